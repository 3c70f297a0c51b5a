"""The step engine (pipelines/step_engine.py): images joining and leaving between denoising steps
get the pixels they get alone and from TextToImagePipeline, for every scheduler."""

from __future__ import annotations

import numpy as np
import pytest
import tiny

from pipelines import ImageToImagePipeline, TextToImagePipeline
from pipelines.requests import ImageRequest
from pipelines.step_engine import StepEngine

SIZE = 32  # pixels (16x16 latents on the tiny checkpoint)
BASE = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
            num_train_timesteps=1000, steps_offset=1, prediction_type="epsilon")
SCHEDULERS = {
    "euler-trailing": dict(BASE, _class_name="EulerDiscreteScheduler", timestep_spacing="trailing"),
    "euler-karras": dict(BASE, _class_name="EulerDiscreteScheduler", use_karras_sigmas=True),
    "euler-ancestral": dict(BASE, _class_name="EulerAncestralDiscreteScheduler",
                            timestep_spacing="leading"),
    "ddim": dict(BASE, _class_name="DDIMScheduler", clip_sample=False, set_alpha_to_one=False),
    # sigma_min makes the last step's order depend on the step count (< 15: first order)
    "dpm++2m": dict(BASE, _class_name="DPMSolverMultistepScheduler", final_sigmas_type="sigma_min"),
    "lcm": dict(_class_name="LCMScheduler"),
    # corrector and predictor history per slot; the last step first order at every length
    "unipc": dict(BASE, _class_name="UniPCMultistepScheduler", use_karras_sigmas=True),
    # DPM++ 2M SDE: history per slot and fresh noise per image-step
    "dpm++2m-sde": dict(BASE, _class_name="DPMSolverMultistepScheduler",
                        algorithm_type="sde-dpmsolver++", use_karras_sigmas=True),
}
# (request, steps), submitted at ticks 0, 1, 2, 2 into 2 slots: the second joins the first
# mid-way, the last two wait for free slots and then share their steps; CFG on and off mixed
REQUESTS = [
    (ImageRequest("a red circle", seed=11, guidance_scale=3.0), 3),
    (ImageRequest("a blue square", seed=12, guidance_scale=0.0), 2),
    (ImageRequest("the dog", negative_prompt="a cat", seed=13, guidance_scale=5.0,
                  guidance_rescale=0.5, original_size=(16, 24)), 5),
    (ImageRequest("a green triangle", seed=14, guidance_scale=4.0), 2),
]


@pytest.fixture(scope="module")
def engines(sdxl_dir):
    made = {}

    def get(name):
        if name not in made:
            pipe = TextToImagePipeline.from_pretrained(sdxl_dir, scheduler=SCHEDULERS[name],
                                                       compile_cache_dir=None)
            # DPM++ 2M's engine (in the default suite) waits for each tick's own step
            # (lookahead 0), the others keep one tick queued ahead (the default)
            made[name] = StepEngine(pipe, SIZE, SIZE, slots=2, output_type="np",
                                    lookahead=0 if name == "dpm++2m" else 1)
        return made[name]

    return get


def _run_mixed(eng, requests):
    handles = [eng.submit(*requests[0])]
    eng.tick()
    handles.append(eng.submit(*requests[1]))
    eng.tick()
    handles += [eng.submit(*r) for r in requests[2:]]
    assert eng.queue_position(handles[2]) == 1 and eng.queue_position(handles[3]) == 2
    done = eng.run_until_idle()
    assert sorted(h.id for h in done) == sorted(h.id for h in handles)
    assert all(h.status == "done" and h.step == h.steps for h in handles)
    return [h.image for h in handles]


