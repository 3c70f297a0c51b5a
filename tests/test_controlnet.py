"""ControlNet parity against diffusers' PyTorch ControlNetModel on the same random weights, the
UNet with ControlNet residuals against diffusers' UNet2DConditionModel, and loading (folders,
fp16 variants, shards, single files in diffusers keys and in the original layout)."""

from __future__ import annotations

import copy
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
import torch

from maxdiff import single_file
from maxdiff.checkpoint import CheckpointError, _flatten, save_safetensors
from maxdiff.loaders import config_from_unet, load_controlnet
from maxdiff.models.controlnet import ControlNetConfig
from maxdiff.models.unet import load_unet

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SDXL_CN = dict(conditioning_embedding_out_channels=(8, 16))  # image 2x the latents


def _rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))


def _nchw(x):
    return torch.from_numpy(np.ascontiguousarray(x)).permute(0, 3, 1, 2)


def _torch_controlnet(model, sample, t, ctx, cond, scale=1.0, guess=False, te=None, tid=None):
    kw = {}
    if te is not None:
        kw["added_cond_kwargs"] = {"text_embeds": torch.from_numpy(te),
                                   "time_ids": torch.from_numpy(tid)}
    with torch.no_grad():
        out = model(_nchw(sample), torch.from_numpy(t), torch.from_numpy(ctx), _nchw(cond),
                    conditioning_scale=scale, guess_mode=guess, **kw)
    return ([r.permute(0, 2, 3, 1).numpy() for r in out.down_block_res_samples],
            out.mid_block_res_sample.permute(0, 2, 3, 1).numpy())


def _assert_outputs_match(ours, theirs, tol=1e-4):
    (down, mid), (ref_down, ref_mid) = ours, theirs
    assert len(down) == len(ref_down)
    for i, (a, b) in enumerate([*zip(down, ref_down), (mid, ref_mid)]):
        a = np.asarray(a)
        assert a.shape == b.shape, i
        assert np.abs(b).max() > 1e-3, i  # a real signal, not zeros
        assert _rel_err(a, b) <= tol, (i, _rel_err(a, b))


def _sdxl_inputs(b, h=8, w=6, factor=2, seed=0):
    rng = np.random.default_rng(seed)
    return dict(sample=rng.standard_normal((b, h, w, 4)).astype(np.float32),
                t=np.array([999.0, 10.5, 500.0][:b], np.float32),
                ctx=rng.standard_normal((b, 7, 64)).astype(np.float32),
                cond=rng.random((b, factor * h, factor * w, 3)).astype(np.float32),
                te=rng.standard_normal((b, 32)).astype(np.float32),
                tid=np.array([[1024, 1024, 0, 0, 1024, 1024], [512, 768, 16, 8, 512, 768],
                              [64, 64, 0, 0, 64, 64]][:b], np.float32))


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    """A tiny SDXL UNet and a ControlNet for it, both written by diffusers, and our jitted
    ControlNet (one program for every conditioning_scale / guess_mode)."""
    root = tmp_path_factory.mktemp("controlnet-sdxl")
    unet = tiny.make_unet(root / "unet", tiny.SDXL_UNET, seed=1)
    cn = tiny.make_controlnet(root / "controlnet", tiny.SDXL_UNET, seed=2, **SDXL_CN)
    model, params = load_controlnet(root / "controlnet")
    return root, unet, cn, params, jax.jit(lambda *a: model.apply({"params": params}, *a))


@pytest.fixture(scope="module")
def sdxl_parity_apply(sdxl):
    """The ControlNet jitted for the parity cases alone, to count its compiled programs."""
    model = load_controlnet(sdxl[0] / "controlnet")[0]
    return jax.jit(lambda *a: model.apply({"params": sdxl[3]}, *a))


