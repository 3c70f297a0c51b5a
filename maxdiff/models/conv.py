"""2-D convolutions, with two CPU algorithms that do fewer multiplications than XLA's direct one.

:class:`Conv` is a drop-in for ``flax.linen.Conv`` (same ``kernel`` (kh, kw, in, out) and
``bias`` parameters, NHWC) that picks, at trace time, how to compute a 3x3 convolution:

- **Winograd F(2x2, 3x3)** (Lavin & Gray 2015, "Fast Algorithms for Convolutional Neural
  Networks"): each 4x4 input tile is transformed (``Bᵀ d B``), multiplied channel-wise by the
  transformed kernel (``G g Gᵀ``, 16 matmuls over the input channels) and transformed back
  (``Aᵀ m A``) into a 2x2 output tile: 16 multiplications per 4 outputs instead of 36. The
  tiles of one row of tiles at a time are processed in a loop, so the transformed tiles stay in
  cache (all at once, memory traffic ate the gain). Used on CPU for float32 inputs with at least
  ``WINOGRAD_MIN_CHANNELS`` input channels and even sides, where it measured 1.2-1.8x faster
  than XLA's convolution (``benchmarks/compare.py``, docs/benchmarks.md); relative error about
  1e-6.
- **Winograd F(4x4, 3x3)**: 6x6 tiles, 36 multiplications per 16 outputs and 2.25 transformed
  values per output (F(2x2, 3x3): 4). It wins only with many channels: measured on an idle
  machine (2 x 3x3 convs, batch 2) 68 vs 83 ms at 64² x 512 and 157 vs 183 ms at 128² x 512 ->
  256, but 123 vs 93 ms at 128² x 256; so it is used from ``WINOGRAD_F4_MIN_CHANNELS`` (512)
  input channels and ``WINOGRAD_F4_MIN_PIXELS`` pixels (sides multiples of 4). Relative error
  about 1e-5.
- **Sub-pixel nearest upsampling** (``upsample=True``): nearest 2x upsampling followed by a 3x3
  convolution equals four 2x2 convolutions of the low-resolution input (one per output phase,
  with the 3x3 taps that land on the same source pixel summed), interleaved: 16 instead of 36
  multiplications per 4 outputs, and the upsampled tensor is never built. With at least 512
  channels and 64² input pixels the four phases run as Winograd F(4x4, 3x3) of their
  zero-padded 3x3 kernels sharing one input transform (9 multiplications per output; 263 vs
  303 ms at 64² x 512, but slower at 128² x 256). The patches are built a band of two
  low-resolution rows at a time (1.7x faster at 128² x 256 than whole-image patches).

Everything else (other kernel sizes, strides, accelerators, half precision) is XLA's
``conv_general_dilated``. ``MAXDIFF_CONV=xla`` turns the CPU algorithms off (for A/B
measurements); the default ``auto`` uses them only in programs compiled for a CPU (the platform
of the mesh being traced under, :func:`maxdiff.target.platform`, not the compiling machine's).
"""

from __future__ import annotations

import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from maxdiff import target
from maxdiff.models.params import FromTree

WINOGRAD_MIN_CHANNELS = 256
WINOGRAD_MIN_PIXELS = 1024  # h * w below which the loop overhead outweighs the gain (measured)
WINOGRAD_F4_MIN_PIXELS = 4096  # h * w from which F(4x4, 3x3) beats F(2x2, 3x3) (measured)
UPSAMPLE_F4_MIN_PIXELS = 4096  # low-resolution h * w from which upsampling uses F(4x4, 3x3)
WINOGRAD_F4_MIN_CHANNELS = 512  # input channels from which F(4x4, 3x3) beats F(2x2, 3x3)
_DN = ("NHWC", "HWIO", "NHWC")


class _Winograd:
    """Winograd F(m x m, 3x3) (Lavin & Gray 2015): input tiles of (m+2)², ``Bᵀ d B``;
    kernel ``G g Gᵀ`` as one ((m+2)², 9) map of the 9 taps; output ``Aᵀ M A``."""

    def __init__(self, m: int, bt, g, at):
        self.m, self.n = m, m + 2
        self.bt, self.at = np.asarray(bt, np.float64), np.asarray(at, np.float64)
        g = np.asarray(g, np.float64)
        self.gg = np.einsum("ia,jb->ijab", g, g).reshape(self.n ** 2, 9).astype(np.float32)


# F(2x2, 3x3): 16 multiplications per 4 outputs instead of 36; relative error about 1e-6
F2 = _Winograd(2, [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]],
               [[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]],
               [[1, 1, 1, 0], [0, 1, -1, -1]])
