"""Load a UNet or a VAE from wherever people keep one: a diffusers component folder or a
single ``.safetensors`` file (diffusers keys, or the original Stability layout of a whole
checkpoint, read through :mod:`maxdiff.single_file`'s key maps). The model modules load
folders and opened weight sources; this module picks the source for a file."""

from __future__ import annotations

import os
from pathlib import Path

from maxdiff import checkpoint, single_file
from maxdiff.models import taesd
from maxdiff.models import unet as unetlib
from maxdiff.models import vae as vaelib

__all__ = ["load_unet", "load_vae"]


def load_unet(path: str | os.PathLike, dtype="float32", *, config: dict | None = None,
              source=None, **kwargs):
    """:func:`maxdiff.models.unet.load_unet` for a folder or a single file (``config``: the
    model's ``unet/config.json``, required for a file)."""
    path = Path(path)
    if source is None and path.is_file() and config is not None:
        source = single_file.unet_source(path, config)
    return unetlib.load_unet(path, dtype, config=config, source=source, **kwargs)


def load_vae(path: str | os.PathLike, dtype="float32", *, config: dict | None = None,
             source=None, **kwargs):
    """:func:`maxdiff.models.vae.load_vae` for a folder or a single file (a VAE file such as
    ``sdxl_vae.safetensors``, original or diffusers keys; ``config``: the model's
    ``vae/config.json``, required for a file). A folder (or ``config``) of diffusers'
    ``AutoencoderTiny`` (``madebyollin/taesdxl``) loads the tiny autoencoder instead
    (:func:`maxdiff.models.taesd.load_tiny_autoencoder`): fast decodes of lower quality."""
    path = Path(path)
    if (path / "model_index.json").is_file() and (path / "vae" / "config.json").is_file():
        path = path / "vae"
    own = config if config is not None else (
        checkpoint.read_config(path) if (path / "config.json").is_file() else {})
    if taesd.is_tiny_autoencoder(own):
        if path.is_file() or source is not None:
            raise checkpoint.CheckpointError(
                f"{path}: an AutoencoderTiny is read from its diffusers folder (config.json and "
                "diffusion_pytorch_model.safetensors, as madebyollin/taesdxl ships it)")
        return taesd.load_tiny_autoencoder(path, dtype, variant=kwargs.get("variant"),
                                           put=kwargs.get("put"))
    if source is None and path.is_file() and config is not None:
        source = single_file.vae_source(path, config)
    return vaelib.load_vae(path, dtype, config=config, source=source, **kwargs)
