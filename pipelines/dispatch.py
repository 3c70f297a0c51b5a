"""The pipelines of one loaded model, by request kind: the one table the CLI and the service
both dispatch a device batch through.

A device batch is a key (:class:`pipelines.requests.ShapeKey` for text-to-image,
:class:`~pipelines.conditioned_requests.EditKey` for image-to-image and inpainting,
:class:`~pipelines.conditioned_requests.ControlKey` for ControlNets), its :class:`ImageRequest` items and
one entry per item of what the kind adds (None; ``(image, mask)``; the item's
:class:`ControlImage` list). :meth:`Pipelines.generate` runs it on the pipeline of its kind,
made on first use over the model's live weights (``from_pipe``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipelines.conditioned_requests import ControlKey, EditKey
from pipelines.program import PipelineOutput
from pipelines.requests import ImageRequest, ShapeKey

__all__ = ["Pipelines"]


class Pipelines:
    """``pipe`` (a loaded :class:`pipelines.TextToImagePipeline`) and the pipelines composed on
    it: image-to-image and inpainting, and one ControlNet pipeline per set of ControlNets
    (``controlnets``: name -> ``(module, params)``, loaded once, their arrays shared)."""

    def __init__(self, pipe, controlnets: Mapping[str, Any] | None = None):
        self.pipe = pipe
        self.controlnets = dict(controlnets or {})
        self._composed: dict[tuple, Any] = {}

    def edit(self, kind: str):
        """The ``"img2img"`` or ``"inpaint"`` pipeline over :attr:`pipe`."""
        def make():
            from pipelines.edit import ImageToImagePipeline, InpaintPipeline

            return (InpaintPipeline if kind == "inpaint" else ImageToImagePipeline).from_pipe(
                self.pipe)
        return self._made(("edit", kind), make)

    def control(self, names: tuple[str, ...]):
        """The ControlNet pipeline over :attr:`pipe` for the ControlNets ``names``, in order."""
        def make():
            from pipelines.controlnet import ControlNetPipeline

            return ControlNetPipeline.from_pipe(
                self.pipe, controlnet=[self.controlnets[n] for n in names])
        return self._made(("control", tuple(names)), make)

    def _made(self, key: tuple, make: Callable[[], Any]):
        pipe = self._composed.get(key)
        if pipe is None:
            pipe = self._composed[key] = make()
        return pipe

    @property
    def composed(self) -> list:
        """The composed pipelines made so far."""
        return list(self._composed.values())

    @property
    def num_compiled(self) -> int:
        """Programs the composed pipelines compiled (:attr:`pipe`'s own not included)."""
        return sum(p.num_compiled for p in self._composed.values())

    def generate(self, key, items: Sequence[ImageRequest], extras: Sequence[Any],
                 on_denoised=None) -> PipelineOutput:
        """Run one device batch of ``key``'s kind (see the module's docstring);
        ``on_denoised(step, timestep, x0 (N, C, h, w))`` (text-to-image only) sees each step's
        estimate of the clean latents (streamed previews)."""
        if on_denoised is not None:
            return _text(self, key, list(items), list(extras), on_denoised)
        return _KINDS[type(key)](self, key, list(items), list(extras))


def _text(pipes: Pipelines, key: ShapeKey, items, extras, on_denoised=None) -> PipelineOutput:
    return pipes.pipe.generate(items, height=key.height, width=key.width,
                               num_inference_steps=key.steps, on_step=on_denoised,
                               denoised=on_denoised is not None, hires=key.hires,
                               progress=False)  # the CLI and the service report their own


def _edit(pipes: Pipelines, key: EditKey, items, extras) -> PipelineOutput:
    return pipes.edit(key.kind).generate(
        items, [image for image, _ in extras],
        [mask for _, mask in extras] if key.kind == "inpaint" else None,
        strength=key.strength, height=key.height, width=key.width,
        num_inference_steps=key.steps)


def _control(pipes: Pipelines, key: ControlKey, items, extras) -> PipelineOutput:
    return pipes.control(key.controlnets).generate(
        items, extras, height=key.height, width=key.width, num_inference_steps=key.steps)


_KINDS = {ShapeKey: _text, EditKey: _edit, ControlKey: _control}
