"""CLIP's vision encoder in Flax: transformers' ``CLIPVisionModel`` and
``CLIPVisionModelWithProjection`` (the image encoder of IP-Adapter and of SD 1.x's safety
checker), with their parameter names, so their safetensors load as they are.

    pixels (B, H, W, 3) normalised -> patch conv (no bias) -> [class token; patches] + positions
      -> pre_layrnorm -> N x encoder layer (bidirectional) -> post_layernorm(class token)
      -> visual_projection (WithProjection: ``image_embeds``)

Images are NHWC here (transformers takes NCHW ``pixel_values``); :func:`preprocess` makes them
from uint8 or [0, 1] images as ``CLIPImageProcessor`` does (shortest side resized to 224 with
bicubic resampling, centre crop, CLIP's mean and std).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from maxdiff import checkpoint
from maxdiff.models.clip import CLIPEncoder, _layer_norm, check_tower_config, config_from_dict
from maxdiff.models.params import Conv, Dense, Embed, FromTree

__all__ = ["CLIPVisionConfig", "CLIPVisionModel", "CLIPVisionModelWithProjection",
           "CLIPVisionOutput", "load_image_encoder", "preprocess", "CLIP_MEAN", "CLIP_STD"]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class CLIPVisionConfig:
    """The fields of transformers' ``CLIPVisionConfig`` that shape the computation (defaults:
    transformers', CLIP ViT-B/32)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    architectures: tuple[str, ...] = ()

    def __post_init__(self):
        check_tower_config(self, ("num_channels", "image_size", "patch_size"))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CLIPVisionConfig:
        """From a transformers ``config.json``; unknown keys raise ValueError."""
        return config_from_dict(cls, d, "clip_vision_model", "vision")


@flax.struct.dataclass
class CLIPVisionOutput:
    """``last_hidden_state`` (B, 1 + P, D) (before the post layer norm, as transformers
    returns it), ``pooler_output`` (B, D) the class token after it, ``hidden_states`` (the
    embeddings and every layer's output; IP-Adapter Plus reads ``hidden_states[-2]``),
    ``image_embeds`` (B, projection_dim) from the projection model only."""

    last_hidden_state: jax.Array
    pooler_output: jax.Array
    hidden_states: tuple[jax.Array, ...] | None = None
    image_embeds: jax.Array | None = None


class CLIPVisionEmbeddings(FromTree, nn.Module):
    config: CLIPVisionConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, pixels: jax.Array) -> jax.Array:
        c = self.config
        patches = Conv(c.hidden_size, (c.patch_size, c.patch_size),
                       strides=(c.patch_size, c.patch_size), padding="VALID", use_bias=False,
                       dtype=self.dtype, name="patch_embedding")(pixels.astype(self.dtype))
        b = patches.shape[0]
        patches = patches.reshape(b, -1, c.hidden_size)
        cls = self.param("class_embedding", nn.initializers.normal(0.02), (c.hidden_size,))
        x = jnp.concatenate([jnp.broadcast_to(cls.astype(self.dtype), (b, 1, c.hidden_size)),
                             patches], axis=1)
        pos = Embed(c.num_positions, c.hidden_size, dtype=self.dtype,
                    name="position_embedding")(jnp.arange(x.shape[1]))
        return x + pos[None]


class CLIPVisionTransformer(nn.Module):
    """``vision_model`` in the checkpoint."""

    config: CLIPVisionConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, pixels: jax.Array, output_hidden_states: bool = True) -> CLIPVisionOutput:
        c = self.config
        want = (c.image_size, c.image_size, c.num_channels)
        if pixels.ndim != 4 or tuple(pixels.shape[1:]) != want:
            raise ValueError(f"pixels must be (batch, {c.image_size}, {c.image_size}, "
                             f"{c.num_channels}) (preprocess() makes them), got {pixels.shape}")
        x = CLIPVisionEmbeddings(c, self.dtype, name="embeddings")(pixels)
        x = _layer_norm(x, c.layer_norm_eps, "pre_layrnorm")  # (sic: transformers' name)
        bias = jnp.zeros((1, 1, 1, 1), jnp.float32)  # every patch sees every patch
        states = CLIPEncoder(c, self.dtype, name="encoder")(x, bias)
        pooled = _layer_norm(states[-1][:, 0], c.layer_norm_eps, "post_layernorm")
        return CLIPVisionOutput(last_hidden_state=states[-1], pooler_output=pooled,
                                hidden_states=states if output_hidden_states else None)