@pytest.mark.parity
@pytest.mark.parametrize("scale,guess", [(1.0, False), (0.5, False), (0.5, True), (1.0, True)])
def test_sdxl_controlnet_parity(sdxl, sdxl_parity_apply, scale, guess):
    """Every down residual and the mid residual equal diffusers' in float32; the scale and
    guess mode are traced inputs, so all four cases run one compiled program."""
    cn, apply = sdxl[2], sdxl_parity_apply
    x = _sdxl_inputs(2)
    ours = apply(x["sample"], x["t"], x["ctx"], x["cond"], np.float32(scale), x["te"], x["tid"],
                 np.bool_(guess))
    theirs = _torch_controlnet(cn, x["sample"], x["t"], x["ctx"], x["cond"], scale, guess,
                               x["te"], x["tid"])
    _assert_outputs_match(ours, theirs)
    assert apply._cache_size() == 1


@pytest.mark.parity
def test_per_row_scale_and_guess_mode(sdxl):
    """One batch whose rows ask for different scales and guess modes gives each row what
    diffusers gives that row alone."""
    _, _, cn, _, apply = sdxl
    x = _sdxl_inputs(3, seed=4)
    scales = np.array([0.25, 1.0, 0.75], np.float32)
    guess = np.array([True, False, True])
    down, mid = apply(x["sample"], x["t"], x["ctx"], x["cond"], scales, x["te"], x["tid"], guess)
    for row in range(3):
        one = {k: v[row:row + 1] for k, v in x.items()}
        theirs = _torch_controlnet(cn, one["sample"], one["t"], one["ctx"], one["cond"],
                                   float(scales[row]), bool(guess[row]), one["te"], one["tid"])
        _assert_outputs_match(([d[row:row + 1] for d in down], mid[row:row + 1]), theirs)


@pytest.mark.parity
def test_sd15_controlnet_bgr_parity(tmp_path):
    """SD 1.x layout (no addition embedding, 1x1-conv projections), the released
    conditioning encoder (16, 32, 96, 256: an image 8x the latents) and BGR channel order."""
    cn = tiny.make_controlnet(tmp_path, tiny.SD15_UNET, seed=3,
                              controlnet_conditioning_channel_order="bgr")
    model, params = load_controlnet(tmp_path)
    rng = np.random.default_rng(1)
    sample = rng.standard_normal((1, 8, 8, 4)).astype(np.float32)
    cond = rng.random((1, 64, 64, 3)).astype(np.float32)
    t = np.array([500], np.int64)
    ctx = rng.standard_normal((1, 7, 32)).astype(np.float32)
    ours = jax.jit(model.apply)({"params": params}, sample, t, ctx, cond, 0.5)
    _assert_outputs_match(ours, _torch_controlnet(cn, sample, t, ctx, cond, 0.5))
    # the order matters: the image read as RGB gives residuals over 10x the tolerance away
    rgb = _torch_controlnet(cn, sample, t, ctx, cond[..., ::-1], 0.5)
    assert _rel_err(np.asarray(ours[0][0]), rgb[0][0]) > 1e-3


@pytest.mark.parity
def test_sd2_style_controlnet_parity(tmp_path):
    """SD 2.x-like (linear projections, per-block head counts and transformer depths, a 0 among
    them, three blocks, one layer each, other time-embedding settings) with diffusers' other
    options: a resnet-only mid block (UNetMidBlock2D), one conditioning channel and global
    pooling (guess mode then does not change the scaling)."""
    unet = dict(tiny.SD15_UNET, block_out_channels=(16, 32, 32),
                down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                attention_head_dim=(2, 4, 4), use_linear_projection=True, layers_per_block=1,
                upcast_attention=True, flip_sin_to_cos=False, freq_shift=1,
                transformer_layers_per_block=(0, 2, 1))  # 0: norm and projections only
    cn = tiny.make_controlnet(tmp_path, unet, seed=5, mid_block_type="UNetMidBlock2D",
                              conditioning_channels=1, global_pool_conditions=True,
                              conditioning_embedding_out_channels=(8, 8, 16))
    assert cn.config.global_pool_conditions and cn.config.mid_block_type == "UNetMidBlock2D"
    model, params = load_controlnet(tmp_path)
    rng = np.random.default_rng(2)
    sample = rng.standard_normal((2, 6, 10, 4)).astype(np.float32)
    cond = rng.random((2, 24, 40, 1)).astype(np.float32)
    ctx = rng.standard_normal((2, 5, 32)).astype(np.float32)
    t = np.array([3.0, 800.0], np.float32)
    down, mid = jax.jit(model.apply)({"params": params}, sample, t, ctx, cond, 0.7, None, None, True)
    assert all(d.shape[1:3] == (1, 1) for d in down) and mid.shape == (2, 1, 1, 32)
    _assert_outputs_match((down, mid), _torch_controlnet(cn, sample, t, ctx, cond, 0.7, True))


