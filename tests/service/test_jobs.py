"""Links and jobs (serving.storage, serving.jobs) on the main application: images answered as
links download the bytes the inline answer carries; a job's images equal the synchronous
route's for the same seed; webhooks arrive signed (checked with the ``standardwebhooks``
library) and are retried; cancelling; the errors a client meets. The restart of an application
with jobs in flight is tests/service/test_jobs_restart.py (slow)."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import requests
from PIL import Image

from .helpers import KEY_A, KEY_B, SIZE, auth, generate, png

pytest.importorskip("ray.serve")

DONE = ("succeeded", "failed", "cancelled")


class Receiver:
    """A webhook receiver on a free port: answers each delivery with the next of ``codes``
    (then 200) and keeps (headers, body) of every delivery."""

    def __init__(self, codes=()):
        self.codes, self.got, self.lock = list(codes), [], threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with outer.lock:
                    outer.got.append(({k.lower(): v for k, v in self.headers.items()}, body))
                    code = outer.codes.pop(0) if outer.codes else 200
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def wait_done(url, job_id, headers=None, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = requests.get(f"{url}/v1/jobs/{job_id}", headers=headers, timeout=30).json()
        if job["status"] in DONE:
            return job
        time.sleep(0.1)
    pytest.fail(f"job {job_id} not done after {timeout} s: {job}")


def test_links_download_the_inline_bytes(main_app):
    """response_format url on /v1/generate: the link serves the very file b64_json carries,
    without an API key, until it expires; the file lands in the output store with its
    metadata; unknown names are 404s."""
    body = dict(seed=11, num_images=2, width=SIZE, height=SIZE)
    inline = generate(main_app.url, **body).json()
    linked = generate(main_app.url, response_format="url", **body)
    assert linked.status_code == 200, linked.text
    images = linked.json()["images"]
    assert [im["seed"] for im in images] == [11, 12]
    for got, want in zip(images, inline["images"]):
        assert "b64_json" not in got and got["expires_at"] > time.time() + 3000
        r = requests.get(got["url"], timeout=30)
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        assert r.content == base64.b64decode(want["b64_json"])
        name = got["url"].rsplit("/", 1)[1]
        meta = json.loads((main_app.outputs / name.replace(".png", ".json")).read_text())
        assert meta["seed"] == got["seed"] and meta["model"] == "tiny-sdxl"
    for bad in ("0" * 32 + ".png", "x.png", name.replace(".png", ".json")):
        r = requests.get(f"{main_app.url}/v1/files/{bad}", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found"
    r = requests.get(f"{main_app.url}/v1/files/..%2F..%2Fjobs%2Fjobs.sqlite", timeout=30)
    assert r.status_code == 404 and b"SQLite" not in r.content


def test_a_job_equals_the_synchronous_route_and_its_webhook_is_retried(main_app):
    """A /v1/generate job: 202 at once with an id and a Location, then succeeded with the
    route's response whose links serve the synchronous route's images for the same seed. Its
    webhook answers 500 twice: the third try delivers the job, signed under the key's secret
    (standardwebhooks verifies it)."""
    from standardwebhooks.webhooks import Webhook, WebhookVerificationError

    hook = Receiver([500, 500])
    try:
        body = {"prompt": "a red circle", "seed": 5, "num_images": 2}
        r = requests.post(f"{main_app.url}/v1/jobs", json={
            "endpoint": "/v1/generate", "body": body, "webhook": hook.url,
            "metadata": {"order": "42"}}, timeout=60)
        assert r.status_code == 202, r.text
        job = r.json()
        assert job["status"] in ("queued", "running") and job["id"].startswith("job_")
        assert r.headers["location"].endswith(f"/v1/jobs/{job['id']}")
        done = wait_done(main_app.url, job["id"])
        assert done["status"] == "succeeded", done
        assert done["metadata"] == {"order": "42"} and done["error"] is None
        sync = generate(main_app.url, **{k: v for k, v in body.items() if k != "prompt"}).json()
        assert done["result"]["seeds"] == sync["seeds"] == [5, 6]
        for got, want in zip(done["result"]["images"], sync["images"]):
            assert requests.get(got["url"], timeout=30).content == base64.b64decode(
                want["b64_json"])
        deadline = time.monotonic() + 30
        while len(hook.got) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(hook.got) == 3, [h for h, _ in hook.got]
        headers, payload = hook.got[-1]
        secret = requests.get(f"{main_app.url}/v1/webhooks/secret", timeout=30).json()["secret"]
        delivered = Webhook(secret).verify(payload, headers)
        assert delivered["id"] == job["id"] and delivered["status"] == "succeeded"
        assert delivered["result"]["images"] == done["result"]["images"]
        assert {h["webhook-id"] for h, _ in hook.got} == {job["id"]}
        with pytest.raises(WebhookVerificationError):  # another secret: refused
            Webhook("whsec_" + base64.b64encode(b"x" * 32).decode()).verify(payload, headers)
        final = requests.get(f"{main_app.url}/v1/jobs/{job['id']}", timeout=30).json()
        assert final["webhook"]["status"] == "delivered" and final["webhook"]["attempts"] == 3
        assert final["webhook"]["last_status_code"] == 200
    finally:
        hook.close()


def test_jobs_of_every_route_and_cancelling(main_app):
    """The OpenAI and edit routes as jobs; ten jobs at once with two running at a time: the
    last, cancelled at once, ends cancelled and the others succeed; a finished job is not
    cancelled; the caller's list shows them newest first."""
    picture = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (SIZE, SIZE, 3), np.uint8)).save(
        picture, "PNG")
    edit = {"prompt": "a blue square", "image": base64.b64encode(picture.getvalue()).decode(),
            "seed": 3}
    for endpoint, body, entries in (
            ("/v1/images/generations", {"prompt": "a cat", "size": f"{SIZE}x{SIZE}"}, "data"),
            ("/v1/edit", edit, "images")):
        r = requests.post(f"{main_app.url}/v1/jobs", json={"endpoint": endpoint, "body": body},
                          timeout=60)
        assert r.status_code == 202, r.text
        done = wait_done(main_app.url, r.json()["id"])
        assert done["status"] == "succeeded", done
        url = done["result"][entries][0]["url"]
        assert png(requests.get(url, timeout=30).content).shape == (SIZE, SIZE, 3)
    ids = [requests.post(f"{main_app.url}/v1/jobs", json={
        "endpoint": "/v1/generate", "body": {"prompt": f"job {i}", "seed": i}},
        timeout=60).json()["id"] for i in range(10)]
    cancelled = requests.delete(f"{main_app.url}/v1/jobs/{ids[-1]}", timeout=30).json()
    assert cancelled["status"] == "cancelled", cancelled
    finals = [wait_done(main_app.url, i) for i in ids]
    assert [f["status"] for f in finals] == ["succeeded"] * 9 + ["cancelled"]
    again = requests.delete(f"{main_app.url}/v1/jobs/{ids[0]}", timeout=30).json()
    assert again["status"] == "succeeded"
    listed = requests.get(f"{main_app.url}/v1/jobs", params={"limit": 10}, timeout=30).json()
    assert [j["id"] for j in listed["data"]] == ids[::-1]
    only = requests.get(f"{main_app.url}/v1/jobs", params={"status": "cancelled"},
                        timeout=30).json()
    assert ids[-1] in [j["id"] for j in only["data"]]
    assert all(j["status"] == "cancelled" for j in only["data"])


