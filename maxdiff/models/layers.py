"""Building blocks shared by the UNet and the VAE: ResNet blocks, down/upsamplers, group norm.

Layout is NHWC throughout. Submodules carry the PyTorch names of diffusers' modules
(``norm1``, ``conv1``, ``time_emb_proj``, ...) so checkpoints map onto them by name
(see :mod:`maxdiff.checkpoint`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import flax.linen as nn

from maxdiff.models.conv import Conv


def group_norm(groups: int, eps: float, name: str, dtype: Any) -> nn.GroupNorm:
    """torch.nn.GroupNorm over the channel (last) axis; statistics in float32.

    Two-pass variance (``use_fast_variance=False``): flax's default E[x^2] - E[x]^2 loses
    most digits when a group's mean is large against its spread (VAE decoder activations
    reach the hundreds); measured at mean 1000, std 1: error 8.3 (fast), 0.82 (torch),
    3e-4 (two-pass), at no measurable cost in speed.
    """
    return nn.GroupNorm(num_groups=groups, epsilon=eps, dtype=dtype, param_dtype=dtype,
                        use_fast_variance=False, name=name)


def conv(features: int, name: str, dtype: Any, kernel: int = 3, stride: int = 1,
         padding: int | tuple = 1) -> Conv:
    """A 2-D convolution with torch's symmetric integer padding (or explicit pairs); 3x3 ones
    use the faster CPU algorithms of :mod:`maxdiff.models.conv` where they apply."""
    if isinstance(padding, int):
        padding = ((padding, padding), (padding, padding))
    return Conv(features, (kernel, kernel), strides=(stride, stride),
                padding=tuple(map(tuple, padding)), dtype=dtype, param_dtype=dtype, name=name)


def dense(features: int, name: str, dtype: Any, use_bias: bool = True) -> nn.Dense:
    return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=dtype, name=name)


class ResnetBlock2D(nn.Module):
    """diffusers' ResnetBlock2D ("default" time-embedding norm, SiLU).

    x: (B, H, W, C_in), temb: (B, T) or None -> (B, H, W, C_out).
    """

    in_channels: int
    out_channels: int
    temb_channels: int | None = None
    groups: int = 32
    eps: float = 1e-6
    output_scale_factor: float = 1.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, temb: jax.Array | None = None) -> jax.Array:
        h = group_norm(self.groups, self.eps, "norm1", self.dtype)(x)
        h = nn.silu(h)
        h = conv(self.out_channels, "conv1", self.dtype)(h)
        if self.temb_channels is not None:
            t = dense(self.out_channels, "time_emb_proj", self.dtype)(nn.silu(temb))
            h = h + t[:, None, None, :]
        h = group_norm(self.groups, self.eps, "norm2", self.dtype)(h)
        h = nn.silu(h)
        h = conv(self.out_channels, "conv2", self.dtype)(h)
        if self.in_channels != self.out_channels:
            x = conv(self.out_channels, "conv_shortcut", self.dtype, kernel=1, padding=0)(x)
        out = x + h
        if self.output_scale_factor != 1.0:
            out = out / self.output_scale_factor
        return out


class Downsample2D(nn.Module):
    """Strided 3x3 convolution. ``padding=0`` is the VAE encoder's variant: pad one
    row/column at the bottom/right first, as diffusers does."""

    out_channels: int
    padding: int = 1
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        pad = ((1, 1), (1, 1)) if self.padding == 1 else ((0, 1), (0, 1))
        return conv(self.out_channels, "conv", self.dtype, stride=2, padding=pad)(x)


class Upsample2D(nn.Module):
    """Nearest-neighbour 2x upsampling, then a 3x3 convolution (on CPU computed from the
    low-resolution input directly, see :func:`maxdiff.models.conv.upsample2x_conv3x3`)."""

    out_channels: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, output_size: tuple[int, int] | None = None) -> jax.Array:
        b, h, w, c = x.shape
        oh, ow = output_size or (2 * h, 2 * w)
        if (oh, ow) == (2 * h, 2 * w):
            return conv(self.out_channels, "conv", self.dtype)(x, upsample=True)
        # torch nearest: src = floor(dst * in / out)
        x = x[:, (jnp.arange(oh) * h) // oh][:, :, (jnp.arange(ow) * w) // ow]
        return conv(self.out_channels, "conv", self.dtype)(x)
