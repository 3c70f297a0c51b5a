"""The Ray Serve application: a FastAPI ingress in front of the generator deployment.

    serve run serving.app:build_app model=/models/sdxl config=sdxl-base max_batch_size=8
    serve run configs/serve.yaml

The ingress validates every request (422 with the offending field, 413 for bodies over
``max_body_bytes``, or ``max_image_bytes`` on the edit routes), turns it into a :class:`pipelines.requests.GenerationRequest`, sends it to a generator
replica through a deployment handle and encodes the images it gets back. A full generator queue
(``max_queued_requests``) is a 503 with ``Retry-After``; a request past its deadline
(``request_timeout_s``, or a shorter ``X-Request-Timeout`` header) is a 504. A request whose
generator replica dies is retried once on another replica (same seeds, same images), else a 503.
Every response carries ``X-Request-Id``; every error body is ``{"error": {...}}`` with that id.
With API keys on (``api_keys`` / ``MAXDIFF_API_KEYS``) the ``/v1/`` routes need
``Authorization: Bearer KEY`` (401 otherwise) and ``rate_limit_per_minute`` bounds each key (429).

Endpoints (OpenAPI at ``/docs``): ``GET /`` (the web playground, ``serving/playground.html``),
``POST /v1/images/generations`` (OpenAI Images API),
``POST /v1/images/edits`` (OpenAI Images API edits, multipart), ``POST /v1/generate`` (native),
``POST /v1/edit`` (native image-to-image and inpainting, JSON), ``GET /healthz``, ``GET /v1/models``, ``GET /v1/stats``.

Streaming (both engines; only ``engine=step`` has steps and partial images to send):
``"stream": true`` on
``/v1/images/generations`` answers Server-Sent Events in the OpenAI Images API format
(``image_generation.partial_image`` events for ``partial_images``, then
``image_generation.completed``); on ``/v1/generate``, ``progress`` events, ``partial_image``
events, then ``result`` (the route's JSON response). An error after the stream has started is an
``error`` event with the usual error body. A client that disconnects cancels its image (its
step-engine slot is freed at the next tick).
"""


import asyncio
import base64
import functools
import json
import logging
import math
import time
import traceback
from pathlib import Path
from typing import Any

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from pipelines.limits import STRENGTH, Limits, field_name, problems
from pipelines.requests import (EditRequest, GenerationRequest, decode_image, encode_image,
                                image_info, parse_size, repaint_mask)
from serving import security
from serving.generator import Expired, Generator, InvalidJob, StatsBoard
from serving.schemas import (ERROR_RESPONSES, EditRequest as EditBody, EditResponse, ErrorResponse,
                             GenerateRequest, GenerateResponse, ImageFormat,
                             ImagesGenerationRequest, ImagesResponse, JobResult, ServeSettings)

logger = logging.getLogger("ray.serve")

DEFAULT_MAX_SIZE = 2048  # pixels per side when neither the serve args nor the model say
GENERATOR = "Generator"
# How the ingress's router retries a request while every generator replica is at
# max_ongoing_requests: Ray Serve's default backs off to 0.5 s between tries and a finished request
# does not wake the waiting ones, so with 8-image batches of 0.1 s (or a step engine freeing a
# slot per image) the devices sat idle between tries (LoadGen Offline, embedded model: 5 images/s
# through engine=step against 61 in-process). Tries are cheap: two queue-length probes.
ROUTER_BACKOFF = {"initial_backoff_s": 0.005, "backoff_multiplier": 2, "max_backoff_s": 0.05}
INGRESS = "Ingress"
TIMEOUT_HEADER = "X-Request-Timeout"
EDIT_ROUTES = ("/v1/images/edits", "/v1/edit")  # body limit: max_image_bytes, not max_body_bytes


class ApiError(Exception):
    """An HTTP error with a message for the client (rendered as ``{"error": {...}}``)."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


def _error_body(status: int, message: str, kind: str, param: str | None = None, *,
                code: str | int | None = None, request_id: str | None = None) -> dict:
    # `error` is the OpenAI error shape (the openai client reads it); `detail` is FastAPI's.
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": status if code is None else code, "request_id": request_id},
            "detail": message}


def _rid(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def invalid(field: str, message: str, value: Any = None, where: str = "body"):
    """A 422 naming ``field``, in FastAPI's validation-error format."""
    return invalid_all([(field, message, value)], where)


def invalid_all(errors: list[tuple[str, str, Any]], where: str = "body"):
    """A 422 naming every (field, message, value) of ``errors``."""
    return RequestValidationError([{"type": "value_error", "loc": (where, f), "msg": m,
                                    "input": v} for f, m, v in errors])


