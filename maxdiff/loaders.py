"""Load a UNet or a VAE from wherever people keep one: a diffusers component folder or a
single ``.safetensors`` file (diffusers keys, or the original Stability layout of a whole
checkpoint, read through :mod:`maxdiff.single_file`'s key maps). The model modules load
folders and opened weight sources; this module picks the source for a file."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from maxdiff import checkpoint, single_file
from maxdiff.models import controlnet as controlnetlib
from maxdiff.models import taesd
from maxdiff.models import unet as unetlib
from maxdiff.models import vae as vaelib

__all__ = ["load_unet", "load_vae", "load_controlnet", "config_from_unet"]


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


def _hint_channels(source: checkpoint.WeightSource) -> tuple[int, tuple[int, ...]] | None:
    """(conditioning_channels, conditioning_embedding_out_channels) read off a ControlNet
    file's conditioning encoder (diffusers' ``controlnet_cond_embedding.*`` or the original
    ``input_hint_block.*``), or None when it has neither."""
    keys = set(source.keys())

    def out_in(key: str) -> tuple[int, int]:
        shape = source.lazy(key).shape  # from the file's header; nothing read
        return int(shape[0]), int(shape[1])

    first = "controlnet_cond_embedding.conv_in.weight"
    if first in keys:  # blocks 2i: ch[i] -> ch[i]; blocks 2i+1: ch[i] -> ch[i+1]
        out, cond = out_in(first)
        ch = [out]
        while (k := f"controlnet_cond_embedding.blocks.{2 * len(ch) - 1}.weight") in keys:
            ch.append(out_in(k)[0])
        return cond, tuple(ch)
    for prefix in (single_file.CONTROLNET, ""):
        first = f"{prefix}input_hint_block.0.weight"
        if first in keys:  # convolutions at 0, 2, ..., 4 * steps + 2 (SiLUs between)
            convs = sum(k.startswith(f"{prefix}input_hint_block.") and k.endswith(".weight")
                        for k in keys)
            out, cond = out_in(first)
            steps = (convs - 2) // 2
            return cond, (out, *(out_in(f"{prefix}input_hint_block.{4 * i + 4}.weight")[0]
                                 for i in range(steps)))
    return None


def config_from_unet(path: str | os.PathLike, unet_config: Any) -> dict:
    """The diffusers config of a single-file ControlNet that ships without one, for the model
    whose UNet config is ``unet_config`` (a dict or a :class:`maxdiff.models.unet.UNetConfig`):
    the UNet fields diffusers' ``ControlNetModel.from_unet`` copies (how the released full-size
    ControlNets were made), with the conditioning encoder's channels read off the file. A file
    made otherwise (a smaller ControlNet) fails to load naming the first weight whose shape
    differs; pass its own ``config=`` then."""
    fields = [f.name for f in dataclasses.fields(unetlib.EncoderConfig)]
    if dataclasses.is_dataclass(unet_config):
        unet_config = {k: getattr(unet_config, k) for k in fields}
    config = {k: unet_config[k] for k in fields if k in unet_config}
    found = _hint_channels(checkpoint.WeightSource.from_files([path]))
    if found is not None:
        config["conditioning_channels"], config["conditioning_embedding_out_channels"] = found
    return config


def load_controlnet(path: str | os.PathLike, dtype: Any = "float32", *, config: dict | None = None,
                    unet_config: Any = None, **kwargs):
    """:func:`maxdiff.models.controlnet.load_controlnet` for a diffusers folder or a single
    ``.safetensors`` file: diffusers keys, or the original layout (``control_model.*`` or bare
    ``input_hint_block.*`` / ``zero_convs.*`` keys, as lllyasviel's files ship). A single
    file's config is ``config`` (the diffusers ``config.json`` of the same ControlNet, as a
    dict), or, without one, made from ``unet_config``, the config of the UNet it was made for
    (:func:`config_from_unet`). Returns ``(module, params)``."""
    path = Path(path)
    if not path.is_file():
        return controlnetlib.load_controlnet(path, dtype, config=config, **kwargs)
    if config is None:
        if unet_config is None:
            raise checkpoint.CheckpointError(
                f"{path}: a single-file ControlNet needs a config: config= (the config.json "
                "of the same ControlNet in the diffusers layout) or unet_config= (the "
                "config of the UNet it was made for)")
        config = config_from_unet(path, unet_config)
    return controlnetlib.load_controlnet(path, dtype, config=config,
                                         source=single_file.controlnet_source(path, config),
                                         **kwargs)
