"""The attention kernels agree with each other and with torch's scaled_dot_product_attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from maxdiff.models.attention import KERNELS, attention


@pytest.mark.parity
@pytest.mark.parametrize("lq, lk", [(300, 300), (1024, 77), (64, 64), (256, 384)])
def test_kernels_agree(lq, lk):
    """(256, 384): whole 128-row blocks, so ``splash`` runs (Pallas' interpreter on a CPU)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, lq, 4, 32)).astype(np.float32)
    k = rng.standard_normal((2, lk, 4, 32)).astype(np.float32)
    v = rng.standard_normal((2, lk, 4, 32)).astype(np.float32)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x).transpose(1, 2) for x in (q, k, v))).transpose(1, 2).numpy()
    for kernel in KERNELS:
        out = np.asarray(jax.jit(
            lambda a, b, c, kernel=kernel: attention(a, b, c, kernel, chunk_size=128))(q, k, v))
        assert out.shape == ref.shape
        assert np.abs(out - ref).max() <= 1e-5, kernel


def test_bf16_inputs_keep_dtype():
    q = jnp.ones((1, 10, 2, 8), jnp.bfloat16)
    for kernel in KERNELS:
        assert attention(q, q, q, kernel, chunk_size=4).dtype == jnp.bfloat16


def test_unknown_kernel():
    q = jnp.ones((1, 4, 1, 8))
    with pytest.raises(ValueError, match="attention kernel 'flash' is unknown; use one of "
                                         "auto, chunked, xla, dot_product"):
        attention(q, q, q, "flash")


def test_dot_product_asks_for_cudnn_only_where_it_applies():
    from maxdiff.models.attention import dot_product_implementation as impl

    assert impl("gpu", jnp.bfloat16, 64) == impl("cuda", jnp.float16, 128) == "cudnn"
    assert impl("gpu", jnp.float32, 64) is None  # cuDNN's fused kernel is half precision only
    assert impl("gpu", jnp.bfloat16, 512) is None  # the VAE's single 512-wide head
    assert impl("gpu", jnp.bfloat16, 36) is None
    assert impl("cpu", jnp.bfloat16, 64) is None and impl("tpu", jnp.bfloat16, 64) is None
