"""Image-to-image and inpainting against diffusers' StableDiffusionXLImg2ImgPipeline and
StableDiffusionXLInpaintPipeline on tiny random checkpoints, with the same noise.

diffusers draws from one torch generator in a fixed order (VAE posterior sample(s), then the
add-noise noise; see each test); the tests draw the same tensors from a generator with the same
seed and pass them to ours as ``image_latents_noise`` / ``noise`` /
``masked_image_latents_noise``.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import tiny
import torch

from pipelines import ImageToImagePipeline, InpaintPipeline, TextToImagePipeline
from pipelines.edit import start_step
from pipelines.requests import ImageRequest

SIZE = 32  # pixels; the tiny VAE has a scale factor of 2, so 16x16 latents
LAT = (4, SIZE // 2, SIZE // 2)
TOL = 2e-3  # on [0, 1] pixels; measured 1.7e-6 .. 6.1e-6 (CPU, float32)


def _image(seed: int) -> np.ndarray:
    """A smooth random picture, float32 (H, W, 3) in [0, 1]."""
    rng = np.random.default_rng(seed)
    coarse = rng.random((4, 4, 3))
    return np.kron(coarse, np.ones((SIZE // 4, SIZE // 4, 1))).astype(np.float32) * 0.8 + \
        0.2 * rng.random((SIZE, SIZE, 3)).astype(np.float32)


def _mask() -> np.ndarray:
    """White (repaint) in the middle, float32 (H, W) in [0, 1] (values on both sides of 0.5)."""
    m = np.full((SIZE, SIZE), 0.2, np.float32)
    m[8:24, 6:20] = 0.9
    return m


def _draws(seed: int, n: int, count: int) -> list[np.ndarray]:
    """``count`` standard normal (n, 4, 16, 16) tensors, in diffusers' order from one generator."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((n, *LAT), generator=g).numpy() for _ in range(count)]


def _gen(seed: int):
    return torch.Generator().manual_seed(seed)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pipe(sdxl_dir):
    return ImageToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)


@pytest.fixture(scope="module")
def torch_img2img(sdxl_dir):
    from diffusers import StableDiffusionXLImg2ImgPipeline

    p = StableDiffusionXLImg2ImgPipeline.from_pretrained(sdxl_dir).to("cpu")
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def torch_inpaint(torch_img2img):
    from diffusers import StableDiffusionXLInpaintPipeline

    p = StableDiffusionXLInpaintPipeline.from_pipe(torch_img2img)
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def inpaint9_dir(sdxl_dir, tmp_path_factory):
    """The tiny SDXL folder with a 9-channel inpainting UNet (diffusers, torch seed 3)."""
    root = tmp_path_factory.mktemp("tiny-sdxl-inpaint9")
    shutil.copytree(sdxl_dir, root, dirs_exist_ok=True)
    shutil.rmtree(root / "unet")
    tiny.make_unet(root / "unet", dict(tiny.SDXL_UNET, in_channels=9), seed=3)
    assert json.loads((root / "unet" / "config.json").read_text())["in_channels"] == 9
    return root


def _theirs(torch_pipe, **kw):
    with torch.no_grad():
        return torch_pipe(output_type="np", **kw).images


def test_vae_image_to_latents_with_given_posterior_noise(sdxl_dir):
    """image_to_latents(x, noise=eps) = scaling_factor * (mean + std * eps), diffusers'
    retrieve_latents with a generator; without key and noise it is still the posterior mean."""
    import jax.numpy as jnp
    from diffusers import AutoencoderKL

    from maxdiff.models.vae import load_vae

    vae, params = load_vae(sdxl_dir / "vae")
    theirs_vae = AutoencoderKL.from_pretrained(sdxl_dir / "vae").eval()
    x = np.stack([_image(0), _image(1)]) * 2 - 1
    eps = _draws(1, 2, 1)[0]
    with torch.no_grad():
        dist = theirs_vae.encode(torch.from_numpy(x.transpose(0, 3, 1, 2))).latent_dist
        want = theirs_vae.config.scaling_factor * dist.sample(_gen(1))
        want_mean = theirs_vae.config.scaling_factor * dist.mean
    got = vae.apply({"params": params}, jnp.asarray(x), None, jnp.asarray(eps.transpose(0, 2, 3, 1)),
                    method=vae.image_to_latents)
    mean = vae.apply({"params": params}, jnp.asarray(x), method=vae.image_to_latents)
    np.testing.assert_allclose(np.asarray(got).transpose(0, 3, 1, 2), want.numpy(), atol=1e-4)
    np.testing.assert_allclose(np.asarray(mean).transpose(0, 3, 1, 2), want_mean.numpy(), atol=1e-4)
    assert np.abs(want - want_mean).max() > 1e-2


