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
- ``"splash"``: JAX's Pallas TPU splash attention (a flash-style kernel: the score matrix lives
  block by block in VMEM and never reaches HBM), one image at a time, under ``shard_map`` over
  the mesh's ``data`` axis so the data-parallel program stays free of collectives. Needs both
  lengths to be multiples of 128 (else ``xla``). Off a TPU it runs in Pallas' interpreter
  (slow; for tests).
- ``"auto"`` (default), decided for the devices the program is compiled for
  (:func:`maxdiff.target.platform`), not the machine that compiles it: on a TPU ``splash``
  where it applies (``xla`` for short keys such as the 77 text tokens, where the score matrix
  is small); on a GPU ``dot_product``; on a CPU ``chunked`` once the score matrix per head has
  at least ``AUTO_CHUNKED_MIN`` entries (below that the loop's overhead outweighs it and
  ``xla`` wins).

Attention inside a Pallas kernel is invisible to XLA's cost analysis (a custom call counts no
flops); :func:`counting_kernel_costs` collects the analytic flops and HBM bytes of each such
call as it is traced, for the compile-only reports (``pipelines.aot``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxdiff import target
from maxdiff.mesh import DATA
from maxdiff.models.params import Dense

logger = logging.getLogger(__name__)
KERNELS = ("auto", "chunked", "xla", "dot_product", "splash")
DEFAULT_CHUNK = 512
AUTO_CHUNKED_MIN = 32 * 1024  # Lq * Lk
SPLASH_MULTIPLE = 128  # splash needs sequence lengths in whole 128-row blocks
_KERNEL_COSTS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "maxdiff_kernel_costs", default=None)


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
    backend = target.platform()
    impl = dot_product_implementation(backend, q.dtype, q.shape[-1])
    if impl is None and backend in ("gpu", "cuda"):
        key = (str(q.dtype), q.shape[-1])
        if key not in _FALLBACKS_LOGGED:
            _FALLBACKS_LOGGED.add(key)
            logger.info("attention: cuDNN fused attention does not take %s with head size %d; "
                        "using XLA's dot_product_attention", q.dtype, q.shape[-1])
    return jax.nn.dot_product_attention(q, k, v, scale=scale, implementation=impl).astype(q.dtype)


def splash_fits(lq: int, lk: int) -> bool:
    """Whether splash attention takes these lengths (whole 128-row blocks)."""
    return lq % SPLASH_MULTIPLE == 0 and lk % SPLASH_MULTIPLE == 0


def _block(n: int) -> int:
    return next(b for b in (512, 256, 128) if n % b == 0)


@functools.lru_cache(maxsize=64)
def _splash_kernel(lq: int, lk: int, heads: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.MultiHeadMask([sm.FullMask((lq, lk)) for _ in range(heads)])
    bq, bk = _block(lq), _block(lk)
    sizes = sk.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk)
    return sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes,
                              interpret=interpret)


@contextlib.contextmanager
def counting_kernel_costs():
    """Collects ``{"flops", "bytes"}`` per Pallas attention call traced inside (a list, filled
    as programs are traced): XLA's cost analysis counts none of a custom call's work."""
    costs: list = []
    token = _KERNEL_COSTS.set(costs)
    try:
        yield costs
    finally:
        _KERNEL_COSTS.reset(token)


def _count_splash(q, k):
    costs = _KERNEL_COSTS.get()
    if costs is None:
        return
    b, lq, h, d = q.shape
    lk = k.shape[1]
    b *= target.data_shards() if target.per_device() else 1  # the whole batch's work
    size = jnp.dtype(q.dtype).itemsize
    # QK^T and PV (2 flops a multiply-add each); q and o once, k and v once per query block
    costs.append({"flops": 4 * b * h * lq * lk * d,
                  "bytes": size * b * h * d * (2 * lq + 2 * lk * (lq // _block(lq)))})


def _splash(q, k, v, scale):
    b, lq, h, _ = q.shape
    kernel = _splash_kernel(lq, k.shape[1], h, target.platform() != "tpu")
    _count_splash(q, k)

    def local(q, k, v):
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q * jnp.asarray(scale, q.dtype), k, v))
        return jax.vmap(kernel)(q, k, v).transpose(0, 2, 1, 3)

    shards = target.data_shards()
    if shards > 1 and b % shards == 0 and not target.per_device():  # each device its images
        spec = jax.sharding.PartitionSpec(DATA)
        local = jax.shard_map(local, in_specs=spec, out_specs=spec, check_vma=False)
    return local(q, k, v).astype(q.dtype)


def resolve_kernel(kernel: str, lq: int = 1 << 30, lk: int = 1) -> str:
    """``"auto"`` -> the measured-best kernel for the platform being compiled for
    (:func:`maxdiff.target.platform`) and these lengths; ``"splash"`` where it cannot take the
    lengths -> ``"xla"``."""
    if kernel == "auto":
        where = target.platform()
        if where == "tpu":
            return "splash" if splash_fits(lq, lk) and lk >= SPLASH_MULTIPLE else "xla"
        if where == "gpu":
            return "dot_product"
        return "chunked" if lq * lk >= AUTO_CHUNKED_MIN else "xla"
    if kernel == "splash" and not splash_fits(lq, lk):
        return "xla"
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
    if kernel == "splash":
        return _splash(q, k, v, scale)
    raise ValueError(f"attention kernel {kernel!r} is unknown; use one of {', '.join(KERNELS)}")


class Attention(nn.Module):
    """diffusers' ``Attention``: to_q / to_k / to_v projections, heads, ``to_out.0``.

    x: (B, L, C); context: (B, Lk, C_ctx) for cross-attention, None for self-attention, or an
    IP-Adapter's :class:`maxdiff.ip_adapter.ImageContext` (text states, image tokens, per-image
    scale): the attention to the image tokens (``processor.to_k_ip.0`` / ``to_v_ip.0``) is
    added, scaled, before ``to_out``, as diffusers' ``IPAdapterAttnProcessor2_0`` does.
    """

    query_dim: int
    heads: int
    dim_head: int
    qkv_bias: bool = False
    kernel: str = "auto"
    chunk_size: int = DEFAULT_CHUNK
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, context=None) -> jax.Array:
        inner = self.heads * self.dim_head
        image = None
        if hasattr(context, "tokens"):  # an IP-Adapter's ImageContext (maxdiff.ip_adapter)
            image, context = context, context.text
        ctx = x if context is None else context

        def proj(name, t, bias=self.qkv_bias):
            y = Dense(inner, use_bias=bias, dtype=self.dtype, param_dtype=self.dtype,
                      name=name)(t)
            return y.reshape(*y.shape[:-1], self.heads, self.dim_head)

        q, k, v = proj("to_q", x), proj("to_k", ctx), proj("to_v", ctx)
        o = attention(q, k, v, self.kernel, self.chunk_size)
        if image is not None:  # decoupled cross-attention: + scale * attention to the image
            ik = proj("processor.to_k_ip.0", image.tokens, False)
            iv = proj("processor.to_v_ip.0", image.tokens, False)
            io = attention(q, ik, iv, self.kernel, self.chunk_size)
            o = o + image.scale.astype(o.dtype)[:, None, None, None] * io
        o = o.reshape(*o.shape[:-2], inner)
        return Dense(self.query_dim, dtype=self.dtype, param_dtype=self.dtype,
                     name="to_out.0")(o)
