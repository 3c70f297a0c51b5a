"""LoRA adapters fused into the weights, against diffusers' load_lora_weights + fuse_lora.

The adapters are made here with peft on the torch models of the tiny checkpoint (UNet linear and
conv layers, both text encoders) and saved with ``StableDiffusionXLPipeline.save_lora_weights``;
the kohya files are the same tensors under kohya's names.
"""

from __future__ import annotations

import copy
import re

import jax
import numpy as np
import pytest
import torch

from maxdiff.checkpoint import CheckpointError, _flatten, save_safetensors
from maxdiff.lora import LoraError, read_lora
from pipelines import TextToImagePipeline

SIZE = 32
KW = dict(prompt=["a red circle on a blue background", "the cat!"], negative_prompt="blurry",
          num_inference_steps=3, guidance_scale=4.0)


@pytest.fixture(autouse=True)
def _peft_for_transformers(monkeypatch):
    """transformers 5.24 asks for peft >= 0.22 before loading an adapter into a text encoder, a
    version not yet on PyPI (0.21.2 is the newest); the adapter loading it then does works with
    0.21.2 (the fused text encoder weights equal ours bit for bit), so the oracle runs with it."""
    import transformers.integrations.peft as tp

    monkeypatch.setattr(tp, "check_peft_version", lambda **kw: None)


# ------------------------------------------------------------------------------- adapters
UNET_A = dict(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0", "conv1",
                                                  "conv2", "proj_in"])
TE1_A = dict(r=4, lora_alpha=2, target_modules=["q_proj", "k_proj", "v_proj", "out_proj", "fc1"])
TE2_A = dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "fc2"])
UNET_B = dict(r=2, lora_alpha=1, target_modules=["to_k", "ff.net.2", "conv_shortcut", "proj_out"])
TE2_B = dict(r=8, lora_alpha=8, target_modules=["k_proj", "out_proj"])


