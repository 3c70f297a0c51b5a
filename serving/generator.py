"""The generator deployment: one ``TextToImagePipeline`` per replica.

Each replica owns its host's local devices (the pipeline's mesh shards every device batch over
them). Generation runs on the backend the serve arg ``engine`` picks (:mod:`serving.backend`):
``batch`` batches whole requests per shape key (:mod:`serving.batch_backend`), ``step`` runs
step-level continuous batching (:mod:`serving.step_backend`). Edits (``edit(job)``, an
:class:`pipelines.requests.EditRequest`: image-to-image and inpainting) are request-batched on
either engine, under the same device lock (FIFO: batches take turns), deadlines and stats.

The constructor loads the model and compiles every ``warmup_shapes`` program (engine=batch: at
every padded batch size a batch can have; engine=step: one engine per size) before it returns;
Ray Serve routes to a replica only after that.

A request carries the seconds it has left (the ingress's deadline); a request whose deadline
passes before its images start (engine=batch), or before they finish (engine=step: they are
cancelled), fails with ``Expired``, counted in ``maxdiff_expired_requests``.
:meth:`Generator.generate_stream` yields progress events, partial images (engine=step: the
engine's denoised-estimate previews) and the result, for the streaming routes.

Health: Ray Serve calls :meth:`Generator.check_health` every ``health_check_period_s``; it runs a
tiny program on the replica's devices with the loaded weights and raises if that fails or
hangs, so Ray Serve replaces the replica. After every batch a replica reports its stats to the
application's :class:`StatsBoard` actor, which ``/v1/stats`` reads (and after every health
check, so an idle replica's report stays fresh).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import ray
from ray import serve

from pipelines.limits import check, edit_adapter_problem
from pipelines.requests import EditRequest, GenerationRequest
from serving.backend import Backend, Expired, InvalidJob, Meters
from serving.batch_backend import BatchBackend
from serving.schemas import JobResult
from serving.settings import ServeSettings, WarmupShape

__all__ = ["Expired", "Generator", "InvalidJob", "StatsBoard"]

logger = logging.getLogger("ray.serve")


def size_multiple(pipe) -> int:
    """Image sides must be multiples of this: the VAE's scale factor (8 for SDXL). The UNet
    upsamples to its skip connections' sizes, so latents need not divide its downsampling."""
    return pipe.vae_scale_factor


@ray.remote(num_cpus=0)
class _Board:
    """Latest stats of each generator replica of one application."""

    FORGET_S = 600.0

    def __init__(self):
        self.replicas: dict[str, tuple[float, dict]] = {}

    def report(self, replica_id: str, stats: dict) -> None:
        self.replicas[replica_id] = (time.time(), stats)

    def snapshot(self) -> dict:
        now = time.time()
        self.replicas = {k: v for k, v in self.replicas.items() if now - v[0] < self.FORGET_S}
        return {k: {**stats, "report_age_s": round(now - at, 1)}
                for k, (at, stats) in self.replicas.items()}


class StatsBoard:
    """The stats actor of an application: one named, detached Ray actor per application name
    (namespace ``maxdiff``), created by whichever replica asks first; redeploying the
    application reuses it. Replicas silent for 10 minutes are forgotten."""

    @staticmethod
    def get(app_name: str):
        return _Board.options(name=f"stats:{app_name}", namespace="maxdiff", get_if_exists=True,
                              lifetime="detached").remote()


