"""Stable Diffusion 1.x and 2.x (one CLIP text encoder, no added conditioning) through the same
pipeline as SDXL, against diffusers' StableDiffusionPipeline / StableDiffusionImg2ImgPipeline on
tiny checkpoints: diffusers folders and single files in the original layout."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tiny
import torch

from maxdiff import single_file
from maxdiff.checkpoint import SafetensorsFile
from pipelines import ImageToImagePipeline, TextToImagePipeline, cli

SIZE = 32  # the tiny VAE's scale factor is 2: 16x16 latents
TOL = 2e-3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"sd1": folder, "sd2": folder}: SD 1.x, and 2.x-like (v-prediction DDIM, linear
    projections, upcast_attention, gelu text encoder, "!" padding), plus their single files."""
    root = tmp_path_factory.mktemp("tiny-sd")
    out = {}
    for name, v2 in (("sd1", False), ("sd2", True)):
        tiny.make_sd_pipeline(root / name, v2=v2, seed=4 if v2 else 3)
        single_file.export(root / name, root / f"{name}.safetensors")
        out[name] = root / name
    return out


def _diffusers(folder, cls_name="StableDiffusionPipeline", scheduler=None):
    import diffusers

    p = getattr(diffusers, cls_name).from_pretrained(str(folder))
    if scheduler is not None:
        p.scheduler = scheduler
    p.set_progress_bar_config(disable=True)
    return p