def _peft_adapter(module: torch.nn.Module, cfg: dict, seed: int):
    """peft LoRA layers on a copy of ``module`` with random down and up matrices; returns
    (state dict in PEFT key format, LoraConfig)."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(init_lora_weights=False, **cfg)
    m = inject_adapter_in_model(config, copy.deepcopy(module))
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, p in m.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            fan_in = p[0].numel()
            sd[name.replace(".default", "")] = (torch.randn(p.shape, generator=g)
                                                * 0.5 / fan_in ** 0.5).contiguous()
    return sd, config


def _save_peft(folder, torch_pipe, parts: dict, seed: int):
    """``parts``: component -> LoRA config dict. Saved as diffusers does, with its metadata."""
    from diffusers import StableDiffusionXLPipeline

    kw = {}
    for i, (comp, cfg) in enumerate(parts.items()):
        sd, config = _peft_adapter(getattr(torch_pipe, comp), cfg, seed + i)
        kw[f"{comp}_lora_layers"] = sd
        kw[f"{comp}_lora_adapter_metadata"] = config.to_dict()
    StableDiffusionXLPipeline.save_lora_weights(folder, **kw)
    return folder / "pytorch_lora_weights.safetensors"


def _read(path):
    from maxdiff.checkpoint import SafetensorsFile

    f = SafetensorsFile(path)
    return {k: f.get(k) for k in f.keys()}, f.metadata


def _to_kohya(peft_file, out, alphas: dict):
    """The same tensors under kohya names (``lora_unet_`` / ``lora_te1_`` / ``lora_te2_``, module
    path with ``_``, lora_down / lora_up) with an ``alpha`` each: ``alphas[component]``."""
    tensors, _ = _read(peft_file)
    prefixes = {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}
    out_t = {}
    for key, value in tensors.items():
        comp, rest = key.split(".", 1)
        module, kind = re.fullmatch(r"(.+)\.lora_([AB])\.weight", rest).groups()
        if comp != "unet" and not module.startswith("text_model."):
            module = "text_model." + module  # kohya names CLIP layers as transformers 4 did
        name = prefixes[comp] + module.replace(".", "_")
        out_t[f"{name}.lora_{'down' if kind == 'A' else 'up'}.weight"] = value.astype(np.float16)
        out_t[f"{name}.alpha"] = np.array(alphas[comp], np.float16)
    save_safetensors(out_t, out)
    return out


@pytest.fixture(scope="module")
def torch_base(sdxl_dir):
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(sdxl_dir).to("cpu")


@pytest.fixture(scope="module")
def loras(torch_base, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    a = _save_peft(root / "a", torch_base, {"unet": UNET_A, "text_encoder": TE1_A,
                                           "text_encoder_2": TE2_A}, seed=100)
    b = _save_peft(root / "b", torch_base, {"unet": UNET_B, "text_encoder_2": TE2_B}, seed=200)
    # alpha such that alpha / r is what the PEFT metadata gives (8/4, 2/4, 4/2)
    kohya = _to_kohya(a, root / "a_kohya.safetensors",
                      {"unet": 8.0, "text_encoder": 2.0, "text_encoder_2": 4.0})
    return {"a": a, "b": b, "kohya": kohya, "root": root}


@pytest.fixture(scope="module")
def pipe(sdxl_dir):
    return TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)


def _latents(seed=0):
    return np.random.default_rng(seed).standard_normal((2, 4, SIZE // 2, SIZE // 2)).astype(np.float32)


def _ours(pipe, lat):
    return pipe(**KW, latents=lat, output_type="np").images


def _theirs(sdxl_dir, lat, adapters: list[tuple[str, float]], how: str = "fuse"):
    from diffusers import StableDiffusionXLPipeline

    p = StableDiffusionXLPipeline.from_pretrained(sdxl_dir).to("cpu")
    for i, (path, _) in enumerate(adapters):
        p.load_lora_weights(str(path), adapter_name=f"ad{i}")
    names = [f"ad{i}" for i in range(len(adapters))]
    if how == "fuse":  # one adapter: fuse_lora(lora_scale=s)
        (_, s), = adapters
        p.fuse_lora(lora_scale=s)
    else:  # several: set_adapters with their weights, then fuse them all
        p.set_adapters(names, adapter_weights=[s for _, s in adapters])
        p.fuse_lora(adapter_names=names)
    with torch.no_grad():
        return p(**KW, height=SIZE, width=SIZE, latents=torch.from_numpy(lat),
                 output_type="np").images


# ------------------------------------------------------------------------------- parity
@pytest.mark.parity
def test_peft_file_unet_and_both_text_encoders(pipe, sdxl_dir, loras):
    lat = _latents(1)
    base = _ours(pipe, lat)
    compiled = pipe.num_compiled
    name = pipe.load_lora_weights(loras["a"], scale=0.7)
    try:
        assert name == "default_0" and pipe.lora_adapters[0]["scale"] == 0.7
        assert pipe.lora_adapters[0]["layers"] == 126 + 25 + 15  # unet, te1, te2 weights
        ours = _ours(pipe, lat)
        assert pipe.num_compiled == compiled  # new weights, same program
    finally:
        pipe.unload_lora_weights()
    theirs = _theirs(sdxl_dir, lat, [(loras["a"], 0.7)])
    err = np.abs(ours - theirs).max()
    print(f"PEFT file, scale 0.7: max |ours - diffusers| = {err:.2e}, "
          f"LoRA moved pixels by {np.abs(ours - base).max():.3f}")
    assert err <= 2e-3
    assert np.abs(ours - base).max() > 0.05  # the adapter really changes the images


@pytest.mark.parity
def test_two_adapters_stack(pipe, sdxl_dir, loras):
    lat = _latents(2)
    pipe.load_lora_weights(loras["a"], adapter_name="a", scale=0.7)
    pipe.load_lora_weights(loras["b"], adapter_name="b", scale=1.3)
    try:
        assert [x["name"] for x in pipe.lora_adapters] == ["a", "b"]
        ours = _ours(pipe, lat)
        with pytest.raises(ValueError, match="'a' is already loaded"):
            pipe.load_lora_weights(loras["a"], adapter_name="a")
        # unloading one adapter leaves exactly the other one fused
        pipe.unload_lora_weights("a")
        only_b = jax.tree_util.tree_leaves(pipe.params)
        pipe.unload_lora_weights()
        pipe.load_lora_weights(loras["b"], scale=1.3)
        assert all(np.array_equal(x, y) for x, y in zip(only_b, jax.tree_util.tree_leaves(pipe.params)))
    finally:
        pipe.unload_lora_weights()
    theirs = _theirs(sdxl_dir, lat, [(loras["a"], 0.7), (loras["b"], 1.3)], how="set_adapters")
    err = np.abs(ours - theirs).max()
    print(f"two adapters (0.7, 1.3): max |ours - diffusers| = {err:.2e}")
    assert err <= 2e-3


@pytest.mark.parity
def test_kohya_file_equals_peft_file(pipe, loras):
    """The same tensors under kohya names with alpha: the same fused weights (the file is
    float16, so the weights agree to float16 rounding) and images. (diffusers 0.42 is no oracle
    here: with transformers 5 it drops a kohya file's text encoder attention layers as
    unexpected keys; its UNet part is compared in test_kohya_sgm_names_match_diffusers.)"""
    lat = _latents(3)
    pipe.load_lora_weights(loras["kohya"], scale=0.7)
    try:
        kohya = _ours(pipe, lat)
        kohya_params = jax.device_get(pipe.params)
    finally:
        pipe.unload_lora_weights()
    pipe.load_lora_weights(loras["a"], scale=0.7)
    try:
        peft = _ours(pipe, lat)
        peft_params = jax.device_get(pipe.params)
    finally:
        pipe.unload_lora_weights()
    for comp in ("unet", "text_encoder", "text_encoder_2"):
        k, p = _flatten(kohya_params[comp]), _flatten(peft_params[comp])
        assert max(np.abs(k[x] - p[x]).max() for x in k) < 2e-3
    print(f"kohya file: max |kohya - peft| = {np.abs(kohya - peft).max():.2e}")
    assert np.abs(kohya - peft).max() <= 2e-3


def _sgm_name(module: str, layers: int = 2) -> str:
    """A diffusers UNet module name in the original SDXL (SGM) spelling kohya uses for SDXL."""
    resnet = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
              "conv_shortcut": "skip_connection"}
    m = re.fullmatch(r"(down|up)_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", module)
    if m:
        side, b, what, l, rest = m.group(1), int(m.group(2)), m.group(3), int(m.group(4)), m.group(5)
        i = (1 if side == "down" else 0) + b * (layers + 1) + l
        block = "input_blocks" if side == "down" else "output_blocks"
        if what == "resnets":
            return f"{block}.{i}.0.{resnet.get(rest, rest)}"
        return f"{block}.{i}.1.{rest}"
    m = re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)", module)
    what, l, rest = m.group(1), int(m.group(2)), m.group(3)
    if what == "attentions":
        return f"middle_block.1.{rest}"
    return f"middle_block.{2 * l}.{resnet.get(rest, rest)}"


@pytest.mark.parity
def test_kohya_sgm_names_match_diffusers(pipe, sdxl_dir, loras, tmp_path):
    """kohya's SDXL spelling (``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``,
    ``..._in_layers_2`` for conv1, ``middle_block_1``, ``output_blocks``): the same layers as
    the PEFT file's UNet part, and the images diffusers gives for that file."""
    tensors, _ = _read(loras["a"])
    sgm = {}
    for key, value in tensors.items():
        comp, rest = key.split(".", 1)
        if comp != "unet":
            continue
        module, kind = re.fullmatch(r"(.+)\.lora_([AB])\.weight", rest).groups()
        name = "lora_unet_" + _sgm_name(module).replace(".", "_")
        sgm[f"{name}.lora_{'down' if kind == 'A' else 'up'}.weight"] = value
        sgm[f"{name}.alpha"] = np.array(8.0, np.float32)
    assert any("input_blocks_4_1_transformer_blocks_0_attn1_to_q" in k for k in sgm)
    path = tmp_path / "sgm.safetensors"
    save_safetensors(sgm, path)
    got = {x.path: x for x in read_lora(path, pipe.params, unet_config=pipe.unet.config)}
    want = {x.path: x for x in read_lora(loras["a"], pipe.params) if x.component == "unet"}
    assert got.keys() == want.keys() and len(got) == 126
    for k, x in got.items():
        assert x.factor == want[k].factor
        np.testing.assert_array_equal(x.torch_delta(), want[k].torch_delta())
    lat = _latents(5)
    pipe.load_lora_weights(path, scale=0.7)
    try:
        ours = _ours(pipe, lat)
    finally:
        pipe.unload_lora_weights()
    theirs = _theirs(sdxl_dir, lat, [(path, 0.7)])
    print(f"kohya SGM names (UNet): max |ours - diffusers| = {np.abs(ours - theirs).max():.2e}")
    assert np.abs(ours - theirs).max() <= 2e-3


