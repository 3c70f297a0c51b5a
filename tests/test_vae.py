"""VAE (AutoencoderKL) parity against diffusers' PyTorch AutoencoderKL on the same random weights.

Our side is NHWC, diffusers' NCHW: the torch helpers transpose at the boundary.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tiny
import torch

from maxdiff.checkpoint import CheckpointError, load_params, open_weights, read_config
from maxdiff.models.vae import AutoencoderKL, AutoencoderKLConfig, DiagonalGaussian, load_vae, param_shapes

# Three levels (f = 4), two resnets per level, 4 groups, 16 latent channels without the 1x1
# quant convs, and SD3's scaling/shift factors.
VARIANT = dict(
    block_out_channels=(16, 32, 32),
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
    layers_per_block=2,
    latent_channels=16,
    norm_num_groups=4,
    sample_size=32,
    scaling_factor=1.5305,
    shift_factor=0.0609,
    use_quant_conv=False,
    use_post_quant_conv=False,
)


def _nchw(a):
    return torch.from_numpy(np.ascontiguousarray(a)).permute(0, 3, 1, 2)


def _nhwc(t):
    return t.permute(0, 2, 3, 1).numpy()


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))


def _run(model, params, method, *args):
    return _run_all(model, params, [(method, args)])[0]


def _run_all(model, params, calls):
    """Several ``(method, args)`` calls compiled as one program (one compile, not several)."""
    fn = jax.jit(lambda p: [model.apply({"params": p}, *a, method=m) for m, a in calls])
    return jax.tree.map(np.asarray, fn(params))


def _images(shape, seed=0):
    return np.random.default_rng(seed).uniform(-1, 1, shape).astype(np.float32)


def _latents(shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("vae")
    return path, tiny.make_vae(path)


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    path = tmp_path_factory.mktemp("vae-variant")
    return path, tiny.make_vae(path, VARIANT, seed=5)


# --- config -------------------------------------------------------------------------------


def test_config_reads_every_key_diffusers_writes(base):
    path, ref = base
    raw = read_config(path)
    cfg = AutoencoderKLConfig.from_dict(raw)
    for k, v in raw.items():
        if not k.startswith("_"):
            assert getattr(cfg, k) == (tuple(v) if isinstance(v, list) else v), k
    assert cfg.vae_scale_factor == 2
    hash(cfg)  # frozen and hashable: usable as a static module attribute


@pytest.mark.parametrize("change, field", [
    ({"down_block_types": ["DownEncoderBlock2D", "AttnDownEncoderBlock2D"]}, "down_block_types"),
    ({"up_block_types": ["UpDecoderBlock2D"]}, "up_block_types"),
    ({"act_fn": "gelu"}, "act_fn"),
    ({"norm_num_groups": 5}, "norm_num_groups"),
    ({"latents_mean": [0.0] * 3, "latents_std": [1.0] * 3}, "latents_mean"),
    ({"latents_mean": [0.0] * 4}, "latents_std"),
    ({"use_tiling": True}, "use_tiling"),
    ({"_class_name": "AutoencoderTiny"}, "AutoencoderTiny"),
])
def test_config_rejects_what_we_do_not_implement(change, field):
    d = {k: list(v) if isinstance(v, tuple) else v for k, v in tiny.VAE.items()}
    with pytest.raises(ValueError, match=field):
        AutoencoderKLConfig.from_dict({**d, **change})


def test_optional_layers_change_the_parameter_tree(base):
    path, _ = base
    cfg = AutoencoderKLConfig.from_dict(read_config(path))
    bare = dataclasses.replace(cfg, use_quant_conv=False, use_post_quant_conv=False,
                               mid_block_add_attention=False)
    shapes = param_shapes(AutoencoderKL(bare))
    assert "quant_conv" not in shapes and "post_quant_conv" not in shapes
    assert not any(k.startswith("attentions") for k in shapes["decoder"]["mid_block"])
    # These weights hold quant_conv: the loader refuses to drop them silently.
    with pytest.raises(CheckpointError, match="unexpected key"):
        load_params(shapes, open_weights(path))


def test_posterior_sample_and_mode():
    mean = jnp.arange(24.0).reshape(1, 2, 3, 4)
    post = DiagonalGaussian(mean, jnp.full_like(mean, np.log(0.25)))
    s1, s2 = post.sample(jax.random.key(0)), post.sample(jax.random.key(0))
    np.testing.assert_array_equal(s1, s2)
    eps = (s1 - mean) / 0.5
    np.testing.assert_allclose(eps, jax.random.normal(jax.random.key(0), mean.shape), atol=1e-5)
    np.testing.assert_array_equal(post.mode(), mean)


# --- parity ---------------------------------------------------------------------------------


@pytest.mark.parity
def test_encode_parity(base):
    path, ref = base
    model, params = load_vae(path, attention_chunk=24)  # 256 tokens: the chunked path, padded
    x = _images((2, 32, 32, 3))
    post = _run(model, params, "encode", x)
    with torch.no_grad():
        dist = ref.encode(_nchw(x)).latent_dist
    assert post.mean.shape == (2, 16, 16, 4)
    assert _rel_err(post.mean, _nhwc(dist.mean)) <= 1e-4
    assert _rel_err(post.logvar, _nhwc(dist.logvar)) <= 1e-4


@pytest.mark.parity
@pytest.mark.parametrize("kernel", ["chunked", "xla"])
def test_decode_parity_non_square(base, kernel):
    path, ref = base
    model, params = load_vae(path, attention_kernel=kernel, attention_chunk=16)
    z = _latents((2, 6, 10, 4))
    ours = _run(model, params, "decode", z)
    with torch.no_grad():
        theirs = _nhwc(ref.decode(_nchw(z)).sample)
    assert ours.shape == theirs.shape == (2, 12, 20, 3)
    assert _rel_err(ours, theirs) <= 1e-4


@pytest.mark.parity
def test_latent_scaling_matches_the_sdxl_pipeline(base):
    """latents_to_image / image_to_latents against diffusers' SDXL (img2img) pipeline formulas,
    without and with latents_mean / latents_std in the config."""
    path, ref = base
    model, params = load_vae(path)
    sf = model.config.scaling_factor
    z = _latents((1, 8, 8, 4))
    x = _images((1, 16, 16, 3))
    mean, std = [0.1, -0.2, 0.3, 0.05], [0.9, 1.1, 0.8, 1.2]
    moments = AutoencoderKL(dataclasses.replace(model.config, latents_mean=tuple(mean),
                                                latents_std=tuple(std)))
    m_t, s_t = torch.tensor(mean).view(1, 4, 1, 1), torch.tensor(std).view(1, 4, 1, 1)
    with torch.no_grad():
        img_plain = _nhwc(ref.decode(_nchw(z) / sf).sample)
        img_moments = _nhwc(ref.decode(_nchw(z) * s_t / sf + m_t).sample)
        mode = ref.encode(_nchw(x)).latent_dist.mode()
        lat_plain = _nhwc(sf * mode)
        lat_moments = _nhwc((mode - m_t) * sf / s_t)
    calls = [("latents_to_image", (z,)), ("image_to_latents", (x,))]
    image, latents = _run_all(model, params, calls)
    assert _rel_err(image, img_plain) <= 1e-4
    assert _rel_err(latents, lat_plain) <= 1e-4
    image, latents = _run_all(moments, params, calls)
    assert _rel_err(image, img_moments) <= 1e-4
    assert _rel_err(latents, lat_moments) <= 1e-4


@pytest.mark.parity
def test_variant_parity(variant):
    """3 levels, 2 resnets per level, 4 groups, 16 latent channels, no quant convs, shift."""
    path, ref = variant
    model, params = load_vae(path)
    assert "quant_conv" not in params and model.config.vae_scale_factor == 4
    sf, shift = VARIANT["scaling_factor"], VARIANT["shift_factor"]
    x = _images((2, 24, 40, 3), seed=2)
    z = _latents((2, 6, 10, 16), seed=3)
    key = jax.random.key(7)
    post, image, latents = _run_all(model, params, [
        ("encode", (x,)), ("latents_to_image", (z,)), ("image_to_latents", (x, key))])
    with torch.no_grad():
        dist = ref.encode(_nchw(x)).latent_dist
        theirs = _nhwc(ref.decode(_nchw(z) / sf + shift).sample)  # SD3 pipeline formula
    assert _rel_err(post.mean, _nhwc(dist.mean)) <= 1e-4
    assert _rel_err(post.logvar, _nhwc(dist.logvar)) <= 1e-4
    assert image.shape == (2, 24, 40, 3)
    assert _rel_err(image, theirs) <= 1e-4
    # A posterior sample, shifted and scaled (SD3 img2img): (z - shift) * scaling_factor.
    eps = np.asarray(jax.random.normal(key, post.mean.shape))
    want = (post.mean + np.exp(0.5 * post.logvar) * eps - shift) * sf
    np.testing.assert_allclose(latents, want, rtol=1e-5, atol=1e-5)


# --- dtypes ---------------------------------------------------------------------------------


def test_force_upcast_loads_float16_as_float32(base):
    """As diffusers: force_upcast is about float16's range; bfloat16 has float32's and stays."""
    path, _ = base
    assert read_config(path)["force_upcast"] is True
    model, params = load_vae(path, dtype="float16")
    assert model.dtype == jnp.float32
    assert {a.dtype for a in jax.tree.leaves(params)} == {np.dtype("float32")}
    model, params = load_vae(path, dtype="bfloat16")
    assert model.dtype == jnp.bfloat16
    assert {a.dtype for a in jax.tree.leaves(params)} == {np.dtype(ml_dtypes.bfloat16)}


def test_bfloat16_smoke(base, tmp_path):
    path, ref = base
    folder = tmp_path / "vae-bf16"
    shutil.copytree(path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "force_upcast": False}))
    model, params = load_vae(folder, dtype="bfloat16")
    assert model.dtype == jnp.bfloat16
    assert {a.dtype for a in jax.tree.leaves(params)} == {np.dtype(ml_dtypes.bfloat16)}
    z = _latents((1, 6, 10, 4))
    ours = _run(model, params, "latents_to_image", z)
    with torch.no_grad():  # the float32 reference
        want = _nhwc(ref.decode(_nchw(z) / model.config.scaling_factor).sample)
    assert ours.dtype == ml_dtypes.bfloat16
    assert np.isfinite(ours.astype(np.float32)).all()
    assert _rel_err(ours, want) <= 5e-2


@pytest.mark.parity
@pytest.mark.parametrize("lh, lw", [(40, 28), (16, 33)])
def test_tiled_decode_matches_diffusers_enable_tiling(lh, lw, tmp_path):
    """diffusers' tiling on a VAE whose sample_size is 32 (16-pixel latent tiles, stride 12,
    8-pixel blends): edge tiles, non-square latents, a single row of tiles."""
    import tiny
    import torch

    from maxdiff.models.vae_tiling import needs_tiling, tile_decoder, tiled_decode

    tv = tiny.make_vae(tmp_path / "vae", tiny.VAE, seed=4)
    model, params = load_vae(tmp_path / "vae")
    z = np.random.default_rng(5).standard_normal((2, lh, lw, 4)).astype(np.float32)
    assert needs_tiling(model.config, lh, lw)
    ours = np.asarray(tiled_decode(model.config, tile_decoder(model, params), z))
    tv.enable_tiling()
    with torch.no_grad():
        theirs = tv.decode(torch.from_numpy(z.transpose(0, 3, 1, 2))).sample.numpy()
    theirs = theirs.transpose(0, 2, 3, 1)
    assert ours.shape == theirs.shape == (2, 2 * lh, 2 * lw, 3)
    assert _rel_err(ours, theirs) <= 1e-4
    plain = np.asarray(model.apply({"params": params}, z, method="decode"))
    assert np.abs(ours - plain).max() > 1e-3  # the tiles really are blended, not one decode


@pytest.mark.parity
@pytest.mark.parametrize("h, w", [(80, 56), (32, 72)])
def test_tiled_encode_matches_diffusers_enable_tiling(h, w, tmp_path):
    """diffusers' tiled encode on a VAE whose sample_size is 32 (32-pixel image tiles, stride
    24, 16-pixel latent tiles blended over 4 and cropped to 12): edge tiles as small as 8
    pixels, a single row of tiles; the posterior's mean and log-variance."""
    from maxdiff.models.vae_tiling import needs_tiled_encode, tile_encoder, tiled_encode

    tv = tiny.make_vae(tmp_path / "vae", tiny.VAE, seed=6)
    model, params = load_vae(tmp_path / "vae")
    x = _images((2, h, w, 3), seed=7)
    assert needs_tiled_encode(model.config, h, w)
    moments = tiled_encode(model.config, tile_encoder(model, params), x)
    post = jax.tree.map(np.asarray, model.posterior(moments))
    tv.enable_tiling()
    with torch.no_grad():
        dist = tv.encode(_nchw(x)).latent_dist
    f = model.config.vae_scale_factor
    assert post.mean.shape == _nhwc(dist.mean).shape == (2, h // f, w // f, 4)
    assert _rel_err(post.mean, _nhwc(dist.mean)) <= 1e-4
    assert _rel_err(post.logvar, _nhwc(dist.logvar)) <= 1e-4
    plain = _run(model, params, "encode", x)
    assert np.abs(post.mean - np.asarray(plain.mean)).max() > 1e-3  # really tiled and blended
    # moments_to_latents on the tiled moments: the img2img latents from a given noise
    eps = _latents(post.mean.shape, seed=8)
    lat = np.asarray(model.apply({"params": params}, moments, None, eps,
                                 method="moments_to_latents"))
    want = (post.mean + np.exp(0.5 * post.logvar) * eps) * model.config.scaling_factor
    np.testing.assert_allclose(lat, want, rtol=1e-5, atol=1e-5)
