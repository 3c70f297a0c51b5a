"""Generation over HTTP: health during warm-up, the native and OpenAI routes (with ``requests``
and the ``openai`` client), seeds, batching, metrics, streaming on engine=batch, two-host
placement and LoRA adapters."""

from __future__ import annotations

import base64
import io
import json
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from PIL import Image

from .helpers import (
    MAIN_ARGS,
    SIZE,
    STEPS,
    concurrently,
    generate,
    generate_as_a_client,
    png,
    sse_events,
)

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")


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
    r = generate(main_app.url, seed=7, num_images=2, steps=STEPS, guidance_scale=0.0,
                  width=SIZE, height=SIZE, scheduler="EulerDiscreteScheduler")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["seeds"] == [7, 8] and [im["seed"] for im in body["images"]] == [7, 8]
    assert (body["width"], body["height"], body["steps"]) == (SIZE, SIZE, STEPS)
    assert body["model"] == "tiny-sdxl" and body["scheduler"] == "EulerDiscreteScheduler"
    pixels = [png(im["b64_json"]) for im in body["images"]]
    assert all(p.shape == (SIZE, SIZE, 3) for p in pixels)
    assert not np.array_equal(pixels[0], pixels[1])
    assert {"queue_s", "generate_s", "encode_s", "total_s"} <= set(body["timings"])
    assert r.headers["X-Maxdiff-Replica"] and r.headers["X-Maxdiff-Node"]


