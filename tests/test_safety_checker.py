"""SD 1.x's safety checker (maxdiff.models.safety_checker) against diffusers'
StableDiffusionSafetyChecker on random weights: the same images flagged and blacked out by the
whole pipeline, the flags reported as ``nsfw_content_detected``, and off when asked."""

from __future__ import annotations

import numpy as np
import pytest
import tiny
import torch

from pipelines import TextToImagePipeline

SIZE = 32
KW = dict(num_inference_steps=2, guidance_scale=5.0, height=SIZE, width=SIZE, output_type="np")
PROMPTS = ["a red circle", "a blue square", "a green triangle", "a white star"]


def _latents():
    return np.random.default_rng(4).standard_normal(
        (len(PROMPTS), 4, SIZE // 2, SIZE // 2)).astype(np.float32)


@pytest.fixture(scope="module")
def checked_dir(tmp_path_factory):
    """A tiny SD 1.x folder with a random safety checker whose first concept's threshold
    lies between the images' scores, so some images are flagged and some are not."""
    from diffusers import StableDiffusionPipeline
    from diffusers.pipelines.stable_diffusion.safety_checker import (
        StableDiffusionSafetyChecker,
    )
    from transformers import CLIPConfig, CLIPImageProcessor

    base = tmp_path_factory.mktemp("sd1-plain")
    tiny.make_sd_pipeline(base)
    ours = TextToImagePipeline.from_pretrained(base, compile_cache_dir=None)
    images = ours(PROMPTS, latents=_latents(), **KW).images
    torch.manual_seed(3)
    config = CLIPConfig(vision_config=dict(hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4,
                                           image_size=32, patch_size=8),
                        text_config=dict(hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4),
                        projection_dim=16)
    checker = StableDiffusionSafetyChecker(config).eval()
    with torch.no_grad():
        for p in checker.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        checker.special_care_embeds_weights.fill_(2.0)  # never: no adjustment
        checker.concept_embeds_weights.fill_(2.0)
    fe = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    pixels = fe(images=[(im * 255).round().astype(np.uint8) for im in images],
                return_tensors="pt").pixel_values
    with torch.no_grad():
        emb = checker.visual_projection(checker.vision_model(pixels)[1])
        cos = torch.nn.functional.normalize(emb) @ torch.nn.functional.normalize(
            checker.concept_embeds).T
        scores = np.sort(cos[:, 0].numpy())
        checker.concept_embeds_weights[0] = float(scores[1] + scores[2]) / 2  # two of four
    pipe = StableDiffusionPipeline.from_pretrained(base, safety_checker=checker,
                                                   feature_extractor=fe)
    out = tmp_path_factory.mktemp("sd1-checked")
    pipe.save_pretrained(out)
    return out


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