api = FastAPI(
    title="maxdiff",
    summary="SDXL-family text-to-image over HTTP (JAX on Ray Serve).",
    description="`POST /v1/images/generations` speaks the OpenAI Images API (point the "
                "`openai` client's `base_url` here); `POST /v1/generate` exposes every setting "
                "and reports seeds and timings. Requests that share size, steps and CFG on/off "
                "are batched onto the accelerators together.",
    version="0.1.0",
)
# The gate's settings live in serving.security.GATE, set by the Ingress constructor (one
# ingress per replica process). Not in a dict of this module: Ray Serve pickles the ingress
# class by value, globals included, so such a dict would be a copy the gate never sees.
_OPEN = ("/healthz", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc")


class _Gate:
    """ASGI middleware: give every request an id (``X-Request-Id``, the client's if plain);
    check API keys and per-key rate limits on the ``/v1/`` routes (401, 429); refuse bodies over
    ``max_body_bytes`` (``max_image_bytes`` on the edit routes; declared Content-Length or bytes
    actually received, chunked uploads included) with a 413; answer an exception that escaped the app with a 500 error body (the
    traceback goes to the log, never to the client); count requests per route and status in
    Prometheus metrics."""

    ROUTES = ("/v1/images/generations", "/v1/images/edits", "/v1/generate", "/v1/edit",
              "/healthz", "/v1/models", "/v1/stats")

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
            route = next((r for r in self.ROUTES if path.endswith(r)), "other")
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
            body = _error_body(code, message, kind, code=err_code, request_id=rid)
            return JSONResponse(body, code, headers=extra_headers)(scope, receive, send_status)

        try:
            path = scope.get("path", "")
            if "/v1/" in path and not path.endswith(_OPEN):
                denied = self._admit(headers, scope)
                if denied is not None:
                    return await reply(*denied)
            arg = "max_image_bytes" if path.endswith(EDIT_ROUTES) else "max_body_bytes"
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
            await reply(500, f"internal error (request id {rid}); the server's log has the "
                        "details", "server_error")
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


def _as_json(scope: dict, headers: dict, body: bytes) -> dict:
    """A POST body that is a JSON object is read as JSON whatever Content-Type declares
    (``curl -d`` sends ``application/x-www-form-urlencoded``; many clients send none)."""
    declared = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
    if scope.get("method") != "POST" or declared == b"application/json" or declared.endswith(
            b"+json") or declared.startswith(b"multipart/") or not body.lstrip().startswith(b"{"):
        return scope
    rest = [(k, v) for k, v in scope.get("headers") or [] if k.lower() != b"content-type"]
    return {**scope, "headers": [*rest, (b"content-type", b"application/json")]}


api.add_middleware(_Gate)


@api.exception_handler(RequestValidationError)
async def _on_invalid(request: Request, exc: RequestValidationError):
    errors = []
    for e in exc.errors():
        if e.get("type") == "json_invalid":  # FastAPI puts the character offset in loc
            reason = (e.get("ctx") or {}).get("error", "")
            where = f"{reason}, " if reason else ""
            e = {"type": "json_invalid", "loc": ("body",),
                 "msg": f"the body is not valid JSON ({where}at character {e['loc'][-1]})"}
        e = {k: v for k, v in e.items() if k in ("type", "loc", "msg", "input")}
        if isinstance(e.get("msg"), str) and e["msg"].startswith("Value error, "):
            e["msg"] = e["msg"][len("Value error, "):]
        v = e.get("input")
        if "input" in e and (not isinstance(v, (str, int, float, bool, type(None)))
                             or isinstance(v, float) and not math.isfinite(v)
                             or len(str(v)) > 200):
            e.pop("input")  # echo short, JSON-safe inputs only (NaN is not JSON)
        e["loc"] = list(e["loc"])
        errors.append(e)
    first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
    field = ".".join(str(p) for p in first["loc"][1:]) or None
    message = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}"
                        for e in errors)
    body = _error_body(422, message, "invalid_request_error", field, request_id=_rid(request))
    body["detail"] = errors
    return JSONResponse(body, status_code=422)


@api.exception_handler(ApiError)
async def _on_api_error(request: Request, exc: ApiError):
    if exc.status >= 500:  # the request id in the log too, to find it from a client's report
        logger.warning("request %s answered %d: %s", _rid(request), exc.status, exc.message)
    return JSONResponse(_error_body(exc.status, exc.message, exc.kind, request_id=_rid(request)),
                        status_code=exc.status, headers=exc.headers)


@api.exception_handler(Exception)
async def _on_unexpected(request: Request, exc: Exception):
    """Any other failure: a 500 with the error body and request id; details only in the log."""
    rid = _rid(request)
    logger.error("request %s failed: %s\n%s", rid, type(exc).__name__,
                 "".join(traceback.format_exception(exc)))
    return JSONResponse(_error_body(500, f"internal error (request id {rid}); the server's log "
                                    "has the details", "server_error", request_id=rid),
                        status_code=500)


@api.exception_handler(StarletteHTTPException)
async def _on_http_error(request: Request, exc: StarletteHTTPException):
    """Starlette's own errors (no route, wrong method, a body that cannot be parsed) in the
    same error body as every other error."""
    rid = _rid(request)
    status, kind = exc.status_code, "invalid_request_error"
    if status == 400 and "parsing the body" in str(exc.detail) and request.headers.get(
            "content-type", "").lower().startswith("multipart/"):
        body = _error_body(422, "the multipart/form-data body could not be parsed", kind,
                           request_id=rid)
        body["detail"] = [{"type": "multipart_invalid", "loc": ["body"],
                           "msg": "the multipart/form-data body could not be parsed"}]
        return JSONResponse(body, status_code=422)
    if status == 400 and "parsing the body" in str(exc.detail):  # e.g. not UTF-8
        body = _error_body(422, "the body is not valid JSON (it could not be decoded)", kind,
                           request_id=rid)
        body["detail"] = [{"type": "json_invalid", "loc": ["body"],
                           "msg": "the body is not valid JSON"}]
        return JSONResponse(body, status_code=422)
    if status == 404:
        message, kind = f"no route {request.url.path}; see /docs", "not_found"
    elif status == 405:
        message, kind = (f"{request.method} is not allowed on {request.url.path}; see /docs",
                         "method_not_allowed")
    else:
        message = str(exc.detail)
    return JSONResponse(_error_body(status, message, kind, request_id=rid), status_code=status,
                        headers=getattr(exc, "headers", None))


def _wanted_image_type(accept: str | None) -> str | None:
    """The image format an ``Accept`` header asks for instead of JSON, if any."""
    if not accept:
        return None
    types = [t.split(";")[0].strip().lower() for t in accept.split(",")]
    images = [t for t in types if t.startswith("image/")]
    if "application/json" in types or not images:
        return None
    for t in types:
        if t in ("image/png", "image/jpeg", "image/webp"):
            return t.split("/")[1]
        if t == "image/*":
            return "*"
    return None


# the page may talk to this server only; its script and style are inline
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; connect-src 'self'; img-src 'self' "
                "data:; script-src 'unsafe-inline'; style-src 'unsafe-inline'; base-uri 'none'; "
                "form-action 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