def test_start_step_is_diffusers_rule():
    assert [start_step(5, s) for s in (0.2, 0.3, 0.6, 0.9999, 1.0)] == [4, 4, 2, 1, 0]
    assert start_step(50, 0.3) == 35


@pytest.mark.parity
def test_img2img_three_strengths_one_program(pipe, torch_img2img):
    """Euler (the checkpoint's, leading spacing): strengths 0.3, 0.6, 1.0 (1, 3 and 5 of 5
    steps) with CFG; one compiled program serves all three (the start step is traced)."""
    img = _image(0)
    outs = []
    before = pipe.num_compiled
    for strength in (0.3, 0.6, 1.0):
        post, noise = _draws(5, 1, 2)  # retrieve_latents (posterior sample), then add_noise's
        kw = dict(prompt="a red circle", image=img, strength=strength, num_inference_steps=5,
                  guidance_scale=4.0)
        ours = pipe(**kw, noise=noise, image_latents_noise=post, output_type="np")
        theirs = _theirs(torch_img2img, **kw, generator=_gen(5))
        assert ours.images.shape == theirs.shape == (1, SIZE, SIZE, 3)
        assert ours.timings["denoising_steps"] == int(5 * strength)
        assert np.abs(ours.images - theirs).max() <= TOL, strength
        outs.append(ours.images)
    assert pipe.num_compiled == before + 1
    # the posterior sample matters (its std is not ~0 on this VAE), so parity checks its draw
    again = pipe(**kw, noise=noise, image_latents_noise=np.zeros_like(post), output_type="np")
    assert np.abs(again.images - outs[-1]).max() > 1e-2
    # the strength really changes the result (a random VAE does not reconstruct the image, so
    # closeness to the input says nothing here)
    assert min(np.abs(outs[i] - outs[j]).max() for i, j in ((0, 1), (1, 2), (0, 2))) > 1e-2


@pytest.mark.slow  # default-suite time: make test-slow runs it
@pytest.mark.parity
def test_img2img_batch_pil_negative_prompts(pipe, torch_img2img):
    """Two prompts with one PIL image each, negative prompts, guidance rescale."""
    from PIL import Image

    imgs = [Image.fromarray((_image(s) * 255).round().astype(np.uint8)) for s in (1, 2)]
    post, noise = _draws(7, 2, 2)
    kw = dict(prompt=["a photo of a dog", "blue square!"], image=imgs, strength=0.7,
              num_inference_steps=4, guidance_scale=6.0, negative_prompt=["blurry", "red"],
              guidance_rescale=0.5)
    ours = pipe(**kw, noise=noise, image_latents_noise=post, output_type="np").images
    theirs = _theirs(torch_img2img, **kw, generator=_gen(7))
    assert np.abs(ours - theirs).max() <= TOL


