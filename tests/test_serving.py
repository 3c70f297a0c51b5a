"""The HTTP service on a real Ray Serve (a local 3-node Ray cluster) over real HTTP.

One cluster for the module: a head node and two "hosts" with one unit each of a custom
``maxdiff_host`` resource. The main application (one generator replica, tiny checkpoint) serves
most tests; the multi-host test adds a second application whose two replicas need a
``maxdiff_host`` each, so they land on the two hosts. Replicas share a JAX compilation cache
(``MAXDIFF_COMPILE_CACHE``), so only the first replica compiles cold.
"""

from __future__ import annotations

import base64
import collections
import io
import json
import os
import socket
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import requests
from hypothesis import given
from PIL import Image

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

SIZE, STEPS = 32, 2
MAIN_ARGS = dict(
    steps=STEPS, guidance=0.0, max_batch_size=4, batch_wait_timeout_s=0.5,
    warmup_shapes=[f"{SIZE}x{SIZE}:{STEPS}:0"], max_queued_requests=2, max_n=4, max_steps=8,
    min_size=16, max_size=64, request_timeout_s=120, num_cpus=1, ingress_num_cpus=0,
    model_name="tiny-sdxl", max_cost=0.02, max_image_bytes=2**20,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _png(b64_or_bytes) -> np.ndarray:
    raw = base64.b64decode(b64_or_bytes) if isinstance(b64_or_bytes, str) else b64_or_bytes
    im = Image.open(io.BytesIO(raw))
    assert im.format == "PNG"
    return np.asarray(im.convert("RGB"))


def _concurrently(n, fn):
    out = [None] * n
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, fn(i))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture(scope="module")
def cluster(compile_cache):
    from ray.cluster_utils import Cluster

    cache = compile_cache  # the run's: the replicas start with the programs already compiled
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False,
        "_system_config": {"metrics_report_interval_ms": 1000}})
    hosts = [c.add_node(num_cpus=1, resources={"maxdiff_host": 1}) for _ in range(2)]
    ray.init(address=c.address, log_to_driver=False,
             runtime_env={"env_vars": {"MAXDIFF_COMPILE_CACHE": str(cache)}})
    port = _free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    try:
        yield types.SimpleNamespace(url=f"http://127.0.0.1:{port}", cache=cache,
                                    nodes=[c.head_node, *hosts],
                                    host_node_ids={h.node_id for h in hosts})
    finally:
        serve.shutdown()
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def main_app(cluster, sdxl_dir):
    """The main application, deployed without waiting; /healthz and /v1/generate are probed
    while the generator replica loads and compiles, then until it is ready."""
    from serving.app import build_app

    url = cluster.url
    serve._run(build_app({"model": str(sdxl_dir), **MAIN_ARGS}), _blocking=False, name="main",
               route_prefix="/")
    probes, early_generate = [], None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            r = requests.get(f"{url}/healthz", timeout=10)
            probes.append((r.status_code, r.headers.get("content-type", ""), r.text,
                           r.headers.get("retry-after")))
            if r.status_code == 200:
                break
            if r.status_code == 503 and early_generate is None and "warming_up" in r.text:
                early_generate = requests.post(f"{url}/v1/generate", json={"prompt": "early"},
                                               timeout=30)
        except requests.ConnectionError:
            probes.append(("connection refused", "", "", None))
        time.sleep(0.25)
    else:
        pytest.fail(f"the main app never became healthy; last probes: {probes[-3:]}")
    yield types.SimpleNamespace(url=url, probes=probes, early_generate=early_generate)
    serve.delete("main")


@pytest.fixture(scope="module")
def pipe(main_app, cluster, sdxl_dir):
    """The Python API in this process, sharing the replicas' compilation cache."""
    import jax

    from pipelines import TextToImagePipeline

    before = (jax.config.jax_compilation_cache_dir,
              jax.config.jax_persistent_cache_min_compile_time_secs)
    yield TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=cluster.cache)
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


def _generate(url, timeout=120, headers=None, **body):
    return requests.post(f"{url}/v1/generate", json={"prompt": "a red circle", **body},
                         headers=headers, timeout=timeout)


def _generate_as_a_client(url, **body):
    """What a well-behaved client does: a 503 with Retry-After is retried (up to 3 times).
    With max_queued_requests=2, requests that arrive at the same instant can outrun the
    router's replica assignment and be shed before the replica is even asked."""
    for _ in range(3):
        r = _generate(url, **body)
        if r.status_code != 503:
            break
        time.sleep(float(r.headers.get("Retry-After", 1)))
    return r


# ---------------------------------------------------------------------------------- settings
def test_settings_from_cli_strings():
    from serving.schemas import ServeSettings, WarmupShape

    s = ServeSettings.from_args({
        "max_batch_size": "8", "batch_wait_timeout_s": "0.1", "resource": "TPU",
        "resource_amount": "4", "max_replicas_per_node": "1", "steps": "4", "model": "/m/1234",
        "warmup_shapes": "1024x1024:4:0,512x768:30:cfg", "warmup_batch_sizes": "1,2"})
    assert (s.max_batch_size, s.batch_wait_timeout_s, s.resource, s.resource_amount) == (
        8, 0.1, "TPU", 4.0)
    assert s.run_overrides == {"steps": 4, "model": "/m/1234"}
    assert s.warmup_shapes == (WarmupShape(width=1024, height=1024, steps=4, guidance=0.0),
                               WarmupShape(width=512, height=768, steps=30, guidance=5.0))
    assert s.warmup_batch_sizes == (1, 2) and s.generator_max_ongoing == 16
    assert s.engine == "batch" and s.slots == 8  # default: whole requests batched per shape key
    step = ServeSettings.from_args({"engine": "step", "engine_slots": "16"})
    assert (step.engine, step.engine_slots, step.generator_max_ongoing) == ("step", 16, 64)
    yaml_style = ServeSettings.from_args({"warmup_shapes": [{"size": "64x32", "cfg": "off"},
                                                            "default"], "max_queued_requests": -1})
    assert yaml_style.warmup_shapes == (WarmupShape(width=64, height=32, guidance=0.0),
                                        WarmupShape())


def test_settings_adapters():
    from serving.schemas import AdapterSpec, ServeSettings

    want = (AdapterSpec(name="pixel", path="/l/pixel.safetensors", scale=0.7),
            AdapterSpec(name="ink", path="/l/ink", scale=1.0))
    for spec in ("pixel=/l/pixel.safetensors:0.7, ink=/l/ink",
                 '{"pixel": {"path": "/l/pixel.safetensors", "scale": 0.7}, "ink": "/l/ink"}',
                 "{pixel: {path: /l/pixel.safetensors, scale: 0.7}, ink: /l/ink}",
                 {"pixel": {"path": "/l/pixel.safetensors", "scale": 0.7}, "ink": "/l/ink"}):
        assert ServeSettings.from_args({"adapters": spec}).adapters == want, spec
    assert ServeSettings.from_args({}).adapters == ()
    for bad, message in (("pixel", "name=path"), ("a=/x,a=/y", "'a' is given twice"),
                         ("a:b=/x", "should match pattern"), ({"a": {"path": "/x", "rank": 2}},
                                                                "unknown key .rank.")):
        with pytest.raises(ValueError, match=message):
            ServeSettings.from_args({"adapters": bad})


