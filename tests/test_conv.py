"""The CPU convolution algorithms (Winograd F(2x2, 3x3) and F(4x4, 3x3), sub-pixel upsampling) against XLA's
direct convolution and torch, on shapes that take each path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from maxdiff.models.conv import (
    F2,
    F4,
    WINOGRAD_F4_MIN_CHANNELS,
    WINOGRAD_F4_MIN_PIXELS,
    WINOGRAD_MIN_CHANNELS,
    Conv,
    upsample2x_conv3x3,
    winograd_conv3x3,
    xla_conv,
)


def _takes_f4(h: int, w: int, c: int) -> bool:
    """Whether the module's CPU path uses F(4x4, 3x3) here (relative error about 1e-5)."""
    return (h % 4 == 0 and w % 4 == 0 and h * w >= WINOGRAD_F4_MIN_PIXELS
            and c >= WINOGRAD_F4_MIN_CHANNELS)


def _rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("f, tol", [(F2, 5e-6), (F4, 5e-5)], ids=["F2", "F4"])
@pytest.mark.parametrize("shape", [(2, 8, 12, 4, 5), (1, 16, 16, 256, 32), (3, 4, 20, 3, 2)])
def test_winograd_equals_direct_convolution(shape, f, tol):
    b, h, w, c, o = shape
    rng = np.random.default_rng(0)
    x = rng.standard_normal((b, h, w, c), np.float32)
    k = rng.standard_normal((3, 3, c, o), np.float32)
    assert _rel(winograd_conv3x3(x, k, f), xla_conv(x, k)) < tol
    with pytest.raises(ValueError, match=f"multiples of {f.m}, got {h}x{w - 1}"):
        winograd_conv3x3(x[:, :, :-1], k, f)


@pytest.mark.parametrize("shape", [(2, 5, 7, 4, 3), (1, 8, 8, 64, 16), (1, 64, 68, 8, 4),
                                   (1, 64, 64, WINOGRAD_F4_MIN_CHANNELS, 4)])
def test_subpixel_upsampling_equals_upsample_then_convolve(shape):
    b, h, w, c, o = shape
    rng = np.random.default_rng(1)
    x = rng.standard_normal((b, h, w, c), np.float32)
    k = rng.standard_normal((3, 3, c, o), np.float32)
    up = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
    tol = 5e-5 if _takes_f4(h, w, c) else 5e-6  # the last shape takes F(4x4, 3x3)
    assert _rel(upsample2x_conv3x3(x, k), xla_conv(up, k)) < tol
    # and torch's nearest interpolation followed by its convolution
    xt = torch.from_numpy(x.transpose(0, 3, 1, 2).copy())
    kt = torch.from_numpy(k.transpose(3, 2, 0, 1).copy())
    ref = torch.nn.functional.conv2d(torch.nn.functional.interpolate(xt, scale_factor=2.0,
                                                                     mode="nearest"), kt, padding=1)
    assert _rel(upsample2x_conv3x3(x, k), ref.numpy().transpose(0, 2, 3, 1)) < tol


@pytest.mark.parametrize("cin, hw, upsample", [(WINOGRAD_MIN_CHANNELS, (6, 4), False),
                                               (WINOGRAD_MIN_CHANNELS, (5, 4), False),
                                               (WINOGRAD_MIN_CHANNELS, (64, 68), False),
                                               (WINOGRAD_F4_MIN_CHANNELS, (64, 68), False),
                                               (16, (6, 6), False), (16, (3, 5), True),
                                               (16, (64, 64), True),
                                               (WINOGRAD_F4_MIN_CHANNELS, (64, 64), True)])
def test_conv_module_paths_agree_with_xla(cin, hw, upsample, monkeypatch):
    """The module on CPU (fast paths where they apply) equals MAXDIFF_CONV=xla."""
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, *hw, cin), np.float32))
    m = Conv(24)
    params = m.init(jax.random.key(0), x, upsample)
    params = jax.tree.map(lambda p: p + 0.1, params)  # non-zero bias too
    fast = m.apply(params, x, upsample)
    monkeypatch.setenv("MAXDIFF_CONV", "xla")
    direct = m.apply(params, x, upsample)
    scale = 2 if upsample else 1
    assert fast.shape == direct.shape == (2, hw[0] * scale, hw[1] * scale, 24)
    assert _rel(fast, direct) < (5e-5 if _takes_f4(*hw, cin) else 5e-6)
    if _takes_f4(*hw, cin):  # really F(4x4, 3x3): 36 transformed values per tile
        monkeypatch.setenv("MAXDIFF_CONV", "auto")
        assert "tensor<36x" in jax.jit(m.apply, static_argnums=2).lower(params, x, upsample).as_text()
    monkeypatch.setenv("MAXDIFF_CONV", "winograd")
    with pytest.raises(ValueError, match="MAXDIFF_CONV='winograd'; use auto or xla"):
        m.apply(params, x, upsample)


def test_bfloat16_keeps_xla_convolution():
    x = jnp.ones((1, 4, 4, WINOGRAD_MIN_CHANNELS), jnp.bfloat16)
    m = Conv(8, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    params = m.init(jax.random.key(0), x)
    assert m.apply(params, x).dtype == jnp.bfloat16
    text = jax.jit(m.apply).lower(params, x).as_text()
    assert "convolution" in text and "while" not in text  # no Winograd loop


@pytest.mark.parametrize("mean, std", [(0.0, 1.0), (1000.0, 1.0)])
def test_group_norm_matches_torch_even_far_from_zero(mean, std):
    """Two-pass statistics: at mean 1000 and std 1 a one-pass variance loses most digits."""
    from maxdiff.models.layers import GroupNorm

    rng = np.random.default_rng(3)
    x = (mean + std * rng.standard_normal((2, 6, 5, 32))).astype(np.float32)
    m = GroupNorm(8, epsilon=1e-6)
    params = {"params": {"scale": rng.standard_normal(32).astype(np.float32),
                         "bias": rng.standard_normal(32).astype(np.float32)}}
    ours = np.asarray(m.apply(params, x))
    g = torch.nn.GroupNorm(8, 32, eps=1e-6).double()
    with torch.no_grad():
        g.weight.copy_(torch.from_numpy(params["params"]["scale"]))
        g.bias.copy_(torch.from_numpy(params["params"]["bias"]))
        ref = g(torch.from_numpy(x.transpose(0, 3, 1, 2)).double()).numpy().transpose(0, 2, 3, 1)
    assert np.abs(ours - ref).max() < (1e-5 if mean == 0 else 2e-3)
