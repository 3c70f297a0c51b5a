"""The stats actor of an application (:class:`StatsBoard`): each generator replica reports its
stats there after every batch and health check, and each model it loads its defaults and
limits; the ingress reads it for ``/v1/stats`` (the live replicas and the removed ones:
:func:`split_replicas`) and ``/v1/models``. Light: never imports JAX.
"""

from __future__ import annotations

import time

import ray


def split_replicas(reports: dict[str, tuple[float, dict]], gone: dict[str, float],
                   live: dict[str, str] | None, now: float) -> dict:
    """``/v1/stats``' ``replicas`` and ``removed``, from the replicas' last reports (replica id
    -> (unix time, stats)), those that said they shut down (``gone``: id -> unix time) and
    ``live``: Ray Serve's replicas of the generator deployment (id -> state; None: the
    controller could not be read). A replica is live unless it shut down, Ray Serve is draining
    it (``STOPPING``) or no longer lists it; with ``live`` None, unless it shut down. A live
    replica that has not reported yet (loading its model) is not listed.

    ``replicas``: id -> its stats, ``report_age_s`` and ``state`` (Ray Serve's; None when not
    known); ``removed``: each other replica that reported (``id``, ``node_id``, ``pid``,
    ``last_seen``: unix time of its last report or goodbye, ``state``: ``STOPPING`` while Ray
    Serve drains it, else None), most recently seen first."""
    replicas, removed = {}, []
    for rid, (at, stats) in reports.items():
        state = None if live is None else live.get(rid)
        if rid not in gone and (live is None or state not in (None, "STOPPING")):
            replicas[rid] = {**stats, "report_age_s": round(now - at, 1), "state": state}
            continue
        removed.append({"id": rid, "node_id": stats.get("node_id"), "pid": stats.get("pid"),
                        "last_seen": round(max(at, gone.get(rid, 0.0)), 1), "state": state})
    removed.sort(key=lambda r: -r["last_seen"])
    return {"replicas": replicas, "removed": removed}


@ray.remote(num_cpus=0)
class _Board:
    """Latest stats of each generator replica of one application, and the models' infos."""

    FORGET_S = 600.0

    def __init__(self):
        self.replicas: dict[str, tuple[float, dict]] = {}  # id -> (unix time, last report)
        self.infos: dict[str, dict] = {}  # catalog key:model name -> the model's info
        self.gone: dict[str, float] = {}  # replicas that shut down -> when

    def describe(self, key: str, info: dict) -> None:
        self.infos[key] = info

    def described(self, keys: list[str]) -> dict:
        return {k: self.infos[k] for k in keys if k in self.infos}

    def report(self, replica_id: str, stats: dict) -> None:
        if replica_id not in self.gone:
            self.replicas[replica_id] = (time.time(), stats)

    def forget(self, replica_id: str) -> None:
        """A replica that shut down (scaled down, redeployed): removed at once, whatever the
        controller says (a late report from it is ignored)."""
        self.gone[replica_id] = time.time()

    def snapshot(self, live: dict[str, str] | None = None) -> dict:
        """:func:`split_replicas` of the replicas seen in the last 10 minutes (older ones are
        forgotten)."""
        now = time.time()
        self.replicas = {k: v for k, v in self.replicas.items() if now - v[0] < self.FORGET_S}
        self.gone = {k: t for k, t in self.gone.items() if now - t < self.FORGET_S}
        return split_replicas(self.replicas, self.gone, live, now)


class StatsBoard:
    """The stats actor of an application: one named, detached Ray actor per application name
    (namespace ``maxdiff``), created by whichever replica asks first; redeploying the
    application reuses it. Replicas seen last 10 minutes ago are forgotten."""

    @staticmethod
    def get(app_name: str):
        return _Board.options(name=f"stats:{app_name}", namespace="maxdiff", get_if_exists=True,
                              lifetime="detached").remote()