@pytest.mark.parity
def test_unet_with_controlnet_residuals_parity(sdxl):
    """Our ControlNet's residuals fed to our UNet equal diffusers' ControlNet fed to
    diffusers' UNet2DConditionModel; the residuals change the prediction (so a UNet that
    dropped them would fail)."""
    root, unet_ref, cn_ref, _, apply = sdxl
    unet, uparams = load_unet(root / "unet")
    x = _sdxl_inputs(2, seed=7)
    down, mid = apply(x["sample"], x["t"], x["ctx"], x["cond"], np.float32(0.8), x["te"], x["tid"],
                      np.bool_(False))
    run = jax.jit(unet.apply)
    ours = np.asarray(run({"params": uparams}, x["sample"], x["t"], x["ctx"], x["te"], x["tid"],
                          None, down, mid))
    plain = np.asarray(run({"params": uparams}, x["sample"], x["t"], x["ctx"], x["te"], x["tid"]))
    ref_down, ref_mid = _torch_controlnet(cn_ref, x["sample"], x["t"], x["ctx"], x["cond"], 0.8,
                                          False, x["te"], x["tid"])
    with torch.no_grad():
        theirs = unet_ref(_nchw(x["sample"]), torch.from_numpy(x["t"]), torch.from_numpy(x["ctx"]),
                          added_cond_kwargs={"text_embeds": torch.from_numpy(x["te"]),
                                             "time_ids": torch.from_numpy(x["tid"])},
                          down_block_additional_residuals=tuple(_nchw(r) for r in ref_down),
                          mid_block_additional_residual=_nchw(ref_mid)).sample
    theirs = theirs.permute(0, 2, 3, 1).numpy()
    assert _rel_err(ours, theirs) <= 1e-4
    assert _rel_err(plain, theirs) > 1e-2


def test_unet_residual_errors(sdxl):
    """Residuals that do not fit the UNet are refused naming the argument (checked while
    tracing: nothing runs)."""
    root = sdxl[0]
    unet, uparams = load_unet(root / "unet")
    x = _sdxl_inputs(1)
    f = lambda down, mid: jax.eval_shape(  # noqa: E731
        lambda p, d, m: unet.apply(p, x["sample"], x["t"], x["ctx"], x["te"], x["tid"], None, d, m),
        {"params": uparams}, down, mid)
    down = [jax.ShapeDtypeStruct(s, jnp.float32) for s in
            [(1, 8, 6, 32)] * 3 + [(1, 4, 3, 32)] + [(1, 4, 3, 64)] * 2]
    mid = jax.ShapeDtypeStruct((1, 4, 3, 64), jnp.float32)
    assert f(down, mid).shape == (1, 8, 6, 4)
    with pytest.raises(ValueError, match="pass both or neither"):
        f(down, None)
    with pytest.raises(ValueError, match="down_block_additional_residuals has 5 entries; this "
                                         "UNet has 6 skip connections"):
        f(down[:5], mid)
    with pytest.raises(ValueError, match=r"down_block_additional_residuals\[4\] has shape "
                                         r"\(1, 4, 3, 32\)"):
        f(down[:4] + [jax.ShapeDtypeStruct((1, 4, 3, 32), jnp.float32)] + down[5:], mid)
    with pytest.raises(ValueError, match=r"mid_block_additional_residual has shape \(1, 8, 6, 64\)"):
        f(down, jax.ShapeDtypeStruct((1, 8, 6, 64), jnp.float32))


def test_controlnet_cond_size_error(sdxl):
    root = sdxl[0]
    model, params = load_controlnet(root / "controlnet")
    x = _sdxl_inputs(1)
    with pytest.raises(ValueError, match=r"controlnet_cond has shape \(1, 8, 6, 3\); .* needs "
                                         r"\(1, 16, 12, 3\): the image is 2x the latents"):
        jax.eval_shape(lambda p: model.apply(p, x["sample"], x["t"], x["ctx"], x["cond"][:, :8, :6],
                                             1.0, x["te"], x["tid"]), {"params": params})


