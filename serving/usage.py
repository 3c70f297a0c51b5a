"""Usage per API key (requests, images, steps, device-seconds per UTC day) and the quotas of
:class:`serving.security.KeyPolicy`, kept in the service database (serve arg ``jobs_db``, where
jobs live: it survives restarts and ingress processes on one host share it), and the priority
gate that orders requests waiting for the generators by their keys' classes. Light: never
imports JAX."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import heapq
import itertools
import math
import time

from serving.errors import ApiError
from serving.job_store import open_db
from serving.security import KeyPolicy

ANONYMOUS = ""  # the key id of requests when keys are off
_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    app TEXT NOT NULL, key_id TEXT NOT NULL, day TEXT NOT NULL,
    requests INTEGER NOT NULL DEFAULT 0, images INTEGER NOT NULL DEFAULT 0,
    steps INTEGER NOT NULL DEFAULT 0, device_s REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (app, key_id, day));
"""
FIELDS = ("requests", "images", "steps", "device_s")


def today(now: float | None = None) -> str:
    return dt.datetime.fromtimestamp(time.time() if now is None else now, dt.timezone.utc) \
        .strftime("%Y-%m-%d")


def next_reset(now: float | None = None) -> float:
    """The next UTC midnight (unix seconds): when daily quotas reset."""
    t = dt.datetime.fromtimestamp(time.time() if now is None else now, dt.timezone.utc)
    return (t.replace(hour=0, minute=0, second=0, microsecond=0)
            + dt.timedelta(days=1)).timestamp()


class UsageStore:
    """The ``usage`` table of the database at ``path`` (blocking calls; the ingress runs them in
    a thread)."""

    def __init__(self, path: str):
        self._db, self._lock = open_db(path, _SCHEMA)

    def add(self, app: str, key_id: str | None, requests: int, images: int, steps: int,
            device_s: float, now: float | None = None) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO usage (app, key_id, day, requests, images, steps, device_s) VALUES "
                "(?, ?, ?, ?, ?, ?, ?) ON CONFLICT(app, key_id, day) DO UPDATE SET "
                "requests = requests + excluded.requests, images = images + excluded.images, "
                "steps = steps + excluded.steps, device_s = device_s + excluded.device_s",
                (app, key_id or ANONYMOUS, today(now), requests, images, steps, device_s))

    def day(self, app: str, key_id: str | None, now: float | None = None) -> dict:
        """The key's usage today (UTC)."""
        with self._lock:
            row = self._db.execute(
                "SELECT requests, images, steps, device_s FROM usage WHERE app = ? AND "
                "key_id = ? AND day = ?", (app, key_id or ANONYMOUS, today(now))).fetchone()
        return dict(zip(FIELDS, row or (0, 0, 0, 0.0)))

    def total(self, app: str, key_id: str | None) -> dict:
        with self._lock:
            row = self._db.execute(
                "SELECT COALESCE(SUM(requests), 0), COALESCE(SUM(images), 0), "
                "COALESCE(SUM(steps), 0), COALESCE(SUM(device_s), 0) FROM usage WHERE app = ? "
                "AND key_id = ?", (app, key_id or ANONYMOUS)).fetchone()
        return dict(zip(FIELDS, row))

    def close(self) -> None:
        with self._lock:
            self._db.close()


