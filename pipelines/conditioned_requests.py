"""Generation requests conditioned on images, for every way in (JAX-free, like
:mod:`pipelines.requests`, whose :class:`~pipelines.requests.GenerationRequest` they extend):

- Editing (image-to-image, inpainting): :class:`EditRequest` and its :class:`EditKey` (image
  files in and out are :mod:`pipelines.image_files`').
- ControlNet: :class:`ControlImage`, one image's control image and settings for one ControlNet;
  :class:`ControlRequest` (a request with control images, what the service queues) and its
  :class:`ControlKey` (the ControlNets and the program's shape: what a device batch shares).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from pipelines.control_limits import control_scale_problem, control_window_problems
from pipelines.limits import STRENGTH, cfg_on, describe, strength_problem, within
from pipelines.requests import GenerationRequest, describe_shape


# ---------------------------------------------------------------------------------- editing
class EditKey(NamedTuple):
    """What one batch of edit jobs shares: the compiled program (kind, size, steps, CFG on/off)
    and the strength (a traced input: a new strength never recompiles, but a device batch runs
    one)."""

    kind: str  # "img2img" or "inpaint"
    height: int
    width: int
    steps: int
    cfg: bool
    strength: float

    @property
    def program(self) -> tuple:
        return self[:5]

    def __str__(self) -> str:
        return (f"{self.kind}:{self.width}x{self.height}:{self.steps}:"
                f"{'cfg' if self.cfg else 'nocfg'}:s{self.strength:g}")

    def describe(self) -> str:
        """The batch's shape in words (the CLI's progress bar)."""
        return f"{self.kind} (strength {self.strength:g}) {describe_shape(self)}"


@dataclass(frozen=True, eq=False)
class EditRequest(GenerationRequest):
    """A :class:`GenerationRequest` that starts from ``image`` (uint8 (H, W, 3)) and, for
    inpainting, ``mask`` (uint8 (H, W), 255 = repaint, the image's size); ``strength`` as for
    :class:`pipelines.edit.ImageToImagePipeline` (default: :data:`pipelines.limits.STRENGTH`).
    What the service's ``edit`` queues."""

    strength: float = STRENGTH["img2img"]
    image: np.ndarray | None = None
    mask: np.ndarray | None = None

    @property
    def kind(self) -> str:
        return "img2img" if self.mask is None else "inpaint"

    @property
    def key(self) -> EditKey:  # type: ignore[override]
        return EditKey(self.kind, self.height, self.width, self.steps,
                       cfg_on(self.guidance_scale), float(self.strength))

    def batch_extra(self) -> tuple:
        """Each image's (image, mask) as PIL images (the mask None for image-to-image),
        resized by the pipeline as diffusers resizes them when the size differs."""
        from PIL import Image

        return (Image.fromarray(self.image),
                None if self.mask is None else Image.fromarray(self.mask, mode="L"))

    def file_settings(self) -> dict[str, str]:
        return {"mode": self.kind, "strength": f"{self.strength:g}"}

    def validate(self) -> None:
        super().validate()
        if (p := strength_problem(self.strength, self.steps)) is not None:
            raise ValueError(describe(p))
        img = self.image
        if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3 \
                or img.shape[-1] != 3:
            raise ValueError("image must be a uint8 (H, W, 3) array")
        if self.mask is not None:
            m = self.mask
            if not isinstance(m, np.ndarray) or m.dtype != np.uint8 or m.ndim != 2:
                raise ValueError("mask must be a uint8 (H, W) array")
            if m.shape != img.shape[:2]:
                raise ValueError(f"mask is {m.shape[1]}x{m.shape[0]} but image is "
                                 f"{img.shape[1]}x{img.shape[0]} (width x height); give a mask "
                                 "of the image's size")


# ---------------------------------------------------------------------------------- ControlNet
@dataclass(frozen=True)
class ControlImage:
    """One image's conditioning for one ControlNet (``ControlNetPipeline.generate``: one per
    ControlNet for every image): the control ``image`` (a PIL image or a float (H, W, 3) array
    in [0, 1]), the ``scale`` its residuals are multiplied by, the fraction of the denoising
    steps it acts on (``start`` to ``end``) and ``guess_mode`` (diffusers': the residuals
    ramp from 0.1 to 1.0 over the blocks and, with classifier-free guidance, only the
    text-conditioned half gets them)."""

    image: Any
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    guess_mode: bool = False

    def problems(self, which: str = "") -> list:
        """Every broken rule of :mod:`pipelines.limits` (``which``: "ControlNet 1", for
        messages)."""
        return [p for p in [control_scale_problem(self.scale, which),
                            *control_window_problems(self.start, self.end, which)] if p]


def describe_controls(controls: Iterable[tuple[str, float, float, float, bool]]) -> str:
    """``NAME:SCALE[START-END][ guess]; ...``: the ControlNets and their settings as image
    files record them (``controls``: (name, scale, start, end, guess mode) each)."""
    return "; ".join(f"{name}:{scale:g}[{start:g}-{end:g}]{' guess' if guess else ''}"
                     for name, scale, start, end, guess in controls)


class ControlKey(NamedTuple):
    """What one batch of ControlNet jobs shares: the ControlNets (their names, in the order
    the request gives its control images) and the compiled program's shape. Control images,
    scales and windows are per-image inputs of that program, so jobs that differ only in
    them share a device batch."""

    controlnets: tuple[str, ...]
    height: int
    width: int
    steps: int
    cfg: bool

    @property
    def program(self) -> tuple:
        return tuple(self)

    def __str__(self) -> str:
        return (f"controlnet[{'+'.join(self.controlnets)}]:{self.width}x{self.height}:"
                f"{self.steps}:{'cfg' if self.cfg else 'nocfg'}")

    def describe(self) -> str:
        """The batch's shape in words (the CLI's progress bar)."""
        return f"{len(self.controlnets)} ControlNet(s), {describe_shape(self)}"


@dataclass(frozen=True, eq=False)
class ControlRequest(GenerationRequest):
    """A :class:`GenerationRequest` conditioned by ControlNets (text-to-image):
    ``controls`` is one (ControlNet name, :class:`ControlImage`) per ControlNet, each control
    image a uint8 (H, W, 3) array (resized to the output size by the pipeline). Every image
    of the request gets the same controls. What the service's ``generate`` queues for a
    request with ``control_images``."""

    controls: tuple[tuple[str, ControlImage], ...] = ()

    @property
    def controlnets(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.controls)

    def batch_extra(self) -> list[ControlImage]:
        """The controls as the ControlNet pipeline and the step engine take them: each image a
        PIL image, so it is resized (to the output size) as diffusers resizes an uploaded one."""
        from PIL import Image

        return [ControlImage(Image.fromarray(c.image), c.scale, c.start, c.end, c.guess_mode)
                for _, c in self.controls]

    def file_settings(self) -> dict[str, str]:
        return {"mode": "controlnet", "controlnet": describe_controls(
            (name, c.scale, c.start, c.end, c.guess_mode) for name, c in self.controls)}

    @property
    def key(self) -> ControlKey:  # type: ignore[override]
        return ControlKey(self.controlnets, self.height, self.width, self.steps,
                          cfg_on(self.guidance_scale))

    def validate(self) -> None:
        super().validate()
        if not self.controls:
            raise ValueError("control_images is empty: give at least one control image")
        for k, (name, c) in enumerate(self.controls):
            where = f"control_images[{k}]"
            if not isinstance(name, str) or not isinstance(c, ControlImage):
                raise ValueError(f"{where}: give a (ControlNet name, ControlImage) pair")
            found = c.problems()
            if found:
                raise ValueError("; ".join(describe(within(p, "native", where), "native")
                                           for p in found))
            img = c.image
            if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3 \
                    or img.shape[-1] != 3:
                raise ValueError(f"{where}.image must be a uint8 (H, W, 3) array")
