"""Finished images in storage: the serve arg ``output_store`` (an fsspec URL) and the links the
APIs answer with ``response_format: "url"`` and in jobs' results (:mod:`serving.jobs`).

Each image is two objects under the store's root: ``<id>.<ext>`` (the encoded file) and
``<id>.json`` (its metadata: media type, expiry, model, seed, the API key's id), written in
that order; the metadata is the commit mark. An image whose metadata is missing was never
finished (its writer died): it is never served, nor linked (a link is made only after both
writes returned), and :meth:`OutputStore.sweep` removes it. On a local folder each object is
written to a temporary name and renamed into place (atomic on POSIX); on object stores
(``s3://``, ``gs://``, ...) each is one PUT, which is atomic there.

Ids are 128 random bits: a link is a capability, as presigned URLs are. ``GET /v1/files/<id>.<ext>``
serves the file without an API key until it expires; stores that sign URLs (S3 with s3fs, GCS with
gcsfs) answer presigned links to the store itself instead, valid as long. Expired files are
removed by the ingress's periodic sweep. Light: never imports JAX.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
import uuid
from dataclasses import dataclass

MEDIA = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
FILE_NAME = re.compile(r"^([0-9a-f]{32})\.(png|jpeg|webp)$")
# presigned URLs of S3 (SigV4) last at most 7 days
MAX_SIGNED_S = 7 * 24 * 3600


def cache_path(name: str) -> str:
    """``name`` in maxdiff's cache folder (``$XDG_CACHE_HOME/maxdiff``, else ``~/.cache``):
    where the service keeps its state when no path is given."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "maxdiff", name)


def default_root() -> str:
    """The local folder images go to when ``output_store`` is not given."""
    return cache_path("outputs")


@dataclass(frozen=True)
class Stored:
    """One stored image: ``name`` is ``<id>.<ext>``; ``expires_at`` unix seconds (None: never)."""

    name: str
    media_type: str
    expires_at: float | None


class OutputStore:
    """Images and their metadata under fsspec URL ``url``; ``ttl_s``: how long each stays
    (None: until someone deletes it); ``sign``: answer presigned links where the store can
    make them (else links to ``/v1/files/``); ``options``: the fsspec filesystem's."""

    def __init__(self, url: str | None, ttl_s: float | None = 3600.0, sign: bool = True,
                 options: dict | None = None):
        import fsspec

        self.url = url or default_root()
        self.fs, root = fsspec.core.url_to_fs(self.url, **(options or {}))
        self.root = root.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.local = "file" in protocols or "local" in protocols
        self.ttl_s = ttl_s
        self.sign = sign
        if self.local:
            os.makedirs(self.root, exist_ok=True)

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _write(self, name: str, data: bytes) -> None:
        if self.local:  # a temporary name, flushed, then renamed into place
            tmp = self._path(f".{name}.{uuid.uuid4().hex}.partial")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(name))
        else:  # one PUT: an object store makes it visible whole or not at all
            self.fs.pipe_file(self._path(name), data)

    def put(self, blob: bytes, fmt: str, meta: dict | None = None) -> Stored:
        """Store one encoded image (``fmt``: png, jpeg or webp) with ``meta`` (JSON-able)."""
        file_id = secrets.token_hex(16)
        name = f"{file_id}.{fmt}"
        now = time.time()
        expires = None if self.ttl_s is None else now + self.ttl_s
        record = {"name": name, "media_type": MEDIA[fmt], "bytes": len(blob), "created_at": now,
                  "expires_at": expires, **(meta or {})}
        self._write(name, blob)
        self._write(f"{file_id}.json", json.dumps(record).encode())
        return Stored(name, MEDIA[fmt], expires)

    def _record(self, file_id: str) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(self._path(f"{file_id}.json")))
        except (FileNotFoundError, ValueError, OSError):
            return None

    def read(self, name: str, now: float | None = None) -> tuple[bytes, str] | None:
        """(bytes, media type) of a finished, unexpired image named ``<id>.<ext>``, else None."""
        m = FILE_NAME.match(name)
        if m is None:
            return None
        record = self._record(m.group(1))
        if record is None or record.get("name") != name:
            return None
        expires = record.get("expires_at")
        if expires is not None and expires <= (time.time() if now is None else now):
            return None
        try:
            return self.fs.cat_file(self._path(name)), record["media_type"]
        except (FileNotFoundError, OSError):
            return None

    def link(self, stored: Stored, base_url: str) -> str:
        """Where a client downloads ``stored``: a presigned URL of the store where it signs
        them (and ``sign`` is on), else ``<base_url>/v1/files/<name>``."""
        if self.sign and not self.local:
            left = MAX_SIGNED_S if stored.expires_at is None else stored.expires_at - time.time()
            try:
                return self.fs.sign(self._path(stored.name),
                                    expiration=int(max(1, min(left, MAX_SIGNED_S))))
            except (NotImplementedError, AttributeError):
                pass
        return f"{base_url.rstrip('/')}/v1/files/{stored.name}"

    def sweep(self, now: float | None = None, orphan_after_s: float = 3600.0) -> int:
        """Remove expired images and their metadata, and pieces of unfinished writes older than
        ``orphan_after_s``; returns how many objects went. Safe to run from several processes."""
        now = time.time() if now is None else now
        self.fs.invalidate_cache(self.root)  # object stores cache listings; others write
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return 0
        names = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries}
        gone = []
        for name in names:
            base = name.rsplit(".", 1)[0]
            if name.endswith(".json"):
                record = self._record(base)
                expires = (record or {}).get("expires_at")
                if record is not None and expires is not None and expires <= now:
                    gone += [record.get("name", ""), name]  # the image first: never a bare image
            elif FILE_NAME.match(name) and f"{base}.json" not in names \
                    or name.endswith(".partial"):
                if now - _mtime(names[name]) > orphan_after_s:
                    gone.append(name)
        removed = 0
        for name in gone:
            if not name:
                continue
            try:
                self.fs.rm_file(self._path(name))
                removed += 1
            except (FileNotFoundError, OSError):
                pass  # another sweeper got there first
        return removed


def _mtime(entry: dict) -> float:
    """An ``fs.ls`` entry's modification time in unix seconds (0 when the store gives none)."""
    for key in ("mtime", "LastModified", "updated", "created"):
        v = entry.get(key)
        if v is None:
            continue
        if hasattr(v, "timestamp"):
            return v.timestamp()
        try:
            return float(v)
        except (TypeError, ValueError):
            continue
    return 0.0
