"""Several models in one application (serve arg ``models``, Ray Serve model multiplexing): two
tiny SDXL checkpoints of different weights behind one endpoint, on two generator replicas that
each keep one model loaded. Requests naming each model get that model's pixels (equal to its
Python API output), the default when they name none; a name not served is a 404 naming the
choices in both dialects; ``/v1/models`` lists both with their limits; and once a replica has
loaded model B, B's requests go to it while A's go to the replica that still holds A. The
application is conftest's ``multi_app`` (its serve args: ``MULTI_ARGS``), which test_cost.py
prices; the step engine's case runs on conftest's ``step_app``, which serves the two
checkpoints too. A third entry of ``multi_app`` serves A's weights quantized to int8
(``quantization: int8``)."""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import pytest
import requests

from .helpers import MAIN_ARGS, MODEL_A, MODEL_B, SIZE, STEPS, generate, png, sse_events

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

A, B, Q = MODEL_A, MODEL_B, "tiny-int8"
BODY = dict(steps=STEPS, guidance_scale=0.0, width=SIZE, height=SIZE)


@pytest.fixture(scope="module")
def multi(multi_app):
    return multi_app.url


def _replicas(url) -> dict:
    return requests.get(f"{url}/v1/stats", timeout=30).json()["replicas"]


def _replicas_once(url, done, within_s: float = 30) -> dict:
    """The replicas' stats once ``done(stats)`` (replicas report after each batch, a moment
    after its answers go out), or after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        reps = _replicas(url)
        if done(reps) or time.monotonic() > deadline:
            return reps
        time.sleep(0.2)


def _replica_once(url, done) -> dict:
    """The one replica's stats once ``done(stats)``."""
    (rep,) = _replicas_once(url, lambda reps: done(next(iter(reps.values())))).values()
    return rep


def _python_api(path, cache, seed):
    from pipelines import TextToImagePipeline

    pipe = TextToImagePipeline.from_pretrained(path, compile_cache_dir=cache)
    out = pipe("a red circle", seed=seed, num_inference_steps=STEPS, guidance_scale=0.0,
               height=SIZE, width=SIZE, output_type="np").images[0]
    return np.round(out * 255).astype(int)


@pytest.fixture(scope="module")
def want(cluster, sdxl_dir, sdxl_b) -> dict:
    """Each model's Python API image of "a red circle", seed 5."""
    return {A: _python_api(sdxl_dir, cluster.cache, 5), B: _python_api(sdxl_b, cluster.cache, 5)}


def test_each_model_answers_with_its_own_pixels(multi, want):
    got = {}
    for name in (A, B, None):
        r = generate(multi, seed=5, model=name, **BODY) if name else generate(multi, seed=5, **BODY)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == (name or A)
        got[name] = png(r.json()["images"][0]["b64_json"]).astype(int)
    assert np.abs(got[A] - want[A]).max() <= 1
    assert np.abs(got[B] - want[B]).max() <= 1
    assert np.array_equal(got[None], got[A])  # no model named: the default (first)
    assert np.abs(want[A] - want[B]).max() > 10  # the two models really differ

    # the OpenAI route: `model` picks the model; its default steps are the model's own
    r = requests.post(f"{multi}/v1/images/generations", timeout=120,
                      json={"prompt": "a red circle", "model": B, "size": f"{SIZE}x{SIZE}"})
    assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text


