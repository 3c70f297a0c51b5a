"""2-D convolutions, with two CPU algorithms that do fewer multiplications than XLA's direct one.

:class:`Conv` is a drop-in for ``flax.linen.Conv`` (same ``kernel`` (kh, kw, in, out) and
``bias`` parameters, NHWC) that picks, at trace time, how to compute a 3x3 convolution:

- **Winograd F(2x2, 3x3)** (Lavin & Gray 2015, "Fast Algorithms for Convolutional Neural
  Networks"): each 4x4 input tile is transformed (``Bᵀ d B``), multiplied channel-wise by the
  transformed kernel (``G g Gᵀ``, 16 matmuls over the input channels) and transformed back
  (``Aᵀ m A``) into a 2x2 output tile: 16 multiplications per 4 outputs instead of 36. The
  tiles of two image rows at a time are processed in a loop, so the transformed tiles stay in
  cache (all at once, memory traffic ate the gain). Used on CPU for float32 inputs with at least
  ``WINOGRAD_MIN_CHANNELS`` input channels and even sides, where it measured 1.2-1.8x faster
  than XLA's convolution (``benchmarks/compare.py``, docs/benchmarks.md); relative error about
  1e-6.
- **Sub-pixel nearest upsampling** (``upsample=True``): nearest 2x upsampling followed by a 3x3
  convolution equals four 2x2 convolutions of the low-resolution input (one per output phase,
  with the 3x3 taps that land on the same source pixel summed), interleaved: 16 instead of 36
  multiplications per 4 outputs, and the upsampled tensor is never built.

Everything else (other kernel sizes, strides, accelerators, half precision) is XLA's
``conv_general_dilated``. ``MAXDIFF_CONV=xla`` turns the CPU algorithms off (for A/B
measurements); the default ``auto`` uses them on CPU only.
"""

from __future__ import annotations

import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

WINOGRAD_MIN_CHANNELS = 256
WINOGRAD_MIN_PIXELS = 1024  # h * w below which the loop overhead outweighs the gain (measured)
_DN = ("NHWC", "HWIO", "NHWC")
# Winograd F(2x2, 3x3) kernel transform G (4x3), and G g Gᵀ as one (16, 9) map of the 9 taps
_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], np.float32)
_GG = np.einsum("ia,jb->ijab", _G, _G).reshape(16, 9)
# sub-pixel phases: which 3x3 taps fall on low-resolution offsets (-1, 0) (phase 0) or (0, +1)
_PHASE = np.array([[[1, 0, 0], [0, 1, 1]], [[1, 1, 0], [0, 0, 1]]], np.float32)
# per output phase (py, px): the (4, 9) map from 3x3 taps to the 2x2 taps of that phase
_PHASE_TAPS = np.einsum("yia,xjb->yxijab", _PHASE, _PHASE).reshape(2, 2, 4, 9)


def fast_cpu_convs() -> bool:
    """Whether the CPU algorithms are on: ``MAXDIFF_CONV`` is ``auto`` (default) and JAX's
    default backend is the CPU."""
    mode = os.environ.get("MAXDIFF_CONV", "auto").lower()
    if mode not in ("auto", "xla"):
        raise ValueError(f"MAXDIFF_CONV={mode!r}; use auto or xla")
    return mode == "auto" and jax.default_backend() == "cpu"


def xla_conv(x: jax.Array, kernel: jax.Array, strides=(1, 1), padding=((1, 1), (1, 1))):
    return jax.lax.conv_general_dilated(x, kernel, strides, padding, dimension_numbers=_DN)


def winograd_weights(kernel: jax.Array) -> jax.Array:
    """(3, 3, in, out) -> the transformed kernel ``G g Gᵀ``, (16, in, out)."""
    cin, cout = kernel.shape[2:]
    u = jnp.dot(_GG, kernel.astype(jnp.float32).reshape(9, cin * cout))  # one small matmul
    return u.reshape(16, cin, cout)


def _tiles_in(xs: jax.Array) -> jax.Array:
    """(B, 2R+2, 2T+2, C) padded rows -> Bᵀ d B of every 4x4 tile (stride 2): (16, B*R*T, C)."""
    b, hp, wp, c = xs.shape
    r, t = (hp - 2) // 2, (wp - 2) // 2
    d = [[xs[:, i:i + 2 * r:2, j:j + 2 * t:2, :] for j in range(4)] for i in range(4)]

    def bt(v):  # Bᵀ along one tile axis: [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]
        return [v[0] - v[2], v[1] + v[2], v[2] - v[1], v[1] - v[3]]

    cols = [bt([d[i][j] for i in range(4)]) for j in range(4)]  # Bᵀ d: cols[j][k]
    out = [e for k in range(4) for e in bt([cols[j][k] for j in range(4)])]  # (Bᵀ d) B
    return jnp.stack(out).reshape(16, b * r * t, c)


