"""The generator deployment: the application's models (:class:`serving.models.Catalog`),
loaded on demand on each replica through Ray Serve's model multiplexing.

Each replica owns its host's local devices (the pipeline's mesh shards every device batch over
them) and keeps up to ``max_models_per_replica`` models loaded (``@serve.multiplexed``: a
per-replica LRU; the request's multiplexed model id names the model, and Ray Serve's router
prefers replicas that hold it). Each loaded model (:class:`LoadedModel`) has its own pipeline,
backends, batch queues and metrics, so no device batch ever mixes models; the models of a
replica take turns on its devices (one FIFO device lock). A model evicted by the LRU finishes
the requests it has started; its memory is freed when they end.
Generation runs on the backend the serve arg ``engine`` picks (:mod:`serving.backend`):
``batch`` batches whole requests per shape key (:mod:`serving.batch_backend`), ``step`` runs
step-level continuous batching (:mod:`serving.step_backend`); ControlNet requests (a
:class:`pipelines.conditioned_requests.ControlRequest` through ``generate``, naming ControlNets the model
loaded with it: serve arg ``controlnets``) run on the same engine as the rest. Edits
(``edit(job)``, an :class:`pipelines.conditioned_requests.EditRequest`: image-to-image and inpainting) are
request-batched on either engine, under the same device lock (FIFO: batches take turns),
deadlines and stats.

The constructor loads the default (first) model and compiles every ``warmup_shapes`` program
for it (engine=batch: at every padded batch size a batch can have; engine=step: one engine per
size) before it returns; Ray Serve routes to a replica only after that. Other models are loaded
by the first request that names them (no warm-up: each new shape compiles on its first
request, from the persistent compilation cache when it has the program).

A request carries the seconds it has left (the ingress's deadline); a request whose deadline
passes before its images start (engine=batch), or before they finish (engine=step: they are
cancelled), fails with ``Expired``, counted in ``maxdiff_expired_requests``.
:meth:`Generator.generate_stream` yields progress events, partial images (engine=step: the
engine's denoised-estimate previews) and the result, for the streaming routes.

Health: Ray Serve calls :meth:`Generator.check_health` every ``health_check_period_s``; it runs a
tiny program on the replica's devices with the loaded weights and raises if that fails or
hangs, so Ray Serve replaces the replica. After every batch a replica reports its stats to the
application's :class:`serving.stats_board.StatsBoard` actor, which ``/v1/stats`` reads (and
after every health check, so an idle replica's report stays fresh), and every model it loads
publishes its defaults and limits there for ``/v1/models``. ``/v1/stats`` lists the replicas
Ray Serve's controller runs, and the others that reported as removed
(:func:`serving.stats_board.split_replicas`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Iterator

import numpy as np
import ray
from ray import serve

from pipelines import prompting
from pipelines.conditioned_requests import ControlImage, ControlRequest, EditRequest
from pipelines.control_limits import controlnet_problem
from pipelines.limits import check, edit_adapter_problem, hires_problems
from pipelines.requests import GenerationRequest
from serving.backend import Backend, Expired, InvalidJob, Meters
from serving.batch_backend import BatchBackend
from serving.models import Catalog, Served
from serving.schemas import JobResult
from serving.settings import ServeSettings
from serving.specs import WarmupShape
from serving.stats_board import StatsBoard

__all__ = ["Expired", "Generator", "InvalidJob", "LoadedModel"]

logger = logging.getLogger("ray.serve")


def size_multiple(pipe) -> int:
    """Image sides must be multiples of this: the VAE's scale factor (8 for SDXL). The UNet
    upsamples to its skip connections' sizes, so latents need not divide its downsampling."""
    return pipe.vae_scale_factor


