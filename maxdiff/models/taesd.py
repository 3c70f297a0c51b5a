"""The tiny autoencoder's decoder (TAESD / TAESDXL, diffusers' ``AutoencoderTiny``) in Flax: a
preview decoder that draws an image from the diffusion model's latents at a few percent of the
VAE decoder's cost (ComfyUI's and A1111's live previews use it).

    latents (B, h, w, C) as the UNet sees them -> / scaling_factor -> tanh(z / 3) * 3
      -> conv, act -> per block: n x [conv, act, conv, act, conv] + skip, relu;
         nearest 2x upsample (not after the last) ; conv -> image in [-1, 1]

Submodules carry diffusers' ``nn.Sequential`` indices (``layers.0``, ``layers.2.conv.0``, ...)
so ``madebyollin/taesdxl``'s ``diffusion_pytorch_model.safetensors`` loads as it is (its
encoder's tensors are not read). NHWC; the upsample is fused into the next convolution
(:class:`maxdiff.models.conv.Conv`).
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

__all__ = ["TinyDecoderConfig", "TinyDecoder", "load_tiny_decoder"]

ACTIVATIONS = {"relu": jax.nn.relu, "silu": jax.nn.silu, "swish": jax.nn.silu,
               "gelu": lambda x: jax.nn.gelu(x, approximate=False),
               "mish": lambda x: x * jnp.tanh(jax.nn.softplus(x))}


@dataclass(frozen=True)
class TinyDecoderConfig:
    """The fields of diffusers' ``AutoencoderTiny`` config that shape its decoder."""

    latent_channels: int = 4
    out_channels: int = 3
    decoder_block_out_channels: tuple[int, ...] = (64, 64, 64, 64)
    num_decoder_blocks: tuple[int, ...] = (3, 3, 3, 1)
    upsampling_scaling_factor: int = 2
    act_fn: str = "relu"
    upsample_fn: str = "nearest"
    scaling_factor: float = 1.0
    shift_factor: float = 0.0

    def __post_init__(self):
        if len(self.decoder_block_out_channels) != len(self.num_decoder_blocks):
            raise ValueError("decoder_block_out_channels and num_decoder_blocks must have the "
                             "same length")
        if self.act_fn not in ACTIVATIONS:
            raise ValueError(f"act_fn {self.act_fn!r}: one of {', '.join(ACTIVATIONS)}")
        if self.upsample_fn != "nearest" or self.upsampling_scaling_factor != 2:
            raise ValueError("only nearest 2x upsampling (upsample_fn='nearest', "
                             "upsampling_scaling_factor=2) is supported, as every TAESD uses")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TinyDecoderConfig:
        if d.get("_class_name", "AutoencoderTiny") != "AutoencoderTiny":
            raise ValueError(f"_class_name {d.get('_class_name')!r}: not an AutoencoderTiny")
        known = {f.name for f in fields(cls)}
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in known}
        return cls(**kw)

    @property
    def scale_factor(self) -> int:
        """Pixels per latent along a side."""
        return 2 ** (len(self.num_decoder_blocks) - 1)


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

    config: TinyDecoderConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, latents: jax.Array) -> jax.Array:
        c = self.config
        act = ACTIVATIONS[c.act_fn]
        z = latents.astype(jnp.float32) / c.scaling_factor + c.shift_factor
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


def load_tiny_decoder(folder: str | os.PathLike, dtype: Any = "float32", *,
                      variant: str | None = None) -> tuple[TinyDecoder, dict]:
    """Read a diffusers ``AutoencoderTiny`` folder (``madebyollin/taesdxl``, ``taesd``: a
    ``config.json`` and safetensors): ``(decoder module, its params)``."""
    target = checkpoint.resolve_dtype(dtype)
    raw = checkpoint.read_config(folder)
    try:
        config = TinyDecoderConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{os.fspath(folder)}/config.json: {e}") from None
    module = TinyDecoder(config, dtype=jnp.dtype(target))
    shapes = checkpoint.init_shapes(module, jax.ShapeDtypeStruct(
        (1, 8, 8, config.latent_channels), jnp.float32))
    source = checkpoint.open_weights(folder, variant)
    return module, checkpoint.load_params(shapes, source, target, key_prefix="decoder.")
