"""Model families: what a model is, in one object each (SDXL base, SDXL refiner, SD 1.x, SD 2.x).

A :class:`Family` says which components a model has (its text encoders and tokenizers), how its
text conditions the denoiser (:meth:`Family.encode` -> context and pooled states;
:meth:`Family.time_ids` -> the micro-conditioning a request adds), how the denoiser is called
(:meth:`Family.denoise` with a :class:`Cond`), its defaults (steps, guidance, whether an omitted
negative prompt is zeros) and where its weights sit in a single-file checkpoint (``text``: the
text encoders' key prefixes; :mod:`maxdiff.single_file` holds the key maps). The pipelines read
all of it from here, so a new family is one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from maxdiff import adapters as adapterlib
from maxdiff.checkpoint import CheckpointError, read_config

__all__ = ["Cond", "Family", "FAMILIES", "folder_family"]

# where each text encoder sits in a single-file checkpoint (original Stability layout)
SDXL_CLIP_L = "conditioner.embedders.0.transformer."
SDXL_BIGG = "conditioner.embedders.1.model."
REFINER_BIGG = "conditioner.embedders.0.model."
SD1_CLIP = "cond_stage_model.transformer."
SD2_OPENCLIP = "cond_stage_model.model."


@jax.tree_util.register_dataclass
@dataclass
class Cond:
    """What the text gives the denoiser, per row: ``context`` (B, tokens, D) cross-attention
    states, ``pooled`` (B, P) pooled text embedding (P = 0 without one) and ``time_ids``
    (B, n) micro-conditioning (n = 0 without any); with image prompts, an IP-Adapter's
    ``image_tokens`` (B, T, D) and ``image_scale`` (B,) (:mod:`maxdiff.ip_adapter`)."""

    context: Any
    pooled: Any
    time_ids: Any
    image_tokens: Any = None
    image_scale: Any = None

    def rows(self, fn) -> Cond:
        """``fn`` applied to every field (a row rearrangement)."""
        return jax.tree.map(fn, self)


@dataclass(frozen=True)
class Family:
    """One model family. ``pipeline``: the diffusers pipeline class its folders name;
    ``text``: (component, ``"clip"`` | ``"openclip"``, single-file prefix) per text encoder;
    ``single_file``: whether maxdiff's pipelines load its single files; ``tokenizers``:
    (component, the embedded model's tokenizer folder with the same settings); ``n_time_ids``:
    the micro-conditioning values per image (6: size, crop, target size; 5: size, crop,
    aesthetic score; 0: none); ``steps`` / ``guidance``: diffusers' defaults;
    ``zero_negative``: an omitted negative prompt is zeros (diffusers'
    ``force_zeros_for_empty_prompt`` when model_index.json does not say)."""

    name: str
    title: str
    pipeline: str
    text: tuple[tuple[str, str, str], ...]
    single_file: bool
    tokenizers: tuple[tuple[str, str], ...] = (("tokenizer", "tokenizer"),)
    n_time_ids: int = 0
    steps: int = 50
    guidance: float = 7.5
    zero_negative: bool = False

    @property
    def encoders(self) -> tuple[str, ...]:
        """The text encoder components, in the order their states are concatenated."""
        return tuple(name for name, _, _ in self.text)

    @property
    def components(self) -> tuple[str, ...]:
        """Every component with weights: the UNet, the VAE, the text encoders."""
        return ("unet", "vae", *self.encoders)

    @property
    def pooled(self) -> bool:
        """Whether the denoiser takes a pooled text embedding (the last encoder's projection)."""
        return self.n_time_ids > 0

    def encode(self, encoders: Mapping[str, Any], params: Mapping, text, ad=None,
               aidx=None) -> Cond:
        """A batch's prompts -> their :class:`Cond`: context (B, T, D) and pooled (B, P), no
        time ids (the request's, added by the caller). ``text``: a
        :class:`maxdiff.prompts.Text` (long and weighted prompts), or token ids (2, B, L) (row
        k: tokenizer k's ids; one tokenizer: its ids twice). SDXL: both encoders' penultimate
        states side by side and encoder 2's pooled projection; the refiner: encoder 2's alone;
        SD 1.x / 2.x: the encoder's last state after its final layer norm and an empty pooled,
        as diffusers' pipelines compute them. Each chunk of a long prompt is encoded on its own
        and the chunks' states are concatenated; weights and masked encodings are applied as
        :mod:`maxdiff.prompts` describes. ``ad`` / ``aidx``: per-image adapter tables and
        indices."""
        from maxdiff.prompts import Text

        if not isinstance(text, Text):
            ids = jnp.asarray(text)
            text = Text(ids=jnp.moveaxis(ids, 0, 1), weights=None, masks=None, coefs=None,
                        empty=None, pooled_ids=ids[-1], lerp=None, used=None)
        ad = ad or {}
        b, _, size = text.ids.shape
        n = text.pooled_ids.shape[-1]
        c = size // n
        v = text.masks.shape[2] if text.weighted else 1
        outs, pooled = [], None
        for k, name in enumerate(self.encoders):
            r = k if len(self.encoders) > 1 else (1 if name == "text_encoder_2" else 0)
            rows = jnp.broadcast_to(text.ids[:, r, None], (b, v, size)).reshape(b * v * c, n)
            mask = text.masks[:, r].reshape(b * v * c, n) if v > 1 else None
            idx = None if aidx is None else jnp.repeat(aidx, v * c)
            if text.weighted:  # and each image's empty prompt: compel's pivot
                rows = jnp.concatenate([rows, text.empty[:, r]])
                mask = None if mask is None else jnp.concatenate(
                    [mask, jnp.ones((b, n), mask.dtype)])
                idx = None if idx is None else jnp.concatenate([idx, aidx])
            with adapterlib.applied(ad.get(name), idx):
                out = encoders[name].apply({"params": params[name]}, rows, mask)
            z = out.hidden_states[-2] if self.pooled else out.last_hidden_state
            if name == self.encoders[-1] and self.pooled:
                pooled = out.text_embeds[: b * v * c].reshape(b, v, c, -1)[:, 0, 0]
            if text.weighted:
                z = _weighted(z, text, r, b, v, c, n)
            else:
                z = z.reshape(b, size, z.shape[-1])
            outs.append(z)
        if not self.pooled:
            return Cond(outs[-1], jnp.zeros((b, 0), outs[-1].dtype), None)
        if text.own_pooled:
            last = self.encoders[-1]
            with adapterlib.applied(ad.get(last), aidx):
                pooled = encoders[last].apply({"params": params[last]},
                                              text.pooled_ids).text_embeds
        return Cond(jnp.concatenate(outs, axis=-1), pooled, None)

    def denoise(self, unet, params: Mapping, cond: Cond, x, t, **extras):
        """The denoiser's prediction for latents ``x`` at timesteps ``t`` (``extras``: e.g.
        ControlNet residuals). With image tokens, ``params`` hold the IP-Adapter's layers
        (:func:`maxdiff.ip_adapter.with_layers`)."""
        if cond.image_tokens is not None:
            from maxdiff.ip_adapter import ImageContext

            extras = {**extras, "image_context": ImageContext(cond.context, cond.image_tokens,
                                                              cond.image_scale)}
        return unet.apply({"params": params}, x, t, cond.context, cond.pooled, cond.time_ids,
                          **extras)

    def time_ids(self, item, height: int, width: int) -> tuple[list[float], list[float]]:
        """The (positive, negative) micro-conditioning of one request for an image of
        ``height`` x ``width`` (``item``: a :class:`pipelines.requests.ImageRequest`)."""
        if self.n_time_ids == 6:
            return item.time_ids(height, width), item.negative_time_ids(height, width)
        if self.n_time_ids == 5:
            return item.aesthetic_time_ids(height, width)
        return [], []


def _weighted(z, text, r: int, b: int, v: int, c: int, n: int):
    """Encoder states of a weighted batch (its b*v*c chunk rows, then b empty prompts) ->
    (b, c*n, D): weights applied (compel's pivot at the empty prompt for compel rows, A1111's
    mean-restoring scale for the others), the masked encodings mixed (:mod:`maxdiff.prompts`)."""
    dtype, d = z.dtype, z.shape[-1]
    z = z.astype(jnp.float32)
    empty = z[b * v * c:][:, None, None]  # (b, 1, 1, n, D)
    z = z[: b * v * c].reshape(b, v, c, n, d)
    w = text.weights[:, r].reshape(b, 1, c, n, 1).astype(jnp.float32)
    pivot = jnp.where(w == 1, z, empty + (z - empty) * w)
    scaled = z * w
    scaled = scaled * (jnp.mean(z, axis=(3, 4), keepdims=True)
                       / jnp.mean(scaled, axis=(3, 4), keepdims=True))
    z = jnp.where(text.lerp[:, None, None, None, None], pivot, scaled).reshape(b, v, c * n, d)
    z = jnp.sum(z * text.coefs[:, r][:, :, None, None], axis=1)
    return z.astype(dtype)


FAMILIES = {f.name: f for f in (
    Family("sdxl-base", "Stable Diffusion XL base", "StableDiffusionXLPipeline",
           (("text_encoder", "clip", SDXL_CLIP_L), ("text_encoder_2", "openclip", SDXL_BIGG)),
           True, (("tokenizer", "tokenizer"), ("tokenizer_2", "tokenizer_2")), n_time_ids=6,
           guidance=5.0, zero_negative=True),
    Family("sdxl-refiner", "Stable Diffusion XL refiner", "StableDiffusionXLImg2ImgPipeline",
           (("text_encoder_2", "openclip", REFINER_BIGG),), True,
           (("tokenizer_2", "tokenizer_2"),), n_time_ids=5, guidance=5.0, zero_negative=True),
    Family("sd1", "Stable Diffusion 1.x", "StableDiffusionPipeline",
           (("text_encoder", "clip", SD1_CLIP),), True),
    Family("sd2", "Stable Diffusion 2.x", "StableDiffusionPipeline",
           (("text_encoder", "openclip", SD2_OPENCLIP),), True, (("tokenizer", "tokenizer_2"),)),
)}
PIPELINES = ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline",
             "StableDiffusionPipeline")


def folder_family(folder: str | Path, model_index: Mapping | None = None) -> Family:
    """The family of a diffusers folder (``model_index`` read from it unless given): SDXL
    base (an SDXL image-to-image folder with both text encoders too), the SDXL refiner (an
    image-to-image folder with ``text_encoder_2`` only) or SD 1.x (OpenAI's CLIP text
    encoder, ``quick_gelu``) / 2.x (OpenCLIP's, ``gelu``). CheckpointError otherwise."""
    folder = Path(folder)
    if model_index is None:
        model_index = json.loads((folder / "model_index.json").read_text())
    name = model_index.get("_class_name")
    if name in ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline"):
        family = _sdxl_family(folder, name, model_index)
        # the time ids follow requires_aesthetics_score, as diffusers' pipelines read it
        n_ids = 5 if model_index.get("requires_aesthetics_score", False) else 6
        return family if family.n_time_ids == n_ids else replace(family, n_time_ids=n_ids)
    if name == "StableDiffusionPipeline":
        act = read_config(folder / "text_encoder").get("hidden_act") \
            if (folder / "text_encoder").is_dir() else "quick_gelu"
        return FAMILIES["sd1" if act == "quick_gelu" else "sd2"]
    raise CheckpointError(f"{folder / 'model_index.json'}: model_index.json names a {name}; "
                          f"maxdiff loads {', '.join(PIPELINES)} folders")


def _sdxl_family(folder: Path, name: str, model_index: Mapping) -> Family:
    if name == "StableDiffusionXLPipeline":
        return FAMILIES["sdxl-base"]

    def present(c):
        return model_index.get(c, [None])[0] is not None
    if present("text_encoder") and present("tokenizer"):
        return FAMILIES["sdxl-base"]
    if present("text_encoder_2") and present("tokenizer_2"):
        return FAMILIES["sdxl-refiner"]
    raise CheckpointError(
        f"{folder / 'model_index.json'}: an SDXL image-to-image folder without "
        "text_encoder_2 / tokenizer_2; maxdiff loads SDXL base and refiner folders")