class LoadedModel:
    """One model loaded on a generator replica: its pipeline (with its adapters), backends
    and metrics. ``replica``: the replica's identity, ``device_lock``, ``report()`` and
    ``batch_ids`` (its batch id sequence) its own, shared by its models; ``meters``: this
    model's on this replica (kept across reloads)."""

    def __init__(self, served: Served, settings: ServeSettings, meters: Meters,
                 device_lock: asyncio.Lock, replica: dict, report, on_unload=None,
                 batch_ids: Iterator[int] | None = None):
        from pipelines import TextToImagePipeline

        t0 = time.perf_counter()
        self.name, self.settings, self.meters = served.name, settings, meters
        self.pipe = TextToImagePipeline.from_config(served.run_config)
        for spec in served.adapters:  # before the warm-up: its programs carry the tables
            self.pipe.add_adapter(spec.name, spec.path, spec.scale)
        self.controlnets = {}  # name -> (module, params), in the pipeline's dtype and mesh
        for spec in served.controlnets:
            from pipelines import ControlNetPipeline

            one = ControlNetPipeline.from_pipe(self.pipe, controlnet=spec.path)  # fits it?
            self.controlnets[spec.name] = (one.controlnets[0], one.controlnet_params[0])
        self.load_s = time.perf_counter() - t0
        self.replica = replica
        self._on_unload = on_unload
        parts = (self.pipe, settings, meters, device_lock, replica, report)
        shared = dict(controlnets=self.controlnets, batch_ids=batch_ids)
        # edits and ControlNet requests, and generation with engine=batch
        self.batches = BatchBackend(*parts, **shared)
        self.backend: Backend = self.batches
        if settings.engine == "step":
            from serving.specs import STEP_REFINER
            from serving.step_backend import StepBackend

            if self.pipe.refiner is not None:  # (a config file's refiner key)
                raise ValueError(STEP_REFINER)

            self.backend = StepBackend(*parts, **shared)
        self.warmup_s, self.warmed = 0.0, []

    def __del__(self):
        """Ray Serve's multiplexer calls this when its LRU evicts the model (and Python when
        the object goes): the replica forgets it; requests already running keep it alive."""
        forget, self._on_unload = getattr(self, "_on_unload", None), None
        if forget is not None:
            forget(self)

    def warm_up(self) -> None:
        """Compile every ``warmup_shapes`` program (blocking)."""
        t0 = time.perf_counter()
        for shape in self.settings.warmup_shapes:
            job = self.resolve(shape)
            if job is None:
                logger.warning("warm-up %s skipped: the model has no default size", shape)
                continue
            if (done := self.backend.warmup(job)) is not None:
                self.warmed.append(done)
        self.warmup_s = time.perf_counter() - t0

    def resolve(self, shape: WarmupShape) -> GenerationRequest | None:
        """The job a warm-up shape stands for (None: no size known); with ControlNets, a
        :class:`ControlRequest` with blank control images (a ControlNet this model did not
        load is an error naming it)."""
        p = self.pipe
        w, h = shape.width or p.default_width, shape.height or p.default_height
        if w is None or h is None:
            return None
        steps = shape.steps or p.default_steps
        g = p.default_guidance if shape.guidance is None else shape.guidance
        if not shape.controlnets:
            return GenerationRequest("", None, 0, 1, w, h, steps, g)
        check([controlnet_problem(name, self.controlnets) for name in shape.controlnets])
        blank = ControlImage(np.zeros((h, w, 3), np.uint8))
        return ControlRequest("", None, 0, 1, w, h, steps, g,
                              controls=tuple((name, blank) for name in shape.controlnets))

    def info(self) -> dict:
        """Defaults and limits the ingress validates against."""
        p = self.pipe
        cfg = p.run_config
        names = [type(p.scheduler).__name__]
        if cfg is not None and cfg.scheduler and cfg.scheduler not in names:
            names.insert(0, cfg.scheduler)
        return {"name": self.name, "model": p.name, "scheduler": names[0],
                "scheduler_names": names,
                "default_steps": p.default_steps, "default_guidance": p.default_guidance,
                "default_width": p.default_width, "default_height": p.default_height,
                "size_multiple": size_multiple(p), "max_size": p.max_size,
                "max_steps": p.max_steps,
                "dtype": cfg.dtype if cfg else None, "quantization": p.quantization,
                "devices": p.mesh.size, "replica": self.replica, "warmup_s": self.warmup_s,
                "warmed": self.warmed, "load_s": self.load_s,
                "adapters": [{k: a[k] for k in ("name", "scale", "layers", "rank")}
                             for a in p.adapters],
                "controlnets": [{"name": name} for name in self.controlnets],
                "ip_adapter": None if p.ip_adapter is None else {
                    "kind": p.ip_adapter.kind, "tokens": p.ip_adapter.tokens,
                    "scale": p.ip_adapter_scale}}

    def stats(self) -> dict:
        """What ``/v1/stats`` reports of this model on this replica beyond its images."""
        backends = {id(b): b for b in (self.batches, self.backend)}.values()
        return {"compiled_programs": self.pipe.num_compiled + sum(b.num_compiled
                                                                  for b in backends),
                "load_s": self.load_s, **self.backend.stats()}

    def validate(self, job: GenerationRequest, stream: bool = False) -> None:
        """:class:`InvalidJob` unless this model can run ``job`` (the request rules, an
        adapter it added, one image when streamed)."""
        try:
            if stream and job.n != 1:
                raise ValueError("streaming returns one image; ask for one")
            step = self.backend_for(job).name == "step"
            if job.scheduler is not None and (step or job.controlnets):
                raise ValueError(f"scheduler: this server runs {self.info()['scheduler']!r} for "
                                 f"{'every request on engine=step' if step else 'ControlNet'}; "
                                 "a sampler per request runs text-to-image on engine=batch")
            if step and job.deepcache_interval != 1:  # (the ingress refuses it first)
                raise ValueError(f"deepcache_interval={job.deepcache_interval!r}: engine=step "
                                 "cannot run DeepCache; engine=batch runs it")
            self.pipe.check_request(job.steps, job.height, job.width, "pil", job.scheduler)
            job.validate()
            if (h := job.hires) is not None:  # (the ingress checks it first)
                lim = self.pipe.limits
                check(hires_problems(h.scale, h.strength, h.steps, job.steps, job.width,
                                     job.height, lim.multiple, lim.min_size, lim.max_steps,
                                     lim.steps_why), "native")
            prompting.check_prompts(self.pipe, job.images()[:1], 1 if step else None,
                                    "engine=step holds one 75-token chunk per image")
            self.pipe.adapter_index(job.images()[:1])  # an adapter this model added
            check([controlnet_problem(name, self.controlnets)  # ControlNets this model loaded
                   for name in job.controlnets], "native")
        except ValueError as e:
            raise InvalidJob(str(e)) from None

    def backend_for(self, job: GenerationRequest) -> Backend:
        """The backend that runs ``job``: the serve arg ``engine``'s (ControlNet requests too:
        engine=step runs them on step engines of their ControlNets); a hires fix runs on the
        batch backend on either engine (its two passes run at two sizes), as edits do."""
        return self.batches if job.hires is not None else self.backend

    def validate_edit(self, job: EditRequest) -> None:
        try:
            if not isinstance(job, EditRequest):
                raise ValueError(f"edit takes an EditRequest, got {type(job).__name__}")
            check([edit_adapter_problem(job.adapter)], "native")
            self.pipe.check_request(job.steps, job.height, job.width, "pil")
            job.validate()
            prompting.check_prompts(self.pipe, job.images()[:1])
        except ValueError as e:
            raise InvalidJob(str(e)) from None


