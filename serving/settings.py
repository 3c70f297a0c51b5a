"""The deployment's settings (:class:`ServeSettings`), parsed strictly from ``build_app``'s args
(a dict from ``serve run ... key=value`` or a ``configs/serve.yaml`` ``args:`` block) with the
same config machinery as run configs (:mod:`maxdiff.config`); its parts (warm-up shapes,
adapters, ControlNets, models, autoscaling) are :mod:`serving.specs`'. Nothing here imports
JAX."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from maxdiff.config import parse_overrides, validate, yaml_scalar
from pipelines.config import RunConfig
from pipelines.step_scheduler import POLICIES
from serving.specs import (
    MODEL_ARGS,
    RUN_CONFIG_KEYS,
    STEP_REFINER,
    AdapterSpec,
    Autoscaling,
    ControlNetSpec,
    ModelSpec,
    WarmupShape,
    WithAdapters,
    as_list,
    split_run_args,
)

__all__ = ["AdapterSpec", "ControlNetSpec", "ServeSettings", "STEP_REFINER", "StepPolicy",
           "WarmupShape"]

# the step engine's admission policies (pipelines.step_scheduler.POLICIES): "fifo", "srs"
StepPolicy = Literal[tuple(POLICIES)]


class ServeSettings(WithAdapters):
    """How the service batches, places replicas and bounds requests (see docs/service.md).

    ``build_app`` args that are :class:`pipelines.config.RunConfig` keys (model, unet, scheduler,
    dtype, steps, guidance, height, width, attention, devices, ...) go to the run config, on top
    of ``config`` (a shipped config's name or a YAML path); :meth:`from_args` splits them off
    into ``run_overrides``.
    """

    config: str | None = None  # run config name or path; None: defaults (the embedded model)
    run_overrides: dict = {}
    model_name: str | None = None  # the id /v1/models reports; None: the model folder's name
    # several models in one application (docs/multi-model.md): the first is the default
    models: tuple[ModelSpec, ...] = ()
    # models one generator replica keeps loaded (Ray Serve's LRU); None: every model of `models`
    max_models_per_replica: int | None = Field(None, ge=1)
    # batching: requests that share (height, width, steps, cfg on/off) share a device batch
    max_batch_size: int = Field(8, ge=1)  # requests per batch
    max_batch_images: int | None = Field(None, ge=1)  # images per device batch; None: batch size
    batch_wait_timeout_s: float = Field(0.05, ge=0)
    # "batch": whole requests batched per shape key (above); "step": step-level continuous
    # batching (pipelines.step_engine), images join and leave between denoising steps, one
    # engine of engine_slots slots per image size; streamed progress and partial images need it
    engine: Literal["batch", "step"] = "batch"
    # images per step-engine tick (rounded up to a multiple of the devices); None: max_batch_size
    engine_slots: int | None = Field(None, ge=1)
    # the order queued images take free step-engine slots in: "fifo" (arrival) or "srs"
    # (shortest remaining steps first; a waiting image gains a step of priority per tick, so
    # none waits forever: pipelines.step_scheduler)
    step_policy: StepPolicy = "fifo"
    # replicas and placement
    # a fixed count, or "auto": replicas follow the load within `autoscaling` (its defaults
    # unless given; an `autoscaling` block alone also turns it on)
    num_replicas: Annotated[int, Field(ge=1)] | Literal["auto"] = 1
    autoscaling: Autoscaling | None = None
    resource: str | None = None  # "GPU", "TPU" or a custom per-host resource; None: CPU only
    resource_amount: float = Field(1.0, gt=0)  # of `resource` per replica (e.g. every chip)
    num_cpus: float = Field(1.0, ge=0)  # per generator replica
    max_replicas_per_node: int | None = Field(None, ge=1)  # 1: one replica per host
    # per replica; None: 2 * max_batch_size (engine=step: 4 * engine_slots: the engine's own
    # queue, which admits an image the moment a slot frees, holds 3 slots' worth)
    max_ongoing_requests: int | None = Field(None, ge=1)
    max_queued_requests: int = 64  # waiting for a generator replica, per caller; -1: no limit
    ingress_replicas: int = Field(1, ge=1)
    ingress_num_cpus: float = Field(0.25, ge=0)
    ingress_max_ongoing_requests: int = Field(1024, ge=1)
    # requests
    request_timeout_s: float = Field(300.0, gt=0)
    retry_after_s: int = Field(2, ge=1)  # Retry-After on a 503
    warmup_shapes: tuple[WarmupShape, ...] = (WarmupShape(),)  # compiled before ready
    warmup_batch_sizes: tuple[int, ...] | None = None  # None: every padded batch size
    # adapters, controlnets: WithAdapters'
    max_n: int = Field(4, ge=1)  # images per request
    max_steps: int = Field(100, ge=1)
    max_guidance: float = Field(30.0, ge=0)
    min_size: int | None = Field(None, ge=1)  # pixels per side; None: size_multiple
    max_size: int | None = Field(None, ge=1)  # None: the model's max_size (maxdiff.json), or 2048
    size_multiple: int | None = Field(None, ge=1)  # sides: multiples of this and the VAE factor
    max_body_bytes: int = Field(65536, ge=1)  # every route but the edit routes (below)
    # the body limit of POST /v1/images/edits and /v1/edit instead (they carry images; base64
    # in JSON is 4/3 of the file size); 20 MiB
    max_image_bytes: int = Field(20 * 2**20, ge=1)
    max_prompt_chars: int = Field(4000, ge=1)
    # a request's cost: images x steps x megapixels (width x height / 2**20); 400 is 4 images of
    # 1024x1024 at 100 steps
    max_cost: float = Field(400.0, gt=0)
    # security (docs/service.md, "Security model")
    api_keys: tuple[str, ...] | None = None  # keys or "sha256:<hex>"; a file path: one a line
    rate_limit_per_minute: float | None = Field(None, gt=0)  # per API key (or client address)
    cors_origins: tuple[str, ...] = ()  # origins allowed to call from a browser; () : no CORS
    log_prompts: bool = False  # prompts appear in the logs only when true
    # a request's `moderation: "low"` turns the model's safety checker (SD 1.x checkpoints that
    # ship one) off for its images; refused (422) unless true
    allow_moderation_low: bool = False
    playground: bool = True  # the web playground at GET / (docs/service.md, "Playground")
    # cost (/v1/stats): what one generator replica costs per hour (its host, or its share of
    # one: every accelerator it holds), in any currency; None: no cost figures
    price_per_hour: float | None = Field(None, ge=0)
    stats_window_s: float = Field(300.0, gt=0)  # /v1/stats' images/s and cost: this window
    # outputs and jobs (docs/service.md, "Links and jobs")
    # where images answered as links (response_format "url", jobs) are written: a folder or an
    # fsspec URL (s3://bucket/prefix with s3fs, gs://... with gcsfs); None: ~/.cache/maxdiff/outputs
    output_store: str | None = None
    # fsspec options for it, e.g. {endpoint_url: http://minio:9000} (s3fs's client_kwargs and
    # the like); credentials best come from the environment (AWS_ACCESS_KEY_ID, ...)
    output_store_options: dict = {}
    output_ttl_s: float | None = Field(3600.0, gt=0)  # how long they stay; None: for good
    sign_urls: bool = True  # presigned links where the store makes them (else /v1/files/)
    # what links to this server start with (e.g. https://images.example.com); None: the URL
    # each request came to
    public_url: str | None = None
    # the jobs database (SQLite); None: ~/.cache/maxdiff/jobs.sqlite
    jobs_db: str | None = None
    job_timeout_s: float = Field(3600.0, gt=0)  # a job not done by then fails
    max_running_jobs: int = Field(16, ge=1)  # per ingress replica, sent to the generator at once
    max_active_jobs: int = Field(1000, ge=1)  # queued or running jobs per API key
    webhook_secret: str | None = Field(None, min_length=16)  # None: one kept in jobs_db
    webhook_retries: int = Field(5, ge=0)
    webhook_backoff_s: float = Field(2.0, ge=0)  # doubles after each failed try
    webhook_timeout_s: float = Field(10.0, gt=0)
    # faults
    # a replica being removed (scale-down, redeploy) takes no new requests and finishes its
    # in-flight ones within this; checked every graceful_shutdown_wait_loop_s
    graceful_shutdown_s: float = Field(60.0, ge=0)
    graceful_shutdown_wait_loop_s: float = Field(2.0, gt=0)
    health_check_period_s: float = Field(10.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)

    @field_validator("warmup_shapes", mode="before")
    @classmethod
    def _shapes(cls, v):
        return tuple(WarmupShape.parse(x) for x in (as_list(v) or ()))

    @field_validator("num_replicas", mode="before")
    @classmethod
    def _replicas(cls, v):
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError("num_replicas must be a count >= 1 or auto")

    @field_validator("autoscaling", mode="before")
    @classmethod
    def _autoscaling(cls, v):
        if v is None or isinstance(v, Autoscaling):
            return v
        if not isinstance(v, dict):
            raise ValueError("give a mapping, e.g. {min_replicas: 0, max_replicas: 4}")
        return validate(Autoscaling, v, "autoscaling")

    @field_validator("models", mode="before")
    @classmethod
    def _models(cls, v):
        v = yaml_scalar(v) if isinstance(v, str) else v
        if v is None:
            return ()
        if isinstance(v, dict):
            raise ValueError("give a list of models, each a mapping with a name (e.g. "
                             "[{name: base, model: /models/sdxl}])")
        specs = tuple(ModelSpec.parse(x, f"models[{i}]") for i, x in enumerate(v))
        names = [m.name for m in specs]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"model name {dup!r} is given twice; each needs its own name")
        return specs

    @field_validator("api_keys", "cors_origins", mode="before")
    @classmethod
    def _strings(cls, v):
        return as_list(v)

    @field_validator("warmup_batch_sizes", mode="before")
    @classmethod
    def _sizes(cls, v):
        v = as_list(v)
        return None if v is None else tuple(yaml_scalar(x) if isinstance(x, str) else x
                                             for x in v)

    @field_validator("warmup_batch_sizes")
    @classmethod
    def _sizes_positive(cls, v):
        for b in v or ():
            if b < 1:
                raise ValueError(f"{b} must be >= 1")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.autoscaling is not None and "num_replicas" in self.model_fields_set \
                and self.num_replicas != "auto":
            raise ValueError(f"num_replicas={self.num_replicas} and an autoscaling block: give "
                             "num_replicas: auto with autoscaling, or a fixed num_replicas alone")
        if self.max_queued_requests < 1 and self.max_queued_requests != -1:
            raise ValueError("max_queued_requests must be >= 1, or -1 for no limit")
        if (self.max_ongoing_requests is not None
                and self.max_ongoing_requests < self.max_batch_size):
            raise ValueError(f"max_ongoing_requests={self.max_ongoing_requests} is below "
                             f"max_batch_size={self.max_batch_size}: batches could never fill")
        if (self.min_size is not None and self.max_size is not None
                and self.min_size > self.max_size):
            raise ValueError(f"min_size={self.min_size} is above max_size={self.max_size}")
        if self.engine == "step" and (self.run_overrides.get("refiner") or any(
                m.run_overrides.get("refiner") for m in self.models)):
            raise ValueError(STEP_REFINER)
        # warm-up shapes are the default (first) model's: their ControlNets must be its own
        loaded = [c.name for c in (self.models[0].controlnets if self.models
                                   else self.controlnets)]
        for shape in self.warmup_shapes:
            unknown = [n for n in shape.controlnets if n not in loaded]
            if unknown:
                raise ValueError(f"warmup shape {shape}: ControlNet {unknown[0]!r} is not loaded "
                                 f"by the default model; its ControlNets: "
                                 f"{', '.join(loaded) or 'none (serve arg controlnets)'}")
        return self

    @classmethod
    def from_args(cls, args: dict | None) -> ServeSettings:
        """Parse ``build_app`` args; values may be strings (``serve run ... key=value``)."""
        args, run = split_run_args(parse_overrides(args))
        if "run_overrides" in args:
            raise ValueError("serve arg 'run_overrides' is internal; give run-config keys "
                             f"({', '.join(RUN_CONFIG_KEYS)}) directly")
        extra = set(args) - set(cls.model_fields)
        if extra:
            allowed = sorted([*(k for k in cls.model_fields if k != "run_overrides"),
                              *RUN_CONFIG_KEYS])
            raise ValueError(f"unknown serve arg {sorted(extra)[0]!r}; allowed: "
                             f"{', '.join(allowed)}")
        given = sorted(k for k in (*args, *run) if k in MODEL_ARGS)
        if args.get("models") and given:
            raise ValueError(f"serve arg {given[0]!r} belongs to one model: with `models` give "
                             "it in each models entry (name, config, adapters, controlnets, "
                             "run-config keys)")
        validate(RunConfig, run, "serve args (run-config keys)")  # bad values fail here, early
        return validate(cls, {**args, "run_overrides": run}, "serve args")

    @property
    def batch_images(self) -> int:
        return self.max_batch_images or self.max_batch_size

    @property
    def generator_max_ongoing(self) -> int:
        if self.max_ongoing_requests:
            return self.max_ongoing_requests
        return 4 * self.slots if self.engine == "step" else 2 * self.max_batch_size

    @property
    def autoscaling_config(self) -> dict | None:
        """Ray Serve's ``autoscaling_config`` for the generator, or None (fixed replicas)."""
        if self.num_replicas != "auto" and self.autoscaling is None:
            return None
        a = self.autoscaling or Autoscaling()
        config = a.model_dump(exclude_none=True)
        config["target_ongoing_requests"] = a.target_ongoing_requests or (
            self.slots if self.engine == "step" else self.max_batch_size)
        if a.initial_replicas is None and a.min_replicas == 0:
            config["initial_replicas"] = 1  # start serving; scale to zero once idle
        return config

    @property
    def scales_to_zero(self) -> bool:
        return (self.autoscaling_config or {}).get("min_replicas", 1) == 0

    @property
    def slots(self) -> int:
        """Slots of each step engine (engine=step)."""
        return self.engine_slots or self.max_batch_size