def test_unload_restores_base_bit_exactly(pipe, loras):
    lat = _latents(4)
    before = _ours(pipe, lat)
    base_leaves = jax.tree_util.tree_leaves(pipe.params)
    compiled = pipe.num_compiled
    pipe.load_lora_weights(loras["a"], scale=0.7)
    pipe.load_lora_weights(loras["b"])
    assert any(x is not y for x, y in zip(base_leaves, jax.tree_util.tree_leaves(pipe.params)))
    pipe.unload_lora_weights()
    assert pipe.lora_adapters == []
    assert all(x is y for x, y in zip(base_leaves, jax.tree_util.tree_leaves(pipe.params)))
    after = _ours(pipe, lat)
    assert np.array_equal(before, after)
    assert pipe.num_compiled == compiled
    pipe.unload_lora_weights()  # nothing loaded: nothing happens


def test_dtype_is_kept_and_delta_is_added_in_float32(sdxl_dir, loras):
    half = TextToImagePipeline.from_pretrained(sdxl_dir, dtype="bfloat16", compile_cache_dir=None)
    base = half.params["unet"]["down_blocks.0.resnets.0"]["conv1"]["kernel"]
    sharding = base.sharding
    dtypes = [x.dtype for x in jax.tree_util.tree_leaves(half.params)]
    half.load_lora_weights(loras["a"], scale=0.7)
    fused = half.params["unet"]["down_blocks.0.resnets.0"]["conv1"]["kernel"]
    assert fused.dtype == base.dtype == jax.numpy.bfloat16 and fused.sharding == sharding
    tensors, _ = _read(loras["a"])
    down = tensors["unet.down_blocks.0.resnets.0.conv1.lora_A.weight"]  # (r, in, 3, 3)
    up = tensors["unet.down_blocks.0.resnets.0.conv1.lora_B.weight"]    # (out, r, 1, 1)
    delta = 0.7 * (8 / 4) * (up[:, :, 0, 0] @ down.reshape(4, -1)).reshape(up.shape[0], -1, 3, 3)
    want = (np.asarray(base, np.float32) + delta.transpose(2, 3, 1, 0)).astype(base.dtype)
    np.testing.assert_array_equal(np.asarray(fused), want)
    assert [x.dtype for x in jax.tree_util.tree_leaves(half.params)] == dtypes


