"""maxdiff: the SDXL family of text-to-image models in JAX/Flax.

The core library: models (``maxdiff.models``), schedulers (``maxdiff.schedulers``),
checkpoint loading from the diffusers folder layout (``maxdiff.checkpoint``) and
device meshes (``maxdiff.mesh``). Nothing here imports torch.
"""

__version__ = "0.1.0"
