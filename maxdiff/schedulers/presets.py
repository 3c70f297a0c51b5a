"""Named sampler presets: a scheduler config plus the step count and guidance they are meant for.

SDXL-Lightning (Lin, Wang & Yang, "SDXL-Lightning: Progressive Adversarial Diffusion
Distillation", 2024) runs the SDXL base Euler scheduler with ``timestep_spacing="trailing"`` and
no classifier-free guidance; the 1-step model predicts x0 (``prediction_type="sample"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from maxdiff.sampler_names import find_sampler

# `scheduler/scheduler_config.json` of stabilityai/stable-diffusion-xl-base-1.0.
SDXL_BASE_SCHEDULER_CONFIG: Mapping[str, Any] = MappingProxyType({
    "_class_name": "EulerDiscreteScheduler",
    "_diffusers_version": "0.19.0.dev0",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "interpolation_type": "linear",
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "sample_max_value": 1.0,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "trained_betas": None,
    "use_karras_sigmas": False,
})


@dataclasses.dataclass(frozen=True)
class Preset:
    """A scheduler config (diffusers ``scheduler_config.json`` keys) with the number of steps and
    the classifier-free guidance scale it is meant to run with (0: no guidance, one UNet pass
    per step)."""

    scheduler_config: Mapping[str, Any]
    num_inference_steps: int
    guidance_scale: float


def _lightning(steps: int) -> Preset:
    config = dict(SDXL_BASE_SCHEDULER_CONFIG, timestep_spacing="trailing")
    if steps == 1:
        config["prediction_type"] = "sample"
    return Preset(MappingProxyType(config), num_inference_steps=steps, guidance_scale=0.0)


PRESETS: Mapping[str, Preset] = MappingProxyType({
    f"lightning-{steps}step": _lightning(steps) for steps in (1, 2, 4, 8)
})


def get_preset(name: str) -> Preset:
    """The preset called ``name``; a ValueError lists the known names otherwise (and for a
    sampler name, says how to use one)."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        pass
    sampler = find_sampler(name)
    if sampler is not None:
        raise ValueError(
            f"{name!r} names a sampler ({sampler.title}), not a preset ({sorted(PRESETS)}): a "
            "sampler changes a model's scheduler config; give it in a run config "
            "(TextToImagePipeline.from_config(..., ['scheduler=NAME']), the CLI's --scheduler) "
            "or switch a loaded pipeline's: pipe.scheduler = "
            f"maxdiff.schedulers.load_scheduler({name!r}, base=pipe.scheduler)")
    raise ValueError(f"unknown scheduler preset {name!r}; known presets: {sorted(PRESETS)}")
