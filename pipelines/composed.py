"""Pipelines that compose on a loaded text-to-image pipeline (image-to-image, inpainting,
ControlNet): diffusers' ``from_pipe``, live.

A composed pipeline holds its text-to-image pipeline (:attr:`pipe`) and reads the model from
it on every call: weights (``params``, fused LoRAs included), text encoders, tokenizers, UNet,
VAE, mesh, scheduler, defaults and adapters are the parent's live ones, so a LoRA loaded on
the parent after :meth:`from_pipe` is used by the next call. Every other attribute (``name``,
``default_steps``, ``limits``, ``load_lora_weights`` ...) is the parent's too; only
:attr:`OWN_SETTINGS` (``scheduler``, ``vae_tiling``, ``vae_tiling_threshold``) may be set on a
composed pipeline, for it alone. Compiled programs are its own (:attr:`programs`); the weights
are an input of every program (a new LoRA never recompiles nor goes stale) and a program is
kept per scheduler object.
"""

from __future__ import annotations

from maxdiff.models.vae_tiling import use_tiling
from pipelines import program as program_lib
from pipelines.text_to_image import TextToImagePipeline

__all__ = ["ComposedPipeline"]


class ComposedPipeline:
    """The base of :class:`pipelines.ImageToImagePipeline`, :class:`pipelines.InpaintPipeline`
    and :class:`pipelines.ControlNetPipeline` (see the module's docstring)."""

    OWN_SETTINGS = ("scheduler", "vae_tiling", "vae_tiling_threshold")

    def __init__(self, pipe: TextToImagePipeline):
        if isinstance(pipe, ComposedPipeline):
            pipe = pipe.pipe
        if not isinstance(pipe, TextToImagePipeline):
            raise TypeError(f"{type(self).__name__} runs on a TextToImagePipeline, got "
                            f"{type(pipe).__name__}")
        object.__setattr__(self, "pipe", pipe)
        object.__setattr__(self, "programs", program_lib.Programs(pipe.mesh))

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """Load a model as :meth:`TextToImagePipeline.from_pretrained` (same arguments)."""
        return cls(TextToImagePipeline.from_pretrained(*args, **kwargs))

    @classmethod
    def from_single_file(cls, *args, **kwargs):
        """Load a single file as :meth:`TextToImagePipeline.from_single_file` (same arguments)."""
        return cls(TextToImagePipeline.from_single_file(*args, **kwargs))

    @classmethod
    def from_config(cls, *args, **kwargs):
        """Load a run config as :meth:`TextToImagePipeline.from_config` (same arguments)."""
        return cls(TextToImagePipeline.from_config(*args, **kwargs))

    @classmethod
    def from_pipe(cls, pipe, **kwargs):
        """A pipeline of this kind over ``pipe`` (a :class:`TextToImagePipeline`, or a composed
        pipeline: its text-to-image pipeline and its own settings): the parent's live weights,
        tokenizers, scheduler, defaults and adapters, nothing copied; compiled programs are
        not shared."""
        new = cls(pipe, **kwargs)
        if isinstance(pipe, ComposedPipeline):
            for name in cls.OWN_SETTINGS:
                if name in vars(pipe):
                    setattr(new, name, vars(pipe)[name])
        return new

    def __getattr__(self, name: str):
        # only called for names not found on the composed pipeline: the parent's, live
        if name == "pipe":  # not set yet (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.pipe, name)

    def __setattr__(self, name: str, value) -> None:
        if name not in self.OWN_SETTINGS:
            raise AttributeError(
                f"{type(self).__name__}.{name} is its text-to-image pipeline's (shared, live); "
                f"set it there (.pipe.{name} = ...), for every pipeline that shares it; only "
                f"{', '.join(self.OWN_SETTINGS)} can be set for one pipeline alone")
        object.__setattr__(self, name, value)

    @property
    def latent_channels(self) -> int:
        """The VAE's latent channels (the UNet of an inpainting model takes 9)."""
        return self.vae.config.latent_channels

    @property
    def unet_channels(self) -> int:
        return self.unet.config.in_channels

    @property
    def num_compiled(self) -> int:
        """How many programs this pipeline has compiled (one per distinct shape key)."""
        return self.programs.num_compiled

    def uses_vae_tiling(self, height: int, width: int) -> bool:
        """Whether images of this size are encoded / decoded tile by tile (this pipeline's
        ``vae_tiling``, which is the parent's unless set here)."""
        return use_tiling(self.vae_tiling, self.vae.config, height, width,
                          self.vae_tiling_threshold)
