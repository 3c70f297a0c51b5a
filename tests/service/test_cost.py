"""``/v1/stats``' throughput and cost figures, checked by hand: two generator replicas with
``price_per_hour``, a window longer than the application's life (so the window holds every
image it made), a known number of images. The application is conftest's ``multi_app`` (two
replicas, priced; test_multi_model.py tests its models): other modules may have had it make
images before, so the count is a difference."""

from __future__ import annotations

import time

import pytest
import requests

from .helpers import PRICE, SIZE, generate


def _timed_stats(url):
    before = time.time()
    stats = requests.get(f"{url}/v1/stats", timeout=30).json()
    return before, stats, time.time()


def test_stats_report_images_per_second_and_cost_per_1000_images(multi_app):
    url, deploy_started, deploy_returned = multi_app.url, multi_app.started, multi_app.returned
    earlier = _timed_stats(url)[1]["throughput"]["total"]["images"]
    n = 6
    for seed in range(n):
        r = generate(url, seed=seed, width=SIZE, height=SIZE)
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    while True:  # reports are sent after each batch, without waiting: poll until all are in
        before, stats, after = _timed_stats(url)
        figures = stats["throughput"]
        if figures["total"]["images"] == earlier + n or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert figures["window_s"] == 3600 and figures["price_per_hour"] == PRICE
    per_replica = figures["per_replica"]
    assert len(per_replica) == 2 and set(per_replica) == set(stats["replicas"])
    for rid, f in per_replica.items():
        # the window holds the replica's whole life: its images are all it made, and it has
        # been serving since its warm-up ended (after the deploy began, before it returned)
        assert f["images"] == stats["replicas"][rid]["images"]
        assert before - deploy_returned - 1 <= f["seconds"] <= after - deploy_started + 1
        # the service rounds seconds to the millisecond and divides unrounded ones
        ms = 5e-4 / f["seconds"]
        assert f["images_per_s"] == pytest.approx(f["images"] / f["seconds"], rel=1e-4 + ms)
        if f["images"]:
            # price per second over images per second, per 1,000 images
            assert f["cost_per_1000_images"] == pytest.approx(
                PRICE / 3600 / f["images_per_s"] * 1000, rel=1e-4)
        else:
            assert f["cost_per_1000_images"] is None
    total = figures["total"]
    assert total["replicas"] == 2 and total["images"] == earlier + n
    seconds = sum(f["seconds"] for f in per_replica.values())
    assert total["seconds"] == pytest.approx(seconds, abs=2e-3)
    assert total["images_per_s"] == pytest.approx(
        sum(f["images"] / f["seconds"] for f in per_replica.values()),
        rel=1e-4 + 5e-4 / min(f["seconds"] for f in per_replica.values()))
    # two replicas' hours at PRICE each, over all the images they made
    assert total["cost_per_1000_images"] == pytest.approx(
        PRICE * seconds / 3600 / total["images"] * 1000, rel=1e-4)


def test_cost_figures_without_a_price_or_images():
    from serving.cost import throughput

    now = 1_000_000.0
    replicas = {"a": {"ready_at": now - 100, "images_by_second": [[now - 400, 9], [now - 50, 4]],
                      "report_age_s": 5},
                "b": {"ready_at": now - 30, "images_by_second": [], "report_age_s": 5},
                "gone": {"ready_at": now - 900, "images_by_second": [[now - 40, 8]],
                         "report_age_s": 31}}
    f = throughput(replicas, now, window_s=300, price_per_hour=None, live_s=30)
    assert set(f["per_replica"]) == {"a", "b"}  # "gone" reported 31 s ago: not live
    a, b = f["per_replica"]["a"], f["per_replica"]["b"]
    assert (a["images"], a["seconds"], a["images_per_s"]) == (4, 100, 0.04)  # 9 before window
    assert (b["images"], b["seconds"], b["images_per_s"]) == (0, 30, 0.0)
    assert a["cost_per_1000_images"] is None and f["total"]["cost_per_1000_images"] is None
    priced = throughput(replicas, now, window_s=300, price_per_hour=3.6, live_s=30)
    # 130 replica-seconds at $3.60/h = $0.13, for 4 images: $32.50 per 1,000
    assert priced["total"]["cost_per_1000_images"] == pytest.approx(32.5)
    assert priced["per_replica"]["b"]["cost_per_1000_images"] is None  # no image yet
