"""Single-file checkpoints in the original Stability layout: maxdiff writes them
(:func:`maxdiff.single_file.export`), diffusers' own ``from_single_file`` reads them back to the
same weights (diffusers is the oracle of the key mapping), and maxdiff's images from the file
equal diffusers' from the same file."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import tiny
import torch

from maxdiff import single_file
from maxdiff.checkpoint import CheckpointError, SafetensorsFile, save_safetensors
from pipelines import TextToImagePipeline, cli

SIZE = 32
COMPONENTS = ("unet", "vae", "text_encoder", "text_encoder_2")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny SDXL folder whose two text encoders differ in width (768 / 1280 in the real
    model; diffusers' single-file reader tells them apart that way) and its single files."""
    root = tmp_path_factory.mktemp("single-file")
    torch_pipe = tiny.make_sdxl_pipeline(root / "folder", hidden_2=48)
    single_file.export(root / "folder", root / "model.safetensors")
    single_file.export(root / "folder", root / "model-fp16.safetensors", dtype="float16")
    single_file.export(root / "folder", root / "no-vae.safetensors", include_vae=False)
    return root, torch_pipe


def _diffusers(path, config, dtype=torch.float32):
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_single_file(str(path), config=str(config),
                                                      local_files_only=True, torch_dtype=dtype)


def _latents(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 4, SIZE // 2, SIZE // 2)
                                                       ).astype(np.float32)


KW = dict(prompt=["a red circle on a blue background", "the cat!"], negative_prompt=["", "red"],
          num_inference_steps=3, guidance_scale=5.0, height=SIZE, width=SIZE)


def test_diffusers_reads_our_file_to_the_same_weights(model):
    root, original = model
    theirs = _diffusers(root / "model.safetensors", root / "folder")
    for name in COMPONENTS:
        want, got = getattr(original, name).state_dict(), getattr(theirs, name).state_dict()
        assert set(want) == set(got), name
        differ = [k for k in want if not torch.equal(want[k], got[k])]
        assert not differ, f"{name}: {differ[:5]}"
    keys = SafetensorsFile(root / "model.safetensors").keys()  # the original layout's names
    assert "model.diffusion_model.input_blocks.4.1.proj_in.weight" in keys
    assert "first_stage_model.decoder.up.0.block.0.conv1.weight" in keys
    assert "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight" in keys
    assert "conditioner.embedders.0.transformer.text_model.final_layer_norm.weight" in keys


@pytest.mark.parity
@pytest.mark.parametrize("file", ["model.safetensors", "model-fp16.safetensors"])
def test_images_from_a_single_file_equal_diffusers(model, file):
    root, _ = model
    ours = TextToImagePipeline.from_single_file(root / file, config=root / "folder",
                                                compile_cache_dir=None)
    theirs = _diffusers(root / file, root / "folder")
    lat = _latents(2)
    mine = ours(**KW, latents=lat, output_type="np").images
    with torch.no_grad():
        ref = theirs(**KW, latents=torch.from_numpy(lat), output_type="np").images
    assert mine.shape == ref.shape == (2, SIZE, SIZE, 3)
    assert np.abs(mine - ref).max() <= 2e-3


