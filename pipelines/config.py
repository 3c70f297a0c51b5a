"""Run configs: small YAML files in ``configs/`` loaded into a strict, typed dataclass.

The CLI (``--config``) and the service (``config=``) load them the same way:
``load_run_config("sdxl-lightning-4step", ["model=/models/sdxl-base", "steps=2"])``.
Unknown keys and wrongly typed values are refused with the allowed keys / expected type.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass(frozen=True)
class RunConfig:
    """What a generation run needs. ``None`` means: the model's or scheduler preset's default."""

    model: str | None = None  # diffusers SDXL folder; None: the embedded default model
    unet: str | None = None  # single-file UNet replacing the folder's (SDXL-Lightning)
    scheduler: str | None = None  # preset name (lightning-4step, ...), config folder or json
    steps: int | None = None
    guidance: float | None = None
    height: int | None = None
    width: int | None = None
    dtype: str = "float32"  # float32 | bfloat16 | float16
    attention: str = "auto"  # auto | chunked | xla | dot_product
    attention_chunk: int = 512
    devices: int | None = None  # mesh size: first N local devices; None for all
    compile_cache_dir: str | None = None  # None: ~/.cache/maxdiff/jax ("" turns it off)

    def pipeline_kwargs(self) -> dict:
        """Keyword arguments for ``TextToImagePipeline.from_pretrained``."""
        kw = dict(path=self.model, dtype=self.dtype, unet=self.unet, scheduler=self.scheduler,
                  devices=self.devices, attention_kernel=self.attention,
                  attention_chunk=self.attention_chunk)
        if self.compile_cache_dir is not None:
            kw["compile_cache_dir"] = self.compile_cache_dir or None
        return kw

    def call_kwargs(self) -> dict:
        """Defaults for a pipeline call (only the ones the config sets)."""
        kw = dict(num_inference_steps=self.steps, guidance_scale=self.guidance,
                  height=self.height, width=self.width)
        return {k: v for k, v in kw.items() if v is not None}


def _check_type(key: str, value: Any, hint: Any) -> Any:
    args = typing.get_args(hint) or (hint,)
    if value is None:
        if type(None) in args:
            return None
        raise ValueError(f"config key {key!r} may not be null")
    for t in args:
        if t is type(None):
            continue
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is str and isinstance(value, (str, os.PathLike)):
            return os.fspath(value)
    names = " or ".join("null" if t is type(None) else t.__name__ for t in args)
    raise ValueError(f"config key {key!r} must be {names}, got {value!r}")


NOT_RUN_CONFIGS = ("serve", "train-")  # configs/ also holds the service's and training's


def available_configs() -> list[str]:
    """Names of the run configs in ``configs/``."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")
                  if not p.stem.startswith(NOT_RUN_CONFIGS))


def load_run_config(source: str | os.PathLike | dict | None = None,
                    overrides: Sequence[str] | dict | None = None) -> RunConfig:
    """A :class:`RunConfig` from a YAML path, a name in ``configs/`` (``"sdxl-base"``), a dict
    or None (all defaults), then ``key=value`` overrides (values parsed as YAML scalars)."""
    if source is None:
        data: dict = {}
        where = "run config"
    elif isinstance(source, dict):
        data, where = dict(source), "config"
    else:
        path = Path(source)
        if not path.is_file():
            named = CONFIG_DIR / f"{source}.yaml"
            if not named.is_file():
                raise ValueError(f"config {str(source)!r}: no such file, and not one of the "
                                 f"named configs: {', '.join(available_configs())}")
            path = named
        data = yaml.safe_load(path.read_text()) or {}
        where = str(path)
        if not isinstance(data, dict):
            raise ValueError(f"{where}: a run config is a YAML mapping of key: value")
    if isinstance(overrides, dict):
        data.update(overrides)
    else:
        for item in overrides or ():
            if "=" not in item:
                raise ValueError(f"override {item!r} must look like key=value")
            k, v = item.split("=", 1)
            data[k.strip()] = yaml.safe_load(v) if v.strip() else None
    hints = typing.get_type_hints(RunConfig)
    fields = [f.name for f in dataclasses.fields(RunConfig)]
    kw = {}
    for k, v in data.items():
        if k not in hints:
            raise ValueError(f"{where}: unknown config key {k!r}; allowed keys: {', '.join(fields)}")
        kw[k] = _check_type(k, v, hints[k])
    cfg = RunConfig(**kw)
    from maxdiff.checkpoint import resolve_dtype
    from maxdiff.models.attention import KERNELS

    resolve_dtype(cfg.dtype)
    if cfg.attention not in KERNELS:
        raise ValueError(f"{where}: attention={cfg.attention!r}; use one of {', '.join(KERNELS)}")
    for k in ("steps", "height", "width", "devices", "attention_chunk"):
        v = getattr(cfg, k)
        if v is not None and v < 1:
            raise ValueError(f"{where}: {k}={v}; it must be >= 1")
    if cfg.guidance is not None and cfg.guidance < 0:
        raise ValueError(f"{where}: guidance={cfg.guidance}; it must be >= 0")
    return cfg
