"""Step-level continuous batching: images join and leave a running batch between denoising steps.

A :class:`StepEngine` keeps a fixed number of *slots* on the devices (sharded over the mesh's
``data`` axis). Each :meth:`StepEngine.tick` frees the slots of cancelled images, admits queued
images into free slots (one batched text-encode program; the order is the engine's ``policy``,
:mod:`pipelines.step_scheduler`), queues ONE jitted program that advances every active slot by
one step (each with its own timestep, step count and scheduler memory), queues the VAE decode
of the images that take their last step, then waits until at most ``lookahead`` ticks are left
on the device and reports steps, previews and finished images. An image's pixels equal the
pipeline's for it alone (to float32 rounding), whatever shared its steps: its schedule,
noise and guidance are its own (a ``cfg_cutoff`` too: its negative rows stop after its
guided steps; ``deepcache_interval`` > 1 is refused at :meth:`StepEngine.submit`); a finished
image goes through the pipeline's safety checker
(SD 1.x checkpoints that ship one) as the pipeline's would, and so do its previews, unless its
request turned it off (``ImageRequest.safety_checker``). The compiled programs are bounded and
known (:meth:`StepEngine.warmup` compiles them all). The host-only deciding is
:class:`pipelines.step_scheduler.SlotScheduler`; the device side is :class:`StepRunner`. How
and why, in detail: docs/step-engine.md.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from pipelines import prompting
from pipelines.conditioned_requests import ControlImage
from pipelines.limits import cfg_on, check, steps_problem
from pipelines.requests import ImageRequest
from pipelines.step_runner import StepRunner
from pipelines.step_scheduler import Handle, Policy, SlotScheduler

__all__ = ["StepEngine", "StepRunner", "Handle"]


@dataclass
class _Tick:
    """A tick queued on the device, and what the host learns once it has run: ``executed`` is
    the step program's own output (each row's step count after the step; 0 for padding rows),
    ``images`` / ``previews`` the decode programs' outputs for ``finishing`` / ``previewed``."""

    rows: list[Handle]
    executed: Any
    finishing: list[Handle]
    images: Any
    previewed: list[Handle]
    previews: Any