def _check(eng, requests=REQUESTS):
    before = eng.stats["guided_slot_steps"]
    mixed = _run_mixed(eng, requests)
    # negative rows for the guided images' steps only, though they shared ticks with others
    assert eng.stats["guided_slot_steps"] - before == sum(s for r, s in requests
                                                          if r.guidance_scale > 1)
    # one compilation per program it ran, each one of the engine's known programs
    assert eng.num_compiled == len(eng.runner.programs)
    assert eng.runner.programs <= eng.runner.all_programs
    for (req, steps), img in zip(requests, mixed):
        guided = eng.stats["guided_ticks"]
        h = eng.submit(req, steps)
        eng.run_until_idle()
        # alone, an image without CFG runs the unguided step program (no negative rows)
        assert eng.stats["guided_ticks"] - guided == (steps if req.guidance_scale > 1 else 0)
        assert h.image.shape == (SIZE, SIZE, 3)
        np.testing.assert_allclose(h.image, img, atol=1e-5, err_msg=f"{req.prompt}, {steps} steps")
    # nothing compiled twice for new prompts, seeds, guidance or step counts
    assert eng.num_compiled == len(eng.runner.programs)
    assert eng.runner.programs <= eng.runner.all_programs
    # TextToImagePipeline on the two 2-step images (one batch: CFG on for one, off for the other)
    two = [k for k, (_, s) in enumerate(requests) if s == 2]
    ref = eng.pipe.generate([requests[k][0] for k in two], height=SIZE, width=SIZE,
                            num_inference_steps=2, output_type="np").images
    for k, im in zip(two, ref):
        np.testing.assert_allclose(mixed[k], im, atol=1e-5)
    assert np.abs(mixed[0] - mixed[1]).max() > 1e-2  # different images differ
    return mixed


@pytest.mark.slow  # default-suite time: the DPM++ 2M test below covers the same paths
def test_euler_trailing(engines):
    _check(engines("euler-trailing"))


def test_dpm_solver_2m_history_and_final_order(engines):
    # one image of 16 steps: its last step is second order, the others' first order
    _check(engines("dpm++2m"), REQUESTS + [(ImageRequest("a white cat", seed=15,
                                                        guidance_scale=2.0), 16)])


@pytest.mark.slow
def test_euler_karras(engines):
    _check(engines("euler-karras"))


@pytest.mark.slow
def test_euler_ancestral(engines):
    _check(engines("euler-ancestral"))


@pytest.mark.slow
def test_ddim(engines):
    _check(engines("ddim"))


@pytest.mark.slow
def test_lcm(engines):
    _check(engines("lcm"))


@pytest.mark.slow
def test_dpm_solver_2m_sde(engines):
    _check(engines("dpm++2m-sde"))


@pytest.mark.slow
def test_unipc(engines):
    _check(engines("unipc"), REQUESTS + [(ImageRequest("a white cat", seed=15,
                                                      guidance_scale=2.0), 16)])


def test_cancel_progress_preview_and_programs(engines):
    eng = engines("euler-trailing")
    seen, previews = [], {}

    def progress(h):
        seen.append((h.id, h.step))
        if h.preview is not None:
            previews.setdefault(h.id, []).append((h.step, h.preview_step, h.preview))

    # previews after steps 2 and 4: the last step's x0 estimate is the final latents (Euler,
    # sigma 0), so the step-4 preview is the image
    a = eng.submit(ImageRequest("a red circle", seed=1, guidance_scale=3.0), 4,
                   on_progress=progress, previews=[2, 4])
    b = eng.submit(ImageRequest("a blue square", seed=2, guidance_scale=0.0), 6)
    c = eng.submit(ImageRequest("queued", seed=3), 2, on_progress=progress)
    eng.tick()
    assert (a.status, b.status, c.status) == ("running", "running", "queued")
    assert c.queue_position == 1 and (c.id, 0) in seen and a.queue_position == 0
    # the step is queued; the host learns it ran only when it has (lookahead 1: next tick)
    assert a.dispatched == 1 and a.step == 0 and a.preview is None
    eng.cancel(b)
    eng.cancel(c)
    out = eng.tick()
    assert {h.id for h in out} == {b.id, c.id} and b.status == c.status == "cancelled"
    assert eng.active == 1 and eng.queued == 0 and eng.stats["cancelled"] == 2
    eng.run_until_idle()
    assert a.status == "done" and [s for s in seen if s[0] == a.id] == [(a.id, k)
                                                                        for k in range(1, 5)]
    # the previews arrive with the steps they show (progress at step 3 still carries step 2's)
    assert [(step, at) for step, at, _ in previews[a.id]] == [(2, 2), (3, 2), (4, 4)]
    assert np.abs(previews[a.id][0][2] - a.image).max() > 1e-2  # a step-2 estimate is not final
    np.testing.assert_allclose(previews[a.id][-1][2], a.image, atol=2e-3)
    eng.cancel(a)  # finished: nothing happens
    assert a.status == "done" and eng.idle
    # every program is compiled, no more: step programs for (b, g) in (1, 0), (1, 1), (2, 0),
    # (2, 1), (2, 2), text-encode and decode for batch sizes 1 and 2
    assert eng.warmup() == eng.max_programs == 9