def test_a_separate_vae_file_completes_a_file_without_one(model, tmp_path):
    """A single file without ``first_stage_model.*`` says to pass vae=; a standalone VAE in the
    original layout (as ``sdxl_vae.safetensors`` ships) then gives the full file's weights."""
    root, _ = model
    with pytest.raises(CheckpointError, match=r"holds no VAE.*vae="):
        TextToImagePipeline.from_single_file(root / "no-vae.safetensors", config=root / "folder",
                                             compile_cache_dir=None)
    full = SafetensorsFile(root / "model.safetensors")
    prefix = "first_stage_model."
    save_safetensors({k[len(prefix):]: full.get(k) for k in full.keys() if k.startswith(prefix)},
                     tmp_path / "sdxl_vae.safetensors")
    a = TextToImagePipeline.from_single_file(root / "model.safetensors", config=root / "folder",
                                             compile_cache_dir=None)
    b = TextToImagePipeline.from_single_file(root / "no-vae.safetensors", config=root / "folder",
                                             vae=tmp_path / "sdxl_vae.safetensors",
                                             compile_cache_dir=None)
    flat = lambda p: {"/".join(k): np.asarray(v) for k, v in _flatten(p).items()}  # noqa: E731
    va, vb = flat(a.params["vae"]), flat(b.params["vae"])
    assert set(va) == set(vb) and all(np.array_equal(va[k], vb[k]) for k in va)
    # a diffusers VAE folder replaces a folder model's VAE the same way
    c = TextToImagePipeline.from_pretrained(root / "folder", vae=root / "folder" / "vae",
                                            compile_cache_dir=None)
    vc = flat(c.params["vae"])
    assert all(np.array_equal(va[k], vc[k]) for k in va)


def _flatten(tree, prefix=()):
    out = {}
    for k, v in tree.items():
        out.update(_flatten(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v})
    return out


def _rewrite(src, dst, keep=lambda k: True, rename=lambda k: k):
    f = SafetensorsFile(src)
    save_safetensors({rename(k): f.get(k) for k in f.keys() if keep(k)}, dst)
    return dst


@pytest.mark.parametrize("case, match", [
    ("missing", r"missing key 'model\.diffusion_model\.out\.2\.weight' \(diffusers 'conv_out"),
    ("sd15-unet", r"label_emb"),
    ("lora", r"a LoRA file; load it with load_lora_weights"),
    ("unet-only", r"a UNet alone in diffusers keys.*unet="),
    ("vae-only", r"a VAE alone; pass it as vae="),
    ("truncated", r"corrupt or truncated|truncated"),
    ("mixed", r"a Stable Diffusion 1\.x file, but .* describes a StableDiffusionXLPipeline"),
    ("mixed-shipped", r"shipped Stable Diffusion 1\.x configs do not describe this file"),
])
def test_bad_files_say_what_is_wrong(model, tmp_path, case, match):
    root, _ = model
    src = root / "model.safetensors"
    if case == "missing":
        path = _rewrite(src, tmp_path / "m.safetensors", keep=lambda k: not k.endswith("out.2.weight"))
    elif case == "sd15-unet":  # an SDXL file whose UNet has no added-condition embedding
        path = _rewrite(src, tmp_path / "m.safetensors", keep=lambda k: "label_emb" not in k)
    elif case == "lora":
        path = tiny.make_sdxl_lora(root / "folder", tmp_path / "lora.safetensors")
    elif case == "unet-only":
        path = root / "folder" / "unet" / "diffusion_pytorch_model.safetensors"
    elif case == "vae-only":
        path = root / "folder" / "vae" / "diffusion_pytorch_model.safetensors"
    elif case == "truncated":
        path = tmp_path / "t.safetensors"
        path.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    else:  # an SDXL UNet with SD 1.x's text encoder (cond_stage_model.transformer.*)
        path = _rewrite(src, tmp_path / "m.safetensors",
                        keep=lambda k: not k.startswith("conditioner.embedders.1."),
                        rename=lambda k: k.replace("conditioner.embedders.0.", "cond_stage_model."))
    config = None if case == "mixed-shipped" else root / "folder"
    with pytest.raises(CheckpointError, match=match):
        TextToImagePipeline.from_pretrained(path, config=config, compile_cache_dir=None)


# the published parameter counts of the real models (diffusers' models of these configs)
REAL_SIZES = {
    "sdxl-base": {"unet": 2_567_463_684, "vae": 83_653_863, "text_encoder": 123_060_480,
                  "text_encoder_2": 694_659_840},
    # the refiner's UNet: diffusers' count of what its own converter makes of sd_xl_refiner.yaml
    "sdxl-refiner": {"unet": 2_259_526_660, "vae": 83_653_863, "text_encoder_2": 694_659_840},
    "sd1": {"unet": 859_520_964, "vae": 83_653_863, "text_encoder": 123_060_480},
    "sd2": {"unet": 865_910_724, "vae": 83_653_863, "text_encoder": 340_387_840},
}


