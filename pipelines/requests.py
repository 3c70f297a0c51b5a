"""What a generation request is, for every way in: the Python API, the CLI and the service.

JAX-free (NumPy and Pillow only), so the HTTP ingress imports it without loading a model:

- :func:`parse_size`: ``"1024x768"``, ``"512"`` or ``512`` -> (width, height). What a size,
  a step count, a seed, a guidance or a strength may be is :mod:`pipelines.limits`' to say.
- :class:`ShapeKey`: (height, width, steps, CFG on/off): requests with equal keys run in the
  same compiled program (:func:`pipelines.limits.cfg_on` says when guidance turns CFG on).
- :func:`image_seeds`: image k of a request gets ``seed + k``; :func:`derive_seed`: the
  CLI's per-(line, image) seed from a run seed.
- :class:`ImageRequest`: one image (prompt, negative prompt, seed, guidance); a batch is a list
  of them. :class:`GenerationRequest`: one request of ``n`` images with every setting resolved.
- :func:`bucket_size`, :func:`plan_batches`, :func:`pad_to`: cut images into device batches,
  padded so that every batch of a shape runs one compiled program.
- Requests conditioned on images (edits, ControlNet) are :mod:`pipelines.conditioned_requests`'.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, TypeVar

import numpy as np

from pipelines.limits import (
    AESTHETIC_SCORE,
    NEGATIVE_AESTHETIC_SCORE,
    aesthetic_problem,
    cfg_cutoff_problem,
    cfg_on,
    deepcache_problem,
    describe,
    guidance_problem,
    hires_first_size,
    ip_adapter_scale_problem,
    n_problem,
    prompt_text_problems,
    seed_problem,
)

T = TypeVar("T")


# ---------------------------------------------------------------------------------- sizes
_SIZE = re.compile(r"\s*(\d{1,6})\s*(?:[xX×]\s*(\d{1,6})\s*)?")


def parse_size(value: Any) -> tuple[int, int]:
    """``"768x512"`` (width x height), ``"512"`` or ``512`` (square) -> (width, height)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        w = h = int(value)
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value)):
        w = int(m.group(1))
        h = int(m.group(2)) if m.group(2) else w
    else:
        raise ValueError(f"must be WIDTHxHEIGHT such as 1024x768 (or one number for a square), "
                         f"got {value!r}")
    if w < 1 or h < 1:
        raise ValueError(f"must be positive, got {w}x{h}")
    return w, h


# ---------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class HiresFix:
    """A1111's "Hires. fix" for a text-to-image request: the image is drawn first at its size
    divided by ``scale`` (sides rounded down to the VAE's factor), its latents are upscaled
    (bilinear) to the full size and denoised again from there at ``strength`` (image-to-image's
    rule: ``int(steps * strength)`` of ``steps`` run; ``steps`` None: the request's), all in
    one program (:mod:`pipelines.tasks.hires`). The request's ``steps`` are the first pass's."""

    scale: float = 2.0
    strength: float = 0.7  # A1111's default denoising strength
    steps: int | None = None

    def first_size(self, width: int, height: int, multiple: int) -> tuple[int, int]:
        """The first pass's (width, height) for an output of ``width`` x ``height``."""
        return hires_first_size(width, height, self.scale, multiple)

    def __str__(self) -> str:
        steps = "" if self.steps is None else f":{self.steps}"
        return f"hires{self.scale:g}:s{self.strength:g}{steps}"


class ShapeKey(NamedTuple):
    """What selects a compiled program (besides the padded batch size); ``hires``: a
    :class:`HiresFix` (None: plain text-to-image)."""

    height: int
    width: int
    steps: int
    cfg: bool
    hires: HiresFix | None = None

    @property
    def program(self) -> tuple:
        """The compiled program's part of the key (every batch key has one)."""
        return tuple(self)

    @classmethod
    def of(cls, height: int, width: int, steps: int, guidance: float,
           hires: HiresFix | None = None) -> ShapeKey:
        return cls(height, width, steps, cfg_on(guidance), hires)

    def __str__(self) -> str:
        tail = "" if self.hires is None else f":{self.hires}"
        return f"{self.width}x{self.height}:{self.steps}:{'cfg' if self.cfg else 'nocfg'}{tail}"

    def describe(self) -> str:
        """The batch's shape in words (the CLI's progress bar)."""
        tail = "" if self.hires is None else f", {self.hires}"
        return f"{describe_shape(self)}{tail}"