@functools.cache
def _playground_html() -> str:
    from importlib.resources import files

    return files("serving").joinpath("playground.html").read_text(encoding="utf-8")


def _b64(value: str) -> bytes:
    """Base64 text (optionally a ``data:...;base64,`` URL) -> bytes; ValueError if it is not."""
    text = value.strip()
    if text.startswith("data:"):
        head, _, text = text.partition(",")
        if not head.endswith(";base64"):
            raise ValueError("is a data URL without ;base64")
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise ValueError("is not valid base64 (give a base64 PNG, JPEG or WebP file)") from None


async def _await(response):
    return await response


@serve.deployment(name=INGRESS)
@serve.ingress(api)
class Ingress:
    """Validates, forwards to the generator deployment, encodes. Light: never imports JAX."""

    def __init__(self, generator: DeploymentHandle, settings: ServeSettings, model_id: str,
                 key_hashes: tuple[str, ...] | None = None):
        self.generator = generator
        self.s = settings
        self.model_id = model_id
        self.started = int(time.time())
        security.GATE.update(
            max_body_bytes=settings.max_body_bytes, max_image_bytes=settings.max_image_bytes,
            key_hashes=key_hashes,
            limiter=(security.RateLimiter(settings.rate_limit_per_minute)
                     if settings.rate_limit_per_minute else None))
        if settings.cors_origins:
            from fastapi.middleware.cors import CORSMiddleware

            api.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                               allow_methods=["GET", "POST"],
                               allow_headers=["Authorization", "Content-Type", "X-Request-Id",
                                              TIMEOUT_HEADER],
                               expose_headers=["X-Request-Id", "X-Seed", "Retry-After"])
        self.app_name = serve.get_replica_context().app_name
        self.board = StatsBoard.get(self.app_name)
        self._info: dict | None = None
        self._ready_seen = False
        self._state = (0.0, False, {})

    # ------------------------------------------------------------------ plumbing
    async def _generator_state(self) -> tuple[bool, dict]:
        """(ready, detail): ready once a generator replica is RUNNING, i.e. its constructor
        (model load and warm-up compiles) has returned. Cached for a second."""
        at, ready, detail = self._state
        if time.monotonic() - at < 1.0:
            return ready, detail
        try:
            status = await asyncio.to_thread(serve.status)
            app = status.applications.get(self.app_name)
            dep = app.deployments.get(GENERATOR) if app else None
            states = {getattr(k, "value", str(k)): v
                      for k, v in (dep.replica_states if dep else {}).items()}
            running = states.get("RUNNING", 0)
            detail = {"generator_replicas": states, "generator_status":
                      getattr(dep.status, "value", str(dep.status)) if dep else "missing"}
            ready = running > 0
        except Exception as e:  # controller unreachable: not ready
            ready, detail = False, {"error": f"{type(e).__name__}: {e}"}
        self._state = (time.monotonic(), ready, detail)
        self._ready_seen |= ready
        return ready, detail

    def _deadline(self, request: Request) -> float:
        timeout = self.s.request_timeout_s
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is not None:
            try:
                asked = float(raw)
            except ValueError:
                asked = math.nan
            if not (math.isfinite(asked) and asked > 0):
                raise invalid(TIMEOUT_HEADER.lower(), f"must be a number of seconds > 0 "
                              f"(at most {timeout:g}), got {raw!r}", raw, where="header")
            timeout = min(timeout, asked)
        return time.monotonic() + timeout

    async def _call(self, method: str, arg: Any, deadline: float, rid: str | None = None) -> Any:
        """Call a generator method within the deadline; map failures to HTTP errors. A call
        whose replica dies is made once more (Ray Serve routes it to a live replica)."""
        from ray.exceptions import RayActorError

        for attempt in ("retrying once", "again"):
            try:
                return await self._call_once(method, arg, deadline)
            except RayActorError as e:
                logger.warning("request %s: generator replica lost (%s); %s", rid,
                               type(e).__name__, attempt)
        raise ApiError(503, "a generator replica became unavailable; retry",
                       kind="service_unavailable",
                       headers={"Retry-After": str(self.s.retry_after_s)})

    async def _call_once(self, method: str, arg: Any, deadline: float) -> Any:
        from ray.serve.exceptions import BackPressureError

        if not self._ready_seen:
            ready, _ = await self._generator_state()
            if not ready:
                raise ApiError(503, "the model is still warming up (loading and compiling); "
                               "retry shortly", kind="service_unavailable",
                               headers={"Retry-After": str(self.s.retry_after_s)})
        handle = getattr(self.generator, method)
        left = max(deadline - time.monotonic(), 0)
        response = handle.remote() if arg is None else handle.remote(arg, left)
        try:
            return await asyncio.wait_for(_await(response), max(deadline - time.monotonic(), 0))
        except asyncio.TimeoutError:
            response.cancel()
            raise ApiError(504, "the request did not finish before its deadline "
                           f"(request_timeout_s={self.s.request_timeout_s:g} or {TIMEOUT_HEADER})",
                           kind="timeout") from None
        except asyncio.CancelledError:  # the client went away
            response.cancel()
            raise
        except BackPressureError:
            raise ApiError(503, "the server is at capacity (its queue is full); retry after "
                           f"{self.s.retry_after_s} s", kind="server_overloaded",
                           headers={"Retry-After": str(self.s.retry_after_s)}) from None
        except InvalidJob as e:
            raise ApiError(422, str(e)) from None
        except Expired:
            raise ApiError(504, "the request did not start before its deadline "
                           f"(request_timeout_s={self.s.request_timeout_s:g} or {TIMEOUT_HEADER})",
                           kind="timeout") from None

    async def _model_info(self, deadline: float) -> dict:
        """The generator's defaults and limits (asked once, then cached)."""
        if self._info is None:
            self._info = await self._call("info", None, deadline)
        return self._info

    async def _generate(self, job: GenerationRequest, deadline: float, request: Request
                        ) -> JobResult:
        """Run ``job`` on a generator replica: ``generate``, or ``edit`` for an EditRequest."""
        rid = _rid(request)
        if self.s.log_prompts:
            logger.info("request %s: prompt=%r negative=%r", rid, job.prompt, job.negative_prompt)
        method = "edit" if isinstance(job, EditRequest) else "generate"
        result: JobResult = await self._call(method, job, deadline, rid)
        self._ready_seen = True
        return result

    def _limits(self, info: dict) -> Limits:
        """What requests may ask for on this server: the serve args, tightened by the model
        (its scheduler's step limit, its size multiple, its maxdiff.json max_size), with whose
        limit each is (``*_why``) for error messages."""
        s = self.s
        steps, steps_why = s.max_steps, "the serve arg max_steps"
        if info.get("max_steps") and info["max_steps"] < steps:
            steps, steps_why = info["max_steps"], f"what this model's {info['scheduler']} allows"
        multiple = math.lcm(s.size_multiple or 1, info["size_multiple"])  # config: stricter only
        hi, size_why = s.max_size, "the serve arg max_size"
        if hi is None and info.get("max_size"):
            hi, size_why = info["max_size"], ("this model's maxdiff.json max_size; the serve arg "
                                              "max_size raises it")
        elif hi is None:
            hi, size_why = DEFAULT_MAX_SIZE, ""
        return Limits(multiple=multiple, min_size=s.min_size, max_size=hi, max_steps=steps,
                      max_guidance=s.max_guidance, max_n=s.max_n, max_cost=s.max_cost,
                      steps_why=steps_why, size_why=size_why,
                      guidance_why="the serve arg max_guidance", n_why="the serve arg max_n")

    def _problems(self, info: dict, door: str, *, prompt: str, negative_prompt: str | None = None,
                  steps, guidance=None, seed=None, n, width, height, strength=None
                  ) -> list[tuple[str, str, Any]]:
        """Every problem of a request, (field in ``door``'s words, message, value): the rules of
        :mod:`pipelines.limits` against this server's limits, and the prompts' lengths."""
        found = problems(self._limits(info), steps=steps, guidance=guidance, seed=seed, n=n,
                         width=width, height=height, strength=strength)
        out = {}  # one entry per (field, message): OpenAI's one "size" field, both sides
        for p in found:
            out.setdefault((field_name(p.field, door), p.message), p.value)
        errors = [(f, m, v) for (f, m), v in out.items()]
        for field, text in (("prompt", prompt), ("negative_prompt", negative_prompt)):
            if text is not None and len(text) > self.s.max_prompt_chars:
                errors.append((field, f"{field} has {len(text)} characters; at most "
                               f"{self.s.max_prompt_chars} are accepted", None))
        return errors

    @staticmethod
    def _adapter_problem(info: dict, name: str | None, field: str):
        """None, or (field, message, value) when ``name`` is no adapter the replicas loaded."""
        loaded = [a["name"] for a in info.get("adapters") or []]
        if name is None or name in loaded:
            return None
        have = (f"loaded adapters: {', '.join(loaded)}" if loaded else
                "this server loaded no adapters (serve arg adapters)")
        return field, f"unknown adapter {name!r}; {have}", name

    def _openai_adapter(self, info: dict, body: ImagesGenerationRequest) -> str | None:
        """The adapter an OpenAI request asks for: ``lora``, or ``model: "<base>:<adapter>"``."""
        from_model = None
        if body.model and ":" in body.model:
            from_model = body.model.rpartition(":")[2]
            problem = self._adapter_problem(info, from_model, "model")
            if problem is not None:
                raise invalid(*problem)
        problem = self._adapter_problem(info, body.lora, "lora")
        if problem is not None:
            raise invalid(*problem)
        if from_model is not None and body.lora is not None and body.lora != from_model:
            raise invalid("lora", f"lora={body.lora!r} but model names adapter {from_model!r}; "
                          "give one", body.lora)
        return body.lora or from_model

    def _headers(self, result: JobResult) -> dict:
        return {"X-Maxdiff-Replica": result.replica["id"],
                "X-Maxdiff-Node": result.replica["node_id"]}

    async def _edit_job(self, info: dict, *, prompt: str, negative_prompt: str | None,
                        image: bytes | None, mask: bytes | None, transparent_mask: bool | None,
                        strength: float | None, seed: int | None, n: int, door: str,
                        width: int | None, height: int | None, steps: int, guidance: float,
                        errors: list | None = None) -> EditRequest:
        """Decode the image (and mask) and check an edit request: every problem is a 422 naming
        its field in ``door``'s words ("native" or "openai"). ``transparent_mask``: see
        :func:`pipelines.requests.repaint_mask`. Width and height default to the image's size
        rounded down to the size multiple."""
        errors = list(errors or [])

        def decode(data: bytes | None, field: str):
            if data is None:
                return None
            try:
                return decode_image(data, field)
            except ValueError as e:
                errors.append((field, str(e), None))
                return None

        if image is None:
            errors.append(("image", "an image to edit is required", None))
        img, msk = await asyncio.to_thread(lambda: (decode(image, "image"), decode(mask, "mask")))
        repaint = None
        if img is not None and msk is not None:
            (ih, iw), (mh, mw) = img[0].shape[:2], msk[0].shape[:2]
            if (ih, iw) != (mh, mw):
                errors.append(("mask", f"mask is {mw}x{mh} but image is {iw}x{ih} (width x "
                               "height); give a mask of the image's size", None))
            else:
                repaint = repaint_mask(*msk, transparent=transparent_mask)
        if errors and img is None:  # no image: sizes and costs cannot be checked
            raise invalid_all(errors)
        multiple = self._limits(info).multiple
        ih, iw = img[0].shape[:2]
        width = iw - iw % multiple if width is None else width
        height = ih - ih % multiple if height is None else height
        if strength is None:
            strength = STRENGTH["inpaint" if mask is not None else "img2img"]
        errors += self._problems(info, door, prompt=prompt, negative_prompt=negative_prompt,
                                 steps=steps, guidance=guidance, seed=seed, n=n, width=width,
                                 height=height, strength=strength)
        if errors:
            raise invalid_all(errors)
        return EditRequest(prompt, negative_prompt, seed, n, width, height, steps, guidance,
                           strength=float(strength), image=img[0], mask=repaint)

    def _stream_problems(self, stream: bool | None, n: int, n_field: str) -> list:
        if not stream:
            return []
        if n != 1:
            return [(n_field, "a stream returns one image; ask for 1", n)]
        return []

    async def _stream(self, job: GenerationRequest, deadline: float, request: Request,
                      partial_images: int, render) -> StreamingResponse:
        """Start ``job`` on the generator's ``generate_stream`` and answer its events as
        Server-Sent Events; ``render(event)`` (async) gives the (name, data) pairs to send for
        one generator event. Errors before the first event are ordinary HTTP errors; later ones
        an ``error`` event. Leaving early (client gone) cancels the generator call."""
        from ray.serve.exceptions import BackPressureError

        rid = _rid(request)
        if not self._ready_seen and not (await self._generator_state())[0]:
            raise ApiError(503, "the model is still warming up (loading and compiling); "
                           "retry shortly", kind="service_unavailable",
                           headers={"Retry-After": str(self.s.retry_after_s)})
        left = max(deadline - time.monotonic(), 0)
        gen = self.generator.options(stream=True).generate_stream.remote(job, left,
                                                                         partial_images)

        def failure(e: BaseException) -> ApiError:
            if isinstance(e, InvalidJob):
                return ApiError(422, str(e))
            if isinstance(e, BackPressureError):
                return ApiError(503, "the server is at capacity (its queue is full); retry "
                                f"after {self.s.retry_after_s} s", kind="server_overloaded",
                                headers={"Retry-After": str(self.s.retry_after_s)})
            if isinstance(e, (Expired, asyncio.TimeoutError)):
                return ApiError(504, "the request did not finish before its deadline "
                                f"(request_timeout_s={self.s.request_timeout_s:g} or "
                                f"{TIMEOUT_HEADER})", kind="timeout")
            logger.error("request %s: stream failed: %s: %s", rid, type(e).__name__, e)
            return ApiError(500, f"internal error (request id {rid}); the server's log has "
                            "the details", kind="server_error")

        async def next_event():
            return await asyncio.wait_for(gen.__anext__(),
                                          max(deadline - time.monotonic(), 0) + 5)

        try:
            first = await next_event()
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except StopAsyncIteration:
            raise failure(RuntimeError("the stream ended before it started")) from None
        except Exception as e:
            gen.cancel()
            raise failure(e) from None
        self._ready_seen = True

        def sse(name: str, data: dict) -> bytes:
            return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()

        async def events():
            ev = first
            try:
                while True:
                    for name, data in await render(ev):
                        yield sse(name, data)
                    if ev["type"] == "result":
                        return
                    try:
                        ev = await next_event()
                    except StopAsyncIteration:
                        return
                    except (asyncio.CancelledError, GeneratorExit):
                        raise
                    except Exception as e:
                        err = failure(e)
                        yield sse("error", _error_body(err.status, err.message, err.kind,
                                                       request_id=rid))
                        return
            finally:
                gen.cancel()  # a no-op once finished; else the client left: free the slot

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # ------------------------------------------------------------------ routes
    @api.post("/v1/images/generations", response_model=ImagesResponse, tags=["OpenAI-compatible"],
              summary="Create images (OpenAI Images API)",
              responses={200: {"content": {"text/event-stream": {}},
                               "description": "JSON, or with `stream` Server-Sent Events."},
                         **{k: v for k, v in ERROR_RESPONSES.items() if k != 406}})
    async def images_generations(self, body: ImagesGenerationRequest, request: Request):
        """Same request and response as OpenAI's ``images.generate`` with
        ``response_format="b64_json"``. Steps and guidance are the served model's defaults;
        seeds are random (use ``/v1/generate`` for control)."""
        deadline = self._deadline(request)
        info = await self._model_info(deadline)
        n = 1 if body.n is None else body.n
        if body.size in (None, "auto"):
            width, height = info["default_width"], info["default_height"]
        else:
            try:
                width, height = parse_size(body.size)
            except ValueError as e:
                raise invalid("size", f"{e}, or 'auto'", body.size) from None
        errors = self._stream_problems(body.stream, n, "n")
        errors += self._problems(info, "openai", prompt=body.prompt, steps=info["default_steps"],
                                 n=n, width=width, height=height)
        if errors:
            raise invalid_all(errors)
        adapter = self._openai_adapter(info, body)
        job = GenerationRequest(body.prompt, None, None, n, width, height,
                                info["default_steps"], info["default_guidance"], adapter)
        fmt = body.output_format or "png"
        if body.stream:
            common = {"background": "opaque", "output_format": fmt, "quality": "auto",
                      "size": f"{width}x{height}"}

            async def render(ev):
                if ev["type"] == "progress":
                    return []
                im = ev["image"] if ev["type"] == "partial_image" else ev["result"].images[0]
                blob = await asyncio.to_thread(encode_image, im, fmt,
                                               quality=body.output_compression)
                data = {"b64_json": base64.b64encode(blob).decode(),
                        "created_at": int(time.time()), **common}
                if ev["type"] == "partial_image":
                    return [("image_generation.partial_image",
                             {"type": "image_generation.partial_image",
                              "partial_image_index": ev["index"], **data})]
                usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                         "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}}
                return [("image_generation.completed",
                         {"type": "image_generation.completed", "usage": usage, **data})]

            return await self._stream(job, deadline, request, body.partial_images or 0, render)
        result = await self._generate(job, deadline, request)
        blobs = await asyncio.to_thread(
            lambda: [encode_image(im, fmt, quality=body.output_compression)
                     for im in result.images])
        return JSONResponse({"created": int(time.time()), "output_format": fmt,
                             "size": f"{width}x{height}",
                             "data": [{"b64_json": base64.b64encode(b).decode(),
                                       "revised_prompt": None} for b in blobs]},
                            headers=self._headers(result))

    @api.post("/v1/generate", response_model=GenerateResponse, tags=["native"],
              summary="Generate images with explicit settings",
              responses={200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {},
                                           "text/event-stream": {}},
                               "description": "JSON, or with `Accept: image/png` (jpeg, webp) "
                               "and one image, the image itself (seed in `X-Seed`), or with "
                               "`stream` Server-Sent Events."},
                         **ERROR_RESPONSES})
    async def generate(self, body: GenerateRequest, request: Request):
        """Every setting explicit; the response carries each image's seed (pass it back to
        reproduce the image) and timings (queue, device, encode)."""
        t0 = time.perf_counter()
        deadline = self._deadline(request)
        fmt = body.output_format
        wanted = _wanted_image_type(request.headers.get("accept"))
        if wanted is not None:
            if body.num_images != 1:
                raise ApiError(406, "an image Accept type returns exactly one image; ask for "
                               "num_images=1 or Accept: application/json", kind="not_acceptable")
            if wanted != "*":
                if "output_format" in body.model_fields_set and wanted != fmt:
                    raise ApiError(406, f"Accept asks for image/{wanted} but output_format is "
                                   f"{fmt!r}", kind="not_acceptable")
                fmt = wanted
        info = await self._model_info(deadline)
        steps = info["default_steps"] if body.steps is None else body.steps
        guidance = info["default_guidance"] if body.guidance_scale is None else body.guidance_scale
        width = info["default_width"] if body.width is None else body.width
        height = info["default_height"] if body.height is None else body.height
        errors = []
        if body.scheduler is not None and body.scheduler.lower() not in [
                s.lower() for s in info["scheduler_names"]]:
            errors.append(("scheduler", f"this server runs {info['scheduler']!r}; the scheduler "
                           "is chosen when the server starts (config / scheduler args)",
                           body.scheduler))
        if (problem := self._adapter_problem(info, body.lora, "lora")) is not None:
            errors.append(problem)
        errors += self._stream_problems(body.stream, body.num_images, "num_images")
        if body.stream and wanted is not None:
            errors.append(("stream", "a stream answers text/event-stream, not an image Accept "
                           "type", True))
        errors += self._problems(info, "native", prompt=body.prompt,
                                 negative_prompt=body.negative_prompt, steps=steps,
                                 guidance=guidance, seed=body.seed, n=body.num_images,
                                 width=width, height=height)
        if errors:
            raise invalid_all(errors)
        job = GenerationRequest(body.prompt, body.negative_prompt, body.seed, body.num_images,
                                width, height, steps, guidance, body.lora)

        async def respond(result: JobResult) -> tuple[dict, list[bytes]]:
            t1 = time.perf_counter()
            meta = [image_info(prompt=body.prompt, negative_prompt=body.negative_prompt,
                               seed=seed, steps=steps, guidance=guidance,
                               size=f"{width}x{height}", scheduler=info["scheduler"],
                               model=self.model_id, dtype=info["dtype"], adapter=body.lora)
                    for seed in result.seeds]
            blobs = await asyncio.to_thread(lambda: [encode_image(im, fmt, m)
                                                     for im, m in zip(result.images, meta)])
            timings = dict(result.timings, encode_s=time.perf_counter() - t1,
                           total_s=time.perf_counter() - t0,
                           batch_requests=result.batch["requests"],
                           batch_images=result.batch["images"], batch_id=result.batch["id"])
            return {
                "created": int(time.time()), "model": self.model_id,
                "images": [{"b64_json": base64.b64encode(b).decode(), "seed": s}
                           for b, s in zip(blobs, result.seeds)],
                "seeds": result.seeds, "width": width, "height": height, "steps": steps,
                "guidance_scale": guidance, "scheduler": info["scheduler"],
                "output_format": fmt, "timings": timings, "lora": body.lora}, blobs

        if body.stream:
            async def render(ev):
                if ev["type"] == "progress":
                    return [("progress", {k: ev[k] for k in ("step", "total",
                                                             "queue_position")})]
                if ev["type"] == "partial_image":
                    blob = await asyncio.to_thread(encode_image, ev["image"], fmt)
                    return [("partial_image", {"index": ev["index"], "step": ev["step"],
                                               "b64_json": base64.b64encode(blob).decode()})]
                return [("result", (await respond(ev["result"]))[0])]

            return await self._stream(job, deadline, request, body.partial_images, render)
        result = await self._generate(job, deadline, request)
        data, blobs = await respond(result)
        headers = self._headers(result)
        if wanted is not None:
            headers["X-Seed"] = str(result.seeds[0])
            return Response(blobs[0], media_type=f"image/{fmt}", headers=headers)
        return JSONResponse(data, headers=headers)

    @api.post("/v1/images/edits", response_model=ImagesResponse, tags=["OpenAI-compatible"],
              summary="Edit an image (OpenAI Images API)",
              responses={**{k: v for k, v in ERROR_RESPONSES.items() if k != 406},
                         400: {"model": ErrorResponse,
                               "description": "The multipart body could not be parsed."}})
    async def images_edits(
            self, request: Request,
            prompt: str = Form(min_length=1, description="What the edited image should show."),
            image: UploadFile | None = File(None, description="The image to edit (PNG, JPEG "
                                            "or WebP). The openai client sends one file as "
                                            "`image`, a list as `image[]`."),
            image_list: list[UploadFile] | None = File(None, alias="image[]", description=
                                                       "Images to edit; the first is used."),
            mask: UploadFile | None = File(None, description="PNG of the image's size whose "
                                           "fully transparent pixels (alpha 0) mark what to "
                                           "repaint (OpenAI's convention; a mask without alpha: "
                                           "white = repaint). Omitted: image-to-image."),
            n: int | None = Form(1, description="How many images (up to max_n).",
                                 json_schema_extra={"minimum": 1}),
            size: str | None = Form("auto", description="'WIDTHxHEIGHT' or 'auto' (the "
                                    "image's size, rounded down to the size multiple)."),
            response_format: str | None = Form("b64_json",
                                               description="Only 'b64_json' is supported."),
            output_format: ImageFormat | None = Form(None, description="png (default), jpeg "
                                                     "or webp."),
            output_compression: int | None = Form(None, ge=0, le=100,
                                                  description="jpeg/webp quality, 0-100."),
            stream: bool | None = Form(None, description="Streaming is not supported.")):
        """Same request and response as OpenAI's ``images.edit`` with ``b64_json``: with a
        ``mask``, inpainting (strength 0.9999); without, image-to-image (strength 0.75;
        :data:`pipelines.limits.STRENGTH`). Steps and guidance are the served model's defaults,
        seeds random (use ``/v1/edit`` for control). ``model``, ``user``, ``quality``,
        ``background``, ``input_fidelity`` and other OpenAI fields are accepted and ignored."""
        deadline = self._deadline(request)
        errors = []
        if response_format not in (None, "b64_json"):
            errors.append(("response_format", "only 'b64_json' is supported: this server "
                           "returns images inline and does not host them at URLs",
                           response_format))
        if stream:
            errors.append(("stream", "streaming is not supported; omit stream or set it to "
                           "false", stream))
        width = height = None
        if size not in (None, "auto"):
            try:
                width, height = parse_size(size)
            except ValueError as e:
                errors.append(("size", f"{e}, or 'auto'", size))
        upload = image if image is not None else (image_list[0] if image_list else None)
        info = await self._model_info(deadline)
        steps = info["default_steps"]
        job = await self._edit_job(
            info, prompt=prompt, negative_prompt=None,
            image=None if upload is None else await upload.read(),
            mask=None if mask is None else await mask.read(), transparent_mask=True,
            strength=None, seed=None, n=1 if n is None else n, door="openai", width=width,
            height=height, steps=steps, guidance=info["default_guidance"], errors=errors)
        result = await self._generate(job, deadline, request)
        fmt = output_format or "png"
        blobs = await asyncio.to_thread(
            lambda: [encode_image(im, fmt, quality=output_compression) for im in result.images])
        return JSONResponse({"created": int(time.time()), "output_format": fmt,
                             "size": f"{job.width}x{job.height}",
                             "data": [{"b64_json": base64.b64encode(b).decode(),
                                       "revised_prompt": None} for b in blobs]},
                            headers=self._headers(result))

    @api.post("/v1/edit", response_model=EditResponse, tags=["native"],
              summary="Edit an image (image-to-image, inpainting) with explicit settings",
              responses={k: v for k, v in ERROR_RESPONSES.items() if k != 406})
    async def edit(self, body: EditBody, request: Request):
        """Image-to-image, or inpainting with a ``mask`` (white = repaint; a mask with
        transparency: transparent = repaint). Every setting explicit; the response carries each
        image's seed and timings like ``/v1/generate``."""
        t0 = time.perf_counter()
        deadline = self._deadline(request)
        info = await self._model_info(deadline)
        steps = info["default_steps"] if body.steps is None else body.steps
        guidance = info["default_guidance"] if body.guidance_scale is None else body.guidance_scale
        errors = []
        raw = {}
        for field in ("image", "mask"):
            value = getattr(body, field)
            if value is None:
                continue
            try:
                raw[field] = _b64(value)
            except ValueError as e:
                errors.append((field, f"{field} {e}", None))
        if "image" not in raw and not any(f == "image" for f, _, _ in errors):
            errors.append(("image", "an image to edit is required", None))
        if any(f in ("image", "mask") for f, _, _ in errors):
            raise invalid_all(errors)
        job = await self._edit_job(
            info, prompt=body.prompt, negative_prompt=body.negative_prompt, image=raw["image"],
            mask=raw.get("mask"), transparent_mask=None, strength=body.strength, seed=body.seed,
            n=body.num_images, door="native", width=body.width, height=body.height,
            steps=steps, guidance=guidance, errors=errors)
        result = await self._generate(job, deadline, request)
        t1 = time.perf_counter()
        size = f"{job.width}x{job.height}"
        meta = [image_info(prompt=body.prompt, negative_prompt=body.negative_prompt, seed=seed,
                           steps=steps, guidance=guidance, size=size,
                           scheduler=info["scheduler"], model=self.model_id, dtype=info["dtype"])
                | {"mode": job.kind, "strength": f"{job.strength:g}"}
                for seed in result.seeds]
        fmt = body.output_format
        blobs = await asyncio.to_thread(lambda: [encode_image(im, fmt, m)
                                                 for im, m in zip(result.images, meta)])
        timings = dict(result.timings, encode_s=time.perf_counter() - t1,
                       total_s=time.perf_counter() - t0, batch_requests=result.batch["requests"],
                       batch_images=result.batch["images"])
        return JSONResponse({
            "created": int(time.time()), "model": self.model_id,
            "images": [{"b64_json": base64.b64encode(b).decode(), "seed": s}
                       for b, s in zip(blobs, result.seeds)],
            "seeds": result.seeds, "mode": job.kind, "strength": job.strength,
            "width": job.width, "height": job.height, "steps": steps,
            "guidance_scale": guidance, "scheduler": info["scheduler"], "output_format": fmt,
            "timings": timings}, headers=self._headers(result))

    @api.get("/", response_class=HTMLResponse, tags=["playground"],
             summary="The web playground (a page for people)",
             responses={404: {"description": "The playground is off (serve arg playground)."}})
    async def playground(self):
        """One self-contained page (nothing fetched from other hosts) that calls the public
        endpoints above: ``GET /v1/models`` for the defaults and limits, ``POST /v1/generate``."""
        if not self.s.playground:
            raise ApiError(404, "the playground is off on this server (serve arg playground)",
                           kind="not_found")
        return HTMLResponse(_playground_html(), headers=PAGE_HEADERS)

    @api.get("/healthz", tags=["operations"], summary="Ready to serve?",
             responses={503: {"description": "No generator replica has finished warming up."}})
    async def healthz(self):
        """200 once a generator replica has loaded the model and compiled its warm-up shapes;
        503 (with ``Retry-After``) before that."""
        ready, detail = await self._generator_state()
        if ready:
            return {"status": "ok", **detail}
        return JSONResponse({"status": "warming_up", **detail}, status_code=503,
                            headers={"Retry-After": str(self.s.retry_after_s)})

    @api.get("/v1/models", tags=["OpenAI-compatible"], summary="The served model",
             responses={k: ERROR_RESPONSES[k] for k in (401, 429, 500)})
    async def models(self):
        """The served model; once a generator replica is ready, ``maxdiff`` adds its defaults,
        ``limits`` (what requests may ask for: sizes, steps, guidance, images) and ``adapters``
        (the LoRA adapters loaded, serve arg adapters), and every adapter is listed as a model
        ``<model>:<adapter>`` too (the OpenAI route's ``model`` picks it)."""
        entry = {"id": self.model_id, "object": "model", "created": self.started,
                 "owned_by": "maxdiff"}
        if self._info is None and (await self._generator_state())[0]:
            try:
                await self._model_info(time.monotonic() + 10)
            except ApiError:  # busy or restarting: the entry without details, this time
                pass
        if self._info is not None:
            entry["maxdiff"] = {k: self._info[k] for k in (
                "scheduler", "default_steps", "default_guidance", "default_width",
                "default_height", "size_multiple", "max_size", "dtype", "devices")}
            entry["maxdiff"]["engine"] = self.s.engine  # "step": streaming is available
            lim = self._limits(self._info)
            entry["maxdiff"]["limits"] = {
                "min_size": lim.min_size or lim.multiple, "max_size": lim.max_size,
                "size_multiple": lim.multiple, "max_steps": lim.max_steps,
                "max_guidance": lim.max_guidance, "max_n": lim.max_n,
                "max_prompt_chars": self.s.max_prompt_chars, "max_cost": lim.max_cost}
            entry["maxdiff"]["adapters"] = self._info.get("adapters") or []
        extra = [{"id": f"{self.model_id}:{a['name']}", "object": "model",
                  "created": self.started, "owned_by": "maxdiff", "parent": self.model_id,
                  "maxdiff": {"adapter": a}}
                 for a in ((self._info or {}).get("adapters") or [])]
        return {"object": "list", "data": [entry, *extra]}

    @api.get("/v1/stats", tags=["operations"], summary="Recent batches per generator replica",
             responses={k: ERROR_RESPONSES[k] for k in (401, 429, 500)})
    async def stats(self):
        """Every generator replica of this application (whichever ingress replica served its
        requests): its node, images served, compiled programs and recent batches (newest
        last), as each replica last reported them (after every batch) to the application's
        stats actor; ``report_age_s`` says how long ago. Replicas that are gone are listed
        until they have been silent for 10 minutes."""
        try:
            replicas = await self.board.snapshot.remote()
        except Exception as e:  # the stats actor is gone: report, never fail
            logger.warning("stats actor unavailable: %s", type(e).__name__)
            self.board = StatsBoard.get(self.app_name)
            replicas = {}
        return {"replicas": replicas}


