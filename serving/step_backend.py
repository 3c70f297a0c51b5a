"""``engine=step``: step-level continuous batching (:class:`pipelines.step_engine.StepEngine`).

One engine of ``engine_slots`` slots per image size, compiled at warm-up for ``warmup_shapes``
sizes; another size is compiled in a thread on its first request, without the device lock,
while the others keep ticking. A request's images join free slots between denoising steps and
leave as soon as their own steps are done, so a 2-step image does not wait for a 40-step one.
ControlNet requests (:class:`pipelines.conditioned_requests.ControlRequest`) run on engines of their own,
one per set of ControlNets (in the request's order) and size, over a ``ControlNetPipeline``:
each slot holds its image's control images, scales and window, so requests with other control
images, scales, windows, step counts or guidance share steps; such an engine is compiled (in a
thread, like a new size) on the first request that needs it.

One asyncio task drives the engines: while any has work it runs a tick of each in a thread
(under the replica's device lock) and resolves the futures of finished images; engines starting
from idle first wait up to ``batch_wait_timeout_s`` for their slots to fill. A tick returns only
once the device has run the tick before it (the engine's pacing), so admission, progress
events, previews and cancellation follow the steps the device has run, not the ones the host
has queued. A request whose client goes away (Ray Serve cancels the call) or whose deadline
passes has its images cancelled: their slots are freed at the next tick (``cancelled`` in
``/v1/stats``, ``maxdiff_cancelled_images``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pipelines.requests import GenerationRequest
from serving.backend import Backend, partial_steps, past_deadline
from serving.schemas import JobResult

logger = logging.getLogger("ray.serve")


@dataclass(eq=False)
class _Image:
    """One submitted image: its engine handle, its engine, and the future the driving task
    resolves (with the handle) when it finishes, or cancels."""

    handle: object  # pipelines.step_engine.Handle
    engine: object  # the StepEngine it was submitted to
    future: asyncio.Future


class StepBackend(Backend):
    """Step engines over ``pipe`` (the replica's pipeline), one per image size, ticked under
    ``device_lock``; ``report()`` runs after every tick that ended images."""

    name = "step"
    streams_steps = True

    def __init__(self, *parts, controlnets: dict | None = None,
                 batch_ids: Iterator[int] | None = None):
        super().__init__(*parts, controlnets=controlnets, batch_ids=batch_ids)
        # (height, width, ControlNet names) -> engine; names () for text-to-image
        self._engines: dict[tuple[int, int, tuple], object] = {}
        self._warming: dict[tuple[int, int, tuple], asyncio.Future] = {}  # being compiled
        self._images: dict[object, _Image] = {}  # engine handle -> image, until it ends
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ engines
    @staticmethod
    def _key(job: GenerationRequest) -> tuple[int, int, tuple]:
        return job.height, job.width, job.controlnets

    def _new_engine(self, key: tuple[int, int, tuple]):
        """A step engine of a size (not compiled; over the ControlNet pipeline of its
        ControlNets, if any), ``engine_slots`` rounded up to a multiple of the mesh size,
        admitting by ``step_policy``."""
        from pipelines.step_engine import StepEngine

        height, width, names = key
        m = self.pipe.mesh.size
        pipe = self.pipes.control(names) if names else self.pipe
        return StepEngine(pipe, height, width, slots=-(-self.settings.slots // m) * m,
                          policy=self.settings.step_policy)

    def warmup(self, job: GenerationRequest) -> str | None:
        """One engine per size, whatever the steps: made and compiled on its size's first
        shape."""
        key = self._key(job)
        if key in self._engines:
            return None
        eng = self._engines[key] = self._new_engine(key)
        eng.warmup()
        return f"{self._name(key)}:step-engine"

    @staticmethod
    def _name(key: tuple[int, int, tuple]) -> str:
        height, width, names = key
        size = f"{width}x{height}"
        return f"controlnet[{'+'.join(names)}]:{size}" if names else size

    @property
    def num_compiled(self) -> int:
        return sum(e.num_compiled for e in self._engines.values())

    def stats(self) -> dict:
        return {"engines": {self._name(key): {"slots": e.slots, "policy": e.policy.name,
                                              "active": e.active, "queued": e.queued, **e.stats}
                            for key, e in self._engines.items()},
                "cancelled": sum(e.stats["cancelled"] for e in self._engines.values())}

    async def _ready_engine(self, key: tuple[int, int, tuple]):
        """The step engine of a size and ControlNet set; one not warmed up is made and compiled
        in a thread first, without the device lock, so the engines already serving keep
        ticking."""
        eng = self._engines.get(key)
        if eng is not None:
            return eng
        task = self._warming.get(key)
        if task is None:
            def make():
                new = self._new_engine(key)
                new.warmup()
                return new

            task = self._warming[key] = asyncio.ensure_future(asyncio.to_thread(make))
        try:
            eng = await asyncio.shield(task)
        finally:
            if task.done():
                self._warming.pop(key, None)
        return self._engines.setdefault(key, eng)

    # ------------------------------------------------------------------ the driving task
    def _wake_engines(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drive())
        self._wake.set()

    def _tick_engines(self) -> list:
        out = []
        for eng in list(self._engines.values()):
            if not eng.idle:
                out += eng.tick()
        return out

    async def _drive(self) -> None:
        """While any engine has work: one tick of each (in a thread, holding the device lock),
        then resolve the futures of the images that finished or were cancelled."""
        while True:
            if all(e.idle for e in self._engines.values()):
                self._wake.clear()
                await self._wake.wait()
                await self._gather_arrivals()
                continue
            try:
                async with self._device_lock:
                    ended = await asyncio.to_thread(self._tick_engines)
            except Exception as e:  # a failed tick fails its images, never the loop
                logger.error("step engine tick failed: %s", e)
                self.abort(f"generation failed: {e}")
                continue
            cancelled = 0
            for h in ended:
                image = self._images.pop(h, None)
                fut = None if image is None else image.future
                if h.status == "cancelled":
                    cancelled += 1
                    if fut is not None and not fut.done():
                        fut.cancel()
                elif fut is not None and not fut.done():
                    fut.set_result(h)
            if cancelled:
                self.meters.cancelled(cancelled)
            if ended:
                self._report()

    def abort(self, why: str) -> int:
        """Give up every image not finished (the engines drop their queues, slots and ticks in
        flight); their requests fail with ``RuntimeError(why)``."""
        lost = 0
        for eng in self._engines.values():
            for h in eng.abort():
                lost += 1
                image = self._images.pop(h, None)
                if image is not None and not image.future.done():
                    image.future.set_exception(RuntimeError(why))
        return lost

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
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except asyncio.TimeoutError:
                return

    # ------------------------------------------------------------------ jobs
    async def _submit(self, job: GenerationRequest, on_progress=None, previews=()
                      ) -> list[_Image]:
        eng = await self._ready_engine(self._key(job))
        loop = asyncio.get_running_loop()
        controls = job.batch_extra()  # (text-to-image: None; ControlNet: its controls)
        images = []
        for item in job.images():
            h = eng.submit(item, job.steps, on_progress, previews, controls, job.priority)
            self._images[h] = image = _Image(h, eng, loop.create_future())
            images.append(image)
        self._wake_engines()
        return images

    def _cancel(self, images: list[_Image]) -> None:
        for im in images:
            im.engine.cancel(im.handle)
        self._wake_engines()

    def _result(self, job: GenerationRequest, images: list[_Image], arrived: float
                ) -> JobResult:
        handles = [im.handle for im in images]
        started = min(h.started_at for h in handles)
        finished = max(h.finished_at for h in handles)
        pixels = [np.asarray(h.image) for h in handles]
        # ids in the order requests finish
        batch = {"id": next(self.batch_ids), "requests": 1, "images": len(pixels),
                 "engine": "step", "shape": f"{self._name(self._key(job))}:{job.steps}",
                 "slots": images[0].engine.slots, "generate_s": finished - started}
        self.meters.served(batch, len(pixels))
        self.meters.queue_wait(started - arrived)
        self.meters.step_time((finished - started) / max(job.steps, 1))
        flags = [h.nsfw for h in handles]  # None: not checked (no checker, or turned off)
        return JobResult(images=pixels, seeds=[h.seed for h in handles],
                         timings={"queue_s": started - arrived, "prepare_s": 0.0,
                                  "generate_s": finished - started},
                         batch=batch, replica=self.replica,
                         filtered=None if any(f is None for f in flags) else flags)

    async def generate(self, job: GenerationRequest, timeout_s: float | None) -> JobResult:
        """Run ``job`` on the step engine of its size; its images are cancelled (slots freed at
        the next tick) when the caller goes away or ``timeout_s`` passes."""
        arrived = time.perf_counter()
        images = await self._submit(job)
        try:
            await asyncio.wait_for(asyncio.gather(*[im.future for im in images]), timeout_s)
        except asyncio.TimeoutError:
            self._cancel(images)
            self.meters.expired()
            raise past_deadline(arrived, "; its images were cancelled") from None
        except BaseException:  # cancelled: the client went away
            self._cancel(images)
            raise
        return self._result(job, images, arrived)

    async def stream(self, job: GenerationRequest, timeout_s: float | None,
                     partial_images: int = 0):
        """Progress once when queued, whenever its queue position changes and after each step;
        ``partial_images`` previews spread over the steps; then the result."""
        arrived = time.perf_counter()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        n = job.steps
        partial_at = partial_steps(n, partial_images)

        def progress(h):  # in the ticking thread: after a step ran, or a new queue position
            ev = [{"type": "progress", "step": h.step, "total": h.steps,
                   "queue_position": h.queue_position}]
            if h.step in partial_at and h.preview_step == h.step:  # decoded after this step
                ev.append({"type": "partial_image", "index": partial_at.index(h.step),
                           "step": h.step, "image": np.asarray(h.preview)})
            for e in ev:
                loop.call_soon_threadsafe(events.put_nowait, e)

        images = await self._submit(job, progress, partial_at)
        im = images[0]
        deadline = None if timeout_s is None else arrived + timeout_s
        try:
            yield {"type": "progress", "step": 0, "total": n,
                   "queue_position": im.engine.queue_position(im.handle)}
            while not im.future.done() or not events.empty():
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    raise asyncio.TimeoutError
                getter = asyncio.ensure_future(events.get())
                done, _ = await asyncio.wait({getter, im.future}, timeout=left,
                                             return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                else:
                    getter.cancel()
                    if not done:
                        raise asyncio.TimeoutError
            im.future.result()
        except asyncio.TimeoutError:
            self._cancel(images)
            self.meters.expired()
            raise past_deadline(arrived, "; its image was cancelled") from None
        except BaseException:  # the client went away (the stream was cancelled)
            self._cancel(images)
            raise
        yield {"type": "result", "result": self._result(job, images, arrived)}
