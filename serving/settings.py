"""The deployment's settings (``ServeSettings``, with ``WarmupShape``, ``AdapterSpec`` and
``ControlNetSpec``), parsed
strictly from ``build_app``'s args (a dict from ``serve run ... key=value`` or a
``configs/serve.yaml`` ``args:`` block) with the same config machinery as run configs
(:mod:`maxdiff.config`). Nothing here imports JAX."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from maxdiff.config import StrictConfig, parse_overrides, validate, yaml_scalar
from pipelines.config import RunConfig
from pipelines.requests import parse_size
from pipelines.step_scheduler import POLICIES

# the step engine's admission policies (pipelines.step_scheduler.POLICIES): "fifo", "srs"
StepPolicy = Literal[tuple(POLICIES)]

# build_app args that go to the run config; the rest are ServeSettings.
RUN_CONFIG_KEYS = tuple(RunConfig.model_fields)
# args taken as given when they come as strings (names and paths); others are parsed as YAML
_TEXT_ARGS = ("config", "model_name", "name", "resource", "model", "unet", "vae", "single_file_config",
              "scheduler", "compile_cache_dir", "dtype", "quantization", "attention", "api_keys",
              "cors_origins", "adapters", "controlnets", "refiner")
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


# ---------------------------------------------------------------------------------- settings
class WarmupShape(StrictConfig):
    """One program to compile before a replica reports ready. None: the model's default."""

    width: int | None = Field(None, json_schema_extra={"minimum": 1})
    height: int | None = Field(None, json_schema_extra={"minimum": 1})
    steps: int | None = Field(None, ge=1)
    guidance: float | None = Field(None, ge=0)  # > 1: classifier-free guidance on
    # ControlNets (names the model loaded, in a request's order): their programs (engine=batch)
    # or step engine (engine=step) for this shape; (): text-to-image
    controlnets: tuple[str, ...] = ()

    @classmethod
    def parse(cls, spec: Any) -> WarmupShape:
        """``"WxH:steps:guidance:controlnets"`` (later parts optional; guidance may be
        ``cfg``/``nocfg``; ControlNet names joined by ``+``), ``"default"``, or a mapping with
        ``size`` (or ``width``, ``height``), ``steps``, ``guidance`` (or ``cfg``),
        ``controlnets`` (a list, or names joined by ``+``)."""
        if isinstance(spec, WarmupShape):
            return spec
        if isinstance(spec, dict):
            d = dict(spec)
            if d.get("size") is not None:
                d["width"], d["height"] = _size(d.pop("size"), spec)
            d.pop("size", None)
            if "cfg" in d:
                d["guidance"] = _cfg_word(str(d.pop("cfg")).lower())
            if isinstance(d.get("controlnets"), str):
                d["controlnets"] = _names(d["controlnets"])
            return validate(cls, d, f"warmup shape {spec}")
        if not isinstance(spec, str):
            raise ValueError(f"warmup shape {spec!r}: give 'WxH:steps:guidance' or a mapping")
        if spec.strip().lower() == "default":
            return cls()
        parts = spec.strip().split(":")
        if len(parts) > 4 or not parts[0]:
            raise ValueError(f"warmup shape {spec!r}: use 'WxH', 'WxH:steps', "
                             "'WxH:steps:guidance' (e.g. '1024x1024:4:0') or "
                             "'WxH:steps:guidance:controlnets' (e.g. '1024x1024:30:cfg:canny')")
        w, h = _size(parts[0], spec)
        d: dict[str, Any] = {"width": w, "height": h}
        if len(parts) > 1 and parts[1]:
            d["steps"] = yaml_scalar(parts[1])
        if len(parts) > 2 and parts[2]:
            word = parts[2].strip().lower()
            d["guidance"] = _cfg_word(word) if word in _CFG_WORDS else yaml_scalar(word)
        if len(parts) > 3:
            d["controlnets"] = _names(parts[3])
        return validate(cls, d, f"warmup shape {spec!r}")

    def __str__(self) -> str:
        size = "default size" if self.width is None else f"{self.width}x{self.height}"
        guidance = "default" if self.guidance is None else self.guidance
        nets = f":{'+'.join(self.controlnets)}" if self.controlnets else ""
        return f"{size}:{self.steps or 'default'}:{guidance}{nets}"


def _names(text: str) -> tuple[str, ...]:
    """``"canny+depth"`` -> ("canny", "depth"); an empty name is an error."""
    names = tuple(n.strip() for n in text.split("+"))
    if not all(names):
        raise ValueError(f"controlnets {text!r}: give ControlNet names joined by '+' "
                         "(e.g. canny+depth)")
    return names


_CFG_WORDS = {"cfg": 5.0, "on": 5.0, "true": 5.0, "nocfg": 0.0, "off": 0.0, "false": 0.0}


def _cfg_word(word: str) -> float:
    if word not in _CFG_WORDS:
        raise ValueError(f"cfg={word!r}: use cfg/nocfg, on/off, or a guidance scale")
    return _CFG_WORDS[word]