@pytest.mark.parametrize("family", list(REAL_SIZES))
def test_shipped_configs_describe_the_real_models(family):
    """Without config= a file is read with the configs maxdiff ships for its family; they
    describe the real models: every component has the real model's parameter count."""
    root = single_file.shipped_config(family)
    for name, count in REAL_SIZES[family].items():
        cfg = json.loads((root / name / "config.json").read_text())
        shapes = single_file._expected(name, cfg)
        assert sum(int(np.prod(s)) for s in shapes.values()) == count, name


def test_convert_both_ways_and_generate_from_a_single_file(model, tmp_path, capsys):
    """``maxdiff convert`` folder -> file -> folder keeps every weight (diffusers reads the
    result), and ``maxdiff generate --model FILE`` makes the folder's image."""
    root, original = model
    file, back = tmp_path / "m.safetensors", tmp_path / "back"
    assert cli.main(["convert", str(root / "folder"), str(file)]) == 0
    assert cli.main(["convert", str(file), str(back), "--single-file-config",
                     str(root / "folder")]) == 0
    assert cli.main(["convert", str(file), str(back), "--single-file-config",
                     str(root / "folder")]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    from diffusers import StableDiffusionXLPipeline

    again = StableDiffusionXLPipeline.from_pretrained(str(back))
    for name in COMPONENTS:
        want, got = getattr(original, name).state_dict(), getattr(again, name).state_dict()
        assert all(torch.equal(want[k], got[k]) for k in want), name
    outs = {}
    for label, model_args in (("folder", ["--model", str(root / "folder")]),
                              ("file", ["--model", str(file), "--single-file-config",
                                        str(root / "folder")])):
        out = tmp_path / label
        assert cli.main(["generate", "a red circle", "--steps", "2", "--seed", "3", "--quiet",
                         "--out", str(out), *model_args]) == 0
        png, = out.glob("*.png")
        outs[label] = np.asarray(__import__("PIL.Image").Image.open(png))
    assert np.array_equal(outs["folder"], outs["file"])
    assert cli.main(["info", "--json", "--model", str(file), "--single-file-config",
                     str(root / "folder")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "single file (Stable Diffusion XL base)"
    assert info["components"]["unet"]["weights"].endswith("(its UNet, model.diffusion_model.*)")
    shutil.rmtree(back)


def test_a_sampler_name_on_a_single_file(model):
    """A sampler name switches the scheduler config that describes the file: the shipped SDXL
    base one, or config='s (the folder the file came from); run configs pass the name on."""
    from maxdiff.schedulers import read_scheduler_config, resolve_scheduler, sampler_config
    from pipelines.config import RunConfig

    root, _ = model
    file = str(root / "model.safetensors")
    assert RunConfig(model=file, scheduler="unipc").pipeline_kwargs()["scheduler"] == "unipc"
    # the shipped configs describe the file when config= names none (as pipelines.loading does)
    shipped = single_file.inspect(file).scheduler_config(
        read_scheduler_config(single_file.shipped_config("sdxl-base") / "scheduler"))
    sched, _ = resolve_scheduler("unipc", shipped)
    want = sampler_config("unipc", shipped)
    assert {k: sched.config[k] for k in want} == want
    own = read_scheduler_config(root / "folder" / "scheduler")
    pipe = TextToImagePipeline.from_pretrained(file, config=str(root / "folder"),
                                               scheduler="DPM++ 2M Karras", compile_cache_dir=None)
    want = sampler_config("DPM++ 2M Karras", own)
    assert {k: pipe.scheduler.config[k] for k in want} == want
    assert pipe.scheduler.config["use_karras_sigmas"] is True
