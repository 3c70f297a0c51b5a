"""UNet parity against diffusers' PyTorch UNet2DConditionModel on the same random weights."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
import torch

from maxdiff.models.unet import UNet2DConditionModel, UNetConfig, count_params, load_unet, param_shapes


def _torch_unet(model, sample, t, ctx, text_embeds=None, time_ids=None):
    kw = {}
    if text_embeds is not None:
        kw["added_cond_kwargs"] = {"text_embeds": torch.from_numpy(text_embeds),
                                   "time_ids": torch.from_numpy(time_ids)}
    with torch.no_grad():
        out = model(torch.from_numpy(sample).permute(0, 3, 1, 2), torch.from_numpy(t),
                    torch.from_numpy(ctx), **kw).sample
    return out.permute(0, 2, 3, 1).numpy()


def _rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))


@pytest.fixture(scope="module")
def sdxl_unet(tmp_path_factory):
    path = tmp_path_factory.mktemp("unet-sdxl")
    return path, tiny.make_unet(path, tiny.SDXL_UNET)


@pytest.mark.parity
@pytest.mark.parametrize("kernel", ["xla", "dot_product", "chunked"])
def test_sdxl_unet_parity(sdxl_unet, kernel):
    path, ref = sdxl_unet
    model, params = load_unet(path, attention_kernel=kernel, attention_chunk=24)
    rng = np.random.default_rng(0)
    b, h, w = 2, 16, 12  # non-square; 16x12 latents -> 192 tokens at the top level
    sample = rng.standard_normal((b, h, w, 4)).astype(np.float32)
    t = np.array([999.0, 10.5], np.float32)
    ctx = rng.standard_normal((b, 77, 64)).astype(np.float32)
    te = rng.standard_normal((b, 32)).astype(np.float32)
    tid = np.array([[1024, 1024, 0, 0, 1024, 1024], [512, 768, 16, 8, 512, 768]], np.float32)
    ours = np.asarray(jax.jit(model.apply)({"params": params}, sample, t, ctx, te, tid))
    theirs = _torch_unet(ref, sample, t, ctx, te, tid)
    assert ours.shape == theirs.shape
    assert _rel_err(ours, theirs) <= 1e-4


@pytest.mark.parity
@pytest.mark.parametrize("size", [(8, 8), (9, 7)])
def test_sd15_unet_parity(tmp_path, size):
    ref = tiny.make_unet(tmp_path, tiny.SD15_UNET, seed=3)
    model, params = load_unet(tmp_path)
    rng = np.random.default_rng(1)
    sample = rng.standard_normal((1, *size, 4)).astype(np.float32)
    t = np.array([500], np.int64)
    ctx = rng.standard_normal((1, 7, 32)).astype(np.float32)
    ours = np.asarray(jax.jit(model.apply)({"params": params}, sample, t, ctx))
    theirs = _torch_unet(ref, sample, t, ctx)
    assert _rel_err(ours, theirs) <= 1e-4


@pytest.mark.parity
def test_sd2_style_unet_parity(tmp_path):
    """Linear projections, per-block head counts, layers per block as a list, 3 blocks."""
    cfg = dict(tiny.SD15_UNET, block_out_channels=(16, 32, 32),
               down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
               up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
               attention_head_dim=(2, 4, 4), use_linear_projection=True, layers_per_block=1,
               upcast_attention=True, flip_sin_to_cos=False, freq_shift=1)
    ref = tiny.make_unet(tmp_path, cfg, seed=5)
    model, params = load_unet(tmp_path)
    rng = np.random.default_rng(2)
    sample = rng.standard_normal((1, 8, 8, 4)).astype(np.float32)
    ctx = rng.standard_normal((1, 5, 32)).astype(np.float32)
    t = np.array([3.0], np.float32)
    ours = np.asarray(jax.jit(model.apply)({"params": params}, sample, t, ctx))
    assert _rel_err(ours, _torch_unet(ref, sample, t, ctx)) <= 1e-4


def test_single_file_unet_replaces_folder(sdxl_unet, tmp_path):
    """A diffusers-format single .safetensors file (how SDXL-Lightning ships) loads with a config."""
    path, _ = sdxl_unet
    single = tmp_path / "lightning_unet.safetensors"
    single.write_bytes((path / "diffusion_pytorch_model.safetensors").read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    from maxdiff.loaders import load_unet as load_any

    _, a = load_any(single, config=cfg)
    _, b = load_unet(path)
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(x, y), a, b)


def test_bf16_load(sdxl_unet):
    path, _ = sdxl_unet
    model, params = load_unet(path, dtype="bfloat16")
    assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    rng = np.random.default_rng(0)
    args = (rng.standard_normal((1, 8, 8, 4)).astype(np.float32), np.array([10.0], np.float32),
            rng.standard_normal((1, 77, 64)).astype(np.float32),
            rng.standard_normal((1, 32)).astype(np.float32), np.ones((1, 6), np.float32))
    out16 = np.asarray(jax.jit(model.apply)({"params": params}, *args).astype(jnp.float32))
    m32, p32 = load_unet(path)
    out32 = np.asarray(jax.jit(m32.apply)({"params": p32}, *args))
    assert np.isfinite(out16).all()
    assert _rel_err(out16, out32) < 0.1


def test_config_errors():
    with pytest.raises(ValueError, match="down_block_types entry 'AttnDownBlock2D'"):
        UNetConfig.from_dict(dict(tiny.SD15_UNET, down_block_types=["AttnDownBlock2D", "DownBlock2D"]))
    with pytest.raises(ValueError, match="class_embed_type"):
        UNetConfig.from_dict(dict(tiny.SD15_UNET, class_embed_type="timestep"))
    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        UNetConfig.from_dict(dict(tiny.SD15_UNET, bogus=1))
    with pytest.raises(ValueError, match="needs addition_time_embed_dim"):
        UNetConfig.from_dict(dict(tiny.SD15_UNET, addition_embed_type="text_time"))


SDXL_BASE_CONFIG = {
    "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.19.0.dev0",
    "act_fn": "silu", "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20],
    "block_out_channels": [320, 640, 1280], "center_input_sample": False,
    "class_embed_type": None, "class_embeddings_concat": False, "conv_in_kernel": 3,
    "conv_out_kernel": 3, "cross_attention_dim": 2048, "cross_attention_norm": None,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "downsample_padding": 1, "dual_cross_attention": False, "encoder_hid_dim": None,
    "encoder_hid_dim_type": None, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4,
    "layers_per_block": 2, "mid_block_only_cross_attention": None, "mid_block_scale_factor": 1,
    "mid_block_type": "UNetMidBlock2DCrossAttn", "norm_eps": 1e-05, "norm_num_groups": 32,
    "num_attention_heads": None, "num_class_embeds": None, "only_cross_attention": False,
    "out_channels": 4, "projection_class_embeddings_input_dim": 2816,
    "resnet_out_scale_factor": 1.0, "resnet_skip_time_act": False,
    "resnet_time_scale_shift": "default", "sample_size": 128, "time_cond_proj_dim": None,
    "time_embedding_act_fn": None, "time_embedding_dim": None, "time_embedding_type": "positional",
    "timestep_post_act": None, "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "upcast_attention": None, "use_linear_projection": True,
}


@pytest.mark.slow
def test_full_sdxl_unet_shapes_and_key_map():
    """The real SDXL config: exact parameter count, and our names cover diffusers' exactly."""
    from diffusers import UNet2DConditionModel as TorchUNet

    from maxdiff.checkpoint import _flatten, _torch_shape, flax_to_torch_key

    model = UNet2DConditionModel(UNetConfig.from_dict(SDXL_BASE_CONFIG))
    shapes = param_shapes(model)
    assert count_params(shapes) == 2_567_463_684
    with torch.device("meta"):
        ref = TorchUNet(**{k: v for k, v in SDXL_BASE_CONFIG.items() if not k.startswith("_")})
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    ours = {flax_to_torch_key(path, len(leaf.shape))[0]: (path, tuple(leaf.shape))
            for path, leaf in _flatten(shapes).items()}
    assert set(ours) == set(ref_shapes)
    for key, (path, shape) in ours.items():
        assert _torch_shape(path, shape) == ref_shapes[key], key
