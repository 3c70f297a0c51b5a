"""The Ray Serve application: a FastAPI ingress in front of the generator deployment.

    serve run serving.app:build_app model=/models/sdxl config=sdxl-base max_batch_size=8
    serve run configs/serve.yaml

The ingress validates every request (422 with the offending field, 413 for bodies over
``max_body_bytes``, or ``max_image_bytes`` on the edit routes), turns it into a
:class:`pipelines.requests.GenerationRequest`, sends it to a generator replica through a
deployment handle and encodes the images it gets back. A full generator queue
(``max_queued_requests``) is a 503 with ``Retry-After``; a request past its deadline
(``request_timeout_s``, or a shorter ``X-Request-Timeout`` header) is a 504. A request whose
generator replica dies is retried once on another replica (same seeds, same images), else a 503.
Every response carries ``X-Request-Id``; every error body is ``{"error": {...}}`` with that id.
With API keys on (``api_keys`` / ``MAXDIFF_API_KEYS``) the ``/v1/`` routes need
``Authorization: Bearer KEY`` (401 otherwise) and ``rate_limit_per_minute`` bounds each key (429).

Endpoints (OpenAPI at ``/docs``): ``GET /`` (the web playground, ``serving/playground.html``),
``POST /v1/images/generations`` (OpenAI Images API),
``POST /v1/images/edits`` (OpenAI Images API edits, multipart), ``POST /v1/generate`` (native),
``POST /v1/edit`` (native image-to-image and inpainting, JSON), ``GET /healthz``,
(``/v1/generate`` takes ControlNet ``control_images`` where the serve arg ``controlnets`` loaded
some: an unknown one is a 422 naming the loaded ones; its body limit is then
``max_image_bytes``),
``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /v1/stats``.

Several models (serve arg ``models``, docs/multi-model.md): a request's ``model`` field (OpenAI
and native alike; ``<model>:<adapter>`` on the OpenAI routes) names one, omitted: the first. A
name not served is a 404 ``model_not_found`` naming the choices. The call to the generator
carries the name as Ray Serve's multiplexed model id (:mod:`serving.models`).

Streaming (both engines: progress after each step and partial images; on engine=batch for
text-to-image):
``"stream": true`` on
``/v1/images/generations`` answers Server-Sent Events in the OpenAI Images API format
(``image_generation.partial_image`` events for ``partial_images``, then
``image_generation.completed``); on ``/v1/generate``, ``progress`` events, ``partial_image``
events, then ``result`` (the route's JSON response). An error after the stream has started is an
``error`` event with the usual error body. A client that disconnects cancels its image (its
step-engine slot is freed at the next tick).

Images as links (``response_format: "url"``), jobs (``/v1/jobs``, webhooks) and usage per key
(``/v1/usage``; quotas, priority classes): docs/service.md; their routes are
:class:`serving.job_routes.JobRoutes`', the FastAPI app itself :mod:`serving.api`'s.

This module declares the routes and ``build_app``; the work is done by ``gate`` (request ids,
keys, rate and body limits), ``validation``, ``openai_api`` and ``native_api`` (each dialect's
request to a job, result to a response), ``client`` (calls to the generator), ``sse`` and
``errors`` (every error body, and the one mapping of generator failures to HTTP errors).
"""


import functools
import logging
import time
from typing import Any

from fastapi import Depends, File, Form, Request, UploadFile
from fastapi.responses import HTMLResponse, JSONResponse, Response
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from serving import (
    answers,
    cost,
    jobs,
    native_api,
    openai_api,
    security,
    usage,
    validation,
)
from serving.answers import Prepared
from serving.api import api, key_of
from serving.client import GENERATOR, GeneratorClient
from serving.errors import TIMEOUT_HEADER, ApiError, request_id
from serving.gate import CONTROL_ROUTES, EDIT_ROUTES, PROMPT_ROUTES
from serving.generator import Generator, StatsBoard
from serving.job_routes import JobRoutes
from serving.models import Catalog
from serving.schemas import (
    ERROR_RESPONSES,
    EditResponse,
    ErrorResponse,
    GenerateRequest,
    GenerateResponse,
    ImageFormat,
    ImagesGenerationRequest,
    ImagesResponse,
    JobResult,
)
from serving.schemas import EditRequest as EditBody
from serving.settings import ServeSettings
from serving.storage import OutputStore

