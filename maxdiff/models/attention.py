"""Multi-head attention for the UNet and the VAE, with a selectable kernel.

Kernels (all take q: (B, Lq, H, D), k/v: (B, Lk, H, D) and return (B, Lq, H, D);
scores and softmax in float32 whatever the input dtype, so they agree to ~1e-6):

- ``"chunked"``: a loop (``lax.map``) over batch x heads and over query chunks of
  ``chunk_size``; each iteration is two plain 2-D matmuls on a (chunk, Lk) score block that
  stays in cache, and the 4096x4096 score matrix of a 1024-pixel image is never materialised.
  Measured on a 2-core AVX2 CPU (``benchmarks/attention.py``) it runs at 0.6-1.2x the time of
  torch's ``scaled_dot_product_attention``, where batched einsums take 2.3-4.8x and
  ``jax.nn.dot_product_attention`` 5.7x: XLA:CPU's batched matmul is far slower than its
  plain one.
- ``"xla"``: heads-first batched einsum, softmax, einsum (full score matrix).
- ``"dot_product"``: ``jax.nn.dot_product_attention``, asking for cuDNN's fused flash attention
  (``implementation="cudnn"``) on NVIDIA GPUs where the dtype (bf16 / fp16) and head size
  (a multiple of 8, at most 128) allow it, XLA's implementation otherwise (logged once per
  shape; the VAE's single 512-wide head is one such case). On TPU it is XLA's.
- ``"auto"`` (default): on CPU ``chunked`` once the score matrix per head has at least
  ``AUTO_CHUNKED_MIN`` entries (below that the loop's overhead outweighs it and ``xla`` wins),
  ``dot_product`` on accelerators.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import flax.linen as nn

logger = logging.getLogger(__name__)
KERNELS = ("auto", "chunked", "xla", "dot_product")
DEFAULT_CHUNK = 512
AUTO_CHUNKED_MIN = 32 * 1024  # Lq * Lk


def _xla(q, k, v, scale):
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # heads first
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bhkd->bhqd", p, v).transpose(0, 2, 1, 3)


def _chunked(q, k, v, scale, chunk):
    b, lq, h, d = q.shape
    chunk = min(chunk, lq)
    n = -(-lq // chunk)
    pad = n * chunk - lq
    heads_first = lambda x: x.transpose(0, 2, 1, 3).reshape(b * h, x.shape[1], d)
    qh, kh, vh = heads_first(q), heads_first(k), heads_first(v)
    if pad:
        qh = jnp.pad(qh, ((0, 0), (0, pad), (0, 0)))
    qh = qh.reshape(b * h, n, chunk, d)

    def one_head(args):
        qs, kk, vv = args
        kt = kk.T

        def one_chunk(qc):
            s = jnp.matmul(qc, kt, preferred_element_type=jnp.float32) * scale
            e = jnp.exp(s - s.max(axis=-1, keepdims=True))
            o = jnp.matmul(e.astype(vv.dtype), vv, preferred_element_type=jnp.float32)
            return (o / e.sum(axis=-1, keepdims=True)).astype(vv.dtype)

        return jax.lax.map(one_chunk, qs)

    out = jax.lax.map(one_head, (qh, kh, vh))  # (b*h, n, chunk, d)
    out = out.reshape(b, h, n * chunk, d)[:, :, :lq]
    return out.transpose(0, 2, 1, 3)


_FALLBACKS_LOGGED: set = set()


def dot_product_implementation(backend: str, dtype: Any, head_dim: int) -> str | None:
    """``"cudnn"`` where cuDNN's fused attention applies (NVIDIA GPU, bf16/fp16, head size a
    multiple of 8 and at most 128), else None (XLA's implementation)."""
    if (backend in ("gpu", "cuda") and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and head_dim % 8 == 0 and head_dim <= 128):
        return "cudnn"
    return None


def _dot_product(q, k, v, scale):
    backend = jax.default_backend()
    impl = dot_product_implementation(backend, q.dtype, q.shape[-1])
    if impl is None and backend in ("gpu", "cuda"):
        key = (str(q.dtype), q.shape[-1])
        if key not in _FALLBACKS_LOGGED:
            _FALLBACKS_LOGGED.add(key)
            logger.info("attention: cuDNN fused attention does not take %s with head size %d; "
                        "using XLA's dot_product_attention", q.dtype, q.shape[-1])
    return jax.nn.dot_product_attention(q, k, v, scale=scale, implementation=impl).astype(q.dtype)


def resolve_kernel(kernel: str, lq: int = 1 << 30, lk: int = 1) -> str:
    """``"auto"`` -> the measured-best kernel for the default backend and these lengths."""
    if kernel == "auto":
        if jax.default_backend() != "cpu":
            return "dot_product"
        return "chunked" if lq * lk >= AUTO_CHUNKED_MIN else "xla"
    return kernel


def attention(q: jax.Array, k: jax.Array, v: jax.Array, kernel: str = "auto",
              chunk_size: int = DEFAULT_CHUNK) -> jax.Array:
    """Scaled dot-product attention with the chosen kernel (see module docstring)."""
    scale = q.shape[-1] ** -0.5
    kernel = resolve_kernel(kernel, q.shape[1], k.shape[1])
    if kernel == "xla":
        return _xla(q, k, v, scale)
    if kernel == "chunked":
        return _chunked(q, k, v, scale, chunk_size)
    if kernel == "dot_product":
        return _dot_product(q, k, v, scale)
    raise ValueError(f"attention kernel {kernel!r} is unknown; use one of {', '.join(KERNELS)}")


class Attention(nn.Module):
    """diffusers' ``Attention``: to_q / to_k / to_v projections, heads, ``to_out.0``.

    x: (B, L, C); context: (B, Lk, C_ctx) for cross-attention, None for self-attention.
    """

    query_dim: int
    heads: int
    dim_head: int
    qkv_bias: bool = False
    kernel: str = "auto"
    chunk_size: int = DEFAULT_CHUNK
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array | None = None) -> jax.Array:
        inner = self.heads * self.dim_head
        ctx = x if context is None else context

        def proj(name, t):
            y = nn.Dense(inner, use_bias=self.qkv_bias, dtype=self.dtype, param_dtype=self.dtype,
                         name=name)(t)
            return y.reshape(*y.shape[:-1], self.heads, self.dim_head)

        q, k, v = proj("to_q", x), proj("to_k", ctx), proj("to_v", ctx)
        o = attention(q, k, v, self.kernel, self.chunk_size)
        o = o.reshape(*o.shape[:-2], inner)
        return nn.Dense(self.query_dim, dtype=self.dtype, param_dtype=self.dtype,
                        name="to_out.0")(o)
