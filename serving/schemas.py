"""What crosses the service's boundaries.

- ``ServeSettings``: the deployment's settings, parsed strictly from ``build_app``'s args (a
  dict from ``serve run ... key=value`` or a ``configs/serve.yaml`` ``args:`` block).
- The HTTP request/response models (Pydantic; FastAPI shows them at ``/docs``).
- ``Job`` / ``JobResult``: what the ingress sends a generator replica and gets back.

Nothing here imports JAX: the ingress replicas only need this module and FastAPI.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_SEED = 2**32 - 1  # the pipeline's seed range (pipelines.text_to_image.MAX_SEED)

# build_app args that go to the run config (pipelines.config.RunConfig); the rest are ServeSettings.
RUN_CONFIG_KEYS = ("model", "unet", "scheduler", "dtype", "steps", "guidance", "height", "width",
                   "attention", "attention_chunk", "devices", "compile_cache_dir")
_RUN_CONFIG_NUMBERS = ("steps", "guidance", "height", "width", "attention_chunk", "devices")


# ---------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class WarmupShape:
    """One program to compile before a replica reports ready. None: the model's default."""

    width: int | None = None
    height: int | None = None
    steps: int | None = None
    guidance: float | None = None  # > 1: classifier-free guidance on

    @classmethod
    def parse(cls, spec: Any) -> "WarmupShape":
        """``"WxH:steps:guidance"`` (later parts optional; guidance may be ``cfg``/``nocfg``),
        ``"default"``, or a dict with ``size``/``width``/``height``, ``steps``, ``guidance``."""
        if isinstance(spec, dict):
            unknown = set(spec) - {"size", "width", "height", "steps", "guidance", "cfg"}
            if unknown:
                raise ValueError(f"warmup shape {spec}: unknown keys {sorted(unknown)}; use size "
                                 "(or width, height), steps, guidance")
            w, h = spec.get("width"), spec.get("height")
            if spec.get("size") is not None:
                w, h = parse_size(str(spec["size"]))
            guidance = spec.get("guidance")
            if "cfg" in spec:
                guidance = _cfg_word(str(spec["cfg"]).lower())
            return cls(*_ints(spec, w, h, spec.get("steps")), _float_or_none(guidance, spec))
        if not isinstance(spec, str):
            raise ValueError(f"warmup shape {spec!r}: give 'WxH:steps:guidance' or a dict")
        if spec.strip().lower() == "default":
            return cls()
        parts = spec.strip().split(":")
        if len(parts) > 3 or not parts[0]:
            raise ValueError(f"warmup shape {spec!r}: use 'WxH', 'WxH:steps' or "
                             "'WxH:steps:guidance' (e.g. '1024x1024:4:0')")
        w, h = parse_size(parts[0])
        steps = _int(parts[1], spec) if len(parts) > 1 and parts[1] else None
        guidance = None
        if len(parts) > 2:
            word = parts[2].strip().lower()
            guidance = _cfg_word(word) if word in _CFG_WORDS else _float_or_none(word, spec)
        return cls(w, h, steps, guidance)

    def __str__(self) -> str:
        size = "default size" if self.width is None else f"{self.width}x{self.height}"
        guidance = "default" if self.guidance is None else self.guidance
        return f"{size}:{self.steps or 'default'}:{guidance}"


_CFG_WORDS = {"cfg": 5.0, "on": 5.0, "true": 5.0, "nocfg": 0.0, "off": 0.0, "false": 0.0}


def _cfg_word(word: str) -> float:
    if word not in _CFG_WORDS:
        raise ValueError(f"cfg={word!r}: use cfg/nocfg, on/off, or a guidance scale")
    return _CFG_WORDS[word]


def _int(v, where) -> int:
    try:
        out = int(v)
    except (TypeError, ValueError):
        raise ValueError(f"warmup shape {where!r}: {v!r} is not an integer") from None
    if out < 1:
        raise ValueError(f"warmup shape {where!r}: {v!r} must be >= 1")
    return out


def _ints(spec, *vals):
    return [None if v is None else _int(v, spec) for v in vals]


def _float_or_none(v, where) -> float | None:
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ValueError(f"warmup shape {where!r}: guidance {v!r} is not a number "
                         "(or cfg/nocfg)") from None


_SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX×]\s*(\d{1,6})\s*$")