def test_native_accept_png_returns_the_image(main_app):
    json_r = generate(main_app.url, seed=11)
    r = generate(main_app.url, seed=11, headers={"Accept": "image/png"})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert r.headers["X-Seed"] == "11"
    np.testing.assert_array_equal(png(r.content), png(json_r.json()["images"][0]["b64_json"]))
    for fmt, accept in (("jpeg", None), ("webp", "image/webp")):
        body = {"seed": 11} if accept else {"seed": 11, "output_format": fmt}
        r = generate(main_app.url, headers={"Accept": accept} if accept else None, **body)
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
    assert all(png(d.b64_json).shape == (SIZE, SIZE, 3) for d in out.data)
    assert out.data[0].revised_prompt is None
    assert [m.id for m in client.models.list()] == ["tiny-sdxl"]
    # a link instead of the image: the same file the image entry would have carried
    linked = client.images.generate(prompt="a cat", response_format="url")
    assert linked.data[0].b64_json is None and linked.data[0].url.startswith(main_app.url)
    assert png(requests.get(linked.data[0].url, timeout=30).content).shape == (SIZE, SIZE, 3)
    # size "auto" (and no size) is the model's default, through the client too
    for size in ("auto", openai.NOT_GIVEN):
        out = client.images.generate(prompt="a red circle", size=size)
        assert png(out.data[0].b64_json).shape == (SIZE, SIZE, 3)
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
    read as JSON anyway (text/plain, an odd ``+json`` type and no Content-Type too), and a JSON
    type with parameters or of the ``application/...+json`` family is JSON (one rule, the gate's
    and the route's: ``serving.gate.is_json_type``)."""
    body = json.dumps({"prompt": "a cat", "seed": 1234, "steps": 2, "guidance_scale": 0})
    for ctype in ("application/x-www-form-urlencoded", "text/plain", None, "text/x-thing+json",
                  "application/vnd.api+json", "Application/JSON; charset=utf-8"):
        headers = {"Accept": "image/png"} | ({"Content-Type": ctype} if ctype else {})
        r = requests.post(f"{main_app.url}/v1/generate", data=body.encode(), headers=headers,
                          timeout=120)
        assert r.status_code == 200, (ctype, r.text)
        assert r.headers["content-type"] == "image/png" and r.headers["X-Seed"] == "1234"
    r = requests.post(f"{main_app.url}/v1/generate", data="prompt=a+cat",
                      headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=30)
    assert r.status_code == 422  # a real form is still not a JSON object


def test_same_seed_same_image(main_app):
    a, b, c = (generate(main_app.url, seed=s, prompt="a green triangle") for s in (42, 42, 43))
    img = [png(r.json()["images"][0]["b64_json"]) for r in (a, b, c)]
    np.testing.assert_array_equal(img[0], img[1])
    assert not np.array_equal(img[0], img[2])


def test_http_image_equals_python_api(main_app, pipe):
    """Same program, same seed: the served PNG has exactly the Python API's pixels."""
    r = generate(main_app.url, prompt="a photo of a cat", negative_prompt="blurry", seed=1234,
                  steps=STEPS, guidance_scale=0.0, width=SIZE, height=SIZE)
    ours = pipe("a photo of a cat", negative_prompt="blurry", seed=1234,
                num_inference_steps=STEPS, guidance_scale=0.0, height=SIZE, width=SIZE).images[0]
    np.testing.assert_array_equal(png(r.json()["images"][0]["b64_json"]), np.asarray(ours))


def test_weighted_and_long_prompts_equal_the_python_api(main_app, pipe):
    """prompt_syntax per request: an A1111-weighted, a compel-weighted and a 100-token prompt
    sent together (two chunk counts: the batch splits) each get the Python API's pixels (up to
    one level, as batched images do); a prompt its syntax cannot read, and an unknown syntax,
    are 422s naming the field."""
    asks = [("a (red:1.4) cat", "a1111"), ("a red+ cat", "compel"), ("x " * 100, None)]
    rs = concurrently(3, lambda i: generate_as_a_client(
        main_app.url, prompt=asks[i][0], prompt_syntax=asks[i][1], seed=50 + i))
    assert [r.status_code for r in rs] == [200] * 3, [r.text for r in rs]
    for i, (r, (prompt, syntax)) in enumerate(zip(rs, asks)):
        single = pipe(prompt, prompt_syntax=syntax, seed=50 + i, num_inference_steps=STEPS,
                      guidance_scale=0.0, height=SIZE, width=SIZE).images[0]
        got = png(r.json()["images"][0]["b64_json"]).astype(int)
        assert np.abs(got - np.asarray(single, int)).max() <= 1, prompt
    r = generate(main_app.url, prompt="a (cat", negative_prompt="[dog")
    assert r.status_code == 422 and r.json()["error"]["param"] == "prompt", r.text
    assert "'(' is never closed" in r.text and "'[' is never closed" in r.text
    r = generate(main_app.url, prompt="a cat", prompt_syntax="markdown")
    assert r.status_code == 422 and r.json()["error"]["param"] == "prompt_syntax", r.text


def test_samplers_per_request_equal_the_python_api(main_app, pipe):
    """Three samplers sent together (one queue; separate device batches): each image is the
    Python API's with that sampler; the response names the sampler it ran."""
    asks = ["dpmpp_2m_karras", "Euler a", None]
    rs = concurrently(3, lambda i: generate_as_a_client(main_app.url, prompt="a small dog",
                                                         scheduler=asks[i], seed=70 + i))
    assert [r.status_code for r in rs] == [200] * 3, [r.text for r in rs]
    for i, (r, name) in enumerate(zip(rs, asks)):
        single = pipe("a small dog", scheduler=name, seed=70 + i, num_inference_steps=STEPS,
                      guidance_scale=0.0, height=SIZE, width=SIZE).images[0]
        got = png(r.json()["images"][0]["b64_json"]).astype(int)
        assert np.abs(got - np.asarray(single, int)).max() <= 1, name
    assert rs[0].json()["scheduler"] == "dpmpp_2m_karras"
    assert rs[2].json()["scheduler"] == "EulerDiscreteScheduler"
    # the OpenAI route takes it as an extra field (the openai client's extra_body)
    r = requests.post(f"{main_app.url}/v1/images/generations",
                      json={"prompt": "a small dog", "scheduler": "unipc"}, timeout=120)
    assert r.status_code == 200, r.text
    r = requests.post(f"{main_app.url}/v1/images/generations",
                      json={"prompt": "a small dog", "scheduler": "eulr"}, timeout=120)
    assert r.status_code == 422 and r.json()["error"]["param"] == "scheduler", r.text


def test_feature_caching_equals_the_python_api(main_app, pipe):
    """cfg_cutoff on /v1/generate (guidance 5: the first of 2 steps guided) and
    deepcache_interval on /v1/images/generations (an extra field: the official openai
    client's extra_body): each image is the Python API's with the same settings, and its file
    records them. A bad value is a 422 naming the field on every route that takes it."""
    r = generate(main_app.url, prompt="a small dog", seed=80, guidance_scale=5.0,
                 cfg_cutoff=0.5, steps=STEPS, width=SIZE, height=SIZE)
    assert r.status_code == 200, r.text
    raw = base64.b64decode(r.json()["images"][0]["b64_json"])
    assert Image.open(io.BytesIO(raw)).text["cfg_cutoff"] == "0.5"
    import openai

    client = openai.OpenAI(base_url=f"{main_app.url}/v1", api_key="unused", max_retries=0)
    r2 = client.images.generate(prompt="a small dog", extra_body={"deepcache_interval": 2})
    seed = r2.data[0].model_extra["seed"]
    for got, kw in [(png(raw), dict(seed=80, guidance_scale=5.0, cfg_cutoff=0.5)),
                    (png(r2.data[0].b64_json),
                     dict(seed=seed, guidance_scale=0.0, deepcache_interval=2))]:
        ours = pipe("a small dog", num_inference_steps=STEPS, height=SIZE, width=SIZE,
                    **kw).images[0]
        plain = pipe("a small dog", num_inference_steps=STEPS, height=SIZE, width=SIZE,
                     **{k: v for k, v in kw.items() if k in ("seed", "guidance_scale")}).images[0]
        assert np.abs(got.astype(int) - np.asarray(ours, int)).max() <= 1, kw
        assert np.abs(got.astype(int) - np.asarray(plain, int)).max() > 1, kw  # it acts
    bad = [("/v1/generate", {"prompt": "x", "cfg_cutoff": 0}, "cfg_cutoff", "(0, 1]"),
           ("/v1/generate", {"prompt": "x", "deepcache_interval": 101}, "deepcache_interval",
            "1..100"),
           ("/v1/images/generations", {"prompt": "x", "cfg_cutoff": 1.5}, "cfg_cutoff",
            "(0, 1]"),
           ("/v1/images/generations", {"prompt": "x", "deepcache_interval": 0},
            "deepcache_interval", "1..100"),
           ("/v1/edit", {"prompt": "x", "image": base64.b64encode(_tiny_png()).decode(),
                         "cfg_cutoff": -1}, "cfg_cutoff", "(0, 1]"),
           ("/v1/jobs", {"endpoint": "/v1/generate",
                         "body": {"prompt": "x", "deepcache_interval": 0}},
            "body.deepcache_interval", "1..100")]
    for route, body, field, words in bad:
        r = requests.post(f"{main_app.url}{route}", json=body, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 422 and err["param"] == field and words in err["message"], \
            (route, r.text)


def test_hires_fix_equals_the_python_api(main_app, pipe):
    """hires_scale / hires_strength / hires_steps on /v1/generate and (extra fields) on
    /v1/images/generations: the image is the Python API's with the same settings and its file
    records them; bad values, a strength without a scale and both passes over max_cost are
    422s naming the field."""
    hires = dict(hires_scale=2.0, hires_strength=0.5, hires_steps=4)
    r = generate(main_app.url, prompt="a small dog", seed=81, steps=STEPS, width=64, height=64,
                 **hires)
    assert r.status_code == 200, r.text
    raw = base64.b64decode(r.json()["images"][0]["b64_json"])
    text = Image.open(io.BytesIO(raw)).text
    assert (text["hires_scale"], text["hires_strength"], text["hires_steps"]) == ("2", "0.5", "4")
    ours = pipe("a small dog", seed=81, num_inference_steps=STEPS, height=64, width=64,
                guidance_scale=0.0, **hires).images[0]
    assert np.abs(png(raw).astype(int) - np.asarray(ours, int)).max() <= 1
    import openai

    client = openai.OpenAI(base_url=f"{main_app.url}/v1", api_key="unused", max_retries=0)
    r2 = client.images.generate(prompt="a small dog", size="64x64",
                                extra_body={"hires_scale": 2.0, "hires_strength": 0.5})
    seed = r2.data[0].model_extra["seed"]
    ours = pipe("a small dog", seed=seed, num_inference_steps=STEPS, height=64, width=64,
                guidance_scale=0.0, hires_scale=2.0, hires_strength=0.5).images[0]
    assert np.abs(png(r2.data[0].b64_json).astype(int) - np.asarray(ours, int)).max() <= 1
    bad = [({"hires_scale": 1.0}, "hires_scale", "(1, 4]"),
           ({"hires_strength": 0.5}, "hires_strength", "needs hires_scale"),
           ({"hires_scale": 2.0, "hires_strength": 0.2}, "hires_strength", "no denoising step"),
           ({"hires_scale": 4.0, "width": 32, "height": 32}, "hires_scale", "first pass at 8x8"),
           ({"hires_scale": 2.0, "hires_steps": 9}, "hires_steps", "1..8"),  # max_steps
           # each pass alone is within max_cost (0.02), the two together are not
           ({"hires_scale": 2.0, "steps": 4, "hires_steps": 8, "width": 64, "height": 64}, None,
            "max_cost")]
    for body, field, words in bad:
        r = requests.post(f"{main_app.url}/v1/generate", json={"prompt": "x", **body}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 422 and words in err["message"], (body, r.text)
        assert field is None or err["param"] == field, (body, r.text)


def _tiny_png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (SIZE, SIZE), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


def test_openai_images_carry_their_seed_and_redraw_through_generate(main_app):
    """An images.generate image's seed is in its entry, the X-Seeds header and its PNG's text
    chunks with the settings; /v1/generate with those settings returns its pixels."""
    r = requests.post(f"{main_app.url}/v1/images/generations",
                      json={"prompt": "a red circle", "n": 2}, timeout=120)
    assert r.status_code == 200, r.text
    seeds = [d["seed"] for d in r.json()["data"]]
    assert r.headers["X-Seeds"] == ",".join(map(str, seeds)) and len(set(seeds)) == 2
    raw = base64.b64decode(r.json()["data"][1]["b64_json"])
    chunks = Image.open(io.BytesIO(raw)).text
    assert int(chunks["seed"]) == seeds[1] and chunks["prompt"] == "a red circle"
    w, h = map(int, chunks["size"].split("x"))
    again = generate(main_app.url, prompt=chunks["prompt"], seed=seeds[1],
                     steps=int(chunks["steps"]), guidance_scale=float(chunks["guidance"]),
                     width=w, height=h)
    assert again.status_code == 200, again.text
    # up to one level: the two were made in batches of 2 and of 1 (see the next test)
    first = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"), int)
    assert np.abs(png(again.json()["images"][0]["b64_json"]).astype(int) - first).max() <= 1


def test_concurrent_requests_share_a_batch(main_app, pipe):
    seeds = [100, 101, 102, 103]
    rs = concurrently(4, lambda i: generate_as_a_client(main_app.url, prompt="a small dog",
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
        got = png(r.json()["images"][0]["b64_json"]).astype(int)
        assert np.abs(got - np.asarray(single, int)).max() <= 1


def test_a_new_shape_does_not_hold_up_compiled_ones(cluster, main_app):
    """A 16x16 request (its own batch queue; its program compiles for seconds) sent together
    with 32x32 ones: the 32x32 requests are served while it compiles. The program must really
    compile: the runs share a persistent compilation cache that outlives them, so the 16x16
    request takes a step count drawn per run, and the cache entries written during the test
    are removed afterwards (a cached program loads in milliseconds and races the others)."""
    import random

    steps = random.choice([k for k in range(1, MAIN_ARGS["max_steps"] + 1) if k != STEPS])
    cache = Path(cluster.cache)
    before = set(cache.rglob("*"))
    done = {}

    def send(i):
        r = generate_as_a_client(main_app.url, seed=i,
                                  **({"width": 16, "height": 16, "steps": steps} if i == 0 else {}))
        done[i] = time.monotonic()
        return r

    try:
        rs = concurrently(4, send)
    finally:
        for f in set(cache.rglob("*")) - before:
            if f.is_file():
                f.unlink(missing_ok=True)
    assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
    assert png(rs[0].json()["images"][0]["b64_json"]).shape == (16, 16, 3)
    assert max(done[i] for i in (1, 2, 3)) < done[0], (steps, done)
    shapes = {b["shape"] for rep in requests.get(f"{main_app.url}/v1/stats").json()[
        "replicas"].values() for b in rep["batches"]}
    assert {f"16x16:{steps}:nocfg", f"{SIZE}x{SIZE}:{STEPS}:nocfg"} <= shapes


def test_prometheus_metrics(cluster, main_app):
    """Ours (ray_maxdiff_*) next to Ray Serve's own, on the nodes' metrics export ports."""
    assert generate(main_app.url, seed=3).status_code == 200
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


def test_the_batch_engine_streams_too(main_app, pipe):
    """engine=batch (this app) streams like engine=step, so a client never needs to know the
    engine: /v1/generate sends the queued progress event, progress after each step, the
    partial image (the step's estimate of the clean image: the Python API's
    ``generate(on_step=..., denoised=True)`` estimate drawn by ``draw_preview``, within one
    level) and the result, whose image is the one the same request gets without streaming;
    the official openai client's images.generate(stream=True, partial_images=2) gets a partial
    image, then the completed one. A stream is still one image."""
    from pipelines.requests import ImageRequest

    openai = pytest.importorskip("openai")

    body = {"prompt": "a blue square", "seed": 5, "steps": STEPS}
    with requests.post(f"{main_app.url}/v1/generate", json={**body, "stream": True,
                                                            "partial_images": 1},
                       stream=True, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    names = [n for n, _ in events]
    assert names[-1] == "result" and names.count("partial_image") == 1, names
    progress = [e for n, e in events if n == "progress"]
    assert progress[0] == {"step": 0, "total": STEPS, "queue_position": None}
    assert [e["step"] for e in progress] == list(range(STEPS + 1)), progress
    partial = dict(events)["partial_image"]
    assert partial["index"] == 0 and partial["step"] == 1
    seen = {}
    pipe.generate([ImageRequest("a blue square", seed=5, guidance_scale=0.0)], height=SIZE,
                  width=SIZE, num_inference_steps=STEPS, denoised=True,
                  on_step=lambda i, t, x0: seen.setdefault(i + 1, np.array(x0)))
    want = np.asarray(pipe.draw_preview(seen[1])[0], np.int16)
    assert np.abs(png(partial["b64_json"]).astype(np.int16) - want).max() <= 1
    plain = requests.post(f"{main_app.url}/v1/generate", json=body, timeout=120).json()
    result = events[-1][1]
    assert result["seeds"] == plain["seeds"] == [5]
    np.testing.assert_array_equal(png(result["images"][0]["b64_json"]),
                                  png(plain["images"][0]["b64_json"]))

    client = openai.OpenAI(base_url=f"{main_app.url}/v1", api_key="unused", max_retries=0)
    got = list(client.images.generate(model="tiny-sdxl", prompt="a green triangle",
                                      size=f"{SIZE}x{SIZE}", stream=True, partial_images=2))
    assert [e.type for e in got] == ["image_generation.partial_image",
                                     "image_generation.completed"]
    assert all(png(e.b64_json).shape == (SIZE, SIZE, 3) for e in got)
    r = requests.post(f"{main_app.url}/v1/generate", json={"prompt": "x", "stream": True,
                                                            "num_images": 2}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["param"] == "num_images", r.text


def test_openapi_docs(main_app):
    assert "swagger" in requests.get(f"{main_app.url}/docs").text.lower()
    paths = requests.get(f"{main_app.url}/openapi.json").json()["paths"]
    assert {"/v1/images/generations", "/v1/images/edits", "/v1/generate", "/v1/edit",
            "/healthz", "/v1/models"} <= set(paths)


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
            rs = concurrently(8, lambda i: generate(url, seed=i))
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


# ---------------------------------------------------------------------------------- adapters
@pytest.mark.slow  # default-suite time: make test-slow runs it
def test_adapters_share_a_batch_and_equal_the_fused_python_api(cluster, sdxl_dir,
                                                               tmp_path_factory):
    """Two LoRA adapters (serve arg adapters, preloaded unfused) and the base model, requested
    concurrently with CFG: one batch, one compiled program, and each image equals the Python
    API's with that adapter fused (load_lora_weights)."""
    from test_adapters import make_lora_files

    from pipelines import TextToImagePipeline
    from serving.app import build_app

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
        rs = concurrently(3, lambda i: generate(url, prompt=asks[i][1], seed=asks[i][2],
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
            errs.append(float(np.abs(png(raw) / 255.0 - want).max()))
        print(f"served (unfused, one batch) vs fused Python API, max |diff| on [0,1]: {errs}")
        assert max(errs) <= 2e-3, errs
        base = png(rs[0].json()["images"][0]["b64_json"])
        alone = generate(url, prompt=asks[0][1], seed=7, lora="a", **body)  # a changes it
        assert np.abs(png(alone.json()["images"][0]["b64_json"]).astype(int) - base).max() > 10

        # unknown adapters: 422 naming the field and listing the loaded ones
        r = generate(url, lora="c", **body)
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
