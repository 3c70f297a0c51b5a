"""Multi-head attention for the UNet and the VAE, with a selectable kernel.

Kernels (all take q: (B, Lq, H, D), k/v: (B, Lk, H, D) and return (B, Lq, H, D);
scores and softmax in float32 whatever the input dtype, so they agree to ~1e-6):

- ``"xla"``: heads-first einsum, softmax, einsum. The default on CPU: measured faster
  than ``jax.nn.dot_product_attention`` there (see ``benchmarks/attention.py``).
- ``"dot_product"``: ``jax.nn.dot_product_attention`` (cuDNN flash attention on GPUs
  when the dtype and shapes allow).
- ``"chunked"``: queries in chunks of ``chunk_size`` (``lax.map``), so a 1024x1024
  image's 4096x4096 score matrix per head is never materialised at once.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import flax.linen as nn

KERNELS = ("xla", "dot_product", "chunked")
DEFAULT_CHUNK = 512


def _xla(q, k, v, scale):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _chunked(q, k, v, scale, chunk):
    b, lq, h, d = q.shape
    if lq <= chunk:
        return _xla(q, k, v, scale)
    n = -(-lq // chunk)
    pad = n * chunk - lq
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else q
    qc = qp.reshape(b, n, chunk, h, d).transpose(1, 0, 2, 3, 4)
    out = jax.lax.map(lambda qi: _xla(qi, k, v, scale), qc)
    out = out.transpose(1, 0, 2, 3, 4).reshape(b, n * chunk, h, d)
    return out[:, :lq]


def attention(q: jax.Array, k: jax.Array, v: jax.Array, kernel: str = "xla",
              chunk_size: int = DEFAULT_CHUNK) -> jax.Array:
    """Scaled dot-product attention with the chosen kernel (see module docstring)."""
    scale = q.shape[-1] ** -0.5
    if kernel == "xla":
        return _xla(q, k, v, scale)
    if kernel == "chunked":
        return _chunked(q, k, v, scale, chunk_size)
    if kernel == "dot_product":
        return jax.nn.dot_product_attention(q, k, v, scale=scale).astype(q.dtype)
    raise ValueError(f"attention kernel {kernel!r} is unknown; use one of {', '.join(KERNELS)}")


class Attention(nn.Module):
    """diffusers' ``Attention``: to_q / to_k / to_v projections, heads, ``to_out.0``.

    x: (B, L, C); context: (B, Lk, C_ctx) for cross-attention, None for self-attention.
    """

    query_dim: int
    heads: int
    dim_head: int
    qkv_bias: bool = False
    kernel: str = "xla"
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
