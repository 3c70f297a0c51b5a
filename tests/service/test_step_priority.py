"""Priority classes on engine=step: with a low-class key keeping the queue full, a high-class
request takes the next free slot (the ingress's gate and the step engine's queue both order by
class)."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from .helpers import KEY_HIGH, KEY_LOW, SIZE, STEP_ARGS, auth

pytest.importorskip("ray.serve")


@pytest.fixture(scope="module")
def step_keys(cluster, sdxl_dir, tmp_path_factory):
    """An engine=step application (two slots) whose keys have classes."""
    from ray import serve

    from serving.app import build_app

    state = tmp_path_factory.mktemp("step-keys")
    keys = state / "keys.txt"
    keys.write_text(f"{KEY_HIGH} priority=10\n{KEY_LOW}\n")
    serve.run(build_app({**STEP_ARGS, "model": str(sdxl_dir), "steps": 4, "guidance": 0.0,
                         "warmup_shapes": [f"{SIZE}x{SIZE}"], "max_queued_requests": -1,
                         "api_keys": str(keys), "jobs_db": str(state / "db.sqlite"),
                         "output_store": str(state / "outputs")}),
              name="stepkeys", route_prefix="/stepkeys")
    yield f"{cluster.url}/stepkeys"
    serve.delete("stepkeys")


def test_a_high_class_request_takes_the_next_free_slot(step_keys):
    """40 clients of the low key keep sending; one request of the high key then finishes
    ahead of the low requests queued before it: few low images finish while it waits and
    runs (the slots' current images and their successors), where first come, first served
    it would wait behind some 30."""
    url = step_keys
    low, done = [], threading.Event()

    def keep_sending(i):
        for k in range(6):
            if done.is_set():
                return
            at = time.monotonic()
            r = requests.post(f"{url}/v1/generate", headers=auth(KEY_LOW), timeout=300,
                              json={"prompt": f"low {i}", "seed": 100 * i + k})
            low.append((at, time.monotonic(), r))

    threads = [threading.Thread(target=keep_sending, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while len(low) < 8:  # serving, with the queue full
        assert time.monotonic() < deadline, "the low requests were not answered"
        time.sleep(0.05)
    sent = time.monotonic()
    high = requests.post(f"{url}/v1/generate", headers=auth(KEY_HIGH), timeout=300,
                         json={"prompt": "high", "seed": 99})
    answered = time.monotonic()
    done.set()
    for t in threads:
        t.join()
    assert high.status_code == 200 and all(r.status_code == 200 for *_, r in low), \
        [r.text for *_, r in low if r.status_code != 200][:1]
    meanwhile = sum(sent < end < answered for _, end, r in low)
    overtaken = sum(start < sent and end > answered for start, end, r in low)
    assert meanwhile <= 6, meanwhile  # 2 slots: their images, their successors, in transit
    assert overtaken >= 8, overtaken
