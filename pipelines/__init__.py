"""maxdiff pipelines: the Python API (``TextToImagePipeline``), requests, run configs and the CLI.

Importing the package is light: ``TextToImagePipeline`` (and with it JAX) loads on first use, so
the HTTP ingress can import ``pipelines.requests`` and ``pipelines.config`` without JAX.
"""

from typing import TYPE_CHECKING

__all__ = ["TextToImagePipeline", "ImageRequest", "PipelineOutput", "GenerationRequest"]

if TYPE_CHECKING:
    from pipelines.requests import GenerationRequest, ImageRequest
    from pipelines.text_to_image import PipelineOutput, TextToImagePipeline


def __getattr__(name):
    if name in ("TextToImagePipeline", "PipelineOutput"):
        from pipelines import text_to_image

        return getattr(text_to_image, name)
    if name in ("ImageRequest", "GenerationRequest"):
        from pipelines import requests

        return getattr(requests, name)
    raise AttributeError(f"module 'pipelines' has no attribute {name!r}")