class Generator:
    """Ray Serve deployment class (``build_app`` sets its options). Handle methods:
    ``generate(job) -> JobResult``, ``generate_stream(job)``, ``edit(job) -> JobResult``,
    ``info() -> dict``, ``stats() -> dict``."""

    def __init__(self, run_config, settings: ServeSettings):
        from pipelines import TextToImagePipeline

        t0 = time.perf_counter()
        self.settings = settings
        self.pipe = TextToImagePipeline.from_config(run_config)
        for spec in settings.adapters:  # before the warm-up: its programs carry the tables
            self.pipe.add_adapter(spec.name, spec.path, spec.scale)
        self.load_s = time.perf_counter() - t0
        ctx = serve.get_replica_context()
        self.replica = {"id": ctx.replica_id.unique_id,
                        "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}
        self._board = StatsBoard.get(ctx.app_name)
        self.meters = Meters(self.pipe.name.rsplit("/", 1)[-1] or "default",
                             settings.stats_window_s)
        self.ready_at: float | None = None  # unix time the warm-up finished
        parts = (self.pipe, settings, self.meters, asyncio.Lock(), self.replica, self._report)
        self.batches = BatchBackend(*parts)  # edits, and generation with engine=batch
        self.backend: Backend = self.batches
        if settings.engine == "step":
            from serving.step_backend import StepBackend

            self.backend = StepBackend(*parts)
        self.warmup_s, self.warmed = self._warm_up()
        self.ready_at = time.time()  # serving (and costing) from now on
        logger.info("generator ready on node %s: load %.1fs, warm-up %.1fs, %d program(s)",
                    self.replica["node_id"], self.load_s, self.warmup_s, self.pipe.num_compiled)
        self._report()

    def _warm_up(self) -> tuple[float, list[str]]:
        t0 = time.perf_counter()
        warmed = []
        for shape in self.settings.warmup_shapes:
            job = self.resolve(shape)
            if job is None:
                logger.warning("warm-up %s skipped: the model has no default size", shape)
                continue
            if (done := self.backend.warmup(job)) is not None:
                warmed.append(done)
        return time.perf_counter() - t0, warmed

    def resolve(self, shape: WarmupShape) -> GenerationRequest | None:
        p = self.pipe
        w, h = shape.width or p.default_width, shape.height or p.default_height
        if w is None or h is None:
            return None
        steps = shape.steps or p.default_steps
        g = p.default_guidance if shape.guidance is None else shape.guidance
        return GenerationRequest("", None, 0, 1, w, h, steps, g)

    # ------------------------------------------------------------------ handle methods
    def info(self) -> dict:
        """Defaults and limits the ingress validates against."""
        p = self.pipe
        cfg = p.run_config
        names = [type(p.scheduler).__name__]
        if cfg is not None and cfg.scheduler and cfg.scheduler not in names:
            names.insert(0, cfg.scheduler)
        return {"model": p.name, "scheduler": names[0], "scheduler_names": names,
                "default_steps": p.default_steps, "default_guidance": p.default_guidance,
                "default_width": p.default_width, "default_height": p.default_height,
                "size_multiple": size_multiple(p), "max_size": p.max_size,
                "max_steps": p.max_steps,
                "dtype": cfg.dtype if cfg else None,
                "devices": p.mesh.size, "replica": self.replica, "warmup_s": self.warmup_s,
                "warmed": self.warmed, "load_s": self.load_s,
                "adapters": [{k: a[k] for k in ("name", "scale", "layers", "rank")}
                             for a in p.adapters]}

    def stats(self, recent: int | None = None) -> dict:
        """This replica's recent batches (newest last), images served and compiled programs."""
        batches = list(self.meters.recent)
        batches = batches[-recent:] if recent else batches
        backends = {id(b): b for b in (self.batches, self.backend)}.values()
        return {"node_id": self.replica["node_id"], "pid": self.replica["pid"],
                "images": self.meters.images, "compiled_programs": self.pipe.num_compiled + sum(
                    b.num_compiled for b in backends),
                "batches": batches, "warmed": self.warmed, "warmup_s": self.warmup_s,
                "ready_at": self.ready_at, "images_by_second": self.meters.images_by_second(),
                "engine": self.backend.name, **self.backend.stats()}

    def _report(self) -> None:
        try:  # fire and forget: stats must never slow or fail a request
            self._board.report.remote(self.replica["id"], self.stats(recent=32))
        except Exception as e:
            logger.warning("stats report failed: %s", type(e).__name__)

    async def check_health(self) -> None:
        """Ray Serve's health check: a tiny program on this replica's devices with the loaded
        weights must finish within ``health_check_timeout_s`` (half of it here, to answer in
        time); otherwise raising marks the replica unhealthy and Ray Serve replaces it."""
        await asyncio.wait_for(asyncio.to_thread(self.pipe.probe),
                               self.settings.health_check_timeout_s / 2)
        self._report()  # a heartbeat: /v1/stats tells live replicas from gone ones by it

    async def generate(self, job: GenerationRequest, timeout_s: float | None = None
                       ) -> JobResult:
        """Run ``job`` on this replica's backend; returns when its images are done.
        ``timeout_s``: seconds the caller still waits; past that the job is dropped
        (:class:`Expired`)."""
        self._validate(job)
        with self.meters.holding(job.n):
            return await self.backend.generate(job, timeout_s)

    def _validate(self, job: GenerationRequest, stream: bool = False) -> None:
        """:class:`InvalidJob` unless this replica can run ``job`` (the request rules, an
        adapter it added, one image when streamed)."""
        try:
            if stream and job.n != 1:
                raise ValueError("streaming returns one image; ask for one")
            self.pipe._check(job.steps, job.height, job.width, "pil")
            job.validate()
            self.pipe._adapter_index(job.images()[:1])  # an adapter this replica added
        except ValueError as e:
            raise InvalidJob(str(e)) from None

    async def edit(self, job: EditRequest, timeout_s: float | None = None) -> JobResult:
        """Like :meth:`generate` for an image-to-image (no mask) or inpainting job; edit jobs
        are batched with the jobs of their :class:`EditKey` (on either engine)."""
        try:
            if not isinstance(job, EditRequest):
                raise ValueError(f"edit takes an EditRequest, got {type(job).__name__}")
            check([edit_adapter_problem(job.adapter)], "native")
            self.pipe._check(job.steps, job.height, job.width, "pil")
            job.validate()
        except ValueError as e:
            raise InvalidJob(str(e)) from None
        with self.meters.holding(job.n):
            return await self.batches.generate(job, timeout_s)

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
        self._validate(job, stream=True)
        with self.meters.holding(job.n):
            async with contextlib.aclosing(self.backend.stream(job, timeout_s,
                                                               partial_images)) as events:
                async for event in events:  # closed at once when the client leaves
                    yield event
