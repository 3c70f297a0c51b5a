"""The step engine paced by the device, through the Python API, at a size where a step costs real
time: the tiny checkpoint at 128x128 (64x64 latents, about 0.1 s per UNet step on 2 CPU cores).
At the 32x32 of tests/test_step_engine.py a step costs a few ms and JAX's asynchronous dispatch
is invisible: a loop of ticks that never waited for the device passed every test there, while
at real sizes it queued all of an image's steps ahead of the device.

Like a real service, a thread ticks the engine while the test thread submits and cancels on the
wall clock (a client does not know which step the host is at). tests/service/test_step_serving.py
makes the same checks against a real ``serve run``."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import pytest

from pipelines import TextToImagePipeline
from pipelines.requests import ImageRequest
from pipelines.step_engine import StepEngine

SIZE = 128


def req(prompt: str, seed: int) -> ImageRequest:
    return ImageRequest(prompt, seed=seed, guidance_scale=0.0)  # the engine runs without CFG


@contextlib.contextmanager
def ticking(engine):
    """A thread that ticks ``engine`` whenever it has work, as the service's driver does."""
    stop, errors = threading.Event(), []

    def run():
        try:
            while not stop.is_set():
                if engine.idle:
                    time.sleep(0.001)
                else:
                    engine.tick()
        except BaseException as e:  # reported by the test
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(120)
    assert not errors, errors


def wait_for(cond, timeout=120.0):
    deadline = time.perf_counter() + timeout
    while not cond():
        assert time.perf_counter() < deadline, "timed out"
        time.sleep(0.002)


@pytest.fixture(scope="module")
def engine(sdxl_dir):
    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    eng = StepEngine(pipe, SIZE, SIZE, slots=2, cfg=False, output_type="np")
    eng.warmup()
    return eng


@pytest.fixture(scope="module")
def step_s(engine):
    """Seconds of one image's step, from a 10-step run alone (the premise of every test here:
    a step costs tens of milliseconds)."""
    with ticking(engine):
        h = engine.submit(req("warm", 0), 10)
        wait_for(lambda: h.done)
    s = (h.finished_at - h.submitted_at) / 10
    assert s >= 0.03, f"a step takes {s * 1e3:.0f} ms: too little to show pacing"
    return s


def test_a_short_image_sent_later_overtakes_a_long_one(engine, step_s):
    short_req = req("a blue square", 7)
    before = dict(engine.stats["tick_images"])
    with ticking(engine):
        long = engine.submit(req("a long one", 1), 40)
        time.sleep(8 * step_s)  # the long image is about 8 steps in
        short = engine.submit(short_req, 2)
        wait_for(lambda: short.done)
        long_step_then = long.step
        wait_for(lambda: long.done)
    assert short.status == long.status == "done"
    # the short image joined the running one: a few shared ticks, then it left
    assert long_step_then <= 20, long_step_then
    assert short.finished_at - short.submitted_at < 0.3 * (long.finished_at - long.submitted_at)
    assert engine.stats["tick_images"].get("2", 0) - before.get("2", 0) >= 2
    with ticking(engine):  # the same request alone: the same pixels
        alone = engine.submit(short_req, 2)
        wait_for(lambda: alone.done)
    np.testing.assert_allclose(short.image, alone.image, atol=1e-5)


def test_progress_is_reported_as_the_device_runs_the_steps(engine, step_s):
    n, events = 20, []
    with ticking(engine):
        h = engine.submit(req("a red circle", 3), n,
                          on_progress=lambda h: events.append((time.perf_counter(), h.step)))
        wait_for(lambda: h.done)
    t0, total = h.submitted_at, h.finished_at - h.submitted_at
    assert [s for _, s in events] == list(range(1, n + 1))
    s = total / n  # this run's own time per step
    for t, k in events:  # the k-th step is not reported before k steps' worth of time passed
        assert t - t0 >= 0.5 * k * s, (k, t - t0, s)
    # spread over the run, not bunched at its start or its end: about half of the progress events
    # come before the run's midpoint (a rank test: one slow step on a shared machine moves at most
    # the events around it, where a largest-gap bound failed)
    early = sum(t - t0 < total / 2 for t, _ in events)
    assert n // 4 <= early <= 3 * n // 4, (early, [round(t - t0, 3) for t, _ in events])


def test_a_cancelled_image_stops_using_device_time(engine, step_s):
    """Two 30-step images share ticks; the one cancelled after 5 steps has nothing queued after
    the next tick, while the other runs to the end. Device time is counted in slot-steps (the
    images the engine stepped, summed over ticks), not on the wall clock of a shared machine."""
    before = dict(engine.stats)
    with ticking(engine):
        a = engine.submit(req("the one that stays", 4), 30)
        b = engine.submit(req("the one that leaves", 5), 30)
        wait_for(lambda: b.step >= 5)  # the device has run 5 of its steps
        engine.cancel(b)
        queued_then = b.dispatched
        wait_for(lambda: a.done and b.done)
    assert a.status == "done" and a.image is not None
    assert b.status == "cancelled" and b.image is None
    assert b.dispatched <= queued_then + 1, (queued_then, b.dispatched)  # nothing after next tick
    assert b.dispatched < 15, b.dispatched  # far from its 30
    assert engine.stats["slot_steps"] - before["slot_steps"] == 30 + b.dispatched
    assert engine.stats["cancelled"] - before["cancelled"] == 1