@pytest.mark.slow  # default-suite time: make test-slow runs it
@pytest.mark.parity
def test_img2img_dpmpp_2m(pipe, torch_img2img, sdxl_dir):
    """DPM++ 2M (Karras sigmas) shares the loaded weights through from_pipe."""
    from diffusers import DPMSolverMultistepScheduler

    from maxdiff.schedulers import load_scheduler

    extra = {"use_karras_sigmas": True, "algorithm_type": "dpmsolver++", "solver_order": 2}
    base = dict(torch_img2img.scheduler.config)
    dpm = ImageToImagePipeline.from_pipe(pipe)
    dpm.scheduler = load_scheduler({**base, **extra, "_class_name": "DPMSolverMultistepScheduler"})
    assert dpm.params is pipe.params
    post, noise = _draws(9, 1, 2)
    kw = dict(prompt="a white triangle", image=_image(3), strength=0.6, num_inference_steps=6,
              guidance_scale=3.0)
    ours = dpm(**kw, noise=noise, image_latents_noise=post, output_type="np").images
    old = torch_img2img.scheduler
    torch_img2img.scheduler = DPMSolverMultistepScheduler.from_config(base, **extra)
    try:
        theirs = _theirs(torch_img2img, **kw, generator=_gen(9))
    finally:
        torch_img2img.scheduler = old
    assert np.abs(ours - theirs).max() <= TOL


@pytest.mark.parity
def test_inpaint_4_channel_unet(pipe, torch_inpaint):
    """A 4-channel UNet: the unmasked latents are reset each step. diffusers encodes the image
    (posterior draw), then draws the noise (then encodes the masked image: unused here). At
    strength 1 the latents start from pure noise."""
    inpaint = InpaintPipeline.from_pipe(pipe)
    assert inpaint.params is pipe.params
    img, mask = _image(4), _mask()
    outs = {}
    for strength in (0.75, 1.0):
        post, noise = _draws(11, 1, 2)
        kw = dict(prompt="a green square", image=img, mask_image=mask, strength=strength,
                  num_inference_steps=4, guidance_scale=5.0)
        ours = inpaint(**kw, noise=noise, image_latents_noise=post, output_type="np").images
        theirs = _theirs(torch_inpaint, **kw, height=SIZE, width=SIZE, generator=_gen(11))
        assert np.abs(ours - theirs).max() <= TOL, strength
        outs[strength] = ours
    assert inpaint.num_compiled == 1
    assert np.abs(outs[0.75] - outs[1.0]).max() > 1e-2


@pytest.mark.parity
def test_inpaint_9_channel_unet(inpaint9_dir):
    """A 9-channel inpainting UNet gets [latents, mask, masked-image latents]. diffusers' draws:
    strength < 1: image posterior, noise, masked-image posterior; strength 1: noise, masked-image
    posterior (the image is not encoded)."""
    from diffusers import StableDiffusionXLInpaintPipeline
    from PIL import Image

    ours_pipe = InpaintPipeline.from_pretrained(inpaint9_dir, compile_cache_dir=None)
    assert ours_pipe.unet_channels == 9 and ours_pipe.latent_channels == 4
    theirs_pipe = StableDiffusionXLInpaintPipeline.from_pretrained(inpaint9_dir).to("cpu")
    theirs_pipe.set_progress_bar_config(disable=True)
    img = _image(6)
    mask = Image.fromarray((_mask() * 255).astype(np.uint8))  # a PIL mask ("L")
    for strength in (0.6, 1.0):
        if strength < 1:
            post, noise, masked_post = _draws(13, 1, 3)
        else:
            noise, masked_post = _draws(13, 1, 2)
            post = None
        kw = dict(prompt="a black cat", image=img, mask_image=mask, strength=strength,
                  num_inference_steps=5, guidance_scale=4.0, negative_prompt="white")
        ours = ours_pipe(**kw, noise=noise, image_latents_noise=post,
                         masked_image_latents_noise=masked_post, output_type="np").images
        theirs = _theirs(theirs_pipe, **kw, height=SIZE, width=SIZE, generator=_gen(13))
        assert np.abs(ours - theirs).max() <= TOL, strength


@pytest.mark.slow  # default-suite time: make test-slow runs it
def test_seeded_noise_is_deterministic(pipe):
    img = _image(8)
    kw = dict(prompt=["a red circle", "a blue square"], image=img, strength=0.5,
              num_inference_steps=2, guidance_scale=2.0, output_type="np")
    a = pipe(**kw, seed=[3, 4])
    b = pipe(**kw, seed=[3, 4])
    assert a.seeds == [3, 4]
    np.testing.assert_array_equal(a.images, b.images)
    assert np.abs(a.images[0] - a.images[1]).max() > 1e-3
    c = pipe(**{**kw, "prompt": "a red circle"}, seed=3)  # alone = in a batch
    np.testing.assert_allclose(c.images[0], a.images[0], atol=1e-5)