logger = logging.getLogger("ray.serve")

# How the ingress's router retries a request while every generator replica is at
# max_ongoing_requests: Ray Serve's default backs off to 0.5 s between tries and a finished request
# does not wake the waiting ones, so with 8-image batches of 0.1 s (or a step engine freeing a
# slot per image) the devices sat idle between tries (LoadGen Offline, embedded model: 5 images/s
# through engine=step against 61 in-process). Tries are cheap: two queue-length probes.
ROUTER_BACKOFF = {"initial_backoff_s": 0.005, "backoff_multiplier": 2, "max_backoff_s": 0.05}
INGRESS = "Ingress"

# the page may talk to this server only; its script and style are inline
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; connect-src 'self'; img-src 'self' "
                "data:; script-src 'unsafe-inline'; style-src 'unsafe-inline'; base-uri 'none'; "
                "form-action 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


@functools.cache
def _playground_html() -> str:
    from importlib.resources import files

    return files("serving").joinpath("playground.html").read_text(encoding="utf-8")


def _headers(result: JobResult, seeds: bool = False) -> dict:
    """Which replica and node ran a job (and, for the OpenAI routes, ``X-Seeds``: each image's
    seed, comma-separated, as their entries' ``seed`` fields give them)."""
    out = {"X-Maxdiff-Replica": result.replica["id"],
           "X-Maxdiff-Node": result.replica["node_id"]}
    if seeds:
        out["X-Seeds"] = ",".join(str(s) for s in result.seeds)
    return out


def _model_details(s: ServeSettings, info: dict) -> dict:
    """``/v1/models``'s ``maxdiff`` entry: the model's defaults, the engine, this server's
    limits for it and the adapters loaded."""
    details = {k: info[k] for k in (
        "scheduler", "default_steps", "default_guidance", "default_width", "default_height",
        "size_multiple", "max_size", "dtype", "devices")}
    details["quantization"] = info.get("quantization", "none")
    details["engine"] = s.engine  # "step": steps and partial images are streamed
    lim = validation.limits(s, info)
    details["limits"] = {
        "min_size": lim.min_size or lim.multiple, "max_size": lim.max_size,
        "size_multiple": lim.multiple, "max_steps": lim.max_steps,
        "max_guidance": lim.max_guidance, "max_n": lim.max_n,
        "max_prompt_chars": s.max_prompt_chars, "max_cost": lim.max_cost}
    details["adapters"] = info.get("adapters") or []
    details["controlnets"] = info.get("controlnets") or []  # what control_images may name
    details["ip_adapter"] = info.get("ip_adapter")  # image prompts (ip_adapter_image), or None
    return details


