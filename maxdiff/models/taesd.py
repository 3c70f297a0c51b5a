"""The tiny autoencoder (TAESD / TAESDXL, diffusers' ``AutoencoderTiny``) in Flax. Its decoder
draws an image from the diffusion model's latents at a few percent of the VAE decoder's cost:
the previews ComfyUI and A1111 show (:class:`TinyDecoder`), or, loaded as a pipeline's ``vae=``,
fast final images of lower quality (:class:`TinyAutoencoder`, the VAE's methods).

    decoder: latents (B, h, w, C) as the UNet sees them -> / scaling_factor -> tanh(z / 3) * 3
      -> conv, act -> per block: n x [conv, act, conv, act, conv] + skip, relu;
         nearest 2x upsample (not after the last) ; conv -> image in [-1, 1]
    encoder: image in [-1, 1] -> [0, 1] -> per block: conv (stride 2 after the first, no
      bias), n x block ; conv -> latents, which times scaling_factor are the UNet's

Submodules carry diffusers' ``nn.Sequential`` indices (``layers.0``, ``layers.2.conv.0``, ...)
so ``madebyollin/taesdxl``'s ``diffusion_pytorch_model.safetensors`` loads as it is. NHWC; the
upsample is fused into the next convolution (:class:`maxdiff.models.conv.Conv`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxdiff import checkpoint
from maxdiff.models.conv import Conv

__all__ = ["TinyAutoencoderConfig", "TinyDecoder", "TinyEncoder", "TinyAutoencoder",
           "is_tiny_autoencoder", "load_tiny_decoder", "load_tiny_autoencoder"]

ACTIVATIONS = {"relu": jax.nn.relu, "silu": jax.nn.silu, "swish": jax.nn.silu,
               "gelu": lambda x: jax.nn.gelu(x, approximate=False),
               "mish": lambda x: x * jnp.tanh(jax.nn.softplus(x))}


@dataclass(frozen=True)
class TinyAutoencoderConfig:
    """The fields of diffusers' ``AutoencoderTiny`` config that shape it."""

    in_channels: int = 3
    latent_channels: int = 4
    out_channels: int = 3
    encoder_block_out_channels: tuple[int, ...] = (64, 64, 64, 64)
    num_encoder_blocks: tuple[int, ...] = (1, 3, 3, 3)
    decoder_block_out_channels: tuple[int, ...] = (64, 64, 64, 64)
    num_decoder_blocks: tuple[int, ...] = (3, 3, 3, 1)
    upsampling_scaling_factor: int = 2
    act_fn: str = "relu"
    upsample_fn: str = "nearest"
    scaling_factor: float = 1.0
    shift_factor: float = 0.0

    def __post_init__(self):
        for part in ("encoder", "decoder"):
            if len(getattr(self, f"{part}_block_out_channels")) != len(
                    getattr(self, f"num_{part}_blocks")):
                raise ValueError(f"{part}_block_out_channels and num_{part}_blocks must have "
                                 "the same length")
        if self.act_fn not in ACTIVATIONS:
            raise ValueError(f"act_fn {self.act_fn!r}: one of {', '.join(ACTIVATIONS)}")
        if self.upsample_fn != "nearest" or self.upsampling_scaling_factor != 2:
            raise ValueError("only nearest 2x upsampling (upsample_fn='nearest', "
                             "upsampling_scaling_factor=2) is supported, as every TAESD uses")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TinyAutoencoderConfig:
        if d.get("_class_name", "AutoencoderTiny") != "AutoencoderTiny":
            raise ValueError(f"_class_name {d.get('_class_name')!r}: not an AutoencoderTiny")
        known = {f.name for f in fields(cls)}
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in known}
        return cls(**kw)

    @property
    def scale_factor(self) -> int:
        """Pixels per latent along a side."""
        return 2 ** (len(self.num_decoder_blocks) - 1)

    # what a pipeline reads of its VAE's config: the scale, and that it never tiles (its
    # full-resolution activations have 64 channels, not the VAE decoder's 128-256)
    vae_scale_factor = scale_factor
    tileable = False


def _unscale(c: TinyAutoencoderConfig, latents: jax.Array) -> jax.Array:
    """The diffusion model's latents -> the tiny decoder's input (``/ scaling_factor +
    shift_factor``, as diffusers' pipelines hand latents to ``vae.decode``)."""
    return latents.astype(jnp.float32) / c.scaling_factor + c.shift_factor


class _Block(nn.Module):
    """``AutoencoderTinyBlock``: relu(conv(act(conv(act(conv(x))))) + skip(x))."""

    cin: int
    cout: int
    act: str
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        act = ACTIVATIONS[self.act]
        conv = lambda i: Conv(self.cout, dtype=self.dtype, param_dtype=self.dtype,
                              name=f"conv.{i}")
        h = conv(4)(act(conv(2)(act(conv(0)(x)))))
        skip = x if self.cin == self.cout else Conv(
            self.cout, (1, 1), padding=((0, 0), (0, 0)), use_bias=False, dtype=self.dtype,
            param_dtype=self.dtype, name="skip")(x)
        return jax.nn.relu(h + skip)


