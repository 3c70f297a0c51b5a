"""Tiled VAE decoding with diffusers' ``enable_tiling`` semantics, so large images decode in
bounded memory.

As diffusers' ``AutoencoderKL.tiled_decode``: latents are cut into tiles of
``tile = sample_size / vae_scale_factor`` latent pixels (128 for SDXL) that start every
``int(tile * 0.75)`` pixels, each tile is decoded on its own (``post_quant_conv`` + decoder),
and each decoded tile is blended into the one above and the one to its left over
``int(sample_size * 0.25)`` pixels (linear ramps), then cropped to
``sample_size - blend`` pixels and the crops are concatenated. Blends use tiles already blended
with their own upper and left neighbours, as diffusers' in-place updates do, so the pixels
agree with ``vae.enable_tiling(); vae.decode(...)``.

Each tile shape is one jitted decode (at most four shapes: interior, right edge, bottom edge,
corner), so peak memory is that of one tile's decode plus the output.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

OVERLAP = 0.25  # diffusers' tile_overlap_factor


def tile_sizes(config) -> tuple[int, int, int, int, int]:
    """(latent tile, sample tile, latent stride, blend extent, row limit) for a VAE config."""
    sample = config.sample_size
    sample = int(sample[0] if isinstance(sample, (tuple, list)) else sample)
    latent_tile = int(sample / config.vae_scale_factor)
    stride = int(latent_tile * (1 - OVERLAP))
    blend = int(sample * OVERLAP)
    return latent_tile, sample, stride, blend, sample - blend


def needs_tiling(config, latent_height: int, latent_width: int) -> bool:
    """diffusers' rule once tiling is enabled: a side larger than one tile."""
    latent_tile = tile_sizes(config)[0]
    return latent_height > latent_tile or latent_width > latent_tile


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


def tiled_decode(config, decode_tile: Callable[[jax.Array], jax.Array], z: jax.Array) -> jax.Array:
    """VAE latents (B, h, w, C) -> images (B, h*f, w*f, 3), decoding tile by tile with
    ``decode_tile`` (``post_quant_conv`` + decoder of one tile, NHWC)."""
    latent_tile, _, stride, blend, limit = tile_sizes(config)
    h, w = z.shape[1], z.shape[2]
    rows: list[list[Any]] = []
    for i in range(0, h, stride):
        rows.append([decode_tile(z[:, i:i + latent_tile, j:j + latent_tile])
                     for j in range(0, w, stride)])
    out_rows = []
    for i, row in enumerate(rows):
        crops = []
        for j in range(len(row)):
            tile = row[j]
            if i > 0:
                tile = _blend(rows[i - 1][j], tile, blend, axis=1)
            if j > 0:
                tile = _blend(row[j - 1], tile, blend, axis=2)
            row[j] = tile  # later neighbours blend with this blended tile, as diffusers does
            crops.append(tile[:, :limit, :limit])
        out_rows.append(jnp.concatenate(crops, axis=2))
    return jnp.concatenate(out_rows, axis=1)


def tile_decoder(vae, params) -> Callable[[jax.Array], jax.Array]:
    """A ``decode_tile`` for :func:`tiled_decode`: the module's ``decode``, jitted (one program
    per tile shape)."""
    fn = jax.jit(lambda p, t: vae.apply({"params": p}, t, method="decode"))
    return lambda tile: fn(params, tile)