def _latents(n, h=SIZE, w=SIZE, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 4, h // 2, w // 2)).astype(np.float32)


def _compare(ours, theirs, lat, **kw):
    mine = ours(**kw, latents=lat, output_type="np").images
    with torch.no_grad():
        ref = theirs(**kw, latents=torch.from_numpy(lat), output_type="np").images
    assert mine.shape == ref.shape
    return float(np.abs(mine - ref).max())


SCHEDULERS = {  # maxdiff config overrides; diffusers class of the same name
    "PNDMScheduler": {},
    "EulerDiscreteScheduler": {},
    "DDIMScheduler": {"clip_sample": False},
    "DPMSolverMultistepScheduler": {"algorithm_type": "dpmsolver++"},
}


@pytest.mark.parity
@pytest.mark.parametrize("family, scheduler", [
    ("sd1", "PNDMScheduler"), ("sd1", "EulerDiscreteScheduler"),
    ("sd1", "DPMSolverMultistepScheduler"), ("sd2", "DDIMScheduler")])
# (the samplers themselves are tested in test_schedulers.py; PNDM makes steps + 1 model calls)
def test_sd_parity_schedulers_cfg_and_sizes(folders, family, scheduler):
    """CFG with a negative prompt (and an omitted one, which SD encodes as ""), CFG off, and a
    non-square size."""
    import diffusers

    folder = folders[family]
    base = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    config = {**base, **SCHEDULERS[scheduler], "_class_name": scheduler}
    ours = TextToImagePipeline.from_pretrained(folder, scheduler=config, compile_cache_dir=None)
    theirs = _diffusers(folder, scheduler=getattr(diffusers, scheduler).from_config(config))
    assert ours.text_encoder_2 is None and ours.default_guidance == 7.5
    cfg = dict(prompt=["a red circle on a blue background", "the cat!"],
               negative_prompt=["blurry", ""], num_inference_steps=4, guidance_scale=6.0,
               height=SIZE, width=SIZE)
    assert _compare(ours, theirs, _latents(2), **cfg) <= TOL
    off = dict(prompt="a photo of a dog", num_inference_steps=3, guidance_scale=1.0,
               height=48, width=SIZE)
    assert _compare(ours, theirs, _latents(1, 48, SIZE, seed=1), **off) <= TOL


@pytest.mark.parity
def test_sd2_v_prediction_zero_snr_and_guidance_rescale(folders):
    """SD 2.1-style v-prediction with trailing zero-terminal-SNR DDIM and guidance rescale
    (Lin et al. 2023), the settings diffusers recommends for such models."""
    import diffusers

    folder = folders["sd2"]
    base = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    config = {**base, "rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}
    ours = TextToImagePipeline.from_pretrained(folder, scheduler=config, compile_cache_dir=None)
    theirs = _diffusers(folder, scheduler=diffusers.DDIMScheduler.from_config(config))
    kw = dict(prompt=["a red circle", "a blue square"], num_inference_steps=4,
              guidance_scale=7.5, guidance_rescale=0.7, height=SIZE, width=SIZE)
    assert _compare(ours, theirs, _latents(2, seed=2), **kw) <= TOL


@pytest.mark.parity
@pytest.mark.parametrize("family", ["sd1", "sd2"])
def test_sd_single_file_is_read_back_by_diffusers_and_matches(folders, family):
    """maxdiff writes the original layout (cond_stage_model.transformer.* for 1.x,
    cond_stage_model.model.* OpenCLIP for 2.x); diffusers' from_single_file reads it back to
    the same weights, and maxdiff's images from the file equal diffusers' from it."""
    from diffusers import StableDiffusionPipeline

    folder = folders[family]
    file = folder.parent / f"{family}.safetensors"
    prefix = "cond_stage_model.model." if family == "sd2" else "cond_stage_model.transformer."
    assert any(k.startswith(prefix) for k in SafetensorsFile(file).keys())
    assert single_file.inspect(file).family.name == family
    original = _diffusers(folder)
    theirs = StableDiffusionPipeline.from_single_file(str(file), config=str(folder),
                                                      local_files_only=True)
    theirs.set_progress_bar_config(disable=True)
    for name in ("unet", "vae", "text_encoder"):
        want, got = getattr(original, name).state_dict(), getattr(theirs, name).state_dict()
        assert set(want) == set(got), name
        assert all(torch.equal(want[k], got[k]) for k in want), name
    ours = TextToImagePipeline.from_single_file(file, config=folder, compile_cache_dir=None)
    kw = dict(prompt="a red circle", num_inference_steps=3, guidance_scale=6.0,
              height=SIZE, width=SIZE)
    assert _compare(ours, theirs, _latents(1, seed=3), **kw) <= TOL


def test_sd2_file_with_openclip_h_layer_24_and_projection_loads(folders, tmp_path):
    """Real SD 2.x files hold OpenCLIP-H's 24 blocks and its projection, while diffusers' text
    encoder stops at block 23 (the penultimate layer): those keys are expected, not errors."""
    folder = folders["sd2"]
    src = SafetensorsFile(folder.parent / "sd2.safetensors")
    tensors = {k: src.get(k) for k in src.keys()}
    last = "cond_stage_model.model.transformer.resblocks.4."  # tiny: 5 blocks in the config
    for k in [k for k in tensors if k.startswith(last)]:
        tensors[k.replace(".resblocks.4.", ".resblocks.5.")] = tensors[k]
    tensors["cond_stage_model.model.text_projection"] = np.zeros((32, 16), np.float32)
    from maxdiff.checkpoint import save_safetensors

    save_safetensors(tensors, tmp_path / "sd2-full.safetensors")
    a = TextToImagePipeline.from_single_file(tmp_path / "sd2-full.safetensors", config=folder,
                                             compile_cache_dir=None)
    b = TextToImagePipeline.from_pretrained(folder, compile_cache_dir=None)
    kw = dict(prompt="a red circle", num_inference_steps=2, seed=1, output_type="np")
    assert np.array_equal(a(**kw).images, b(**kw).images)


@pytest.mark.parity
def test_sd1_img2img_parity(folders):
    """Image-to-image on SD 1.x (its PNDM: strength 0.6 of 5 steps runs 4 of the 6 model
    calls) against StableDiffusionImg2ImgPipeline (the posterior sample and add-noise noise
    drawn in diffusers' order from one generator)."""
    folder = folders["sd1"]
    ours = ImageToImagePipeline.from_pretrained(folder, compile_cache_dir=None)
    theirs = _diffusers(folder, "StableDiffusionImg2ImgPipeline")
    from PIL import Image

    img = Image.fromarray((np.random.default_rng(5).random((SIZE, SIZE, 3)) * 255
                           ).astype(np.uint8))
    g = torch.Generator().manual_seed(6)
    post, noise = (torch.randn((1, 4, SIZE // 2, SIZE // 2), generator=g).numpy()
                   for _ in range(2))
    kw = dict(prompt="a red circle", image=img, strength=0.6, num_inference_steps=5,
              guidance_scale=4.0)
    mine = ours(**kw, noise=noise, image_latents_noise=post, output_type="np")
    assert type(ours.scheduler).__name__ == "PNDMScheduler"
    assert mine.timings["denoising_steps"] == 4
    with torch.no_grad():
        ref = theirs(**kw, generator=torch.Generator().manual_seed(6), output_type="np").images
    assert np.abs(mine.images - ref).max() <= TOL


def test_the_step_engine_refuses_pndm_by_name(folders):
    from pipelines.step_engine import StepEngine

    pipe = TextToImagePipeline.from_pretrained(folders["sd1"], compile_cache_dir=None)
    with pytest.raises(ValueError, match="PNDMScheduler makes more model calls than steps"):
        StepEngine(pipe, slots=1, height=SIZE, width=SIZE)


def test_sd_through_the_cli(folders, tmp_path, capsys):
    """``maxdiff generate`` and ``info`` on an SD 1.x single file."""
    file = folders["sd1"].parent / "sd1.safetensors"
    out = tmp_path / "out"
    args = ["--model", str(file), "--single-file-config", str(folders["sd1"])]
    assert cli.main(["generate", "a red circle", "--steps", "2", "--seed", "1", "--quiet",
                     "--out", str(out), *args]) == 0
    assert len(list(out.glob("*.png"))) == 1
    assert cli.main(["info", "--json", *args]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "single file (Stable Diffusion 1.x)"
    assert set(info["components"]) == {"unet", "vae", "text_encoder"}


@pytest.mark.parity
def test_sd1_lora_parity(folders, tmp_path):
    """A LoRA on SD 1.x's UNet (diffusers/PEFT keys), fused, against diffusers'
    load_lora_weights; it changes the image."""
    folder = folders["sd1"]
    lora = tiny.make_sdxl_lora(folder, tmp_path / "lora.safetensors", seed=3)
    ours = TextToImagePipeline.from_pretrained(folder, compile_cache_dir=None)
    lat = _latents(1, seed=4)
    kw = dict(prompt="a red circle", num_inference_steps=3, guidance_scale=6.0,
              height=SIZE, width=SIZE)
    before = ours(**kw, latents=lat, output_type="np").images
    ours.load_lora_weights(lora)
    theirs = _diffusers(folder)
    theirs.load_lora_weights(str(lora))
    assert _compare(ours, theirs, lat, **kw) <= TOL
    assert np.abs(ours(**kw, latents=lat, output_type="np").images - before).max() > 1e-2


def test_the_step_engine_runs_sd2_like_the_pipeline(folders):
    """engine=step on SD 2.x (v-prediction DDIM): images that share ticks equal the
    pipeline's batch for the same requests."""
    from pipelines.requests import ImageRequest
    from pipelines.step_engine import StepEngine

    pipe = TextToImagePipeline.from_pretrained(folders["sd2"], compile_cache_dir=None)
    eng = StepEngine(pipe, SIZE, SIZE, slots=2, output_type="np")
    reqs = [ImageRequest("a red circle", seed=1, guidance_scale=5.0),
            ImageRequest("a blue square", seed=2, guidance_scale=0.0)]
    handles = [eng.submit(r, 3) for r in reqs]
    eng.run_until_idle()
    ref = pipe.generate(reqs, height=SIZE, width=SIZE, num_inference_steps=3,
                        output_type="np").images
    for h, im in zip(handles, ref):
        np.testing.assert_allclose(h.image, im, atol=1e-5)


@pytest.mark.parity
def test_sd1_inpaint_with_pndm_parity(folders):
    """Inpainting on SD 1.x's base UNet (4 channels, the unmasked latents reset each call) with
    its PNDM, against StableDiffusionInpaintPipeline (posterior draw, then the noise)."""
    from PIL import Image

    from pipelines import InpaintPipeline

    folder = folders["sd1"]
    ours = InpaintPipeline.from_pretrained(folder, compile_cache_dir=None)
    theirs = _diffusers(folder, "StableDiffusionInpaintPipeline")
    img = Image.fromarray((np.random.default_rng(7).random((SIZE, SIZE, 3)) * 255
                           ).astype(np.uint8))
    mask = np.full((SIZE, SIZE), 0.2, np.float32)
    mask[8:24, 6:20] = 0.9
    g = torch.Generator().manual_seed(8)
    post, noise = (torch.randn((1, 4, SIZE // 2, SIZE // 2), generator=g).numpy()
                   for _ in range(2))
    kw = dict(prompt="a green square", image=img, mask_image=mask, strength=0.75,
              num_inference_steps=4, guidance_scale=5.0)
    mine = ours(**kw, noise=noise, image_latents_noise=post, output_type="np").images
    with torch.no_grad():
        ref = theirs(**kw, height=SIZE, width=SIZE, generator=torch.Generator().manual_seed(8),
                     output_type="np").images
    assert np.abs(mine - ref).max() <= TOL


@pytest.mark.parity
def test_sd1_kohya_lora_matches_diffusers(folders, tmp_path):
    """An SD 1.5 LoRA in kohya's names (lora_unet_<module with _>, lora_down / lora_up,
    alpha), as A1111 / civitai files are: diffusers reads the same file to the same images."""
    from maxdiff.checkpoint import save_safetensors

    folder = folders["sd1"]
    peft = SafetensorsFile(tiny.make_sdxl_lora(folder, tmp_path / "peft.safetensors", seed=5))
    kohya = {}
    for key in peft.keys():  # unet.<module>.lora_A.weight
        module, ab = key[len("unet."):].rsplit(".lora_", 1)
        name = "lora_unet_" + module.replace(".", "_")
        kohya[f"{name}.lora_{'down' if ab.startswith('A') else 'up'}.weight"] = peft.get(key)
        kohya[f"{name}.alpha"] = np.array(2.0, np.float32)  # rank 4: scale 0.5
    save_safetensors(kohya, tmp_path / "kohya.safetensors")
    ours = TextToImagePipeline.from_pretrained(folder, compile_cache_dir=None)
    ours.load_lora_weights(tmp_path / "kohya.safetensors")
    theirs = _diffusers(folder)
    theirs.load_lora_weights(str(tmp_path / "kohya.safetensors"))
    kw = dict(prompt="a red circle", num_inference_steps=3, guidance_scale=6.0,
              height=SIZE, width=SIZE)
    assert _compare(ours, theirs, _latents(1, seed=6), **kw) <= TOL


@pytest.mark.parity
def test_sd2_from_a_float16_single_file(folders, tmp_path):
    """An fp16 single file (how SD files ship) gives diffusers' images from the same file."""
    from diffusers import StableDiffusionPipeline

    folder = folders["sd2"]
    file = tmp_path / "sd2-fp16.safetensors"
    single_file.export(folder, file, dtype="float16")
    ours = TextToImagePipeline.from_single_file(file, config=folder, compile_cache_dir=None)
    theirs = StableDiffusionPipeline.from_single_file(str(file), config=str(folder),
                                                      local_files_only=True,
                                                      torch_dtype=torch.float32)
    theirs.set_progress_bar_config(disable=True)
    kw = dict(prompt="a red circle", num_inference_steps=3, guidance_scale=6.0,
              height=SIZE, width=SIZE)
    assert _compare(ours, theirs, _latents(1, seed=7), **kw) <= TOL
