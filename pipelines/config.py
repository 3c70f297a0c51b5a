"""Run configs and a model folder's own defaults.

- :class:`RunConfig`: a small YAML file in ``configs/`` (or anywhere), loaded strictly: the CLI
  (``--config``) and the service (``config=``) use the same loader,
  ``load_run_config("sdxl-lightning-4step", ["model=/models/sdxl-base", "steps=2"])``.
- :class:`ModelDefaults`: an optional ``maxdiff.json`` in a model folder with the settings that
  were measured to suit that model (steps, guidance, native size, largest size, notes).
  ``TextToImagePipeline.from_pretrained`` applies it, so every way in (Python, CLI, service)
  gets the same defaults without naming a config. The embedded demo model ships one.

Precedence, lowest first: the scheduler folder's class, ``maxdiff.json``, a scheduler preset
(``lightning-4step`` sets its steps and guidance), the run config, the call's arguments.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from maxdiff.config import StrictConfig, config_names, load_config, validate
from maxdiff.quantization import Quantization, lora_problem
from pipelines.limits import HIGH_NOISE_FRAC, IP_ADAPTER_SCALE

MODEL_DEFAULTS_FILE = "maxdiff.json"
NOT_RUN_CONFIGS = ("serve", "train-")  # configs/ also holds the service's and training's
Attention = Literal["auto", "chunked", "xla", "dot_product", "splash"]
DType = Literal["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]


class LoraSpec(StrictConfig):
    """A LoRA adapter fused at load: ``path`` (a ``.safetensors`` file, or a folder holding
    ``pytorch_lora_weights.safetensors``), ``scale``, optional ``name``. Written
    ``"PATH[:SCALE]"`` on command lines and in serve args."""

    path: str
    scale: float = 1.0
    name: str | None = None

    @classmethod
    def parse(cls, value) -> LoraSpec | dict:
        """``"PATH"``, ``"PATH:SCALE"`` (the last ``:`` followed by a number) or a mapping."""
        if not isinstance(value, str):
            return value
        path, sep, tail = value.rpartition(":")
        if sep and path:
            try:
                return cls(path=path, scale=float(tail))
            except ValueError:
                pass
        return cls(path=value)

    def __str__(self) -> str:
        return f"{self.path}:{self.scale:g}" + (f" ({self.name})" if self.name else "")


class EmbeddingSpec(StrictConfig):
    """A textual-inversion embedding loaded at load: ``path`` (a ``.safetensors`` file or a
    folder with ``learned_embeds.safetensors``), optional ``token`` (default: the file's).
    Written ``"PATH[:TOKEN]"`` on command lines."""

    path: str
    token: str | None = None

    @classmethod
    def parse(cls, value) -> EmbeddingSpec | dict:
        """``"PATH"`` or ``"PATH:TOKEN"`` (the part after the last ``:`` when the whole is no
        existing path), or a mapping."""
        if not isinstance(value, str):
            return value
        path, sep, tail = value.rpartition(":")
        if sep and path and tail and not os.path.exists(value):
            return cls(path=path, token=tail)
        return cls(path=value)

    def __str__(self) -> str:
        return self.path + (f":{self.token}" if self.token else "")


class RunConfig(StrictConfig):
    """What a generation run needs. ``None`` means: the model's or scheduler preset's default."""

    model: str | None = None  # diffusers SDXL folder or single file; None: the embedded model
    unet: str | None = None  # single-file UNet replacing the model's (SDXL-Lightning)
    vae: str | None = None  # VAE file or folder replacing the model's (sdxl_vae.safetensors)
    single_file_config: str | None = None  # diffusers folder describing a single-file model
    # preset (lightning-4step, ...), sampler name (dpmpp_2m_karras, "DPM++ 2M Karras", unipc,
    # ...: the model's own scheduler config switched to that sampler), config folder or json
    scheduler: str | None = None
    steps: int | None = Field(None, ge=1)
    guidance: float | None = Field(None, ge=0)
    height: int | None = Field(None, ge=1)
    width: int | None = Field(None, ge=1)
    dtype: DType = "float32"
    attention: Attention = "auto"
    attention_chunk: int = Field(512, ge=1)
    devices: int | None = Field(None, ge=1)  # mesh size: first N local devices; None for all
    compile_cache_dir: str | None = None  # None: ~/.cache/maxdiff/jax ("" turns it off)
    # encode / decode large images tile by tile: "auto" (more than 2.1 megapixels for SDXL),
    # true (whenever a side exceeds sample_size, diffusers' enable_tiling) or false
    vae_tiling: bool | Literal["auto"] = "auto"
    loras: tuple[LoraSpec, ...] = ()  # LoRA adapters fused at load, in order ("PATH[:SCALE]")
    # textual-inversion embeddings loaded at load ("PATH[:TOKEN]"): their tokens work in prompts
    embeddings: tuple[EmbeddingSpec, ...] = ()
    # an IP-Adapter (.safetensors) loaded at load: requests then take an image prompt
    # (ip_adapter_image); its CLIP vision encoder folder (None: h94/IP-Adapter's place beside
    # the file) and the scale of images that give none
    ip_adapter: str | None = None
    ip_adapter_image_encoder: str | None = None
    ip_adapter_scale: float = Field(1.0, ge=IP_ADAPTER_SCALE[0], le=IP_ADAPTER_SCALE[1])
    # a tiny autoencoder folder (TAESDXL / TAESD) or decoder file (taesdxl_decoder.safetensors)
    # that draws previews (the step engine's, the service's partial_images) at a few percent
    # of the VAE decoder's cost
    preview_decoder: str | None = None
    # the UNet's transformer linear layers in int8 / fp8 through qwix (maxdiff.quantization):
    # none, int8-weights (int8 weights), int8 (int8 weights and activations), fp8 (e4m3)
    quantization: Quantization = "none"
    # an SDXL refiner (folder or single file) that finishes every text-to-image image from high_noise_frac of
    # the schedule (diffusers' ensemble of experts; base and refiner in one program)
    refiner: str | None = None
    # run the checkpoint's safety checker where it ships one (SD 1.x; diffusers' default)
    safety_checker: bool = True
    high_noise_frac: float = Field(HIGH_NOISE_FRAC, gt=0, lt=1)
    # a Hugging Face model name's branch, tag or commit (None: main), and the weight variant
    # read where a component has one (``fp16``: *.fp16.safetensors)
    revision: str | None = None
    variant: str | None = None

    @field_validator("loras", "embeddings", mode="before")
    @classmethod
    def _specs(cls, v, info):
        """None, one spec (a string or a mapping) or a list of them -> a tuple of parsed specs."""
        if v is None:
            return ()
        if isinstance(v, (str, dict)):
            v = [v]
        parse = (LoraSpec if info.field_name == "loras" else EmbeddingSpec).parse
        return tuple(parse(x) for x in v)

    @model_validator(mode="after")
    def _ip_adapter_encoder(self):
        if self.ip_adapter_image_encoder is not None and self.ip_adapter is None:
            raise ValueError("ip_adapter_image_encoder is set without an ip_adapter")
        return self

    @model_validator(mode="after")
    def _loras_unquantized(self):
        if self.loras and (problem := lora_problem(self.quantization, "loras")) is not None:
            raise ValueError(problem)
        return self

    def pipeline_kwargs(self) -> dict:
        """Keyword arguments for ``TextToImagePipeline.from_pretrained``."""
        kw = dict(path=self.model, dtype=self.dtype, unet=self.unet, vae=self.vae,
                  config=self.single_file_config, scheduler=self.scheduler_source(),
                  devices=self.devices, attention_kernel=self.attention,
                  attention_chunk=self.attention_chunk, vae_tiling=self.vae_tiling,
                  quantization=self.quantization, refiner=self.refiner,
                  high_noise_frac=self.high_noise_frac, revision=self.revision,
                  variant=self.variant, safety_checker=self.safety_checker)
        if self.compile_cache_dir is not None:
            kw["compile_cache_dir"] = self.compile_cache_dir or None
        return kw

    def scheduler_source(self):
        """``scheduler`` as ``from_pretrained`` takes it (None, a preset, a sampler name, a
        path), checked: an unknown name raises a ValueError listing the presets and samplers
        before any model is read."""
        source = self.scheduler
        if source is None or Path(source).exists():
            return source
        from maxdiff.schedulers import PRESETS
        from maxdiff.schedulers.loading import name_problem

        if source not in PRESETS and (problem := name_problem(source)) is not None:
            raise ValueError(problem)
        return source

    def call_kwargs(self) -> dict:
        """Defaults for a pipeline call (only the ones the config sets)."""
        kw = dict(num_inference_steps=self.steps, guidance_scale=self.guidance,
                  height=self.height, width=self.width)
        return {k: v for k, v in kw.items() if v is not None}


class ModelDefaults(StrictConfig):
    """A model folder's ``maxdiff.json``: defaults measured for that model (all optional)."""

    steps: int | None = Field(None, ge=1)
    guidance: float | None = Field(None, ge=0)
    width: int | None = Field(None, ge=1)  # native size
    height: int | None = Field(None, ge=1)
    max_size: int | None = Field(None, ge=1)  # largest side the model is meant for
    notes: str | None = None  # how the defaults were chosen

    @classmethod
    def read(cls, folder: str | os.PathLike) -> ModelDefaults:
        path = Path(folder) / MODEL_DEFAULTS_FILE
        if not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: must be a JSON object")
        return validate(cls, data, str(path))


def available_configs() -> list[str]:
    """Names of the shipped run configs."""
    return config_names(exclude=NOT_RUN_CONFIGS)


def load_run_config(source: str | os.PathLike | dict | None = None,
                    overrides: Sequence[str] | dict | None = None) -> RunConfig:
    """A :class:`RunConfig` from a YAML path, a shipped config's name (``"sdxl-base"``), a dict
    or None (all defaults), then ``key=value`` overrides (values parsed as YAML scalars)."""
    return load_config(RunConfig, source, overrides, kind="run config", exclude=NOT_RUN_CONFIGS)
