"""The step engine's scheduler: who is queued, who holds which slot, what the next tick runs.

Host only: plain Python and NumPy, no JAX (the tests import and exercise it in a process where
``jax`` is never imported). :class:`pipelines.step_engine.StepEngine` pairs one
:class:`SlotScheduler` with a runner (:class:`pipelines.step_runner.StepRunner`) that owns the
compiled programs and the device state, the way vLLM splits its scheduler from its model
runner. Each tick the engine asks the scheduler, in this order:

1. :meth:`SlotScheduler.reap_cancelled`: queued and running images whose cancel was asked
   leave (their slots are free at once);
2. :meth:`SlotScheduler.admit`: which queued images take which free slots, in the order of the
   :class:`Policy` (the runner then text-encodes them into those slots);
3. :meth:`SlotScheduler.report_queue_positions`: the waiting images' new queue positions;
4. :meth:`SlotScheduler.plan_step`: the rows of the next step program (active slots,
   guided-first), its compiled shape ``(b, g)`` and each row's table index; after the runner
   queued it, :meth:`SlotScheduler.stepped` counts the step and frees the slots of the images
   that took their last one.

**Policies** order the queue for admission (and for queue positions); a running image keeps its
slot until it is done (no preemption):

- ``"fifo"`` (:class:`Fifo`): submission order.
- ``"srs"`` (:class:`ShortestRemainingSteps`): fewest steps first, with aging. A queued image's
  priority is ``steps - waited_ticks / aging_ticks`` (lower first; ties in submission order),
  where ``waited_ticks`` counts the ticks it has spent queued. So a short image overtakes a
  long one that arrived before it, but every tick a waiting image gains ``1 / aging_ticks``
  step of priority: an image of ``S`` steps that has waited ``aging_ticks * (S - 1)`` ticks
  goes before every image submitted after that (whose priority is at least 1), and it is never
  starved. ``aging_ticks=1`` (the default) lets it wait about one tick per step it has more
  than a 1-step image.

Batch shapes: :func:`batch_sizes` (the powers of two times the mesh size up to ``slots``) and
:func:`step_shapes` (the ``(b, g)`` of every step program) are the bounded set the runner
compiles.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipelines.limits import cfg_on, guided_steps
from pipelines.requests import ImageRequest, bucket_size

__all__ = ["Handle", "Policy", "Fifo", "ShortestRemainingSteps", "POLICIES", "make_policy",
           "StepPlan", "SlotScheduler", "batch_sizes", "step_shapes"]


@dataclass(eq=False)
class Handle:
    """One image in a :class:`pipelines.step_engine.StepEngine`. ``status``: ``queued``,
    ``running``, ``done`` or ``cancelled``; ``step``: denoising steps the device has *executed*
    of ``steps`` (read back from the step program's output, never counted ahead);
    ``dispatched``: steps queued on the device (at most ``lookahead + 1`` ahead of ``step``);
    ``queue_position``: 1 + the images ahead of it in the policy's order as of the last tick (0
    once it holds a slot); ``waited_ticks``: ticks it spent queued; ``image``: the result once
    done (PIL image, or float32 (H, W, 3) in [0, 1] with ``output_type="np"``); ``seed``: the
    seed used (drawn at admission when the request has none); ``preview`` / ``preview_step``:
    the latest decoded denoised estimate asked for with ``submit(previews=...)`` and the step it
    was taken after; ``controls``: its ControlNet conditioning, as submitted; ``nsfw``: once
    done, whether the pipeline's safety checker blacked ``image`` out (None: no checker, or its
    request turned it off)."""

    request: ImageRequest
    steps: int
    on_progress: Callable[[Handle], None] | None = None
    previews: frozenset = frozenset()
    controls: Any = None  # one ControlImage per ControlNet (an engine over a ControlNetPipeline)
    id: int = 0
    status: str = "queued"
    step: int = 0
    dispatched: int = 0
    queue_position: int = 0
    waited_ticks: int = 0
    slot: int | None = None
    seed: int | None = None
    image: Any = None
    nsfw: bool | None = None
    preview: Any = None
    preview_step: int = 0
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    finished_at: float | None = None
    cancel_requested: bool = False
    priority: int = 0  # its class: higher classes are admitted first (aged: CLASS_AGING_TICKS)

    @property
    def done(self) -> bool:
        return self.status in ("done", "cancelled")


# ---------------------------------------------------------------------------------- policies
class Policy:
    """Orders the queue for admission: :meth:`order` returns the queued handles, first to be
    admitted first (the queue is in submission order). A subclass overrides :meth:`order`."""

    name = "policy"

    def order(self, queue: Sequence[Handle]) -> list[Handle]:
        raise NotImplementedError


class Fifo(Policy):
    """First in, first out: submission order."""

    name = "fifo"

    def order(self, queue: Sequence[Handle]) -> list[Handle]:
        return list(queue)


class ShortestRemainingSteps(Policy):
    """Fewest steps first, aged: priority ``steps - waited_ticks / aging_ticks``, lowest first,
    ties in submission order (see the module docstring for the bound on waiting)."""

    name = "srs"

    def __init__(self, aging_ticks: float = 1.0):
        if isinstance(aging_ticks, bool) or not isinstance(aging_ticks, (int, float)) \
                or not aging_ticks > 0:
            raise ValueError(f"aging_ticks={aging_ticks!r}; it must be a number > 0 (ticks a "
                             "queued image waits to gain one step of priority)")
        self.aging_ticks = float(aging_ticks)

    def priority(self, h: Handle) -> float:
        return (h.steps - h.dispatched) - h.waited_ticks / self.aging_ticks

    def order(self, queue: Sequence[Handle]) -> list[Handle]:
        # sorted() is stable: equal priorities stay in submission order
        return sorted(queue, key=self.priority)


POLICIES: dict[str, type[Policy]] = {"fifo": Fifo, "srs": ShortestRemainingSteps}


CLASS_AGING_TICKS = 100  # ticks a queued image waits to gain one class


def by_class(order: list[Handle]) -> list[Handle]:
    """``order`` (a policy's) regrouped by class, highest first: a queued image's class is its
    ``priority`` plus one for every CLASS_AGING_TICKS ticks it waited, so none is starved.
    All of class 0 (no classes in use): ``order`` itself."""
    if not any(h.priority for h in order):
        return order
    return sorted(order, key=lambda h: -(h.priority + h.waited_ticks / CLASS_AGING_TICKS))


def make_policy(policy: str | Policy) -> Policy:
    """A :class:`Policy` from its name (a key of :data:`POLICIES`) or the policy itself."""
    if isinstance(policy, Policy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r}; use one of {', '.join(map(repr, POLICIES))} "
                         "(fifo: submission order; srs: shortest remaining steps first, aged)")
    return POLICIES[policy]()


# ---------------------------------------------------------------------------------- shapes
def batch_sizes(slots: int, mesh_size: int) -> list[int]:
    """The step, admit and decode programs' batch sizes: the buckets of 1..``slots`` images
    (powers of two times the mesh size), capped at ``slots``."""
    return sorted({min(bucket_size(n, mesh_size), slots) for n in range(1, slots + 1)})


def step_shapes(sizes: Sequence[int], cfg: bool) -> list[tuple[int, int]]:
    """(b, g) of every step program: ``b`` rows, the first ``g`` of them with negative rows
    (``g = 0``, or with ``cfg`` any size in ``sizes`` up to ``b``)."""
    return [(b, g) for b in sizes for g in [0, *(x for x in sizes if x <= b and cfg)]]


@dataclass
class StepPlan:
    """One step program call: ``b`` rows, the first ``g`` guided. ``rows``: the slot of each row
    (distinct; padding rows are free slots, inactive); ``active``, ``index`` (each row's table
    index, ``max_steps - steps + dispatched``), ``local`` (its own step number) and ``variant``
    (the sampler's step variant for a run of its length, ``variant_of(steps)``) are per row;
    ``handles``: the images stepped, row order; ``guided``: how many of them run this step
    guided (guidance > 1, before their ``cfg_cutoff``)."""

    b: int
    g: int
    rows: np.ndarray
    active: np.ndarray
    index: np.ndarray
    local: np.ndarray
    variant: np.ndarray
    handles: list[Handle]
    guided: int


def _guided(h: Handle) -> bool:
    """Whether ``h``'s next step runs classifier-free guidance: guidance > 1 and the step
    before its ``cfg_cutoff`` (:func:`pipelines.limits.guided_steps` of its steps)."""
    r = h.request
    return cfg_on(r.guidance_scale) and h.dispatched < guided_steps(h.steps, r.cfg_cutoff)


class SlotScheduler:
    """The queue and the ``slots`` slots of one engine, ordered by ``policy``. ``max_steps``:
    the per-slot tables' length (an image of ``k`` steps starts at index ``max_steps - k``);
    ``mesh_size``: batch sizes are multiples of it; ``variant_of(steps)``: the sampler's step
    variant for a run of ``steps`` (``Scheduler.step_variant``; default 0).

    :meth:`submit`, :meth:`cancel` and :meth:`queue_position` may be called from any thread;
    the rest from the ticking thread only."""

    def __init__(self, slots: int, mesh_size: int, max_steps: int, *, cfg: bool = True,
                 policy: str | Policy = "fifo", variant_of: Callable[[int], int] | None = None):
        if not isinstance(slots, int) or slots < 1 or slots % mesh_size:
            raise ValueError(f"slots={slots!r}; it must be a positive multiple of the mesh "
                             f"size {mesh_size}")
        self.slots, self.mesh_size, self.max_steps, self.cfg = slots, mesh_size, max_steps, cfg
        self.policy = make_policy(policy)
        self.variant_of = variant_of or (lambda steps: 0)
        self.batch_sizes = batch_sizes(slots, mesh_size)
        self.lock = threading.Lock()
        self.queue: list[Handle] = []  # submission order
        self.slot_handles: list[Handle | None] = [None] * slots
        self._ids = itertools.count(1)
        self.stats = {"submitted": 0, "finished": 0, "cancelled": 0, "ticks": 0,
                      "guided_ticks": 0, "slot_steps": 0, "guided_slot_steps": 0,
                      "tick_images": {}}

    # ------------------------------------------------------------------ any thread
    def submit(self, handle: Handle) -> Handle:
        """Queue ``handle`` (already checked); gives it its id."""
        handle.id = next(self._ids)
        with self.lock:
            self.queue.append(handle)
            self.stats["submitted"] += 1
        return handle

    def cancel(self, handle: Handle) -> None:
        """Ask to cancel: it leaves at the next :meth:`reap_cancelled` (nothing once done)."""
        with self.lock:
            if not handle.done:
                handle.cancel_requested = True

    def queue_position(self, handle: Handle) -> int:
        """0 when the image holds a slot (or is done), else 1 + the images ahead of it in the
        policy's order now."""
        with self.lock:
            if handle not in self.queue:
                return 0
            return by_class(self.policy.order(self.queue)).index(handle) + 1

    @property
    def active(self) -> int:
        """Slots held by images with steps still to queue."""
        return sum(h is not None for h in self.slot_handles)

    @property
    def queued(self) -> int:
        return len(self.queue)

    # ------------------------------------------------------------------ the ticking thread
    def reap_cancelled(self) -> list[Handle]:
        """Queued and running images whose cancel was asked leave (marked cancelled)."""
        out = []
        with self.lock:
            keep = []
            for h in self.queue:
                (out if h.cancel_requested else keep).append(h)
            self.queue = keep
        for k, h in enumerate(self.slot_handles):
            if h is not None and h.cancel_requested:
                self.slot_handles[k] = None
                out.append(h)
        self._cancelled(out)
        return out

    def admit(self) -> tuple[list[Handle], list[int], int]:
        """Take queued images, in the policy's order, into the free slots (lowest first):
        returns (the images, their slots, the admit program's batch size ``b``); marks them
        running. The images left queued wait one more tick (``waited_ticks``)."""
        free = [k for k, h in enumerate(self.slot_handles) if h is None]
        with self.lock:
            take = by_class(self.policy.order(self.queue))[:len(free)]
            chosen = {id(h) for h in take}
            self.queue = [h for h in self.queue if id(h) not in chosen]
            for h in self.queue:
                h.waited_ticks += 1
        free = free[:len(take)]
        now = time.perf_counter()
        for h, k in zip(take, free):
            h.slot, h.status, h.started_at, h.queue_position = k, "running", now, 0
            self.slot_handles[k] = h
        b = min(bucket_size(len(take), self.mesh_size), self.slots) if take else 0
        return take, free, b

    def report_queue_positions(self) -> list[Handle]:
        """Update the queued images' positions (policy order); returns those that moved."""
        moved = []
        with self.lock:
            for k, h in enumerate(by_class(self.policy.order(self.queue)), start=1):
                if h.queue_position != k:
                    h.queue_position = k
                    moved.append(h)
        return moved

    def plan_step(self) -> StepPlan | None:
        """The next step of every active slot, gathered guided-first (the step program gives
        negative rows to its first ``g`` rows) into the smallest ``(b, g)`` that holds them;
        None when no slot is active. An image is guided while its guidance is > 1 and its
        ``cfg_cutoff`` has not passed (its first ``guided_steps(steps, cfg_cutoff)`` steps)."""
        busy = [k for k, h in enumerate(self.slot_handles) if h is not None]
        if not busy:
            return None
        m = self.mesh_size
        guided = [k for k in busy if _guided(self.slot_handles[k])]
        busy = guided + [k for k in busy if k not in guided]
        b = min(bucket_size(len(busy), m), self.slots)
        g = min(bucket_size(len(guided), m), b) if guided else 0
        rows = busy + [k for k, h in enumerate(self.slot_handles) if h is None][:b - len(busy)]
        handles = [self.slot_handles[k] for k in busy]
        index, local, variant = (np.zeros(b, np.int32) for _ in range(3))
        for r, h in enumerate(handles):
            local[r] = h.dispatched
            index[r] = self.max_steps - h.steps + h.dispatched
            variant[r] = self.variant_of(h.steps)
        return StepPlan(b, g, np.array(rows, np.int32), np.arange(b) < len(busy), index, local,
                        variant, handles, len(guided))

    def stepped(self, plan: StepPlan) -> tuple[list[Handle], list[Handle]]:
        """``plan`` is queued on the device: count the step of each image; the ones that took
        their last step leave their slots (free for the next tick). Returns (finishing, those
        with a preview asked at this step)."""
        for h in plan.handles:
            h.dispatched += 1
        finishing = [h for h in plan.handles if h.dispatched == h.steps]
        previewed = [h for h in plan.handles if h.dispatched in h.previews]
        for h in finishing:
            self.slot_handles[h.slot] = None
        st = self.stats
        st["ticks"] += 1
        st["guided_ticks"] += int(bool(plan.guided))
        st["slot_steps"] += len(plan.handles)
        st["guided_slot_steps"] += plan.guided
        key = str(len(plan.handles))
        st["tick_images"][key] = st["tick_images"].get(key, 0) + 1
        return finishing, previewed

    def finished(self, handles: Sequence[Handle], images: Sequence[Any]) -> None:
        """The device has decoded ``handles``' images: they are done."""
        now = time.perf_counter()
        for h, im in zip(handles, images):
            h.image, h.status, h.finished_at, h.slot = im, "done", now, None
        self.stats["finished"] += len(handles)

    def abort(self, draining: Sequence[Handle] = ()) -> list[Handle]:
        """Give up on every image not finished: the queued, the running and ``draining`` (the
        finishing images of ticks still on the device); they are marked cancelled and
        returned, the queue and the slots are emptied."""
        with self.lock:
            queued, self.queue = self.queue, []
        held = [h for h in self.slot_handles if h is not None]
        self.slot_handles = [None] * self.slots
        lost = list({id(h): h for h in [*queued, *held, *draining] if not h.done}.values())
        self._cancelled(lost)
        return lost

    def _cancelled(self, handles: list[Handle]) -> None:
        now = time.perf_counter()
        for h in handles:
            h.status, h.finished_at, h.slot = "cancelled", now, None
        self.stats["cancelled"] += len(handles)
