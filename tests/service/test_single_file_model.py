"""The service on a single-file Stable Diffusion 1.x checkpoint (``model=FILE``, as a user with a
downloaded ``.safetensors`` starts it): the official ``openai`` client gets images, and the
native route's pixels equal the Python API's on the same file."""

from __future__ import annotations

import numpy as np
import pytest
import tiny

from .helpers import MAIN_ARGS, SIZE, STEPS, generate, png


@pytest.fixture(scope="module")
def sd_file(tmp_path_factory):
    from maxdiff import single_file

    root = tmp_path_factory.mktemp("served-sd1")
    tiny.make_sd_pipeline(root / "folder", seed=5)
    single_file.export(root / "folder", root / "model.safetensors")
    return root / "model.safetensors", root / "folder"


@pytest.fixture(scope="module")
def sd_app(cluster, sd_file):
    from ray import serve

    from serving.app import build_app

    file, config = sd_file
    serve.run(build_app({**MAIN_ARGS, "model": str(file), "single_file_config": str(config),
                         "model_name": "tiny-sd15"}), name="sd15", route_prefix="/sd15")
    yield f"{cluster.url}/sd15"
    serve.delete("sd15")


def test_a_single_file_model_is_served(sd_app, sd_file):
    import openai

    client = openai.OpenAI(base_url=f"{sd_app}/v1", api_key="unused", max_retries=2)
    out = client.images.generate(model="tiny-sd15", prompt="a red circle", size=f"{SIZE}x{SIZE}",
                                 response_format="b64_json")
    assert len(out.data) == 1 and png(out.data[0].b64_json).shape == (SIZE, SIZE, 3)
    r = generate(sd_app, seed=3, steps=STEPS, guidance_scale=0.0, width=SIZE, height=SIZE)
    assert r.status_code == 200, r.text
    served = png(r.json()["images"][0]["b64_json"])

    from pipelines import TextToImagePipeline

    file, config = sd_file
    pipe = TextToImagePipeline.from_single_file(file, config=config, compile_cache_dir=None)
    ours = pipe("a red circle", seed=3, num_inference_steps=STEPS, guidance_scale=0.0,
                height=SIZE, width=SIZE, output_type="np").images[0]
    assert np.abs(served.astype(int) - np.round(ours * 255).astype(int)).max() <= 1
