"""How a generator replica runs generation jobs: the :class:`Backend` interface, its errors,
and the replica's :class:`Meters` that every backend reports to.

Two backends implement it: :class:`serving.batch_backend.BatchBackend` (``engine=batch``,
whole requests batched per shape key) and :class:`serving.step_backend.StepBackend`
(``engine=step``, step-level continuous batching). The replica picks one from the serve args
when it starts."""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator

from ray.serve import metrics

from pipelines.dispatch import Pipelines
from pipelines.requests import GenerationRequest
from serving.schemas import JobResult
from serving.settings import ServeSettings

_SECONDS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]
_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


def partial_steps(steps: int, partial_images: int) -> list[int]:
    """After which steps (1-based) a stream's ``partial_images`` previews are drawn: spread
    evenly, never after the last step (that is the image itself)."""
    if steps <= 1:
        return []
    return sorted({max(1, min(steps - 1, round(steps * (k + 1) / (partial_images + 1))))
                   for k in range(partial_images)})


class InvalidJob(ValueError):
    """A job the pipeline refuses (the ingress maps it to a 422)."""


class Expired(TimeoutError):
    """The request's deadline passed before its images started on the devices."""


def past_deadline(arrived: float, rest: str) -> Expired:
    """The error of a job that arrived at ``arrived`` (``time.perf_counter()``) and ran out of
    time; ``rest`` ends the message."""
    return Expired(f"the request's deadline passed after {time.perf_counter() - arrived:.1f} s"
                   f"{rest}")


class Meters:
    """A model's Prometheus metrics on a replica (tagged with the model's name) and its record
    of recent batches (``recent``, newest last; a deque the replica's models may share, each
    batch naming its model) and images served (``images``), for ``/v1/stats``."""

    def __init__(self, model: str, recent: collections.deque | None = None,
                 window_s: float = 300.0):
        self.tags = {"model": model}
        self.recent = collections.deque(maxlen=256) if recent is None else recent
        self.images = 0
        self.window_s = window_s
        self._by_second: collections.deque = collections.deque()  # [unix second, images]
        tags = tuple(self.tags)
        self._images = metrics.Counter(
            "maxdiff_images_generated", "Images generated.", tag_keys=tags)
        self._batch = metrics.Histogram(
            "maxdiff_batch_requests", "Requests per batch (one shape key).", _SIZES, tag_keys=tags)
        self._device_batch = metrics.Histogram(
            "maxdiff_device_batch_images", "Padded images per device batch.", _SIZES, tag_keys=tags)
        self._queue = metrics.Histogram(
            "maxdiff_queue_wait_s", "Seconds from arrival at the replica to its batch starting "
            "on the devices.", _SECONDS, tag_keys=tags)
        self._step = metrics.Histogram(
            "maxdiff_step_time_s", "Device seconds per denoising step (whole batch, including "
            "text encoders and VAE decode spread over the steps).", _SECONDS, tag_keys=tags)
        self._expired = metrics.Counter(
            "maxdiff_expired_requests", "Requests dropped unstarted because their deadline "
            "passed in the queue.", tag_keys=tags)
        self._on_replica = metrics.Gauge(
            "maxdiff_replica_images", "Images on this replica: waiting for their batch (or "
            "step-engine slot) or running.", tag_keys=tags)
        self.on_replica = 0
        self._on_replica.set(0, tags=self.tags)
        self._cancelled = metrics.Counter(
            "maxdiff_cancelled_images", "Step-engine images cancelled (client gone or deadline "
            "passed); their slots are freed at the next tick.", tag_keys=tags)

    def served(self, batch: dict, images: int) -> None:
        """A batch ran: keep it in ``recent`` and count its images."""
        self.recent.append({**batch, "model": self.tags["model"]})
        self.images += images
        if images:  # a batch whose every request expired made none (Ray's inc refuses 0)
            self._images.inc(images, tags=self.tags)
        second = int(time.time())
        if self._by_second and self._by_second[-1][0] == second:
            self._by_second[-1][1] += images
        else:
            self._by_second.append([second, images])

    def images_by_second(self) -> list[list[int]]:
        """``[unix second, images finished in it]`` over the last ``window_s`` (oldest first),
        what ``/v1/stats`` turns into images/s and cost."""
        while self._by_second and self._by_second[0][0] < time.time() - self.window_s - 1:
            self._by_second.popleft()
        return [list(x) for x in self._by_second]

    @contextlib.contextmanager
    def holding(self, images: int):
        """A job's ``images`` are on the replica while the block runs (``maxdiff_replica_images``)."""
        self.on_replica += images
        self._on_replica.set(self.on_replica, tags=self.tags)
        try:
            yield
        finally:
            self.on_replica -= images
            self._on_replica.set(self.on_replica, tags=self.tags)

    def batch_requests(self, n: int) -> None:
        self._batch.observe(n, tags=self.tags)

    def device_batch(self, images: int) -> None:
        self._device_batch.observe(images, tags=self.tags)

    def queue_wait(self, seconds: float) -> None:
        self._queue.observe(seconds, tags=self.tags)

    def step_time(self, seconds: float) -> None:
        self._step.observe(seconds, tags=self.tags)

    def expired(self, n: int = 1) -> None:
        self._expired.inc(n, tags=self.tags)

    def cancelled(self, n: int) -> None:
        self._cancelled.inc(n, tags=self.tags)


class Backend(abc.ABC):
    """Runs a replica's generation jobs on ``pipe`` (the replica's pipeline), holding
    ``device_lock`` (the replica's, FIFO: shared by its backends) while it uses the devices, and
    calls ``report()`` after each batch it ran. ``batch_ids``: the replica's batch id sequence,
    shared by every model and engine it loads, so an id names one batch of the replica for as
    long as it runs (a backend of its own without one). ``name``: the serve arg ``engine`` that
    picks it; ``streams_steps``: its streams report every step and partial images (else only
    the queued and finished events)."""

    name: str
    streams_steps: bool

    def __init__(self, pipe, settings: ServeSettings, meters: Meters, device_lock: asyncio.Lock,
                 replica: dict, report: Callable[[], None], controlnets: dict | None = None,
                 batch_ids: Iterator[int] | None = None):
        self.pipe, self.settings, self.meters = pipe, settings, meters
        self.replica, self._report = replica, report
        self.batch_ids = itertools.count(1) if batch_ids is None else batch_ids
        self._device_lock = device_lock
        # the pipelines composed on ``pipe`` by request kind (controlnets: name -> (module,
        # params), loaded), made on first use
        self.pipes = Pipelines(pipe, controlnets)

    @abc.abstractmethod
    def warmup(self, job: GenerationRequest) -> str | None:
        """Compile what ``job``'s shape needs (blocking); what was warmed up, or None when
        nothing new was."""

    @abc.abstractmethod
    async def generate(self, job: GenerationRequest, timeout_s: float | None) -> JobResult:
        """Run a validated job; :class:`Expired` when ``timeout_s`` passes first."""

    @abc.abstractmethod
    def stream(self, job: GenerationRequest, timeout_s: float | None,
               partial_images: int) -> AsyncIterator[dict]:
        """The events of a validated one-image job (see ``Generator.generate_stream``)."""

    @abc.abstractmethod
    def abort(self, why: str) -> int:
        """Fail every job not finished with ``RuntimeError(why)``, where jobs can be given up
        on; returns how many images were given up."""

    @property
    @abc.abstractmethod
    def num_compiled(self) -> int:
        """Programs compiled beyond the replica pipeline's own."""

    def stats(self) -> dict:
        """What ``/v1/stats`` reports of this backend beyond the replica's batches."""
        return {}
