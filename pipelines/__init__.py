"""maxdiff pipelines: the Python API (``TextToImagePipeline``, ``ImageToImagePipeline``,
``InpaintPipeline``, ``ControlNetPipeline``), requests, run configs and the CLI.

Importing the package is light: the pipelines (and with them JAX) load on first use, so
the HTTP ingress can import ``pipelines.requests`` and ``pipelines.config`` without JAX.
"""

from typing import TYPE_CHECKING

__all__ = ["TextToImagePipeline", "ImageToImagePipeline", "InpaintPipeline", "ControlNetPipeline",
           "ImageRequest", "ControlImage", "PipelineOutput", "GenerationRequest"]

if TYPE_CHECKING:
    from pipelines.conditioned_requests import ControlImage
    from pipelines.controlnet import ControlNetPipeline
    from pipelines.edit import ImageToImagePipeline, InpaintPipeline
    from pipelines.requests import GenerationRequest, ImageRequest
    from pipelines.text_to_image import PipelineOutput, TextToImagePipeline


def __getattr__(name):
    if name in ("TextToImagePipeline", "PipelineOutput"):
        from pipelines import text_to_image

        return getattr(text_to_image, name)
    if name in ("ImageToImagePipeline", "InpaintPipeline"):
        from pipelines import edit

        return getattr(edit, name)
    if name == "ControlNetPipeline":
        from pipelines import controlnet

        return controlnet.ControlNetPipeline
    if name in ("ImageRequest", "GenerationRequest"):
        from pipelines import requests

        return getattr(requests, name)
    if name == "ControlImage":
        from pipelines import conditioned_requests

        return conditioned_requests.ControlImage
    raise AttributeError(f"module 'pipelines' has no attribute {name!r}")
