"""Stable Diffusion 1.x's safety checker in Flax: diffusers' ``StableDiffusionSafetyChecker``
(a CLIP vision tower, a projection and the concept embeddings SD 1.x checkpoints ship in
``safety_checker/``, read by their names), and :class:`SafetyChecker` that flags and blacks out
images as diffusers does.

    image -> CLIPImageProcessor (``feature_extractor/``; on the host, with PIL, as diffusers)
      -> CLIP vision -> pooled -> visual_projection -> cosine with each concept embedding
      -> score = round(cos - concept threshold + adjustment, 3) (adjustment 0.01 once a
         "special care" concept scores above 0) -> flagged when any concept scores above 0
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from maxdiff import checkpoint
from maxdiff.models.clip_vision import (
    CLIP_MEAN,
    CLIP_STD,
    CLIPVisionConfig,
    CLIPVisionModel,
    CLIPVisionTransformer,
)
from maxdiff.models.params import Dense, FromTree

__all__ = ["SafetyCheckerModel", "SafetyChecker", "load_safety_checker"]


class SafetyCheckerModel(FromTree, nn.Module):
    """pixels (B, S, S, 3) -> (cosine with each special-care concept (B, n_special), with each
    concept (B, n_concepts)); the thresholds are parameters too (``*_weights``)."""

    config: CLIPVisionConfig
    projection_dim: int
    n_concepts: int = 17
    n_special: int = 3
    nested: bool = True  # vision_model.vision_model.* (as SD 1.x ships it) or vision_model.*
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, pixels: jax.Array):
        tower = CLIPVisionModel if self.nested else CLIPVisionTransformer
        pooled = tower(self.config, self.dtype, name="vision_model")(
            pixels, output_hidden_states=False).pooler_output
        emb = Dense(self.projection_dim, use_bias=False, dtype=self.dtype,
                    name="visual_projection")(pooled).astype(jnp.float32)
        ones = nn.initializers.ones
        concepts = self.param("concept_embeds", ones, (self.n_concepts, self.projection_dim))
        special = self.param("special_care_embeds", ones, (self.n_special, self.projection_dim))
        self.param("concept_embeds_weights", ones, (self.n_concepts,))
        self.param("special_care_embeds_weights", ones, (self.n_special,))

        def cosine(a, b):
            a = a / jnp.maximum(jnp.linalg.norm(a, axis=-1, keepdims=True), 1e-12)
            b = b / jnp.maximum(jnp.linalg.norm(b, axis=-1, keepdims=True), 1e-12)
            return a @ b.T
        return cosine(emb, special.astype(jnp.float32)), cosine(emb, concepts.astype(jnp.float32))


class SafetyChecker:
    """A loaded safety checker: ``check(images)`` -> (images with the flagged ones black, a
    flag per image). ``images``: PIL images, float (H, W, 3) arrays in [0, 1] or one float
    (N, H, W, 3) array (what the pipelines return); the checker sees them as diffusers'
    pipelines hand them over (uint8 PIL images through the feature extractor). The CLIP tower
    runs on batches padded to a power of two, so few programs are ever compiled."""

    def __init__(self, module: SafetyCheckerModel, params: dict, processor: dict):
        self.module, self.params, self.processor = module, params, processor
        self._fn = jax.jit(lambda p, x: module.apply({"params": p}, x))

    def pixels(self, images) -> np.ndarray:
        """The feature extractor: shortest side to ``size`` (bicubic), centre crop, scale, the
        processor's mean and std (CLIPImageProcessor's steps, its config's values)."""
        from PIL import Image

        p = self.processor
        size = p["size"]
        crop = p["crop"]
        out = []
        for im in images:
            if not isinstance(im, Image.Image):
                a = np.asarray(im)
                if a.dtype != np.uint8:  # diffusers' numpy_to_pil: round(x * 255)
                    a = (np.clip(a, 0, 1) * 255).round().astype(np.uint8)
                im = Image.fromarray(a)
            im = im.convert("RGB")
            w, h = im.size
            if w <= h:
                nw, nh = size, int(size * h / w)
            else:
                nw, nh = int(size * w / h), size
            im = im.resize((nw, nh), Image.BICUBIC)
            top, left = (nh - crop) // 2, (nw - crop) // 2
            im = im.crop((left, top, left + crop, top + crop))
            a = np.asarray(im, np.float32) * np.float32(p["rescale"])
            out.append((a - p["mean"]) / p["std"])
        return np.stack(out).astype(np.float32)

    def scores(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Cosines with the special-care concepts and with the concepts, (N, n_special) and
        (N, n_concepts), of preprocessed ``pixels`` (N, S, S, 3), run padded to a power of
        two."""
        n = len(pixels)
        padded = np.zeros((1 << (n - 1).bit_length(), *pixels.shape[1:]), np.float32)
        padded[:n] = pixels
        special, concepts = self._fn(self.params, jnp.asarray(padded))
        return (np.asarray(special, np.float64)[:n], np.asarray(concepts, np.float64)[:n])

    def warmup(self, max_images: int) -> None:
        """Compile the programs of every padded batch size up to ``max_images`` images."""
        crop = self.processor["crop"]
        for b in sorted({1 << (n - 1).bit_length() for n in range(1, max_images + 1)}):
            self.scores(np.zeros((b, crop, crop, 3), np.float32))

    def flags(self, images) -> list[bool]:
        """Whether each image shows a concept the checker flags (diffusers' rule, scores
        rounded to 3 decimals)."""
        special, concepts = self.scores(self.pixels(images))
        sw = np.asarray(self.params["special_care_embeds_weights"], np.float64)
        cw = np.asarray(self.params["concept_embeds_weights"], np.float64)
        out = []
        for s, c in zip(special, concepts):
            adjustment = 0.0
            for k in range(len(s)):
                if round(float(s[k] - sw[k] + adjustment), 3) > 0:
                    adjustment = 0.01
            out.append(any(round(float(c[k] - cw[k] + adjustment), 3) > 0
                           for k in range(len(c))))
        return out

    def check(self, images, which=None) -> tuple[Any, list[bool | None]]:
        """(``images`` with the flagged ones black, a flag per image). ``which``: per image
        whether to check it (default: all); an image not checked is returned as it is, with
        the flag None."""
        which = [True] * len(images) if which is None else [bool(w) for w in which]
        checked = [k for k, w in enumerate(which) if w]
        flagged: list[bool | None] = [None] * len(images)
        if not checked:
            return images, flagged
        for k, f in zip(checked, self.flags([images[k] for k in checked])):
            flagged[k] = f
        black = [k for k in checked if flagged[k]]
        if isinstance(images, np.ndarray):
            images = images.copy()
            images[black] = 0.0
            return images, flagged
        return [_black(im) if k in black else im for k, im in enumerate(images)], flagged


def _black(image):
    """A black image of ``image``'s size and kind (PIL RGB, or an array of its shape)."""
    if isinstance(image, np.ndarray):
        return np.zeros_like(image)
    from PIL import Image

    return Image.new("RGB", image.size)


def load_safety_checker(folder: str | os.PathLike, feature_extractor: str | os.PathLike,
                        dtype: Any = "float32") -> SafetyChecker:
    """A checkpoint's ``safety_checker/`` (a CLIPConfig and its safetensors) and
    ``feature_extractor/`` (``preprocessor_config.json``)."""
    folder = Path(folder)
    raw = checkpoint.read_config(folder)
    vision = dict(raw.get("vision_config") or {})
    vision.setdefault("model_type", "clip_vision_model")
    config = CLIPVisionConfig.from_dict({k: v for k, v in vision.items()
                                         if k != "projection_dim"})
    source = checkpoint.open_weights(folder)
    proj = source.get("visual_projection.weight").shape[0]
    target = checkpoint.resolve_dtype(dtype)
    module = SafetyCheckerModel(config, proj, source.get("concept_embeds").shape[0],
                                source.get("special_care_embeds").shape[0],
                                # transformers >= 5 saves the tower without its inner prefix
                                nested="vision_model.vision_model.embeddings.class_embedding"
                                in set(source.keys()), dtype=jnp.dtype(target))
    shapes = checkpoint.init_shapes(module, jax.ShapeDtypeStruct(
        (1, config.image_size, config.image_size, config.num_channels), jnp.float32))
    params = checkpoint.load_params(shapes, source, target,
                                    ignore_unexpected=("position_ids",))
    pre = json.loads((Path(feature_extractor) / "preprocessor_config.json").read_text())
    size = pre.get("size", config.image_size)
    size = size.get("shortest_edge", size.get("height")) if isinstance(size, dict) else size
    crop = pre.get("crop_size", size)
    crop = crop.get("height") if isinstance(crop, dict) else crop
    processor = {"size": int(size), "crop": int(crop),
                 "rescale": float(pre.get("rescale_factor", 1 / 255)),
                 "mean": np.asarray(pre.get("image_mean", CLIP_MEAN), np.float32),
                 "std": np.asarray(pre.get("image_std", CLIP_STD), np.float32)}
    return SafetyChecker(module, params, processor)