@pytest.mark.parametrize("strength", [0, 0.0, -0.1, 1.5, float("nan"), "0.5", True])
def test_strength_out_of_range(pipe, strength):
    with pytest.raises(ValueError, match=r"strength=.*\(0, 1\]"):
        pipe("a cat", image=_image(0), strength=strength, num_inference_steps=4)


def test_strength_too_small_for_steps(pipe):
    with pytest.raises(ValueError, match=r"strength=0.1: with 5 step\(s\) leaves no"):
        pipe("a cat", image=_image(0), strength=0.1, num_inference_steps=5)


def test_mask_size_must_match_image(pipe):
    inpaint = InpaintPipeline.from_pipe(pipe)
    mask = np.ones((24, 32), np.float32)
    with pytest.raises(ValueError, match=r"mask_image is 32x24 but image is 32x32"):
        inpaint("a cat", image=_image(0), mask_image=mask)
    with pytest.raises(ValueError, match=r"mask_image is required"):
        inpaint("a cat", image=_image(0))


@pytest.mark.parametrize("kw, match", [
    (dict(image=None), r"image is required"),
    (dict(image="x.png"), r"image must be a PIL image"),
    (dict(image=np.zeros((32, 32), np.float32)), r"image array has shape \(32, 32\)"),
    (dict(image=np.full((32, 32, 3), 2.0, np.float32)), r"values in \[2.0, 2.0\]"),
    (dict(image=[_image(0), _image(1)]), r"image has 2 entries but prompt has 1"),
    (dict(noise=np.zeros((1, 4, 8, 8), np.float32)), r"noise has shape \(1, 4, 8, 8\).*\(1, 4, 16, 16\)"),
    (dict(height=31), r"height=31"),
])
def test_bad_arguments(pipe, kw, match):
    kw = {"prompt": "a cat", "image": _image(0), **kw}
    with pytest.raises(ValueError, match=match):
        pipe(**kw)


def test_from_pipe_shares_text_to_image_weights(sdxl_dir):
    t2i = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    i2i = ImageToImagePipeline.from_pipe(t2i)
    inp = InpaintPipeline.from_pipe(i2i)
    assert i2i.params is t2i.params and inp.params is t2i.params
    assert isinstance(inp, InpaintPipeline) and inp.programs is not t2i.programs


def test_edit_pipelines_see_the_parents_later_loras(sdxl_dir, tmp_path_factory):
    """from_pipe holds the parent, not a copy: a LoRA fused on the text-to-image pipeline after
    the edit pipeline was made changes the edit's pixels to exactly those of an edit pipeline
    made after the load, with the programs compiled before (the weights are an input: none
    recompiles, none goes stale); unloading gives the first pixels back. A per-image adapter
    added on the parent later is the edit's too (its list, and the refusal that names it)."""
    from test_adapters import make_lora_files

    files = make_lora_files(sdxl_dir, tmp_path_factory.mktemp("edit-loras"))
    t2i = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    i2i = ImageToImagePipeline.from_pipe(t2i)
    inp = InpaintPipeline.from_pipe(i2i)
    kw = dict(prompt="a red circle", image=_image(0), strength=0.75, num_inference_steps=3,
              guidance_scale=4.0, seed=5, output_type="np")
    before = i2i(**kw).images
    before_inp = inp(**kw, mask_image=_mask()).images
    compiled = (i2i.num_compiled, inp.num_compiled)
    t2i.load_lora_weights(files["a"], scale=0.8)
    after = i2i(**kw).images
    fresh = ImageToImagePipeline.from_pipe(t2i)(**kw).images
    np.testing.assert_array_equal(after, fresh)
    assert np.abs(after - before).max() > 1e-3  # the LoRA changes the picture
    after_inp = inp(**kw, mask_image=_mask()).images
    np.testing.assert_array_equal(after_inp, InpaintPipeline.from_pipe(t2i)(
        **kw, mask_image=_mask()).images)
    assert np.abs(after_inp - before_inp).max() > 1e-3
    assert (i2i.num_compiled, inp.num_compiled) == compiled  # no recompile, nothing stale
    t2i.unload_lora_weights()
    np.testing.assert_array_equal(i2i(**kw).images, before)

    t2i.add_adapter("pixel", files["b"])
    assert [a["name"] for a in i2i.adapters] == ["pixel"] and i2i.params is t2i.params
    with pytest.raises(ValueError, match=r"adapter='pixel': per-image adapters apply to "
                                         r"text-to-image only"):
        i2i.generate([ImageRequest("a red circle", seed=1, adapter="pixel")],
                     images=[_image(0)], num_inference_steps=2)