class CLIPVisionModel(nn.Module):
    """transformers' ``CLIPVisionModel``: ``pixels (B, 224, 224, 3) -> CLIPVisionOutput``."""

    config: CLIPVisionConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, pixels: jax.Array, output_hidden_states: bool = True) -> CLIPVisionOutput:
        return CLIPVisionTransformer(self.config, self.dtype, name="vision_model")(
            pixels, output_hidden_states)


class CLIPVisionModelWithProjection(nn.Module):
    """transformers' ``CLIPVisionModelWithProjection``: adds ``image_embeds``."""

    config: CLIPVisionConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, pixels: jax.Array, output_hidden_states: bool = True) -> CLIPVisionOutput:
        out = CLIPVisionTransformer(self.config, self.dtype, name="vision_model")(
            pixels, output_hidden_states)
        embeds = Dense(self.config.projection_dim, use_bias=False, dtype=self.dtype,
                       name="visual_projection")(out.pooler_output)
        return out.replace(image_embeds=embeds)


ARCHITECTURES = {"CLIPVisionModel": CLIPVisionModel,
                 "CLIPVisionModelWithProjection": CLIPVisionModelWithProjection}


def load_image_encoder(folder: str | os.PathLike, dtype: Any = "float32", *,
                       variant: str | None = None) -> tuple[nn.Module, dict]:
    """Load a transformers CLIP vision encoder folder (``config.json`` + safetensors, as
    IP-Adapter's ``image_encoder/`` and SD 1.x's safety checker ship it): ``(module, params)``.
    The class: the config's ``architectures``, else the projection model when the weights
    hold ``visual_projection.weight``."""
    target = checkpoint.resolve_dtype(dtype)
    raw = checkpoint.read_config(folder)
    try:
        config = CLIPVisionConfig.from_dict(raw)
    except ValueError as e:
        raise ValueError(f"{os.fspath(folder)}/config.json: {e}") from None
    source = checkpoint.open_weights(folder, variant)
    known = [a for a in config.architectures if a in ARCHITECTURES]
    keys = set(source.keys())
    architecture = known[0] if known else ("CLIPVisionModelWithProjection"
                                           if "visual_projection.weight" in keys
                                           else "CLIPVisionModel")
    module = ARCHITECTURES[architecture](config, dtype=jnp.dtype(target))
    pixels = jax.ShapeDtypeStruct((1, config.image_size, config.image_size,
                                   config.num_channels), jnp.float32)
    shapes = checkpoint.init_shapes(module, pixels)
    ignore = ("position_ids",)
    if "vision_model.embeddings.class_embedding" not in keys \
            and "embeddings.class_embedding" in keys:  # transformers >= 5: CLIPVisionModel bare
        rest = {k: v for k, v in shapes.items() if k != "vision_model"}
        if rest:
            raise checkpoint.CheckpointError(f"{os.fspath(folder)}: weights without the "
                                             "vision_model. prefix and a projection")
        return module, {"vision_model": checkpoint.load_params(shapes["vision_model"], source,
                                                               target, ignore_unexpected=ignore)}
    return module, checkpoint.load_params(shapes, source, target, ignore_unexpected=ignore)


def preprocess(images, size: int = 224) -> np.ndarray:
    """Images (PIL, or uint8 / float [0, 1] (H, W, 3) arrays) -> (B, size, size, 3) float32
    as ``CLIPImageProcessor`` makes them: the shortest side resized to ``size`` (bicubic),
    the centre ``size`` x ``size`` crop, scaled to [0, 1], normalised by CLIP's mean and
    std. Runs on the host."""
    from PIL import Image

    out = []
    for im in images:
        if not isinstance(im, Image.Image):
            a = np.asarray(im)
            if a.dtype != np.uint8:
                a = np.clip(np.round(a.astype(np.float64) * 255), 0, 255).astype(np.uint8)
            im = Image.fromarray(a)
        im = im.convert("RGB")
        w, h = im.size
        short = min(w, h)
        nw, nh = (size, int(size * h / w)) if w == short else (int(size * w / h), size)
        im = im.resize((nw, nh), Image.BICUBIC)
        left, top = (nw - size) // 2, (nh - size) // 2
        im = im.crop((left, top, left + size, top + size))
        a = np.asarray(im, np.float32) / 255.0
        out.append((a - np.asarray(CLIP_MEAN, np.float32)) / np.asarray(CLIP_STD, np.float32))
    return np.stack(out)
