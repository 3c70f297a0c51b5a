"""A prompt line of ``maxdiff generate`` and its checks: :class:`PromptLine` (a prompt argument,
a text file line or a JSONL line, resolved), :class:`ControlSpec`, :class:`InputError` (every
problem found, each naming where it is) and the per-field rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipelines.limits import (
    Problem,
    cfg_cutoff_problem,
    deepcache_problem,
    guidance_problem,
    hires_scale_problem,
    hires_steps_problem,
    hires_strength_problem,
    ip_adapter_scale_problem,
    n_problem,
    prompt_syntax_problem,
    sampler_problem,
    seed_problem,
    size_problems,
    steps_problem,
    strength_problem,
)
from pipelines.requests import (
    parse_size,
)

LINE_FIELDS = ("prompt", "negative_prompt", "seed", "steps", "guidance", "size", "n", "image",
               "mask", "strength", "control_images", "prompt_syntax", "scheduler",
               "ip_adapter_image", "ip_adapter_scale", "cfg_cutoff", "deepcache_interval",
               "hires_scale", "hires_strength", "hires_steps")


CONTROL_FIELDS = ("image", "controlnet", "scale", "start", "end",  # of a control_images entry
                  "guess_mode")


class InputError(ValueError):
    """Bad command-line or prompt-file input. ``errors``: every problem found, one per entry,
    each naming where it is (``prompts.jsonl:3: field 'steps': ...``)."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = list(errors)


@dataclass(frozen=True)
class PromptLine:
    """One prompt and its per-line overrides (None: the run's setting)."""

    index: int  # 0-based position among all prompts of the run: names files, derives seeds
    where: str  # "prompts.jsonl:3" or "prompt argument 1", for messages and metadata
    prompt: str
    negative_prompt: str | None = None
    seed: int | None = None  # image k of the line gets seed + k
    steps: int | None = None
    guidance: float | None = None
    size: tuple[int, int] | None = None  # (width, height) in pixels
    n: int | None = None  # images of this prompt
    image: str | None = None  # absolute path of the image to edit (None: text-to-image)
    mask: str | None = None  # absolute path of its inpainting mask
    strength: float | None = None  # None: the edit pipeline's default
    controls: tuple[ControlSpec, ...] | None = None  # ControlNet text-to-image (None: none)
    prompt_syntax: str | None = None  # a1111, compel or none (None: the run's --prompt-syntax)
    scheduler: str | None = None  # a sampler name for this line (None: the run's --scheduler)
    ip_adapter_image: str | None = None  # absolute path of the line's image prompt (IP-Adapter)
    ip_adapter_scale: float | None = None  # its scale (None: the run's --ip-adapter-scale)
    # feature caching (None: the run's --cfg-cutoff / --deepcache-interval)
    cfg_cutoff: float | None = None
    deepcache_interval: int | None = None
    # hires fix (None: the run's --hires-scale / --hires-strength / --hires-steps)
    hires_scale: float | None = None
    hires_strength: float | None = None
    hires_steps: int | None = None


@dataclass(frozen=True)
class ControlSpec:
    """One control image of a line and the ControlNet that reads it (``--control-image`` or
    a JSONL line's ``control_images`` entry), resolved: absolute paths."""

    image: str  # the control image
    controlnet: str  # the ControlNet's folder
    scale: float = 1.0
    start: float = 0.0  # the fraction of the denoising steps it acts on: start to end
    end: float = 1.0
    guess_mode: bool = False

    def record(self) -> dict:
        """The metadata (and settings-hash) record; ``guess_mode`` only when on, so runs
        without it keep the file names they had."""
        return dict(image=self.image, controlnet=self.controlnet, scale=self.scale,
                    start=self.start, end=self.end, **({"guess_mode": True}
                                                        if self.guess_mode else {}))


def check_size(size: tuple[int, int], factor: int | None) -> None:
    """ValueError when a (width, height) breaks :func:`pipelines.limits.size_problems` for a
    model whose sides are multiples of ``factor`` (None: not known yet, not checked)."""
    if factor:
        found = size_problems(*size, factor)
        if found:
            raise ValueError("; ".join(dict.fromkeys(p.message for p in found)))


def _rule(check: Callable[[Any], Problem | None], convert: Callable[[Any], Any] = int):
    """A JSONL field's check from a :mod:`pipelines.limits` rule: the value converted, or a
    ValueError with the rule's message and the value given."""
    def run(value: Any) -> Any:
        problem = check(value)
        if problem is not None:
            raise ValueError(f"{problem.message}, got {value!r}")
        return convert(value)
    return run


def _text(value: Any, *, empty_ok: bool) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {type(value).__name__} {value!r}")
    if not empty_ok and not value.strip():
        raise ValueError("must be a non-empty string")
    return value


_CHECKS = {
    "prompt": lambda v: _text(v, empty_ok=False),
    "negative_prompt": lambda v: None if v is None else _text(v, empty_ok=True),
    "seed": _rule(lambda v: seed_problem(v, optional=False)),  # null: omit the field
    "steps": _rule(steps_problem),
    "guidance": _rule(guidance_problem, float),
    "size": parse_size,
    "n": _rule(lambda v: n_problem(v, MAX_IMAGES_PER_LINE)),
    "image": lambda v: _text(v, empty_ok=False),
    "mask": lambda v: None if v is None else _text(v, empty_ok=False),
    "strength": lambda v: None if v is None else _rule(strength_problem, float)(v),
    "prompt_syntax": lambda v: None if v is None else _rule(prompt_syntax_problem, str)(v),
    "scheduler": lambda v: None if v is None else _rule(sampler_problem, str)(v),
    "ip_adapter_image": lambda v: None if v is None else _text(v, empty_ok=False),
    "ip_adapter_scale": lambda v: None if v is None else _rule(ip_adapter_scale_problem,
                                                               float)(v),
    "cfg_cutoff": lambda v: None if v is None else _rule(cfg_cutoff_problem, float)(v),
    "deepcache_interval": _rule(deepcache_problem),
    "hires_scale": lambda v: None if v is None else _rule(hires_scale_problem, float)(v),
    "hires_strength": lambda v: None if v is None else _rule(hires_strength_problem, float)(v),
    "hires_steps": lambda v: None if v is None else _rule(hires_steps_problem)(v),
}


MAX_IMAGES_PER_LINE = 10_000  # a line's n (the CLI's --num-images)


def edit_size(path: str, factor: int | None) -> tuple[int, int]:
    """An edit's default size: the image's, rounded down to a multiple of ``factor``."""
    from PIL import Image

    with Image.open(path) as im:
        w, h = im.size
    f = factor or 1
    return w - w % f, h - h % f
