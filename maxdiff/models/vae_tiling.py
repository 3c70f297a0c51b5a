"""Tiled VAE decoding and encoding with diffusers' ``enable_tiling`` semantics, so large images
decode and encode in bounded memory.

Decoding, as diffusers' ``AutoencoderKL.tiled_decode``: latents are cut into tiles of
``tile = sample_size / vae_scale_factor`` latent pixels (128 for SDXL) that start every
``int(tile * 0.75)`` pixels, each tile is decoded on its own (``post_quant_conv`` + decoder),
and each decoded tile is blended into the one above and the one to its left over
``int(sample_size * 0.25)`` pixels (linear ramps), then cropped to
``sample_size - blend`` pixels and the crops are concatenated. Blends use tiles already blended
with their own upper and left neighbours, as diffusers' in-place updates do, so the pixels
agree with ``vae.enable_tiling(); vae.decode(...)``.

Encoding, as diffusers' ``_tiled_encode`` (what ``vae.encode`` runs once tiling is enabled and
an image side exceeds ``sample_size``): images are cut into tiles of ``sample_size`` pixels
(1024 for SDXL) that start every ``int(sample_size * 0.75)`` pixels, each tile goes through
the encoder (+ ``quant_conv``), and the tiles' raw moments (mean and log-variance side by side,
before the clamp) are blended the same way over ``int(tile * 0.25)`` latent pixels and cropped
to ``tile - blend`` latent pixels.

Each tile shape is one jitted program (at most four shapes: interior, right edge, bottom edge,
corner), so peak memory is that of one tile plus the tiles' outputs.

:func:`use_tiling` is the pipelines' rule: ``vae_tiling=True`` tiles whenever diffusers would,
``"auto"`` (the default) only images of more than :func:`auto_tile_pixels` pixels:
``AUTO_TILE_AREA`` x ``sample_size²``, and at least ``AUTO_TILE_MIN_PIXELS`` (both give 2.1
megapixels for SDXL, so every size SDXL was trained at stays untiled, as in diffusers; the
floor keeps small models, whose decode needs little memory at any size they are used at,
untiled). The memory this saves is measured in docs/benchmarks.md
(``python -m benchmarks.vae_memory``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

OVERLAP = 0.25  # diffusers' tile_overlap_factor
AUTO_TILE_AREA = 2.0  # "auto" tiles images of more than this many times sample_size² pixels
AUTO_TILE_MIN_PIXELS = 2 * 1024 * 1024  # ... and never images of at most this many pixels


def tile_sizes(config) -> tuple[int, int, int, int, int]:
    """(latent tile, sample tile, latent stride, blend extent, row limit) of the tiled decode
    for a VAE config."""
    sample = config.sample_size
    sample = int(sample[0] if isinstance(sample, (tuple, list)) else sample)
    latent_tile = int(sample / config.vae_scale_factor)
    stride = int(latent_tile * (1 - OVERLAP))
    blend = int(sample * OVERLAP)
    return latent_tile, sample, stride, blend, sample - blend


def needs_tiling(config, latent_height: int, latent_width: int) -> bool:
    """diffusers' decode rule once tiling is enabled: a side larger than one latent tile."""
    latent_tile = tile_sizes(config)[0]
    return latent_height > latent_tile or latent_width > latent_tile


def needs_tiled_encode(config, height: int, width: int) -> bool:
    """diffusers' encode rule once tiling is enabled: an image side larger than
    ``sample_size``."""
    sample = tile_sizes(config)[1]
    return height > sample or width > sample


def check_tiling_setting(setting) -> Any:
    """``"auto"``, True or False (a pipeline's ``vae_tiling``); anything else is a ValueError."""
    if isinstance(setting, str) and setting.lower() == "auto":
        return "auto"
    if isinstance(setting, bool):
        return setting
    raise ValueError(f"vae_tiling={setting!r}; use 'auto' (tile only large images), True "
                     "(tile whenever a side exceeds the VAE's sample_size) or False")


def auto_tile_pixels(config) -> int:
    """The image area (pixels) above which ``vae_tiling="auto"`` tiles: ``AUTO_TILE_AREA`` x
    ``sample_size²``, at least ``AUTO_TILE_MIN_PIXELS`` (2,097,152 for SDXL's VAE)."""
    sample = tile_sizes(config)[1]
    return max(int(AUTO_TILE_AREA * sample * sample), AUTO_TILE_MIN_PIXELS)


