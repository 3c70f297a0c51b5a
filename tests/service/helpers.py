"""What the service tests share: the apps' serve args and HTTP helpers."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time

import numpy as np
import requests
from PIL import Image

SIZE, STEPS = 32, 2
MAIN_ARGS = dict(
    steps=STEPS, guidance=0.0, max_batch_size=4, batch_wait_timeout_s=0.5,
    warmup_shapes=[f"{SIZE}x{SIZE}:{STEPS}:0"], max_queued_requests=2, max_n=4, max_steps=8,
    min_size=16, max_size=64, request_timeout_s=120, num_cpus=1, ingress_num_cpus=0,
    model_name="tiny-sdxl", max_cost=0.02, max_image_bytes=2**20,
    max_running_jobs=2, webhook_backoff_s=0.2,
)
KEY_A, KEY_B = "test-key-alpha-0123", "test-key-bravo-4567"
# the guarded app's keys with policies: a priority class above the others', and a daily quota
KEY_HIGH, KEY_LOW, KEY_QUOTA = "test-key-high-8910", "test-key-low-1112", "test-key-quota-1314"
QUOTA_IMAGES = 3
ORIGIN = "http://playground.test"
GUARDED_ARGS = dict(MAIN_ARGS, max_steps=5000, min_size=SIZE, max_size=SIZE, max_n=1,
                    max_cost=0.002, rate_limit_per_minute=400, cors_origins=[ORIGIN],
                    num_cpus=0, max_queued_requests=-1, model_name="guarded", max_body_bytes=4096)
BIG = 128
# the engine=step application (conftest's step_app): two models, each with these defaults
STEP_MODEL = dict(steps=4, guidance=0.0)
STEP_ARGS = dict(
    engine="step", engine_slots=2, warmup_shapes=[f"{SIZE}x{SIZE}", f"{BIG}x{BIG}"],
    max_steps=50, max_n=2, min_size=16, max_size=BIG, request_timeout_s=120, num_cpus=1,
    ingress_num_cpus=0, max_cost=1.0, max_queued_requests=16,
)
# the multi-model application (conftest's multi_app): MAIN_ARGS' limits, two replicas that keep
# one model each, priced per replica-hour with a stats window longer than the app's life
MODEL_A, MODEL_B = "tiny-a", "tiny-b"
PRICE = 2.5
MULTI_ARGS = dict({k: v for k, v in MAIN_ARGS.items() if k not in ("steps", "guidance", "model_name")},
                  num_cpus=0, num_replicas=2, max_models_per_replica=1, max_queued_requests=-1,
                  price_per_hour=PRICE, stats_window_s=3600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def png(b64_or_bytes) -> np.ndarray:
    """The RGB pixels of a PNG (bytes, or base64 text)."""
    raw = base64.b64decode(b64_or_bytes) if isinstance(b64_or_bytes, str) else b64_or_bytes
    im = Image.open(io.BytesIO(raw))
    assert im.format == "PNG"
    return np.asarray(im.convert("RGB"))


def concurrently(n, fn):
    out = [None] * n
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, fn(i))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def generate(url, timeout=120, headers=None, **body):
    return requests.post(f"{url}/v1/generate", json={"prompt": "a red circle", **body},
                         headers=headers, timeout=timeout)


def generate_as_a_client(url, **body):
    """What a well-behaved client does: a 503 with Retry-After is retried (up to 3 times).
    With max_queued_requests=2, requests that arrive at the same instant can outrun the
    router's replica assignment and be shed before the replica is even asked."""
    for _ in range(3):
        r = generate(url, **body)
        if r.status_code != 503:
            break
        time.sleep(float(r.headers.get("Retry-After", 1)))
    return r


def burst(url, n, body, timeout=120):
    def send(i):
        try:
            return requests.post(f"{url}/v1/generate", json={**body, "seed": i}, timeout=timeout)
        except requests.RequestException as e:  # a reset or a hang is a failure, kept as such
            return e
    return concurrently(n, send)


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def sse_events(response):
    """(event, data) pairs of a Server-Sent Events response, as they arrive."""
    name = None
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            yield name, json.loads(line[len("data: "):])


def high_among_low(url, low_key, high_key, clients=40, per_client=8):
    """``clients`` threads of ``low_key`` keep sending /v1/generate (``per_client`` each at
    most); once 8 are answered (the queue full), one request of ``high_key``. Returns (the
    high response, when it was sent, when answered, the low ones as (sent, answered,
    response)); every response a 200."""
    low, done = [], threading.Event()

    def keep_sending(i):
        for k in range(per_client):
            if done.is_set():
                return
            at = time.monotonic()
            r = requests.post(f"{url}/v1/generate", headers=auth(low_key), timeout=300,
                              json={"prompt": f"low {i}", "seed": 100 * i + k})
            low.append((at, time.monotonic(), r))

    threads = [threading.Thread(target=keep_sending, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while len(low) < 8:
        assert time.monotonic() < deadline, "the low requests were not answered"
        time.sleep(0.05)
    sent = time.monotonic()
    high = requests.post(f"{url}/v1/generate", headers=auth(high_key), timeout=300,
                         json={"prompt": "high", "seed": 99})
    answered = time.monotonic()
    done.set()
    for t in threads:
        t.join()
    assert high.status_code == 200 and all(r.status_code == 200 for *_, r in low), \
        [r.text for *_, r in low if r.status_code != 200][:1]
    return high, sent, answered, low
