"""What a request may ask for: the one home of every request rule, for every front door.

JAX-free (NumPy only), so the HTTP ingress and the CLI's argument parser use it without loading
a model. The Python API, the CLI (arguments and JSONL lines), the HTTP service (native and
OpenAI routes), the generator replicas and the step engine all check requests here:

- :data:`STRENGTH`: the edit strength used when a request gives none, per mode (one default
  for every front door; see below).
- :func:`cfg_on`: guidance turns classifier-free guidance on above 1.
- one rule per setting: :func:`steps_problem`, :func:`guidance_problem`, :func:`seed_problem`,
  :func:`n_problem`, :func:`strength_problem`, :func:`size_problems`, :func:`cost_problem`,
  :func:`denoising_fraction_problem`, :func:`aesthetic_problem` and
  :func:`split_steps_problems` (the SDXL refiner), :func:`hires_problems` (the hires fix) and
  :func:`output_type_problem` (the Python API's); ControlNet's are in
  :mod:`pipelines.control_limits`.
  Each returns :class:`Problem` (canonical field, message, value) or None; the message states
  the allowed range and never the field's name, because
- :data:`pipelines.field_names.FIELDS` names each setting in each front door's vocabulary
  (``num_inference_steps`` in Python, ``--steps`` on the command line, ``steps`` in a JSONL
  line and in JSON bodies, ``num_images`` / ``n``, ``width`` / ``size`` ...), and
  :func:`describe` / :func:`check` say a problem the way that door's user wrote it.
- :class:`Limits` + :func:`problems`: every rule of one request at once, against what this
  model (its scheduler's step limit, its size multiple) and this server (its serve args) allow.

The default strength, 0.75: image-to-image runs ``int(steps * strength)`` steps, so it must
leave steps on SDXL-Lightning's 2-8-step schedules (diffusers' SDXL default, 0.3, leaves none
at 2) and make a visible edit where a request cannot say more (OpenAI's ``images.edit``).
Inpainting keeps diffusers' 0.9999.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from pipelines.field_names import field_name

MAX_SEED = 2**32 - 1
STRENGTH = {"img2img": 0.75, "inpaint": 0.9999}  # when a request gives none


class Problem(NamedTuple):
    """One broken rule: the canonical field (a key of :data:`pipelines.field_names.FIELDS`), a
    message stating the allowed range (without the field's name), and the value given (None
    when it adds nothing)."""

    field: str
    message: str
    value: Any = None


def describe(problem: Problem, door: str = "python") -> str:
    """``problem`` as the user of ``door`` reads it: ``num_inference_steps=0: must be ...``
    (Python), ``--steps: must be ...`` (CLI), ``field 'steps': must be ..., got 0`` (JSONL),
    ``steps: must be ...`` (HTTP; the 422 names the field in ``loc`` too)."""
    name = field_name(problem.field, door)
    if door == "python":
        return (f"{name}: {problem.message}" if problem.value is None
                else f"{name}={problem.value!r}: {problem.message}")
    if door == "jsonl":
        got = "" if problem.value is None else f", got {problem.value!r}"
        return f"field {name!r}: {problem.message}{got}"
    return f"{name}: {problem.message}"


def within(problem: Problem, door: str, entry: str) -> Problem:
    """``problem`` of a field inside a list entry (``entry`` = ``"control_images[1]"``), named
    ``control_images[1].scale`` in ``door``'s words."""
    return problem._replace(field=f"{entry}.{field_name(problem.field, door)}")


def check(problems: Iterable[Problem | None], door: str = "python") -> None:
    """ValueError naming every problem (None entries are skipped) in ``door``'s words."""
    found = [p for p in problems if p is not None]
    if found:
        raise ValueError("; ".join(describe(p, door) for p in found))


# ---------------------------------------------------------------------------------- rules
# A prompt is encoded in chunks of 75 tokens (maxdiff.prompts); A1111 and ComfyUI users write
# 100-200-token prompts. Each chunk adds a text-encoder pass and 77 cross-attention keys.
MAX_PROMPT_CHUNKS = 4


def prompt_syntax_problem(syntax: Any) -> Problem | None:
    """None (the model's default) or one of :data:`maxdiff.prompt_syntax.SYNTAXES`."""
    from maxdiff.prompt_syntax import SYNTAXES

    if syntax is None or syntax in SYNTAXES:
        return None
    return Problem("prompt_syntax", f"must be one of {', '.join(SYNTAXES)}", syntax)


