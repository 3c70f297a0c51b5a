"""Every HTTP error of the service: the error body, the 422 builders, the one mapping of a
generator failure to an HTTP error (plain and streamed calls alike) and FastAPI's exception
handlers.

Every error body is ``{"error": {"message", "type", "param", "code", "request_id"}, "detail"}``:
``error`` is the OpenAI error shape (the openai client reads it), ``detail`` FastAPI's."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import traceback
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.backend import Expired, InvalidJob

logger = logging.getLogger("ray.serve")

TIMEOUT_HEADER = "X-Request-Timeout"


class ApiError(Exception):
    """An HTTP error with a message for the client (rendered as ``{"error": {...}}``)."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 headers: dict | None = None, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers
        self.param, self.code = param, code  # the field at fault; code: the status if None


def error_body(status: int, message: str, kind: str, param: str | None = None, *,
               code: str | int | None = None, request_id: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": status if code is None else code, "request_id": request_id},
            "detail": message}


def request_id(request: Request) -> str | None:
    """The id the gate gave the request (``X-Request-Id``)."""
    return getattr(request.state, "request_id", None)


def invalid(field: str, message: str, value: Any = None, where: str = "body"):
    """A 422 naming ``field``, in FastAPI's validation-error format."""
    return invalid_all([(field, message, value)], where)


def invalid_all(errors: list[tuple[str, str, Any]], where: str = "body"):
    """A 422 naming every (field, message, value) of ``errors``."""
    return RequestValidationError([{"type": "value_error", "loc": (where, f), "msg": m,
                                    "input": v} for f, m, v in errors])


def internal_message(rid: str | None) -> str:
    """What a 500 tells the client (the details go to the log only)."""
    return f"internal error (request id {rid}); the server's log has the details"


# ------------------------------------------------------------------ generator failures
def warming_up(retry_after_s: int) -> ApiError:
    return ApiError(503, "the model is still warming up (loading and compiling); retry shortly",
                    kind="service_unavailable", headers={"Retry-After": str(retry_after_s)})


def replica_lost(retry_after_s: int) -> ApiError:
    return ApiError(503, "a generator replica became unavailable; retry",
                    kind="service_unavailable", headers={"Retry-After": str(retry_after_s)})


def failure(e: BaseException, settings, *, streamed: bool = False) -> ApiError | None:
    """The HTTP error for a generator call that raised ``e`` (``settings``: the serve args),
    or None when ``e`` is no expected failure (the caller re-raises it). ``streamed``: the
    stream had been asked for, so an expired request counts as unfinished, not unstarted."""
    from ray.serve.exceptions import BackPressureError

    def past_deadline(what: str) -> ApiError:
        return ApiError(504, f"the request did not {what} before its deadline "
                        f"(request_timeout_s={settings.request_timeout_s:g} or {TIMEOUT_HEADER})",
                        kind="timeout")

    if isinstance(e, asyncio.TimeoutError) or streamed and isinstance(e, Expired):
        return past_deadline("finish")
    if isinstance(e, BackPressureError):
        return ApiError(503, "the server is at capacity (its queue is full); retry after "
                        f"{settings.retry_after_s} s", kind="server_overloaded",
                        headers={"Retry-After": str(settings.retry_after_s)})
    if isinstance(e, InvalidJob):  # "field: ..." / "field=value: ..." names the field
        m = re.match(r"(\w+)[:=]", str(e))
        return ApiError(422, str(e), param=m and m.group(1))
    if isinstance(e, Expired):
        return past_deadline("start")
    return None


# ------------------------------------------------------------------ exception handlers
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
    body = error_body(422, message, "invalid_request_error", field,
                      request_id=request_id(request))
    body["detail"] = errors
    return JSONResponse(body, status_code=422)


async def _on_api_error(request: Request, exc: ApiError):
    rid = request_id(request)
    if exc.status >= 500:  # the request id in the log too, to find it from a client's report
        logger.warning("request %s answered %d: %s", rid, exc.status, exc.message)
    return JSONResponse(error_body(exc.status, exc.message, exc.kind, exc.param, code=exc.code,
                                   request_id=rid), status_code=exc.status, headers=exc.headers)


async def _on_unexpected(request: Request, exc: Exception):
    """Any other failure: a 500 with the error body and request id; details only in the log."""
    rid = request_id(request)
    logger.error("request %s failed: %s\n%s", rid, type(exc).__name__,
                 "".join(traceback.format_exception(exc)))
    return JSONResponse(error_body(500, internal_message(rid), "server_error", request_id=rid),
                        status_code=500)


def _unparsed(rid: str | None, message: str, kind: str, msg: str) -> JSONResponse:
    """The 422 for a body Starlette could not parse."""
    body = error_body(422, message, "invalid_request_error", request_id=rid)
    body["detail"] = [{"type": kind, "loc": ["body"], "msg": msg}]
    return JSONResponse(body, status_code=422)


async def _on_http_error(request: Request, exc: StarletteHTTPException):
    """Starlette's own errors (no route, wrong method, a body that cannot be parsed) in the
    same error body as every other error."""
    rid = request_id(request)
    status, kind = exc.status_code, "invalid_request_error"
    if status == 400 and "parsing the body" in str(exc.detail) and request.headers.get(
            "content-type", "").lower().startswith("multipart/"):
        message = "the multipart/form-data body could not be parsed"
        return _unparsed(rid, message, "multipart_invalid", message)
    if status == 400 and "parsing the body" in str(exc.detail):  # e.g. not UTF-8
        return _unparsed(rid, "the body is not valid JSON (it could not be decoded)",
                         "json_invalid", "the body is not valid JSON")
    if status == 404:
        message, kind = f"no route {request.url.path}; see /docs", "not_found"
    elif status == 405:
        message, kind = (f"{request.method} is not allowed on {request.url.path}; see /docs",
                         "method_not_allowed")
    else:
        message = str(exc.detail)
    return JSONResponse(error_body(status, message, kind, request_id=rid), status_code=status,
                        headers=getattr(exc, "headers", None))


def install(api: FastAPI) -> None:
    """Answer every error of ``api`` with the error body."""
    api.add_exception_handler(RequestValidationError, _on_invalid)
    api.add_exception_handler(ApiError, _on_api_error)
    api.add_exception_handler(Exception, _on_unexpected)
    api.add_exception_handler(StarletteHTTPException, _on_http_error)