# ---------------------------------------------------------------------------------- builder
def build_app(args: dict | None = None):
    """Ray Serve application builder: ``serve run serving.app:build_app key=value ...`` or the
    ``args:`` of an application in ``configs/serve.yaml``. Keys: :class:`ServeSettings` fields
    plus run-config keys (model, unet, scheduler, dtype, ...; ``config`` names the run config)."""
    from pipelines.config import load_run_config
    from pipelines.default_model import default_model_path

    settings = ServeSettings.from_args(args)
    run_config = load_run_config(settings.config, settings.run_overrides)
    model = run_config.model
    if model is None:
        default_model_path()  # a clear error now rather than from every replica
    model_id = settings.model_name or (Path(model).name if model else "maxdiff-default")
    key_hashes = security.load_key_hashes(settings.api_keys)
    actor: dict[str, Any] = {"num_cpus": settings.num_cpus}
    if settings.resource == "GPU":
        actor["num_gpus"] = settings.resource_amount
    elif settings.resource:
        actor["resources"] = {settings.resource: settings.resource_amount}
    gen_options = dict(name=GENERATOR, num_replicas=settings.num_replicas,
                       max_ongoing_requests=settings.generator_max_ongoing,
                       max_queued_requests=settings.max_queued_requests,
                       request_router_config=RequestRouterConfig(**ROUTER_BACKOFF),
                       graceful_shutdown_timeout_s=settings.graceful_shutdown_s,
                       health_check_period_s=settings.health_check_period_s,
                       health_check_timeout_s=settings.health_check_timeout_s,
                       ray_actor_options=actor)
    if settings.max_replicas_per_node is not None:
        gen_options["max_replicas_per_node"] = settings.max_replicas_per_node
    generator = serve.deployment(Generator).options(**gen_options)
    ingress = Ingress.options(num_replicas=settings.ingress_replicas,
                              max_ongoing_requests=settings.ingress_max_ongoing_requests,
                              ray_actor_options={"num_cpus": settings.ingress_num_cpus})
    return ingress.bind(generator.bind(run_config, settings), settings, model_id, key_hashes)
