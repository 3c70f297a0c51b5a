"""maxdiff pipelines: the Python API (``TextToImagePipeline``), run configs and the CLI."""

from pipelines.text_to_image import ImageRequest, PipelineOutput, TextToImagePipeline

__all__ = ["TextToImagePipeline", "ImageRequest", "PipelineOutput"]
