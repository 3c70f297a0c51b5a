"""Previews from the tiny autoencoder (TAESD / TAESDXL, :mod:`maxdiff.models.taesd`) on a loaded
pipeline: :class:`Previews` is a base of :class:`pipelines.TextToImagePipeline`.

With a preview decoder loaded, a step engine's previews (``previews=`` steps; the service's
``partial_images`` on engine=step) are drawn by it instead of the VAE decoder, and
:meth:`Previews.preview` draws any latents (a ``callback_on_step_end``'s, say). Final images
always come from the VAE.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from maxdiff import mesh as meshlib

__all__ = ["Previews"]


class Previews:
    """The preview-decoder methods of a pipeline (a mixin over its ``vae``, ``mesh``)."""

    preview_decoder = None  # (TinyDecoder module, its params on the mesh), or None

    def load_preview_decoder(self, path: str | os.PathLike, *, variant: str | None = None
                             ) -> None:
        """Load a diffusers ``AutoencoderTiny`` folder (``madebyollin/taesdxl`` for SDXL,
        ``madebyollin/taesd`` for SD 1.x / 2.x) or a decoder file in the original layout
        (``taesdxl_decoder.safetensors``) as this pipeline's preview decoder. ValueError
        when its latent channels or scale factor are not the VAE's."""
        from maxdiff.models.taesd import load_tiny_decoder

        module, params = load_tiny_decoder(path, variant=variant)
        c, vae = module.config, self.vae.config
        if (c.latent_channels, c.scale_factor) != (vae.latent_channels, vae.vae_scale_factor):
            raise ValueError(
                f"{os.fspath(path)}: a tiny decoder for {c.latent_channels}-channel latents at "
                f"{c.scale_factor}x; this model's VAE has {vae.latent_channels} channels at "
                f"{vae.vae_scale_factor}x (TAESDXL is SDXL's, TAESD SD 1.x / 2.x's)")
        self.preview_decoder = (module, meshlib.place(params, meshlib.replicated(self.mesh)))
        self._preview_fn = None

    def unload_preview_decoder(self) -> None:
        self.preview_decoder = None
        self._preview_fn = None

    def draw_preview(self, latents) -> list:
        """PIL images of latents (N, C, H/f, W/f): by the preview decoder where one is loaded,
        else by the VAE (a full decode: what a preview costs without a tiny decoder)."""
        import jax

        from pipelines import program as program_lib

        if self.preview_decoder is not None:
            return self.preview(latents)
        if getattr(self, "_vae_preview_fn", None) is None:
            vae = self.vae
            self._vae_preview_fn = jax.jit(
                lambda p, z: program_lib.finish(vae, p, z, program_lib.out_kind("pil", False)))
        z = np.asarray(latents, np.float32).transpose(0, 2, 3, 1)
        return program_lib.host_images(self._vae_preview_fn(self.params["vae"], z), z.shape[0],
                                       "pil")

    def preview(self, latents, output_type: str = "pil") -> Any:
        """Draw latents (N, C, H/f, W/f) in diffusers' layout (a ``callback_on_step_end``'s
        ``latents``) with the preview decoder: PIL images, or float32 (N, H, W, 3) in [0, 1]
        for ``"np"``. ValueError without one."""
        import jax

        from pipelines import program as program_lib

        if self.preview_decoder is None:
            raise ValueError("no preview decoder: load one with load_preview_decoder(path) "
                             "(run config: preview_decoder)")
        if output_type not in ("pil", "np"):
            raise ValueError(f"output_type={output_type!r}: 'pil' or 'np'")
        module, params = self.preview_decoder
        if getattr(self, "_preview_fn", None) is None:
            self._preview_fn = jax.jit(lambda p, z, u8: program_lib.to_pixels(
                module.apply({"params": p}, z), u8), static_argnums=2)
        z = np.asarray(latents, np.float32).transpose(0, 2, 3, 1)
        out = self._preview_fn(params, z, output_type == "pil")
        return program_lib.host_images(out, z.shape[0], output_type)
