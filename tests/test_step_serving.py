"""The service with step-level batching (serve arg engine=step) on a real Ray Serve over real
HTTP: short requests overtake long ones, streaming (native and the official openai client), and
a client that disconnects frees its slot."""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import time

import numpy as np
import pytest
import requests
from PIL import Image

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

SIZE = 32
STEP_ARGS = dict(
    engine="step", engine_slots=2, steps=4, guidance=0.0, warmup_shapes=[f"{SIZE}x{SIZE}"],
    max_steps=50, max_n=2, min_size=16, max_size=64, request_timeout_s=120, num_cpus=1,
    ingress_num_cpus=0, model_name="tiny-sdxl", max_cost=1.0, max_queued_requests=16,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _png(b64: str) -> np.ndarray:
    im = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert im.format == "PNG"
    return np.asarray(im.convert("RGB"))


def _events(response):
    """(event, data) pairs of a Server-Sent Events response, as they arrive."""
    name = None
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            yield name, json.loads(line[len("data: "):])


@pytest.fixture(scope="module")
def step_app(tmp_path_factory, sdxl_dir):
    from serving.app import build_app

    cache = tmp_path_factory.mktemp("jax-cache")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"MAXDIFF_COMPILE_CACHE": str(cache)}})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app({"model": str(sdxl_dir), **STEP_ARGS}), name="step",
                  route_prefix="/step")
        yield f"http://127.0.0.1:{port}/step"
    finally:
        serve.shutdown()
        ray.shutdown()


def _generate(url, **body):
    r = requests.post(f"{url}/v1/generate", json={"prompt": "a red circle", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _engine_stats(url):
    (replica,) = requests.get(f"{url}/v1/stats", timeout=30).json()["replicas"].values()
    return replica["engines"][f"{SIZE}x{SIZE}"]


def _wait_for_freed_slot(url: str, cancelled_before: int) -> dict:
    """Engine stats once one more image was cancelled and no slot is active (30 s at most)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = _engine_stats(url)
        if stats["cancelled"] > cancelled_before and stats["active"] == 0:
            return stats
        time.sleep(0.2)
    pytest.fail(f"the slot was not freed: {stats}")


def test_a_short_request_overtakes_a_long_one(step_app):
    long = requests.post(f"{step_app}/v1/generate", json={
        "prompt": "a long one", "steps": 40, "guidance_scale": 3.0, "seed": 1, "stream": True},
        stream=True, timeout=120)
    assert long.status_code == 200 and long.headers["content-type"].startswith("text/event-stream")
    events = _events(long)
    name, first = next(events)
    assert name == "progress" and (first["step"], first["total"]) == (0, 40)
    for name, data in events:  # the long image is running
        if name == "progress" and data["step"] >= 2:
            break
    short = {"prompt": "a blue square", "steps": 2, "guidance_scale": 2.0, "seed": 7}
    shared = _generate(step_app, **short)
    rest = list(events)
    assert [d["step"] for n, d in rest if n == "progress"][-1] == 40
    assert rest[-1][0] == "result" and rest[-1][1]["steps"] == 40
    # result ids are given in the order requests finish on the replica: the short one first
    assert shared["timings"]["batch_id"] < rest[-1][1]["timings"]["batch_id"]
    alone = _generate(step_app, **short)
    assert alone["seeds"] == shared["seeds"] == [7]
    assert np.abs(_png(alone["images"][0]["b64_json"]).astype(int)
                  - _png(shared["images"][0]["b64_json"])).max() <= 1


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
        assert _png(e.b64_json).shape == (SIZE, SIZE, 3) and e.size == f"{SIZE}x{SIZE}"
    assert client.models.list().data[0].model_extra["maxdiff"]["engine"] == "step"
    # without streaming the same route answers JSON as before
    plain = client.images.generate(model="tiny-sdxl", prompt="a green triangle",
                                   size=f"{SIZE}x{SIZE}")
    assert _png(plain.data[0].b64_json).shape == (SIZE, SIZE, 3)


def test_stream_validation(step_app):
    r = requests.post(f"{step_app}/v1/generate", json={"prompt": "x", "stream": True,
                                                       "num_images": 2}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["param"] == "num_images"
    r = requests.post(f"{step_app}/v1/images/generations",
                      json={"prompt": "x", "stream": True, "partial_images": 4}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["param"] == "partial_images"


def test_a_client_disconnect_frees_its_slot(step_app):
    before = _engine_stats(step_app)["cancelled"]
    r = requests.post(f"{step_app}/v1/generate", json={
        "prompt": "abandoned", "steps": 50, "guidance_scale": 3.0, "stream": True},
        stream=True, timeout=120)
    events = _events(r)
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
    preview = _png(page.get_attribute("#preview-img", "src").split(",", 1)[1])
    final = _png(page.get_attribute("figure.card img", "src").split(",", 1)[1])
    assert preview.shape == final.shape == (SIZE, SIZE, 3)
    plain = _generate(step_app, prompt="a red circle", width=SIZE, height=SIZE, steps=40,
                      guidance_scale=3.0, seed=5)
    assert np.abs(_png(plain["images"][0]["b64_json"]).astype(int) - final).max() <= 1
    assert not problems, problems
    page.close()


@pytest.mark.slow  # default-suite time: make test-slow runs it
def test_a_deadline_cancels_the_image(step_app):
    """A 504 at the deadline, and the image leaves its slot: cancelled at the next tick, or,
    when its 50 one-row steps beat the cancellation (they take about as long as the 0.2 s
    deadline on this tiny model), finished; either way no slot stays taken."""
    before = _engine_stats(step_app)
    r = requests.post(f"{step_app}/v1/generate", json={
        "prompt": "too slow", "steps": 50, "guidance_scale": 3.0},
        headers={"X-Request-Timeout": "0.2"}, timeout=60)
    assert r.status_code == 504, r.text
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = _engine_stats(step_app)
        left = (stats["cancelled"] + stats["finished"]) - (before["cancelled"] + before["finished"])
        if stats["submitted"] > before["submitted"] and left >= 1 and stats["active"] == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the slot was not freed: {stats}")


@pytest.mark.slow
def test_a_size_not_warmed_up_compiles_and_serves(step_app):
    out = _generate(step_app, width=16, height=48, steps=2, seed=3)
    assert _png(out["images"][0]["b64_json"]).shape == (48, 16, 3)
    assert set(requests.get(f"{step_app}/v1/stats", timeout=30).json()["replicas"].popitem()[1][
        "engines"]) == {f"{SIZE}x{SIZE}", "16x48"}
