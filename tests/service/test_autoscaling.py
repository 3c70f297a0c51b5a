"""Autoscaling on the local multi-node cluster (two ``maxdiff_host`` hosts): load rises ->
a second generator replica; load falls -> one again, drained while a request stream runs
(every request answered, none lost); idle -> zero replicas, and a request then starts one.

Short delays (test settings, not the defaults) keep it cheap; every state is polled for with
a generous timeout, never assumed after a sleep."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from .helpers import MAIN_ARGS, SIZE, generate

APP, ROUTE = "scaling", "/scaling"
SCALING_ARGS = dict(
    MAIN_ARGS, model_name="scaling", num_cpus=0, resource="maxdiff_host", resource_amount=1,
    max_replicas_per_node=1, max_queued_requests=-1, num_replicas="auto",
    # one request per replica is the target; requests wait up to 0.5 s for their batch to
    # fill (MAIN_ARGS), so a request stream keeps requests ongoing
    autoscaling=dict(min_replicas=0, max_replicas=2, initial_replicas=1,
                     target_ongoing_requests=1, upscale_delay_s=1, downscale_delay_s=4,
                     downscale_to_zero_delay_s=4, metrics_interval_s=0.5,
                     look_back_period_s=2),
    graceful_shutdown_s=60, graceful_shutdown_wait_loop_s=0.2)


def replica_states() -> dict:
    from ray import serve

    app = serve.status().applications.get(APP)
    dep = app.deployments.get("Generator") if app else None
    return {getattr(k, "value", str(k)): v for k, v in (dep.replica_states if dep else {}).items()
            if v}


def wait_for(what, predicate, timeout=240):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        states = replica_states()
        if not seen or seen[-1] != states:
            seen.append(states)
        if predicate(states):
            return seen
        time.sleep(0.25)
    pytest.fail(f"{what}: not reached in {timeout} s; replica states seen: {seen}")


class Stream:
    """``clients`` threads, each sending one request after another until stopped; every
    outcome is kept: (status, Retry-After, replica) or the exception."""

    def __init__(self, url, clients):
        self.url, self.outcomes, self._stop = url, [], threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(clients)]
        for t in self._threads:
            t.start()

    def _loop(self, i):
        seed = i * 100_000
        while not self._stop.is_set():
            seed += 1
            try:
                r = generate(self.url, seed=seed, width=SIZE, height=SIZE, timeout=120)
                self.outcomes.append((r.status_code, r.headers.get("retry-after"),
                                      r.headers.get("x-maxdiff-replica")))
            except requests.RequestException as e:  # a reset or a hang: lost, kept as such
                self.outcomes.append((e, None, None))

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join()
        return self.outcomes


@pytest.mark.slow  # about 1.5 minutes of scaling up, down and to zero: make test-slow runs it
def test_replicas_follow_the_load_and_scale_down_drains(cluster, sdxl_dir):
    from ray import serve

    from serving.app import build_app

    url = f"{cluster.url}{ROUTE}"
    serve.run(build_app({"model": str(sdxl_dir), **SCALING_ARGS}), name=APP, route_prefix=ROUTE)
    try:
        assert replica_states() == {"RUNNING": 1}  # initial_replicas
        # load rises: four clients against a target of one ongoing request per replica
        load = Stream(url, 4)
        wait_for("a second replica under load", lambda s: s.get("RUNNING", 0) == 2)
        deadline = time.monotonic() + 120
        while len({o[2] for o in load.outcomes if o[0] == 200}) < 2:  # it serves too
            assert time.monotonic() < deadline, "the new replica served no request"
            time.sleep(0.1)
        # load falls to one client: back to one replica while its stream runs on
        light = Stream(url, 1)
        heavy = load.stop()
        wait_for("one replica again", lambda s: s == {"RUNNING": 1})
        n_after = len(light.outcomes)
        while len(light.outcomes) < n_after + 3:  # served on by the remaining replica
            time.sleep(0.1)
        outcomes = heavy + light.stop()
        served = [o for o in outcomes if o[0] == 200]
        shed = [o for o in outcomes if o[0] == 503]
        assert len(served) + len(shed) == len(outcomes), [o for o in outcomes if o[0] not in
                                                          (200, 503)]
        assert all(retry for _, retry, _ in shed), "a 503 without Retry-After"
        # idle: down to zero replicas; /healthz stays 200 (a request starts a replica)
        wait_for("zero replicas when idle", lambda s: s == {})
        # the removed replicas leave /v1/stats as they go (not after the board's 10 minutes)
        deadline = time.monotonic() + 30
        while requests.get(f"{url}/v1/stats", timeout=30).json()["replicas"]:
            assert time.monotonic() < deadline, "removed replicas still in /v1/stats"
            time.sleep(0.5)
        health = requests.get(f"{url}/healthz", timeout=30)
        assert health.status_code == 200 and health.json().get("scaled_to_zero") is True
        r = generate(url, seed=7, width=SIZE, height=SIZE, timeout=180)
        assert r.status_code == 200, r.text
        assert replica_states() == {"RUNNING": 1}
    finally:
        serve.delete(APP)
