"""The jobs database (:class:`JobStore`): every job's row, the heartbeats of the ingress
replicas that own them and the server's webhook secret, in SQLite (serve arg ``jobs_db``; WAL
mode, so several ingress processes on one host share it). A job belongs to the ingress replica
that accepted it (its ``owner``), which beats a heartbeat into the database; jobs of an owner
that stopped are marked failed (``job_interrupted``) by the next replica that looks
(:meth:`JobStore.reap`). Light: never imports JAX.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
import uuid

from serving.errors import error_body
from serving.storage import cache_path

OWNER_TIMEOUT_S = 30.0  # an owner silent this long has stopped: its active jobs failed

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, app TEXT NOT NULL, key_id TEXT, owner TEXT NOT NULL,
    status TEXT NOT NULL, endpoint TEXT NOT NULL, request_id TEXT,
    created_at REAL NOT NULL, started_at REAL, finished_at REAL,
    result TEXT, error TEXT, metadata TEXT,
    webhook TEXT, webhook_status TEXT, webhook_attempts INTEGER NOT NULL DEFAULT 0,
    webhook_last_status INTEGER);
CREATE INDEX IF NOT EXISTS jobs_by_key ON jobs (app, key_id, created_at);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, owner);
CREATE TABLE IF NOT EXISTS owners (owner TEXT PRIMARY KEY, seen REAL NOT NULL);
CREATE TABLE IF NOT EXISTS secrets (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def default_path() -> str:
    return cache_path("jobs.sqlite")


def open_db(path: str, schema: str) -> tuple[sqlite3.Connection, threading.Lock]:
    """The service database at ``path`` (autocommit, WAL: several processes on one host share
    it) with ``schema`` applied, and the lock its one connection is used under."""
    db = sqlite3.connect(path, timeout=30, check_same_thread=False, isolation_level=None)
    lock = threading.Lock()
    with lock:
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(schema)
    return db, lock


def interrupted() -> dict:
    return error_body(500, "the service stopped while this job was queued or running; submit "
                      "it again", "server_error", code="job_interrupted")


class JobStore:
    """The jobs database at ``path`` (created with its folder). Every method is blocking; the
    ingress calls them in a thread (one connection, one lock)."""

    def __init__(self, path: str | None):
        self.path = path or default_path()
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._db, self._lock = open_db(self.path, _SCHEMA)
        self._db.row_factory = sqlite3.Row

    def _exec(self, sql: str, args=()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _change(self, sql: str, args=()) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    def create(self, *, app: str, key_id: str | None, owner: str, endpoint: str,
               request_id: str | None, webhook: str | None, metadata: dict | None) -> dict:
        job_id = f"job_{uuid.uuid4().hex}"
        self._change(
            "INSERT INTO jobs (id, app, key_id, owner, status, endpoint, request_id, created_at,"
            " metadata, webhook, webhook_status) VALUES (?, ?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?)",
            (job_id, app, key_id, owner, endpoint, request_id, time.time(),
             None if metadata is None else json.dumps(metadata), webhook,
             None if webhook is None else "pending"))
        return self.get(job_id)

    def get(self, job_id: str, app: str | None = None, key_id: str | None = None,
            check_key: bool = False) -> dict | None:
        """The job's row, or None (also when it is another application's, or with
        ``check_key`` another API key's)."""
        rows = self._exec("SELECT * FROM jobs WHERE id = ?", (job_id,))
        if not rows:
            return None
        row = dict(rows[0])
        if app is not None and row["app"] != app or check_key and row["key_id"] != key_id:
            return None
        return row

    def recent(self, app: str, key_id: str | None, limit: int, status: str | None) -> list[dict]:
        sql, args = "SELECT * FROM jobs WHERE app = ? AND key_id IS ?", [app, key_id]
        if status is not None:
            sql, args = sql + " AND status = ?", [*args, status]
        return [dict(r) for r in self._exec(sql + " ORDER BY created_at DESC LIMIT ?",
                                            (*args, limit))]

    def active(self, app: str, key_id: str | None) -> int:
        return self._exec("SELECT COUNT(*) FROM jobs WHERE app = ? AND key_id IS ? AND status "
                          "IN ('queued', 'running')", (app, key_id))[0][0]

    def start(self, job_id: str) -> bool:
        """queued -> running; False when it is no longer queued (cancelled)."""
        return self._change("UPDATE jobs SET status = 'running', started_at = ? WHERE id = ? "
                            "AND status = 'queued'", (time.time(), job_id)) == 1

    def finish(self, job_id: str, status: str, result: dict | None = None,
               error: dict | None = None) -> bool:
        """An active job -> ``status``; False when it had ended already (cancelled)."""
        return self._change(
            "UPDATE jobs SET status = ?, finished_at = ?, result = ?, error = ? WHERE id = ? "
            "AND status IN ('queued', 'running')",
            (status, time.time(), None if result is None else json.dumps(result),
             None if error is None else json.dumps(error), job_id)) == 1

    def cancel(self, job_id: str) -> bool:
        return self.finish(job_id, "cancelled")

    def webhook_state(self, job_id: str, state: str, attempts: int, last: int | None) -> None:
        self._change("UPDATE jobs SET webhook_status = ?, webhook_attempts = ?, "
                     "webhook_last_status = ? WHERE id = ?", (state, attempts, last, job_id))

    def beat(self, owner: str) -> None:
        self._change("INSERT INTO owners (owner, seen) VALUES (?, ?) ON CONFLICT(owner) DO "
                     "UPDATE SET seen = excluded.seen", (owner, time.time()))

    def leave(self, owner: str) -> int:
        """An owner stopping: its active jobs failed (interrupted), its heartbeat gone."""
        n = self._change("UPDATE jobs SET status = 'failed', finished_at = ?, error = ? WHERE "
                         "owner = ? AND status IN ('queued', 'running')",
                         (time.time(), json.dumps(interrupted()), owner))
        self._change("DELETE FROM owners WHERE owner = ?", (owner,))
        return n

    def reap(self, now: float | None = None) -> int:
        """Fail the active jobs of owners silent for OWNER_TIMEOUT_S (or never seen)."""
        now = time.time() if now is None else now
        return self._change(
            "UPDATE jobs SET status = 'failed', finished_at = ?, error = ? WHERE status IN "
            "('queued', 'running') AND owner NOT IN (SELECT owner FROM owners WHERE seen > ?)",
            (now, json.dumps(interrupted()), now - OWNER_TIMEOUT_S))

    def orphaned_webhooks(self, owner: str, now: float | None = None) -> list[str]:
        """Claim the undelivered webhooks of finished jobs whose owners stopped; their ids."""
        now = time.time() if now is None else now
        rows = self._exec("SELECT id FROM jobs WHERE webhook_status = 'pending' AND status IN "
                          "('succeeded', 'failed', 'cancelled') AND owner NOT IN (SELECT owner "
                          "FROM owners WHERE seen > ?)", (now - OWNER_TIMEOUT_S,))
        claimed = []
        for r in rows:
            if self._change("UPDATE jobs SET owner = ? WHERE id = ? AND owner NOT IN (SELECT "
                            "owner FROM owners WHERE seen > ?)",
                            (owner, r["id"], now - OWNER_TIMEOUT_S)) == 1:
                claimed.append(r["id"])
        return claimed

    def statuses(self, ids: list[str]) -> dict[str, str]:
        if not ids:
            return {}
        marks = ",".join("?" * len(ids))
        return {r["id"]: r["status"] for r in self._exec(
            f"SELECT id, status FROM jobs WHERE id IN ({marks})", ids)}

    def expire(self, before: float) -> int:
        """Forget jobs that finished before ``before`` (their files expire with the store)."""
        return self._change("DELETE FROM jobs WHERE status IN ('succeeded', 'failed', "
                            "'cancelled') AND finished_at < ? AND (webhook_status IS NULL OR "
                            "webhook_status != 'pending')", (before,))

    def master_secret(self) -> bytes:
        """The server's webhook secret kept in the database (made on first use)."""
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO secrets (name, value) VALUES ('webhook', ?)",
                             (secrets.token_hex(32),))
            row = self._db.execute("SELECT value FROM secrets WHERE name = 'webhook'").fetchone()
        return bytes.fromhex(row[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