def test_edit_pipeline_settings_are_the_parents_unless_set_on_it(sdxl_dir):
    """Defaults are read from the parent when used; only scheduler and the VAE tiling settings
    can be set on one edit pipeline alone, anything else is refused, naming where to set it."""
    t2i = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    i2i = ImageToImagePipeline.from_pipe(t2i)
    t2i.default_steps, t2i.vae_tiling = 7, False
    assert i2i.default_steps == 7 and i2i.vae_tiling is False and i2i.pipe is t2i
    i2i.vae_tiling = True
    assert i2i.vae_tiling is True and t2i.vae_tiling is False
    assert InpaintPipeline.from_pipe(i2i).vae_tiling is True  # an edit's own settings carry over
    with pytest.raises(AttributeError, match=r"default_steps is its text-to-image pipeline's.*"
                                             r"\.pipe\.default_steps"):
        i2i.default_steps = 3
    with pytest.raises(TypeError, match="runs on a TextToImagePipeline"):
        ImageToImagePipeline.from_pipe(object())


@pytest.mark.parity
@pytest.mark.slow  # default-suite time: make test-slow runs it
def test_img2img_vae_tiling_matches_diffusers_enable_tiling(sdxl_dir, pipe, torch_img2img):
    """vae_tiling=True at 48x40 (the tiny VAE's tiles are 32 px): the input is encoded tile by
    tile (diffusers' tiled encode) and the output decoded tile by tile; diffusers with
    vae.enable_tiling() gives the same pixels. The default ("auto") leaves this size untiled."""
    tiled = ImageToImagePipeline.from_pipe(pipe)
    tiled.vae_tiling = True
    rng = np.random.default_rng(3)
    img = np.kron(rng.random((5, 6, 3)), np.ones((8, 8, 1))).astype(np.float32)  # 40 x 48
    g = torch.Generator().manual_seed(9)
    post, noise = (torch.randn((1, 4, 20, 24), generator=g).numpy() for _ in range(2))
    kw = dict(prompt="a red circle", image=img, strength=0.6, num_inference_steps=5,
              guidance_scale=4.0)
    ours = tiled(**kw, noise=noise, image_latents_noise=post, output_type="np").images
    torch_img2img.vae.enable_tiling()
    try:
        theirs = _theirs(torch_img2img, **kw, generator=_gen(9))
    finally:
        torch_img2img.vae.disable_tiling()
    assert ours.shape == theirs.shape == (1, 40, 48, 3)
    assert np.abs(ours - theirs).max() <= TOL
    assert pipe.vae_tiling == "auto" and not pipe.uses_vae_tiling(40, 48)
    untiled = pipe(**kw, noise=noise, image_latents_noise=post, output_type="np").images
    assert np.abs(untiled - ours).max() > 1e-3


def test_a_per_image_adapter_on_an_edit_is_refused_by_name(pipe):
    """Per-image adapters apply to text-to-image only: an edit naming one is a ValueError that
    names the field (the service refuses it with the same rule), never silently ignored."""
    from pipelines.requests import ImageRequest

    with pytest.raises(ValueError, match=r"adapter='pixel': per-image adapters apply to "
                                         r"text-to-image only"):
        pipe.generate([ImageRequest("a red circle", seed=1, adapter="pixel")],
                      images=[_image(0)], num_inference_steps=2)