class StepEngine:
    """Continuous batching over denoising steps for one (height, width) of ``pipe``: a
    host-only :class:`pipelines.step_scheduler.SlotScheduler` (queue, slots, policy, batch
    shapes) and a :class:`StepRunner` (compiled programs, device state), paced by the device.

    ``slots``: images advanced together per tick (a multiple of the mesh size); ``cfg``: see the
    module docstring; ``max_steps``: the most steps an image may take (default: the
    scheduler's limit; the per-slot tables have this length, the programs do not depend on it);
    ``output_type``: ``"pil"`` or ``"np"`` (float32 [0, 1]); ``lookahead``: ticks left queued
    on the device when :meth:`tick` returns (see *Pacing* in the module docstring): 1 (default)
    overlaps the host's work for the next tick with the device's step, 0 returns only once the
    tick's own step has run; ``policy``: the order queued images take free slots in, ``"fifo"``
    (default: submission order), ``"srs"`` (shortest remaining steps first, aged so that a long
    image is never starved; the rule: :mod:`pipelines.step_scheduler`) or a
    :class:`pipelines.step_scheduler.Policy`.

    Not thread-safe for concurrent :meth:`tick` calls; :meth:`submit` and :meth:`cancel` may be
    called from other threads while one thread ticks.
    """

    def __init__(self, pipe, height: int | None = None, width: int | None = None, slots: int = 8,
                 *, cfg: bool = True, max_steps: int | None = None, output_type: str = "pil",
                 lookahead: int = 1, policy: str | Policy = "fifo"):
        self.pipe = pipe
        self.height = pipe.default_height if height is None else height
        self.width = pipe.default_width if width is None else width
        self.max_steps = pipe.max_steps if max_steps is None else int(max_steps)
        pipe.check_request(1, self.height, self.width, output_type)
        if not 1 <= self.max_steps <= pipe.max_steps:
            raise ValueError(f"max_steps={max_steps}; {type(pipe.scheduler).__name__} allows "
                             f"1..{pipe.max_steps}")
        if pipe.scheduler.num_model_calls(2) != 2:  # PNDM: steps + 1 calls, a redone step
            raise ValueError(
                f"{type(pipe.scheduler).__name__} makes more model calls than steps, which the "
                "step engine does not schedule; use engine=batch (the pipeline) or another "
                "scheduler (e.g. EulerDiscreteScheduler, DPMSolverMultistepScheduler)")
        if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
            raise ValueError(f"lookahead={lookahead!r}; it must be an integer >= 0 (ticks left "
                             "queued on the device when tick() returns)")
        self.scheduler = SlotScheduler(slots, pipe.mesh.size, self.max_steps, cfg=bool(cfg),
                                       policy=policy, variant_of=pipe.scheduler.step_variant)
        self.slots, self.cfg, self.output_type = slots, bool(cfg), output_type
        self.lookahead = lookahead
        self.batch_sizes = self.scheduler.batch_sizes
        self.runner = StepRunner(pipe, self.height, self.width, slots, self.batch_sizes,
                                 cfg=self.cfg, max_steps=self.max_steps, output_type=output_type)
        self._inflight: collections.deque[_Tick] = collections.deque()  # oldest first
        # images in and out; ticks run (and those with guided images); slot-steps done (active
        # slots summed over ticks; guided_slot_steps: those with negative rows); tick_images:
        # ticks by the number of images they stepped ({"1": 40, "2": 12}); host_s: seconds the
        # ticking thread spent working (scheduling, dispatch, callbacks), wait_s: seconds it
        # waited for the device (a tick's step, its decodes)
        self.stats = self.scheduler.stats
        self.stats.update(host_s=0.0, wait_s=0.0)

    @property
    def policy(self) -> Policy:
        return self.scheduler.policy

    @property
    def num_compiled(self) -> int:
        """Programs compiled so far (at most :attr:`max_programs`)."""
        return self.runner.num_compiled

    @property
    def max_programs(self) -> int:
        """The programs this engine can compile (all of them at :meth:`warmup`)."""
        return self.runner.max_programs

    # ------------------------------------------------------------------ public API
    def submit(self, request: ImageRequest, steps: int | None = None,
               on_progress: Callable[[Handle], None] | None = None,
               previews: Iterable[int] = (), controls: Sequence[ControlImage] | None = None,
               priority: int = 0) -> Handle:
        """Queue one image (``steps`` None: the pipeline's default). It joins a free slot at
        a coming tick, in the policy's order. ``on_progress(handle)`` is called from the
        ticking thread once the device has run each of its steps (``handle.step`` is then that
        step), and at ticks where it stays queued but its ``queue_position`` changed.
        ``previews``: steps (1 to ``steps``) after which its denoised estimate is VAE-decoded on
        the device, in the tick that runs that step; ``handle.preview`` / ``preview_step`` hold
        it when ``on_progress`` reports that step. ``controls``: with an engine over a
        :class:`pipelines.ControlNetPipeline` (and only then), one
        :class:`pipelines.conditioned_requests.ControlImage` per ControlNet: the image's control image,
        scale, window (fractions of its own steps) and guess mode."""
        steps = self.pipe.default_steps if steps is None else steps
        self.pipe.check_request(steps, self.height, self.width, self.output_type)
        check([steps_problem(steps, self.max_steps, "this engine's max_steps")])
        request = request.with_defaults(self.pipe.default_guidance)
        request.validate()
        if request.scheduler is not None:
            raise ValueError(f"scheduler={request.scheduler!r}: the step engine runs its "
                             f"pipeline's sampler ({type(self.pipe.scheduler).__name__}) for "
                             "every image; engine=batch runs a sampler per request")
        if request.deepcache_interval != 1:
            raise ValueError(f"deepcache_interval={request.deepcache_interval!r}: the step "
                             "engine cannot run DeepCache (images at different steps share one "
                             "UNet call, where some would need the full UNet and others its "
                             "shallow branch); engine=batch and the Python API run it, or send "
                             "deepcache_interval 1")
        if request.ip_adapter_image is not None and self.runner.ip is None:
            raise ValueError("ip_adapter_image: this engine has no IP-Adapter (load one with "
                             "load_ip_adapter before making the engine)")
        prompting.check_prompts(self.pipe, [request], max_chunks=1,
                                why="the step engine holds one 75-token chunk per image; "
                                    "engine=batch runs longer prompts")
        controls = self.runner.task.slot_extra(self.pipe, controls)
        if self.pipe.adapter_index([request]) is None and request.adapter is not None:
            raise ValueError(f"adapter={request.adapter!r} is not added; no adapters are added")
        if not self.cfg and cfg_on(request.guidance_scale):
            raise ValueError(f"guidance_scale={request.guidance_scale}: this engine runs without "
                             "classifier-free guidance (cfg=False); use guidance <= 1")
        previews = frozenset(previews)
        bad = sorted(k for k in previews if not isinstance(k, (int, np.integer))
                     or isinstance(k, bool) or not 1 <= k <= steps)
        if bad:
            raise ValueError(f"previews={sorted(previews, key=str)}: {bad} not in 1..{steps} "
                             "(the steps after which to decode a preview)")
        return self.scheduler.submit(Handle(request=request, steps=int(steps),
                                            on_progress=on_progress, previews=previews,
                                            controls=controls, priority=int(priority)))

    def cancel(self, handle: Handle) -> None:
        """Cancel an image: a queued one leaves the queue, a running one frees its slot at the
        next tick (no step of it is queued on the device after that; one already queued still
        runs). Images whose last step is already queued are not affected."""
        self.scheduler.cancel(handle)

    def queue_position(self, handle: Handle) -> int:
        """0 when the image holds a slot (or is done), else 1 + the images ahead of it in the
        policy's order."""
        return self.scheduler.queue_position(handle)

    @property
    def active(self) -> int:
        """Slots held by images with steps still to queue."""
        return self.scheduler.active

    @property
    def queued(self) -> int:
        return self.scheduler.queued

    @property
    def idle(self) -> bool:
        """Nothing queued, no slot held, no tick left on the device."""
        return not self.queued and not self.active and not self._inflight

    def tick(self) -> list[Handle]:
        """One scheduling round, paced by the device. Frees the slots of cancelled images,
        admits queued images into free slots, queues one step of every active slot on the
        device (and the VAE decode of the images that take their last step), then waits until
        at most ``lookahead`` ticks are left unfinished on the device (all of them when nothing
        was queued) and reports those that finished: progress from the step program's output,
        previews, finished images. Returns the images finished or cancelled in this call."""
        t0, waited = time.perf_counter(), self.stats["wait_s"]
        out = self.scheduler.reap_cancelled()
        take, free, b = self.scheduler.admit()
        if take:
            self.runner.admit(take, free, b)
        for h in self.scheduler.report_queue_positions():
            if h.on_progress is not None:
                h.on_progress(h)
        launched = self._launch()
        while self._inflight and (launched is None or len(self._inflight) > self.lookahead):
            out += self._complete(self._inflight.popleft())
        self.stats["host_s"] += time.perf_counter() - t0 - (self.stats["wait_s"] - waited)
        return out

    def run_until_idle(self, max_ticks: int | None = None) -> list[Handle]:
        """Tick until no image is queued or running; returns the finished handles in order."""
        done = []
        ticks = 0
        while not self.idle and (max_ticks is None or ticks < max_ticks):
            done += self.tick()
            ticks += 1
        return done

    def abort(self) -> list[Handle]:
        """Give up on every image not finished (after a failed tick): they are marked cancelled,
        the queue, the slots and the ticks in flight are dropped; returns them. The engine is
        usable afterwards."""
        ticks, self._inflight = list(self._inflight), collections.deque()
        return self.scheduler.abort([h for t in ticks for h in t.finishing])

    def warmup(self) -> int:
        """Compile every program this engine can run (the step programs and the admit and
        decode programs of each batch size, and the safety checker's for up to ``slots``
        finished images where the pipeline has one) without touching any slot; returns how
        many the runner compiled."""
        checker = getattr(self.pipe, "safety_checker", None)
        if checker is not None:
            checker.warmup(self.slots)
        return self.runner.warmup()

    # ------------------------------------------------------------------ execution
    def _launch(self) -> _Tick | None:
        """Queue one step of every active slot on the device (the scheduler's plan), then the
        decodes of the images that took their last step (their slots are free for the next
        tick: the decode reads this tick's latents, whatever is admitted there later) and of
        the previews asked for at this step. Returns the tick, or None when no slot is
        active."""
        plan = self.scheduler.plan_step()
        if plan is None:
            return None
        executed = self.runner.step(plan)
        finishing, previewed = self.scheduler.stepped(plan)
        images = self.runner.decode([h.slot for h in finishing]) if finishing else None
        previews = (self.runner.decode([h.slot for h in previewed], preview=True)
                    if previewed else None)
        tick = _Tick(plan.handles, executed, finishing, images, previewed, previews)
        self._inflight.append(tick)
        return tick

    def _complete(self, tick: _Tick) -> list[Handle]:
        """Wait for a queued tick to run and report it: each image's step as the step program
        returned it, then its preview, then the finished images. Returns those."""
        t0 = time.perf_counter()
        executed = np.asarray(jax.device_get(tick.executed))  # blocks until the step has run
        self.stats["wait_s"] += time.perf_counter() - t0
        live = [h for h in tick.rows if h.status == "running"]  # not cancelled meanwhile
        for h, k in zip(tick.rows, executed):
            if h.status == "running":
                h.step = int(k)
        for h in live:
            if h.on_progress is not None and h not in tick.previewed and h not in tick.finishing:
                h.on_progress(h)
        if tick.previewed:
            previews, _ = self._checked(tick.previewed,
                                        self._fetch(tick.previews, len(tick.previewed)))
            for h, im in zip(tick.previewed, previews):
                h.preview, h.preview_step = im, h.step
                if h.on_progress is not None and h.status == "running" and h not in tick.finishing:
                    h.on_progress(h)
        if not tick.finishing:
            return []
        images, flags = self._checked(tick.finishing,
                                      self._fetch(tick.images, len(tick.finishing)))
        for h, flag in zip(tick.finishing, flags):
            h.nsfw = flag
        self.scheduler.finished(tick.finishing, images)
        for h in tick.finishing:
            if h.on_progress is not None:
                h.on_progress(h)
        return list(tick.finishing)

    def _checked(self, handles: list[Handle], images: list) -> tuple[list, list]:
        """``images`` (of ``handles``: finished images or previews) through the pipeline's
        safety checker (SD 1.x checkpoints that ship one) where the image's request keeps it
        on, as the pipeline does: (the images, flagged ones black; a flag per image, None
        where it was off or there is no checker)."""
        checker = getattr(self.pipe, "safety_checker", None)
        if checker is None:
            return images, [None] * len(images)
        return checker.check(images, [h.request.safety_checker for h in handles])

    def _fetch(self, out, n: int) -> list:
        t0 = time.perf_counter()
        images = self.runner.fetch(out, n)
        self.stats["wait_s"] += time.perf_counter() - t0
        return images
