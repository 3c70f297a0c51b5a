"""Build a scheduler from a diffusers ``scheduler_config.json`` (a dict, a file, a model folder),
a preset name, or a sampler name applied to a model's scheduler config (:mod:`.names`)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from maxdiff.sampler_names import sampler_config, sampler_problem
from maxdiff.schedulers.common import Scheduler
from maxdiff.schedulers.ddim import DDIMScheduler
from maxdiff.schedulers.dpm_solver import DPMSolverMultistepScheduler
from maxdiff.schedulers.euler import EulerDiscreteScheduler
from maxdiff.schedulers.euler_ancestral import EulerAncestralDiscreteScheduler
from maxdiff.schedulers.lcm import LCMScheduler
from maxdiff.schedulers.pndm import PNDMScheduler
from maxdiff.schedulers.presets import PRESETS, Preset
from maxdiff.schedulers.unipc import UniPCMultistepScheduler

# diffusers `_class_name` -> our sampler.
SCHEDULERS: Mapping[str, type] = {
    cls.__name__: cls
    for cls in (EulerDiscreteScheduler, EulerAncestralDiscreteScheduler, DDIMScheduler,
                DPMSolverMultistepScheduler, LCMScheduler, PNDMScheduler,
                UniPCMultistepScheduler)
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
            f"{str(path)!r} is neither a preset ({sorted(PRESETS)}), a sampler name nor an existing "
            "file or folder")
    with open(path) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return config


def base_config(base: Mapping[str, Any] | Scheduler | str | os.PathLike) -> Mapping[str, Any]:
    """A model's scheduler config from ``base``: the config itself, a loaded scheduler (its
    ``config``), or a path (:func:`read_scheduler_config`)."""
    if isinstance(base, Mapping):
        return base
    if isinstance(base, (str, os.PathLike)):
        if not Path(base).exists():
            raise ValueError(f"the model's scheduler config {str(base)!r}: no such file or folder")
        return read_scheduler_config(base)
    config = getattr(base, "config", None)
    if isinstance(config, Mapping):
        return config
    raise ValueError("base: a scheduler config dict, a loaded scheduler or a path to a "
                     f"scheduler config, got {type(base).__name__}")


def name_problem(source: str) -> str | None:
    """Why the string ``source`` names no scheduler (None when it names one): neither a preset,
    a sampler name nor an existing path; the message lists the choices."""
    if source in PRESETS or Path(source).exists():
        return None
    problem = sampler_problem(source)
    if problem is None:
        return None
    return (f"scheduler {source!r} is no preset ({', '.join(PRESETS)}) and no existing file or "
            f"folder; {problem}")


def load_scheduler(source: Mapping[str, Any] | str | os.PathLike,
                   base: Mapping[str, Any] | Scheduler | str | os.PathLike | None = None
                   ) -> Scheduler:
    """A scheduler from a config dict, a preset name (e.g. ``"lightning-4step"``), a path to a
    ``scheduler_config.json`` / scheduler folder / diffusers model folder, or a sampler name
    (``"dpmpp_2m_karras"``, ``"DPM++ 2M Karras"``, ``"UniPCMultistepScheduler"``: see
    :mod:`maxdiff.schedulers.names`). A sampler name changes a model's scheduler config, which
    ``base`` gives: the config, the model's loaded scheduler, or a path to its config (a model
    or scheduler folder). ``pipe.scheduler = load_scheduler("unipc", base=pipe.scheduler)`` is
    diffusers' ``UniPCMultistepScheduler.from_config(pipe.scheduler.config)``."""
    if isinstance(source, Mapping):
        return scheduler_from_config(source)
    if isinstance(source, str) and source in PRESETS:
        return scheduler_from_config(PRESETS[source].scheduler_config)
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError("load_scheduler takes a config dict, a preset name, a sampler name or a "
                         f"path, got {type(source).__name__}")
    if isinstance(source, str) and not Path(source).exists():
        problem = name_problem(source)
        if problem is not None:
            raise ValueError(problem)
        if base is None:
            raise ValueError(f"{source!r} names a sampler, a change to a model's scheduler config: "
                             "pass base= (the model's scheduler config, its loaded scheduler, or "
                             "the path of its model or scheduler folder)")
        return scheduler_from_config(sampler_config(source, base_config(base)))
    return scheduler_from_config(read_scheduler_config(source))


def resolve_scheduler(source: Any, model: Mapping[str, Any] | Scheduler | str | os.PathLike
                      ) -> tuple[Scheduler, Preset | None]:
    """The scheduler a pipeline loads for ``source`` (what ``from_pretrained(scheduler=...)``
    takes), and the preset it names (whose steps and guidance become the defaults) or None.
    ``model`` is the model's own scheduler config (or a path to it, read only when needed):
    ``source`` None loads it, a sampler name changes it; a config dict, a preset or a path
    stands alone. A string that is an existing path is read as one, whatever its name."""
    if source is None:
        return scheduler_from_config(base_config(model)), None
    if isinstance(source, str) and source in PRESETS and not Path(source).exists():
        return scheduler_from_config(PRESETS[source].scheduler_config), PRESETS[source]
    return load_scheduler(source, base=model), None
