"""The SDXL-family VAE: diffusers' ``AutoencoderKL`` (encoder, decoder, KL posterior) in Flax.

Layout is NHWC: images are (B, H, W, C) with values in [-1, 1]; latents are
(B, H/f, W/f, latent_channels) with ``f = config.vae_scale_factor`` (8 for SD/SDXL).
Submodules carry diffusers' PyTorch names (``encoder.down_blocks.0.resnets.1.conv2``,
``decoder.mid_block.attentions.0.to_q``, ``quant_conv``), so :func:`load_vae` fills
every parameter with :func:`maxdiff.checkpoint.load_params` and no key map.

Use::

    vae, params = load_vae("sdxl/vae", dtype="bfloat16")   # float16: fp32 if force_upcast
    images = vae.apply({"params": params}, latents, method="latents_to_image")
    latents = vae.apply({"params": params}, images, key, method="image_to_latents")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from maxdiff.checkpoint import (
    CheckpointError,
    init_shapes,
    load_params,
    open_weights,
    read_config,
    resolve_dtype,
)
from maxdiff.models.attention import DEFAULT_CHUNK, KERNELS, Attention
from maxdiff.models.layers import Downsample2D, ResnetBlock2D, Upsample2D, conv, group_norm

__all__ = [
    "AutoencoderKLConfig",
    "DiagonalGaussian",
    "Encoder",
    "Decoder",
    "AutoencoderKL",
    "param_shapes",
    "load_vae",
]

DOWN_BLOCK_TYPES = ("DownEncoderBlock2D",)
UP_BLOCK_TYPES = ("UpDecoderBlock2D",)
ACT_FNS = ("silu", "swish")  # both are SiLU in diffusers
EPS = 1e-6  # diffusers hard-codes this for every norm of the VAE


@dataclass(frozen=True)
class AutoencoderKLConfig:
    """diffusers' ``AutoencoderKL`` constructor arguments (its ``config.json``), checked.

    ``scaling_factor`` / ``shift_factor`` / ``latents_mean`` / ``latents_std`` map VAE
    latents to the diffusion model's latent space (see :meth:`AutoencoderKL.latents_to_image`);
    ``force_upcast`` says the model is not safe in half precision (see :func:`load_vae`).
    """

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",)
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",)
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    act_fn: str = "silu"
    latent_channels: int = 4
    norm_num_groups: int = 32
    sample_size: int | tuple[int, ...] = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    force_upcast: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    def __post_init__(self):
        for name in ("down_block_types", "up_block_types", "block_out_channels", "latents_mean",
                     "latents_std", "sample_size"):
            v = getattr(self, name)
            if isinstance(v, list):
                object.__setattr__(self, name, tuple(v))
        self._validate()

    def _validate(self) -> None:
        def bad(field: str, value: Any, allowed: str) -> ValueError:
            return ValueError(
                f"AutoencoderKL config: {field}={value!r} is not supported; {allowed}")

        n = len(self.block_out_channels)
        if n == 0 or any(int(c) <= 0 for c in self.block_out_channels):
            raise bad("block_out_channels", self.block_out_channels,
                      "give one positive channel count per resolution level")
        for field, types, allowed in (("down_block_types", self.down_block_types, DOWN_BLOCK_TYPES),
                                      ("up_block_types", self.up_block_types, UP_BLOCK_TYPES)):
            if len(types) != n:
                raise bad(field, types, f"it needs {n} entries, one per block_out_channels entry")
            for i, t in enumerate(types):
                if t not in allowed:
                    raise bad(f"{field}[{i}]", t, f"allowed: {', '.join(allowed)}")
        if self.act_fn not in ACT_FNS:
            raise bad("act_fn", self.act_fn, f"allowed: {', '.join(ACT_FNS)}")
        if self.layers_per_block < 1:
            raise bad("layers_per_block", self.layers_per_block, "it must be at least 1")
        g = self.norm_num_groups
        if g < 1 or any(c % g for c in self.block_out_channels):
            raise bad("norm_num_groups", self.norm_num_groups,
                      f"it must divide every block_out_channels entry {self.block_out_channels}")
        for field in ("latents_mean", "latents_std"):
            v = getattr(self, field)
            if v is not None and len(v) != self.latent_channels:
                raise bad(field, v, f"it needs latent_channels={self.latent_channels} entries")
        if (self.latents_mean is None) != (self.latents_std is None):
            raise ValueError("AutoencoderKL config: latents_mean and latents_std must be given "
                             "together (or both null)")
        if not self.scaling_factor:
            raise bad("scaling_factor", self.scaling_factor, "it must be non-zero")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AutoencoderKLConfig:
        """Build from a diffusers ``config.json`` dict; ``_``-prefixed metadata is skipped.

        Unknown keys raise ValueError (a newer diffusers option we may not implement).
        """
        cls_name = d.get("_class_name", "AutoencoderKL")
        if cls_name != "AutoencoderKL":
            raise ValueError(f"config _class_name={cls_name!r}: only AutoencoderKL is supported "
                             "(not AutoencoderTiny or other autoencoders)")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if not k.startswith("_") and k not in known)
        if unknown:
            raise ValueError(f"AutoencoderKL config: unknown key(s) {', '.join(unknown)}; "
                             f"supported keys: {', '.join(sorted(known))}")
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def vae_scale_factor(self) -> int:
        """Image pixels per latent pixel along each side (8 for SD / SDXL)."""
        return 2 ** (len(self.block_out_channels) - 1)


@flax.struct.dataclass
class DiagonalGaussian:
    """The encoder's posterior: per-element normal with ``mean`` and ``logvar`` (NHWC).

    ``logvar`` is already clamped to [-30, 20] as in diffusers.
    """

    mean: jax.Array
    logvar: jax.Array

    @property
    def std(self) -> jax.Array:
        return jnp.exp(0.5 * self.logvar)

    def sample(self, key: jax.Array) -> jax.Array:
        """``mean + std * eps`` with ``eps ~ N(0, 1)`` drawn from ``key``."""
        eps = jax.random.normal(key, self.mean.shape, jnp.float32).astype(self.mean.dtype)
        return self.mean + self.std * eps

    def mode(self) -> jax.Array:
        return self.mean


class MidBlock(nn.Module):
    """diffusers' ``UNetMidBlock2D`` as the VAE uses it: resnet, (attention, resnet) with one
    attention layer of a single head spanning all channels, no time embedding.

    The attention is diffusers' ``Attention`` with ``group_norm`` and a residual connection;
    its norm is named ``attentions.0.group_norm`` here, beside the ``attentions.0`` projections,
    so both land on their PyTorch keys. x: (B, H, W, C) -> (B, H, W, C).
    """

    channels: int
    groups: int
    add_attention: bool = True
    attention_kernel: str = "auto"
    attention_chunk: int = DEFAULT_CHUNK
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.channels
        x = ResnetBlock2D(c, c, groups=self.groups, eps=EPS, dtype=self.dtype, name="resnets.0")(x)
        if self.add_attention:
            b, h, w, _ = x.shape
            y = group_norm(self.groups, EPS, "attentions.0.group_norm", self.dtype)(x)
            y = Attention(c, heads=1, dim_head=c, qkv_bias=True, kernel=self.attention_kernel,
                          chunk_size=self.attention_chunk, dtype=self.dtype,
                          name="attentions.0")(y.reshape(b, h * w, c))
            x = x + y.reshape(b, h, w, c)
        return ResnetBlock2D(c, c, groups=self.groups, eps=EPS, dtype=self.dtype,
                             name="resnets.1")(x)


class DownEncoderBlock2D(nn.Module):
    """``num_layers`` resnets, then an optional stride-2 conv (bottom/right padded)."""

    in_channels: int
    out_channels: int
    num_layers: int
    groups: int
    add_downsample: bool
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for j in range(self.num_layers):
            cin = self.in_channels if j == 0 else self.out_channels
            x = ResnetBlock2D(cin, self.out_channels, groups=self.groups, eps=EPS,
                              dtype=self.dtype, name=f"resnets.{j}")(x)
        if self.add_downsample:
            x = Downsample2D(self.out_channels, padding=0, dtype=self.dtype,
                             name="downsamplers.0")(x)
        return x


class UpDecoderBlock2D(nn.Module):
    """``num_layers`` resnets, then an optional nearest 2x upsample and 3x3 conv."""

    in_channels: int
    out_channels: int
    num_layers: int
    groups: int
    add_upsample: bool
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for j in range(self.num_layers):
            cin = self.in_channels if j == 0 else self.out_channels
            x = ResnetBlock2D(cin, self.out_channels, groups=self.groups, eps=EPS,
                              dtype=self.dtype, name=f"resnets.{j}")(x)
        if self.add_upsample:
            x = Upsample2D(self.out_channels, dtype=self.dtype, name="upsamplers.0")(x)
        return x


class Encoder(nn.Module):
    """Image (B, H, W, in_channels) -> posterior moments (B, H/f, W/f, 2 * latent_channels)."""

    config: AutoencoderKLConfig
    attention_kernel: str = "auto"
    attention_chunk: int = DEFAULT_CHUNK
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, dt = self.config, self.dtype
        ch = cfg.block_out_channels
        x = conv(ch[0], "conv_in", dt)(x)
        cin = ch[0]
        for i, cout in enumerate(ch):
            x = DownEncoderBlock2D(cin, cout, cfg.layers_per_block, cfg.norm_num_groups,
                                   add_downsample=i < len(ch) - 1, dtype=dt,
                                   name=f"down_blocks.{i}")(x)
            cin = cout
        x = MidBlock(ch[-1], cfg.norm_num_groups, cfg.mid_block_add_attention,
                     self.attention_kernel, self.attention_chunk, dt, name="mid_block")(x)
        x = nn.silu(group_norm(cfg.norm_num_groups, EPS, "conv_norm_out", dt)(x))
        return conv(2 * cfg.latent_channels, "conv_out", dt)(x)


class Decoder(nn.Module):
    """Latents (B, h, w, latent_channels) -> image (B, h*f, w*f, out_channels)."""

    config: AutoencoderKLConfig
    attention_kernel: str = "auto"
    attention_chunk: int = DEFAULT_CHUNK
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        cfg, dt = self.config, self.dtype
        ch = cfg.block_out_channels[::-1]
        x = conv(ch[0], "conv_in", dt)(z)
        x = MidBlock(ch[0], cfg.norm_num_groups, cfg.mid_block_add_attention,
                     self.attention_kernel, self.attention_chunk, dt, name="mid_block")(x)
        cin = ch[0]
        for i, cout in enumerate(ch):
            x = UpDecoderBlock2D(cin, cout, cfg.layers_per_block + 1, cfg.norm_num_groups,
                                 add_upsample=i < len(ch) - 1, dtype=dt,
                                 name=f"up_blocks.{i}")(x)
            cin = cout
        x = nn.silu(group_norm(cfg.norm_num_groups, EPS, "conv_norm_out", dt)(x))
        return conv(cfg.out_channels, "conv_out", dt)(x)


class AutoencoderKL(nn.Module):
    """diffusers' ``AutoencoderKL``. ``dtype`` is the computation (and parameter) dtype;
    inputs are cast to it. ``attention_kernel`` picks the mid-block attention kernel
    (:mod:`maxdiff.models.attention`); ``"chunked"`` keeps the 1-head score matrix of a
    1024x1024 image (16384 tokens) from being materialised whole.

    Methods (call with ``module.apply({"params": p}, ..., method="name")``):
    ``encode(x) -> DiagonalGaussian``, ``encode_moments(x)``, ``decode(z) -> image``,
    ``latents_to_image(latents)``, ``image_to_latents(x, key=None, noise=None)``,
    ``moments_to_latents(moments, key=None, noise=None)``, and
    ``__call__(x, key=None)`` = encode, sample (or mode without a key), decode.
    """

    config: AutoencoderKLConfig
    attention_kernel: str = "auto"
    attention_chunk: int = DEFAULT_CHUNK
    dtype: Any = jnp.float32

    def setup(self):
        cfg, dt = self.config, self.dtype
        if self.attention_kernel not in KERNELS:
            raise ValueError(f"attention_kernel={self.attention_kernel!r} is unknown; use one of "
                             f"{', '.join(KERNELS)}")
        kernel, chunk = self.attention_kernel, self.attention_chunk
        self.encoder = Encoder(cfg, kernel, chunk, dt, name="encoder")
        self.decoder = Decoder(cfg, kernel, chunk, dt, name="decoder")
        lc = cfg.latent_channels
        self.quant_conv = (conv(2 * lc, "quant_conv", dt, kernel=1, padding=0)
                           if cfg.use_quant_conv else None)
        self.post_quant_conv = (conv(lc, "post_quant_conv", dt, kernel=1, padding=0)
                                if cfg.use_post_quant_conv else None)

    def encode(self, x: jax.Array) -> DiagonalGaussian:
        """Images (B, H, W, in_channels) in [-1, 1] -> posterior, (B, H/f, W/f, latent_channels)."""
        return self.posterior(self.encode_moments(x))

    def encode_moments(self, x: jax.Array) -> jax.Array:
        """Images -> the encoder's raw output (B, H/f, W/f, 2 * latent_channels): mean and
        log-variance side by side, before the clamp (what diffusers' tiled encode blends)."""
        h = self.encoder(x.astype(self.dtype))
        if self.quant_conv is not None:
            h = self.quant_conv(h)
        return h

    @staticmethod
    def posterior(moments: jax.Array) -> DiagonalGaussian:
        """:meth:`encode_moments`' output -> the posterior (log-variance clamped to [-30, 20])."""
        mean, logvar = jnp.split(moments, 2, axis=-1)
        return DiagonalGaussian(mean, jnp.clip(logvar, -30.0, 20.0))

    def decode(self, z: jax.Array) -> jax.Array:
        """VAE latents (B, h, w, latent_channels) -> images (B, h*f, w*f, out_channels)."""
        z = z.astype(self.dtype)
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        posterior = self.encode(x)
        z = posterior.mode() if key is None else posterior.sample(key)
        return self.decode(z)

    def _moments(self) -> tuple[jax.Array | None, jax.Array | None]:
        cfg = self.config
        if cfg.latents_mean is None or cfg.latents_std is None:
            return None, None
        return (jnp.asarray(cfg.latents_mean, jnp.float32).reshape(1, 1, 1, -1),
                jnp.asarray(cfg.latents_std, jnp.float32).reshape(1, 1, 1, -1))

    def latents_to_image(self, latents: jax.Array) -> jax.Array:
        """Diffusion-space latents (B, h, w, C) -> decoded images (B, h*f, w*f, 3) in ~[-1, 1].

        As diffusers' pipelines before ``vae.decode``: with ``latents_mean``/``latents_std``
        in the config (SDXL pipeline), ``latents * std / scaling_factor + mean``; otherwise
        ``latents / scaling_factor + shift_factor`` (shift 0 when null; the SD3 formula).
        The arithmetic runs in float32, the decode in ``self.dtype``. Images are not clipped.
        """
        return self.decode(self.unscale_latents(latents))

    def unscale_latents(self, latents: jax.Array) -> jax.Array:
        """Diffusion-space latents -> VAE latents (float32): the first half of
        :meth:`latents_to_image`, for decoding elsewhere (tiled, :mod:`maxdiff.models.vae_tiling`)."""
        cfg = self.config
        z = latents.astype(jnp.float32)
        mean, std = self._moments()
        if mean is not None:
            return z * std / cfg.scaling_factor + mean
        return z / cfg.scaling_factor + (cfg.shift_factor or 0.0)

    def image_to_latents(self, images: jax.Array, key: jax.Array | None = None,
                         noise: jax.Array | None = None) -> jax.Array:
        """Images (B, H, W, 3) in [-1, 1] -> diffusion-space latents (B, H/f, W/f, C), float32.

        The inverse of :meth:`latents_to_image` (diffusers' img2img pipelines): a posterior
        sample ``mean + std * noise`` (``noise``: standard normal, shaped like the latents;
        else drawn with ``key``; the posterior mean when both are None), then
        ``(z - mean) * scaling_factor / std`` or ``(z - shift_factor) * scaling_factor``.
        """
        return self.moments_to_latents(self.encode_moments(images), key, noise)

    def moments_to_latents(self, moments: jax.Array, key: jax.Array | None = None,
                           noise: jax.Array | None = None) -> jax.Array:
        """:meth:`image_to_latents` from the encoder's output (:meth:`encode_moments`, or
        :func:`maxdiff.models.vae_tiling.tiled_encode`'s)."""
        posterior = self.posterior(moments)
        if noise is not None:
            z = posterior.mean + posterior.std * noise.astype(posterior.mean.dtype)
        else:
            z = posterior.mode() if key is None else posterior.sample(key)
        return self.scale_latents(z)

    def scale_latents(self, z: jax.Array) -> jax.Array:
        """VAE latents -> diffusion-space latents (float32): the inverse of
        :meth:`unscale_latents`."""
        cfg = self.config
        z = z.astype(jnp.float32)
        mean, std = self._moments()
        if mean is not None:
            return (z - mean) * cfg.scaling_factor / std
        return (z - (cfg.shift_factor or 0.0)) * cfg.scaling_factor


def param_shapes(model: AutoencoderKL) -> dict:
    """The model's parameter tree as ``jax.ShapeDtypeStruct`` leaves (no computation)."""
    f = model.config.vae_scale_factor
    x = jax.ShapeDtypeStruct((1, f, f, model.config.in_channels), jnp.float32)
    return init_shapes(model, x)


def load_vae(folder: str | Path, dtype: Any = "float32", *, variant: str | None = None,
             attention_kernel: str = "auto",
             attention_chunk: int = DEFAULT_CHUNK, put=None, config: dict | None = None,
             source=None) -> tuple[AutoencoderKL, dict]:
    """Load a diffusers ``AutoencoderKL`` folder (``config.json`` + safetensors weights).

    ``folder`` is the VAE component folder, or a pipeline folder holding ``vae/``, or a
    single ``.safetensors`` VAE file (original or diffusers keys, e.g. ``sdxl_vae.safetensors``)
    together with ``config`` (a diffusers VAE config dict). ``source``: the weights, already
    opened (a :mod:`maxdiff.single_file` model).
    ``dtype`` ("float32", "bfloat16", "float16") is the parameter and computation dtype,
    except that when the config sets ``force_upcast`` (SDXL's VAE does: it overflows in
    float16) a float16 request is overridden, as diffusers does: the parameters are loaded and
    the model computes in float32. bfloat16 (float32's range) is kept: measured against
    float32, bf16 decodes are 51.9 dB PSNR (the embedded model's VAE) and 52.1 dB (SDXL's VAE
    config, random weights) on uint8 pixels, above the 40 dB set before measuring
    (docs/performance.md). Check ``module.dtype`` to see what was chosen; latents of any
    dtype may be passed in, they are cast on entry.

    ``put`` places each array (default ``jax.device_put``; pass a sharded put for a mesh).
    Returns ``(module, params)``; use ``module.apply({"params": params}, ..., method=...)``.
    Missing, unexpected or mis-shaped weights raise
    :class:`maxdiff.checkpoint.CheckpointError` naming the file and key.
    """
    if attention_kernel not in KERNELS:
        raise ValueError(f"attention_kernel={attention_kernel!r}; use one of {', '.join(KERNELS)}")
    folder = Path(folder)
    if (folder / "model_index.json").is_file() and (folder / "vae" / "config.json").is_file():
        folder = folder / "vae"
    if config is None:
        if folder.is_file():
            raise CheckpointError(f"{folder}: a single-file VAE needs config= (the model's "
                                  "vae/config.json)")
        config = read_config(folder)
    if source is None and folder.is_file():
        raise CheckpointError(f"{folder}: a single file; load it with maxdiff.loaders.load_vae, "
                              "which reads its keys (diffusers or the original layout)")
    config = AutoencoderKLConfig.from_dict(config)
    dt = resolve_dtype(dtype)
    if config.force_upcast and dt == np.dtype("float16"):
        dt = np.dtype("float32")
    model = AutoencoderKL(config, dtype=jnp.dtype(dt), attention_kernel=attention_kernel,
                          attention_chunk=attention_chunk)
    params = load_params(param_shapes(model), source or open_weights(folder, variant), dt, put=put)
    return model, params
