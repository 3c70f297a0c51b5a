"""The parts of the deployment's settings (:mod:`serving.settings`): warm-up shapes, LoRA
adapters, ControlNets, the models of a multi-model deployment and the autoscaling policy, each
parsed strictly from ``build_app``'s args (strings as ``serve run`` gives them, or YAML). Nothing
here imports JAX."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from maxdiff.config import StrictConfig, validate, yaml_scalar
from pipelines.config import RunConfig
from pipelines.requests import parse_size

# build_app args that go to the run config; the rest are ServeSettings.
RUN_CONFIG_KEYS = tuple(RunConfig.model_fields)
# args taken as given when they come as strings (names and paths); others are parsed as YAML
TEXT_ARGS = ("config", "model_name", "name", "resource", "model", "unet", "vae",
             "single_file_config", "scheduler", "compile_cache_dir", "dtype", "quantization",
             "attention", "api_keys", "cors_origins", "adapters", "controlnets", "refiner",
             "ip_adapter", "ip_adapter_image_encoder", "preview_decoder")
ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


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


class WithAdapters(StrictConfig):
    """A model's per-request LoRA adapters (preloaded unfused by every generator replica before
    warm-up: name -> path, or {path, scale}, or "name=path[:scale],..."; requests pick one by
    name) and its ControlNets (name -> a diffusers ControlNet folder, or "name=path,...";
    requests name them in control_images): the single-model serve args and each ``models``
    entry alike."""

    adapters: tuple[AdapterSpec, ...] = ()
    controlnets: tuple[ControlNetSpec, ...] = ()

    @field_validator("adapters", mode="before")
    @classmethod
    def _adapters(cls, v):
        return AdapterSpec.parse_all(v)

    @field_validator("controlnets", mode="before")
    @classmethod
    def _controlnets(cls, v):
        return ControlNetSpec.parse_all(v)


class ModelSpec(WithAdapters):
    """One entry of the serve arg ``models`` (docs/multi-model.md): a name, its run config
    (``config``, a shipped name or a YAML path) and run-config keys (model, vae,
    single_file_config, loras, scheduler, steps, dtype, ...), its per-request LoRA
    ``adapters`` and its ``controlnets``, all as the single-model serve args have them."""

    name: str = Field(pattern=MODEL_NAME)
    config: str | None = None
    run_overrides: dict = {}

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
        args["loras"] = as_list(args["loras"])
    run = {k: args.pop(k) for k in list(args) if k in RUN_CONFIG_KEYS}
    for values in (args, run):
        for k, v in values.items():
            if isinstance(v, str) and k not in TEXT_ARGS:
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


def as_list(value) -> Any:
    """A list arg given as a string: ``"[a, b]"`` (YAML) or ``"a,b"``; one value: a list of it."""
    if isinstance(value, (int, float, dict)) and not isinstance(value, bool):
        return [value]
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return yaml_scalar(text)
        return [p.strip() for p in text.split(",") if p.strip()]
    return value