@pytest.mark.parametrize("args,message", [
    ({"max_batchsize": 4}, "unknown serve arg 'max_batchsize'"),
    ({"max_batch_size": "many"}, "key 'max_batch_size': Input should be a valid integer"),
    ({"steps": "many"}, "key 'steps': Input should be a valid integer"),
    ({"max_batch_size": 0}, "key 'max_batch_size': Input should be greater than or equal to 1"),
    ({"warmup_shapes": "1024y4:4"}, "WIDTHxHEIGHT"),
    ({"warmup_shapes": "64x64:0"}, "key 'steps': Input should be greater than or equal to 1"),
    ({"warmup_batch_sizes": "1,0"}, "warmup_batch_sizes"),
    ({"engine": "steps"}, "key 'engine'"),
    ({"max_batch_size": 8, "max_ongoing_requests": 4}, "batches could never fill"),
])
def test_settings_refuse_bad_args(args, message):
    from serving.schemas import ServeSettings

    with pytest.raises(ValueError, match=message):
        ServeSettings.from_args(args)


def test_build_app_without_a_model_says_what_to_do(monkeypatch, tmp_path):
    from serving.app import build_app

    monkeypatch.setenv("MAXDIFF_DEFAULT_MODEL", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="MAXDIFF_DEFAULT_MODEL"):
        build_app({})
    with pytest.raises(ValueError, match="no such file, and not one of the named run configs"):
        build_app({"config": "no-such-config", "model": str(tmp_path)})


# ---------------------------------------------------------------------------------- health
def test_healthz_is_503_while_warming_up_then_200(main_app):
    ours = [p for p in main_app.probes if p[0] in (200, 503) and "json" in p[1]]
    assert ours[0][0] == 503, main_app.probes[:5]
    assert json.loads(ours[0][2])["status"] == "warming_up"
    assert ours[0][3] is not None  # Retry-After
    assert ours[-1][0] == 200 and json.loads(ours[-1][2])["status"] == "ok"
    # a generation request during warm-up is refused at once, not queued for minutes
    early = main_app.early_generate
    assert early is not None and early.status_code == 503, early and early.text
    assert "warming up" in early.json()["error"]["message"] and early.headers["Retry-After"]
    assert requests.get(f"{main_app.url}/healthz").status_code == 200


# ---------------------------------------------------------------------------------- endpoints
def test_native_generate_json(main_app):
    r = _generate(main_app.url, seed=7, num_images=2, steps=STEPS, guidance_scale=0.0,
                  width=SIZE, height=SIZE, scheduler="EulerDiscreteScheduler")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["seeds"] == [7, 8] and [im["seed"] for im in body["images"]] == [7, 8]
    assert (body["width"], body["height"], body["steps"]) == (SIZE, SIZE, STEPS)
    assert body["model"] == "tiny-sdxl" and body["scheduler"] == "EulerDiscreteScheduler"
    pixels = [_png(im["b64_json"]) for im in body["images"]]
    assert all(p.shape == (SIZE, SIZE, 3) for p in pixels)
    assert not np.array_equal(pixels[0], pixels[1])
    assert {"queue_s", "generate_s", "encode_s", "total_s"} <= set(body["timings"])
    assert r.headers["X-Maxdiff-Replica"] and r.headers["X-Maxdiff-Node"]


def test_native_accept_png_returns_the_image(main_app):
    json_r = _generate(main_app.url, seed=11)
    r = _generate(main_app.url, seed=11, headers={"Accept": "image/png"})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert r.headers["X-Seed"] == "11"
    np.testing.assert_array_equal(_png(r.content), _png(json_r.json()["images"][0]["b64_json"]))
    for fmt, accept in (("jpeg", None), ("webp", "image/webp")):
        body = {"seed": 11} if accept else {"seed": 11, "output_format": fmt}
        r = _generate(main_app.url, headers={"Accept": accept} if accept else None, **body)
        assert r.status_code == 200, r.text
        raw = r.content if accept else base64.b64decode(r.json()["images"][0]["b64_json"])
        assert Image.open(io.BytesIO(raw)).format == fmt.upper()


def test_openai_client(main_app):
    import openai

    client = openai.OpenAI(base_url=f"{main_app.url}/v1", api_key="unused", max_retries=0)
    out = client.images.generate(model="tiny-sdxl", prompt="a blue square", n=2,
                                 size=f"{SIZE}x{SIZE}", response_format="b64_json",
                                 quality="standard", style="vivid", user="test")
    assert len(out.data) == 2 and out.created > 0
    assert all(_png(d.b64_json).shape == (SIZE, SIZE, 3) for d in out.data)
    assert out.data[0].revised_prompt is None
    assert [m.id for m in client.models.list()] == ["tiny-sdxl"]
    with pytest.raises(openai.UnprocessableEntityError, match="b64_json"):
        client.images.generate(prompt="a cat", response_format="url")
    # size "auto" (and no size) is the model's default, through the client too
    for size in ("auto", openai.NOT_GIVEN):
        out = client.images.generate(prompt="a red circle", size=size)
        assert _png(out.data[0].b64_json).shape == (SIZE, SIZE, 3)
        assert out.size == f"{SIZE}x{SIZE}"
    # the most common OpenAI size, far above what this server allows: a clear 422 at once
    t0 = time.monotonic()
    with pytest.raises(openai.UnprocessableEntityError, match=r"between 16 and 64 \(the serve arg "
                                                              r"max_size\)"):
        client.images.generate(prompt="a cat", size="1024x1024")
    assert time.monotonic() - t0 < 10
    assert client.images.generate(prompt="a cat", size=f"{SIZE}x{SIZE}").data  # still serving


def test_curl_style_form_encoded_json_is_accepted(main_app):
    """``curl -d '{...}'`` declares application/x-www-form-urlencoded; a JSON object body is
    read as JSON anyway (text/plain and no Content-Type too)."""
    body = json.dumps({"prompt": "a cat", "seed": 1234, "steps": 2, "guidance_scale": 0})
    for ctype in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {"Accept": "image/png"} | ({"Content-Type": ctype} if ctype else {})
        r = requests.post(f"{main_app.url}/v1/generate", data=body.encode(), headers=headers,
                          timeout=120)
        assert r.status_code == 200, (ctype, r.text)
        assert r.headers["content-type"] == "image/png" and r.headers["X-Seed"] == "1234"
    r = requests.post(f"{main_app.url}/v1/generate", data="prompt=a+cat",
                      headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=30)
    assert r.status_code == 422  # a real form is still not a JSON object


def test_same_seed_same_image(main_app):
    a, b, c = (_generate(main_app.url, seed=s, prompt="a green triangle") for s in (42, 42, 43))
    img = [_png(r.json()["images"][0]["b64_json"]) for r in (a, b, c)]
    np.testing.assert_array_equal(img[0], img[1])
    assert not np.array_equal(img[0], img[2])


def test_http_image_equals_python_api(main_app, pipe):
    """Same program, same seed: the served PNG has exactly the Python API's pixels."""
    r = _generate(main_app.url, prompt="a photo of a cat", negative_prompt="blurry", seed=1234,
                  steps=STEPS, guidance_scale=0.0, width=SIZE, height=SIZE)
    ours = pipe("a photo of a cat", negative_prompt="blurry", seed=1234,
                num_inference_steps=STEPS, guidance_scale=0.0, height=SIZE, width=SIZE).images[0]
    np.testing.assert_array_equal(_png(r.json()["images"][0]["b64_json"]), np.asarray(ours))