# Ray Serve freezes the app (and these methods' globals) here: helpers go above.
@serve.deployment(name=INGRESS)
@serve.ingress(api)
class Ingress(JobRoutes):
    """Validates, forwards to the generator deployment, encodes. Light: never imports JAX."""

    def __init__(self, generator: DeploymentHandle, settings: ServeSettings, catalog: Catalog,
                 keys: dict[str, security.KeyPolicy] | None = None):
        self.s = settings
        self.catalog = catalog
        self.started = int(time.time())
        controlnets = any(m.controlnets for m in catalog.models)  # control images in bodies
        prompts = any(m.run_config.ip_adapter for m in catalog.models)  # image prompts too
        security.GATE.update(
            max_body_bytes=settings.max_body_bytes, max_image_bytes=settings.max_image_bytes,
            image_routes=EDIT_ROUTES + (CONTROL_ROUTES if controlnets or prompts else ())
            + (PROMPT_ROUTES if prompts else ()),
            key_hashes=None if keys is None else tuple(keys),
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
        self.generator = GeneratorClient(generator, settings, self.app_name,
                                         catalog.default.name)
        self.board = StatsBoard.get(self.app_name)
        self.files = OutputStore(settings.output_store, settings.output_ttl_s, settings.sign_urls,
                                 settings.output_store_options)
        self.jobs = jobs.Jobs(settings, self.app_name, self.files, self._run)
        self.accounts = usage.Accounts(
            settings, self.app_name,
            {security.key_id(h): p for h, p in (keys or {}).items()}, self.jobs.db.path)

    async def _run(self, prep: Prepared, deadline: float, rid: str | None,
                   key_id: str | None) -> JobResult:
        """Run a prepared request on the generator: the key's quotas checked, its priority
        class kept (where classes are set), its usage counted."""
        await self.accounts.check(key_id, prep.job.n)
        job = self.accounts.classed(prep.job, key_id)
        replicas = 1
        if self.accounts.gate is not None:
            replicas = (await self.generator.state())[1].get("generator_replicas", {}).get(
                "RUNNING", 1)
        result = await self.accounts.run(
            lambda: self.generator.run(job, deadline, rid, prep.model), key_id, deadline,
            replicas)
        await self.accounts.count(key_id, prep.job, result)
        return result

    async def _stream(self, prep: Prepared, deadline: float, request: Request,
                      partial_images: int, render):
        """Stream a prepared request (quotas checked, usage counted at its result)."""
        key_id = key_of(request)
        await self.accounts.check(key_id, prep.job.n)

        async def counted(ev):
            if ev["type"] == "result":
                await self.accounts.count(key_id, prep.job, ev["result"])
            return await render(ev)

        return await self.generator.stream(self.accounts.classed(prep.job, key_id), deadline,
                                           request_id(request), partial_images, counted,
                                           prep.model)

    def __del__(self):
        """Ray Serve stops this replica: its jobs end as interrupted now."""
        for part in (getattr(self, "jobs", None), getattr(self, "accounts", None)):
            if part is not None:
                part.close()

    async def _answer(self, prep: Prepared, deadline: float, request: Request,
                      response_format: str | None, seeds: bool = False) -> JSONResponse:
        """Run a prepared request and answer its route's JSON (images inline or as links)."""
        result = await self._run(prep, deadline, request_id(request), key_of(request))
        data = await answers.answer(prep, result, response_format, self.files,
                                    self._base_url(request), key_of(request))
        return JSONResponse(data, headers=_headers(result, seeds=seeds))

    def _base_url(self, request: Request) -> str:
        """What links to this server start with: the serve arg public_url, else the URL the
        request came to (its route prefix included)."""
        if self.s.public_url:
            return self.s.public_url
        root = request.scope.get("root_path", "")
        return f"{request.url.scheme}://{request.url.netloc}{root}"

    async def _start(self, request: Request, model: str) -> tuple[float, dict]:
        """(deadline, the model's info) for a generation request."""
        deadline = validation.deadline(request, self.s)
        return deadline, await self.generator.model_info(model, deadline)

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
        deadline = validation.deadline(request, self.s)
        prep = await openai_api.prepare(self.s, self.generator, self.catalog, body, deadline)
        if body.stream:
            return await self._stream(
                prep, deadline, request, body.partial_images or 0,
                openai_api.stream_render(prep.job, prep.fmt, body.output_compression))
        return await self._answer(prep, deadline, request, body.response_format, seeds=True)

    @api.post("/v1/generate", response_model=GenerateResponse, tags=["native"],
              summary="Generate images with explicit settings",
              responses={200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {},
                                           "text/event-stream": {}},
                               "description": "JSON, or with `Accept: image/png` (jpeg, webp) "
                               "and one image, the image itself (seed in `X-Seed`), or with "
                               "`stream` Server-Sent Events."},
                         **ERROR_RESPONSES,
                         400: {"model": ErrorResponse,
                               "description": "The multipart body could not be parsed."},
                         422: {"model": ErrorResponse,
                               "description": "A field is missing or out of range (`param` "
                               "and `detail` name every one)."}})
    async def generate(self, request: Request,
                       body: GenerateRequest = Depends(native_api.generate_body)):
        """Every setting explicit; the response carries each image's seed (pass it back to
        reproduce the image) and timings (queue, device, encode). The body is JSON, or
        ``multipart/form-data`` with the same fields and the control images as
        ``control_image`` files (``controlnet`` / ``control_scale`` / ``control_start`` /
        ``control_end`` / ``control_guess_mode`` once, or once per file)."""
        t0 = time.perf_counter()
        deadline = validation.deadline(request, self.s)
        wanted, fmt = native_api.negotiate(body, request.headers.get("accept"))
        prep = await native_api.prepare_generate(self.s, self.generator, self.catalog, body,
                                                 wanted, fmt, deadline, t0)
        if body.stream:
            render = native_api.stream_render(prep.job, fmt, prep.info, prep.model, t0)
            return await self._stream(prep, deadline, request, body.partial_images, render)
        if wanted is None:
            return await self._answer(prep, deadline, request, body.response_format)
        result = await self._run(prep, deadline, request_id(request), key_of(request))
        _, blobs = await prep.render(result)
        return Response(blobs[0], media_type=f"image/{fmt}",
                        headers={**_headers(result), "X-Seed": str(result.seeds[0])})

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
            stream: bool | None = Form(None, description="Streaming is not supported."),
            model: str | None = Form(None, description="A served model's name (see "
                                     "/v1/models); omitted: the default model.")):
        """Same request and response as OpenAI's ``images.edit`` with ``b64_json``: with a
        ``mask``, inpainting (strength 0.9999); without, image-to-image (strength 0.75;
        :data:`pipelines.limits.STRENGTH`). Steps and guidance are the served model's defaults,
        seeds random (use ``/v1/edit`` for control). ``model`` picks a served model as on
        ``/v1/images/generations`` (an adapter part is ignored: edits take none); ``user``,
        ``quality``, ``background``, ``input_fidelity`` and other OpenAI fields are accepted
        and ignored."""
        model = openai_api.model_name(self.catalog, model)
        deadline, info = await self._start(request, model)
        job = await openai_api.edit_job(
            self.s, info, prompt=prompt, mask=mask, n=n, size=size,
            image=image if image is not None else (image_list[0] if image_list else None),
            response_format=response_format, stream=stream)
        fmt = output_format or "png"
        prep = Prepared(model, info, job, fmt, lambda result: openai_api.images_response(
            result, job, fmt, output_compression, info, model), "data")
        return await self._answer(prep, deadline, request, response_format, seeds=True)

    @api.post("/v1/edit", response_model=EditResponse, tags=["native"],
              summary="Edit an image (image-to-image, inpainting) with explicit settings",
              responses={k: v for k, v in ERROR_RESPONSES.items() if k != 406})
    async def edit(self, body: EditBody, request: Request):
        """Image-to-image, or inpainting with a ``mask`` (white = repaint; a mask with
        transparency: transparent = repaint). Every setting explicit; the response carries each
        image's seed and timings like ``/v1/generate``."""
        t0 = time.perf_counter()
        deadline = validation.deadline(request, self.s)
        prep = await native_api.prepare_edit(self.s, self.generator, self.catalog, body,
                                             deadline, t0)
        return await self._answer(prep, deadline, request, body.response_format)

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
        503 (with ``Retry-After``) before that. The body: ``status`` (``ok`` /
        ``warming_up``); ``generator_replicas``: how many generator replicas are in each Ray
        Serve replica state (``STARTING``: loading the model and compiling its warm-up shapes,
        ``RUNNING``: serving, ``UPDATING``: taking a new config, ``RECOVERING``: restarting after
        a failure, ``STOPPING``: removed by a scale-down or redeploy, draining,
        ``PENDING_MIGRATION``: moving off a draining node); ``generator_status``: the
        deployment's (``HEALTHY``, ``UPDATING``, ``UPSCALING``, ``DOWNSCALING``, ``UNHEALTHY``,
        ``DEPLOY_FAILED``; ``missing`` when the application has none); ``scaled_to_zero: true``
        at zero replicas under autoscaling after a first replica was ready (still 200: a
        request starts a replica); ``error`` instead of the states when the Ray controller
        cannot be read (503)."""
        ready, detail = await self.generator.state()
        if ready:
            return {"status": "ok", **detail}
        return JSONResponse({"status": "warming_up", **detail}, status_code=503,
                            headers={"Retry-After": str(self.s.retry_after_s)})

    @api.get("/v1/models", tags=["OpenAI-compatible"], summary="The served models",
             responses={k: ERROR_RESPONSES[k] for k in (401, 429, 500)})
    async def models(self):
        """Every served model, the default first. Once a generator replica has loaded a model
        (the default: at start), ``maxdiff`` adds its defaults, ``limits`` (what requests may
        ask for: sizes, steps, guidance, images) and ``adapters`` (the LoRA adapters loaded,
        serve arg adapters); each adapter is listed as a model ``<model>:<adapter>`` too (the
        OpenAI routes' ``model`` picks it). ``GET /v1/models/{model}`` loads a model to answer."""
        await self._known_infos()
        data = []
        for served in self.catalog.models:
            data += self._entries(served.name, self.generator.infos.get(served.name))
        return {"object": "list", "data": data}

    @api.get("/v1/models/{model}", tags=["OpenAI-compatible"], summary="One served model",
             responses={k: ERROR_RESPONSES[k] for k in (401, 404, 429, 500, 503, 504)})
    async def model(self, model: str, request: Request):
        """One model's ``/v1/models`` entry with its defaults and limits (``maxdiff``); a
        generator replica loads the model to answer if none has yet. ``<model>:<adapter>``
        answers an adapter's entry."""
        name, _, adapter = model.partition(":")
        self.catalog.get(name)  # 404 naming the choices
        info = await self.generator.model_info(name, validation.deadline(request, self.s))
        entries = self._entries(name, info)
        found = next((e for e in entries if e["id"] == model), None)
        if found is None:
            raise ApiError(404, f"model {name!r} has no adapter {adapter!r}; its adapters: "
                           f"{', '.join(a['name'] for a in info['adapters']) or 'none'}",
                           param="model", code="model_not_found")
        return found

    def _entries(self, name: str, info: dict | None) -> list[dict]:
        """``/v1/models`` entries of model ``name``: the model, then its adapters."""
        entry = {"id": name, "object": "model", "created": self.started, "owned_by": "maxdiff"}
        if info is not None:
            entry["maxdiff"] = {"default": name == self.catalog.default.name,
                                **_model_details(self.s, info)}
        adapters = ((info or {}).get("adapters")
                    or [{"name": a.name, "scale": a.scale} for a in self.catalog.get(name).adapters])
        return [entry, *({"id": f"{name}:{a['name']}", "object": "model", "created": self.started,
                          "owned_by": "maxdiff", "parent": name, "maxdiff": {"adapter": a}}
                         for a in adapters)]

    async def _known_infos(self) -> None:
        """Fill the info of models a generator replica has loaded (and reported to the stats
        actor) that this ingress has not asked for yet; the default model's is asked once
        the generator is ready. Loads nothing."""
        missing = [m for m in self.catalog.names if m not in self.generator.infos]
        if not missing:
            return
        try:
            found = await self.board.described.remote([self.catalog.key(m) for m in missing])
        except Exception as e:  # the stats actor is gone: details later
            logger.warning("stats actor unavailable: %s", type(e).__name__)
            found = {}
        for m in missing:
            if self.catalog.key(m) in found:
                self.generator.infos[m] = found[self.catalog.key(m)]
        default = self.catalog.default.name
        if default not in self.generator.infos and (await self.generator.state())[0]:
            try:
                await self.generator.model_info(default, time.monotonic() + 10)
            except ApiError:  # busy or restarting: the entry without details, this time
                pass

    @api.get("/v1/stats", tags=["operations"], summary="Recent batches per generator replica",
             responses={k: ERROR_RESPONSES[k] for k in (401, 429, 500)})
    async def stats(self):
        """Every live generator replica of this application (whichever ingress replica served
        its requests): its node, images served, compiled programs and recent batches (newest
        last), as it last reported them (after every batch and health check) to the
        application's stats actor; ``report_age_s`` says how long ago, ``state`` is Ray
        Serve's. Live: the replicas Ray Serve's controller runs (``live_from: "controller"``);
        the others that reported (scaled down, redeployed, failed; ``STOPPING`` while drained)
        are in ``removed`` (id, node, pid, ``last_seen``) for 10 minutes. When the controller
        cannot be read, ``live_from`` is ``"reports"`` (``live_error`` says why): the replicas
        that reported in the last 10 minutes and have not shut down. ``throughput``: images/s
        and, with the serve arg ``price_per_hour`` (per replica), the cost per 1,000 images of
        each live replica and in total over the last ``stats_window_s``
        (:mod:`serving.cost`)."""
        source: dict = {"live_from": "controller"}
        try:
            live = await self.generator.live_replicas()
        except Exception as e:  # the controller is unreachable: the reports alone, flagged
            live, source = None, {"live_from": "reports", "live_error": f"{type(e).__name__}: {e}"}
        try:
            snap = await self.board.snapshot.remote(live)
        except Exception as e:  # the stats actor is gone: report, never fail
            logger.warning("stats actor unavailable: %s", type(e).__name__)
            self.board = StatsBoard.get(self.app_name)
            snap = {"replicas": {}, "removed": []}
        replicas = snap["replicas"]
        figures = cost.throughput(replicas, time.time(), self.s.stats_window_s,
                                  self.s.price_per_hour, 3 * self.s.health_check_period_s)
        for r in replicas.values():
            r.pop("images_by_second", None)  # summed up in throughput
        return {"replicas": replicas, "removed": snap["removed"], **source,
                "throughput": figures}


# ---------------------------------------------------------------------------------- builder
def build_app(args: dict | None = None):
    """Ray Serve application builder: ``serve run serving.app:build_app key=value ...`` or the
    ``args:`` of an application in ``configs/serve.yaml``. Keys: :class:`ServeSettings` fields
    plus run-config keys (model, unet, scheduler, dtype, ...; ``config`` names the run config),
    or several models as ``models`` (docs/multi-model.md)."""
    settings = ServeSettings.from_args(args)
    catalog = Catalog.from_settings(settings)  # a bad run config or missing model fails here
    keys = security.load_keys(settings.api_keys)
    jobs.check_places(settings)  # the output store and the jobs database open, or fail here
    actor: dict[str, Any] = {"num_cpus": settings.num_cpus}
    if settings.resource == "GPU":
        actor["num_gpus"] = settings.resource_amount
    elif settings.resource:
        actor["resources"] = {settings.resource: settings.resource_amount}
    scaling = settings.autoscaling_config  # None: a fixed num_replicas
    gen_options = dict(name=GENERATOR, max_ongoing_requests=settings.generator_max_ongoing,
                       max_queued_requests=settings.max_queued_requests,
                       request_router_config=RequestRouterConfig(**ROUTER_BACKOFF),
                       graceful_shutdown_timeout_s=settings.graceful_shutdown_s,
                       graceful_shutdown_wait_loop_s=settings.graceful_shutdown_wait_loop_s,
                       health_check_period_s=settings.health_check_period_s,
                       health_check_timeout_s=settings.health_check_timeout_s,
                       ray_actor_options=actor)
    if scaling is None:
        gen_options["num_replicas"] = settings.num_replicas
    else:
        gen_options["autoscaling_config"] = scaling
    if settings.max_replicas_per_node is not None:
        gen_options["max_replicas_per_node"] = settings.max_replicas_per_node
    generator = serve.deployment(Generator).options(**gen_options)
    ingress = Ingress.options(num_replicas=settings.ingress_replicas,
                              max_ongoing_requests=settings.ingress_max_ongoing_requests,
                              ray_actor_options={"num_cpus": settings.ingress_num_cpus})
    return ingress.bind(generator.bind(catalog, settings), settings, catalog, keys)