def sampler_problem(name: Any) -> Problem | None:
    """None, or the problem of a ``scheduler`` that names no sampler (the closest name and the
    choices: :mod:`maxdiff.sampler_names`)."""
    from maxdiff.sampler_names import sampler_problem as why

    if name is None:
        return None
    if not isinstance(name, str):
        return Problem("scheduler", "must be a sampler name (a string)", name)
    reason = why(name)
    return None if reason is None else Problem("scheduler", reason)


def prompt_text_problems(syntax: Any, **texts: str | None) -> list[Problem]:
    """Each of ``texts`` (field -> text; None skipped) that ``syntax`` (None: the default)
    cannot read: its problem says where and why (:mod:`maxdiff.prompt_syntax`)."""
    from maxdiff.prompt_syntax import DEFAULT_SYNTAX, PromptSyntaxError, parse

    if (p := prompt_syntax_problem(syntax)) is not None:
        return [p]
    out = []
    for field, text in texts.items():
        try:
            None if text is None else parse(text, syntax or DEFAULT_SYNTAX)
        except PromptSyntaxError as e:
            out.append(Problem(field, f"{e} (prompt_syntax={syntax or DEFAULT_SYNTAX!r})"))
    return out


def prompt_length_problem(chunks: int, tokens: int, field: str = "prompt") -> Problem | None:
    """A prompt may fill :data:`MAX_PROMPT_CHUNKS` chunks of 75 tokens."""
    if chunks <= MAX_PROMPT_CHUNKS:
        return None
    return Problem(field, f"has {tokens} tokens in {chunks} chunks of 75; at most "
                          f"{MAX_PROMPT_CHUNKS} chunks ({MAX_PROMPT_CHUNKS * 75} tokens) are "
                          "allowed")