class TinyDecoder(nn.Module):
    """``AutoencoderTiny``'s decoder: latents (B, h, w, C) in the diffusion model's space ->
    images (B, H, W, 3) in ~[-1, 1] (``decoder.layers.*`` in the checkpoint)."""

    config: TinyAutoencoderConfig
    dtype: Any = jnp.float32
    unscaled: bool = False  # latents already divided by scaling_factor (the VAE's decode)

    @nn.compact
    def __call__(self, latents: jax.Array) -> jax.Array:
        c = self.config
        act = ACTIVATIONS[c.act_fn]
        z = latents.astype(jnp.float32) if self.unscaled else _unscale(c, latents)
        x = (jnp.tanh(z / 3) * 3).astype(self.dtype)
        chans = c.decoder_block_out_channels
        x = act(Conv(chans[0], dtype=self.dtype, param_dtype=self.dtype, name="layers.0")(x))
        i = 2
        for k, n in enumerate(c.num_decoder_blocks):
            last = k == len(c.num_decoder_blocks) - 1
            ch = chans[k]
            for _ in range(n):
                x = _Block(x.shape[-1], ch, c.act_fn, self.dtype, name=f"layers.{i}")(x)
                i += 1
            if not last:
                i += 1  # the nn.Upsample's index: fused into the next convolution
            conv = Conv(c.out_channels if last else ch, use_bias=last, dtype=self.dtype,
                        param_dtype=self.dtype, name=f"layers.{i}")
            x = conv(x, upsample=not last)
            i += 1
        return x.astype(jnp.float32) * 2 - 1


class TinyEncoder(nn.Module):
    """``AutoencoderTiny``'s encoder: images (B, H, W, 3) in [-1, 1] -> its latents (B, h, w, C),
    not yet times ``scaling_factor`` (``encoder.layers.*`` in the checkpoint)."""

    config: TinyAutoencoderConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        c = self.config
        x = ((images.astype(jnp.float32) + 1) / 2).astype(self.dtype)
        i = 0
        for k, n in enumerate(c.num_encoder_blocks):
            ch = c.encoder_block_out_channels[k]
            x = Conv(ch, strides=(1, 1) if k == 0 else (2, 2), use_bias=k == 0,
                     dtype=self.dtype, param_dtype=self.dtype, name=f"layers.{i}")(x)
            i += 1
            for _ in range(n):
                x = _Block(x.shape[-1], ch, c.act_fn, self.dtype, name=f"layers.{i}")(x)
                i += 1
        x = Conv(c.latent_channels, dtype=self.dtype, param_dtype=self.dtype,
                 name=f"layers.{i}")(x)
        return x.astype(jnp.float32)


class TinyAutoencoder(nn.Module):
    """The whole ``AutoencoderTiny`` with the methods a pipeline calls on its VAE
    (:class:`maxdiff.models.vae.AutoencoderKL`'s), as diffusers' SDXL and SD pipelines use an
    ``AutoencoderTiny`` given as ``vae=``: decode ``latents / scaling_factor``, encode to
    ``scaling_factor * latents``. The encoder is deterministic (no posterior): the key and noise
    arguments are accepted and unused."""

    config: TinyAutoencoderConfig
    dtype: Any = jnp.float32

    def setup(self):
        self.encoder = TinyEncoder(self.config, self.dtype)
        self.decoder = TinyDecoder(self.config, self.dtype, unscaled=True)

    def decode(self, z: jax.Array) -> jax.Array:
        return self.decoder(z)

    def encode_moments(self, x: jax.Array) -> jax.Array:
        return self.encoder(x)

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        return self.decode(self.encoder(x))

    def unscale_latents(self, latents: jax.Array) -> jax.Array:
        return _unscale(self.config, latents)

    def scale_latents(self, z: jax.Array) -> jax.Array:
        c = self.config
        return (z - c.shift_factor) * c.scaling_factor

    def latents_to_image(self, latents: jax.Array) -> jax.Array:
        return self.decode(self.unscale_latents(latents))

    def image_to_latents(self, images: jax.Array, key: jax.Array | None = None,
                         noise: jax.Array | None = None) -> jax.Array:
        return self.scale_latents(self.encoder(images))

    def moments_to_latents(self, moments: jax.Array, key: jax.Array | None = None,
                           noise: jax.Array | None = None) -> jax.Array:
        return self.scale_latents(moments)


def is_tiny_autoencoder(config: Mapping[str, Any]) -> bool:
    """Whether a component's ``config.json`` (a dict) is an ``AutoencoderTiny``'s."""
    return config.get("_class_name") == "AutoencoderTiny"