def parse_size(size: str) -> tuple[int, int]:
    """``"1024x768"`` -> (1024, 768) as (width, height)."""
    m = _SIZE.match(size)
    if not m:
        raise ValueError(f"size {size!r} must look like WIDTHxHEIGHT, e.g. 1024x1024")
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class ServeSettings:
    """How the service batches, places replicas and bounds requests (see README "HTTP service").

    Keys not listed here that ``pipelines.config.RunConfig`` knows (model, unet, scheduler, dtype,
    steps, guidance, height, width, attention, devices, compile_cache_dir, ...) go to the run
    config, on top of ``config`` (a name in ``configs/`` or a YAML path).
    """

    config: str | None = None  # run config name or path; None: defaults (the embedded model)
    run_overrides: dict = field(default_factory=dict)
    model_name: str | None = None  # the id /v1/models reports; None: the model folder's name
    # batching: requests that share (height, width, steps, cfg on/off) share a device batch
    max_batch_size: int = 8  # requests per batch
    max_batch_images: int | None = None  # images per device batch; None: max_batch_size
    batch_wait_timeout_s: float = 0.05
    # replicas and placement
    num_replicas: int = 1
    resource: str | None = None  # "GPU", "TPU" or a custom per-host resource; None: CPU only
    resource_amount: float = 1.0  # of `resource` per replica (e.g. every chip of a host)
    num_cpus: float = 1.0  # per generator replica
    max_replicas_per_node: int | None = None  # 1: one replica per host
    max_ongoing_requests: int | None = None  # per generator replica; None: 2 * max_batch_size
    max_queued_requests: int = 64  # waiting for a generator replica, per caller; -1: no limit
    ingress_replicas: int = 1
    ingress_num_cpus: float = 0.25
    ingress_max_ongoing_requests: int = 1024
    # requests
    request_timeout_s: float = 300.0
    retry_after_s: int = 2  # Retry-After on a 503
    warmup_shapes: tuple = (WarmupShape(),)  # compiled before a replica is ready
    warmup_batch_sizes: tuple | None = None  # None: every padded batch up to max_batch_images
    max_n: int = 4  # images per request
    max_steps: int = 100
    max_guidance: float = 30.0
    min_size: int | None = None  # pixels per side; None: size_multiple
    max_size: int = 2048
    size_multiple: int | None = None  # sides are multiples of this and of the VAE factor
    max_body_bytes: int = 65536
    max_prompt_chars: int = 4000

    @classmethod
    def from_args(cls, args: dict | None) -> "ServeSettings":
        """Parse ``build_app`` args; values may be strings (``serve run ... key=value``)."""
        args = dict(args or {})
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.name != "run_overrides"]
        run, kw = {}, {}
        for key, value in args.items():
            if key in RUN_CONFIG_KEYS:
                if isinstance(value, str) and key in _RUN_CONFIG_NUMBERS:
                    value = _yaml_scalar(value)
                run[key] = value
            elif key == "warmup_shapes":
                kw[key] = tuple(WarmupShape.parse(s) for s in _as_list(key, value))
            elif key == "warmup_batch_sizes":
                kw[key] = None if value is None else tuple(
                    _coerce(key, v, int) for v in _as_list(key, value))
            elif key in names:
                kw[key] = _coerce(key, value, hints[key])
            else:
                raise ValueError(f"unknown serve arg {key!r}; allowed: "
                                 f"{', '.join(sorted([*names, *RUN_CONFIG_KEYS]))}")
        out = cls(run_overrides=run, **kw)
        out.check()
        return out

    def check(self) -> None:
        positive = ("max_batch_size", "max_batch_images", "num_replicas", "max_replicas_per_node",
                    "max_ongoing_requests", "ingress_replicas", "ingress_max_ongoing_requests",
                    "max_n", "max_steps", "min_size", "max_size", "size_multiple",
                    "max_body_bytes", "max_prompt_chars", "retry_after_s")
        for name in positive:
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"serve arg {name}={v}; it must be >= 1")
        for name in ("batch_wait_timeout_s", "num_cpus", "ingress_num_cpus", "max_guidance"):
            if getattr(self, name) < 0:
                raise ValueError(f"serve arg {name}={getattr(self, name)}; it must be >= 0")
        if not self.request_timeout_s > 0:
            raise ValueError(f"serve arg request_timeout_s={self.request_timeout_s}; "
                             "it must be > 0")
        if self.resource is not None and not self.resource_amount > 0:
            raise ValueError(f"serve arg resource_amount={self.resource_amount}; it must be > 0")
        if self.max_queued_requests < 1 and self.max_queued_requests != -1:
            raise ValueError("serve arg max_queued_requests must be >= 1, or -1 for no limit")
        if (self.max_ongoing_requests is not None
                and self.max_ongoing_requests < self.max_batch_size):
            raise ValueError(f"max_ongoing_requests={self.max_ongoing_requests} is below "
                             f"max_batch_size={self.max_batch_size}: batches could never fill")
        if self.min_size is not None and self.min_size > self.max_size:
            raise ValueError(f"min_size={self.min_size} is above max_size={self.max_size}")
        for b in self.warmup_batch_sizes or ():
            if b < 1:
                raise ValueError(f"warmup_batch_sizes: {b} must be >= 1")

    @property
    def batch_images(self) -> int:
        return self.max_batch_images or self.max_batch_size

    @property
    def generator_max_ongoing(self) -> int:
        return self.max_ongoing_requests or 2 * self.max_batch_size


