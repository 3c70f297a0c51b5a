"""The generator deployment: one ``TextToImagePipeline`` per replica, dynamic batching.

Each replica owns its host's local devices (the pipeline's mesh shards every device batch over
them). Requests are batched with ``@serve.batch``, one batch queue per shape key
(height, width, steps, CFG on/off): only requests that can run in the same compiled program wait
for each other. Batches of different keys take turns on the devices (a FIFO lock), so no shape
waits behind another for longer than the batches queued ahead of it; a batch whose program is not
compiled yet compiles and runs without taking the lock, so a new shape's compile never stalls
the shapes already being served.

The constructor loads the model and compiles every ``warmup_shapes`` program (at every padded
batch size a batch can have) before it returns; Ray Serve routes to a replica only after that.

A request carries the seconds it has left (the ingress's deadline); a request whose deadline has
passed by the time a device batch starts is dropped from it (``Expired``, counted in
``maxdiff_expired_requests``), so no work is done for a client that has stopped waiting. A device
batch that has started runs to its end (one compiled program).

Edits (``edit(job)``, an :class:`pipelines.requests.EditRequest`): image-to-image and inpainting
with ``ImageToImagePipeline.from_pipe`` / ``InpaintPipeline.from_pipe`` over the loaded weights
(made once, on the first edit), batched per :class:`pipelines.requests.EditKey` (kind, size,
steps, CFG on/off, strength) under the same device lock, deadlines and stats. Edit programs are
not warmed up: the first edit of a shape compiles (without holding the device lock).

With the serve arg ``engine=step`` generation runs on step-level continuous batching instead
(:class:`pipelines.step_engine.StepEngine`, one engine of ``engine_slots`` slots per image size,
compiled at warm-up for ``warmup_shapes`` sizes; another size is compiled in a thread on its
first request, without the device lock, while the others keep ticking): a request's images join
free slots between denoising steps and leave as soon as their own steps are done, so a 2-step
image does not wait for a 40-step one. One asyncio task drives the engines: while any has work
it runs a tick of each in a thread (under the device lock) and resolves the futures of finished
images; engines starting from idle first wait up to ``batch_wait_timeout_s`` for their slots to
fill. A tick returns only once the device has run the tick before it (the engine's pacing), so
admission, progress events, previews and cancellation follow the steps the device has run, not
the ones the host has queued. A request whose client goes away
(Ray Serve cancels the call) or whose deadline passes has its images cancelled: their slots are
freed at the next tick (``cancelled`` in ``/v1/stats``, ``maxdiff_cancelled_images``).
:meth:`Generator.generate_stream` yields progress events, partial images (the engine's
denoised-estimate previews) and the result, for the streaming routes. Edits keep the batch path.

Health: Ray Serve calls :meth:`Generator.check_health` every ``health_check_period_s``; it runs a
tiny program on the replica's devices with the loaded weights and raises if that fails or
hangs, so Ray Serve replaces the replica. After every batch a replica reports its stats to the
application's :class:`StatsBoard` actor, which ``/v1/stats`` reads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import time

import numpy as np
import ray
from ray import serve
from ray.serve import metrics

from pipelines.requests import (EditKey, EditRequest, GenerationRequest, ShapeKey, bucket_size,
                                pad_to, plan_batches)
from serving.schemas import JobResult, ServeSettings, WarmupShape

logger = logging.getLogger("ray.serve")

_SECONDS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]
_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


class InvalidJob(ValueError):
    """A job the pipeline refuses (the ingress maps it to a 422)."""


class Expired(TimeoutError):
    """The request's deadline passed before its images started on the devices."""


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
    ``generate(job) -> JobResult``, ``edit(job) -> JobResult``, ``info() -> dict``,
    ``stats() -> dict``."""

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
        self._batchers: dict[tuple, object] = {}
        self._edit_pipes: dict[str, object] = {}  # kind -> pipeline sharing self.pipe's weights
        self._device_lock = asyncio.Lock()  # FIFO: batches of different shapes take turns
        self._compiled: set[tuple] = set()  # (height, width, steps, cfg, padded batch) run so far
        self._batch_ids = itertools.count(1)
        self._recent = collections.deque(maxlen=256)
        self._images_total = 0
        tags = ("model",)
        self._m_images = metrics.Counter(
            "maxdiff_images_generated", "Images generated.", tag_keys=tags)
        self._m_batch = metrics.Histogram(
            "maxdiff_batch_requests", "Requests per batch (one shape key).", _SIZES, tag_keys=tags)
        self._m_device_batch = metrics.Histogram(
            "maxdiff_device_batch_images", "Padded images per device batch.", _SIZES, tag_keys=tags)
        self._m_queue = metrics.Histogram(
            "maxdiff_queue_wait_s", "Seconds from arrival at the replica to its batch starting "
            "on the devices.", _SECONDS, tag_keys=tags)
        self._m_step = metrics.Histogram(
            "maxdiff_step_time_s", "Device seconds per denoising step (whole batch, including "
            "text encoders and VAE decode spread over the steps).", _SECONDS, tag_keys=tags)
        self._m_expired = metrics.Counter(
            "maxdiff_expired_requests", "Requests dropped unstarted because their deadline "
            "passed in the queue.", tag_keys=tags)
        self._m_cancelled = metrics.Counter(
            "maxdiff_cancelled_images", "Step-engine images cancelled (client gone or deadline "
            "passed); their slots are freed at the next tick.", tag_keys=tags)
        self._tags = {"model": self.pipe.name.rsplit("/", 1)[-1] or "default"}
        self._engines: dict[tuple[int, int], object] = {}  # engine=step: (height, width) -> engine
        self._warming: dict[tuple[int, int], asyncio.Future] = {}  # sizes being compiled
        self._engine_wake: asyncio.Event | None = None
        self._engine_task: asyncio.Task | None = None
        self._engine_ids = itertools.count(1)
        self.warmup_s, self.warmed = self._warm_up()
        logger.info("generator ready on node %s: load %.1fs, warm-up %.1fs, %d program(s)",
                    self.replica["node_id"], self.load_s, self.warmup_s, self.pipe.num_compiled)
        self._report()

    # ------------------------------------------------------------------ warm-up
    def warmup_batch_sizes(self) -> list[int]:
        sizes = self.settings.warmup_batch_sizes
        if sizes is None:
            sizes = range(1, self.settings.batch_images + 1)
        return sorted({bucket_size(n, self.pipe.mesh.size) for n in sizes})

    def _warm_up(self) -> tuple[float, list[str]]:
        t0 = time.perf_counter()
        warmed = []
        for shape in self.settings.warmup_shapes:
            job = self.resolve(shape)
            if job is None:
                logger.warning("warm-up %s skipped: the model has no default size", shape)
                continue
            if self.settings.engine == "step":  # one engine per size, whatever the steps
                if (job.height, job.width) not in self._engines:
                    self._engine(job.height, job.width).warmup()
                    warmed.append(f"{job.width}x{job.height}:step-engine")
                continue
            for b in self.warmup_batch_sizes():
                job = GenerationRequest("", None, 0, b, job.width, job.height, job.steps,
                                        job.guidance_scale)
                self.pipe.generate(job.images(), height=job.height, width=job.width,
                                   num_inference_steps=job.steps)
                self._compiled.add((*job.key, b))
            warmed.append(f"{job.width}x{job.height}:{job.steps}:{job.guidance_scale:g}")
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
        batches = list(self._recent)[-recent:] if recent else list(self._recent)
        out = {"node_id": self.replica["node_id"], "pid": self.replica["pid"],
               "images": self._images_total, "compiled_programs": self.pipe.num_compiled + sum(
                   p.num_compiled for p in self._edit_pipes.values()) + sum(
                   e.num_compiled for e in self._engines.values()),
               "batches": batches, "warmed": self.warmed, "warmup_s": self.warmup_s,
               "engine": self.settings.engine}
        if self.settings.engine == "step":
            out["engines"] = {f"{w}x{h}": {"slots": e.slots, "active": e.active,
                                           "queued": e.queued, **e.stats}
                              for (h, w), e in self._engines.items()}
            out["cancelled"] = sum(e.stats["cancelled"] for e in self._engines.values())
        return out

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

    async def generate(self, job: GenerationRequest, timeout_s: float | None = None
                       ) -> JobResult:
        """Queue ``job`` with the jobs of its shape key; returns when its batch has run.
        ``timeout_s``: seconds the caller still waits; past that the job is dropped before its
        images start (:class:`Expired`)."""
        self._validate(job)
        if self.settings.engine == "step":
            return await self._on_engine(job, timeout_s)
        return await self._queue(job, timeout_s)

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
        are batched with the jobs of their :class:`EditKey`."""
        try:
            if not isinstance(job, EditRequest):
                raise ValueError(f"edit takes an EditRequest, got {type(job).__name__}")
            if job.adapter is not None:
                raise ValueError("adapters are not applied to edits (image-to-image, "
                                 "inpainting); only to generation")
            self.pipe._check(job.steps, job.height, job.width, "pil")
            job.validate()
        except ValueError as e:
            raise InvalidJob(str(e)) from None
        return await self._queue(job, timeout_s)

    async def _queue(self, job: GenerationRequest, timeout_s: float | None) -> JobResult:
        now = time.perf_counter()
        result = await self._batcher(job.key)(
            (job, now, None if timeout_s is None else now + timeout_s))
        if isinstance(result, Exception):
            raise result
        return result

    def _edit_pipe(self, kind: str):
        pipe = self._edit_pipes.get(kind)
        if pipe is None:
            from pipelines.edit import ImageToImagePipeline, InpaintPipeline

            cls = InpaintPipeline if kind == "inpaint" else ImageToImagePipeline
            pipe = self._edit_pipes[kind] = cls.from_pipe(self.pipe)
        return pipe

    def _items(self, job: GenerationRequest) -> list:
        """What one device batch entry is: an ImageRequest, or for an edit (ImageRequest,
        image, mask) with the image and mask as PIL images (resized by the pipeline as
        diffusers does when the size differs)."""
        if not isinstance(job, EditRequest):
            return job.images()
        from PIL import Image

        image = Image.fromarray(job.image)
        mask = None if job.mask is None else Image.fromarray(job.mask, mode="L")
        return [(item, image, mask) for item in job.images()]

    def _device_batch(self, key: tuple, items: list):
        """Run one padded device batch of ``key``'s items (blocking)."""
        if isinstance(key, EditKey):
            pipe = self._edit_pipe(key.kind)
            return pipe.generate([r for r, _, _ in items], [im for _, im, _ in items],
                                 [m for _, _, m in items] if key.kind == "inpaint" else None,
                                 strength=key.strength, height=key.height, width=key.width,
                                 num_inference_steps=key.steps)
        return self.pipe.generate(items, height=key.height, width=key.width,
                                  num_inference_steps=key.steps)

    # ------------------------------------------------------------------ step engine
    def _new_engine(self, height: int, width: int):
        """A step engine of a size (not compiled), ``engine_slots`` rounded up to a multiple
        of the mesh size."""
        from pipelines.step_engine import StepEngine

        m = self.pipe.mesh.size
        return StepEngine(self.pipe, height, width, slots=-(-self.settings.slots // m) * m)

    def _engine(self, height: int, width: int):
        """The step engine of a size, made (not compiled) on first use; blocking."""
        eng = self._engines.get((height, width))
        if eng is None:
            eng = self._engines[(height, width)] = self._new_engine(height, width)
        return eng

    async def _ready_engine(self, height: int, width: int):
        """The step engine of a size; a size not warmed up is made and compiled in a thread
        first, without the device lock, so the engines already serving keep ticking."""
        eng = self._engines.get((height, width))
        if eng is not None:
            return eng
        task = self._warming.get((height, width))
        if task is None:
            def make():
                new = self._new_engine(height, width)
                new.warmup()
                return new

            task = self._warming[(height, width)] = asyncio.ensure_future(asyncio.to_thread(make))
        try:
            eng = await asyncio.shield(task)
        finally:
            if task.done():
                self._warming.pop((height, width), None)
        return self._engines.setdefault((height, width), eng)

    def _wake_engines(self) -> None:
        if self._engine_wake is None:
            self._engine_wake = asyncio.Event()
        if self._engine_task is None or self._engine_task.done():
            self._engine_task = asyncio.get_running_loop().create_task(self._drive_engines())
        self._engine_wake.set()

    def _tick_engines(self) -> list:
        out = []
        for eng in list(self._engines.values()):
            if not eng.idle:
                out += eng.tick()
        return out

    async def _drive_engines(self) -> None:
        """While any engine has work: one tick of each (in a thread, holding the device lock),
        then resolve the futures of the images that finished or were cancelled."""
        while True:
            if all(e.idle for e in self._engines.values()):
                self._engine_wake.clear()
                await self._engine_wake.wait()
                await self._gather_arrivals()
                continue
            try:
                async with self._device_lock:
                    ended = await asyncio.to_thread(self._tick_engines)
            except Exception as e:  # a failed tick fails its images, never the loop
                logger.error("step engine tick failed: %s", e)
                for eng in self._engines.values():
                    for h in eng.abort():
                        fut = getattr(h, "future", None)
                        if fut is not None and not fut.done():
                            fut.set_exception(RuntimeError(f"generation failed: {e}"))
                continue
            cancelled = 0
            for h in ended:
                fut = getattr(h, "future", None)
                if h.status == "cancelled":
                    cancelled += 1
                    if fut is not None and not fut.done():
                        fut.cancel()
                elif fut is not None and not fut.done():
                    fut.set_result(h)
            if cancelled:
                self._m_cancelled.inc(cancelled, tags=self._tags)
            if ended:
                self._report()

    async def _gather_arrivals(self) -> None:
        """Engines starting from idle wait up to ``batch_wait_timeout_s`` for their free slots
        to fill (requests sent together arrive a few ms apart, and an image that misses the
        first tick finishes a tick later than its batch-mates); a running engine never waits."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.batch_wait_timeout_s
        while True:
            busy = [e for e in self._engines.values() if not e.idle]
            if any(e.active for e in busy) or all(e.queued >= e.slots for e in busy):
                return
            left = deadline - loop.time()
            if left <= 0:
                return
            self._engine_wake.clear()
            try:
                await asyncio.wait_for(self._engine_wake.wait(), left)
            except asyncio.TimeoutError:
                return

    async def _submit(self, job: GenerationRequest, on_progress=None, previews=()) -> list:
        eng = await self._ready_engine(job.height, job.width)
        loop = asyncio.get_running_loop()
        handles = []
        for item in job.images():
            h = eng.submit(item, job.steps, on_progress, previews)
            h.future = loop.create_future()
            h.engine = eng
            handles.append(h)
        self._wake_engines()
        return handles

    def _engine_result(self, job: GenerationRequest, handles: list, arrived: float) -> JobResult:
        started = min(h.started_at for h in handles)
        finished = max(h.finished_at for h in handles)
        images = [np.asarray(h.image) for h in handles]
        # ids in the order requests finish
        batch = {"id": next(self._engine_ids), "requests": 1, "images": len(images),
                 "engine": "step", "shape": f"{job.width}x{job.height}:{job.steps}",
                 "slots": handles[0].engine.slots, "generate_s": finished - started}
        self._recent.append(batch)
        self._images_total += len(images)
        self._m_images.inc(len(images), tags=self._tags)
        self._m_queue.observe(started - arrived, tags=self._tags)
        self._m_step.observe((finished - started) / max(job.steps, 1), tags=self._tags)
        return JobResult(images=images, seeds=[h.seed for h in handles],
                         timings={"queue_s": started - arrived, "prepare_s": 0.0,
                                  "generate_s": finished - started},
                         batch=batch, replica=self.replica)

    def _cancel(self, handles: list) -> None:
        for h in handles:
            h.engine.cancel(h)
        self._wake_engines()

    async def _on_engine(self, job: GenerationRequest, timeout_s: float | None) -> JobResult:
        """Run ``job`` on the step engine of its size; its images are cancelled (slots freed at
        the next tick) when the caller goes away or ``timeout_s`` passes."""
        arrived = time.perf_counter()
        handles = await self._submit(job)
        try:
            await asyncio.wait_for(asyncio.gather(*[h.future for h in handles]), timeout_s)
        except asyncio.TimeoutError:
            self._cancel(handles)
            self._m_expired.inc(1, tags=self._tags)
            raise Expired(f"the request's deadline passed after "
                          f"{time.perf_counter() - arrived:.1f} s; its images were cancelled")
        except BaseException:  # cancelled: the client went away
            self._cancel(handles)
            raise
        return self._engine_result(job, handles, arrived)

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
        if self.settings.engine != "step":
            yield {"type": "progress", "step": 0, "total": job.steps, "queue_position": None}
            result = await self._queue(job, timeout_s)
            yield {"type": "progress", "step": job.steps, "total": job.steps,
                   "queue_position": 0}
            yield {"type": "result", "result": result}
            return
        arrived = time.perf_counter()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        n = job.steps
        partial_at = sorted({max(1, min(n - 1, round(n * (k + 1) / (partial_images + 1))))
                             for k in range(partial_images)}) if n > 1 else []

        def progress(h):  # in the ticking thread: after a step ran, or a new queue position
            ev = [{"type": "progress", "step": h.step, "total": h.steps,
                   "queue_position": h.queue_position}]
            if h.step in partial_at and h.preview_step == h.step:  # decoded after this step
                ev.append({"type": "partial_image", "index": partial_at.index(h.step),
                           "step": h.step, "image": np.asarray(h.preview)})
            for e in ev:
                loop.call_soon_threadsafe(events.put_nowait, e)

        handles = await self._submit(job, progress, partial_at)
        h = handles[0]
        deadline = None if timeout_s is None else arrived + timeout_s
        try:
            yield {"type": "progress", "step": 0, "total": n,
                   "queue_position": h.engine.queue_position(h)}
            while not h.future.done() or not events.empty():
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    raise asyncio.TimeoutError
                getter = asyncio.ensure_future(events.get())
                done, _ = await asyncio.wait({getter, h.future}, timeout=left,
                                             return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                else:
                    getter.cancel()
                    if not done:
                        raise asyncio.TimeoutError
            h.future.result()
        except asyncio.TimeoutError:
            self._cancel(handles)
            self._m_expired.inc(1, tags=self._tags)
            raise Expired(f"the request's deadline passed after "
                          f"{time.perf_counter() - arrived:.1f} s; its image was cancelled")
        except BaseException:  # the client went away (the stream was cancelled)
            self._cancel(handles)
            raise
        yield {"type": "result", "result": self._engine_result(job, handles, arrived)}

    # ------------------------------------------------------------------ batching
    def _batcher(self, key: tuple):
        fn = self._batchers.get(key)
        if fn is None:
            async def run_batch(jobs: list[tuple]) -> list:
                return await self._run_batch(key, jobs)

            fn = serve.batch(max_batch_size=self.settings.max_batch_size,
                             batch_wait_timeout_s=self.settings.batch_wait_timeout_s)(run_batch)
            self._batchers[key] = fn
        return fn

    async def _run_batch(self, key: ShapeKey | EditKey, queued: list[tuple]) -> list:
        """Run one batch of same-key jobs as device batches of at most ``batch_images``
        images; jobs whose deadline has passed when a device batch starts are dropped."""
        jobs = [q[0] for q in queued]
        images = [(j, item) for j, job in enumerate(jobs) for item in self._items(job)]
        done: dict[int, list] = {j: [] for j in range(len(jobs))}  # (image, seed) per job
        expired: set[int] = set()
        buckets: list[int] = []
        prepare = generate = 0.0
        started = None
        for _, part, _ in plan_batches(images, lambda _: key, self.settings.batch_images,
                                            self.pipe.mesh.size):
            now = time.perf_counter()
            expired |= {j for j, (_, _, deadline) in enumerate(queued)
                        if deadline is not None and now > deadline}
            part = [(j, item) for j, item in part if j not in expired]
            if not part:
                continue
            bucket = bucket_size(len(part), self.pipe.mesh.size)  # every one is warmed up
            program = (*(key.program if isinstance(key, EditKey) else key), bucket)
            # A program not compiled yet compiles (seconds to minutes) without holding the
            # devices, so batches of compiled shapes keep running meanwhile.
            lock = self._device_lock if program in self._compiled else contextlib.nullcontext()
            async with lock:
                if started is None:
                    started = time.perf_counter()
                out = await asyncio.to_thread(
                    self._device_batch, key, pad_to([item for _, item in part], bucket))
            self._compiled.add(program)
            for (j, _), image, seed in zip(part, out.images, out.seeds):
                done[j].append((np.asarray(image), seed))
            buckets.append(bucket)
            prepare += out.timings["prepare_s"]
            generate += out.timings["generate_s"]
        n_images = sum(len(v) for v in done.values())
        batch = {"id": next(self._batch_ids), "requests": len(jobs), "images": n_images,
                 "device_batches": buckets, "shape": str(key), "generate_s": generate,
                 "expired": len(expired),
                 "adapters": dict(collections.Counter(
                     getattr(j, "adapter", None) or "" for j in jobs))}  # "": the base model
        self._recent.append(batch)
        self._images_total += n_images
        self._m_images.inc(n_images, tags=self._tags)
        self._m_batch.observe(len(jobs), tags=self._tags)
        self._report()
        if expired:
            self._m_expired.inc(len(expired), tags=self._tags)
        for b in buckets:
            self._m_device_batch.observe(b, tags=self._tags)
        if buckets:
            self._m_step.observe(generate / max(key.steps, 1) / len(buckets), tags=self._tags)
        results = []
        for j, (job, arrived, _) in enumerate(queued):
            if j in expired:
                results.append(Expired(f"the request's deadline passed after "
                                       f"{time.perf_counter() - arrived:.1f} s in the queue; "
                                       "its images were not started"))
                continue
            queue_s = started - arrived
            self._m_queue.observe(queue_s, tags=self._tags)
            results.append(JobResult(
                images=[im for im, _ in done[j]], seeds=[sd for _, sd in done[j]],
                timings={"queue_s": queue_s, "prepare_s": prepare, "generate_s": generate},
                batch=batch, replica=self.replica))
        return results
