"""The hires fix task (:mod:`pipelines.tasks.hires`): one program equals the two calls it
replaces (text-to-image at the small size with ``output_type="latent"``, the latents upscaled
by torch's bilinear interpolation, image-to-image from them), a new strength never
recompiles, and bad settings are named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines import ImageToImagePipeline, TextToImagePipeline
from pipelines.requests import HiresFix, ImageRequest

SIZE = 64
KW = dict(prompt=["a red circle on a blue background", "the cat!"], negative_prompt=["blurry", ""],
          num_inference_steps=4, guidance_scale=5.0, seed=[11, 12])


@pytest.fixture(scope="module")
def pipe(sdxl_dir):
    return TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)


def _two_calls(pipe, scale, strength, hires_steps, **kw):
    f = pipe.vae_scale_factor
    w0, h0 = HiresFix(scale).first_size(SIZE, SIZE, f)
    lat = pipe(**kw, height=h0, width=w0, output_type="latent").images
    up = torch.nn.functional.interpolate(torch.from_numpy(np.array(lat)),
                                         size=(SIZE // f, SIZE // f), mode="bilinear",
                                         align_corners=False).numpy()
    edit = ImageToImagePipeline.from_pipe(pipe)
    items = [ImageRequest(p, negative_prompt=n, seed=s, guidance_scale=kw["guidance_scale"])
             for p, n, s in zip(kw["prompt"], kw["negative_prompt"], kw["seed"])]
    steps = kw["num_inference_steps"] if hires_steps is None else hires_steps
    return edit.generate(items, image_latents=up, strength=strength, num_inference_steps=steps,
                         output_type="np").images


@pytest.mark.parametrize("scale,strength,hires_steps", [(2.0, 0.5, 6), (1.5, 0.7, None)])
def test_one_program_equals_text_to_image_then_image_to_image(pipe, scale, strength,
                                                                hires_steps):
    one = pipe(**KW, height=SIZE, width=SIZE, output_type="np", hires_scale=scale,
               hires_strength=strength, hires_steps=hires_steps)
    two = _two_calls(pipe, scale, strength, hires_steps, **KW)
    plain = pipe(**KW, height=SIZE, width=SIZE, output_type="np").images
    assert one.images.shape == (2, SIZE, SIZE, 3)
    assert np.abs(one.images - two).max() <= 1e-4
    assert np.abs(one.images - plain).max() > 1e-2  # the first pass changed the images
    assert one.seeds == [11, 12]
    steps = KW["num_inference_steps"] if hires_steps is None else hires_steps
    assert one.timings["hires_steps"] == int(steps * strength)


def test_a_new_strength_reuses_the_program(pipe):
    kw = dict(KW, height=SIZE, width=SIZE, output_type="np", hires_scale=2.0)
    a = pipe(**kw, hires_strength=0.5).images
    before = pipe.num_compiled
    b = pipe(**kw, hires_strength=0.75).images
    assert pipe.num_compiled == before
    assert np.abs(a - b).max() > 1e-3


@pytest.mark.parametrize("kw,match", [
    (dict(hires_scale=1.0), r"hires_scale=1\.0: must be a number in \(1, 4\]"),
    (dict(hires_scale=2.0, hires_strength=0.0), r"hires_strength=0\.0: must be a number in"),
    (dict(hires_scale=2.0, hires_strength=0.1, hires_steps=4),
     r"hires_strength=0\.1: with 4 step\(s\) leaves no denoising step"),
    (dict(hires_scale=2.0, hires_steps=0), r"hires_steps=0: must be an integer in 1\.\."),
    (dict(hires_scale=4.0, height=6, width=6), r"hires_scale=4\.0: draws the first pass at "
     r"0x0"),
    (dict(hires_scale=2.0, latents=np.zeros((1, 4, 8, 8), np.float32)), r"leave out latents"),
])
def test_bad_settings_are_named(pipe, kw, match):
    with pytest.raises(ValueError, match=match):
        pipe("x", **{"height": SIZE, "width": SIZE, **kw})
