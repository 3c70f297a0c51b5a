"""The UNet's spatial transformer: diffusers' ``Transformer2DModel`` and ``BasicTransformerBlock``.

x: (B, H, W, C) NHWC; context: (B, L, C_ctx) text embeddings. Submodule names are
diffusers' (``norm``, ``proj_in``, ``transformer_blocks.{i}``, ``attn1``, ``ff.net.0.proj``, ...).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxdiff.models.attention import DEFAULT_CHUNK, Attention
from maxdiff.models.layers import conv, dense, group_norm
from maxdiff.models.params import LayerNorm


def _layer_norm(name: str, dtype: Any) -> nn.LayerNorm:
    return LayerNorm(epsilon=1e-5, dtype=dtype, param_dtype=dtype, name=name)


class FeedForward(nn.Module):
    """GEGLU feed-forward: ``net.0.proj`` (dim -> 2 * 4dim), value * gelu(gate), ``net.2``."""

    dim: int
    mult: int = 4
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        inner = self.dim * self.mult
        h = dense(2 * inner, "net.0.proj", self.dtype)(x)
        value, gate = jnp.split(h, 2, axis=-1)
        h = value * jax.nn.gelu(gate, approximate=False)
        return dense(self.dim, "net.2", self.dtype)(h)


class BasicTransformerBlock(nn.Module):
    """Self-attention, cross-attention and GEGLU feed-forward, each pre-LayerNorm and residual."""

    dim: int
    heads: int
    dim_head: int
    only_cross_attention: bool = False
    kernel: str = "auto"
    chunk_size: int = DEFAULT_CHUNK
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array) -> jax.Array:
        attn = lambda name: Attention(self.dim, self.heads, self.dim_head, kernel=self.kernel,
                                      chunk_size=self.chunk_size, dtype=self.dtype, name=name)
        h = _layer_norm("norm1", self.dtype)(x)
        text = getattr(context, "text", context)  # self-attention never sees image tokens
        x = x + attn("attn1")(h, text if self.only_cross_attention else None)
        h = _layer_norm("norm2", self.dtype)(x)
        x = x + attn("attn2")(h, context)
        h = _layer_norm("norm3", self.dtype)(x)
        return x + FeedForward(self.dim, dtype=self.dtype, name="ff")(h)


class Transformer2DModel(nn.Module):
    """GroupNorm, ``proj_in`` (linear or 1x1 conv), ``num_layers`` blocks, ``proj_out``, residual."""

    in_channels: int
    heads: int
    dim_head: int
    num_layers: int = 1
    groups: int = 32
    use_linear_projection: bool = False
    only_cross_attention: bool = False
    kernel: str = "auto"
    chunk_size: int = DEFAULT_CHUNK
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array) -> jax.Array:
        b, hgt, wid, c = x.shape
        inner = self.heads * self.dim_head
        residual = x
        h = group_norm(self.groups, 1e-6, "norm", self.dtype)(x)
        if self.use_linear_projection:
            h = dense(inner, "proj_in", self.dtype)(h.reshape(b, hgt * wid, c))
        else:
            h = conv(inner, "proj_in", self.dtype, kernel=1, padding=0)(h)
            h = h.reshape(b, hgt * wid, inner)
        for i in range(self.num_layers):
            h = BasicTransformerBlock(inner, self.heads, self.dim_head, self.only_cross_attention,
                                      self.kernel, self.chunk_size, self.dtype,
                                      name=f"transformer_blocks.{i}")(h, context)
        if self.use_linear_projection:
            h = dense(c, "proj_out", self.dtype)(h).reshape(b, hgt, wid, c)
        else:
            h = conv(c, "proj_out", self.dtype, kernel=1, padding=0)(h.reshape(b, hgt, wid, inner))
        return h + residual
