"""The safety checker served: a tiny SD 1.x checkpoint with a random safety checker that flags
two of four images (``tests/tiny.py``'s ``add_safety_checker``), served with
``allow_moderation_low``. ``/v1/generate`` answers the Python API's flags and pixels (the
flagged images black); ``moderation: "low"`` answers the pixels of the Python API with the
checker off, on the OpenAI route and beside a checked request of the same seed in one device
batch. A server without the setting refuses ``low`` (tests/service/test_errors.py's 422
cases, on the main application)."""

from __future__ import annotations

import base64
import io
import types

import numpy as np
import pytest
import requests
import tiny
from PIL import Image

from .helpers import MAIN_ARGS, SIZE, STEPS, concurrently, generate, png

serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.slow  # a tiny checkpoint and checker written, a deployment: ~1 minute

APP, ROUTE = "safety", "/safety"
PROMPT, SEED, N = "a red circle", 40, 4
RUN = dict(num_inference_steps=STEPS, guidance_scale=0.0, height=SIZE, width=SIZE,
           output_type="np")
ARGS = dict(MAIN_ARGS, model_name="tiny-sd1", num_cpus=0, max_queued_requests=-1,
            allow_moderation_low=True)


def _pixels(images) -> np.ndarray:
    return np.round(np.asarray(images) * 255).astype(int)


@pytest.fixture(scope="module")
def sd1(cluster, tmp_path_factory):
    """The checked folder, the Python API with and without its checker (``checked``, ``off``)
    and their images of ``PROMPT`` at seeds ``SEED..SEED+3`` (``want``: uint8 values, with
    ``flags``; ``plain``: the checker off); then the folder served (``url``)."""
    from pipelines import TextToImagePipeline

    base = tmp_path_factory.mktemp("sd1-serve-plain")
    tiny.make_sd_pipeline(base)
    plain = TextToImagePipeline.from_pretrained(base, compile_cache_dir=cluster.cache)
    images = plain(PROMPT, seed=SEED, num_images_per_prompt=N, **RUN).images
    folder = tiny.add_safety_checker(base, tmp_path_factory.mktemp("sd1-serve-checked"), images)
    checked = TextToImagePipeline.from_pretrained(folder, compile_cache_dir=cluster.cache)
    off = TextToImagePipeline.from_pretrained(folder, compile_cache_dir=cluster.cache,
                                              safety_checker=False)
    out = checked(PROMPT, seed=SEED, num_images_per_prompt=N, **RUN)
    from serving.app import build_app

    serve.run(build_app({"model": str(folder), **ARGS}), name=APP, route_prefix=ROUTE)
    yield types.SimpleNamespace(
        url=f"{cluster.url}{ROUTE}", off=off, want=_pixels(out.images),
        flags=out.nsfw_content_detected,
        plain=_pixels(off(PROMPT, seed=SEED, num_images_per_prompt=N, **RUN).images))
    serve.delete(APP)


def test_served_flags_and_pixels_equal_the_python_apis(sd1):
    assert sorted(sd1.flags) == [False, False, True, True]  # the checker's threshold
    r = generate(sd1.url, prompt=PROMPT, seed=SEED, num_images=N, steps=STEPS,
                 guidance_scale=0.0, width=SIZE, height=SIZE)
    assert r.status_code == 200, r.text
    got = r.json()["images"]
    assert [im["content_filtered"] for im in got] == sd1.flags
    for im, want, plain, flag in zip(got, sd1.want, sd1.plain, sd1.flags):
        pixels = png(im["b64_json"]).astype(int)
        assert np.abs(pixels - want).max() <= 1
        assert (pixels.max() == 0) == flag  # black exactly where flagged
        assert flag or np.abs(pixels - plain).max() <= 1


def test_moderation_low_answers_the_unchecked_pixels(sd1):
    """The OpenAI route, four images at random seeds (in their entries): no flags, and the
    pixels of the Python API with the checker off at those seeds."""
    r = requests.post(f"{sd1.url}/v1/images/generations", timeout=120, json={
        "prompt": PROMPT, "n": N, "size": f"{SIZE}x{SIZE}", "moderation": "low"})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert all("content_filtered" not in d for d in data), data[0].keys()
    seeds = [d["seed"] for d in data]
    want = _pixels(sd1.off([PROMPT] * N, seed=seeds, **RUN).images)
    for d, w in zip(data, want):
        pixels = png(d["b64_json"]).astype(int)
        assert pixels.max() > 0 and np.abs(pixels - w).max() <= 1
    # the file records it with the settings that redraw the image through /v1/generate
    assert Image.open(io.BytesIO(base64.b64decode(data[0]["b64_json"]))).text["moderation"] == "low"


def test_checked_and_unchecked_requests_share_a_device_batch(sd1):
    """A flagged image's seed asked for twice at once, once with ``moderation: "low"``: one
    device batch, the checked image black and flagged, the other its unchecked pixels."""
    seed = SEED + sd1.flags.index(True)
    bodies = [{"moderation": "auto"}, {"moderation": "low"}]
    rs = concurrently(2, lambda i: generate(sd1.url, prompt=PROMPT, seed=seed, steps=STEPS,
                                            guidance_scale=0.0, width=SIZE, height=SIZE,
                                            **bodies[i]))
    assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
    auto, low = (r.json() for r in rs)
    assert auto["timings"]["batch_id"] == low["timings"]["batch_id"]
    assert auto["timings"]["batch_images"] == 2
    assert auto["images"][0]["content_filtered"] is True
    assert png(auto["images"][0]["b64_json"]).max() == 0
    assert "content_filtered" not in low["images"][0]
    pixels = png(low["images"][0]["b64_json"]).astype(int)
    assert np.abs(pixels - sd1.plain[seed - SEED]).max() <= 1 and pixels.max() > 0