def _tiles_out(m: jax.Array, b: int, r: int, t: int) -> jax.Array:
    """(16, B*R*T, O) -> Aᵀ m A per tile, interleaved into (B, 2R, 2T, O)."""
    m = m.reshape(4, 4, b, r, t, -1)

    def at(v):  # Aᵀ = [[1, 1, 1, 0], [0, 1, -1, -1]] along one tile axis
        return v[0] + v[1] + v[2], v[1] - v[2] - v[3]

    s0, s1 = at(m)
    (y00, y01), (y10, y11) = at(s0), at(s1)
    y = jnp.stack([jnp.stack([y00, y01], 3), jnp.stack([y10, y11], 3)], 2)  # b,r,2,t,2,o
    return y.reshape(b, 2 * r, 2 * t, -1)


def winograd_conv3x3(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """3x3 convolution, stride 1, zero padding 1, NHWC, by Winograd F(2x2, 3x3). Height and
    width must be even. Two output rows (one row of tiles) per loop iteration."""
    b, h, w, c = x.shape
    if h % 2 or w % 2:
        raise ValueError(f"winograd_conv3x3 needs even sides, got {h}x{w}")
    u = winograd_weights(kernel)
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (1, 1), (1, 1), (0, 0)))
    out0 = jnp.zeros((b, h, w, kernel.shape[-1]), jnp.float32)

    def band(i, out):
        xs = jax.lax.dynamic_slice(xp, (0, 2 * i, 0, 0), (b, 4, w + 2, c))
        m = jnp.einsum("kpc,kcd->kpd", _tiles_in(xs), u)
        return jax.lax.dynamic_update_slice(out, _tiles_out(m, b, 1, w // 2), (0, 2 * i, 0, 0))

    return jax.lax.fori_loop(0, h // 2, band, out0)


def upsample2x_conv3x3(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """Nearest 2x upsampling then a 3x3 convolution (stride 1, zero padding 1), computed as
    four 2x2 convolutions of ``x`` (one per output phase) as matmuls over 4-tap patches."""
    b, h, w, c = x.shape
    xp = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    taps = kernel.reshape(9, -1)
    rows = []
    for py in range(2):
        cols = []
        for px in range(2):
            k = jnp.dot(_PHASE_TAPS[py, px].astype(kernel.dtype), taps)  # (4, in * out)
            patches = jnp.concatenate([xp[:, py + i:py + i + h, px + j:px + j + w]
                                       for i in range(2) for j in range(2)], axis=-1)
            y = patches.reshape(-1, 4 * c) @ k.reshape(4 * c, -1)
            cols.append(y.reshape(b, h, w, -1))
        rows.append(jnp.stack(cols, 3))  # b, h, w, 2 (px), o
    return jnp.stack(rows, 2).reshape(b, 2 * h, 2 * w, -1)  # b, h, 2 (py), w, 2, o


class Conv(nn.Module):
    """``flax.linen.Conv`` for NHWC with torch-style padding pairs, choosing its algorithm.

    ``__call__(x, upsample=False)``: with ``upsample=True`` the input is first nearest-neighbour
    upsampled 2x (never materialised on CPU). Parameters: ``kernel`` (kh, kw, in, out), ``bias``.
    """

    features: int
    kernel_size: tuple[int, int] = (3, 3)
    strides: tuple[int, int] = (1, 1)
    padding: tuple[tuple[int, int], tuple[int, int]] = ((1, 1), (1, 1))
    use_bias: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, upsample: bool = False) -> jax.Array:
        cin = x.shape[-1]
        kernel = self.param("kernel", nn.initializers.lecun_normal(),
                            (*self.kernel_size, cin, self.features), self.param_dtype)
        x = x.astype(self.dtype)
        kernel = kernel.astype(self.dtype)
        plain3x3 = (tuple(self.kernel_size) == (3, 3) and tuple(self.strides) == (1, 1)
                    and tuple(map(tuple, self.padding)) == ((1, 1), (1, 1)))
        fast = plain3x3 and jnp.dtype(self.dtype) == jnp.float32 and fast_cpu_convs()
        if upsample and fast:
            y = upsample2x_conv3x3(x, kernel)
        else:
            if upsample:
                x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
            if (fast and cin >= WINOGRAD_MIN_CHANNELS and x.shape[1] % 2 == 0
                    and x.shape[2] % 2 == 0 and x.shape[1] * x.shape[2] >= WINOGRAD_MIN_PIXELS):
                y = winograd_conv3x3(x, kernel)
            else:
                y = xla_conv(x, kernel, tuple(self.strides), tuple(map(tuple, self.padding)))
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
            y = y + bias.astype(self.dtype)
        return y