def describe_shape(key) -> str:
    """``WxH, N step(s), guidance on|off`` of any batch key (its height, width, steps, cfg)."""
    return f"{key.width}x{key.height}, {key.steps} step(s), guidance {'on' if key.cfg else 'off'}"


# ---------------------------------------------------------------------------------- seeds
def image_seeds(seed: int | None, n: int) -> list[int | None]:
    """Seeds of a request's ``n`` images: ``seed + k`` (None: n random draws, made later)."""
    if seed is None:
        return [None] * n
    if (p := seed_problem(seed, n)) is not None:
        raise ValueError(describe(p))
    return [int(seed) + k for k in range(n)]


def derive_seed(run_seed: int, line: int, image: int) -> int:
    """The seed of image ``image`` of line ``line`` of a CLI run: a hash, so no line shifts
    another's."""
    digest = hashlib.sha256(f"maxdiff-seed:{run_seed}:{line}:{image}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


# ---------------------------------------------------------------------------------- requests
@dataclass
class ImageRequest:
    """One image to generate: its text, seed and guidance (sizes and steps are per batch).

    ``seed`` None draws a random one (reported in the output). ``guidance_scale`` None: the
    pipeline's default (its model family's, or its run config's). ``negative_size``:
    (original_size, crops_coords_top_left, target_size) for the negative branch; None uses the
    positive ones, as diffusers does. ``adapter``: the name of a LoRA adapter added with
    ``TextToImagePipeline.add_adapter`` that this image uses (None: the base model); images with
    different adapters share a batch. ``aesthetic_score`` / ``negative_aesthetic_score``: the
    SDXL refiner's time ids (models with ``requires_aesthetics_score``; others ignore them).
    ``prompt_syntax``: how the prompts' weights are written (``"a1111"``, ``"compel"``,
    ``"none"``; None: ``"a1111"``; :mod:`maxdiff.prompt_syntax`). ``scheduler``: a sampler
    name (``"dpmpp_2m_karras"``, ``"Euler a"``, ...: :mod:`maxdiff.schedulers.names`) that this
    image is denoised with, the pipeline's scheduler switched to it (None: the pipeline's own;
    text-to-image only). ``ip_adapter_image``: an image prompt (PIL image, or an
    (H, W, 3) uint8 / float [0, 1] array) for the pipeline's IP-Adapter
    (``load_ip_adapter``), at ``ip_adapter_scale`` (None: the pipeline's); images without one
    share a batch with those that have one. ``safety_checker``: False skips the pipeline's
    safety checker (SD 1.x checkpoints that ship one) for this image alone: it is neither
    checked nor blacked out, and its ``nsfw_content_detected`` entry is None; images with and
    without it share a batch.

    Feature caching (faster, approximate; images with different settings run in separate
    device batches): ``cfg_cutoff`` (a fraction in (0, 1]; None: off) runs classifier-free
    guidance on the first ``floor(cfg_cutoff * steps)`` steps only and the conditional pass
    alone after them (:func:`pipelines.limits.guided_steps`); ``deepcache_interval`` N > 1
    runs the UNet in full on every N-th step and, in between, only its outermost blocks on
    the deep features cached by the last full step (DeepCache, Ma et al. 2023; engine=batch
    and the Python API).
    """

    prompt: str
    prompt_2: str | None = None
    negative_prompt: str | None = None
    negative_prompt_2: str | None = None
    seed: int | None = None
    guidance_scale: float | None = None
    guidance_rescale: float = 0.0
    original_size: tuple[int, int] | None = None
    crops_coords_top_left: tuple[int, int] = (0, 0)
    target_size: tuple[int, int] | None = None
    negative_size: tuple | None = None
    adapter: str | None = None
    aesthetic_score: float = AESTHETIC_SCORE
    negative_aesthetic_score: float = NEGATIVE_AESTHETIC_SCORE
    prompt_syntax: str | None = None
    scheduler: str | None = None
    ip_adapter_image: Any = field(default=None, compare=False, repr=False)
    ip_adapter_scale: float | None = None
    safety_checker: bool = True
    cfg_cutoff: float | None = None
    deepcache_interval: int = 1

    def validate(self, index: int = 0) -> None:
        where = f"item {index}: " if index else ""
        if not isinstance(self.safety_checker, bool):
            raise ValueError(f"{where}safety_checker must be True or False, got "
                             f"{self.safety_checker!r}")
        for name in ("prompt", "prompt_2", "negative_prompt", "negative_prompt_2", "adapter",
                     "scheduler"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"{where}{name} must be a string, got {type(v).__name__}")
        guidance = 0.0 if self.guidance_scale is None else self.guidance_scale
        for p in (seed_problem(self.seed), guidance_problem(guidance),
                  aesthetic_problem(self.aesthetic_score),
                  aesthetic_problem(self.negative_aesthetic_score, "negative_aesthetic_score"),
                  cfg_cutoff_problem(self.cfg_cutoff), deepcache_problem(self.deepcache_interval)):
            if p is not None:
                raise ValueError(where + describe(p))
        r = self.guidance_rescale
        if not isinstance(r, (int, float, np.floating)) or not 0.0 <= r <= 1.0:
            raise ValueError(f"{where}guidance_rescale={r!r}; it must be in [0, 1]")
        if self.ip_adapter_scale is not None and (
                p := ip_adapter_scale_problem(self.ip_adapter_scale)) is not None:
            raise ValueError(where + describe(p))
        if self.ip_adapter_image is not None:
            if not hasattr(self.ip_adapter_image, "convert"):  # not a PIL image
                shape = np.shape(self.ip_adapter_image)
                if len(shape) != 3 or shape[-1] not in (3, 4) or min(shape[:2]) < 1:
                    raise ValueError(f"{where}ip_adapter_image: a PIL image or an (H, W, 3) "
                                     f"array, got shape {shape}")
        found = prompt_text_problems(self.prompt_syntax, **{
            name: getattr(self, name)
            for name in ("prompt", "prompt_2", "negative_prompt", "negative_prompt_2")})
        if found:
            raise ValueError(where + describe(found[0]))

    def with_defaults(self, guidance: float) -> ImageRequest:
        """This request with an omitted guidance scale set to ``guidance`` (the pipeline's)."""
        return self if self.guidance_scale is not None else replace(self, guidance_scale=guidance)

    def time_ids(self, height: int, width: int) -> list[float]:
        return [*(self.original_size or (height, width)), *self.crops_coords_top_left,
                *(self.target_size or (height, width))]

    def negative_time_ids(self, height: int, width: int) -> list[float]:
        if self.negative_size is None:
            return self.time_ids(height, width)
        o, c, t = self.negative_size
        return [*o, *c, *t]

    def aesthetic_time_ids(self, height: int, width: int) -> tuple[list[float], list[float]]:
        """The SDXL refiner's five time ids (diffusers' ``requires_aesthetics_score``), positive
        and negative: original size, crop corner, aesthetic score. The negative's size and
        corner are ``negative_size``'s, else the original size and (0, 0) (diffusers' default
        ``negative_crops_coords_top_left``)."""
        o = tuple(self.original_size or (height, width))
        no, nc = (o, (0, 0)) if self.negative_size is None else self.negative_size[:2]
        return ([*o, *self.crops_coords_top_left, self.aesthetic_score],
                [*no, *nc, self.negative_aesthetic_score])


@dataclass(frozen=True)
class GenerationRequest:
    """One request of ``n`` images, every setting resolved: image k has seed ``seed + k``
    (``seed`` None: random seeds, reported back). What the service queues and batches."""

    prompt: str
    negative_prompt: str | None
    seed: int | None
    n: int
    width: int
    height: int
    steps: int
    guidance_scale: float
    adapter: str | None = None  # a LoRA adapter the server added (add_adapter); not in the key
    prompt_syntax: str | None = None  # how the prompts' weights are written (ImageRequest's)
    scheduler: str | None = None  # a sampler name for this request (None: the model's)
    # an image prompt for the model's IP-Adapter (uint8 (H, W, 3)) and its scale (None: the
    # model's); not in the key (images with and without one share a batch)
    ip_adapter_image: Any = field(default=None, compare=False, repr=False)
    ip_adapter_scale: float | None = None
    # its API key's class (higher first) where the service orders waiting requests by class;
    # the step engine's queue reads it
    priority: int = field(default=0, compare=False)
    # False: the model's safety checker skips this request's images (ImageRequest's); not in
    # the key (images with and without it share a batch)
    safety_checker: bool = True
    # feature caching (ImageRequest's; faster, approximate): not in the key, like the
    # sampler: requests with different settings share a queue and the runner splits them into
    # separate device batches
    cfg_cutoff: float | None = None
    deepcache_interval: int = 1
    hires: HiresFix | None = None  # a first pass at a smaller size (in the key)

    @property
    def key(self) -> ShapeKey:
        """Requests with equal keys can share a device batch (one compiled program); the
        adapter is not part of it (images with different adapters share a batch)."""
        return ShapeKey.of(self.height, self.width, self.steps, self.guidance_scale, self.hires)

    def images(self) -> list[ImageRequest]:
        """One :class:`ImageRequest` per image, seeds ``seed + k``."""
        return [ImageRequest(self.prompt, negative_prompt=self.negative_prompt, seed=s,
                             guidance_scale=self.guidance_scale, adapter=self.adapter,
                             prompt_syntax=self.prompt_syntax, scheduler=self.scheduler,
                             ip_adapter_image=self.ip_adapter_image,
                             ip_adapter_scale=self.ip_adapter_scale,
                             safety_checker=self.safety_checker, cfg_cutoff=self.cfg_cutoff,
                             deepcache_interval=self.deepcache_interval)
                for s in image_seeds(self.seed, self.n)]

    # What a request's kind adds, for every way in (the CLI, both serving engines): each
    # subclass (pipelines.conditioned_requests) answers for its own, so no front door tests
    # request classes.
    @property
    def controlnets(self) -> tuple[str, ...]:
        """The ControlNets that condition this request, in order (none: text-to-image)."""
        return ()

    def batch_extra(self) -> Any:
        """What this request's kind adds to each of its images in a device batch (the extras
        :meth:`pipelines.dispatch.Pipelines.generate` takes): nothing for text-to-image."""
        return None

    def file_settings(self) -> dict[str, str]:
        """What this request's kind adds to the settings its image files record."""
        return {}

    def validate(self) -> None:
        if (p := n_problem(self.n)) is not None:
            raise ValueError(f"n={self.n!r}: {p.message}")
        for k, item in enumerate(self.images()):
            item.validate(k)


# ---------------------------------------------------------------------------------- batches
def bucket_size(n: int, mesh_size: int = 1) -> int:
    """The padded batch size for ``n`` images: the mesh size times the next power of two, so
    every device gets the same share and few distinct shapes are ever compiled."""
    if n < 1:
        raise ValueError(f"batch of {n} images; need at least 1")
    per_device = -(-n // mesh_size)
    return mesh_size * (1 << (per_device - 1).bit_length())


def plan_batches(entries: Iterable[T], key: Callable[[T], Any], max_batch: int,
                 mesh_size: int = 1) -> Iterator[tuple[Any, list[T], int]]:
    """Group ``entries`` by ``key`` (groups in order of first appearance, entries in order) and
    cut each group into batches of at most ``max_batch``. Yields (key, entries, bucket): every
    batch of a group is padded (:func:`pad_to`) to the same ``bucket``, so a group runs one
    compiled program."""
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch}; it must be >= 1")
    groups: dict[Any, list[T]] = {}
    for e in entries:
        groups.setdefault(key(e), []).append(e)
    for k, group in groups.items():
        size = min(max_batch, len(group))
        bucket = bucket_size(size, mesh_size)
        for i in range(0, len(group), size):
            yield k, group[i:i + size], bucket


def pad_to(items: Sequence[T], bucket: int) -> list[T]:
    """``items`` padded to ``bucket`` entries by repeating the last (its outputs are dropped)."""
    items = list(items)
    if not items or len(items) > bucket:
        raise ValueError(f"cannot pad {len(items)} item(s) to a batch of {bucket}")
    return items + [items[-1]] * (bucket - len(items))