def quota_error(policy: KeyPolicy, used: dict, images: int, key_id: str | None,
                now: float | None = None) -> ApiError | None:
    """A 429 naming the quota that ``images`` more images would pass, and when it resets."""
    reset = next_reset(now)
    when = dt.datetime.fromtimestamp(reset, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    wait = str(max(1, math.ceil(reset - (time.time() if now is None else now))))
    if policy.images_per_day is not None and used["images"] + images > policy.images_per_day:
        return ApiError(429, f"API key {key_id}: its quota images_per_day="
                        f"{policy.images_per_day} would be passed ({used['images']} used today, "
                        f"{images} asked); it resets at {when}", kind="rate_limit_exceeded",
                        code="quota_exceeded", headers={"Retry-After": wait})
    if policy.device_seconds_per_day is not None \
            and used["device_s"] >= policy.device_seconds_per_day:
        return ApiError(429, f"API key {key_id}: its quota device_seconds_per_day="
                        f"{policy.device_seconds_per_day:g} is used up ({used['device_s']:.1f} "
                        f"s today); it resets at {when}", kind="rate_limit_exceeded",
                        code="quota_exceeded", headers={"Retry-After": wait})
    return None


def device_share(batch: dict, images: int) -> float:
    """A request's share of its batch's device time: its images over the batch's images
    (engine=step: over the engine's slots, which share each tick)."""
    whole = batch.get("slots") or batch.get("images") or images
    return float(batch.get("generate_s", 0.0)) * images / max(whole, 1)


class PriorityGate:
    """At most ``capacity`` requests with the generators at once (per ingress replica); those
    waiting go highest priority first, then in arrival order. A waiting request gains one
    class for every ``age_s`` seconds it waited, so a lower class is never starved."""

    def __init__(self, capacity: int, age_s: float = 30.0):
        self.capacity, self.age_s = capacity, age_s
        self.active = 0
        self._waiting: list[tuple[float, float, int, asyncio.Future]] = []
        self._order = itertools.count()

    def _admit(self) -> None:
        now = time.monotonic()
        while self.active < self.capacity and self._waiting:
            _, arrived, _, fut = heapq.heappop(self._waiting)
            if fut.done():  # gave up waiting
                continue
            self.active += 1
            fut.set_result(now - arrived)

    async def acquire(self, priority: int) -> float:
        """Take a slot; waits (in class order) while all are taken. Returns the seconds waited."""
        if self.active < self.capacity and not self._waiting:
            self.active += 1
            return 0.0
        arrived = time.monotonic()
        fut = asyncio.get_running_loop().create_future()
        # at time t a waiter's class is priority + (t - arrived) / age_s: the highest first is
        # the smallest arrived / age_s - priority, the same for every t
        heapq.heappush(self._waiting, (arrived / self.age_s - priority, arrived,
                                       next(self._order), fut))
        try:
            return await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # admitted just as the waiter gave up: pass the slot on
            fut.cancel()
            raise

    def release(self) -> None:
        self.active -= 1
        self._admit()

    def resize(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._admit()


class Accounts:
    """The ingress's side of keys: quotas checked before a request runs, usage counted after
    (database and Prometheus, labelled by key id), and, where some key has a priority class
    other than 0, the :class:`PriorityGate` in front of the generators. ``policies``: key id
    -> :class:`KeyPolicy` (empty when keys are off)."""

    def __init__(self, settings, app: str, policies: dict[str, KeyPolicy], db_path: str):
        self.s, self.app, self.policies = settings, app, policies
        self.store = UsageStore(db_path)
        self.gate = (PriorityGate(settings.generator_max_ongoing)
                     if any(p.priority for p in policies.values()) else None)
        self._meters = None

    def policy(self, key_id: str | None) -> KeyPolicy:
        return self.policies.get(key_id) or KeyPolicy()

    async def check(self, key_id: str | None, images: int) -> None:
        """A 429 when ``images`` more would pass one of the key's quotas."""
        policy = self.policy(key_id)
        if policy.images_per_day is None and policy.device_seconds_per_day is None:
            return
        used = await asyncio.to_thread(self.store.day, self.app, key_id)
        err = quota_error(policy, used, images, key_id)
        if err is not None:
            raise err

    def classed(self, job, key_id: str | None):
        """``job`` carrying its key's class (the step engine's queue orders by it)."""
        priority = self.policy(key_id).priority
        return job if priority == job.priority else dataclasses.replace(job, priority=priority)

    async def run(self, call, key_id: str | None, deadline: float, replicas: int):
        """``await call()`` (a generator call) behind the priority gate, if there is one;
        ``replicas``: running generator replicas (the gate's capacity follows them). Behind a
        gate the result's timings carry ``priority_wait_s``, the seconds it waited there."""
        if self.gate is None:
            return await call()
        per_ingress = math.ceil(max(replicas, 1) * self.s.generator_max_ongoing
                                / self.s.ingress_replicas)
        self.gate.resize(per_ingress)
        try:
            waited = await asyncio.wait_for(self.gate.acquire(self.policy(key_id).priority),
                                            max(deadline - time.monotonic(), 0))
        except asyncio.TimeoutError:
            raise ApiError(504, "the request did not start before its deadline (it waited "
                           "behind higher-priority requests)", kind="timeout") from None
        try:
            result = await call()
        finally:
            self.gate.release()
        return dataclasses.replace(result, timings={**result.timings, "priority_wait_s": waited})

    async def count(self, key_id: str | None, job, result) -> None:
        """Add a finished request to its key's usage."""
        n = len(result.seeds)
        device_s = device_share(result.batch, n)
        await asyncio.to_thread(self.store.add, self.app, key_id, 1, n, job.steps * n, device_s)
        try:
            if self._meters is None:
                from ray.serve import metrics

                self._meters = {f: metrics.Counter(f"maxdiff_key_{f}", f"{f} per API key id.",
                                                   tag_keys=("key",)) for f in FIELDS}
            tags = {"key": key_id or "anonymous"}
            for f, v in zip(FIELDS, (1, n, job.steps * n, device_s)):
                self._meters[f].inc(v, tags=tags)
        except Exception:  # metrics never fail a request (outside a Ray worker, say)
            pass

    async def report(self, key_id: str | None) -> dict:
        """``GET /v1/usage``: the key's usage today and in all, its quotas and class."""
        today_, total = await asyncio.gather(
            asyncio.to_thread(self.store.day, self.app, key_id),
            asyncio.to_thread(self.store.total, self.app, key_id))
        policy = self.policy(key_id)
        out = {"key_id": key_id, "priority": policy.priority, "today": today_, "total": total,
               "quotas": {"images_per_day": policy.images_per_day,
                          "device_seconds_per_day": policy.device_seconds_per_day},
               "resets_at": int(next_reset())}
        if self.s.price_per_hour is not None:
            for part in (today_, total):
                part["cost"] = part["device_s"] * self.s.price_per_hour / 3600
        return out

    def close(self) -> None:
        self.store.close()
