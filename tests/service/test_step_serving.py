"""The service with step-level batching (serve arg engine=step) on a real Ray Serve over real
HTTP: short requests overtake long ones, streaming (native and the official openai client), and
a client that disconnects or runs out of time frees its slot.

Timing and ordering are checked at BIG (128x128 on the tiny checkpoint: about 0.1 s per UNet
step on 2 CPU cores), where JAX's asynchronous dispatch would let a host that does not wait for
the device queue every step of an image ahead of it; requests are sent on the wall clock, as a
client sends them. The rest runs at SIZE (32x32, a few ms per step)."""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time

import numpy as np
import pytest
import requests

from .helpers import BIG, SIZE, generate, png, sse_events

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")


def _generate(url, **body):
    r = generate(url, **body)
    assert r.status_code == 200, r.text
    return r.json()


def _engine_stats(url, size=SIZE):
    (replica,) = requests.get(f"{url}/v1/stats", timeout=30).json()["replicas"].values()
    return replica["models"]["tiny-sdxl"]["engines"][f"{size}x{size}"]


def _wait_for_freed_slot(url: str, cancelled_before: int, size=SIZE) -> dict:
    """Engine stats once one more image was cancelled and no slot is active (30 s at most)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = _engine_stats(url, size)
        if stats["cancelled"] > cancelled_before and stats["active"] == 0:
            return stats
        time.sleep(0.2)
    pytest.fail(f"the slot was not freed: {stats}")


def _stream_in_thread(url: str, body: dict):
    """Send a streaming ``/v1/generate`` from a thread; returns (thread, record): ``record``
    has ``sent`` (send time) and ``events``, (arrival time, event, data) as they arrive. Setting
    ``record["leave"]`` closes the connection at the next event (the client goes away)."""
    rec = {"events": [], "sent": time.perf_counter(), "leave": False, "error": None}

    def run():
        try:
            with requests.post(f"{url}/v1/generate", json={**body, "stream": True}, stream=True,
                               timeout=120) as r:
                assert r.status_code == 200, r.text
                for name, data in sse_events(r):
                    rec["events"].append((time.perf_counter(), name, data))
                    if rec["leave"]:
                        return
        except BaseException as e:  # reported by _join
            rec["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, rec


def _join(t, rec):
    t.join(120)
    assert not t.is_alive() and rec["error"] is None, rec["error"]


def _wait_for_step(rec, k: int, timeout: float = 60):
    """Until the stream has reported step ``k`` (the device has run it)."""
    deadline = time.perf_counter() + timeout
    while not any(n == "progress" and d["step"] >= k for _, n, d in rec["events"]):
        assert rec["error"] is None and time.perf_counter() < deadline, rec
        time.sleep(0.005)


def _progress(rec) -> list[tuple[float, int]]:
    return [(t, d["step"]) for t, n, d in rec["events"] if n == "progress" and d["step"] > 0]


def test_a_short_request_sent_later_overtakes_a_long_one(step_app):
    """The issue's scenario at a size where a step costs real time: a 2-step request sent while
    a 40-step one runs joins it, finishes long before it, with its pixels from alone."""
    before = _engine_stats(step_app, BIG)["tick_images"].get("2", 0)
    t, long = _stream_in_thread(step_app, {
        "prompt": "a long one", "steps": 40, "guidance_scale": 0.0, "seed": 1,
        "width": BIG, "height": BIG})
    _wait_for_step(long, 5)  # the device has run 5 of its steps
    short = {"prompt": "a blue square", "steps": 2, "guidance_scale": 2.0, "seed": 7,
             "width": BIG, "height": BIG}
    sent = time.perf_counter()
    shared = _generate(step_app, **short)
    short_done = time.perf_counter()
    _join(t, long)
    result_at, name, result = long["events"][-1]
    assert name == "result" and result["steps"] == 40
    # the long image was mid-way when the short one came back, and is only done much later
    step_then = max(k for at, k in _progress(long) if at <= short_done)
    assert step_then <= 20, step_then
    assert short_done - sent < 0.3 * (result_at - long["sent"]), (short_done - sent,
                                                                  result_at - long["sent"])
    # result ids are given in the order requests finish on the replica: the short one first
    assert shared["timings"]["batch_id"] < result["timings"]["batch_id"]
    assert _engine_stats(step_app, BIG)["tick_images"].get("2", 0) - before >= 2  # shared ticks
    alone = _generate(step_app, **short)
    assert alone["seeds"] == shared["seeds"] == [7]
    assert np.abs(png(alone["images"][0]["b64_json"]).astype(int)
                  - png(shared["images"][0]["b64_json"])).max() <= 1


def test_streamed_progress_and_previews_follow_the_device(step_app):
    """Progress events arrive as the steps run, not bunched at the start: the k-th not before
    k steps' worth of the run's time (half of it, for noise); each preview right with the
    progress event of its step."""
    n = 20
    t, rec = _stream_in_thread(step_app, {
        "prompt": "a red circle", "steps": n, "guidance_scale": 0.0, "seed": 3,
        "width": BIG, "height": BIG, "partial_images": 2})
    _join(t, rec)
    events = rec["events"]
    assert events[0][1] == "progress" and events[0][2]["step"] == 0
    assert events[-1][1] == "result"
    steps = _progress(rec)
    assert [k for _, k in steps] == list(range(1, n + 1))
    t0, done = events[0][0], events[-1][0]
    s = (done - t0) / n  # this run's time per step
    for at, k in steps:
        assert at - t0 >= 0.5 * k * s, (k, at - t0, s)
    # spread over the run, not bunched at its start or its end: about half of the progress events
    # come before the run's midpoint (a rank test, so one slow step on a shared machine, which
    # a largest-gap bound took for bunching, moves at most the events around it)
    early = sum(at - t0 < (done - t0) / 2 for at, _ in steps)
    assert n // 4 <= early <= 3 * n // 4, (early, [round(at - t0, 3) for at, _ in steps])
    names = [(name, d.get("step")) for _, name, d in events]
    for k in (7, 13):  # partial_images=2 of 20 steps: previews after steps 7 and 13
        i = names.index(("partial_image", k))
        assert names[i - 1] == ("progress", k), names[i - 3:i + 2]


def test_a_client_that_leaves_stops_using_device_time(step_app):
    """Two 30-step images share ticks; when one client goes away after 5 steps, its image leaves
    its slot at once while the other runs to the end. Device time is counted in slot-steps (the
    images the engine stepped, summed over ticks), not on the wall clock of a shared machine: a
    host that kept stepping the abandoned image would have run all 60."""
    before = _engine_stats(step_app, BIG)
    body = {"steps": 30, "guidance_scale": 0.0, "width": BIG, "height": BIG}
    t_other, other = _stream_in_thread(step_app, {"prompt": "the one that leaves", "seed": 5,
                                                  **body})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        kept = pool.submit(_generate, step_app, prompt="the one that stays", seed=4, **body)
        _wait_for_step(other, 5)
        other["leave"] = True
        _join(t_other, other)
        assert kept.result()["images"]
    stats = _wait_for_freed_slot(step_app, before["cancelled"], BIG)
    assert stats["queued"] == 0
    assert stats["finished"] - before["finished"] == 1  # the one that stayed
    assert stats["cancelled"] - before["cancelled"] == 1  # the one that left
    left_ran = stats["slot_steps"] - before["slot_steps"] - 30
    assert 5 <= left_ran <= 20, left_ran  # stopped soon after its 5th step, far from its 30


def test_openai_client_streams_partial_and_completed_images(step_app):
    openai = pytest.importorskip("openai")

    client = openai.OpenAI(base_url=f"{step_app}/v1", api_key="unused", max_retries=0)
    stream = client.images.generate(model="tiny-sdxl", prompt="a green triangle",
                                    size=f"{SIZE}x{SIZE}", stream=True, partial_images=2)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    for e in events:
        assert png(e.b64_json).shape == (SIZE, SIZE, 3) and e.size == f"{SIZE}x{SIZE}"
    assert client.models.list().data[0].model_extra["maxdiff"]["engine"] == "step"
    # without streaming the same route answers JSON as before
    plain = client.images.generate(model="tiny-sdxl", prompt="a green triangle",
                                   size=f"{SIZE}x{SIZE}")
    assert png(plain.data[0].b64_json).shape == (SIZE, SIZE, 3)


def test_stream_validation(step_app):
    r = requests.post(f"{step_app}/v1/generate", json={"prompt": "x", "stream": True,
                                                       "num_images": 2}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["param"] == "num_images"
    r = requests.post(f"{step_app}/v1/images/generations",
                      json={"prompt": "x", "stream": True, "partial_images": 4}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["param"] == "partial_images"


def test_cfg_cutoff_runs_and_deepcache_is_refused_before_queueing(step_app, pipe):
    """engine=step: a cfg_cutoff image is the Python API's; deepcache_interval > 1 is a 422
    naming the field on both routes, from the ingress (its words: before anything is queued)."""
    body = dict(prompt="a small dog", seed=90, steps=4, guidance_scale=5.0, cfg_cutoff=0.5,
                width=SIZE, height=SIZE)
    got = png(_generate(step_app, **body)["images"][0]["b64_json"]).astype(int)
    ours = pipe("a small dog", seed=90, num_inference_steps=4, guidance_scale=5.0,
                cfg_cutoff=0.5, height=SIZE, width=SIZE).images[0]
    assert np.abs(got - np.asarray(ours, int)).max() <= 1
    for route in ("/v1/generate", "/v1/images/generations"):
        r = requests.post(f"{step_app}{route}", json={"prompt": "x", "deepcache_interval": 2},
                          timeout=30)
        err = r.json()["error"]
        assert r.status_code == 422 and err["param"] == "deepcache_interval", r.text
        assert "this server runs engine=step, which cannot run DeepCache" in err["message"], \
            r.text


def test_a_hires_fix_runs_on_a_step_server(step_app, pipe):
    """engine=step: a hires-fix request (two sizes, so not a step engine's) runs on the batch
    backend beside the engines and gives the Python API's image."""
    body = dict(prompt="a small dog", seed=91, steps=2, hires_scale=2.0, hires_steps=3,
                width=BIG, height=BIG)
    got = png(_generate(step_app, **body)["images"][0]["b64_json"]).astype(int)
    ours = pipe("a small dog", seed=91, num_inference_steps=2, guidance_scale=0.0,
                hires_scale=2.0, hires_steps=3, height=BIG, width=BIG).images[0]
    assert np.abs(got - np.asarray(ours, int)).max() <= 1


def test_a_client_disconnect_frees_its_slot(step_app):
    before = _engine_stats(step_app)["cancelled"]
    r = requests.post(f"{step_app}/v1/generate", json={
        "prompt": "abandoned", "steps": 50, "guidance_scale": 3.0, "stream": True},
        stream=True, timeout=120)
    events = sse_events(r)
    for name, data in events:
        if name == "progress" and data["step"] >= 2:
            break
    r.close()  # the client goes away mid-stream
    stats = _wait_for_freed_slot(step_app, before)
    assert stats["queued"] == 0


def test_playground_streams_steps_and_previews(step_app, browser):
    """On a step-engine server the playground asks for a stream: a step progress bar and VAE
    previews while the image is made, then the usual card, with the pixels of the same request
    sent without streaming."""
    page = browser.new_page(viewport={"width": 1100, "height": 760}, bypass_csp=True)
    problems, bodies = [], []
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("request", lambda r: r.method == "POST" and bodies.append(r.post_data_json))
    page.goto(f"{step_app}/")
    page.wait_for_function("document.getElementById('scheduler').textContent.endsWith('Scheduler')")
    page.evaluate("""() => { window.labels = [];
        new MutationObserver(() => { const l = document.getElementById('step-label');
            if (l && l.textContent) window.labels.push(l.textContent); })
        .observe(document.getElementById('status'),
                 {subtree: true, childList: true, characterData: true}); }""")
    settings = {"#prompt": "a red circle", "#width": str(SIZE), "#height": str(SIZE),
                "#steps": "40", "#guidance_scale": "3", "#seed": "5"}
    for sel, value in settings.items():
        page.fill(sel, value)
    page.click("#generate")
    page.wait_for_selector("figure.card img", timeout=120_000)
    assert bodies[-1]["stream"] is True and bodies[-1]["partial_images"] == 2
    labels = page.evaluate("window.labels")
    assert labels and all(re.fullmatch(r"step \d+ of 40|queued \(position \d+\)", t)
                          for t in labels), labels
    # the last preview stays in its (now hidden) figure: a real image, from step 13 or 27
    assert page.is_hidden("#preview")
    assert page.text_content("#preview-caption") in ("preview at step 13", "preview at step 27")
    preview = png(page.get_attribute("#preview-img", "src").split(",", 1)[1])
    final = png(page.get_attribute("figure.card img", "src").split(",", 1)[1])
    assert preview.shape == final.shape == (SIZE, SIZE, 3)
    plain = _generate(step_app, prompt="a red circle", width=SIZE, height=SIZE, steps=40,
                      guidance_scale=3.0, seed=5)
    assert np.abs(png(plain["images"][0]["b64_json"]).astype(int) - final).max() <= 1
    assert not problems, problems
    page.close()


def test_a_deadline_cancels_the_image_on_the_device(step_app):
    """A 504 at the deadline, and the image leaves its slot having run about as many steps as
    fit in the deadline: a host that queued steps ahead of the device would have queued all 50
    before the deadline passed."""
    before = _engine_stats(step_app, BIG)
    r = requests.post(f"{step_app}/v1/generate", json={
        "prompt": "too slow", "steps": 50, "guidance_scale": 0.0, "width": BIG, "height": BIG},
        headers={"X-Request-Timeout": "1.0"}, timeout=60)
    assert r.status_code == 504, r.text
    stats = _wait_for_freed_slot(step_app, before["cancelled"], BIG)
    assert stats["finished"] == before["finished"]  # cancelled, not finished
    ran = stats["slot_steps"] - before["slot_steps"]
    assert 1 <= ran <= 30, ran  # about 1 s of 0.1 s steps, far from its 50


def test_stats_name_each_engines_admission_policy(step_app, sdxl_dir):
    """/v1/stats names the step engines' policy (the serve arg step_policy, default fifo); the
    step backend builds its engines with the policy the serve arg names."""
    from pipelines import TextToImagePipeline
    from serving.settings import ServeSettings
    from serving.step_backend import StepBackend

    assert _engine_stats(step_app)["policy"] == "fifo"
    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    for policy in ("fifo", "srs"):
        settings = ServeSettings.from_args({"engine": "step", "step_policy": policy})
        backend = StepBackend(pipe, settings, None, None, {}, lambda: None)
        assert backend._new_engine((32, 32, ())).policy.name == policy


@pytest.mark.slow
def test_a_size_not_warmed_up_compiles_and_serves(step_app):
    out = _generate(step_app, width=16, height=48, steps=2, seed=3)
    assert png(out["images"][0]["b64_json"]).shape == (48, 16, 3)
    assert set(requests.get(f"{step_app}/v1/stats", timeout=30).json()["replicas"].popitem()[1][
        "models"]["tiny-sdxl"]["engines"]) == {f"{SIZE}x{SIZE}", f"{BIG}x{BIG}", "16x48"}


@pytest.mark.slow  # compiles a ControlNet step engine in the replica (~75 s); the engine's parity
# with ControlNetPipeline is in the default suite (tests/test_controlnet_pipeline.py)
def test_controlnet_requests_run_on_a_step_engine_with_previews(step_app, sdxl_dir,
                                                                 step_controlnet):
    """engine=step runs ControlNet requests on a step engine of their ControlNet (its own
    engine in /v1/stats): a streamed one gets its steps and partial images, and it and one sent
    beside it (another control image, scale and window, with CFG) each equal the Python API's
    ControlNetPipeline image alone."""
    import base64
    import io

    from PIL import Image

    from pipelines import ControlNetPipeline, TextToImagePipeline

    controls = [np.random.default_rng(k).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
                for k in (60, 61)]

    def b64(a):
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, "PNG")
        return base64.b64encode(buf.getvalue()).decode()

    bodies = [{"prompt": "a red circle", "seed": 21, "steps": 4, "guidance_scale": 0.0,
               "control_images": [{"image": b64(controls[0]), "controlnet": "canny"}]},
              {"prompt": "a blue square", "seed": 22, "steps": 4, "guidance_scale": 3.0,
               "control_images": [{"image": b64(controls[1]), "controlnet": "canny",
                                   "scale": 0.5, "start": 0.25}]}]
    t, rec = _stream_in_thread(step_app, dict(bodies[0], partial_images=1))
    other = _generate(step_app, **bodies[1])
    _join(t, rec)
    names = [(name, d.get("step")) for _, name, d in rec["events"]]
    assert [k for _, k in _progress(rec)] == [1, 2, 3, 4], names
    assert ("partial_image", 2) in names and names[-1][0] == "result", names
    streamed = rec["events"][-1][2]
    assert streamed["controlnets"] == other["controlnets"] == ["canny"]
    (replica,) = requests.get(f"{step_app}/v1/stats", timeout=30).json()["replicas"].values()
    engine = replica["models"]["tiny-sdxl"]["engines"][f"controlnet[canny]:{SIZE}x{SIZE}"]
    assert engine["finished"] >= 2, engine
    one = ControlNetPipeline.from_pipe(
        TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None),
        controlnet=str(step_controlnet))
    for body, got in zip(bodies, (streamed, other)):
        (c,) = body["control_images"]
        ours = one(body["prompt"], image=Image.fromarray(controls[bodies.index(body)]),
                   controlnet_conditioning_scale=c.get("scale", 1.0),
                   control_guidance_start=c.get("start", 0.0), seed=body["seed"],
                   num_inference_steps=4, guidance_scale=body["guidance_scale"]).images[0]
        assert np.abs(png(got["images"][0]["b64_json"]).astype(int)
                      - np.asarray(ours, int)).max() <= 1, body["prompt"]


