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
:class:`serving.job_routes.JobRoutes`'; the playground, health, models and stats routes
:class:`serving.info_routes.InfoRoutes`'; the FastAPI app itself :mod:`serving.api`'s.

This module declares the routes and ``build_app``; the work is done by ``gate`` (request ids,
keys, rate and body limits), ``validation``, ``openai_api`` and ``native_api`` (each dialect's
request to a job, result to a response), ``client`` (calls to the generator), ``sse`` and
``errors`` (every error body, and the one mapping of generator failures to HTTP errors).
"""


import time
from typing import Any

from fastapi import Depends, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from serving import (
    answers,
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
from serving.errors import TIMEOUT_HEADER, request_id
from serving.gate import CONTROL_ROUTES, EDIT_ROUTES, PROMPT_ROUTES
from serving.generator import Generator
from serving.info_routes import InfoRoutes
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
from serving.stats_board import StatsBoard
from serving.storage import OutputStore

# How the ingress's router retries a request while every generator replica is at
# max_ongoing_requests: Ray Serve's default backs off to 0.5 s between tries and a finished request
# does not wake the waiting ones, so with 8-image batches of 0.1 s (or a step engine freeing a
# slot per image) the devices sat idle between tries (LoadGen Offline, embedded model: 5 images/s
# through engine=step against 61 in-process). Tries are cheap: two queue-length probes.
ROUTER_BACKOFF = {"initial_backoff_s": 0.005, "backoff_multiplier": 2, "max_backoff_s": 0.05}
INGRESS = "Ingress"


def _headers(result: JobResult, seeds: bool = False) -> dict:
    """Which replica and node ran a job (and, for the OpenAI routes, ``X-Seeds``: each image's
    seed, comma-separated, as their entries' ``seed`` fields give them)."""
    out = {"X-Maxdiff-Replica": result.replica["id"],
           "X-Maxdiff-Node": result.replica["node_id"]}
    if seeds:
        out["X-Seeds"] = ",".join(str(s) for s in result.seeds)
    return out


# Ray Serve freezes the app (and these methods' globals) here: helpers go above.
@serve.deployment(name=INGRESS)
@serve.ingress(api)
class Ingress(JobRoutes, InfoRoutes):
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