def _yaml_scalar(value: str):
    import yaml

    return yaml.safe_load(value) if value.strip() else None


def _as_list(key: str, value) -> list:
    if value is None:
        return []
    if isinstance(value, str):
        s = value.strip()
        if s.startswith("["):
            value = _yaml_scalar(s)
        else:
            return [p.strip() for p in s.split(",") if p.strip()]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"serve arg {key} must be a list (or a comma-separated string), got {value!r}")


def _coerce(key: str, value, hint):
    types = typing.get_args(hint) or (hint,)
    if isinstance(value, str) and str not in types:
        value = _yaml_scalar(value)
    if value is None:
        if type(None) in types:
            return None
        raise ValueError(f"serve arg {key!r} may not be null")
    for t in types:
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                break
            return float(value)
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is str and isinstance(value, str):
            return value
    names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
    raise ValueError(f"serve arg {key!r} must be {names}, got {value!r}")


# ---------------------------------------------------------------------------------- HTTP models
ImageFormat = Literal["png", "jpeg", "webp"]


class ImagesGenerationRequest(BaseModel):
    """OpenAI Images API ``POST /v1/images/generations``. ``model``, ``user``, ``quality``,
    ``style``, ``background`` and ``moderation`` are accepted and ignored; unknown fields too."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    prompt: str = Field(min_length=1, description="What to draw.")
    n: int | None = Field(1, ge=1, description="How many images (up to the server's max_n).")
    size: str | None = Field("auto", description="'WIDTHxHEIGHT' (e.g. '1024x1024') or 'auto' "
                             "for the model's default size.")
    response_format: str | None = Field("b64_json", description="Only 'b64_json' is supported.")
    output_format: ImageFormat | None = Field(None, description="png (default), jpeg or webp.")
    output_compression: int | None = Field(None, ge=0, le=100,
                                           description="jpeg/webp quality, 0-100.")
    model: str | None = None
    user: str | None = None
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    moderation: str | None = None
    stream: bool | None = Field(None, description="Streaming is not supported; false or omitted.")

    @field_validator("response_format")
    @classmethod
    def _only_b64(cls, v):
        if v not in (None, "b64_json"):
            raise ValueError("only 'b64_json' is supported: this server returns images inline "
                             "and does not host them at URLs")
        return v

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, v):
        if v:
            raise ValueError("streaming is not supported; omit stream or set it to false")
        return v


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: str | None = None
    size: str | None = None


class GenerateRequest(BaseModel):
    """Native generation: every setting explicit, seeds reported, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: str = Field(min_length=1)
    negative_prompt: str | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED,
                             description="Image k gets seed + k; omitted: random (reported).")
    steps: int | None = Field(None, ge=1, description="Default: the model's / run config's.")
    guidance_scale: float | None = Field(None, ge=0, description="<= 1 turns CFG off.")
    width: int | None = Field(None, ge=1)
    height: int | None = Field(None, ge=1)
    num_images: int = Field(1, ge=1)
    scheduler: str | None = Field(None, description="Must name the loaded scheduler (see "
                                  "/v1/models); the scheduler is chosen when the server starts.")
    output_format: ImageFormat = "png"


class GeneratedImage(BaseModel):
    b64_json: str
    seed: int


class GenerateResponse(BaseModel):
    created: int
    model: str
    images: list[GeneratedImage]
    seeds: list[int]
    width: int
    height: int
    steps: int
    guidance_scale: float
    scheduler: str
    output_format: str
    timings: dict[str, float]


# ---------------------------------------------------------------------------------- jobs
@dataclass
class Job:
    """One HTTP request's images, settings resolved (no None): n images, image k with seed
    ``seed + k`` (``seed`` None: random seeds, reported back)."""

    prompt: str
    negative_prompt: str | None
    seed: int | None
    n: int
    width: int
    height: int
    steps: int
    guidance_scale: float

    @property
    def key(self) -> tuple[int, int, int, bool]:
        """Jobs with equal keys can share a device batch (one compiled program)."""
        return (self.height, self.width, self.steps, self.guidance_scale > 1.0)


@dataclass
class JobResult:
    images: list[np.ndarray]  # uint8 (H, W, 3)
    seeds: list[int]
    timings: dict[str, float]
    batch: dict  # the batch it ran in: id, requests, images, device_batches, shape
    replica: dict  # id, node_id