def test_old_diffusers_spellings(pipe, loras, tmp_path):
    """``lora.down`` / ``lora.up``, ``lora_linear_layer.down`` / ``.up`` and ``.alpha`` tensors
    (no metadata) give the same weights as lora_A / lora_B with the PEFT metadata."""
    tensors, _ = _read(loras["a"])
    old, alphas = {}, {"unet": 8.0, "text_encoder": 2.0, "text_encoder_2": 4.0}
    for key, value in tensors.items():
        comp = key.split(".")[0]
        spell = (".lora.down.weight", ".lora.up.weight") if comp == "unet" else \
            (".lora_linear_layer.down.weight", ".lora_linear_layer.up.weight")
        new = key.replace(".lora_A.weight", spell[0]).replace(".lora_B.weight", spell[1])
        old[new] = value
        old[new.replace(spell[0], ".alpha").replace(spell[1], ".alpha")] = np.array(alphas[comp], np.float32)
    save_safetensors(old, tmp_path / "old.safetensors")
    layers_old = read_lora(tmp_path / "old.safetensors", pipe.params)
    layers_new = read_lora(loras["a"], pipe.params)
    by_path = {(x.component, x.path): x for x in layers_new}
    assert len(layers_old) == len(layers_new) == 166
    for x in layers_old:
        y = by_path[(x.component, x.path)]
        assert x.factor == y.factor
        np.testing.assert_array_equal(x.torch_delta(), y.torch_delta())