def _size(value, spec) -> tuple[int, int]:
    try:
        return parse_size(value)
    except ValueError as e:
        raise ValueError(f"warmup shape {spec!r}: size {e}") from None


class AdapterSpec(StrictConfig):
    """One per-request LoRA adapter the generator replicas preload (``add_adapter``)."""

    name: str = Field(pattern=ADAPTER_NAME)
    path: str = Field(min_length=1)
    scale: float = 1.0

    @classmethod
    def parse_all(cls, value: Any) -> tuple[AdapterSpec, ...]:
        """A mapping name -> path or name -> {path, scale} (YAML/JSON, also as a string), a
        list of such mappings, or ``"name=path[:scale],name2=path2"``."""
        return _named_specs(cls, value, "adapter", scaled=True)


class ControlNetSpec(StrictConfig):
    """One ControlNet the generator replicas load for a model (serve arg ``controlnets``):
    requests name it in their ``control_images``."""

    name: str = Field(pattern=ADAPTER_NAME)
    path: str = Field(min_length=1)  # a diffusers ControlNet folder or a .safetensors file

    @classmethod
    def parse_all(cls, value: Any) -> tuple[ControlNetSpec, ...]:
        """A mapping name -> path (YAML/JSON, also as a string), a list of ``{name, path}``, or
        ``"name=path,name2=path2"``."""
        return _named_specs(cls, value, "controlnet", scaled=False)


def _named_specs(cls, value: Any, what: str, scaled: bool) -> tuple:
    """``cls`` instances (a ``name`` and a ``path``, with ``scaled`` a ``scale``) from the
    forms :meth:`AdapterSpec.parse_all` and :meth:`ControlNetSpec.parse_all` take."""
    form = "name=path[:scale]" if scaled else "name=path"
    if value is None:
        return ()
    if isinstance(value, str):
        text = value.strip()
        if text.startswith(("{", "[")):
            value = yaml_scalar(text)
        else:
            value = {}
            for part in (p.strip() for p in text.split(",")):
                if not part:
                    continue
                name, eq, rest = part.partition("=")
                if not eq:
                    raise ValueError(f"{what} {part!r}: give {form}")
                spec: dict = {"path": rest}
                if scaled:
                    path, colon, scale = rest.rpartition(":")
                    try:
                        spec = {"path": path, "scale": float(scale)} if colon else spec
                    except ValueError:  # a ':' inside the path
                        pass
                if name.strip() in value:
                    raise ValueError(f"{what} {name.strip()!r} is given twice")
                value[name.strip()] = spec
    if isinstance(value, dict):
        value = [{"name": k, **(v if isinstance(v, dict) else {"path": v})}
                 for k, v in value.items()]
    if not isinstance(value, (list, tuple)):
        more = " (or name: {path, scale})" if scaled else ""
        raise ValueError(f"give a mapping name: path{more} or '{form},...'")
    specs = tuple(x if isinstance(x, cls) else validate(cls, x, f"{what} {x}") for x in value)
    names = [x.name for x in specs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"{what} {dup!r} is given twice")
    return specs


MODEL_NAME = ADAPTER_NAME  # a served model's name: no ':' (``<model>:<adapter>`` picks an adapter)
# serve args that belong to one model: with a ``models:`` list each entry gives its own
# the step engine's program has no refiner stage (yet): engine=batch runs base + refiner
STEP_REFINER = ("serve arg refiner: engine=step does not run an SDXL refiner yet; use "
                "engine=batch (its programs run base and refiner as one)")
MODEL_ARGS = ("config", "model_name", "adapters", "controlnets", *RUN_CONFIG_KEYS)


class ModelSpec(StrictConfig):
    """One entry of the serve arg ``models`` (docs/multi-model.md): a name, its run config
    (``config``, a shipped name or a YAML path) and run-config keys (model, vae,
    single_file_config, loras, scheduler, steps, dtype, ...), its per-request LoRA
    ``adapters`` and its ``controlnets``, all as the single-model serve args have them."""

    name: str = Field(pattern=MODEL_NAME)
    config: str | None = None
    adapters: tuple[AdapterSpec, ...] = ()
    controlnets: tuple[ControlNetSpec, ...] = ()
    run_overrides: dict = {}

    @field_validator("adapters", mode="before")
    @classmethod
    def _adapters(cls, v):
        return AdapterSpec.parse_all(v)

    @field_validator("controlnets", mode="before")
    @classmethod
    def _controlnets(cls, v):
        return ControlNetSpec.parse_all(v)

    @classmethod
    def parse(cls, entry: Any, where: str) -> ModelSpec:
        if isinstance(entry, ModelSpec):
            return entry
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: give a mapping with name, model, config, adapters, ... "
                             f"got {entry!r}")
        args, run = split_run_args(entry)
        extra = set(args) - {"name", "config", "adapters", "controlnets"}
        if extra:
            raise ValueError(f"{where}: unknown key {sorted(extra)[0]!r}; allowed: name, config, "
                             f"adapters, controlnets, {', '.join(RUN_CONFIG_KEYS)}")
        validate(RunConfig, run, f"{where} (run-config keys)")
        return validate(cls, {**args, "run_overrides": run}, where)