def test_an_unknown_model_is_a_404_naming_the_choices(multi):
    r = generate(multi, model="tiny-c", **BODY)
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "'tiny-c'" in error["message"] and f"{A}, {B}" in error["message"]
    for body in ({"model": "dall-e-3"}, {"model": "tiny-c:lora"}):
        r = requests.post(f"{multi}/v1/images/generations", json={"prompt": "x", **body},
                          timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert f"{A}, {B}" in r.json()["error"]["message"]
    import openai

    client = openai.OpenAI(base_url=f"{multi}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="choose one of: tiny-a, tiny-b"):
        client.images.generate(model="dall-e-3", prompt="x", size=f"{SIZE}x{SIZE}")
    r = requests.get(f"{multi}/v1/models/tiny-c", timeout=30)
    assert r.status_code == 404 and f"{A}, {B}" in r.text, r.text


def test_models_lists_both_with_their_limits(multi):
    assert generate(multi, model=B, seed=1, **BODY).status_code == 200  # B loaded somewhere
    r = requests.get(f"{multi}/v1/models/{B}", timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["maxdiff"]["default_steps"] == 3 and not r.json()["maxdiff"]["default"]
    data = requests.get(f"{multi}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in data] == [A, B, Q]
    a, b = (m["maxdiff"] for m in data[:2])  # (Q, never loaded here, has no details)
    assert a["default"] and (a["default_steps"], b["default_steps"]) == (STEPS, 3)
    assert a["limits"]["max_size"] == b["limits"]["max_size"] == MAIN_ARGS["max_size"]


def test_a_replica_holding_a_model_is_preferred_for_it(multi):
    """Two replicas, one model each at most: both start with A (the default, warmed up). The
    first B request makes one replica swap A for B; from then on B's requests go to that
    replica, which loads B no more, and A's to the other one."""
    r = generate(multi, model=B, seed=2, **BODY)
    assert r.status_code == 200, r.text
    b_replica = r.headers["X-Maxdiff-Replica"]
    deadline = time.monotonic() + 60  # the swap reaches the routers (Ray pushes model ids)
    while time.monotonic() < deadline:
        reps = _replicas(multi)
        holding = {rid: rep["loaded_models"] for rid, rep in reps.items()}
        if len(reps) == 2 and holding.get(b_replica) == [B]:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"replica {b_replica} does not hold only {B}: {holding}")
    time.sleep(2)  # the replicas' pushes of their model ids are every 0.1 s
    loads_before = reps[b_replica]["models"][B]["loads"]
    b_answers = [generate(multi, model=B, seed=10 + i, **BODY) for i in range(4)]
    a_answers = [generate(multi, model=A, seed=20 + i, **BODY) for i in range(4)]
    assert all(r.status_code == 200 for r in b_answers + a_answers)
    assert {r.headers["X-Maxdiff-Replica"] for r in b_answers} == {b_replica}
    a_replicas = {r.headers["X-Maxdiff-Replica"] for r in a_answers}
    assert len(a_replicas) == 1 and b_replica not in a_replicas, a_replicas
    (a_replica,) = a_replicas
    reps = _replicas_once(multi, lambda reps: reps[a_replica]["models"][A]["images"] >= 4)
    assert reps[b_replica]["models"][B]["loads"] == loads_before  # served without reloading
    assert reps[a_replica]["loaded_models"] == [A]
    assert reps[a_replica]["models"][A]["images"] >= 4
    assert {b["model"] for b in reps[b_replica]["batches"][-4:]} == {B}


def test_the_step_engine_runs_each_model_on_its_own_engines(step_app, want):
    """engine=step with two models on one replica (conftest's step_app: tiny-sdxl, the default,
    is A's checkpoint; B is B's): each model gets its own step engines (no tick mixes models) and
    its own pixels. Image counts are read as differences: other modules use the application."""
    url, default = step_app, "tiny-sdxl"
    checkpoint = {default: A, B: B}  # served name -> whose Python API pixels it must give

    def images(rep, name):
        return rep["models"].get(name, {}).get("images", 0)

    before = _replica_once(url, lambda rep: True)
    for name in (B, default):
        r = generate(url, seed=5, model=name, **BODY)
        assert r.status_code == 200, r.text
        got = png(r.json()["images"][0]["b64_json"]).astype(int)
        assert np.abs(got - want[checkpoint[name]]).max() <= 1, name
    r = requests.post(f"{url}/v1/generate", stream=True, timeout=120,  # streamed: B's too
                      json={"prompt": "a red circle", "model": B, "seed": 5, "stream": True,
                            **BODY})
    events = list(sse_events(r))
    assert [name for name, _ in events].count("progress") >= 2, events  # B's engine's steps
    assert events[-1][0] == "result" and events[-1][1]["model"] == B
    got = png(events[-1][1]["images"][0]["b64_json"]).astype(int)
    assert np.abs(got - want[B]).max() <= 1
    rep = _replica_once(url, lambda rep: images(rep, B) == images(before, B) + 2)
    assert rep["loaded_models"] == [default, B] and rep["engine"] == "step"
    assert list(rep["models"][B]["engines"]) == [f"{SIZE}x{SIZE}"]  # B's own, only its size
    assert f"{SIZE}x{SIZE}" in rep["models"][default]["engines"]  # (and its warm-up sizes)
    assert images(rep, default) == images(before, default) + 1
    assert images(rep, B) == images(before, B) + 2


def test_models_that_take_turns_on_one_replica_lose_nothing(cluster, sdxl_dir, sdxl_b, want):
    """One replica that holds one model at a time, asked for A and B at once: the LRU swaps
    them (an evicted model finishes the requests it has started) and every request gets its
    model's pixels."""
    from serving.app import build_app

    from .helpers import concurrently

    args = {k: v for k, v in MAIN_ARGS.items() if k not in ("steps", "guidance", "model_name")}
    args.update(num_cpus=0, max_models_per_replica=1, max_queued_requests=-1,
                models=[{"name": A, "model": str(sdxl_dir)}, {"name": B, "model": str(sdxl_b)}])
    serve.run(build_app(args), name="multi-swap", route_prefix="/multi-swap")
    try:
        url = f"{cluster.url}/multi-swap"
        names = [B, A, B, A, B, A]
        rs = concurrently(len(names), lambda i: generate(url, seed=5, model=names[i], **BODY))
        assert [r.status_code for r in rs] == [200] * len(names), [r.text for r in rs]
        for name, r in zip(names, rs):
            got = png(r.json()["images"][0]["b64_json"]).astype(int)
            assert r.json()["model"] == name and np.abs(got - want[name]).max() <= 1, name
        rep = _replica_once(url, lambda rep: rep["models"][A]["images"]
                            + rep["models"][B]["images"] == 6)
        assert len(rep["loaded_models"]) == 1
        assert rep["models"][B]["loads"] >= 1 and rep["models"][A]["loads"] >= 1
        assert (rep["models"][A]["images"], rep["models"][B]["images"]) == (3, 3)
        # batch ids name batches across the models' loads (they never start again at 1)
        ids = [b["id"] for b in rep["batches"]]
        assert len(ids) == len(set(ids)) and ids == sorted(ids), ids
    finally:
        serve.delete("multi-swap")


def test_an_int8_model_answers_the_openai_client_with_the_python_apis_pixels(multi, cluster,
                                                                           sdxl_dir, want):
    """The ``quantization: int8`` entry (A's weights): the official openai client gets its image
    and sees the setting in the model's details. Its pixels (native route, seed 5: the OpenAI
    route's seeds are random and not reported) equal the Python API's with
    ``quantization="int8"`` for the same request to the bit: one image, so the same padded batch
    (1) and program (uint8 output), which int8 activations need (docs/python-api.md); they
    differ from A's float32 pixels. After the tests that read which replica holds which model:
    loading it swaps a replica's model."""
    import openai
    from PIL import Image

    from pipelines import TextToImagePipeline

    client = openai.OpenAI(base_url=f"{multi}/v1", api_key="unused", max_retries=0)
    out = client.images.generate(model=Q, prompt="a red circle", size=f"{SIZE}x{SIZE}")
    assert len(out.data) == 1 and png(out.data[0].b64_json).shape == (SIZE, SIZE, 3)
    assert client.models.retrieve(Q).to_dict()["maxdiff"]["quantization"] == "int8"
    r = generate(multi, seed=5, model=Q, **BODY)
    assert r.status_code == 200 and r.json()["model"] == Q, r.text
    b64 = r.json()["images"][0]["b64_json"]
    assert Image.open(io.BytesIO(base64.b64decode(b64))).text["quantization"] == "int8"
    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, quantization="int8",
                                               compile_cache_dir=cluster.cache)
    ours = pipe("a red circle", seed=5, num_inference_steps=STEPS, guidance_scale=0.0,
                height=SIZE, width=SIZE).images[0]
    got = png(b64)
    np.testing.assert_array_equal(got, np.asarray(ours))
    assert np.abs(got.astype(int) - want[A]).max() > 0  # quantized: not A's float32 pixels


def test_batch_ids_never_repeat_on_a_replica_across_model_loads(multi):
    """Three models on two replicas that hold one each: requests that cycle through them make
    replicas load models again, and each replica's batch ids (``timings.batch_id``, the
    replica named by ``X-Maxdiff-Replica``) keep rising across the loads and both models'
    backends, never starting again at 1."""
    per_replica: dict[str, list[tuple[str, int]]] = {}
    for k, name in enumerate([A, B, Q] * 3):
        r = generate(multi, seed=30 + k, model=name, **BODY)
        assert r.status_code == 200, r.text
        per_replica.setdefault(r.headers["X-Maxdiff-Replica"], []).append(
            (name, r.json()["timings"]["batch_id"]))
    swapped = [rid for rid, seen in per_replica.items() if len({m for m, _ in seen}) > 1]
    assert swapped, per_replica  # a replica that held one model at a time served two
    for rid, seen in per_replica.items():
        ids = [i for _, i in seen]
        assert all(a < b for a, b in zip(ids, ids[1:])), (rid, seen)