# ------------------------------------------------------------------------------- errors
def _one(tmp_path, tensors, name="bad.safetensors"):
    save_safetensors({k: np.asarray(v, np.float32) for k, v in tensors.items()}, tmp_path / name)
    return tmp_path / name


Q = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"  # a (64, 64) linear


@pytest.mark.parametrize("tensors, match", [
    ({f"unet.{Q.replace('attn1', 'attn9')}.lora_A.weight": np.zeros((4, 32)),
      f"unet.{Q.replace('attn1', 'attn9')}.lora_B.weight": np.zeros((32, 4))},
     r"unet\.down_blocks\.1.*attn9\.to_q\.lora_A\.weight'.*which this model does not have"),
    ({"lora_unet_down_blocks_7_resnets_0_conv1.lora_down.weight": np.zeros((4, 32, 3, 3)),
      "lora_unet_down_blocks_7_resnets_0_conv1.lora_up.weight": np.zeros((32, 4, 1, 1))},
     r"lora_unet_down_blocks_7_resnets_0_conv1\.lora_down\.weight'.*does not have"),
    ({f"unet.{Q}.lora_A.weight": np.zeros((4, 64)), f"unet.{Q}.lora_B.weight": np.zeros((64, 3))},
     r"rank mismatch: 'unet\..*to_q\.lora_A\.weight' has rank 4 \(shape \(4, 64\)\) but "
     r"'unet\..*to_q\.lora_B\.weight' has rank 3"),
    ({f"unet.{Q}.lora_A.weight": np.zeros((4, 17)), f"unet.{Q}.lora_B.weight": np.zeros((64, 4))},
     r"to_q\.lora_A\.weight': up @ down has shape \(64, 17\) but unet weight .*to_q\.weight "
     r"has shape \(64, 64\)"),
    ({f"unet.{Q}.lora_A.weight": np.zeros((4, 64))}, r"has no matching up"),
    ({f"unet.{Q}.lora_A.weight": np.zeros((4, 64)), f"unet.{Q}.lora_B.weight": np.zeros((64, 4)),
      f"unet.{Q}.lora_magnitude_vector": np.zeros(64)}, r"DoRA"),
    ({"something.else": np.zeros(3)}, r"'something\.else' is not a LoRA weight"),
])
def test_clear_errors(pipe, tmp_path, tensors, match):
    path = _one(tmp_path, tensors)
    before = pipe.params
    with pytest.raises(ValueError, match=match) as err:
        pipe.load_lora_weights(path)
    assert isinstance(err.value, LoraError) and str(path) in str(err.value)
    assert pipe.params is before and pipe.lora_adapters == []