def split_run_args(args: dict) -> tuple[dict, dict]:
    """(the other args, the run-config args) of serve args or a ``models`` entry: ``lora`` is
    ``loras``; strings are parsed as YAML scalars ("8" -> 8, "null" -> None, "[a, b]" -> a
    list) except names and paths."""
    args = dict(args)
    if "lora" in args:  # lora=PATH[:SCALE][,PATH[:SCALE]...]: the run config's loras
        if "loras" in args:
            raise ValueError("give the serve arg lora or loras, not both")
        args["loras"] = args.pop("lora")
    if isinstance(args.get("loras"), str):
        args["loras"] = _as_list(args["loras"])
    run = {k: args.pop(k) for k in list(args) if k in RUN_CONFIG_KEYS}
    for values in (args, run):
        for k, v in values.items():
            if isinstance(v, str) and k not in _TEXT_ARGS:
                values[k] = yaml_scalar(v)
    return args, run


class Autoscaling(StrictConfig):
    """Ray Serve's ``autoscaling_config`` for the generator deployment (serve arg
    ``autoscaling``; ``num_replicas: auto`` turns it on with these defaults). The defaults suit
    image generation, where a new replica loads the model and compiles for seconds to minutes:
    scale up after 30 s of load (a shorter burst is served sooner by the replicas already warm),
    down after 10 minutes idle (a replica is slow to bring back), never below one replica unless
    ``min_replicas: 0`` is asked for (the first request after zero waits for a cold start)."""

    min_replicas: int = Field(1, ge=0)  # 0: scale to zero when idle
    max_replicas: int = Field(4, ge=1)
    initial_replicas: int | None = Field(None, ge=0)  # None: min_replicas (at least 1)
    # requests per replica (running and waiting for it) the autoscaler aims at; None: a full
    # batch (max_batch_size; engine=step: engine_slots)
    target_ongoing_requests: float | None = Field(None, gt=0)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    downscale_to_zero_delay_s: float | None = Field(None, ge=0)  # None: downscale_delay_s
    metrics_interval_s: float = Field(10.0, gt=0)  # how often replicas and callers report load
    look_back_period_s: float = Field(30.0, gt=0)  # the window the load is averaged over

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"autoscaling.min_replicas={self.min_replicas} is above "
                             f"autoscaling.max_replicas={self.max_replicas}")
        if self.initial_replicas is not None and not (
                self.min_replicas <= self.initial_replicas <= self.max_replicas):
            raise ValueError(f"autoscaling.initial_replicas={self.initial_replicas} must lie "
                             f"in [min_replicas, max_replicas] = [{self.min_replicas}, "
                             f"{self.max_replicas}]")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(f"autoscaling.look_back_period_s={self.look_back_period_s} must be "
                             f"above autoscaling.metrics_interval_s={self.metrics_interval_s}")
        return self


def _as_list(value) -> Any:
    """A list arg given as a string: ``"[a, b]"`` (YAML) or ``"a,b"``; one value: a list of it."""
    if isinstance(value, (int, float, dict)) and not isinstance(value, bool):
        return [value]
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return yaml_scalar(text)
        return [p.strip() for p in text.split(",") if p.strip()]
    return value


class ServeSettings(StrictConfig):
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
    # per-request LoRA adapters, preloaded unfused by every generator replica before warm-up:
    # name -> path (or {path, scale}), or "name=path[:scale],..."; requests pick one by name
    adapters: tuple[AdapterSpec, ...] = ()
    # ControlNets every generator replica loads with the model (name -> a diffusers ControlNet
    # folder, or "name=path,..."); requests name them in control_images
    controlnets: tuple[ControlNetSpec, ...] = ()
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
    playground: bool = True  # the web playground at GET / (docs/service.md, "Playground")
    # cost (/v1/stats): what one generator replica costs per hour (its host, or its share of
    # one: every accelerator it holds), in any currency; None: no cost figures
    price_per_hour: float | None = Field(None, ge=0)
    stats_window_s: float = Field(300.0, gt=0)  # /v1/stats' images/s and cost: this window
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
        return tuple(WarmupShape.parse(x) for x in (_as_list(v) or ()))

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

    @field_validator("adapters", mode="before")
    @classmethod
    def _adapters(cls, v):
        return AdapterSpec.parse_all(v)

    @field_validator("controlnets", mode="before")
    @classmethod
    def _controlnets(cls, v):
        return ControlNetSpec.parse_all(v)

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
        return _as_list(v)

    @field_validator("warmup_batch_sizes", mode="before")
    @classmethod
    def _sizes(cls, v):
        v = _as_list(v)
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