def test_srs_policy_admits_the_shorter_image_first(engines):
    """policy="srs" on a real model: with one slot busy, a 2-step image submitted after a
    5-step one takes the slot first (shortest remaining steps; equal waits), the queue
    positions say so from the start, and the pixels are each image's own (as with FIFO)."""
    pipe = engines("euler-trailing").pipe
    out = {}
    for policy in ("fifo", "srs"):
        eng = StepEngine(pipe, SIZE, SIZE, slots=1, output_type="np", policy=policy)
        first = eng.submit(ImageRequest("a red circle", seed=1, guidance_scale=3.0), 2)
        eng.tick()
        long = eng.submit(ImageRequest("a blue square", seed=2, guidance_scale=3.0), 5)
        short = eng.submit(ImageRequest("a green triangle", seed=3, guidance_scale=3.0), 2)
        positions = (eng.queue_position(long), eng.queue_position(short))
        order = [h.id for h in eng.run_until_idle()]
        assert first.status == long.status == short.status == "done"
        assert eng.policy.name == policy and eng.stats["tick_images"] == {"1": 9}
        out[policy] = (positions, order, {h.steps: h.image for h in (long, short)})
    assert out["fifo"][:2] == ((1, 2), [1, 2, 3])
    assert out["srs"][:2] == ((2, 1), [1, 3, 2])
    for steps in (5, 2):
        np.testing.assert_array_equal(out["fifo"][2][steps], out["srs"][2][steps])
    with pytest.raises(ValueError, match=r"policy='lifo'; use one of 'fifo', 'srs'"):
        StepEngine(pipe, SIZE, SIZE, slots=1, policy="lifo")


def test_bad_submissions(engines):
    eng = engines("euler-trailing")
    with pytest.raises(ValueError, match="num_inference_steps=0"):
        eng.submit(ImageRequest("x"), 0)
    with pytest.raises(ValueError, match="guidance_scale=-1"):
        eng.submit(ImageRequest("x", guidance_scale=-1.0), 2)
    with pytest.raises(ValueError, match=r"previews=\[0, 3\]: \[0, 3\] not in 1..2"):
        eng.submit(ImageRequest("x"), 2, previews=[3, 0])
    with pytest.raises(ValueError, match="lookahead=-1"):
        StepEngine(eng.pipe, SIZE, SIZE, slots=2, lookahead=-1)
    with pytest.raises(ValueError, match="adapter='nope' is not added"):
        eng.submit(ImageRequest("x", adapter="nope"), 2)
    with pytest.raises(ValueError, match="multiple of the mesh size"):
        StepEngine(eng.pipe, SIZE, SIZE, slots=0)
    no_cfg = StepEngine(eng.pipe, SIZE, SIZE, slots=2, cfg=False)
    with pytest.raises(ValueError, match="cfg=False"):
        no_cfg.submit(ImageRequest("x", guidance_scale=3.0), 2)
    with pytest.raises(ValueError, match=r"deepcache_interval=2: the step engine cannot run "
                                         r"DeepCache .*engine=batch and the Python API"):
        eng.submit(ImageRequest("x", deepcache_interval=2), 2)
    with pytest.raises(ValueError, match="cfg_cutoff=0"):
        eng.submit(ImageRequest("x", cfg_cutoff=0.0), 2)
    with pytest.raises(ValueError, match="controls: this engine has no ControlNets"):
        eng.submit(ImageRequest("x"), 2, controls=[])
    # a task whose images start from given images has no step program
    with pytest.raises(ValueError, match="does not run the edit task of ImageToImagePipeline; "
                                         r"run it on the pipeline \(engine=batch\)"):
        StepEngine(ImageToImagePipeline.from_pipe(eng.pipe), SIZE, SIZE, slots=2)