def test_concurrent_requests_share_a_batch(main_app, pipe):
    seeds = [100, 101, 102, 103]
    rs = _concurrently(4, lambda i: _generate_as_a_client(main_app.url, prompt="a small dog",
                                                           seed=seeds[i]))
    assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
    assert max(r.json()["timings"]["batch_requests"] for r in rs) > 1
    batches = [b for rep in requests.get(f"{main_app.url}/v1/stats").json()["replicas"].values()
               for b in rep["batches"]]
    assert max(b["requests"] for b in batches) > 1, batches
    # an image does not depend on what it was batched with: equal to the Python API's single
    # image up to one level: XLA's batch-4 and batch-1 programs differ by ~1e-6 in float, which
    # can flip the rounding of a rare pixel
    for r, seed in zip(rs, seeds):
        single = pipe("a small dog", seed=seed, num_inference_steps=STEPS, guidance_scale=0.0,
                      height=SIZE, width=SIZE).images[0]
        got = _png(r.json()["images"][0]["b64_json"]).astype(int)
        assert np.abs(got - np.asarray(single, int)).max() <= 1


def test_a_new_shape_does_not_hold_up_compiled_ones(main_app):
    """A 16x16 request (its own batch queue; its program compiles for seconds) sent together
    with 32x32 ones: the 32x32 requests are served while it compiles."""
    done = {}

    def send(i):
        r = _generate_as_a_client(main_app.url, seed=i,
                                  **({"width": 16, "height": 16} if i == 0 else {}))
        done[i] = time.monotonic()
        return r

    rs = _concurrently(4, send)
    assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
    assert _png(rs[0].json()["images"][0]["b64_json"]).shape == (16, 16, 3)
    assert max(done[i] for i in (1, 2, 3)) < done[0]
    shapes = {b["shape"] for rep in requests.get(f"{main_app.url}/v1/stats").json()[
        "replicas"].values() for b in rep["batches"]}
    assert {f"16x16:{STEPS}:nocfg", f"{SIZE}x{SIZE}:{STEPS}:nocfg"} <= shapes


def test_prometheus_metrics(cluster, main_app):
    """Ours (ray_maxdiff_*) next to Ray Serve's own, on the nodes' metrics export ports."""
    assert _generate(main_app.url, seed=3).status_code == 200
    wanted = ["ray_maxdiff_images_generated", "ray_maxdiff_batch_requests_bucket",
              "ray_maxdiff_queue_wait_s_bucket", "ray_maxdiff_step_time_s_bucket",
              "ray_maxdiff_device_batch_images_bucket", "ray_maxdiff_http_requests",
              "ray_serve_num_http_requests"]
    deadline = time.monotonic() + 60
    while True:
        text = ""
        for node in cluster.nodes:
            try:
                text += requests.get(f"http://{node.node_ip_address}:{node.metrics_export_port}"
                                     "/metrics", timeout=5).text
            except requests.RequestException:
                pass
        missing = [m for m in wanted if m not in text]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not missing, sorted({line.split("{")[0] for line in text.splitlines()
                                if line.startswith("ray_serve") or "maxdiff" in line})


# ---------------------------------------------------------------------------------- errors
BAD_REQUESTS = [
    ("/v1/images/generations", {"prompt": "x", "size": "33x32"}, "size", "multiple of 2"),
    ("/v1/images/generations", {"prompt": "x", "size": "4096x4096"}, "size", "out of range"),
    ("/v1/images/generations", {"prompt": "x", "size": "big"}, "size", "WIDTHxHEIGHT"),
    ("/v1/images/generations", {"prompt": "x", "n": 9}, "n", "at most 4"),
    ("/v1/images/generations", {"prompt": "x", "n": "two"}, "n", "integer"),
    ("/v1/images/generations", {"prompt": "x", "response_format": "url"}, "response_format",
     "only 'b64_json'"),
    ("/v1/images/generations", {"n": 1}, "prompt", "Field required"),
    ("/v1/generate", {"prompt": 5}, "prompt", "string"),
    ("/v1/generate", {"prompt": "x", "steps": 50}, "steps", "in 1..8 (the serve arg max_steps)"),
    ("/v1/generate", {"prompt": "x", "width": 64, "height": 64, "num_images": 4}, "num_images",
     "at most 2 image(s) at this size"),
    ("/v1/generate", {"prompt": "x", "width": 64, "height": 64, "steps": 8}, "steps",
     "at most 5 step(s) for one image"),
    ("/v1/images/generations", {"prompt": "x", "size": "64x64", "n": 4}, "n", "max_cost of 0.02"),
    ("/v1/generate", {"prompt": "x", "steps": 0}, "steps", "must be an integer in 1..8"),
    ("/v1/generate", {"prompt": "x", "width": 31}, "width", "multiple of 2"),
    ("/v1/generate", {"prompt": "x", "height": 8}, "height", "between 16 and 64"),
    ("/v1/generate", {"prompt": "x", "num_images": 5}, "num_images", "at most 4"),
    # found by schemathesis: a huge count was a MemoryError (500) while seeds were expanded
    ("/v1/generate", {"prompt": "x", "num_images": 10**15}, "num_images", "at most 4"),
    ("/v1/generate", {"prompt": "x", "width": 1000, "steps": 8}, "width", "between 16 and 64"),
    ("/v1/generate", {"prompt": "x", "seed": -1}, "seed", "seeds are integers in 0..4294967295"),
    ("/v1/generate", {"prompt": "x", "guidance_scale": "high"}, "guidance_scale", "number"),
    ("/v1/generate", {"prompt": "x", "scheduler": "DDIMScheduler"}, "scheduler",
     "EulerDiscreteScheduler"),
    ("/v1/generate", {"prompt": "x", "output_format": "gif"}, "output_format", "png"),
    ("/v1/generate", {"prompt": "x", "colour": "red"}, "colour", "Extra inputs"),
    ("/v1/generate", [1, 2], "body", "valid dictionary"),
]


@pytest.mark.parametrize("path,body,field,message", BAD_REQUESTS,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{f}-{i}" for i, (p, _, f, _) in
                              enumerate(BAD_REQUESTS)])
def test_invalid_requests_are_422_naming_the_field(main_app, path, body, field, message):
    r = requests.post(f"{main_app.url}{path}", json=body, timeout=30)
    assert r.status_code == 422, r.text
    err = r.json()
    assert any(field in [str(p) for p in d["loc"]] or (field == "body" and d["loc"] == ["body"])
               for d in err["detail"]), err
    assert message in err["error"]["message"], err


