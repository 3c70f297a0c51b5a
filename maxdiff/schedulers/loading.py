"""Build a scheduler from a diffusers ``scheduler_config.json`` (a dict, a file, a model folder)
or from a preset name."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from maxdiff.schedulers.common import Scheduler
from maxdiff.schedulers.ddim import DDIMScheduler
from maxdiff.schedulers.dpm_solver import DPMSolverMultistepScheduler
from maxdiff.schedulers.euler import EulerDiscreteScheduler
from maxdiff.schedulers.euler_ancestral import EulerAncestralDiscreteScheduler
from maxdiff.schedulers.lcm import LCMScheduler
from maxdiff.schedulers.pndm import PNDMScheduler
from maxdiff.schedulers.presets import PRESETS

# diffusers `_class_name` -> our sampler.
SCHEDULERS: Mapping[str, type] = {
    cls.__name__: cls
    for cls in (EulerDiscreteScheduler, EulerAncestralDiscreteScheduler, DDIMScheduler,
                DPMSolverMultistepScheduler, LCMScheduler, PNDMScheduler)
}


def scheduler_from_config(config: Mapping[str, Any]) -> Scheduler:
    """The sampler named by ``config["_class_name"]``, built from the rest of ``config``."""
    if not isinstance(config, Mapping):
        raise ValueError(f"a scheduler config must be a mapping, got {type(config).__name__}")
    name = config.get("_class_name")
    if name is None:
        raise ValueError(f"scheduler config has no `_class_name`; allowed: {sorted(SCHEDULERS)}")
    if name not in SCHEDULERS:
        raise ValueError(f"`_class_name` {name!r} is not supported; allowed: {sorted(SCHEDULERS)}")
    return SCHEDULERS[name].from_config(config)


def read_scheduler_config(path: str | os.PathLike) -> dict[str, Any]:
    """The config dict at ``path``: a ``.json`` file, a ``scheduler`` folder holding
    ``scheduler_config.json``, or a diffusers model folder with ``scheduler/scheduler_config.json``."""
    path = Path(path)
    if path.is_dir():
        for candidate in (path / "scheduler_config.json", path / "scheduler" / "scheduler_config.json"):
            if candidate.is_file():
                path = candidate
                break
        else:
            raise ValueError(f"no scheduler_config.json in {path} or {path / 'scheduler'}")
    if not path.is_file():
        raise ValueError(
            f"{str(path)!r} is neither a preset ({sorted(PRESETS)}) nor an existing file or folder")
    with open(path) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return config


def load_scheduler(source: Mapping[str, Any] | str | os.PathLike) -> Scheduler:
    """A scheduler from a config dict, a preset name (e.g. ``"lightning-4step"``), or a path to a
    ``scheduler_config.json`` / scheduler folder / diffusers model folder."""
    if isinstance(source, Mapping):
        return scheduler_from_config(source)
    if isinstance(source, str) and source in PRESETS:
        return scheduler_from_config(PRESETS[source].scheduler_config)
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(
            f"load_scheduler takes a config dict, a preset name or a path, got {type(source).__name__}")
    return scheduler_from_config(read_scheduler_config(source))