def test_cfg_cutoff_equals_the_pipeline(engines):
    """``cfg_cutoff=0.5`` on 4 steps: its first 2 steps guided, the last 2 the conditional pass
    alone, while three images guided on every step share its ticks (after its cutoff it is
    the padding row of the 4 guided rows: its own cutoff, not the rows', picks its pass). Each
    image equals the pipeline's for it; the cutoff changes the image."""
    pipe = engines("euler-trailing").pipe
    eng = StepEngine(pipe, SIZE, SIZE, slots=4, output_type="np")
    items = [ImageRequest("a red circle", seed=21, guidance_scale=5.0, cfg_cutoff=0.5),
             ImageRequest("a blue square", seed=22, guidance_scale=5.0, guidance_rescale=0.5),
             ImageRequest("a green triangle", seed=23, guidance_scale=3.0),
             ImageRequest("a red circle", seed=21, guidance_scale=5.0)]
    handles = [eng.submit(items[0], 4)]
    eng.tick()
    handles += [eng.submit(it, 4) for it in items[1:]]
    eng.run_until_idle()
    assert all(h.status == "done" for h in handles)
    assert eng.stats["guided_slot_steps"] == 2 + 3 * 4
    ref = pipe.generate(items, height=SIZE, width=SIZE, num_inference_steps=4,
                        output_type="np").images
    for h, im in zip(handles, ref):
        np.testing.assert_allclose(h.image, im, atol=1e-5, err_msg=h.request.prompt)
    assert np.abs(handles[0].image - handles[3].image).max() > 1e-3  # the cutoff acts


@pytest.mark.slow
def test_per_image_adapters(sdxl_dir, tmp_path_factory):
    """Images with different unfused adapters (add_adapter) share ticks and match the
    pipeline's mixed batch."""
    from test_adapters import make_lora_files

    files = make_lora_files(sdxl_dir, tmp_path_factory.mktemp("adapters"))
    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, scheduler=SCHEDULERS["euler-trailing"],
                                               compile_cache_dir=None)
    pipe.add_adapter("a", files["a"], scale=0.7)
    pipe.add_adapter("b", files["b"], scale=1.3)
    items = [ImageRequest("a red circle", seed=1, guidance_scale=4.0, adapter=a)
             for a in (None, "a", "b")]
    eng = StepEngine(pipe, SIZE, SIZE, slots=2, output_type="np")
    handles = [eng.submit(items[0], 2)]
    eng.tick()
    handles += [eng.submit(it, 2) for it in items[1:]]
    eng.run_until_idle()
    ref = pipe.generate(items, height=SIZE, width=SIZE, num_inference_steps=2,
                        output_type="np").images
    for h, im in zip(handles, ref):
        np.testing.assert_allclose(h.image, im, atol=1e-5)
    assert np.abs(handles[0].image - handles[1].image).max() > 1e-3  # the adapter does something


@pytest.mark.slow
def test_slots_sharded_over_4_devices_equal_one_device(sdxl_dir):
    """4 host devices: the slots are sharded over the mesh's data axis and the images equal
    one device's."""
    import textwrap

    script = textwrap.dedent(f"""
        import json, numpy as np, jax
        from pipelines import TextToImagePipeline
        from pipelines.requests import ImageRequest
        from pipelines.step_engine import StepEngine
        assert jax.local_device_count() == 4, jax.devices()
        out = {{}}
        for d in (4, 1):
            p = TextToImagePipeline.from_pretrained({str(sdxl_dir)!r}, devices=d)
            eng = StepEngine(p, 32, 32, slots=4, output_type="np")
            assert eng.batch_sizes == ([4] if d == 4 else [1, 2, 4])
            hs = [eng.submit(ImageRequest("a red circle", seed=1, guidance_scale=3.0), 3)]
            eng.tick()
            hs += [eng.submit(ImageRequest(f"the dog {{k}}", seed=2 + k, guidance_scale=k), 2)
                   for k in range(3)]
            eng.run_until_idle()
            out[d] = np.stack([h.image for h in hs])
        print(json.dumps(float(np.abs(out[4] - out[1]).max())))
    """)
    worst = tiny.run_on_host_devices(script, 4)
    assert worst <= 5e-6