def use_tiling(setting, config, height: int, width: int, threshold: int | None = None) -> bool:
    """Whether an image of ``height`` x ``width`` pixels is encoded and decoded tile by tile.

    ``setting`` True: whenever diffusers' ``enable_tiling`` would tile (a side above
    ``sample_size``); False: never; ``"auto"``: when, besides, the image has more than
    ``threshold`` pixels (default :func:`auto_tile_pixels`). The rule looks at the image's
    size only, never at the batch, so an image's pixels do not depend on its batch-mates."""
    setting = check_tiling_setting(setting)
    f = config.vae_scale_factor
    if not getattr(config, "tileable", True):  # the tiny autoencoder decodes whole images
        return False
    if not setting or not needs_tiling(config, height // f, width // f):
        return False
    if setting == "auto":
        return height * width > (auto_tile_pixels(config) if threshold is None else threshold)
    return True


def _blend(a: jax.Array, b: jax.Array, extent: int, axis: int) -> jax.Array:
    """``b``'s first ``extent`` rows (axis 1) or columns (axis 2) ramped in from ``a``'s last."""
    extent = min(a.shape[axis], b.shape[axis], extent)
    if extent <= 0:
        return b
    w = (jnp.arange(extent, dtype=jnp.float32) / extent).astype(b.dtype)
    w = w.reshape((1, extent, 1, 1) if axis == 1 else (1, 1, extent, 1))
    a_end = jax.lax.slice_in_dim(a, a.shape[axis] - extent, a.shape[axis], axis=axis)
    b_start = jax.lax.slice_in_dim(b, 0, extent, axis=axis)
    mixed = a_end * (1 - w) + b_start * w
    return jax.lax.dynamic_update_slice_in_dim(b, mixed, 0, axis=axis)


def _tiled(x: jax.Array, run_tile: Callable[[jax.Array], jax.Array], tile: int, stride: int,
           blend: int, limit: int) -> jax.Array:
    """Cut ``x`` (B, H, W, C) into ``tile``-pixel tiles starting every ``stride`` pixels, run
    each, blend each result into its upper and left neighbours over ``blend`` (output) pixels
    and concatenate the crops of ``limit`` pixels: diffusers' tiled encode and decode."""
    h, w = x.shape[1], x.shape[2]
    rows: list[list[Any]] = []
    for i in range(0, h, stride):
        rows.append([run_tile(x[:, i:i + tile, j:j + tile]) for j in range(0, w, stride)])
    out_rows = []
    for i, row in enumerate(rows):
        crops = []
        for j in range(len(row)):
            t = row[j]
            if i > 0:
                t = _blend(rows[i - 1][j], t, blend, axis=1)
            if j > 0:
                t = _blend(row[j - 1], t, blend, axis=2)
            row[j] = t  # later neighbours blend with this blended tile, as diffusers does
            crops.append(t[:, :limit, :limit])
        out_rows.append(jnp.concatenate(crops, axis=2))
    return jnp.concatenate(out_rows, axis=1)


def tiled_decode(config, decode_tile: Callable[[jax.Array], jax.Array], z: jax.Array) -> jax.Array:
    """VAE latents (B, h, w, C) -> images (B, h*f, w*f, 3), decoding tile by tile with
    ``decode_tile`` (``post_quant_conv`` + decoder of one tile, NHWC)."""
    latent_tile, _, stride, blend, limit = tile_sizes(config)
    return _tiled(z, decode_tile, latent_tile, stride, blend, limit)


def tiled_encode(config, encode_tile: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """Images (B, H, W, 3) in [-1, 1] -> the encoder's moments (B, H/f, W/f, 2 x latent
    channels), encoding tile by tile with ``encode_tile`` (encoder + ``quant_conv`` of one tile,
    NHWC: ``AutoencoderKL.encode_moments``). ``AutoencoderKL.posterior`` turns the moments into
    the posterior, ``AutoencoderKL.moments_to_latents`` into diffusion-space latents."""
    latent_tile, sample, _, _, _ = tile_sizes(config)
    stride = int(sample * (1 - OVERLAP))
    blend = int(latent_tile * OVERLAP)
    return _tiled(x, encode_tile, sample, stride, blend, latent_tile - blend)


def tile_decoder(vae, params) -> Callable[[jax.Array], jax.Array]:
    """A ``decode_tile`` for :func:`tiled_decode`: the module's ``decode``, jitted (one program
    per tile shape)."""
    fn = jax.jit(lambda p, t: vae.apply({"params": p}, t, method="decode"))
    return lambda tile: fn(params, tile)


def tile_encoder(vae, params) -> Callable[[jax.Array], jax.Array]:
    """An ``encode_tile`` for :func:`tiled_encode`: the module's ``encode_moments``, jitted
    (one program per tile shape)."""
    fn = jax.jit(lambda p, t: vae.apply({"params": p}, t, method="encode_moments"))
    return lambda tile: fn(params, tile)