@pytest.mark.slow  # compiles a one-slot ControlNet step engine (no Ray: the backend alone)
def test_a_controlnet_warmup_shape_compiles_its_step_engine(sdxl_dir, step_controlnet):
    """engine=step's warm-up of a shape with ControlNets (serve arg warmup_shapes
    ``WxH:steps:guidance:names``) makes and compiles that ControlNet set's step engine."""
    from pipelines import ControlNetPipeline, TextToImagePipeline
    from pipelines.conditioned_requests import ControlImage, ControlRequest
    from serving.settings import ServeSettings
    from serving.step_backend import StepBackend

    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    cn = ControlNetPipeline.from_pipe(pipe, controlnet=str(step_controlnet))
    settings = ServeSettings.from_args({"engine": "step", "engine_slots": 1})
    backend = StepBackend(pipe, settings, None, None, {}, lambda: None,
                          controlnets={"canny": (cn.controlnets[0], cn.controlnet_params[0])})
    blank = ControlImage(np.zeros((SIZE, SIZE, 3), np.uint8))
    job = ControlRequest("", None, 0, 1, SIZE, SIZE, 4, 0.0, controls=(("canny", blank),))
    assert backend.warmup(job) == f"controlnet[canny]:{SIZE}x{SIZE}:step-engine"
    (engine,) = backend._engines.values()
    assert engine.num_compiled == engine.max_programs == 4  # step (1, 0), (1, 1), admit, decode
    assert backend.warmup(job) is None  # once per size and ControlNet set
    assert list(backend.stats()["engines"]) == [f"controlnet[canny]:{SIZE}x{SIZE}"]