def _read(folder) -> TinyAutoencoderConfig:
    try:
        return TinyAutoencoderConfig.from_dict(checkpoint.read_config(folder))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{os.fspath(folder)}/config.json: {e}") from None


class _Same:
    """A tensor read as it is stored (the rename protocol of :func:`checkpoint.load_params`)."""

    @staticmethod
    def read(raw):
        return raw


@dataclass
class _OriginalDecoder(checkpoint.WeightSource):
    """A decoder file in the original TAESD layout (``taesdxl_decoder.safetensors``, as
    madebyollin/taesd ships it and ComfyUI keeps it in ``models/vae_approx``): one
    ``nn.Sequential`` whose index 0 is the clamp that diffusers' ``DecoderTiny`` does in its
    forward, so file index ``i + 1`` is diffusers' ``decoder.layers.i``."""

    scope: str = ""

    @staticmethod
    def rename(key: str):
        rest = key.removeprefix("decoder.layers.")
        i, _, tail = rest.partition(".")
        return f"{int(i) + 1}.{tail}", _Same


def _original_decoder_config(source: checkpoint.WeightSource) -> TinyAutoencoderConfig:
    """The decoder's shape read off an original-layout file's keys: ``1`` the first
    convolution (latent channels in), then per level its blocks (``N.conv.0.weight``) up to
    the next convolution (``N.weight``); the last convolution draws the image."""
    keys = set(source.keys())
    index = sorted({int(k.split(".", 1)[0]) for k in keys if k.split(".", 1)[0].isdigit()})
    if "1.weight" not in keys or not any(f"{i}.conv.0.weight" in keys for i in index):
        raise ValueError("not a TAESD decoder in the original layout (no '1.weight' and "
                         "'N.conv.0.weight' keys)")
    blocks, chans, n, ch = [], [], 0, 0
    for i in index[1:]:
        if f"{i}.conv.0.weight" in keys:
            n, ch = n + 1, int(source.lazy(f"{i}.conv.0.weight").shape[0])
        elif f"{i}.weight" in keys:
            if not n:
                raise ValueError(f"convolution {i} follows no block: not a TAESD decoder")
            blocks.append(n)
            chans.append(ch)
            n = 0
    first = source.lazy("1.weight").shape
    last = source.lazy(f"{index[-1]}.weight").shape
    return TinyAutoencoderConfig(latent_channels=int(first[1]), out_channels=int(last[0]),
                                 decoder_block_out_channels=tuple(chans),
                                 num_decoder_blocks=tuple(blocks))


def load_tiny_decoder(path: str | os.PathLike, dtype: Any = "float32", *,
                      variant: str | None = None) -> tuple[TinyDecoder, dict]:
    """Read a tiny decoder: a diffusers ``AutoencoderTiny`` folder (``madebyollin/taesdxl``,
    ``taesd``: a ``config.json`` and safetensors) or a decoder file in the original layout
    (``taesdxl_decoder.safetensors``, ``taesd_decoder.safetensors``: its shape read off its
    keys, ``scaling_factor`` 1 as the diffusers configs have it): ``(decoder module, its
    params)``."""
    target = checkpoint.resolve_dtype(dtype)
    if os.path.isfile(path):
        checkpoint.refuse_pickle(path)
        plain = checkpoint.WeightSource.from_files([path])
        source = _OriginalDecoder(plain.files, plain.index)
        try:
            config = _original_decoder_config(source)
        except ValueError as e:
            raise ValueError(f"{os.fspath(path)}: {e}") from None
    else:
        config, source = _read(path), checkpoint.open_weights(path, variant)
    module = TinyDecoder(config, dtype=jnp.dtype(target))
    shapes = checkpoint.init_shapes(module, jax.ShapeDtypeStruct(
        (1, 8, 8, config.latent_channels), jnp.float32))
    return module, checkpoint.load_params(shapes, source, target, key_prefix="decoder.")


def load_tiny_autoencoder(folder: str | os.PathLike, dtype: Any = "float32", *,
                          variant: str | None = None, put=None
                          ) -> tuple[TinyAutoencoder, dict]:
    """Read a diffusers ``AutoencoderTiny`` folder whole (encoder and decoder) as a pipeline's
    VAE: ``(module, its params)``, placed by ``put`` where given."""
    target = checkpoint.resolve_dtype(dtype)
    config = _read(folder)
    module = TinyAutoencoder(config, dtype=jnp.dtype(target))
    f = config.scale_factor
    shapes = checkpoint.init_shapes(module, jax.ShapeDtypeStruct(
        (1, 8 * f, 8 * f, config.in_channels), jnp.float32))
    return module, checkpoint.load_params(shapes, checkpoint.open_weights(folder, variant),
                                          target, put=put)
