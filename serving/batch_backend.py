"""``engine=batch``: whole requests batched per shape key (and edits, on either engine).

Requests are batched with ``@serve.batch``, one batch queue per shape key (height, width,
steps, CFG on/off; an edit's :class:`pipelines.conditioned_requests.EditKey` adds its kind and strength):
only requests that can run in the same compiled program wait for each other. Batches of
different keys take turns on the devices (the replica's FIFO device lock), so no shape waits
behind another for longer than the batches queued ahead of it; a batch whose program is not
compiled yet compiles and runs without taking the lock, so a new shape's compile never stalls
the shapes already being served. A request whose deadline has passed by the time a device batch
starts is dropped from it (:class:`serving.backend.Expired`); a device batch that has started
runs to its end (one compiled program).

Edits (image-to-image and inpainting) run on ``ImageToImagePipeline.from_pipe`` /
``InpaintPipeline.from_pipe`` over the loaded weights (made once, on the first edit). Edit
programs are not warmed up: the first edit of a shape compiles (without the device lock).
ControlNet requests (:class:`pipelines.conditioned_requests.ControlRequest`) queue per
:class:`pipelines.conditioned_requests.ControlKey` (their ControlNets, size, steps, CFG on/off) and run on a
``ControlNetPipeline.from_pipe`` per set of ControlNets (sharing the loaded ControlNets' arrays);
each image carries its own control images, scales and windows, so requests that differ only
in those share a device batch. Their programs are not warmed up either."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import Iterator

import numpy as np
from ray import serve

from pipelines.conditioned_requests import EditKey
from pipelines.requests import GenerationRequest, ShapeKey, bucket_size, pad_to, plan_batches
from serving.backend import Backend, partial_steps, past_deadline
from serving.schemas import JobResult


class BatchBackend(Backend):
    """Request batching over ``pipe`` (the replica's pipeline) under ``device_lock``;
    ``report()`` runs after every batch."""

    name = "batch"
    streams_steps = False

    def __init__(self, *parts, controlnets: dict | None = None,
                 batch_ids: Iterator[int] | None = None):
        super().__init__(*parts, controlnets=controlnets, batch_ids=batch_ids)
        self._batchers: dict[tuple, object] = {}
        self._compiled: set[tuple] = set()  # (*key.program, padded batch) run so far

    def batch_sizes(self) -> list[int]:
        """The padded batch sizes warm-up compiles (every size a batch can have)."""
        sizes = self.settings.warmup_batch_sizes
        if sizes is None:
            sizes = range(1, self.settings.batch_images + 1)
        return sorted({bucket_size(n, self.pipe.mesh.size) for n in sizes})

    def warmup(self, job: GenerationRequest) -> str:
        """Run ``job``'s shape at every padded batch size (a ControlNet job: its ControlNets'
        programs)."""
        for b in self.batch_sizes():
            one = dataclasses.replace(job, n=b)
            self._device_batch(one.key, self._items(one))
            self._compiled.add((*one.key.program, b))
        if job.controlnets:
            return str(job.key)
        return f"{job.width}x{job.height}:{job.steps}:{job.guidance_scale:g}"

    @property
    def num_compiled(self) -> int:
        return self.pipes.num_compiled

    def abort(self, why: str) -> int:
        """Nothing to give up: a device batch that has started runs to its end."""
        return 0

    async def generate(self, job: GenerationRequest, timeout_s: float | None,
                       watcher: _Watcher | None = None) -> JobResult:
        """Queue ``job`` (or an :class:`EditRequest`) with the jobs of its key; returns when its
        batch has run. ``watcher``: told each step of a streamed text-to-image job."""
        now = time.perf_counter()
        result = await self._batcher(job.key)(
            (job, now, None if timeout_s is None else now + timeout_s, watcher))
        if isinstance(result, Exception):
            raise result
        return result

    async def stream(self, job: GenerationRequest, timeout_s: float | None,
                     partial_images: int = 0):
        """The queued event (``queue_position`` None: request batching does not know it); for
        text-to-image, progress after each step and ``partial_images`` previews (each step's
        estimate of the clean image, drawn by the preview decoder where one is loaded, else
        the VAE) spread over the steps, as engine=step sends them; then the result. The batch
        that carries a streamed text-to-image job runs the program variant that reports its
        steps (compiled on first use)."""
        yield {"type": "progress", "step": 0, "total": job.steps, "queue_position": None}
        watcher = None
        if type(job) is GenerationRequest:
            watcher = _Watcher(self.pipe, job.steps, partial_steps(job.steps, partial_images))
        run = asyncio.ensure_future(self.generate(job, timeout_s, watcher))
        try:
            while watcher is not None and not run.done():
                getter = asyncio.ensure_future(watcher.events.get())
                await asyncio.wait({getter, run}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                else:
                    getter.cancel()
            result = await run
        finally:
            run.cancel()
        if watcher is not None:
            async for event in watcher.rest():
                yield event
        if watcher is None or watcher.seen < job.steps:
            yield {"type": "progress", "step": job.steps, "total": job.steps,
                   "queue_position": 0}
        yield {"type": "result", "result": result}

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

    def _items(self, job: GenerationRequest) -> list[tuple]:
        """One device batch entry per image: (ImageRequest, what the job's kind adds:
        ``job.batch_extra()``)."""
        extra = job.batch_extra()
        return [(item, extra) for item in job.images()]

    def _device_batch(self, key: tuple, items: list, watchers: dict | None = None):
        """Run one padded device batch of ``key``'s items (blocking); ``watchers``: row ->
        the :class:`_Watcher` of a streamed job (its steps reported to it)."""
        on_denoised = None
        if watchers:
            def on_denoised(step, t, x0):  # in JAX's callback thread: hand the rows over
                for row, watcher in watchers.items():
                    watcher.step_done(step + 1, x0[row:row + 1])
        return self.pipes.generate(key, [r for r, _ in items], [e for _, e in items],
                                   on_denoised)

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
            expired |= {j for j, (_, _, deadline, _) in enumerate(queued)
                        if deadline is not None and now > deadline}
            part = [(j, item) for j, item in part if j not in expired]
            if not part:
                continue
            bucket = bucket_size(len(part), self.pipe.mesh.size)  # every one is warmed up
            program = (*key.program, bucket)
            # A program not compiled yet compiles (seconds to minutes) without holding the
            # devices, so batches of compiled shapes keep running meanwhile.
            lock = self._device_lock if program in self._compiled else contextlib.nullcontext()
            async with lock:
                if started is None:
                    started = time.perf_counter()
                out = await asyncio.to_thread(
                    self._device_batch, key, pad_to([item for _, item in part], bucket),
                    {row: queued[j][3] for row, (j, _) in enumerate(part) if queued[j][3]})
            self._compiled.add(program)
            flags = out.nsfw_content_detected or [None] * len(out.images)
            for (j, _), image, seed, flag in zip(part, out.images, out.seeds, flags):
                done[j].append((np.asarray(image), seed, flag))
            buckets.append(bucket)
            prepare += out.timings["prepare_s"]
            generate += out.timings["generate_s"]
        n_images = sum(len(v) for v in done.values())
        batch = {"id": next(self.batch_ids), "requests": len(jobs), "images": n_images,
                 "device_batches": buckets, "shape": str(key), "generate_s": generate,
                 "expired": len(expired),
                 "adapters": dict(collections.Counter(
                     getattr(j, "adapter", None) or "" for j in jobs))}  # "": the base model
        self.meters.served(batch, n_images)
        self.meters.batch_requests(len(jobs))
        self._report()
        if expired:
            self.meters.expired(len(expired))
        for b in buckets:
            self.meters.device_batch(b)
        if buckets:
            self.meters.step_time(generate / max(key.steps, 1) / len(buckets))
        results = []
        for j, (_, arrived, _, _) in enumerate(queued):
            if j in expired:
                results.append(past_deadline(arrived, " in the queue; its images were not "
                                                      "started"))
                continue
            queue_s = started - arrived
            self.meters.queue_wait(queue_s)
            flags = [f for _, _, f in done[j]]
            results.append(JobResult(
                images=[im for im, _, _ in done[j]], seeds=[sd for _, sd, _ in done[j]],
                timings={"queue_s": queue_s, "prepare_s": prepare, "generate_s": generate},
                batch=batch, replica=self.replica,
                filtered=None if any(f is None for f in flags) else flags))
        return results


class _Watcher:
    """A streamed text-to-image job's view of its device batch: progress after each step and
    its previews at ``at`` (steps, 1-based), as stream events in ``events``. The device batch
    reports steps from JAX's callback thread; previews are drawn off it, in order."""

    def __init__(self, pipe, steps: int, at: list[int]):
        self.pipe, self.steps, self.at = pipe, steps, at
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.seen = 0
        self._drawn: asyncio.Future | None = None  # the last preview being drawn

    def step_done(self, step: int, x0) -> None:
        """From the callback thread (a step reported once per device: counted once)."""
        if step <= self.seen:
            return
        self.seen = step
        x0 = np.array(x0)  # a copy: the device's buffer is not ours
        self.loop.call_soon_threadsafe(self._queue, step, x0)

    def _queue(self, step: int, x0) -> None:
        self.events.put_nowait({"type": "progress", "step": step, "total": self.steps,
                                "queue_position": 0})
        if step in self.at:
            before = self._drawn
            self._drawn = asyncio.ensure_future(self._draw(step, x0, before))

    async def _draw(self, step: int, x0, before) -> None:
        if before is not None:
            await before  # previews go out in step order
        image = (await asyncio.to_thread(self.pipe.draw_preview, x0))[0]
        self.events.put_nowait({"type": "partial_image", "index": self.at.index(step),
                                "step": step, "image": np.asarray(image)})

    async def rest(self):
        """The events still to send once the batch has run (previews still being drawn)."""
        await asyncio.sleep(0)  # the callbacks' last hand-overs
        if self._drawn is not None:
            await self._drawn
        while not self.events.empty():
            yield self.events.get_nowait()
