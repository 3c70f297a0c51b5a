"""Samplers by the names people type: A1111's ("DPM++ 2M Karras", "Euler a"), ComfyUI's
(``dpmpp_2m``, ``euler_ancestral``), short ones (``dpmpp_2m_karras``, ``unipc``) and diffusers'
class names (``DPMSolverMultistepScheduler``).

A name is not a whole scheduler config: it is a change to the *model's* scheduler config, the
way diffusers users switch samplers::

    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config,
                                                             use_karras_sigmas=True)

The model's training schedule (betas, ``prediction_type``, ``timestep_spacing``,
``steps_offset``, zero-terminal-SNR) stays; ``_class_name`` and the keys that make the sampler
(Karras sigmas, the solver's algorithm and order) change. Which diffusers class and keys an
A1111 name means follows diffusers' own table (the "Schedulers" overview of its docs:
"DPM++ 2M Karras: DPMSolverMultistepScheduler, init with use_karras_sigmas=True").

Names match whatever their case, spaces, ``_`` and ``-``, with ``++`` read as ``pp``:
``"DPM++ 2M Karras"``, ``dpmpp_2m_karras`` and ``dpm++2m-karras`` are one sampler.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

EULER, ANCESTRAL, DPM, DDIM = ("EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler",
                               "DPMSolverMultistepScheduler", "DDIMScheduler")
PNDM, LCM, UNIPC = "PNDMScheduler", "LCMScheduler", "UniPCMultistepScheduler"
CLASS_NAMES = (EULER, ANCESTRAL, DPM, DDIM, PNDM, LCM, UNIPC)


@dataclasses.dataclass(frozen=True)
class Sampler:
    """A sampler by name: the diffusers scheduler class and the config keys that make it,
    set on top of the model's scheduler config.

    Attributes:
      name: the short name (ComfyUI's spelling where it has one), e.g. ``dpmpp_2m_karras``.
      title: the name A1111 shows, e.g. ``"DPM++ 2M Karras"``.
      class_name: the diffusers class (``_class_name``).
      settings: config keys set whatever the model's config says.
      aliases: other names it answers to.
    """

    name: str
    title: str
    class_name: str
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))

    def config(self, base: Mapping[str, Any]) -> dict[str, Any]:
        """The scheduler config for a model whose scheduler config is ``base``: ``base`` with
        this sampler's class and keys. Keys ``base`` lists in diffusers' ``_use_default_values``
        (a diffusers ``scheduler.config``) are left out, so the new class takes its own
        defaults there, as diffusers' ``from_config`` does."""
        defaults = set(base.get("_use_default_values") or ())
        out = {k: v for k, v in base.items() if k not in defaults and k != "_use_default_values"}
        out.update(self.settings)
        out["_class_name"] = self.class_name
        return out


_DPMPP = {"algorithm_type": "dpmsolver++", "solver_order": 2, "solver_type": "midpoint"}
_DPMPP_SDE = dict(_DPMPP, algorithm_type="sde-dpmsolver++")
_UNIPC = {"solver_type": "bh2", "solver_order": 2, "predict_x0": True}

# The samplers, by short name. Karras variants set use_karras_sigmas, the others unset it (a
# model whose own config turns it on still gets what the name says).
SAMPLERS: Mapping[str, Sampler] = MappingProxyType({s.name: s for s in (
    Sampler("euler", "Euler", EULER, {"use_karras_sigmas": False}),
    Sampler("euler_karras", "Euler Karras", EULER, {"use_karras_sigmas": True}),
    Sampler("euler_a", "Euler a", ANCESTRAL, {}, ("euler_ancestral",)),
    Sampler("dpmpp_2m", "DPM++ 2M", DPM, {**_DPMPP, "use_karras_sigmas": False}),
    Sampler("dpmpp_2m_karras", "DPM++ 2M Karras", DPM, {**_DPMPP, "use_karras_sigmas": True}),
    # diffusers' SDE noise is Gaussian per step (A1111 and ComfyUI draw it from a Brownian tree)
    Sampler("dpmpp_2m_sde", "DPM++ 2M SDE", DPM, {**_DPMPP_SDE, "use_karras_sigmas": False}),
    Sampler("dpmpp_2m_sde_karras", "DPM++ 2M SDE Karras", DPM,
            {**_DPMPP_SDE, "use_karras_sigmas": True}),
    # x0 is never clipped: latents are not images in [-1, 1] (A1111's DDIM does not clip;
    # diffusers' DDIMScheduler does by default, and SD / SDXL configs turn it off)
    Sampler("ddim", "DDIM", DDIM, {"clip_sample": False}),
    Sampler("pndm", "PLMS", PNDM, {"skip_prk_steps": True}, ("plms",)),
    Sampler("lcm", "LCM", LCM, {}),
    Sampler("unipc", "UniPC", UNIPC, {**_UNIPC, "use_karras_sigmas": False}, ("uni_pc_bh2",)),
    Sampler("unipc_karras", "UniPC Karras", UNIPC, {**_UNIPC, "use_karras_sigmas": True}),
)})

# Names people know that maxdiff does not implement, and diffusers' class for each (None: none).
NOT_IMPLEMENTED: Mapping[str, str | None] = MappingProxyType({
    "DPM++ 3M SDE": DPM, "DPM++ 3M SDE Karras": DPM,
    "DPM++ SDE": "DPMSolverSinglestepScheduler", "DPM++ SDE Karras": "DPMSolverSinglestepScheduler",
    "DPM++ 2S a": None, "DPM++ 2S ancestral": None,
    "DPM2": "KDPM2DiscreteScheduler", "DPM2 Karras": "KDPM2DiscreteScheduler",
    "DPM2 a": "KDPM2AncestralDiscreteScheduler", "DPM2 ancestral": "KDPM2AncestralDiscreteScheduler",
    "Heun": "HeunDiscreteScheduler", "LMS": "LMSDiscreteScheduler",
    "LMS Karras": "LMSDiscreteScheduler", "DPM fast": None, "DPM adaptive": None,
    "DDPM": "DDPMScheduler", "DEIS": "DEISMultistepScheduler",
})


def normalise(name: str) -> str:
    """The form names are matched in: lower case, ``++`` as ``pp``, no spaces, ``_``, ``-``."""
    return re.sub(r"[\s_\-]+", "", name.strip().lower().replace("+", "p"))


def _index() -> dict[str, Sampler]:
    out: dict[str, Sampler] = {}
    for s in SAMPLERS.values():
        for n in (s.name, s.title, *s.aliases):
            out[normalise(n)] = s
    for cls in CLASS_NAMES:  # a class name: the model's config, that class (diffusers' from_config)
        out[normalise(cls)] = Sampler(cls, cls, cls, {"skip_prk_steps": True} if cls == PNDM else {})
    return out


_BY_KEY = _index()


def find_sampler(name: Any) -> Sampler | None:
    """The sampler ``name`` names, or None (also for a non-string)."""
    return _BY_KEY.get(normalise(name)) if isinstance(name, str) else None


def choices() -> str:
    """The names to offer in messages and help: short names, A1111 titles and class names."""
    return (", ".join(SAMPLERS) + "; or A1111's names (" + ", ".join(
        repr(s.title) for s in SAMPLERS.values()) + ") or diffusers' class names ("
        + ", ".join(CLASS_NAMES) + ")")


def sampler_problem(name: Any) -> str | None:
    """Why ``name`` names no sampler (None when it does): a known but unimplemented sampler,
    or an unknown name with the closest one; the choices follow."""
    if find_sampler(name) is not None:
        return None
    key = normalise(name) if isinstance(name, str) else ""
    missing = {normalise(k): (k, v) for k, v in NOT_IMPLEMENTED.items()}.get(key)
    if missing is not None:
        title, cls = missing
        where = f" (diffusers' {cls})" if cls else ""
        return (f"sampler {name!r}: {title}{where} is not implemented in maxdiff; the samplers "
                f"are {choices()}")
    close = difflib.get_close_matches(key, list(_BY_KEY), n=1) if key else []
    hint = f" (did you mean {_BY_KEY[close[0]].name!r}?)" if close else ""
    return f"unknown sampler {name!r}{hint}; the samplers are {choices()}"


def get_sampler(name: str) -> Sampler:
    """The sampler ``name`` names; a ValueError says what it is not and lists the choices."""
    problem = sampler_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return find_sampler(name)


def sampler_config(name: str, base: Mapping[str, Any]) -> dict[str, Any]:
    """The scheduler config of sampler ``name`` for a model whose scheduler config is ``base``
    (a ``scheduler_config.json`` dict): see :meth:`Sampler.config`."""
    return get_sampler(name).config(base)
