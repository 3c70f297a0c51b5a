"""The ingress's FastAPI application: its metadata, the ASGI gate, the error handlers and the
OpenAPI schema. Routes are methods of :class:`serving.app.Ingress` and its parts
(:class:`serving.job_routes.JobRoutes`, :class:`serving.info_routes.InfoRoutes`), declared on
:data:`api`."""

from __future__ import annotations

import types

from fastapi import FastAPI, Request

from serving import errors
from serving.gate import Gate
from serving.schemas import generate_openapi_body

api = FastAPI(
    title="maxdiff",
    summary="SDXL-family text-to-image over HTTP (JAX on Ray Serve).",
    description="`POST /v1/images/generations` speaks the OpenAI Images API (point the "
                "`openai` client's `base_url` here); `POST /v1/generate` exposes every setting "
                "and reports seeds and timings. Requests that share size, steps and CFG on/off "
                "are batched onto the accelerators together.",
    version="0.1.0",
)
api.add_middleware(Gate)
errors.install(api)


def _openapi(self: FastAPI) -> dict:
    """FastAPI's schema plus ``/v1/generate``'s request body: it reads the body itself (JSON or
    multipart, :func:`serving.native_api.generate_body`), so FastAPI cannot describe it."""
    if self.openapi_schema is None:
        schema = FastAPI.openapi(self)
        body, components = generate_openapi_body()
        schema["paths"]["/v1/generate"]["post"]["requestBody"] = body
        schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
    return self.openapi_schema


api.openapi = types.MethodType(_openapi, api)


def key_of(request: Request) -> str | None:
    """The public id of the request's API key (None when keys are off)."""
    return getattr(request.state, "key_id", None)
