"""API keys, per-key rate limits and request ids for the ingress (no JAX, no Ray).

Keys come from the ``api_keys`` serve arg (a list of keys, or the path of a file) or, when that
is not given, from the file named by ``MAXDIFF_API_KEYS``. A key file holds one entry a line
(blank lines and ``#`` comments skipped); an entry is a key itself or ``sha256:<64 hex digits>``,
the SHA-256 of a key (so the file need not hold the secret: ``printf %s KEY | sha256sum``).
Only hashes are kept in memory; a presented key is hashed and compared with every stored hash in
constant time (``hmac.compare_digest``), so timing does not tell how close a guess was.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ENV_KEYS = "MAXDIFF_API_KEYS"
# What the ingress's ASGI gate enforces in this process (set by the Ingress constructor).
# ``image_routes``: the routes whose body limit is max_image_bytes (they carry images): the edit
# routes, and /v1/generate on a server that loaded ControlNets (control images)
GATE: dict = {"max_body_bytes": 65536, "max_image_bytes": 20 * 2**20, "key_hashes": None,
              "limiter": None, "image_routes": ("/v1/images/edits", "/v1/edit")}
_HASHED = re.compile(r"^sha256:([0-9a-fA-F]{64})$")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _entries(values) -> list[str]:
    """Key entries: blank lines, ``#`` lines and `` #`` comments after an entry dropped."""
    out = []
    for v in values:
        v = str(v).split(" #", 1)[0].strip()
        if v and not v.startswith("#"):
            out.append(v)
    return out


def _read_key_file(path: Path, origin: str) -> list[str]:
    try:
        return _entries(path.read_text(encoding="utf-8").splitlines())
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{origin}: cannot read the key file {path} ({type(e).__name__})") from None


@dataclass(frozen=True)
class KeyPolicy:
    """What one API key may do: its ``priority`` class (higher goes first when requests wait;
    0 by default) and its quotas per UTC day (None: none)."""

    priority: int = 0
    images_per_day: int | None = None
    device_seconds_per_day: float | None = None


_POLICY_FIELDS = {"priority": int, "images_per_day": int, "device_seconds_per_day": float}


def _policy(words: list[str], where: str) -> KeyPolicy:
    """A key entry's ``name=value`` words as its policy; a ValueError naming the entry."""
    given = {}
    for word in words:
        name, eq, value = word.partition("=")
        if not eq or name not in _POLICY_FIELDS:
            raise ValueError(f"{where}: {word!r} is not a key setting; give "
                             f"{', '.join(f'{k}=N' for k in _POLICY_FIELDS)}")
        try:
            given[name] = _POLICY_FIELDS[name](value)
        except ValueError:
            raise ValueError(f"{where}: {name}={value!r} is not a number") from None
        if name != "priority" and given[name] < 0:
            raise ValueError(f"{where}: {name} must be >= 0, got {value}")
    return KeyPolicy(**given)


def load_keys(api_keys=None, environ=None) -> dict[str, KeyPolicy] | None:
    """The accepted keys' SHA-256 hex digests and their policies, or None when keys are off.

    ``api_keys``: None (then ``MAXDIFF_API_KEYS``), a list of entries, or one string that is a
    file's path (if such a file exists) or a single entry. An entry is a key or
    ``sha256:<hex>``, then optionally ``priority=N``, ``images_per_day=N``,
    ``device_seconds_per_day=N`` separated by spaces."""
    environ = os.environ if environ is None else environ
    if api_keys is None:
        path = environ.get(ENV_KEYS)
        if not path:
            return None
        entries = _read_key_file(Path(path), ENV_KEYS)
        origin = f"{ENV_KEYS} file {path}"
    else:
        items = [api_keys] if isinstance(api_keys, str) else list(api_keys)
        if len(items) == 1 and Path(str(items[0])).is_file():
            entries = _read_key_file(Path(str(items[0])), "api_keys")
            origin = f"api_keys file {items[0]}"
        else:
            entries, origin = _entries(items), "api_keys"
    keys: dict[str, KeyPolicy] = {}
    for n, entry in enumerate(entries, 1):
        e, *words = entry.split()
        m = _HASHED.match(e)
        if e.startswith("sha256:") and not m:
            raise ValueError(f"{origin}: 'sha256:' must be followed by 64 hex digits")
        if not m and len(e) < 8:
            raise ValueError(f"{origin}: an API key must have at least 8 characters")
        digest = m.group(1).lower() if m else hash_key(e)
        keys.setdefault(digest, _policy(words, f"{origin}, entry {n} ({key_id(digest)})"))
    if not keys:
        raise ValueError(f"{origin}: no keys in it (one key or sha256:<hex> a line)")
    return keys


def load_key_hashes(api_keys=None, environ=None) -> tuple[str, ...] | None:
    """SHA-256 hex digests of the accepted keys (:func:`load_keys`), or None when keys are off."""
    keys = load_keys(api_keys, environ)
    return None if keys is None else tuple(keys)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, if any."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def check_key(token: str | None, hashes: tuple[str, ...]) -> str | None:
    """The matching key's hash, or None; compares against every hash in constant time."""
    if token is None:
        return None
    digest = hash_key(token).encode()
    found = None
    for h in hashes:
        if hmac.compare_digest(digest, h.encode()):
            found = h
    return found


def key_id(key_hash: str | None) -> str | None:
    """A key's public id (jobs, usage, logs): ``key_`` and the first 12 hex digits of its hash;
    None when keys are off."""
    return None if key_hash is None else f"key_{key_hash[:12]}"


class RateLimiter:
    """A token bucket per client: ``per_minute`` requests a minute, bursts up to that many."""

    def __init__(self, per_minute: float, clock=time.monotonic):
        self.rate = per_minute / 60.0
        self.capacity = max(per_minute, 1.0)
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}

    def take(self, client: str) -> float:
        """0 if the request may go now (and counts it), else the seconds until it may."""
        now = self.clock()
        tokens, at = self._buckets.get(client, (self.capacity, now))
        tokens = min(self.capacity, tokens + (now - at) * self.rate)
        if tokens >= 1.0:
            self._buckets[client] = (tokens - 1.0, now)
            if len(self._buckets) > 100_000:  # forget the oldest clients, bounded memory
                for k in list(self._buckets)[:50_000]:
                    del self._buckets[k]
            return 0.0
        self._buckets[client] = (tokens, now)
        return (1.0 - tokens) / self.rate

    @staticmethod
    def retry_after(seconds: float) -> int:
        return max(1, math.ceil(seconds))


def request_id(given: str | None) -> str:
    """The client's ``X-Request-Id`` when it is short and plain, else a fresh one."""
    if given and _REQUEST_ID.match(given):
        return given
    return uuid.uuid4().hex
