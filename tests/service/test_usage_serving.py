"""Usage, quotas and priorities per API key on the guarded application (its key file gives
KEY_HIGH priority 10 and KEY_QUOTA a daily quota): ``/v1/usage`` equals what was sent; a
passed quota is a 429 naming it; a high-class request overtakes a queue kept full by a
low-class key."""

from __future__ import annotations

import time

import pytest
import requests

from .helpers import (
    KEY_A,
    KEY_HIGH,
    KEY_LOW,
    KEY_QUOTA,
    QUOTA_IMAGES,
    SIZE,
    auth,
    high_among_low,
)

pytest.importorskip("ray.serve")


def _usage(url, key):
    r = requests.get(f"{url}/v1/usage", headers=auth(key), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_usage_equals_what_was_sent(guarded):
    before = _usage(guarded, KEY_A)
    assert before["key_id"].startswith("key_") and before["priority"] == 0
    for steps in (1, 2, 2):
        r = requests.post(f"{guarded}/v1/generate", headers=auth(KEY_A), timeout=120,
                          json={"prompt": "counted", "steps": steps})
        assert r.status_code == 200, r.text
    r = requests.post(f"{guarded}/v1/images/generations", headers=auth(KEY_A), timeout=120,
                      json={"prompt": "counted", "size": f"{SIZE}x{SIZE}"})
    assert r.status_code == 200, r.text
    after = _usage(guarded, KEY_A)
    default_steps = requests.get(f"{guarded}/v1/models", headers=auth(KEY_A),
                                 timeout=30).json()["data"][0]["maxdiff"]["default_steps"]
    for part in ("today", "total"):
        grew = {k: after[part][k] - before[part][k] for k in ("requests", "images", "steps")}
        assert grew == {"requests": 4, "images": 4, "steps": 5 + default_steps}, grew
        assert after[part]["device_s"] > before[part]["device_s"]
    assert after["resets_at"] > time.time()
    assert requests.get(f"{guarded}/v1/usage", timeout=30).status_code == 401


def test_a_passed_quota_is_a_429_naming_it(guarded):
    for _ in range(QUOTA_IMAGES):
        r = requests.post(f"{guarded}/v1/generate", headers=auth(KEY_QUOTA), timeout=120,
                          json={"prompt": "within the quota"})
        assert r.status_code == 200, r.text
    for path, body in (("/v1/generate", {"prompt": "one too many"}),
                       ("/v1/jobs", {"endpoint": "/v1/generate",
                                     "body": {"prompt": "one too many"}})):
        r = requests.post(f"{guarded}{path}", headers=auth(KEY_QUOTA), json=body, timeout=120)
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == "quota_exceeded" and f"images_per_day={QUOTA_IMAGES}" in \
            err["message"] and "resets at" in err["message"]
        assert 0 < int(r.headers["retry-after"]) <= 86400
    usage = _usage(guarded, KEY_QUOTA)
    assert usage["today"]["images"] == QUOTA_IMAGES
    assert usage["quotas"]["images_per_day"] == QUOTA_IMAGES
    # another key is not held by it
    assert requests.post(f"{guarded}/v1/generate", headers=auth(KEY_A), timeout=120,
                         json={"prompt": "free"}).status_code == 200


def test_a_high_class_request_overtakes_a_full_queue(guarded):
    """40 clients of the low key keep sending (the gate lets 8 requests reach the replica; the
    rest, some 30, wait at the ingress's priority gate), then one request of the high key: it
    goes ahead of the low requests sent before it (first come, first served it would run after
    all of them). How long it waited is read from the server's clock, the gate's
    ``priority_wait_s``, not from when this busy client saw answers come back: it waits for the
    first slot to free (about a batch), the low requests it overtook for the ~30 ahead of them
    (some 8 batches)."""
    high, sent, answered, low = high_among_low(guarded, KEY_LOW, KEY_HIGH)
    h = high.json()["timings"]["batch_id"]
    batch = {id(r): r.json()["timings"]["batch_id"] for *_, r in low}
    assert any(end < sent for _, end, _ in low), "no low request was answered before it"
    overtaken = [r for start, _, r in low if start < sent and batch[id(r)] > h]
    assert len(overtaken) >= 8, (h, sorted(batch.values()))
    waits = sorted(r.json()["timings"]["priority_wait_s"] for r in overtaken)
    waited = high.json()["timings"]["priority_wait_s"]
    assert waited <= waits[len(waits) // 2] / 3, (waited, waits)