class Generator:
    """Ray Serve deployment class (``build_app`` sets its options). Handle methods (each on
    the model named by the call's multiplexed model id, ``handle.options(
    multiplexed_model_id=name)``; none: the default model): ``generate(job) -> JobResult``,
    ``generate_stream(job)``, ``edit(job) -> JobResult``, ``info() -> dict``; and
    ``stats() -> dict`` of the replica."""

    def __del__(self):
        """Ray Serve calls this when the replica shuts down (autoscaling removed it, the
        application was redeployed or deleted): ``/v1/stats`` lists it as removed at once, even
        where the Ray controller cannot be read."""
        board, replica = getattr(self, "_board", None), getattr(self, "replica", None)
        if board is not None and replica is not None:
            with contextlib.suppress(Exception):
                board.forget.remote(replica["id"])

    async def __init__(self, catalog: Catalog, settings: ServeSettings):
        self.catalog, self.settings = catalog, settings
        ctx = serve.get_replica_context()
        self.replica = {"id": ctx.replica_id.unique_id,
                        "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}
        self._board = StatsBoard.get(ctx.app_name)
        self._device_lock = asyncio.Lock()  # FIFO: every model's batches take turns
        # one batch id sequence for the replica's life: a model loaded again, or another
        # model's engine, never starts again at 1 (X-Maxdiff-Replica names the replica)
        self._batch_ids = itertools.count(1)
        self._recent = collections.deque(maxlen=256)  # every model's batches, newest last
        self._meters: dict[str, Meters] = {}
        self._loaded: dict[str, LoadedModel] = {}  # what the multiplexer holds, LRU first
        self._loading: dict[str, asyncio.Future] = {}
        self.loads: collections.Counter = collections.Counter()  # model loads on this replica
        self.warmup_s, self.warmed = 0.0, []  # the default model's warm-up, at start
        self.ready_at: float | None = None  # unix time the default model's warm-up finished

        async def load_model(name: str) -> LoadedModel:  # a function: the multiplexer keeps
            return await self._load(name)                # its LRU as an attribute of it

        self.load_model = serve.multiplexed(
            max_num_models_per_replica=catalog.max_per_replica)(load_model)
        model = await self.load_model(catalog.default.name)
        await asyncio.to_thread(model.warm_up)
        self.warmup_s, self.warmed = model.warmup_s, model.warmed
        self.ready_at = time.time()  # serving (and costing) from now on
        logger.info("generator ready on node %s: %s loaded in %.1fs, warm-up %.1fs, %d "
                    "program(s)", self.replica["node_id"], model.name, model.load_s,
                    self.warmup_s, model.pipe.num_compiled)
        self._report()

    async def _load(self, name: str) -> LoadedModel:
        """Ray Serve's multiplexed loader: load ``name`` (in a thread: the replica keeps
        serving its other models meanwhile). A load whose caller went away (deadline, client
        gone) still finishes, for the next request of that model."""
        task = self._loading.get(name)
        if task is None:
            served = self.catalog.get(name)
            if name not in self._meters:  # kept across reloads: counts and metrics go on
                self._meters[name] = Meters(name, self._recent, self.settings.stats_window_s)
            meters = self._meters[name]
            task = self._loading[name] = asyncio.ensure_future(asyncio.to_thread(
                LoadedModel, served, self.settings, meters, self._device_lock, self.replica,
                self._report, self._forget, self._batch_ids))
        try:
            model = await asyncio.shield(task)
        finally:
            if task.done():
                self._loading.pop(name, None)
        self.loads[name] += 1
        self._loaded[name] = model
        logger.info("model %s loaded in %.1fs (%d held)", name, model.load_s, len(self._loaded))
        try:
            self._board.describe.remote(self.catalog.key(name), model.info())
        except Exception as e:
            logger.warning("model info report failed: %s", type(e).__name__)
        self._report()
        return model

    def _forget(self, model: LoadedModel) -> None:
        if self._loaded.get(model.name) is model:  # not a newer load of the same model
            self._loaded.pop(model.name, None)
            logger.info("model %s unloaded (LRU; %d held)", model.name, len(self._loaded))

    async def _model(self) -> LoadedModel:
        """The model this call names (its multiplexed model id; none: the default)."""
        name = serve.get_multiplexed_model_id() or self.catalog.default.name
        return await self.load_model(name)

    # ------------------------------------------------------------------ handle methods
    async def info(self) -> dict:
        """The named model's defaults and limits the ingress validates against."""
        return (await self._model()).info()

    def stats(self, recent: int | None = None) -> dict:
        """This replica's recent batches of every model (newest last, each naming its
        model), images served, compiled programs, and per model (``models``): loaded or not,
        its images, loads, compiled programs and backend state."""
        batches = list(self._recent)
        batches = batches[-recent:] if recent else batches
        models = {}
        for name, meters in self._meters.items():
            model = self._loaded.get(name)
            models[name] = {"loaded": model is not None, "images": meters.images,
                            "loads": self.loads[name], **(model.stats() if model else {})}
        return {"node_id": self.replica["node_id"], "pid": self.replica["pid"],
                "images": sum(m.images for m in self._meters.values()),
                "compiled_programs": sum(m.get("compiled_programs", 0)
                                         for m in models.values()),
                "batches": batches, "warmed": self.warmed, "warmup_s": self.warmup_s,
                "engine": self.settings.engine, "loaded_models": list(self._loaded),
                "models": models, "ready_at": self.ready_at,
                "images_by_second": self._images_by_second()}

    def _images_by_second(self) -> list[list[int]]:
        """``[unix second, images]`` finished on this replica over the stats window, every
        model's together (oldest first): what ``/v1/stats`` turns into images/s and cost."""
        total: dict[int, int] = collections.Counter()
        for meters in self._meters.values():
            for second, images in meters.images_by_second():
                total[second] += images
        return [[sec, total[sec]] for sec in sorted(total)]

    def _report(self) -> None:
        try:  # fire and forget: stats must never slow or fail a request
            self._board.report.remote(self.replica["id"], self.stats(recent=32))
        except Exception as e:
            logger.warning("stats report failed: %s", type(e).__name__)

    async def check_health(self) -> None:
        """Ray Serve's health check: a tiny program on this replica's devices with the most
        recently loaded model's weights must finish within ``health_check_timeout_s`` (half of
        it here, to answer in time); otherwise raising marks the replica unhealthy and Ray
        Serve replaces it."""
        if not self._loaded:  # between an eviction and a load: nothing to run
            return
        model = next(reversed(self._loaded.values()))
        await asyncio.wait_for(asyncio.to_thread(model.pipe.probe),
                               self.settings.health_check_timeout_s / 2)
        self._report()  # a heartbeat: /v1/stats tells live replicas from gone ones by it

    async def generate(self, job: GenerationRequest, timeout_s: float | None = None
                       ) -> JobResult:
        """Run ``job`` on the named model's backend; returns when its images are done.
        ``timeout_s``: seconds the caller still waits; past that the job is dropped
        (:class:`Expired`)."""
        model = await self._model()
        model.validate(job)
        with model.meters.holding(job.n):
            return await model.backend_for(job).generate(job, timeout_s)

    async def edit(self, job: EditRequest, timeout_s: float | None = None) -> JobResult:
        """Like :meth:`generate` for an image-to-image (no mask) or inpainting job; edit jobs
        are batched with the jobs of their :class:`EditKey` (on either engine)."""
        model = await self._model()
        model.validate_edit(job)
        with model.meters.holding(job.n):
            return await model.batches.generate(job, timeout_s)

    async def generate_stream(self, job: GenerationRequest, timeout_s: float | None = None,
                              partial_images: int = 0):
        """Yield ``{"type": "progress", "step", "total", "queue_position"}`` once when queued,
        then (engine=step) whenever its queue position changes and after each step, and
        ``{"type": "partial_image", "index", "step", "image"}`` for ``partial_images`` previews
        spread over the steps (uint8 (H, W, 3)); then ``{"type": "result", "result":
        JobResult}``. One image per job. engine=batch runs the job like :meth:`generate`: it
        has no steps to report, so it yields the queued event (``queue_position`` None: request
        batching does not know it), then the result, and no partial images (OpenAI's streaming
        allows fewer than asked)."""
        model = await self._model()
        model.validate(job, stream=True)
        with model.meters.holding(job.n):
            async with contextlib.aclosing(model.backend_for(job).stream(
                    job, timeout_s, partial_images)) as events:
                async for event in events:  # closed at once when the client leaves
                    yield event
