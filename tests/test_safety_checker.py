"""SD 1.x's safety checker (maxdiff.models.safety_checker) against diffusers'
StableDiffusionSafetyChecker on random weights: the same images flagged and blacked out by the
whole pipeline, the flags reported as ``nsfw_content_detected``, and off when asked: for the
pipeline, or for one image of a batch (``ImageRequest.safety_checker``). The step engine
checks its finished images the same way."""

from __future__ import annotations

import numpy as np
import pytest
import tiny
import torch

from pipelines import TextToImagePipeline
from pipelines.requests import ImageRequest

SIZE = 32
KW = dict(num_inference_steps=2, guidance_scale=5.0, height=SIZE, width=SIZE, output_type="np")
PROMPTS = ["a red circle", "a blue square", "a green triangle", "a white star"]


def _latents():
    return np.random.default_rng(4).standard_normal(
        (len(PROMPTS), 4, SIZE // 2, SIZE // 2)).astype(np.float32)


@pytest.fixture(scope="module")
def checked_dir(tmp_path_factory):
    """A tiny SD 1.x folder with a random safety checker whose first concept's threshold
    lies between the images' scores, so two of the four images are flagged."""
    base = tmp_path_factory.mktemp("sd1-plain")
    tiny.make_sd_pipeline(base)
    ours = TextToImagePipeline.from_pretrained(base, compile_cache_dir=None)
    images = ours(PROMPTS, latents=_latents(), **KW).images
    return tiny.add_safety_checker(base, tmp_path_factory.mktemp("sd1-checked"), images)


@pytest.mark.parity
def test_flags_and_black_images_equal_diffusers(checked_dir):
    from diffusers import StableDiffusionPipeline

    ref = StableDiffusionPipeline.from_pretrained(checked_dir)
    with torch.no_grad():
        theirs = ref(PROMPTS, latents=torch.from_numpy(_latents()), **KW)
    pipe = TextToImagePipeline.from_pretrained(checked_dir, compile_cache_dir=None)
    assert pipe.safety_checker is not None
    ours = pipe(PROMPTS, latents=_latents(), **KW)
    assert ours.nsfw_content_detected == list(theirs.nsfw_content_detected)
    assert sum(ours.nsfw_content_detected) == 2
    assert np.abs(ours.images - theirs.images).max() <= 2e-3
    for img, flagged in zip(ours.images, ours.nsfw_content_detected):
        assert (img.max() == 0) == flagged  # black exactly where flagged
    pil = pipe(PROMPTS, latents=_latents(), **{**KW, "output_type": "pil"})
    assert pil.nsfw_content_detected == ours.nsfw_content_detected
    assert [np.asarray(im).max() == 0 for im in pil.images] == ours.nsfw_content_detected


def test_off_when_asked(checked_dir):
    from pipelines.config import load_run_config

    pipe = TextToImagePipeline.from_pretrained(checked_dir, compile_cache_dir=None,
                                               safety_checker=False)
    out = pipe(PROMPTS, latents=_latents(), **KW)
    assert pipe.safety_checker is None and out.nsfw_content_detected is None
    assert all(img.max() > 0 for img in out.images)
    cfg = load_run_config(None, [f"model={checked_dir}", "safety_checker=false"])
    assert cfg.pipeline_kwargs()["safety_checker"] is False


def test_an_image_whose_request_turns_it_off_is_left_alone(checked_dir):
    """``ImageRequest(safety_checker=False)``: that image alone skips the checker (flag None,
    its pixels as the checker-less pipeline's, black or not), the others of its batch are
    checked as before."""
    pipe = TextToImagePipeline.from_pretrained(checked_dir, compile_cache_dir=None)
    full = pipe(PROMPTS, latents=_latents(), **KW).nsfw_content_detected
    flagged = [k for k, f in enumerate(full) if f]
    kept = [k for k, f in enumerate(full) if not f]
    checked = {flagged[0], kept[0]}  # a flagged image checked, another not
    items = [ImageRequest(p, guidance_scale=KW["guidance_scale"], safety_checker=k in checked)
             for k, p in enumerate(PROMPTS)]
    run = dict(latents=_latents(), num_inference_steps=2, height=SIZE, width=SIZE,
               output_type="np")
    out = pipe.generate(items, **run)
    off = TextToImagePipeline.from_pretrained(checked_dir, compile_cache_dir=None,
                                              safety_checker=False).generate(items, **run)
    assert out.nsfw_content_detected == [f if k in checked else None
                                         for k, f in enumerate(full)]
    assert out.images[flagged[0]].max() == 0 and out.images[flagged[1]].max() > 0
    for k in range(len(PROMPTS)):
        if k != flagged[0]:  # every image but the checked flagged one: the unchecked pixels
            np.testing.assert_allclose(out.images[k], off.images[k], atol=1e-6)


@pytest.fixture(scope="module")
def euler_checked(tmp_path_factory):
    """(A tiny SD 1.x folder on Euler, which the step engine runs, with a safety checker that
    flags two of ``SEEDED``'s images; those images' requests.)"""
    base = tmp_path_factory.mktemp("sd1-euler")
    tiny.make_sd_pipeline(base, scheduler_config=tiny.SDXL_SCHEDULER)
    items = [ImageRequest(p, seed=20 + k, guidance_scale=KW["guidance_scale"])
             for k, p in enumerate(PROMPTS)]
    pipe = TextToImagePipeline.from_pretrained(base, compile_cache_dir=None)
    images = pipe.generate(items, num_inference_steps=2, height=SIZE, width=SIZE,
                           output_type="np").images
    return tiny.add_safety_checker(base, tmp_path_factory.mktemp("sd1-euler-checked"),
                                   images), items


def test_the_step_engine_checks_each_image_as_the_pipeline_does(euler_checked):
    """The step engine runs the pipeline's safety checker on its finished images: the same
    flags and black images as the pipeline's batch; an image whose request turns it off
    finishes unchecked (``nsfw`` None, not black) beside them."""
    from dataclasses import replace

    from pipelines.step_engine import StepEngine

    folder, items = euler_checked
    pipe = TextToImagePipeline.from_pretrained(folder, compile_cache_dir=None)
    want = pipe.generate(items, num_inference_steps=2, height=SIZE, width=SIZE,
                         output_type="np")
    assert sum(want.nsfw_content_detected) == 2
    eng = StepEngine(pipe, SIZE, SIZE, slots=4, output_type="np")
    handles = [eng.submit(it, 2) for it in items]
    unchecked = [eng.submit(replace(it, safety_checker=False), 2) for it in items]
    eng.run_until_idle()
    assert [h.nsfw for h in handles] == want.nsfw_content_detected
    for h, im, flag, free in zip(handles, want.images, want.nsfw_content_detected, unchecked):
        assert (h.image.max() == 0) == flag and free.nsfw is None and free.image.max() > 0
        np.testing.assert_allclose(h.image, im, atol=2e-5)
        if not flag:
            np.testing.assert_allclose(free.image, h.image, atol=2e-5)
