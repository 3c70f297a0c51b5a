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
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time

import numpy as np
import ray
from ray import serve
from ray.serve import metrics

from serving.schemas import Job, JobResult, ServeSettings, WarmupShape

logger = logging.getLogger("ray.serve")

_SECONDS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]
_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


class InvalidJob(ValueError):
    """A job the pipeline refuses (the ingress maps it to a 422)."""


def size_multiple(pipe) -> int:
    """Image sides must be multiples of this: the VAE's scale factor (8 for SDXL). The UNet
    upsamples to its skip connections' sizes, so latents need not divide its downsampling."""
    return pipe.vae_scale_factor


class Generator:
    """Ray Serve deployment class (``build_app`` sets its options). Handle methods:
    ``generate(job) -> JobResult``, ``info() -> dict``, ``stats() -> dict``."""

    def __init__(self, run_config, settings: ServeSettings):
        from pipelines import TextToImagePipeline

        t0 = time.perf_counter()
        self.settings = settings
        self.pipe = TextToImagePipeline.from_config(run_config)
        self.load_s = time.perf_counter() - t0
        ctx = serve.get_replica_context()
        self.replica = {"id": ctx.replica_id.unique_id,
                        "node_id": ray.get_runtime_context().get_node_id()}
        self._batchers: dict[tuple, object] = {}
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
        self._tags = {"model": self.pipe.name.rsplit("/", 1)[-1] or "default"}
        self.warmup_s, self.warmed = self._warm_up()
        logger.info("generator ready on node %s: load %.1fs, warm-up %.1fs, %d program(s)",
                    self.replica["node_id"], self.load_s, self.warmup_s, self.pipe.num_compiled)

    # ------------------------------------------------------------------ warm-up
    def warmup_batch_sizes(self) -> list[int]:
        from maxdiff.mesh import bucket_size

        sizes = self.settings.warmup_batch_sizes
        if sizes is None:
            sizes = range(1, self.settings.batch_images + 1)
        return sorted({bucket_size(n, self.pipe.mesh.size) for n in sizes})

    def _warm_up(self) -> tuple[float, list[str]]:
        from pipelines import ImageRequest

        t0 = time.perf_counter()
        warmed = []
        for shape in self.settings.warmup_shapes:
            job = self.resolve(shape)
            if job is None:
                logger.warning("warm-up %s skipped: the model has no default size", shape)
                continue
            for b in self.warmup_batch_sizes():
                items = [ImageRequest("", seed=k, guidance_scale=job.guidance_scale)
                         for k in range(b)]
                self.pipe.generate(items, height=job.height, width=job.width,
                                   num_inference_steps=job.steps)
                self._compiled.add((*job.key, b))
            warmed.append(f"{job.width}x{job.height}:{job.steps}:{job.guidance_scale:g}")
        return time.perf_counter() - t0, warmed

    def resolve(self, shape: WarmupShape) -> Job | None:
        p = self.pipe
        w, h = shape.width or p.default_width, shape.height or p.default_height
        if w is None or h is None:
            return None
        steps = shape.steps or p.default_steps
        g = p.default_guidance if shape.guidance is None else shape.guidance
        return Job("", None, 0, 1, w, h, steps, g)

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
                "size_multiple": size_multiple(p), "dtype": cfg.dtype if cfg else None,
                "devices": p.mesh.size, "replica": self.replica, "warmup_s": self.warmup_s,
                "warmed": self.warmed, "load_s": self.load_s}

    def stats(self) -> dict:
        """This replica's recent batches (newest last), images served and compiled programs."""
        return {"replica": self.replica, "images": self._images_total,
                "compiled_programs": self.pipe.num_compiled, "batches": list(self._recent),
                "warmed": self.warmed, "warmup_s": self.warmup_s}

    async def generate(self, job: Job) -> JobResult:
        """Queue ``job`` with the jobs of its shape key; returns when its batch has run."""
        from pipelines import ImageRequest

        try:
            self.pipe._check(job.steps, job.height, job.width, "pil")
            ImageRequest(job.prompt, negative_prompt=job.negative_prompt, seed=job.seed,
                         guidance_scale=job.guidance_scale).validate()
        except ValueError as e:
            raise InvalidJob(str(e)) from None
        job._arrived = time.perf_counter()
        return await self._batcher(job.key)(job)

    # ------------------------------------------------------------------ batching
    def _batcher(self, key: tuple):
        fn = self._batchers.get(key)
        if fn is None:
            async def run_batch(jobs: list[Job]) -> list[JobResult]:
                return await self._run_batch(key, jobs)

            fn = serve.batch(max_batch_size=self.settings.max_batch_size,
                             batch_wait_timeout_s=self.settings.batch_wait_timeout_s)(run_batch)
            self._batchers[key] = fn
        return fn

    async def _run_batch(self, key: tuple, jobs: list[Job]) -> list[JobResult]:
        from maxdiff.mesh import bucket_size
        from pipelines import ImageRequest

        height, width, steps, _ = key
        items, owner = [], []
        for j, job in enumerate(jobs):
            for k in range(job.n):
                seed = None if job.seed is None else job.seed + k
                items.append(ImageRequest(prompt=job.prompt, negative_prompt=job.negative_prompt,
                                          seed=seed, guidance_scale=job.guidance_scale))
                owner.append(j)
        images: list[np.ndarray] = []
        seeds: list[int] = []
        buckets: list[int] = []
        prepare = generate = 0.0
        started = None
        chunk = self.settings.batch_images
        for start in range(0, len(items), chunk):
            part = items[start:start + chunk]
            program = (*key, bucket_size(len(part), self.pipe.mesh.size))
            # A program not compiled yet compiles (seconds to minutes) without holding the
            # devices, so batches of compiled shapes keep running meanwhile.
            lock = self._device_lock if program in self._compiled else contextlib.nullcontext()
            async with lock:
                if started is None:
                    started = time.perf_counter()
                out = await asyncio.to_thread(self.pipe.generate, part, height=height,
                                              width=width, num_inference_steps=steps,
                                              output_type="pil")
            self._compiled.add(program)
            images += [np.asarray(im) for im in out.images]
            seeds += out.seeds
            buckets.append(int(out.timings["batch"]))
            prepare += out.timings["prepare_s"]
            generate += out.timings["generate_s"]
        batch = {"id": next(self._batch_ids), "requests": len(jobs), "images": len(items),
                 "device_batches": buckets, "shape": f"{width}x{height}:{steps}:"
                 f"{'cfg' if key[3] else 'nocfg'}", "generate_s": generate}
        self._recent.append(batch)
        self._images_total += len(items)
        self._m_images.inc(len(items), tags=self._tags)
        self._m_batch.observe(len(jobs), tags=self._tags)
        for b in buckets:
            self._m_device_batch.observe(b, tags=self._tags)
        self._m_step.observe(generate / max(steps, 1) / max(len(buckets), 1), tags=self._tags)
        results = []
        for j, job in enumerate(jobs):
            mine = [k for k, o in enumerate(owner) if o == j]
            queue_s = started - job._arrived
            self._m_queue.observe(queue_s, tags=self._tags)
            results.append(JobResult(
                images=[images[k] for k in mine], seeds=[seeds[k] for k in mine],
                timings={"queue_s": queue_s, "prepare_s": prepare, "generate_s": generate},
                batch=batch, replica=self.replica))
        return results