def test_malformed_json_is_422(main_app):
    r = requests.post(f"{main_app.url}/v1/generate", data=b'{"prompt": "x",',
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "not valid JSON" in r.json()["error"]["message"]
    r = requests.post(f"{main_app.url}/v1/generate", data=b'{"prompt": "x", "guidance_scale": NaN}',
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "guidance_scale"]


def test_oversized_bodies_are_413(main_app):
    big = json.dumps({"prompt": "x" * 70_000}).encode()
    r = requests.post(f"{main_app.url}/v1/generate", data=big,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    # no Content-Length (chunked upload): the bytes actually received are counted
    chunks = (big[i:i + 8192] for i in range(0, len(big), 8192))
    r = requests.post(f"{main_app.url}/v1/images/generations", data=chunks,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text


def test_accept_image_with_several_images_is_406(main_app):
    r = _generate(main_app.url, num_images=2, headers={"Accept": "image/png"})
    assert r.status_code == 406 and "num_images=1" in r.json()["error"]["message"]


def test_deadline_is_504(main_app):
    r = _generate(main_app.url, num_images=4, headers={"X-Request-Timeout": "0.001"})
    assert r.status_code == 504, r.text
    r = _generate(main_app.url, headers={"X-Request-Timeout": "soon"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["header", "x-request-timeout"]
    assert _generate(main_app.url, seed=1).status_code == 200  # the replica is fine afterwards


def test_burst_beyond_the_queue_is_503_with_retry_after(main_app):
    """max_queued_requests=2 and 8 in flight per replica: a burst of 24 overflows."""
    rs = _concurrently(24, lambda i: _generate(main_app.url, seed=i, num_images=2))
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 503}, [r.text for r in rs if r.status_code not in (200, 503)]
    assert codes.count(503) > 0 and codes.count(200) > 0, codes
    rejected = next(r for r in rs if r.status_code == 503)
    assert int(rejected.headers["Retry-After"]) > 0 and "queue is full" in rejected.text
    assert requests.get(f"{main_app.url}/healthz").status_code == 200


def test_the_batch_engine_streams_too(main_app):
    """engine=batch (this app) answers "stream": true as well, so a client never needs to know
    the engine: /v1/generate sends the queued progress event, the finished one and the result,
    whose image is the one the same request gets without streaming; the official openai
    client's images.generate(stream=True) gets its completed event (no partial images: request
    batching has no steps to show, and OpenAI allows fewer than asked). A stream is still one
    image."""
    openai = pytest.importorskip("openai")

    body = {"prompt": "a blue square", "seed": 5, "steps": STEPS}
    with requests.post(f"{main_app.url}/v1/generate", json={**body, "stream": True},
                       stream=True, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = []
        name = None
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
    assert [n for n, _ in events] == ["progress", "progress", "result"], events
    assert events[0][1] == {"step": 0, "total": STEPS, "queue_position": None}
    assert events[1][1]["step"] == STEPS
    plain = requests.post(f"{main_app.url}/v1/generate", json=body, timeout=120).json()
    assert events[2][1]["seeds"] == plain["seeds"] == [5]
    np.testing.assert_array_equal(_png(events[2][1]["images"][0]["b64_json"]),
                                  _png(plain["images"][0]["b64_json"]))

    client = openai.OpenAI(base_url=f"{main_app.url}/v1", api_key="unused", max_retries=0)
    got = list(client.images.generate(model="tiny-sdxl", prompt="a green triangle",
                                      size=f"{SIZE}x{SIZE}", stream=True, partial_images=2))
    assert [e.type for e in got] == ["image_generation.completed"]
    assert _png(got[0].b64_json).shape == (SIZE, SIZE, 3)
    r = requests.post(f"{main_app.url}/v1/generate", json={"prompt": "x", "stream": True,
                                                            "num_images": 2}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["param"] == "num_images", r.text


def test_openapi_docs(main_app):
    assert "swagger" in requests.get(f"{main_app.url}/docs").text.lower()
    paths = requests.get(f"{main_app.url}/openapi.json").json()["paths"]
    assert {"/v1/images/generations", "/v1/images/edits", "/v1/generate", "/v1/edit",
            "/healthz", "/v1/models"} <= set(paths)


# ---------------------------------------------------------------------------------- edits
def _encode(a: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def edit_files(tmp_path_factory):
    """A 32x32 picture, a white = repaint mask (left half) and the same mask the OpenAI way (an
    RGBA PNG, left half fully transparent), as files and arrays."""
    d = tmp_path_factory.mktemp("edit")
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    white = np.zeros((SIZE, SIZE), np.uint8)
    white[:, :SIZE // 2] = 255
    rgba = np.dstack([np.full((SIZE, SIZE, 3), 90, np.uint8), 255 - white])
    files = {"image": _encode(image), "mask": _encode(white), "openai_mask": _encode(rgba),
             "small_mask": _encode(white[:16, :16])}
    for name, data in files.items():
        (d / f"{name}.png").write_bytes(data)
    return types.SimpleNamespace(dir=d, image=image, mask=white, **{
        f"{k}_png": d / f"{k}.png" for k in files})


def _edit(url, timeout=120, **body):
    return requests.post(f"{url}/v1/edit", json={"prompt": "a red circle", **body},
                         timeout=timeout)


def _b64file(path) -> str:
    return base64.b64encode(Path(path).read_bytes()).decode()


def test_openai_client_edits(main_app, edit_files):
    """``client.images.edit`` with a mask (inpainting) and without (image-to-image)."""
    import openai

    client = openai.OpenAI(base_url=f"{main_app.url}/v1", api_key="unused", max_retries=0)
    with open(edit_files.image_png, "rb") as image, open(edit_files.openai_mask_png, "rb") as mask:
        out = client.images.edit(image=image, mask=mask, prompt="a blue square",
                                 size=f"{SIZE}x{SIZE}", model="tiny-sdxl", user="test",
                                 input_fidelity="high", quality="high")
    assert len(out.data) == 1 and out.size == f"{SIZE}x{SIZE}"
    inpainted = _png(out.data[0].b64_json)
    assert inpainted.shape == (SIZE, SIZE, 3)
    with open(edit_files.image_png, "rb") as image:  # no size: the image's
        out = client.images.edit(image=[image], prompt="a blue square")
    assert _png(out.data[0].b64_json).shape == (SIZE, SIZE, 3) and out.size == f"{SIZE}x{SIZE}"
    with open(edit_files.image_png, "rb") as image:
        with pytest.raises(openai.UnprocessableEntityError, match="b64_json"):
            client.images.edit(image=image, prompt="x", response_format="url")
    shapes = {b["shape"] for rep in requests.get(f"{main_app.url}/v1/stats").json()[
        "replicas"].values() for b in rep["batches"]}
    assert {f"inpaint:{SIZE}x{SIZE}:{STEPS}:nocfg:s0.9999",
            f"img2img:{SIZE}x{SIZE}:{STEPS}:nocfg:s0.75"} <= shapes, shapes


def test_native_edit_equals_python_api(main_app, pipe, edit_files):
    """/v1/edit with a seed: the Python API's ImageToImagePipeline / InpaintPipeline pixels
    (within one level), and the mask's two conventions give the same image."""
    from pipelines import ImageToImagePipeline, InpaintPipeline

    image = Image.fromarray(edit_files.image)
    kw = dict(seed=21, num_inference_steps=STEPS, guidance_scale=0.0)
    r = _edit(main_app.url, prompt="a photo of a cat", image=_b64file(edit_files.image_png),
              seed=21, steps=STEPS, guidance_scale=0.0, strength=0.75)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["mode"], body["strength"], body["seeds"]) == ("img2img", 0.75, [21])
    assert (body["width"], body["height"]) == (SIZE, SIZE) and "generate_s" in body["timings"]
    ours = ImageToImagePipeline.from_pipe(pipe)("a photo of a cat", image=image, strength=0.75,
                                                **kw).images[0]
    got = _png(body["images"][0]["b64_json"]).astype(int)
    assert np.abs(got - np.asarray(ours, int)).max() <= 1
    assert np.abs(got - edit_files.image.astype(int)).max() > 0

    inpainted = []
    for mask in (edit_files.mask_png, edit_files.openai_mask_png):
        r = _edit(main_app.url, prompt="a photo of a cat", image=_b64file(edit_files.image_png),
                  mask=_b64file(mask), seed=21, steps=STEPS, guidance_scale=0.0)
        assert r.status_code == 200, r.text
        assert (r.json()["mode"], r.json()["strength"]) == ("inpaint", 0.9999)
        inpainted.append(_png(r.json()["images"][0]["b64_json"]).astype(int))
    np.testing.assert_array_equal(inpainted[0], inpainted[1])
    ours = InpaintPipeline.from_pipe(pipe)("a photo of a cat", image=image,
                                           mask_image=Image.fromarray(edit_files.mask),
                                           strength=0.9999, **kw).images[0]
    assert np.abs(inpainted[0] - np.asarray(ours, int)).max() <= 1


EDIT_ERRORS = [
    (dict(mask="small_mask"), "mask", "mask is 16x16 but image is 32x32"),
    (dict(image=base64.b64encode(b"not an image").decode()), "image", "could not be decoded"),
    (dict(image="%%%"), "image", "not valid base64"),
    (dict(image=None), "image", "required"),
    (dict(strength=1.5), "strength", "must be a number in (0, 1]"),
    (dict(strength=0.25), "strength", "leaves no denoising step"),
    (dict(width=128, height=128), "width", "between 16 and 64"),
    (dict(num_images=5), "num_images", "at most 4"),
    (dict(width=64, height=64, num_images=4), "num_images", "max_cost"),
    (dict(seed=-1), "seed", "seeds are integers in 0..4294967295"),
]


@pytest.mark.parametrize("change,field,message", EDIT_ERRORS,
                         ids=[f"{f}-{i}" for i, (_, f, _) in enumerate(EDIT_ERRORS)])
def test_invalid_edits_are_422_naming_the_field(main_app, edit_files, change, field, message):
    body = {"image": _b64file(edit_files.image_png), "steps": STEPS}
    for k, v in change.items():
        if v is None:
            body.pop(k)
        elif k in ("image", "mask") and v in ("small_mask", "mask"):
            body[k] = _b64file(getattr(edit_files, f"{v}_png"))
        else:
            body[k] = v
    r = _edit(main_app.url, timeout=30, **body)
    assert r.status_code == 422, r.text
    err = r.json()
    assert err["error"]["param"] == field or any(field in d["loc"] for d in err["detail"]), err
    assert message in err["error"]["message"], err


def test_invalid_openai_edits_are_422(main_app, edit_files):
    url = f"{main_app.url}/v1/images/edits"
    image = ("image.png", edit_files.image_png.read_bytes(), "image/png")
    cases = [
        ({"image": image, "mask": ("m.png", edit_files.small_mask_png.read_bytes())}, {},
         "mask", "mask is 16x16 but image is 32x32"),
        ({"image": ("x.png", b"GIF89a not really")}, {}, "image", "could not be decoded"),
        ({}, {"prompt": "x"}, "image", "required"),
        ({"image": image}, {}, "prompt", "Field required"),
        ({"image": image}, {"size": "4096x4096"}, "size", "out of range"),
        ({"image": image}, {"n": "9"}, "n", "at most 4"),
        ({"image": image}, {"n": "two"}, "n", "integer"),
    ]
    for files, data, field, message in cases:
        data = {"prompt": "x", **data} if field != "prompt" else data
        r = requests.post(url, files=files or {"unused": ("", b"")}, data=data, timeout=30)
        assert r.status_code == 422, (field, r.text)
        err = r.json()
        assert any(field in d["loc"] for d in err["detail"]), err
        assert message in err["error"]["message"], err


def test_http_names_the_field_and_the_range_like_every_front_door(main_app, edit_files):
    """tests/test_limits.py's table of bad values, which the Python API, the CLI and JSONL lines
    refuse there: each is a 422 naming the field in the dialect's words and stating the same
    range, through /v1/generate (/v1/edit for strength) and, for the settings OpenAI's API has
    (n, size), through /v1/images/generations and /v1/images/edits."""
    import re

    from pipelines.limits import FIELDS
    from test_limits import BAD_VALUES

    def refused(r, field, says):
        assert r.status_code == 422, (field, r.text)
        err = r.json()
        assert any(field in d["loc"] for d in err["detail"]), err
        assert re.search(says, err["error"]["message"]), (field, err)

    image = _b64file(edit_files.image_png)
    for field, value, says in BAD_VALUES:
        name = FIELDS[field]["native"]
        if field == "strength":
            r = _edit(main_app.url, image=image, steps=STEPS, strength=value)
        else:
            r = requests.post(f"{main_app.url}/v1/generate", json={"prompt": "x", name: value},
                              timeout=30)
        refused(r, name, says)
        if field in ("n", "width"):
            name = FIELDS[field]["openai"]
            text = str(value) if field == "n" else f"{value}x{SIZE}"
            r = requests.post(f"{main_app.url}/v1/images/generations",
                              json={"prompt": "x", name: value if field == "n" else text},
                              timeout=30)
            refused(r, name, says)
            r = requests.post(f"{main_app.url}/v1/images/edits", data={"prompt": "x", name: text},
                              files={"image": ("i.png", edit_files.image_png.read_bytes())},
                              timeout=30)
            refused(r, name, says)


def test_an_omitted_strength_is_the_same_in_every_front_door(main_app, pipe, edit_files):
    """No strength given: /v1/edit answers with limits.STRENGTH and the pixels of the Python
    API's ImageToImagePipeline called without one; OpenAI's images.edit (which has no strength
    field) batches at the same strength; the CLI plans its edit lines with it."""
    from pipelines import ImageToImagePipeline
    from pipelines.batch import PromptLine, edit_strength
    from pipelines.limits import STRENGTH

    r = _edit(main_app.url, prompt="a photo of a cat", image=_b64file(edit_files.image_png),
              seed=22, steps=STEPS, guidance_scale=0.0)
    assert r.status_code == 200, r.text
    assert r.json()["strength"] == STRENGTH["img2img"]
    ours = ImageToImagePipeline.from_pipe(pipe)(
        "a photo of a cat", image=Image.fromarray(edit_files.image), seed=22,
        num_inference_steps=STEPS, guidance_scale=0.0).images[0]
    got = _png(r.json()["images"][0]["b64_json"]).astype(int)
    assert np.abs(got - np.asarray(ours, int)).max() <= 1
    r = requests.post(f"{main_app.url}/v1/images/edits", data={"prompt": "x"},
                      files={"image": ("i.png", edit_files.image_png.read_bytes())}, timeout=120)
    assert r.status_code == 200, r.text
    (rep,) = requests.get(f"{main_app.url}/v1/stats").json()["replicas"].values()
    newest = rep["batches"][-1]["shape"]  # this request's batch (newest last)
    assert newest == f"img2img:{SIZE}x{SIZE}:{STEPS}:nocfg:s{STRENGTH['img2img']:g}", newest
    assert edit_strength(PromptLine(0, "x", "x", image="photo.png")) == STRENGTH["img2img"]


def test_edit_bodies_have_their_own_limit(main_app, edit_files):
    """An image far over max_body_bytes (64 KiB) passes the gate of the edit routes (then its
    size is refused: 422); over max_image_bytes (1 MiB here) it is a 413."""
    rng = np.random.default_rng(1)
    big = _encode(rng.integers(0, 256, (200, 200, 3), dtype=np.uint8))
    assert len(big) > 65536
    r = _edit(main_app.url, timeout=30, image=base64.b64encode(big).decode())
    assert r.status_code == 422 and "between 16 and 64" in r.text, r.text
    r = _edit(main_app.url, timeout=30, image="A" * (2**20 + 10))
    assert r.status_code == 413 and "max_image_bytes" in r.text, r.text
    r = requests.post(f"{main_app.url}/v1/generate", json={"prompt": "x" * 70_000})
    assert r.status_code == 413 and "max_body_bytes" in r.text


# ---------------------------------------------------------------------------------- hosts
@pytest.mark.slow  # default-suite time (20 s): make test-slow runs it
def test_one_replica_per_host_both_serving(cluster, sdxl_dir, main_app):
    """Two replicas that each need the hosts' `maxdiff_host` resource land on the two hosts."""
    from serving.app import build_app

    args = dict(MAIN_ARGS, resource="maxdiff_host", resource_amount=1, num_replicas=2,
                max_replicas_per_node=1, num_cpus=0, max_batch_size=1,
                batch_wait_timeout_s=0.0, max_queued_requests=-1)
    serve.run(build_app({"model": str(sdxl_dir), **args}), name="hosts", route_prefix="/hosts")
    try:
        url = f"{cluster.url}/hosts"
        assert requests.get(f"{url}/healthz").status_code == 200
        for _ in range(10):
            rs = _concurrently(8, lambda i: _generate(url, seed=i))
            assert [r.status_code for r in rs] == [200] * 8
            replicas = requests.get(f"{url}/v1/stats").json()["replicas"]
            if len(replicas) == 2:
                break
        nodes = [r["node_id"] for r in replicas.values()]
        assert len(replicas) == 2 and len(set(nodes)) == 2, replicas
        assert set(nodes) == cluster.host_node_ids
        assert all(r["images"] > 0 for r in replicas.values())
    finally:
        serve.delete("hosts")


# ---------------------------------------------------------------------------------- hardening
KEY_A, KEY_B = "test-key-alpha-0123", "test-key-bravo-4567"
ORIGIN = "http://playground.test"
GUARDED_ARGS = dict(MAIN_ARGS, max_steps=5000, min_size=SIZE, max_size=SIZE, max_n=1,
                    max_cost=0.002, rate_limit_per_minute=400, cors_origins=[ORIGIN],
                    num_cpus=0, max_queued_requests=-1, model_name="guarded", max_body_bytes=4096)


@pytest.fixture(scope="module")
def guarded(cluster, sdxl_dir, tmp_path_factory):
    """API keys from a file (one plain, one hashed), a rate limit, CORS for one origin, limits
    that leave few shapes (32x32, at most 2 steps, one image) so fuzzing stays cheap."""
    from serving.app import build_app
    from serving.security import hash_key

    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# maxdiff API keys\n{KEY_A}\n\nsha256:{hash_key(KEY_B)}\n")
    serve.run(build_app({"model": str(sdxl_dir), **GUARDED_ARGS, "api_keys": str(keys)}),
              name="guarded", route_prefix="/guarded")
    yield f"{cluster.url}/guarded"
    serve.delete("guarded")


def _auth(key):
    return {"Authorization": f"Bearer {key}"}


def test_api_keys(guarded):
    r = requests.post(f"{guarded}/v1/generate", json={"prompt": "x", "seed": 1}, timeout=60)
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
    assert err["request_id"] == r.headers["X-Request-Id"]
    r = requests.post(f"{guarded}/v1/generate", json={"prompt": "x"}, headers=_auth("wrong-key-000"))
    assert r.status_code == 401 and r.json()["error"]["message"] == "incorrect API key"
    assert requests.get(f"{guarded}/v1/models", headers={"Authorization": KEY_A}).status_code == 401
    for key in (KEY_A, KEY_B):  # the plain and the hashed entry
        r = requests.post(f"{guarded}/v1/generate", json={"prompt": "x", "seed": 1},
                          headers=_auth(key), timeout=120)
        assert r.status_code == 200, r.text
    assert requests.get(f"{guarded}/healthz").status_code == 200  # open, for load balancers
    assert requests.get(f"{guarded}/openapi.json").status_code == 200
    r = requests.get(f"{guarded}/v1/stats", headers={"X-Request-Id": "trace-me-42"})
    assert r.status_code == 401 and r.headers["X-Request-Id"] == "trace-me-42"


def test_api_keys_through_the_openai_client(guarded):
    import openai

    client = openai.OpenAI(base_url=f"{guarded}/v1", api_key=KEY_A, max_retries=0)
    assert len(client.images.generate(prompt="a red circle", size="32x32").data) == 1
    bad = openai.OpenAI(base_url=f"{guarded}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        bad.images.generate(prompt="a red circle")


def test_rate_limit_per_key(guarded):
    """KEY_B's bucket (400 a minute) runs out; KEY_A's is its own; 429 says when to retry."""
    session = requests.Session()
    limit, codes = GUARDED_ARGS["rate_limit_per_minute"], []
    t0 = time.monotonic()
    while 429 not in codes and len(codes) < 3 * limit:
        r = session.get(f"{guarded}/v1/models", headers=_auth(KEY_B))
        codes.append(r.status_code)
    refilled = (time.monotonic() - t0) * limit / 60
    assert codes[-1] == 429 and set(codes[:-1]) == {200}, codes
    assert limit <= len(codes) - 1 <= limit + refilled + 1, (len(codes), refilled)
    # the 429 itself (a request after it may already find a token: one refills every 0.15 s)
    assert int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert session.get(f"{guarded}/v1/models", headers=_auth(KEY_A)).status_code == 200


def test_cors_only_for_configured_origins(guarded, main_app):
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = requests.options(f"{guarded}/v1/generate", headers=pre)
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
    r = requests.options(f"{guarded}/v1/generate", headers={**pre, "Origin": "http://evil.test"})
    assert "Access-Control-Allow-Origin" not in r.headers
    r = requests.get(f"{main_app.url}/v1/models", headers={"Origin": ORIGIN})
    assert "Access-Control-Allow-Origin" not in r.headers  # off by default


def test_limits_that_know_the_model(guarded, pipe):
    """max_steps=5000 is allowed by the serve args, but the scheduler allows 1000: 422 naming
    steps and the range; the cost budget names the field to lower."""
    r = requests.post(f"{guarded}/v1/generate", json={"prompt": "x", "steps": 1001},
                      headers=_auth(KEY_A))
    assert r.status_code == 422, r.text
    assert "must be an integer in 1..1000 (what this model's EulerDiscreteScheduler allows)" in \
        r.json()["error"]["message"] and r.json()["error"]["param"] == "steps"
    r = requests.post(f"{guarded}/v1/generate", json={"prompt": "x", "steps": 3},
                      headers=_auth(KEY_A))
    assert r.status_code == 422 and "at most 2 step(s) for one image" in r.text
    r = requests.post(f"{guarded}/v1/generate", json={"prompt": "x" * 5000}, headers=_auth(KEY_A))
    assert r.status_code == 413 and "larger than 4096 bytes" in r.text  # the serve arg applies
    with pytest.raises(ValueError, match=r"num_inference_steps=1001: must be an integer in "
                                         r"1\.\.1000 \(what EulerDiscreteScheduler allows\)"):
        pipe("x", num_inference_steps=1001, height=SIZE, width=SIZE)


def test_fuzz_against_the_openapi_schema(guarded):
    """schemathesis: generated requests for every operation (valid and invalid bodies): no 5xx,
    every status code documented, every response matching its schema."""
    import schemathesis
    from hypothesis import HealthCheck, settings as hsettings
    from schemathesis import GenerationMode
    from schemathesis.checks import (content_type_conformance, not_a_server_error,
                                     response_schema_conformance, status_code_conformance)

    schema = schemathesis.openapi.from_url(f"{guarded}/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]
    seen = collections.Counter()
    session = requests.Session()
    for result in schema.get_all_operations():
        op = result.ok()
        modes = [GenerationMode.POSITIVE]
        if op.method.upper() == "POST":  # a GET without parameters has nothing to get wrong
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            @hsettings(max_examples=12, deadline=None, database=None,
                       suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(mode))
            def fuzz(case):
                response = case.call(base_url=guarded, session=session, headers=_auth(KEY_A),
                                     timeout=120)
                seen[(op.label, response.status_code)] += 1
                case.validate_response(response, checks=checks)

            fuzz()
    assert not [k for k in seen if k[1] >= 500], seen
    assert any(code == 200 for (label, code) in seen if "generate" in label), seen
    assert any(code == 422 for (label, code) in seen if "generate" in label), seen


# ---------------------------------------------------------------------------------- playground
ARTIFACTS = Path(os.environ.get("MAXDIFF_TEST_ARTIFACTS", Path(__file__).parent.parent / "out"
                                / "test-artifacts"))


def _data_url_pixels(src: str) -> np.ndarray:
    assert src.startswith("data:image/png;base64,"), src[:40]
    return _png(src.split(",", 1)[1])


def test_playground_in_a_real_browser(main_app, browser):
    """Type a prompt, generate (Ctrl+Enter), an image of the requested size appears; "reuse
    seed" gives the same image; an invalid size shows the server's message next to the size
    field; a phone-sized screen needs no sideways scrolling; a screenshot is kept."""
    # bypass_csp: the page's own policy forbids eval, which wait_for_function uses
    page = browser.new_page(viewport={"width": 1100, "height": 760}, bypass_csp=True)
    problems = []
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("console", lambda m: m.type == "error" and "Failed to load resource" not in m.text
            and problems.append(f"console: {m.text}"))  # (the 422 asked for below is logged)
    page.on("request", lambda r: r.url.startswith(main_app.url) or r.url.startswith("data:")
            or problems.append(f"request to another host: {r.url}"))
    r = page.goto(f"{main_app.url}/")
    assert r.status == 200 and "text/html" in r.headers["content-type"]
    assert "default-src 'none'" in r.headers["content-security-policy"]
    page.wait_for_function("document.getElementById('scheduler').textContent.endsWith('Scheduler')")
    assert page.text_content("#model-name") == "tiny-sdxl"
    # the model's defaults are preselected and its limits bound the inputs
    assert page.input_value("#steps") == str(STEPS)
    assert page.get_attribute("#width", "max") == str(MAIN_ARGS["max_size"])
    page.fill("#prompt", "a red circle")
    page.fill("#width", str(SIZE))
    page.fill("#height", str(SIZE))
    page.fill("#guidance_scale", "0")
    page.press("#prompt", "Control+Enter")
    page.wait_for_selector("figure.card img", timeout=120_000)
    size = page.eval_on_selector("figure.card img", "i => [i.naturalWidth, i.naturalHeight]")
    assert size == [SIZE, SIZE]
    first = page.get_attribute("figure.card img", "src")
    seed = page.get_attribute("figure.card", "data-seed")
    assert seed.isdigit() and page.text_content("figure.card .seed") == f"seed {seed}"
    # the download is the PNG with its settings inside
    download_href = page.get_attribute("figure.card a.download", "href")
    info = Image.open(io.BytesIO(base64.b64decode(download_href.split(",", 1)[1]))).text
    assert info["seed"] == seed and info["prompt"] == "a red circle"

    # another image with another seed, then "reuse seed" on the first one: the same image
    page.fill("#prompt", "a blue square")
    page.click("#dice")
    assert page.input_value("#seed").isdigit()
    page.click("#generate")
    page.wait_for_function("document.querySelectorAll('figure.card').length === 2",
                           timeout=120_000)
    page.click(f"figure.card[data-seed='{seed}'] button.reuse")
    assert page.input_value("#seed") == seed and page.input_value("#prompt") == "a red circle"
    page.keyboard.press("Control+Enter")
    page.wait_for_function("document.querySelectorAll('figure.card').length === 3",
                           timeout=120_000)
    assert page.get_attribute("figure.card", "data-seed") == seed
    again = page.get_attribute("figure.card img", "src")
    assert np.abs(_data_url_pixels(again).astype(int)
                  - _data_url_pixels(first).astype(int)).max() <= 1
    assert page.get_attribute("figure.card:nth-child(2) img", "src") != first

    # click to enlarge, Escape closes
    page.click("figure.card button.thumb")
    assert page.is_visible("#viewer-img")
    page.keyboard.press("Escape")
    assert not page.is_visible("#viewer-img")

    # an invalid size: the service's 422 message appears next to the size field
    page.fill("#width", "1000")
    page.click("#generate")
    page.wait_for_selector("#err-size:not(:empty)")
    message = page.text_content("#err-size")
    assert "1000 pixels is out of range" in message and str(MAIN_ARGS["max_size"]) in message
    assert page.get_attribute("#width", "aria-invalid") == "true"
    assert page.get_attribute("#height", "aria-invalid") is None  # only the side that is wrong
    assert page.evaluate("document.getElementById('width').closest('.field')"
                         ".contains(document.getElementById('err-size'))")
    assert page.text_content("#err-general") == ""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "playground.png"))

    page.set_viewport_size({"width": 390, "height": 844})  # a phone
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    page.screenshot(path=str(ARTIFACTS / "playground-phone.png"), full_page=True)
    assert not problems, problems
    page.close()


def test_playground_asks_for_the_api_key(guarded, browser):
    """With keys on, the page shows the key field, keeps the key in session storage only and
    then loads the model; under a route prefix it calls the prefixed endpoints."""
    page = browser.new_page(bypass_csp=True)
    page.goto(guarded)  # route prefix /guarded, no trailing slash
    page.wait_for_selector("#api_key", state="visible")
    assert page.text_content("#model-name") == "(API key needed)"
    page.fill("#api_key", "wrong-key-000")
    page.press("#api_key", "Tab")
    page.wait_for_selector("#err-api_key:not(:empty)")
    assert "incorrect API key" in page.text_content("#err-api_key")
    page.fill("#api_key", KEY_A)
    page.press("#api_key", "Tab")
    page.wait_for_function("document.getElementById('model-name').textContent === 'guarded'")
    assert page.evaluate("sessionStorage.getItem('maxdiff.api_key')") == KEY_A
    assert page.evaluate("localStorage.length") == 0 and "test-key" not in page.evaluate(
        "document.cookie")
    page.close()


def _burst(url, n, body, timeout=120):
    def send(i):
        try:
            return requests.post(f"{url}/v1/generate", json={**body, "seed": i}, timeout=timeout)
        except requests.RequestException as e:  # a reset or a hang is a failure, kept as such
            return e
    return _concurrently(n, send)


@pytest.mark.slow  # default-suite time: make test-slow runs it
def test_burst_of_200_at_one_replica_with_a_queue_of_16(cluster, sdxl_dir):
    """Every request answered: 200 or 503 with Retry-After and the error body; no 500, no reset
    connection, no hang; the count adds up."""
    from serving.app import build_app

    args = dict(MAIN_ARGS, max_queued_requests=16, num_cpus=0, max_batch_size=4)
    serve.run(build_app({"model": str(sdxl_dir), **args}), name="burst", route_prefix="/burst")
    try:
        url = f"{cluster.url}/burst"
        t0 = time.monotonic()
        rs = _burst(url, 200, {"prompt": "a red circle"})
        took = time.monotonic() - t0
        failed = [r for r in rs if not isinstance(r, requests.Response)]
        assert not failed, failed[:3]
        codes = collections.Counter(r.status_code for r in rs)
        assert set(codes) <= {200, 503} and sum(codes.values()) == 200, codes
        assert codes[200] >= 16 and codes[503] > 0, codes
        for r in rs:
            if r.status_code == 503:
                assert int(r.headers["Retry-After"]) >= 1
                assert r.json()["error"]["request_id"] == r.headers["X-Request-Id"]
        assert took < 100, took
        assert _generate(url, seed=1).status_code == 200
    finally:
        serve.delete("burst")


def _generator_replicas(app):
    status = serve.status().applications[app].deployments["Generator"]
    return {getattr(k, "value", str(k)): v for k, v in status.replica_states.items()}


@pytest.mark.slow  # default-suite time: make test-slow runs it
def test_a_replica_killed_mid_load(cluster, sdxl_dir):
    """Two replicas; one is killed (SIGKILL to its process) while requests are in flight: every
    request is answered 200 or 503 (those on the dead replica retried once on the other), Ray
    Serve brings the replica back, and then every request succeeds."""
    import os
    import signal

    from serving.app import build_app

    args = dict(MAIN_ARGS, num_replicas=2, num_cpus=0, max_queued_requests=-1,
                max_batch_size=2, health_check_period_s=1, health_check_timeout_s=10)
    serve.run(build_app({"model": str(sdxl_dir), **args}), name="pair", route_prefix="/pair")
    try:
        url = f"{cluster.url}/pair"
        deadline = time.monotonic() + 60
        while True:
            replicas = requests.get(f"{url}/v1/stats").json()["replicas"]
            if len(replicas) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert len(replicas) == 2, replicas
        victim = next(iter(replicas.values()))["pid"]
        results = []
        sender = threading.Thread(target=lambda: results.extend(
            _burst(url, 40, {"prompt": "a red circle", "num_images": 2})))
        sender.start()
        time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        sender.join(timeout=300)
        assert not sender.is_alive()
        failed = [r for r in results if not isinstance(r, requests.Response)]
        assert not failed, failed[:3]
        codes = collections.Counter(r.status_code for r in results)
        assert set(codes) <= {200, 503} and sum(codes.values()) == 40, (
            codes, [r.text for r in results if r.status_code not in (200, 503)][:3])
        deadline = time.monotonic() + 180
        while _generator_replicas("pair").get("RUNNING", 0) < 2:
            assert time.monotonic() < deadline, _generator_replicas("pair")
            time.sleep(1)
        rs = _burst(url, 8, {"prompt": "a red circle"})
        assert [getattr(r, "status_code", r) for r in rs] == [200] * 8
        # the replacement reports too (the dead replica stays listed until silent for 10 min)
        pids = {r["pid"] for r in requests.get(f"{url}/v1/stats").json()["replicas"].values()}
        assert victim in pids and len(pids) >= 3, pids
    finally:
        serve.delete("pair")


# ---------------------------------------------------------------------------------- adapters
@pytest.mark.slow  # default-suite time: make test-slow runs it
def test_adapters_share_a_batch_and_equal_the_fused_python_api(cluster, sdxl_dir,
                                                               tmp_path_factory):
    """Two LoRA adapters (serve arg adapters, preloaded unfused) and the base model, requested
    concurrently with CFG: one batch, one compiled program, and each image equals the Python
    API's with that adapter fused (load_lora_weights)."""
    from pipelines import TextToImagePipeline
    from serving.app import build_app
    from test_adapters import make_lora_files

    files = make_lora_files(sdxl_dir, tmp_path_factory.mktemp("served-loras"))
    args = dict(MAIN_ARGS, max_batch_size=3, batch_wait_timeout_s=5.0, num_cpus=0,
                warmup_shapes=[f"{SIZE}x{SIZE}:{STEPS}:cfg"], warmup_batch_sizes=[3],
                max_queued_requests=-1, adapters=f"a={files['a']}:0.7,b={files['b']}")
    serve.run(build_app({"model": str(sdxl_dir), **args}), name="adapters",
              route_prefix="/adapters")
    try:
        url = f"{cluster.url}/adapters"
        models = requests.get(f"{url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["tiny-sdxl", "tiny-sdxl:a", "tiny-sdxl:b"]
        assert [(a["name"], a["scale"]) for a in models[0]["maxdiff"]["adapters"]] == [
            ("a", 0.7), ("b", 1.0)]
        asks = [(None, "a red circle", 7), ("a", "a blue square", 8), ("b", "the cat!", 9)]
        body = dict(steps=STEPS, guidance_scale=5.0, width=SIZE, height=SIZE)
        rs = _concurrently(3, lambda i: _generate(url, prompt=asks[i][1], seed=asks[i][2],
                                                  lora=asks[i][0], **body))
        assert [r.status_code for r in rs] == [200] * 3, [r.text for r in rs]
        timings = [r.json()["timings"] for r in rs]
        assert [t["batch_requests"] for t in timings] == [3] * 3, timings
        assert len({t["batch_id"] for t in timings}) == 1, timings
        stats = next(iter(requests.get(f"{url}/v1/stats").json()["replicas"].values()))
        batch = next(b for b in stats["batches"] if b["id"] == timings[0]["batch_id"])
        assert batch["adapters"] == {"": 1, "a": 1, "b": 1} and batch["device_batches"] == [4]
        assert stats["compiled_programs"] == 1  # the warm-up's, adapters included
        assert [r.json()["lora"] for r in rs] == [None, "a", "b"]

        pipe = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=cluster.cache)
        errs = []
        for r, (adapter, prompt, seed) in zip(rs, asks):
            raw = base64.b64decode(r.json()["images"][0]["b64_json"])
            info = Image.open(io.BytesIO(raw)).text
            assert info.get("adapter") == adapter, info
            if adapter is not None:
                pipe.load_lora_weights(files[adapter], scale=0.7 if adapter == "a" else 1.0)
            try:
                want = pipe(prompt, seed=seed, num_inference_steps=STEPS, guidance_scale=5.0,
                            height=SIZE, width=SIZE, output_type="np").images[0]
            finally:
                pipe.unload_lora_weights()
            errs.append(float(np.abs(_png(raw) / 255.0 - want).max()))
        print(f"served (unfused, one batch) vs fused Python API, max |diff| on [0,1]: {errs}")
        assert max(errs) <= 2e-3, errs
        base = _png(rs[0].json()["images"][0]["b64_json"])
        alone = _generate(url, prompt=asks[0][1], seed=7, lora="a", **body)  # a changes it
        assert np.abs(_png(alone.json()["images"][0]["b64_json"]).astype(int) - base).max() > 10

        # unknown adapters: 422 naming the field and listing the loaded ones
        r = _generate(url, lora="c", **body)
        assert r.status_code == 422 and r.json()["error"]["param"] == "lora", r.text
        assert "unknown adapter 'c'; loaded adapters: a, b" in r.text
        oa = lambda **kw: requests.post(f"{url}/v1/images/generations", timeout=120,
                                        json={"prompt": "x", "size": f"{SIZE}x{SIZE}", **kw})
        r = oa(model="tiny-sdxl:c")
        assert r.status_code == 422 and r.json()["error"]["param"] == "model", r.text
        assert "loaded adapters: a, b" in r.text
        r = oa(model="tiny-sdxl:a", lora="b")
        assert r.status_code == 422 and r.json()["error"]["param"] == "lora", r.text
        for kw in ({"model": "tiny-sdxl:b"}, {"lora": "b"}, {"model": "dall-e-3"}):
            r = oa(**kw)
            assert r.status_code == 200 and len(r.json()["data"]) == 1, (kw, r.text)
    finally:
        serve.delete("adapters")
