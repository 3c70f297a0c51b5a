"""A sampler per request (ImageRequest.scheduler, ``__call__(scheduler=...)``, a JSONL line's
``scheduler``): a batch that mixes samplers gives each image the pixels of a pipeline loaded
with that sampler, the pipeline's parity with diffusers holds for a named sampler, and the
places that run one sampler for every image refuse another with an error naming the field."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines import TextToImagePipeline
from pipelines.requests import ImageRequest

SIZE = 32
KW = dict(num_inference_steps=3, height=SIZE, width=SIZE, output_type="np")


@pytest.fixture(scope="module")
def pipe(sdxl_dir):
    return TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)


def test_a_batch_mixing_samplers_gives_each_image_its_samplers_pixels(pipe, sdxl_dir):
    names = ["dpmpp_2m_karras", None, "Euler a", "dpmpp_2m_karras"]
    items = [ImageRequest("a red cat", seed=5 + k, guidance_scale=4.0, scheduler=name)
             for k, name in enumerate(names)]
    out = pipe.generate(items, **KW)
    assert out.timings["device_batches"] == 3 and out.seeds == [5, 6, 7, 8]
    for k, name in enumerate(names):
        alone = TextToImagePipeline.from_pretrained(sdxl_dir, scheduler=name,
                                                    compile_cache_dir=None) if name else pipe
        ref = alone("a red cat", seed=5 + k, guidance_scale=4.0, **KW).images[0]
        assert np.abs(out.images[k] - ref).max() < 1e-5, name
    assert np.abs(out.images[0] - out.images[1]).max() > 1e-3  # the sampler changed it
    # the per-call form, and one scheduler made once per name
    again = pipe("a red cat", seed=5, guidance_scale=4.0, scheduler="DPM++ 2M Karras", **KW)
    assert np.abs(again.images[0] - out.images[0]).max() < 1e-5
    assert pipe.scheduler_for("dpmpp_2m_karras") is pipe.scheduler_for("DPM++ 2M Karras")


@pytest.mark.parity
def test_a_named_sampler_equals_diffusers(pipe, sdxl_dir):
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionXLPipeline

    ref = StableDiffusionXLPipeline.from_pretrained(sdxl_dir)
    ref.scheduler = DPMSolverMultistepScheduler.from_config(ref.scheduler.config,
                                                            use_karras_sigmas=True)
    lat = np.random.default_rng(2).standard_normal((1, 4, SIZE // 2, SIZE // 2)).astype(np.float32)
    ours = pipe("a blue dog", scheduler="dpmpp_2m_karras", guidance_scale=5.0, latents=lat,
                **KW).images
    with torch.no_grad():
        theirs = ref("a blue dog", guidance_scale=5.0, latents=torch.from_numpy(lat),
                     **KW).images
    assert np.abs(ours - theirs).max() <= 2e-3


def test_where_one_sampler_runs_every_image(pipe, sdxl_dir):
    from pipelines.edit import ImageToImagePipeline
    from pipelines.step_engine import StepEngine

    with pytest.raises(ValueError, match=r"scheduler: unknown sampler 'dpmpp_2x' \(did you mean "
                                         r"'dpmpp_2m'\?\)"):
        pipe("x", scheduler="dpmpp_2x", **KW)
    with pytest.raises(ValueError, match="scheduler: sampler 'heun'.*not implemented"):
        pipe.generate([ImageRequest("x", scheduler="heun")], num_inference_steps=2)
    edit = ImageToImagePipeline.from_pipe(pipe)
    with pytest.raises(ValueError, match=r"scheduler='unipc': a sampler per request runs "
                                         "text-to-image"):
        edit.generate([ImageRequest("x", scheduler="unipc")],
                      [np.zeros((SIZE, SIZE, 3), np.float32)], None, num_inference_steps=2)
    engine = StepEngine(pipe, SIZE, SIZE, slots=1, output_type="np")
    with pytest.raises(ValueError, match=r"scheduler='unipc': the step engine runs its "
                                         "pipeline's sampler"):
        engine.submit(ImageRequest("x", scheduler="unipc"), 2)


def test_cli_lines_take_a_sampler(tmp_path):
    from pipelines.cli.jobs import RunSettings, plan_jobs
    from pipelines.cli.lines import InputError
    from pipelines.cli.prompts import read_prompts

    s = RunSettings(model="m", scheduler="EulerDiscreteScheduler", dtype="float32", steps=1,
                    guidance=5.0, width=32, height=32, run_seed=9)
    lines = read_prompts(file_text='{"prompt": "a cat"}\n'
                                   '{"prompt": "a cat", "scheduler": "unipc"}\n',
                         file=tmp_path / "p.jsonl")
    jobs = plan_jobs(lines, s)
    assert [j.request().scheduler for j in jobs] == [None, "unipc"]
    assert [j.record()["scheduler"] for j in jobs] == ["EulerDiscreteScheduler", "unipc"]
    with pytest.raises(InputError, match=r"p.jsonl:1: field 'scheduler': unknown sampler "
                                         r"'eulr'"):
        read_prompts(file_text='{"prompt": "a", "scheduler": "eulr"}\n',
                     file=tmp_path / "p.jsonl")


def test_step_callback_and_progress(pipe, capsys):
    """callback_on_step_end sees every step in order with its timestep and latents (diffusers'
    layout); the image is the one made without it; without callbacks no new program exists."""
    seen = []

    def callback(p, step, timestep, kwargs):
        assert p is pipe
        seen.append((step, float(np.ravel(timestep)[0]), kwargs["latents"].shape))

    plain = pipe("a red cat", seed=3, guidance_scale=4.0, **KW).images
    compiled = pipe.programs.num_compiled
    again = pipe("a red cat", seed=3, guidance_scale=4.0, progress=False, **KW).images
    assert pipe.programs.num_compiled == compiled  # no callback, no progress: the same program
    hooked = pipe("a red cat", seed=3, guidance_scale=4.0, callback_on_step_end=callback,
                  progress=True, **KW).images
    timesteps = np.asarray(pipe.scheduler.set_timesteps(3, (1, 1, 1, 1)).timesteps)
    assert [s for s, _, _ in seen] == [0, 1, 2]
    assert np.allclose([t for _, t, _ in seen], timesteps)
    assert {shape for _, _, shape in seen} == {(1, 4, SIZE // 2, SIZE // 2)}
    assert np.abs(hooked - plain).max() < 1e-6 and np.abs(again - plain).max() == 0
    err = capsys.readouterr().err
    assert "maxdiff: compiling the text-to-image program for 32x32, 3 steps" in err