# F(4x4, 3x3), interpolation points 0, ±1, ±2, ∞: 36 multiplications per 16 outputs instead of
# 144, and 2.25 transformed values per output instead of 4; relative error about 1e-5
F4 = _Winograd(4, [[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
                   [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]],
               [[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
                [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]],
               [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0],
                [0, 1, -1, 8, -8, 1]])
# sub-pixel phases: which 3x3 taps fall on low-resolution offsets (-1, 0) (phase 0) or (0, +1)
_PHASE = np.array([[[1, 0, 0], [0, 1, 1]], [[1, 1, 0], [0, 0, 1]]], np.float32)
# per output phase (py, px): the (4, 9) map from 3x3 taps to the 2x2 taps of that phase
_PHASE_TAPS = np.einsum("yia,xjb->yxijab", _PHASE, _PHASE).reshape(2, 2, 4, 9)


def fast_cpu_convs() -> bool:
    """Whether the CPU algorithms are on: ``MAXDIFF_CONV`` is ``auto`` (default) and the
    program is compiled for a CPU (:func:`maxdiff.target.platform`)."""
    mode = os.environ.get("MAXDIFF_CONV", "auto").lower()
    if mode not in ("auto", "xla"):
        raise ValueError(f"MAXDIFF_CONV={mode!r}; use auto or xla")
    return mode == "auto" and target.platform() == "cpu"


def xla_conv(x: jax.Array, kernel: jax.Array, strides=(1, 1), padding=((1, 1), (1, 1))):
    return jax.lax.conv_general_dilated(x, kernel, strides, padding, dimension_numbers=_DN)


def _combine(mat: np.ndarray, vs: list) -> list:
    """``mat @ vs`` for a small constant matrix and a list of arrays, as adds (no zeros)."""
    out = []
    for row in mat:
        acc = None
        for coef, v in zip(row, vs):
            if coef == 0:
                continue
            t = v if coef == 1 else -v if coef == -1 else v * np.float32(coef)
            acc = t if acc is None else acc + t
        out.append(acc)
    return out


def winograd_weights(kernel: jax.Array, f: _Winograd = F2) -> jax.Array:
    """(3, 3, in, out) -> the transformed kernel ``G g Gᵀ``, ((m+2)², in, out)."""
    cin, cout = kernel.shape[2:]
    u = jnp.dot(f.gg, kernel.astype(jnp.float32).reshape(9, cin * cout))  # one small matmul
    return u.reshape(f.n ** 2, cin, cout)


def _tiles_in(xs: jax.Array, f: _Winograd = F2) -> jax.Array:
    """(B, mR+2, mT+2, C) padded rows -> ``Bᵀ d B`` of every (m+2)² tile (stride m):
    ((m+2)², B*R*T, C)."""
    b, hp, wp, c = xs.shape
    m, n = f.m, f.n
    r, t = (hp - 2) // m, (wp - 2) // m
    d = [[xs[:, i:i + m * r:m, j:j + m * t:m, :] for j in range(n)] for i in range(n)]
    cols = [_combine(f.bt, [d[i][j] for i in range(n)]) for j in range(n)]  # Bᵀ d: cols[j][k]
    out = [e for k in range(n) for e in _combine(f.bt, [cols[j][k] for j in range(n)])]
    return jnp.stack(out).reshape(n * n, b * r * t, c)


def _tiles_out(mm: jax.Array, b: int, r: int, t: int, f: _Winograd = F2) -> jax.Array:
    """((m+2)², B*R*T, O) -> ``Aᵀ M A`` per tile, interleaved into (B, mR, mT, O)."""
    m, n = f.m, f.n
    mm = mm.reshape(n, n, b, r, t, -1)
    s = _combine(f.at, [mm[i] for i in range(n)])  # m x (n, b, r, t, o)
    y = [_combine(f.at, [s[i][j] for j in range(n)]) for i in range(m)]  # y[i][j]: (b, r, t, o)
    y = jnp.stack([jnp.stack(row, 3) for row in y], 2)  # b, r, m, t, m, o
    return y.reshape(b, m * r, m * t, -1)


def winograd_conv3x3(x: jax.Array, kernel: jax.Array, f: _Winograd = F2) -> jax.Array:
    """3x3 convolution, stride 1, zero padding 1, NHWC, by Winograd F(m x m, 3x3). Height and
    width must be multiples of m. One row of tiles (m output rows) per loop iteration, so the
    transformed tiles stay in cache."""
    b, h, w, c = x.shape
    m = f.m
    if h % m or w % m:
        raise ValueError(f"winograd_conv3x3 F({m}x{m}, 3x3) needs sides that are multiples "
                         f"of {m}, got {h}x{w}")
    u = winograd_weights(kernel, f)
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (1, 1), (1, 1), (0, 0)))
    out0 = jnp.zeros((b, h, w, kernel.shape[-1]), jnp.float32)

    def band(i, out):
        xs = jax.lax.dynamic_slice(xp, (0, m * i, 0, 0), (b, m + 2, w + 2, c))
        mm = jnp.einsum("kpc,kcd->kpd", _tiles_in(xs, f), u)
        return jax.lax.dynamic_update_slice(out, _tiles_out(mm, b, 1, w // m, f),
                                            (0, m * i, 0, 0))

    return jax.lax.fori_loop(0, h // m, band, out0)


def _phase_kernels(kernel: jax.Array) -> list[jax.Array]:
    """The four 3x3 kernels on the low-resolution input, one per output phase (py, px), whose
    convolutions interleave into nearest-2x-upsampling followed by ``kernel`` (each has only
    the 2x2 taps of its phase non-zero)."""
    c, o = kernel.shape[2:]
    taps = kernel.reshape(9, c * o)
    out = []
    for py in range(2):
        for px in range(2):
            k = jnp.dot(_PHASE_TAPS[py, px].astype(kernel.dtype), taps).reshape(2, 2, c, o)
            out.append(jnp.zeros((3, 3, c, o), kernel.dtype).at[py:py + 2, px:px + 2].set(k))
    return out


def _interleave(phases: list[jax.Array]) -> jax.Array:
    """Four (B, H, W, O) phase outputs (py, px in row-major order) -> (B, 2H, 2W, O)."""
    b, h, w, o = phases[0].shape
    y = jnp.stack([jnp.stack(phases[0:2], 3), jnp.stack(phases[2:4], 3)], 2)  # b,h,2,w,2,o
    return y.reshape(b, 2 * h, 2 * w, o)


def upsample2x_conv3x3(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """Nearest 2x upsampling then a 3x3 convolution (stride 1, zero padding 1), computed from
    ``x`` without building the upsampled tensor: output phase (py, px) is a 2x2 convolution of
    ``x``. Where the sides are multiples of 4 and the input has at least
    ``UPSAMPLE_F4_MIN_PIXELS`` pixels, each phase runs as Winograd F(4x4, 3x3) of its (zero-
    padded) 3x3 kernel, all four sharing one input transform: 9 multiplications per output
    instead of 16; otherwise as matmuls over 4-tap patches, two low-resolution rows at a
    time."""
    b, h, w, c = x.shape
    if (h % 4 == 0 and w % 4 == 0 and h * w >= UPSAMPLE_F4_MIN_PIXELS
            and c >= WINOGRAD_F4_MIN_CHANNELS and fast_cpu_convs()):
        us = [winograd_weights(k, F4) for k in _phase_kernels(kernel)]
        xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (1, 1), (1, 1), (0, 0)))
        out0 = jnp.zeros((b, 2 * h, 2 * w, kernel.shape[-1]), jnp.float32)

        def band(i, out):  # 4 low-resolution rows -> 8 output rows
            tiles = _tiles_in(jax.lax.dynamic_slice(xp, (0, 4 * i, 0, 0), (b, 6, w + 2, c)), F4)
            phases = [_tiles_out(jnp.einsum("kpc,kcd->kpd", tiles, u), b, 1, w // 4, F4)
                      for u in us]
            return jax.lax.dynamic_update_slice(out, _interleave(phases), (0, 8 * i, 0, 0))

        return jax.lax.fori_loop(0, h // 4, band, out0)
    # as matmuls over 4-tap patches, a band of low-resolution rows at a time so the patches
    # stay in cache (whole-image patches: 413 ms at 128² x 256 -> 256; bands of 2 rows: 246)
    rows = 2 if h % 2 == 0 else 1
    xp = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    taps = kernel.reshape(9, -1)
    ks = [jnp.dot(_PHASE_TAPS[py, px].astype(kernel.dtype), taps).reshape(4 * c, -1)
          for py in range(2) for px in range(2)]  # (4 taps * in, out) per phase

    def band(i, out):
        xs = jax.lax.dynamic_slice(xp, (0, rows * i, 0, 0), (b, rows + 2, w + 2, c))
        phases = []
        for k, (py, px) in zip(ks, [(0, 0), (0, 1), (1, 0), (1, 1)]):
            patches = jnp.concatenate([xs[:, py + dy:py + dy + rows, px + dx:px + dx + w]
                                       for dy in range(2) for dx in range(2)], axis=-1)
            phases.append((patches.reshape(-1, 4 * c) @ k).reshape(b, rows, w, -1))
        return jax.lax.dynamic_update_slice(out, _interleave(phases), (0, 2 * rows * i, 0, 0))

    out0 = jnp.zeros((b, 2 * h, 2 * w, kernel.shape[-1]), x.dtype)
    return jax.lax.fori_loop(0, h // rows, band, out0)


class Conv(FromTree, nn.Module):
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
            h, w = x.shape[1:3]
            f = None
            if fast and cin >= WINOGRAD_MIN_CHANNELS:
                if (h % 4 == 0 and w % 4 == 0 and h * w >= WINOGRAD_F4_MIN_PIXELS
                        and cin >= WINOGRAD_F4_MIN_CHANNELS):
                    f = F4
                elif h % 2 == 0 and w % 2 == 0 and h * w >= WINOGRAD_MIN_PIXELS:
                    f = F2
            if f is not None:
                y = winograd_conv3x3(x, kernel, f)
            else:
                y = xla_conv(x, kernel, tuple(self.strides), tuple(map(tuple, self.padding)))
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
            y = y + bias.astype(self.dtype)
        return y