def _flat(params):
    return {"/".join(k): np.asarray(v) for k, v in _flatten(params).items()}


def _assert_same(a, b):
    fa, fb = _flat(a), _flat(b)
    assert set(fa) == set(fb)
    for k in fa:
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


def test_fp16_variant_sharded_and_bf16(sdxl, tmp_path):
    """An fp16-only folder loads (the variant is found), a sharded folder loads the same
    weights as the single file, and a bfloat16 load keeps every leaf in bfloat16."""
    root, _, cn, params, _ = sdxl
    copy.deepcopy(cn).to(torch.float16).save_pretrained(tmp_path / "fp16", variant="fp16")
    assert not (tmp_path / "fp16" / "diffusion_pytorch_model.safetensors").exists()
    _, p16 = load_controlnet(tmp_path / "fp16")
    ref = {k: v.astype(np.float16).astype(np.float32) for k, v in _flat(params).items()}
    assert all(np.array_equal(v, ref[k]) for k, v in _flat(p16).items())

    cn.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    assert (tmp_path / "sharded" / "diffusion_pytorch_model.safetensors.index.json").exists()
    _assert_same(load_controlnet(tmp_path / "sharded")[1], params)

    _, pbf = load_controlnet(root / "controlnet", dtype="bfloat16")
    assert {x.dtype for x in jax.tree_util.tree_leaves(pbf)} == {jnp.dtype(jnp.bfloat16)}


def _original_layout(folder, out, prefix):
    """The folder's ControlNet written in lllyasviel's original key layout."""
    from maxdiff.checkpoint import open_weights

    config = json.loads((folder / "config.json").read_text())
    src = open_weights(folder)
    rename = single_file.controlnet_rename(config, prefix)
    tensors = {}
    for key in src.keys():
        stored, op = rename(key)
        tensors[stored] = op.write([src.get(key)])
    save_safetensors(tensors, out)
    return config


def test_single_files(sdxl, tmp_path):
    """A ControlNet as one file loads with its config: in diffusers keys, and in the original
    layout under control_model.* (which diffusers' own from_single_file reads back to the
    same weights: diffusers is the oracle of the key mapping) or bare."""
    from diffusers import ControlNetModel as TorchControlNet

    _, _, cn, params, _ = sdxl
    folder = tmp_path / "sd15"
    tiny.make_controlnet(folder, tiny.SD15_UNET, seed=6)  # the released encoder: 8x
    _, want = load_controlnet(folder)
    config = json.loads((folder / "config.json").read_text())

    shutil.copy(folder / "diffusion_pytorch_model.safetensors", tmp_path / "diffusers-keys.safetensors")
    _assert_same(load_controlnet(tmp_path / "diffusers-keys.safetensors", config=config)[1], want)

    _original_layout(folder, tmp_path / "control.safetensors", "control_model.")
    ref = TorchControlNet.from_single_file(str(tmp_path / "control.safetensors"), config=str(folder),
                                           local_files_only=True)
    sd = TorchControlNet.from_pretrained(folder).state_dict()
    assert set(ref.state_dict()) == set(sd)
    assert all(torch.equal(v, sd[k]) for k, v in ref.state_dict().items())
    _assert_same(load_controlnet(tmp_path / "control.safetensors", config=config)[1], want)

    _original_layout(folder, tmp_path / "bare.safetensors", "")
    _assert_same(load_controlnet(tmp_path / "bare.safetensors", config=config)[1], want)

    with pytest.raises(CheckpointError, match="a ControlNet; give it to a pipeline as "
                                              "controlnet=.*maxdiff.loaders.load_controlnet"):
        single_file.inspect(tmp_path / "control.safetensors")  # e.g. passed as a whole model
    with pytest.raises(CheckpointError, match="needs a config: config= .* or unet_config="):
        load_controlnet(tmp_path / "control.safetensors")
    # without its config: the UNet's (diffusers' from_unet fields), the conditioning encoder's
    # channels read off the file, in each of the three layouts
    for name in ("diffusers-keys", "control", "bare"):
        made = config_from_unet(tmp_path / f"{name}.safetensors", tiny.SD15_UNET)
        assert made["conditioning_embedding_out_channels"] == (16, 32, 96, 256)
        assert made["conditioning_channels"] == 3
        assert ControlNetConfig.from_dict(made) == ControlNetConfig.from_dict(config)
        _assert_same(load_controlnet(tmp_path / f"{name}.safetensors",
                                     unet_config=tiny.SD15_UNET)[1], want)
    save_safetensors({"first_stage_model.encoder.down.0.block.0.conv1.weight": np.zeros(1, np.float32)},
                     tmp_path / "vae.safetensors")
    with pytest.raises(CheckpointError, match="not a ControlNet: a VAE alone"):
        load_controlnet(tmp_path / "vae.safetensors", config=config)


