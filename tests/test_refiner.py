"""The SDXL refiner against diffusers on tiny random base + refiner checkpoints: the refiner
folder (text_encoder_2 only, aesthetic-score time ids) as image-to-image, and diffusers'
ensemble of experts (base ``denoising_end=0.8`` -> refiner ``denoising_start=0.8``, no decode
in between) as two calls and as one call (one compiled program), for Euler and DPM++ 2M.

diffusers draws from one torch generator; the tests draw the same tensors and pass them to ours
(``latents=`` for the base's initial noise, ``noise=`` / ``image_latents_noise=`` for an
image-to-image run).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipelines import ImageToImagePipeline, TextToImagePipeline

SIZE = 32  # pixels; the tiny VAEs have a scale factor of 2: 16x16 latents
LAT = (4, SIZE // 2, SIZE // 2)
STEPS = 8
# (base steps, refiner steps) at 0.8, base steps at 0.6, for 8 steps of leading spacing: Euler's
# timesteps are 876, 751, ..., 126, 1; DPM++ 2M's 889, 778, ..., 223, 112 (cut at 200 and 400)
SPLITS = {"euler": (6, 2, 4), "dpmpp_2m": (7, 1, 5)}
TOL = 2e-3  # on [0, 1] pixels
DPM = {"_class_name": "DPMSolverMultistepScheduler", "algorithm_type": "dpmsolver++",
       "solver_order": 2}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _draws(seed: int, n: int, count: int) -> list[np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((n, *LAT), generator=g).numpy() for _ in range(count)]


def _image(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    coarse = rng.random((4, 4, 3))
    return (np.kron(coarse, np.ones((SIZE // 4, SIZE // 4, 1))) * 0.8
            + 0.2 * rng.random((SIZE, SIZE, 3))).astype(np.float32)


@pytest.fixture(scope="module")
def base(sdxl_dir):
    return TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)


@pytest.fixture(scope="module")
def refiner(refiner_dir):
    return ImageToImagePipeline.from_pretrained(refiner_dir, compile_cache_dir=None)


@pytest.fixture(scope="module")
def torch_pipes(sdxl_dir, refiner_dir):
    from diffusers import StableDiffusionXLImg2ImgPipeline, StableDiffusionXLPipeline

    b = StableDiffusionXLPipeline.from_pretrained(sdxl_dir)
    r = StableDiffusionXLImg2ImgPipeline.from_pretrained(refiner_dir)
    for p in (b, r):
        p.set_progress_bar_config(disable=True)
    return b, r


def _with_dpm(torch_pipe):
    from diffusers import DPMSolverMultistepScheduler

    cfg = {k: v for k, v in DPM.items() if not k.startswith("_")}
    return DPMSolverMultistepScheduler.from_config(torch_pipe.scheduler.config, **cfg)


def test_refiner_folder_loads_without_text_encoder_1(refiner_dir, refiner):
    index = json.loads((refiner_dir / "model_index.json").read_text())
    assert index["text_encoder"] == [None, None] and index["requires_aesthetics_score"] is True
    assert refiner.text_encoder is None and refiner.tokenizer is None
    assert refiner.requires_aesthetics_score and "text_encoder" not in refiner.params


@pytest.mark.parity
def test_refiner_img2img_matches_diffusers(refiner, torch_pipes):
    """The refiner alone on a picture (the strength path), with non-default aesthetic scores
    and a negative prompt: encoder 2 alone, five time ids."""
    _, theirs_pipe = torch_pipes
    post, noise = _draws(3, 1, 2)  # diffusers: the posterior sample, then add_noise's
    kw = dict(prompt="a red circle", image=_image(0), strength=0.6, num_inference_steps=5,
              guidance_scale=4.0, negative_prompt="blue", aesthetic_score=7.5,
              negative_aesthetic_score=2.0)
    ours = refiner(**kw, noise=noise, image_latents_noise=post, output_type="np").images
    with torch.no_grad():
        theirs = theirs_pipe(**kw, generator=torch.Generator().manual_seed(3),
                             output_type="np").images
    assert np.abs(ours - theirs).max() <= TOL


@pytest.mark.parity
@pytest.mark.parametrize("sampler", ["euler", "dpmpp_2m"])
def test_two_stage_matches_diffusers(base, refiner, torch_pipes, sampler):
    """diffusers' ensemble of experts, two calls each side: the base's latents at the cut and
    the refined pixels; then our one call (one program) gives the same pixels, and another cut
    reuses that program."""
    from maxdiff.schedulers import load_scheduler

    tb, tr = torch_pipes
    n_base, n_refiner, n_base_06 = SPLITS[sampler]
    (noise,) = _draws(11, 2, 1)
    kw = dict(prompt=["a photo of a cat", "green square"], num_inference_steps=STEPS,
              guidance_scale=5.0)
    ref, old_sched, old_tb, old_tr = refiner, base.scheduler, tb.scheduler, tr.scheduler
    if sampler == "dpmpp_2m":
        base.scheduler = load_scheduler({**dict(tb.scheduler.config), **DPM})
        ref = ImageToImagePipeline.from_pipe(refiner)
        ref.scheduler = load_scheduler({**dict(tr.scheduler.config), **DPM})
        tb.scheduler, tr.scheduler = _with_dpm(tb), _with_dpm(tr)
    try:
        with torch.no_grad():
            t_lat = tb(**kw, latents=torch.from_numpy(noise), denoising_end=0.8,
                       output_type="latent").images
            theirs = tr(**kw, image=t_lat, denoising_start=0.8, output_type="np").images
        lat = base(**kw, latents=noise, denoising_end=0.8, output_type="latent")
        assert lat.images.shape == (2, *LAT) and lat.timings["base_steps"] == n_base
        assert np.abs(lat.images - t_lat.numpy()).max() <= 5e-4  # latents of size ~1: 7e-5
        two = ref(**kw, image=lat.images, denoising_start=0.8, output_type="np")
        assert two.timings["denoising_steps"] == n_refiner
        assert np.abs(two.images - theirs).max() <= TOL

        base.set_refiner(ref)
        before = base.num_compiled
        one = base(**kw, latents=noise, output_type="np")  # high_noise_frac 0.8
        assert (one.timings["base_steps"], one.timings["refiner_steps"]) == (n_base, n_refiner)
        assert np.abs(one.images - theirs).max() <= TOL
        assert np.abs(one.images - two.images).max() <= 1e-5
        other = base(**kw, latents=noise, output_type="np", denoising_end=0.6)
        assert other.timings["base_steps"] == n_base_06 and base.num_compiled == before + 1
        assert np.abs(other.images - one.images).max() > 1e-3
    finally:
        base.set_refiner(None)
        base.scheduler, tb.scheduler, tr.scheduler = old_sched, old_tb, old_tr


@pytest.mark.parametrize("kw, match", [
    (dict(denoising_end=1.0), r"denoising_end=1\.0: must be a number in \(0, 1\)"),
    (dict(denoising_end=0.05), "denoising_end=0.05: leaves the base no denoising step"),
    (dict(denoising_end=0.8, output_type="latent", aesthetic_score=11),
     r"aesthetic_score=11: must be a number in \[0, 10\]"),
    (dict(output_type="latents"), "output_type='latents': must be .*'latent'"),
])
def test_base_two_stage_errors_name_the_field(base, kw, match):
    with pytest.raises(ValueError, match=match):
        base("a cat", num_inference_steps=STEPS, height=SIZE, width=SIZE, **kw)


def test_refiner_start_errors(refiner):
    lat = np.zeros((1, *LAT), np.float32)
    with pytest.raises(ValueError, match=r"denoising_start=0\.999: leaves the refiner no"):
        refiner("a cat", image=lat, denoising_start=0.999, num_inference_steps=STEPS)
    with pytest.raises(ValueError, match=r"image latents have shape \(1, 3, 16, 16\)"):
        refiner("a cat", image=lat[:, :3], denoising_start=0.8, num_inference_steps=STEPS)


def test_a_refiner_single_file_loads_as_its_folder(tmp_path, capsys):
    """The refiner in the original single-file layout (``sd_xl_refiner_1.0.safetensors``:
    OpenCLIP bigG under ``conditioner.embedders.0.model.*``): diffusers' ``from_single_file``
    reads the file maxdiff writes to the folder's weights (the oracle of the key map), maxdiff
    reads it to the folder's pixels, ``maxdiff convert`` turns it back into a folder, and the CLI
    takes the file as ``--refiner`` (read with the
    shipped refiner configs, which describe the real 2.26 B-parameter UNet, not this one). The
    tiny refiner has the real one's UNet layout: four levels, attention in the middle two."""
    import tiny
    from diffusers import StableDiffusionXLImg2ImgPipeline

    from maxdiff import single_file
    from maxdiff.checkpoint import SafetensorsFile
    from pipelines import cli

    refiner_dir, file = tmp_path / "refiner", tmp_path / "refiner.safetensors"
    tiny.make_sdxl_refiner(refiner_dir, unet_layout=tiny.REFINER_LAYOUT)
    single_file.export(refiner_dir, file)
    keys = SafetensorsFile(file).keys()
    assert "conditioner.embedders.0.model.transformer.resblocks.0.attn.in_proj_weight" in keys
    assert "model.diffusion_model.label_emb.0.0.weight" in keys
    unet = "model.diffusion_model."  # levels 1 and 2 attend, four layers deep; level 3 does not
    assert unet + "input_blocks.7.1.transformer_blocks.3.attn2.to_k.weight" in keys
    assert unet + "output_blocks.3.1.transformer_blocks.3.ff.net.2.weight" in keys
    assert not any(k.startswith((unet + "input_blocks.10.1.", unet + "output_blocks.0.1."))
                   for k in keys)
    assert not any(k.startswith("conditioner.embedders.1.") for k in keys)
    theirs = StableDiffusionXLImg2ImgPipeline.from_single_file(
        str(file), config=str(refiner_dir), local_files_only=True)
    original = StableDiffusionXLImg2ImgPipeline.from_pretrained(refiner_dir)
    for name in ("unet", "vae", "text_encoder_2"):
        want, got = getattr(original, name).state_dict(), getattr(theirs, name).state_dict()
        assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want), name

    ours = ImageToImagePipeline.from_single_file(file, config=refiner_dir,
                                                 compile_cache_dir=None)
    kw = dict(prompt="a red circle", image=_image(1), strength=0.6, num_inference_steps=3,
              guidance_scale=4.0, seed=2, output_type="np")
    folder = ImageToImagePipeline.from_pretrained(refiner_dir, compile_cache_dir=None)
    assert np.array_equal(ours(**kw).images, folder(**kw).images)

    back = tmp_path / "back"  # and back to a folder diffusers loads to the same weights
    assert cli.main(["convert", str(file), str(back), "--single-file-config",
                     str(refiner_dir)]) == 0
    again = StableDiffusionXLImg2ImgPipeline.from_pretrained(back)
    assert again.text_encoder is None
    for name in ("unet", "vae", "text_encoder_2"):
        want, got = getattr(original, name).state_dict(), getattr(again, name).state_dict()
        assert all(torch.equal(want[k], got[k]) for k in want), name

    code = cli.main(["generate", "a cat", "--model", str(refiner_dir), "--refiner", str(file),
                     "--steps", "2", "--out", str(tmp_path / "out")])
    assert code == 2
    assert ("shipped Stable Diffusion XL refiner configs do not describe this file"
            in capsys.readouterr().err)


