"""Jobs: a request answered at once with an id (``POST /v1/jobs``: 202), run in the background,
its state read with ``GET /v1/jobs/{id}`` and cancelled with ``DELETE``; a ``webhook`` URL gets
the finished job, signed.

State lives in the jobs database (:mod:`serving.job_store`) and survives the application: a
job belongs to the ingress replica that accepted it, and jobs of a replica that stopped (a
restart, a crash) are marked failed with the reason (``job_interrupted``), never left queued.
The images of a finished job are in the output store (:mod:`serving.storage`), its result the
route's body with links.

Webhooks follow the Standard Webhooks scheme (https://www.standardwebhooks.com): headers
``webhook-id`` (the job id), ``webhook-timestamp`` (unix seconds) and ``webhook-signature``
(``v1,`` + base64 HMAC-SHA256 of ``"{id}.{timestamp}.{body}"`` under the secret's bytes); each
API key has its own secret (``GET /v1/webhooks/secret``), derived from the server's
(``webhook_secret``, or one made once and kept in the database). A delivery that fails (no 2xx
within ``webhook_timeout_s``) is retried ``webhook_retries`` times with doubling pauses from
``webhook_backoff_s``; it runs beside the generator, never in its way. Light: never imports JAX.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import os
import sqlite3
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from serving.answers import Prepared, answer
from serving.errors import ApiError, error_body, internal_message
from serving.job_store import JobStore, interrupted
from serving.storage import OutputStore

logger = logging.getLogger("ray.serve")

ACTIVE = ("queued", "running")
DONE = ("succeeded", "failed", "cancelled")
HEARTBEAT_S = 2.0  # how often an owner says it is alive
SWEEP_S = 10.0  # interrupted jobs are failed, their webhooks taken over, this often
FILES_SWEEP_S = 300.0  # expired files and jobs are removed this often
ENV_SECRET = "MAXDIFF_WEBHOOK_SECRET"  # the server's webhook secret when the serve arg is unset
MAX_METADATA = (16, 64, 512)  # entries, key and value characters


def check_places(settings) -> None:
    """Open the output store and the jobs database as the ingress will; a ValueError naming
    the serve arg when one cannot be."""
    try:
        OutputStore(settings.output_store, settings.output_ttl_s, settings.sign_urls,
                    settings.output_store_options)
    except (ImportError, ValueError, OSError, TypeError) as e:
        raise ValueError(f"serve arg output_store={settings.output_store!r}: cannot open it "
                         f"({type(e).__name__}: {e})") from None
    try:
        JobStore(settings.jobs_db).close()
    except (OSError, sqlite3.Error) as e:
        raise ValueError(f"serve arg jobs_db={settings.jobs_db!r}: cannot open it "
                         f"({type(e).__name__}: {e})") from None


def public(row: dict) -> dict:
    """A job as the API shows it (``GET /v1/jobs/{id}``, webhooks)."""
    webhook = None if row["webhook"] is None else {
        "url": row["webhook"], "status": row["webhook_status"],
        "attempts": row["webhook_attempts"], "last_status_code": row["webhook_last_status"]}
    return {"id": row["id"], "object": "job", "status": row["status"],
            "endpoint": row["endpoint"], "created_at": row["created_at"],
            "started_at": row["started_at"], "finished_at": row["finished_at"],
            "request_id": row["request_id"],
            "result": None if row["result"] is None else json.loads(row["result"]),
            "error": None if row["error"] is None else json.loads(row["error"]),
            "metadata": None if row["metadata"] is None else json.loads(row["metadata"]),
            "webhook": webhook}


def key_secret(master: bytes, key_id: str | None) -> str:
    """The webhook secret of API key ``key_id`` (None: keys are off), ``whsec_`` + base64."""
    raw = hmac.new(master, f"webhook:{key_id or ''}".encode(), hashlib.sha256).digest()
    return "whsec_" + base64.b64encode(raw).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header of a Standard Webhooks delivery."""
    raw = base64.b64decode(secret.removeprefix("whsec_"))
    digest = hmac.new(raw, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def webhook_problem(url) -> str | None:
    """Why ``url`` cannot be a webhook, or None."""
    if not isinstance(url, str):
        return "must be a URL string"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http:// or https:// URL with a host"
    if len(url) > 2048:
        return "must be at most 2,048 characters"
    return None


def request_problems(body) -> list[tuple[str, str, object]]:
    """What is wrong with a ``POST /v1/jobs`` body besides its inner ``body``."""
    found = []
    if body.webhook is not None and (why := webhook_problem(body.webhook)):
        found.append(("webhook", why, body.webhook))
    meta = body.metadata or {}
    n, klen, vlen = MAX_METADATA
    if len(meta) > n or any(len(k) > klen or len(v) > vlen for k, v in meta.items()):
        found.append(("metadata", f"at most {n} entries, keys up to {klen} characters, values "
                      f"up to {vlen}", None))
    if body.body.get("stream"):
        found.append(("body.stream", "a job is not streamed; poll GET /v1/jobs/{id} or give a "
                      "webhook", body.body["stream"]))
    return found


def parse_body(endpoint: str, body: dict):
    """The job's inner body as its route's schema reads it (ValidationError as that route's)."""
    from serving.schemas import EditRequest, GenerateRequest, ImagesGenerationRequest

    schema = {"/v1/generate": GenerateRequest, "/v1/edit": EditRequest,
              "/v1/images/generations": ImagesGenerationRequest}[endpoint]
    return schema.model_validate(body)


@contextlib.contextmanager
def nested_errors():
    """422s about the inner body name its fields as ``body.<field>``."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    try:
        yield
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", "body", *err["loc"])}
                                      for err in e.errors(include_url=False)]) from None
    except RequestValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", "body", *err["loc"][1:])}
                                      for err in e.errors()]) from None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # a webhook answers itself, or fails
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def post(url: str, body: bytes, headers: dict, timeout_s: float) -> int | None:
    """POST ``body``; the status code, or None when no answer came."""
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with _OPENER.open(req, timeout=timeout_s) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError, ValueError):
        return None


class Jobs:
    """The jobs of one ingress replica: ``call(prepared, deadline, rid, key_id)`` runs a
    checked request on the generator."""

    def __init__(self, settings, app: str, files: OutputStore,
                 call: Callable[[Prepared, float, str | None, str | None], Awaitable]):
        self.s, self.app, self.files = settings, app, files
        self.db = JobStore(settings.jobs_db)
        self.owner = uuid.uuid4().hex
        self.call = call
        self.tasks: dict[str, asyncio.Task] = {}
        self._deliveries: set[asyncio.Task] = set()  # webhooks taken over (kept referenced)
        self.slots = asyncio.Semaphore(settings.max_running_jobs)
        given = settings.webhook_secret or os.environ.get(ENV_SECRET)
        self.master = given.encode() if given else self.db.master_secret()
        self.db.beat(self.owner)
        self._loop: asyncio.Task | None = None
        with contextlib.suppress(RuntimeError):  # built outside an event loop: on first use
            self.start()

    # ------------------------------------------------------------------ the API's operations
    async def submit(self, endpoint: str, prep: Prepared, key_id: str | None, base_url: str,
                     rid: str | None, webhook: str | None, metadata: dict | None) -> dict:
        self.start()
        if await asyncio.to_thread(self.db.active, self.app, key_id) >= self.s.max_active_jobs:
            raise ApiError(429, f"this API key has {self.s.max_active_jobs} jobs queued or "
                           "running (the serve arg max_active_jobs); wait for some to finish",
                           kind="rate_limit_exceeded", code="too_many_jobs",
                           headers={"Retry-After": str(self.s.retry_after_s)})
        row = await asyncio.to_thread(self.db.create, app=self.app, key_id=key_id,
                                      owner=self.owner, endpoint=endpoint, request_id=rid,
                                      webhook=webhook, metadata=metadata)
        t0 = time.monotonic()
        self.tasks[row["id"]] = asyncio.create_task(
            self._run(row["id"], prep, key_id, base_url, rid, t0))
        return public(row)

    async def get(self, job_id: str, key_id: str | None) -> dict:
        row = await asyncio.to_thread(self.db.get, job_id, self.app, key_id, True)
        if row is not None and row["status"] in ACTIVE and row["owner"] != self.owner:
            await asyncio.to_thread(self.db.reap)  # its owner may have stopped
            row = await asyncio.to_thread(self.db.get, job_id, self.app, key_id, True)
        if row is None:
            raise ApiError(404, f"no job {job_id!r} (jobs are kept for output_ttl_s after "
                           "they finish)", kind="not_found", param="job_id", code="job_not_found")
        return public(row)

    async def cancel(self, job_id: str, key_id: str | None) -> dict:
        """Cancel a queued or running job (its device time stops); a finished one is
        returned unchanged."""
        await self.get(job_id, key_id)  # 404 unless the caller's
        if await asyncio.to_thread(self.db.cancel, job_id) and job_id in self.tasks:
            self.tasks[job_id].cancel()  # another replica's job: its owner sees the row
        return await self.get(job_id, key_id)

    async def recent(self, key_id: str | None, limit: int, status: str | None) -> dict:
        self.start()
        rows = await asyncio.to_thread(self.db.recent, self.app, key_id, limit, status)
        return {"object": "list", "data": [public(r) for r in rows]}

    def secret(self, key_id: str | None) -> str:
        return key_secret(self.master, key_id)

    # ------------------------------------------------------------------ running
    async def _run(self, job_id: str, prep: Prepared, key_id, base_url, rid, t0: float) -> None:
        try:
            async with self.slots:
                if not await asyncio.to_thread(self.db.start, job_id):
                    return  # cancelled while queued
                deadline = t0 + self.s.job_timeout_s
                result = await self._call(prep, deadline, rid, key_id)
                data = await answer(prep, result, "url", self.files, base_url, key_id)
                await asyncio.to_thread(self.db.finish, job_id, "succeeded", data)
        except asyncio.CancelledError:  # a DELETE (the row says so already) or shutdown
            await asyncio.to_thread(self.db.finish, job_id, "failed", None, interrupted())
        except ApiError as e:
            await asyncio.to_thread(self.db.finish, job_id, "failed", None, error_body(
                e.status, e.message, e.kind, e.param, code=e.code, request_id=rid))
        except Exception as e:
            logger.error("job %s failed: %s: %s", job_id, type(e).__name__, e)
            await asyncio.to_thread(self.db.finish, job_id, "failed", None, error_body(
                500, internal_message(rid), "server_error", request_id=rid))
        finally:
            self.tasks.pop(job_id, None)
        await self.deliver(job_id)

    async def _call(self, prep: Prepared, deadline: float, rid: str | None,
                    key_id: str | None):
        """The generator's result; a full queue (503) is waited out until the deadline."""
        while True:
            try:
                return await self.call(prep, deadline, rid, key_id)
            except ApiError as e:
                wait = self.s.retry_after_s
                if e.status != 503 or time.monotonic() + wait >= deadline:
                    raise
                await asyncio.sleep(wait)

    async def deliver(self, job_id: str) -> None:
        """POST the finished job to its webhook, retried with doubling pauses."""
        row = await asyncio.to_thread(self.db.get, job_id)
        if row is None or row["webhook"] is None or row["webhook_status"] != "pending":
            return
        body = json.dumps(public(row)).encode()
        secret = self.secret(row["key_id"])
        tries = self.s.webhook_retries + 1
        for attempt in range(1, tries + 1):
            ts = int(time.time())
            headers = {"Content-Type": "application/json", "User-Agent": "maxdiff-webhooks",
                       "webhook-id": job_id, "webhook-timestamp": str(ts),
                       "webhook-signature": sign(secret, job_id, ts, body)}
            status = await asyncio.to_thread(post, row["webhook"], body, headers,
                                             self.s.webhook_timeout_s)
            ok = status is not None and 200 <= status < 300
            state = "delivered" if ok else ("failed" if attempt == tries else "pending")
            await asyncio.to_thread(self.db.webhook_state, job_id, state, attempt, status)
            if ok or attempt == tries:
                if not ok:
                    logger.warning("job %s: webhook gave up after %d tries (last: %s)", job_id,
                                   tries, status)
                return
            await asyncio.sleep(self.s.webhook_backoff_s * 2 ** (attempt - 1))

    # ------------------------------------------------------------------ upkeep
    def start(self) -> None:
        """Start the upkeep loop (heartbeat, cancellations, interrupted jobs, expiry) once an
        event loop runs this replica's requests."""
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._upkeep())

    async def _upkeep(self) -> None:
        last_sweep = last_files = -1e9
        while True:
            try:
                await asyncio.to_thread(self.db.beat, self.owner)
                mine = list(self.tasks)
                states = await asyncio.to_thread(self.db.statuses, mine)
                for job_id in mine:  # cancelled through another replica
                    if states.get(job_id) in DONE and job_id in self.tasks:
                        self.tasks[job_id].cancel()
                if time.monotonic() - last_sweep > SWEEP_S:
                    last_sweep = time.monotonic()
                    await self.sweep()
                if time.monotonic() - last_files > FILES_SWEEP_S:
                    last_files = time.monotonic()
                    await self.expire()
            except Exception as e:  # a locked or vanished database: try again
                logger.warning("jobs upkeep: %s: %s", type(e).__name__, e)
            await asyncio.sleep(HEARTBEAT_S)

    async def sweep(self) -> None:
        """Interrupted jobs failed, their pending webhooks taken over."""
        await asyncio.to_thread(self.db.reap)
        for job_id in await asyncio.to_thread(self.db.orphaned_webhooks, self.owner):
            self._deliveries.add(task := asyncio.create_task(self.deliver(job_id)))
            task.add_done_callback(self._deliveries.discard)

    async def expire(self) -> None:
        """Expired files and finished jobs older than ``output_ttl_s`` removed."""
        await asyncio.to_thread(self.files.sweep)
        if self.s.output_ttl_s is not None:
            await asyncio.to_thread(self.db.expire, time.time() - self.s.output_ttl_s)

    def close(self) -> None:
        """This replica stops: its active jobs are failed (interrupted) now, not after the
        owner timeout."""
        if self._loop is not None:
            self._loop.cancel()
        for task in self.tasks.values():
            task.cancel()
        with contextlib.suppress(Exception):
            self.db.leave(self.owner)