def test_config_errors(sdxl, tmp_path):
    """Unsupported settings name the config field; weights that do not match config.json
    name the tensor and its two shapes."""
    base = json.loads((sdxl[0] / "controlnet" / "config.json").read_text())
    for change, match in [
        (dict(controlnet_conditioning_channel_order="bgra"),
         "controlnet_conditioning_channel_order='bgra'; use 'rgb' or 'bgr'"),
        (dict(class_embed_type="timestep"), "class_embed_type='timestep' is not supported"),
        (dict(layers_per_block=[2, 2]), r"layers_per_block=\(2, 2\); a ControlNet takes one number"),
        (dict(mid_block_type=None), "mid_block_type=None is not supported; use 'UNetMidBlock2DCrossAttn' "
                                    "or 'UNetMidBlock2D'"),
        (dict(conditioning_embedding_out_channels=[]),
         r"conditioning_embedding_out_channels=\(\); use a list"),
        (dict(up_block_types=["UpBlock2D"]), "unknown key 'up_block_types'"),
        (dict(addition_embed_type="text"), "addition_embed_type='text' is not supported"),
    ]:
        with pytest.raises(ValueError, match=match):
            ControlNetConfig.from_dict({**base, **change})
    # keys that do not change the maths load, as in diffusers (published configs carry some)
    assert (ControlNetConfig.from_dict({**base, "sample_size": 128, "dropout": 0.0})
            == ControlNetConfig.from_dict(base))

    wrong = tmp_path / "wrong"
    shutil.copytree(sdxl[0] / "controlnet", wrong)
    (wrong / "config.json").write_text(json.dumps({**base, "conditioning_embedding_out_channels": [8, 32]}))
    with pytest.raises(CheckpointError, match=r"key 'controlnet_cond_embedding\.blocks\.1\.bias' has "
                                              r"shape \(16,\), expected \(32,\)"):
        load_controlnet(wrong)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_full_size_shapes_and_key_map(family):
    """The released configs (lllyasviel's SD 1.5 ControlNets: diffusers' defaults with 768-wide
    text; diffusers' SDXL ones: from_unet of the SDXL base UNet): our parameters are
    diffusers' exactly, name for name and shape for shape (built on torch's meta device)."""
    from diffusers import ControlNetModel as TorchControlNet
    from diffusers import UNet2DConditionModel as TorchUNet
    from test_unet import SDXL_BASE_CONFIG

    from maxdiff.checkpoint import _torch_shape, flax_to_torch_key
    from maxdiff.models.controlnet import ControlNetModel, param_shapes

    with torch.device("meta"):
        if family == "sd15":
            ref = TorchControlNet(cross_attention_dim=768)
        else:
            unet = TorchUNet(**{k: v for k, v in SDXL_BASE_CONFIG.items() if not k.startswith("_")})
            ref = TorchControlNet.from_unet(unet, load_weights_from_unet=False)
    config = {k: v for k, v in ref.config.items() if not k.startswith("_")}
    shapes = param_shapes(ControlNetModel(ControlNetConfig.from_dict(config)))
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    ours = {flax_to_torch_key(path, len(leaf.shape))[0]: _torch_shape(path, tuple(leaf.shape))
            for path, leaf in _flatten(shapes).items()}
    assert ours == ref_shapes