def test_run_config_cli_and_serve_args_take_a_refiner(tmp_path):
    """The run config keys (what the CLI's --refiner / --high-noise-frac and the serve args
    set), their ranges, and engine=step's refusal (its program has no refiner stage)."""
    from pipelines.cli import build_parser
    from pipelines.config import load_run_config
    from serving.settings import ServeSettings

    cfg = load_run_config(None, ["refiner=/models/refiner", "high_noise_frac=0.7"])
    kw = cfg.pipeline_kwargs()
    assert (kw["refiner"], kw["high_noise_frac"]) == ("/models/refiner", 0.7)
    with pytest.raises(ValueError, match="high_noise_frac"):
        load_run_config(None, ["high_noise_frac=1.0"])
    args = build_parser().parse_args(["generate", "a cat", "--refiner", str(tmp_path),
                                      "--high-noise-frac", "0.75"])
    assert (args.refiner, args.high_noise_frac) == (str(tmp_path), 0.75)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "a cat", "--high-noise-frac", "1"])
    served = ServeSettings.from_args({"refiner": "/models/refiner", "high_noise_frac": "0.7"})
    assert served.run_overrides == {"refiner": "/models/refiner", "high_noise_frac": 0.7}
    with pytest.raises(ValueError, match="engine=step does not run an SDXL refiner"):
        ServeSettings.from_args({"refiner": "/models/refiner", "engine": "step"})
