"""What a request's ControlNet images may ask for, for every front door: the conditioning
scale (:func:`control_scale_problem`, at most :data:`CONTROL_SCALE_MAX`), the window of steps
it acts on (:func:`control_window_problems`) and the ControlNet it goes to
(:func:`chosen_controlnet`, :func:`controlnet_problem`). Each rule returns
:class:`pipelines.limits.Problem` as the rules of :mod:`pipelines.limits` do. JAX-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipelines.limits import Problem, _why, is_number

CONTROL_SCALE_MAX = 10.0  # ComfyUI's ControlNet strength range is [0, 10]; A1111's weight [0, 2]


def control_scale_problem(scale: Any, which: str = "") -> Problem | None:
    """A ControlNet's conditioning scale (its residuals are multiplied by it): a number in
    [0, :data:`CONTROL_SCALE_MAX`]. ``which``: the ControlNet, for messages ("ControlNet 1")."""
    if is_number(scale) and 0.0 <= scale <= CONTROL_SCALE_MAX:
        return None
    return Problem("control_scale", f"must be a number in [0, {CONTROL_SCALE_MAX:g}]"
                   f"{_why(which)} (0: no effect, 1: the ControlNet's full strength)", scale)


def control_window_problems(start: Any, end: Any, which: str = "") -> list[Problem]:
    """The fraction of the denoising steps a ControlNet acts on, ``start`` to ``end``: numbers
    with 0 <= start < end <= 1 (diffusers' rule; step i of n runs the ControlNet when
    ``i / n >= start`` and ``(i + 1) / n <= end``)."""
    out = [Problem(field, f"must be a number in [0, 1]{_why(which)}, a fraction of the "
                   "denoising steps", v)
           for field, v in (("control_start", start), ("control_end", end))
           if not is_number(v) or not 0.0 <= v <= 1.0]
    if not out and start >= end:
        out.append(Problem("control_start", f"must be below the window's end ({end!r})"
                           f"{_why(which)}: the ControlNet acts from start to end, fractions "
                           "of the denoising steps", start))
    return out


def chosen_controlnet(name: Any, loaded: Iterable[str]) -> Any:
    """The ControlNet a control image goes to, for every front door: the one it names, or, when
    it names none, the only one loaded. None when it names none and there is not exactly one:
    the door asks for a name (and lists the loaded ones)."""
    loaded = list(loaded)
    return loaded[0] if name is None and len(loaded) == 1 else name


def controlnet_problem(name: Any, loaded: Iterable[str]) -> Problem | None:
    """A ControlNet a request names: one of ``loaded`` (the names this server or run loaded)."""
    loaded = list(loaded)
    if isinstance(name, str) and name in loaded:
        return None
    have = (f"loaded ControlNets: {', '.join(loaded)}" if loaded else
            "none is loaded here (serve arg controlnets)")
    return Problem("controlnet", f"unknown ControlNet {name!r}; {have}", None)