def is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A finite int or float (not a bool, NaN or infinity)."""
    if not isinstance(v, (int, float, np.integer, np.floating)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int beyond any float
        return False


def _why(why: str) -> str:
    return f" ({why})" if why else ""


def cfg_on(guidance: float) -> bool:
    """Classifier-free guidance runs (two UNet passes a step) only for guidance > 1."""
    return guidance > 1.0


def cfg_cutoff_problem(cutoff: Any) -> Problem | None:
    """``cfg_cutoff``: None (guidance on every step) or a fraction in (0, 1] of the steps that
    run classifier-free guidance (:func:`guided_steps`); the rest run the conditional pass
    only."""
    if cutoff is None or (is_number(cutoff) and 0.0 < cutoff <= 1.0):
        return None
    return Problem("cfg_cutoff", "must be a number in (0, 1] (the fraction of the steps that run "
                   "classifier-free guidance) or null", cutoff)


def guided_steps(steps: int, cutoff: float | None) -> int:
    """How many of ``steps`` denoising steps (the first ones) run classifier-free guidance
    under ``cfg_cutoff`` (None: all): ``floor(cutoff * steps)`` (computed with a 1e-4 margin,
    so float32 on a device and float64 here agree)."""
    return steps if cutoff is None else min(steps, int(math.floor(cutoff * steps + 1e-4)))


DEEPCACHE_MAX = 100


def deepcache_problem(interval: Any) -> Problem | None:
    """``deepcache_interval``: the UNet runs in full every ``interval`` steps and reuses its
    deep features in between (DeepCache); 1 turns it off."""
    if is_int(interval) and 1 <= interval <= DEEPCACHE_MAX:
        return None
    return Problem("deepcache_interval", f"must be an integer in 1..{DEEPCACHE_MAX} (the UNet "
                   "runs in full every N steps; 1: every step, no caching)", interval)


def steps_problem(steps: Any, hi: int | None = None, why: str = "") -> Problem | None:
    """Denoising steps: an integer in 1..``hi`` (``why``: whose limit ``hi`` is)."""
    if is_int(steps) and steps >= 1 and (hi is None or steps <= hi):
        return None
    rng = ">= 1" if hi is None else f"in 1..{hi}"
    return Problem("steps", f"must be an integer {rng}{_why(why) if hi else ''}", steps)


def guidance_problem(guidance: Any, hi: float | None = None, why: str = "") -> Problem | None:
    """Guidance scale: a number in [0, ``hi``]; <= 1 turns classifier-free guidance off."""
    if is_number(guidance) and guidance >= 0 and (hi is None or guidance <= hi):
        return None
    rng = ">= 0" if hi is None else f"in [0, {hi:g}]{_why(why)}"
    return Problem("guidance", f"must be a number {rng} (<= 1 turns classifier-free guidance "
                   "off)", guidance)


def seed_problem(seed: Any, n: int = 1, optional: bool = True) -> Problem | None:
    """A seed: None (random; unless not ``optional``) or an integer in 0..MAX_SEED; image k of
    ``n`` gets seed + k, so seed + n - 1 must stay in range too."""
    if seed is None and optional:
        return None
    if not is_int(seed) or not 0 <= seed <= MAX_SEED:
        return Problem("seed", f"out of range; seeds are integers in 0..{MAX_SEED}", seed)
    if is_int(n) and n >= 1 and seed + n - 1 > MAX_SEED:
        return Problem("seed", f"seed + {n} images - 1 is above {MAX_SEED}; image k gets seed "
                       "+ k, so seed + n - 1 must stay in range", seed)
    return None


def n_problem(n: Any, hi: int | None = None, why: str = "") -> Problem | None:
    """Images per request: an integer in 1..``hi``."""
    if is_int(n) and n >= 1 and (hi is None or n <= hi):
        return None
    if hi is None:
        return Problem("n", "must be an integer >= 1", n)
    return Problem("n", f"must be an integer in 1..{hi} (at most {hi} images per "
                   f"request{', ' + why if why else ''})", n)


def strength_problem(strength: Any, steps: Any = None) -> Problem | None:
    """Edit strength: a number in (0, 1] that leaves at least one of ``steps`` denoising
    steps (edits run ``int(steps * strength)`` of them; diffusers' rule)."""
    if not is_number(strength) or not 0.0 < strength <= 1.0:
        return Problem("strength", "must be a number in (0, 1] (1 repaints everything, small "
                       "values stay close to the image)", strength)
    if is_int(steps) and steps >= 1 and min(int(steps * strength), steps) < 1:
        return Problem("strength", f"with {steps} step(s) leaves no denoising step "
                       f"(int({steps} * {strength}) = 0); raise strength or steps", strength)
    return None


HIRES_SCALE = 4.0  # the largest hires fix: the first pass at a quarter of each side


def hires_scale_problem(scale: Any) -> Problem | None:
    if is_number(scale) and 1.0 < scale <= HIRES_SCALE:
        return None
    return Problem("hires_scale", f"must be a number in (1, {HIRES_SCALE:g}] (the image is "
                   "drawn at its size / hires_scale first, then upscaled)", scale)


def hires_strength_problem(strength: Any, steps: Any = None) -> Problem | None:
    p = strength_problem(strength, steps)
    return p and p._replace(field="hires_strength")


def hires_steps_problem(steps: Any, hi: int | None = None, why: str = "") -> Problem | None:
    p = steps_problem(steps, hi, why)
    return p and p._replace(field="hires_steps")


def hires_first_size(width: int, height: int, scale: float, multiple: int) -> tuple[int, int]:
    """A hires fix's first pass (width, height): each side / ``scale``, rounded down to a
    multiple of ``multiple``."""
    return int(width / scale) // multiple * multiple, int(height / scale) // multiple * multiple


def hires_problems(scale: Any, strength: Any, hires_steps: Any, steps: Any, width: Any,
                   height: Any, multiple: int, lo: int | None = None,
                   max_steps: int | None = None, steps_why: str = "") -> list[Problem]:
    """A hires fix (:class:`pipelines.requests.HiresFix`): ``scale`` in (1, 4], ``strength``
    in (0, 1] leaving at least one of the second pass's steps (``hires_steps``, None: the
    request's ``steps``), and a first pass (each side / ``scale``, rounded down to
    ``multiple``) of at least ``lo`` (None: ``multiple``) pixels; ``hires_steps`` at most
    ``max_steps`` (``steps_why``: whose limit). ``steps``, ``width`` and ``height``: the
    request's, checked by the other rules."""
    if (p := hires_scale_problem(scale)) is not None:
        return [p]
    out = [p for p in [None if hires_steps is None else hires_steps_problem(
        hires_steps, max_steps, steps_why)] if p]
    second = steps if hires_steps is None else hires_steps
    if (p := hires_strength_problem(strength, None if out else second)) is not None:
        out.append(p)
    first = hires_first_size(width, height, scale, multiple) if is_int(width) and is_int(
        height) else None
    if first is not None and min(first) < (lo or multiple):
        out.append(Problem("hires_scale", f"draws the first pass at {first[0]}x{first[1]}; its "
                           f"sides must be at least {lo or multiple} pixels: lower hires_scale "
                           "or raise the size", scale))
    return out


def edit_adapter_problem(adapter: Any) -> Problem | None:
    """Per-image adapters (``add_adapter``) apply to text-to-image only; an edit names none (a
    LoRA for edits is fused with ``load_lora_weights``)."""
    if adapter is None:
        return None
    return Problem("adapter", "per-image adapters apply to text-to-image only, not to edits "
                   "(image-to-image, inpainting); fuse a LoRA with load_lora_weights instead",
                   adapter)


# ComfyUI's IPAdapter weight runs from -1 to 5; diffusers' set_ip_adapter_scale takes any
# float; 0 is exactly the model without the adapter, 1 the adapter as trained
IP_ADAPTER_SCALE = (-1.0, 5.0)


def ip_adapter_scale_problem(scale: Any) -> Problem | None:
    """An IP-Adapter's scale: a number in :data:`IP_ADAPTER_SCALE`."""
    lo, hi = IP_ADAPTER_SCALE
    if is_number(scale) and lo <= scale <= hi:
        return None
    return Problem("ip_adapter_scale", f"must be a number in [{lo:g}, {hi:g}] (0: the image "
                   "prompt has no effect, 1: the adapter's full strength)", scale)


OUTPUT_TYPES = ("pil", "np")


def output_type_problem(output_type: Any, latent: bool = False) -> Problem | None:
    """The Python API's ``output_type``: one of :data:`OUTPUT_TYPES`, or ``"latent"`` where
    ``latent`` (a base stopped at ``denoising_end``, for a refiner)."""
    if output_type in OUTPUT_TYPES or latent and output_type == "latent":
        return None
    also = (", or 'latent' (the denoised latents, (N, C, H/f, W/f), for a refiner)"
            if latent else "")
    return Problem("output_type", "must be 'pil' (PIL images) or 'np' (float32 arrays in "
                   f"[0, 1]){also}", output_type)


AESTHETIC_SCORE, NEGATIVE_AESTHETIC_SCORE = 6.0, 2.5  # diffusers' refiner defaults
AESTHETIC_MAX = 10.0  # the LAION aesthetic predictor's scale, which the refiner was trained on
HIGH_NOISE_FRAC = 0.8  # where a refiner takes over when a call says nothing (diffusers' docs)


def denoising_fraction_problem(value: Any, field: str = "denoising_end") -> Problem | None:
    """``denoising_end`` (where a base stops) or ``denoising_start`` (where a refiner starts):
    a number strictly between 0 and 1, a fraction of the noise schedule (diffusers' rule: the
    cut is at timestep ``round(T - value * T)``)."""
    if is_number(value) and 0.0 < value < 1.0:
        return None
    return Problem(field, "must be a number in (0, 1), the fraction of the noise schedule "
                   "where the base hands over to the refiner (0.8: the base runs the first 80 %)",
                   value)


def aesthetic_problem(value: Any, field: str = "aesthetic_score") -> Problem | None:
    """The refiner's ``aesthetic_score`` / ``negative_aesthetic_score``: a number in
    [0, :data:`AESTHETIC_MAX`] (the aesthetic predictor's scale; defaults 6 and 2.5)."""
    if is_number(value) and 0.0 <= value <= AESTHETIC_MAX:
        return None
    return Problem(field, f"must be a number in [0, {AESTHETIC_MAX:g}] (the refiner's "
                   "aesthetic score time id; diffusers' defaults: 6 positive, 2.5 negative)",
                   value)


def split_steps_problems(base_steps: int, refiner_steps: int, value: Any,
                         field: str = "denoising_end") -> list[Problem]:
    """A hand-over fraction that leaves the base (``base_steps`` before the cut) or the
    refiner (``refiner_steps`` after it) no step."""
    out = []
    for n, who, way in ((base_steps, "the base", "raise it"), (refiner_steps, "the refiner",
                                                                 "lower it")):
        if n < 1:
            out.append(Problem(field, f"leaves {who} no denoising step of this schedule; "
                               f"{way} or give more steps", value))
    return out


def size_problems(width: int | None, height: int | None, multiple: int, lo: int | None = None,
                  hi: int | None = None, why: str = "") -> list[Problem]:
    """One problem for each side that is missing, not an integer, outside ``[lo, hi]`` (``lo``
    None: ``multiple``) or not a multiple of ``multiple``; ``why`` follows range messages
    (whose limit ``hi`` is, how to raise it)."""
    lo = lo or multiple
    out = []
    for name, v in (("width", width), ("height", height)):
        if v is None:
            out.append(Problem(name, "this model has no default size: give one"))
        elif not is_int(v):
            out.append(Problem(name, "must be an integer number of pixels", v))
        elif hi is not None and not lo <= v <= hi:
            out.append(Problem(name, f"{v} pixels is out of range; image sides must be between "
                               f"{lo} and {hi}{_why(why)}", v))
        elif v < lo:
            out.append(Problem(name, f"{v} pixels is too small; image sides must be at least "
                               f"{lo}", v))
        elif v % multiple:
            out.append(Problem(name, f"{v} is not a multiple of {multiple}; image sides must be "
                               f"multiples of {multiple} for this model", v))
    return out


def cost_problem(n: int, steps: int, width: int, height: int, max_cost: float,
                 n_field: str = "n") -> Problem | None:
    """A request's cost, images x steps x megapixels (width x height / 2**20), against
    ``max_cost``; the problem names what to lower (the images, else the steps)."""
    mp = width * height / 2**20
    cost = n * steps * mp
    if cost <= max_cost:
        return None
    most = math.floor(max_cost / (steps * mp))
    field, msg = (n_field, f"at most {most} image(s)") if most >= 1 else (
        "steps", f"at most {math.floor(max_cost / mp)} step(s) for one image")
    return Problem(field, f"{n} image(s) x {steps} steps x {width}x{height} ({cost:.0f} "
                   f"image-step-megapixels) is above this server's max_cost of {max_cost:g}; "
                   f"{msg} at this size and step count")


# ---------------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class Limits:
    """What a request may ask for here. ``None``: no limit beyond the rule itself. ``*_why``:
    whose limit it is, for messages ("what EulerDiscreteScheduler allows", "the serve arg
    max_steps")."""

    multiple: int = 1  # image sides: multiples of this (the VAE's scale factor at least)
    min_size: int | None = None  # None: multiple
    max_size: int | None = None
    max_steps: int | None = None
    max_guidance: float | None = None
    max_n: int | None = None
    max_cost: float | None = None
    steps_why: str = ""
    size_why: str = ""
    guidance_why: str = ""
    n_why: str = ""


def problems(limits: Limits, *, steps: Any, guidance: Any = None, seed: Any = None,
             n: Any = 1, width: Any = None, height: Any = None, strength: Any = None,
             sized: bool = True) -> list[Problem]:
    """Every rule of one request (``guidance`` / ``strength`` None: not checked; ``sized``
    False: width and height are not checked). The cost rule runs only when the others hold
    (a cost of out-of-range values is moot)."""
    lim = limits
    bad_steps = steps_problem(steps, lim.max_steps, lim.steps_why)
    bad_n = n_problem(n, lim.max_n, lim.n_why)
    out = [bad_steps,
           None if guidance is None else guidance_problem(guidance, lim.max_guidance,
                                                          lim.guidance_why),
           bad_n,
           seed_problem(seed, 1 if bad_n else n),
           None if strength is None else strength_problem(
               strength, None if bad_steps else steps)]
    out = [p for p in out if p is not None]
    if sized:
        out += size_problems(width, height, lim.multiple, lim.min_size, lim.max_size,
                             lim.size_why)
    if not out and lim.max_cost is not None and sized:
        out += [p for p in [cost_problem(n, steps, width, height, lim.max_cost)] if p]
    return out
