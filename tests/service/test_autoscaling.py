"""Autoscaling on the local multi-node cluster (two ``maxdiff_host`` hosts): load rises ->
a second generator replica; load falls -> one again, drained while a request stream runs
(every request answered, none lost); idle -> zero replicas, and a request then starts one.
``/v1/stats`` follows: a removed replica leaves its ``replicas`` for its ``removed``.

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


def stats_once(url, done, timeout=30) -> dict:
    """``/v1/stats`` once ``done(stats)`` (a replica Ray Serve removed leaves its replicas at
    once; the poll only absorbs a report in flight), failing after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not done(stats := requests.get(f"{url}/v1/stats", timeout=30).json()):
        assert time.monotonic() < deadline, stats
        time.sleep(0.5)
    return stats


def test_stats_list_live_replicas_and_removed_ones():
    """``/v1/stats``' split (serving.stats_board.split_replicas): with the controller's view, a
    replica it no longer lists, or drains, or that said goodbye is removed (with its node, pid
    and when it was last seen) and a live one that has not reported is not listed; without
    it, every replica that has not said goodbye is listed."""
    from serving.stats_board import split_replicas

    reports = {rid: (100.0 + k, {"node_id": f"n{k}", "pid": k, "images": k})
               for k, rid in enumerate(["run", "drain", "dropped", "bye"])}
    gone = {"bye": 105.0}
    live = {"run": "RUNNING", "drain": "STOPPING", "bye": "RUNNING", "new": "STARTING"}
    out = split_replicas(reports, gone, live, now=110.0)
    assert list(out["replicas"]) == ["run"]
    assert out["replicas"]["run"] == {"node_id": "n0", "pid": 0, "images": 0,
                                      "report_age_s": 10.0, "state": "RUNNING"}
    assert out["removed"] == [
        {"id": "bye", "node_id": "n3", "pid": 3, "last_seen": 105.0, "state": "RUNNING"},
        {"id": "dropped", "node_id": "n2", "pid": 2, "last_seen": 102.0, "state": None},
        {"id": "drain", "node_id": "n1", "pid": 1, "last_seen": 101.0, "state": "STOPPING"}]
    unknown = split_replicas(reports, gone, None, now=110.0)
    assert list(unknown["replicas"]) == ["run", "drain", "dropped"]
    assert [r["id"] for r in unknown["removed"]] == ["bye"]
    assert unknown["replicas"]["drain"]["state"] is None


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
        served_by = {o[2] for o in load.outcomes if o[0] == 200}
        stats = stats_once(url, lambda st: len(st["replicas"]) == 1)
        (kept,) = stats["replicas"]
        assert stats["live_from"] == "controller" and stats["replicas"][kept]["state"] == "RUNNING"
        gone = served_by - {kept}  # the scaled-down replica: out of replicas, into removed
        assert len(gone) == 1 and gone <= {r["id"] for r in stats["removed"]}, stats["removed"]
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
        # the removed replicas leave /v1/stats' replicas as they go, into its removed
        stats = stats_once(url, lambda st: not st["replicas"])
        assert served_by <= {r["id"] for r in stats["removed"]}, stats["removed"]
        assert all(r["last_seen"] <= time.time() and r["node_id"] for r in stats["removed"])
        health = requests.get(f"{url}/healthz", timeout=30)
        assert health.status_code == 200 and health.json().get("scaled_to_zero") is True
        r = generate(url, seed=7, width=SIZE, height=SIZE, timeout=180)
        assert r.status_code == 200, r.text
        assert replica_states() == {"RUNNING": 1}
    finally:
        serve.delete(APP)
