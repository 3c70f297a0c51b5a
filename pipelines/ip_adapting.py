"""IP-Adapter on a loaded pipeline (diffusers' ``load_ip_adapter`` / ``set_ip_adapter_scale`` /
``unload_ip_adapter``): :class:`ImagePrompts` is a base of :class:`pipelines.TextToImagePipeline`,
so text-to-image, image-to-image, inpainting and ControlNet take ``ip_adapter_image``.

The image encoder, the projection and every cross-attention's image projections are inputs of
the programs (:mod:`maxdiff.ip_adapter`); each image's CLIP pixels and scale are traced inputs,
so images with and without an image prompt, at any scale, share one device batch and one
program. A batch without image prompts runs the program it ran before the adapter was loaded.
One adapter at a time (loading another replaces it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from maxdiff import mesh as meshlib
from pipelines.limits import check, ip_adapter_scale_problem

__all__ = ["ImagePrompts", "image_encoder_folder"]


def image_encoder_folder(adapter: str | os.PathLike) -> Path | None:
    """Where an adapter file's image encoder is in h94/IP-Adapter's layout: ``image_encoder/``
    beside the file, or for the SDXL ViT-H adapters (``*vit-h*`` in ``sdxl_models/``) the
    repository's ``models/image_encoder``. None when neither exists."""
    p = Path(adapter)
    here = p if p.is_dir() else p.parent
    candidates = [here / "image_encoder"]
    if "vit-h" in p.name.lower():
        candidates.insert(0, here.parent / "models" / "image_encoder")
    return next((c for c in candidates if (c / "config.json").is_file()), None)


class ImagePrompts:
    """The IP-Adapter methods of a pipeline (a mixin over its ``unet``, ``params``, ``mesh``)."""

    ip_adapter = None  # maxdiff.ip_adapter.IPAdapterWeights, or None
    ip_adapter_scale: float = 1.0

    def load_ip_adapter(self, path: str | os.PathLike, image_encoder: Any = None,
                        scale: float = 1.0) -> None:
        """Load an IP-Adapter ``.safetensors`` file (h94/IP-Adapter's ``ip-adapter_sdxl``,
        ``ip-adapter-plus_sdxl_vit-h``, ``ip-adapter_sd15``, ...; :mod:`maxdiff.ip_adapter`)
        with its CLIP vision encoder: ``image_encoder`` a transformers folder (default: where
        h94/IP-Adapter keeps it, :func:`image_encoder_folder`). ``scale``: the default of
        images that give no ``ip_adapter_scale``. Calls then take ``ip_adapter_image``."""
        from maxdiff import ip_adapter as ipa
        from maxdiff.checkpoint import CheckpointError

        check([ip_adapter_scale_problem(scale)])
        if getattr(self, "quantization", "none") != "none":
            raise ValueError(f"IP-Adapter on a quantized UNet ({self.quantization}) is not "
                             "supported: load the model with quantization='none'")
        if image_encoder is None:
            image_encoder = image_encoder_folder(path)
            if image_encoder is None:
                raise CheckpointError(
                    f"{path}: no image encoder found beside it (looked for image_encoder/ "
                    "there, and models/image_encoder for a ViT-H adapter); give "
                    "image_encoder= (the CLIP vision folder the adapter was trained with)")
        unet_params = self.params["unet"]
        dtype = np.dtype(next(iter(_leaves(unet_params))).dtype)
        weights = ipa.load_ip_adapter(path, unet_params, self.unet.config.cross_attention_dim,
                                      image_encoder, dtype=dtype)
        weights.params = meshlib.place(weights.params, meshlib.replicated(self.mesh))
        self.ip_adapter, self.ip_adapter_scale = weights, float(scale)

    def set_ip_adapter_scale(self, scale: float) -> None:
        """The scale of images that give no ``ip_adapter_scale`` (0: no effect; 1: the adapter's
        full strength)."""
        check([ip_adapter_scale_problem(scale)])
        self.ip_adapter_scale = float(scale)

    def unload_ip_adapter(self) -> None:
        """Forget the IP-Adapter (its weights are freed once no program holds them)."""
        self.ip_adapter, self.ip_adapter_scale = None, 1.0

    def image_prompt_inputs(self, items, every_row: bool = False) -> tuple[Any, Any]:
        """(CLIP pixels (N, S, S, 3), scales (N,)) of a batch's image prompts, or (None, None)
        when no item has one (the batch runs without the adapter). An item without an image
        gets zeros at scale 0: exactly the model without the adapter. ``every_row``: with an
        adapter loaded, the arrays even when no item has an image (a program that holds every
        image's conditioning in one layout: the step engine's slots)."""
        if not any(it.ip_adapter_image is not None for it in items) and not (
                every_row and self.ip_adapter is not None):
            return None, None
        if self.ip_adapter is None:
            raise ValueError("ip_adapter_image: this pipeline has no IP-Adapter; load one with "
                             "load_ip_adapter(path) (run config: ip_adapter)")
        from maxdiff.models.clip_vision import preprocess

        size = self.ip_adapter.image_size
        pixels = np.zeros((len(items), size, size, 3), np.float32)
        scales = np.zeros(len(items), np.float32)
        for k, it in enumerate(items):
            if it.ip_adapter_image is not None:
                pixels[k] = preprocess([_rgb(it.ip_adapter_image)], size)[0]
                scales[k] = (self.ip_adapter_scale if it.ip_adapter_scale is None
                             else it.ip_adapter_scale)
        return pixels, scales

    def program_weights(self, image_prompts: bool) -> dict:
        """The weights a program of this pipeline takes: :attr:`params`, and the IP-Adapter's
        (``"ip_adapter"``) when the program runs ``image_prompts``."""
        if not image_prompts:
            return self.params
        return {**self.params, "ip_adapter": self.ip_adapter.params}


def _leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def _rgb(image):
    """A PIL image, or an (H, W, 3|4) array (an alpha channel dropped)."""
    if hasattr(image, "convert"):
        return image
    a = np.asarray(image)
    return a[..., :3]