def test_metadata_rank_must_match(pipe, loras, tmp_path):
    import json

    tensors, meta = _read(loras["a"])
    md = json.loads(meta["lora_adapter_metadata"])
    md["unet.r"] = 8
    save_safetensors(tensors, tmp_path / "m.safetensors",
                     {"format": "pt", "lora_adapter_metadata": json.dumps(md)})
    with pytest.raises(LoraError, match=r"has rank 4 but the file's lora_adapter_metadata says r=8"):
        pipe.load_lora_weights(tmp_path / "m.safetensors")


def test_pickles_and_bad_arguments_are_refused(pipe, loras, tmp_path):
    (tmp_path / "pytorch_lora_weights.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="pickle"):
        pipe.load_lora_weights(tmp_path / "pytorch_lora_weights.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        pipe.load_lora_weights(tmp_path)  # a folder with only the pickle
    with pytest.raises(CheckpointError, match="no such file"):
        pipe.load_lora_weights(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="scale=nan"):
        pipe.load_lora_weights(loras["a"], scale=float("nan"))
    with pytest.raises(ValueError, match="no LoRA adapter named 'x'"):
        pipe.unload_lora_weights("x")
    assert pipe.lora_adapters == []


# ------------------------------------------------------------------------------- CLI, configs
def test_cli_run_config_and_serve_arg(pipe, sdxl_dir, loras, tmp_path):
    """``maxdiff generate --lora PATH:SCALE`` (repeatable) gives the Python API's fused images;
    the images and metadata record the adapters; ``loras:`` in a run config and the serve arg
    ``lora=`` parse to the same specs; a missing file is exit 2 naming it."""
    import json
    import subprocess
    import sys

    from PIL import Image

    from pipelines.config import LoraSpec, load_run_config
    from serving.schemas import ServeSettings

    a, b = str(loras["a"]), str(loras["b"])
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "pipelines.cli", "generate", "a red circle", "--model",
           str(sdxl_dir), "--steps", "2", "--guidance", "0", "--size", f"{SIZE}x{SIZE}",
           "--seed", "5", "--quiet", "--lora", f"{a}:0.7", "--lora", b, "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads((out / "metadata.jsonl").read_text().splitlines()[0])
    assert rec["lora"] == f"{a}:0.7, {b}:1"
    png = Image.open(out / rec["file"])
    assert png.text["lora"] == rec["lora"]
    pipe.load_lora_weights(a, scale=0.7)
    pipe.load_lora_weights(b)
    try:
        ours = np.asarray(pipe("a red circle", num_inference_steps=2, guidance_scale=0.0,
                               height=SIZE, width=SIZE, seed=rec["seed"]).images[0])
    finally:
        pipe.unload_lora_weights()
    base = np.asarray(pipe("a red circle", num_inference_steps=2, guidance_scale=0.0,
                           height=SIZE, width=SIZE, seed=rec["seed"]).images[0])
    cli = np.asarray(png.convert("RGB"))
    assert np.abs(cli.astype(int) - ours).max() <= 1 and np.abs(cli.astype(int) - base).max() > 8

    missing = subprocess.run(cmd[:-4] + ["--lora", str(tmp_path / "nope.safetensors"), "--out",
                                         str(tmp_path / "o2")], capture_output=True, text=True)
    assert missing.returncode == 2 and "nope.safetensors: no such file" in missing.stderr

    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"loras:\n  - {a}:0.7\n  - {{path: {b}, scale: 1.5, name: style}}\n")
    want = (LoraSpec(path=a, scale=0.7), LoraSpec(path=b, scale=1.5, name="style"))
    assert load_run_config(str(cfg)).loras == want
    served = ServeSettings.from_args({"lora": f"{a}:0.7,{b}", "model": str(sdxl_dir)})
    assert served.run_overrides["loras"] == [f"{a}:0.7", b]
    assert load_run_config(None, served.run_overrides).loras == (LoraSpec(path=a, scale=0.7),
                                                                LoraSpec(path=b))
    with pytest.raises(ValueError, match="scale"):
        load_run_config(None, {"loras": [{"path": a, "scale": "x"}]})