@pytest.mark.parametrize("payload, field, words", [
    ({"endpoint": "/v1/generate", "body": {"prompt": "x"}, "webhook": "ftp://host/x"},
     "webhook", "http:// or https://"),
    ({"endpoint": "/v1/generate", "body": {"prompt": "x", "steps": 50}}, "body.steps",
     "in 1..8 (the serve arg max_steps)"),
    ({"endpoint": "/v1/generate", "body": {"steps": 2}}, "body.prompt", "Field required"),
    ({"endpoint": "/v1/generate", "body": {"prompt": "x", "stream": True}}, "body.stream",
     "not streamed"),
    ({"endpoint": "/v1/images/generations", "body": {"prompt": "x", "n": 9}}, "body.n",
     "at most 4"),
    ({"endpoint": "/v1/upscale", "body": {"prompt": "x"}}, "endpoint", "/v1/generate"),
    ({"endpoint": "/v1/generate", "body": {"prompt": "x"}, "metadata": {"k": "v" * 600}},
     "metadata", "at most 16 entries"),
])
def test_bad_jobs_are_refused_naming_the_field(main_app, payload, field, words):
    r = requests.post(f"{main_app.url}/v1/jobs", json=payload, timeout=60)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == field and words in err["message"], err


def test_unknown_jobs_are_404s(main_app):
    for method in (requests.get, requests.delete):
        r = method(f"{main_app.url}/v1/jobs/job_{'0' * 32}", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"


def test_a_job_is_its_keys_own(guarded):
    """With API keys on, another key's job is a 404 and each key has its own webhook secret;
    files stay open (the link is the permission)."""
    r = requests.post(f"{guarded}/v1/jobs", headers=auth(KEY_A), json={
        "endpoint": "/v1/generate", "body": {"prompt": "mine", "seed": 1}}, timeout=60)
    assert r.status_code == 202, r.text
    job = wait_done(guarded, r.json()["id"], headers=auth(KEY_A))
    assert job["status"] == "succeeded", job
    assert requests.get(f"{guarded}/v1/jobs/{job['id']}", headers=auth(KEY_B),
                        timeout=30).status_code == 404
    assert requests.delete(f"{guarded}/v1/jobs/{job['id']}", headers=auth(KEY_B),
                           timeout=30).status_code == 404
    assert requests.get(f"{guarded}/v1/jobs", headers=auth(KEY_B), timeout=30).json()[
        "data"] == []
    assert requests.get(f"{guarded}/v1/jobs/{job['id']}", timeout=30).status_code == 401
    secrets = {requests.get(f"{guarded}/v1/webhooks/secret", headers=auth(k),
                            timeout=30).json()["secret"] for k in (KEY_A, KEY_B)}
    assert len(secrets) == 2
    url = job["result"]["images"][0]["url"]
    assert png(requests.get(url, timeout=30).content).shape == (SIZE, SIZE, 3)
