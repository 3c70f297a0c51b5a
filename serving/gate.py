"""The ingress's ASGI gate: request ids, API keys, rate limits, body limits, metrics.

Its settings live in :data:`serving.security.GATE`, set by the Ingress constructor (one ingress
per replica process). Not in a dict of the app's module: Ray Serve pickles the ingress class by
value, globals included, so such a dict would be a copy the gate never sees."""

from __future__ import annotations

import logging
import time
import traceback

from fastapi.responses import JSONResponse

from serving import security
from serving.errors import error_body, internal_message

logger = logging.getLogger("ray.serve")

EDIT_ROUTES = ("/v1/images/edits", "/v1/edit")  # body limit: max_image_bytes, not max_body_bytes
CONTROL_ROUTES = ("/v1/generate",)  # max_image_bytes too where ControlNets are loaded
PROMPT_ROUTES = ("/v1/images/generations",)  # ... and where an IP-Adapter is (image prompts)
JOB_ROUTES = ("/v1/jobs",)  # a job's body may be an edit's: always max_image_bytes
FILES = "/v1/files/"  # links to stored images: 128 random bits each, open without a key
# routes open without an API key
OPEN = ("/healthz", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc")


class Gate:
    """ASGI middleware: give every request an id (``X-Request-Id``, the client's if plain);
    check API keys and per-key rate limits on the ``/v1/`` routes (401, 429); refuse bodies over
    ``max_body_bytes`` (``max_image_bytes`` on the edit routes, and on ``/v1/generate`` where
    ControlNets are loaded: control images; declared Content-Length or bytes
    actually received, chunked uploads included) with a 413; answer an exception that escaped
    the app with a 500 error body (the traceback goes to the log, never to the client); count
    requests per route and status in Prometheus metrics."""

    ROUTES = ("/v1/images/generations", "/v1/images/edits", "/v1/generate", "/v1/edit",
              "/healthz", "/v1/models", "/v1/stats", "/v1/jobs", "/v1/files", "/v1/usage")

    def __init__(self, app):
        self.app = app
        self._metrics = None

    def _observe(self, path: str, status: int, seconds: float) -> None:
        try:
            if self._metrics is None:
                from ray.serve import metrics

                self._metrics = (
                    metrics.Counter("maxdiff_http_requests", "HTTP requests by route and status.",
                                    tag_keys=("route", "status")),
                    metrics.Histogram("maxdiff_http_latency_s", "HTTP request latency by route.",
                                      [0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300],
                                      tag_keys=("route",)))
            route = next((r for r in self.ROUTES if path.endswith(r)), None) or next(
                (r for r in ("/v1/jobs", "/v1/files") if f"{r}/" in path), "other")
            self._metrics[0].inc(tags={"route": route, "status": str(status)})
            self._metrics[1].observe(seconds, tags={"route": route})
        except Exception:  # metrics must never fail a request (e.g. outside a Ray worker)
            pass

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = {"code": 500, "started": False}
        headers = dict(scope.get("headers") or [])
        rid = security.request_id(headers.get(b"x-request-id", b"").decode("latin-1"))
        scope = {**scope, "state": {**(scope.get("state") or {}), "request_id": rid}}

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                status["started"] = True
                if b"x-request-id" not in headers:  # else Ray Serve's proxy echoes it
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"x-request-id", rid.encode())]}
            await send(message)

        def reply(code: int, message: str, kind: str, extra_headers=None, err_code=None):
            body = error_body(code, message, kind, code=err_code, request_id=rid)
            return JSONResponse(body, code, headers=extra_headers)(scope, receive, send_status)

        try:
            path = scope.get("path", "")
            if "/v1/" in path and not path.endswith(OPEN) and FILES not in path:
                denied = self._admit(headers, scope)
                if denied is not None:
                    return await reply(*denied)
            images = security.GATE.get("image_routes", EDIT_ROUTES) + JOB_ROUTES
            arg = "max_image_bytes" if path.endswith(tuple(images)) else "max_body_bytes"
            limit = security.GATE[arg]
            declared = headers.get(b"content-length")
            too_big = (413, f"request body is larger than {limit} bytes (the serve arg {arg})",
                       "request_too_large")
            if declared is not None:
                if not declared.strip().isdigit():
                    return await reply(400, "bad Content-Length header", "invalid_request_error")
                if int(declared) > limit:
                    return await reply(*too_big)
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body = message.get("body", b"")
                size += len(body)
                if size > limit:
                    return await reply(*too_big)
                chunks.append(body)
                if not message.get("more_body"):
                    break
            body = b"".join(chunks)
            scope = _as_json(scope, headers, body)
            replay = [{"type": "http.request", "body": body, "more_body": False}]

            async def replay_receive():
                return replay.pop() if replay else await receive()

            await self.app(scope, replay_receive, send_status)
        except Exception:
            if status["started"]:  # the 500 body is already out (the app's handler sent it)
                return
            logger.error("request %s failed:\n%s", rid, traceback.format_exc())
            await reply(500, internal_message(rid), "server_error")
        finally:
            self._observe(scope.get("path", ""), status["code"], time.perf_counter() - t0)

    @staticmethod
    def _admit(headers: dict, scope: dict):
        """None, or (status, message, kind, headers, code) refusing the request."""
        hashes, limiter = security.GATE["key_hashes"], security.GATE["limiter"]
        client = None
        if hashes:
            token = security.bearer_token(headers.get(b"authorization", b"").decode("latin-1"))
            client = security.check_key(token, hashes)
            scope["state"]["key_id"] = security.key_id(client)
            if client is None:
                why = ("no API key given: send 'Authorization: Bearer YOUR_KEY' (the openai "
                       "client's api_key)" if token is None else "incorrect API key")
                return (401, why, "invalid_request_error", {"WWW-Authenticate": "Bearer"},
                        "invalid_api_key")
        if limiter is not None:
            who = client or f"addr:{(scope.get('client') or ('?',))[0]}"
            wait = limiter.take(who)
            if wait > 0:
                after = security.RateLimiter.retry_after(wait)
                return (429, f"rate limit reached ({limiter.capacity:g} requests a minute); "
                        f"retry after {after} s", "rate_limit_exceeded",
                        {"Retry-After": str(after)}, "rate_limit_exceeded")
        return None


def media_type(content_type: str | bytes) -> str:
    """A Content-Type header's media type: lowercased, without its parameters."""
    if isinstance(content_type, bytes):
        content_type = content_type.decode("latin-1")
    return content_type.split(";")[0].strip().lower()


def is_json_type(kind: str) -> bool:
    """Whether a media type (:func:`media_type`) declares JSON: ``application/json`` or an
    ``application/...+json`` type (RFC 6839). The one rule the gate and the routes read bodies
    by."""
    return kind == "application/json" or (kind.startswith("application/")
                                          and kind.endswith("+json"))


def _as_json(scope: dict, headers: dict, body: bytes) -> dict:
    """A POST body that is a JSON object is read as JSON whatever Content-Type declares
    (``curl -d`` sends ``application/x-www-form-urlencoded``; many clients send none)."""
    declared = media_type(headers.get(b"content-type", b""))
    if scope.get("method") != "POST" or is_json_type(declared) or declared.startswith(
            "multipart/") or not body.lstrip().startswith(b"{"):
        return scope
    rest = [(k, v) for k, v in scope.get("headers") or [] if k.lower() != b"content-type"]
    return {**scope, "headers": [*rest, (b"content-type", b"application/json")]}
