"""IP-Adapter (Ye et al. 2023, "IP-Adapter: Text Compatible Image Prompt Adapter"): an image as
a prompt, read from the files people download (``ip-adapter_sdxl.safetensors``,
``ip-adapter-plus_sdxl_vit-h.safetensors``, ``ip-adapter_sd15.safetensors``, ...), no torch.

    image -> CLIP vision encoder (the adapter's ``image_encoder/``) -> image projection
      -> image tokens (B, T, D_ctx)
    every UNet cross-attention: softmax(q k_text) v_text + scale * softmax(q k_img) v_img,
      k_img / v_img = to_k_ip / to_v_ip (the adapter's weights) of the image tokens

as diffusers' ``IPAdapterAttnProcessor2_0`` computes it (both attentions before ``to_out``).
The projections, by what the file holds:

- ``basic`` (``image_proj.proj.weight``): the encoder's ``image_embeds`` -> Linear -> 4 tokens
  -> LayerNorm (diffusers' ``ImageProjection``);
- ``plus`` (``image_proj.latents``): the encoder's penultimate hidden states -> a perceiver
  resampler (learned queries, ``depth`` blocks of attention over [states; queries] and a
  feed-forward) -> ``num_queries`` tokens (``IPAdapterPlusImageProjection``);
- ``full`` (``image_proj.proj.3.weight``): the penultimate states (257 tokens) -> Linear, GELU,
  Linear, LayerNorm (``IPAdapterFullImageProjection``).

The FaceID adapters need face-recognition embeddings (insightface) and are refused by name.
The unconditional rows of classifier-free guidance get the projection of zero embeddings
(``basic``) or of the encoder's states for an all-zero image (``plus`` / ``full``), as diffusers
makes them. ``scale`` is per image (traced): 0 gives exactly the model without the adapter.

File layout: ``image_proj.*`` and ``ip_adapter.{k}.to_k_ip.weight`` / ``to_v_ip.weight``, where
``k`` = 1, 3, 5, ... numbers the UNet's cross-attention layers in diffusers' order (down blocks,
up blocks, mid block). diffusers' converted names for the resampler (``layers.0.attn.to_q``)
load too. Torch pickles (``.bin``) are refused with the conversion command.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from maxdiff import checkpoint
from maxdiff.checkpoint import CheckpointError
from maxdiff.models.layers import dense
from maxdiff.models.params import FromTree
from maxdiff.models.transformer import _layer_norm

__all__ = ["ImageContext", "IPAdapterWeights", "read_ip_adapter", "cross_attention_paths",
           "load_ip_adapter", "with_layers", "image_tokens", "PROJECTIONS"]

PROJECTIONS = ("basic", "plus", "full")
_FACEID = "FaceID IP-Adapters need insightface face embeddings, which maxdiff does not compute"


@flax.struct.dataclass
class ImageContext:
    """A cross-attention context with image tokens: ``text`` (B, L, D) the text states,
    ``tokens`` (B, T, D) the IP-Adapter's image tokens, ``scale`` (B,) per image."""

    text: jax.Array
    tokens: jax.Array
    scale: jax.Array

    def astype(self, dtype) -> ImageContext:
        return ImageContext(self.text.astype(dtype), self.tokens.astype(dtype), self.scale)


class BasicProjection(nn.Module):
    """``image_embeds`` (B, E) -> (B, tokens, dim): Linear, LayerNorm (names: the file's)."""

    dim: int
    tokens: int = 4
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, embeds: jax.Array) -> jax.Array:
        h = dense(self.tokens * self.dim, "proj", self.dtype)(embeds.astype(self.dtype))
        return _layer_norm("norm", self.dtype)(h.reshape(h.shape[0], self.tokens, self.dim))


class FullProjection(nn.Module):
    """Hidden states (B, L, E) -> (B, L, dim): Linear, GELU, Linear, LayerNorm."""

    dim: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, states: jax.Array) -> jax.Array:
        e = states.shape[-1]
        h = dense(e, "proj.0", self.dtype)(states.astype(self.dtype))
        h = dense(self.dim, "proj.2", self.dtype)(jax.nn.gelu(h, approximate=False))
        return _layer_norm("proj.3", self.dtype)(h)


class PlusProjection(FromTree, nn.Module):
    """The perceiver resampler: hidden states (B, L, E) -> (B, queries, dim)."""

    dim: int
    hidden: int
    queries: int
    depth: int
    heads: int
    dim_head: int = 64
    ff_mult: int = 4
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, states: jax.Array) -> jax.Array:
        dt = self.dtype
        b = states.shape[0]
        lat = self.param("latents", nn.initializers.normal(1.0), (1, self.queries, self.hidden))
        lat = jnp.broadcast_to(lat.astype(dt), (b, self.queries, self.hidden))
        x = dense(self.hidden, "proj_in", dt)(states.astype(dt))
        inner = self.heads * self.dim_head
        for i in range(self.depth):
            p = f"layers.{i}"
            xs = _layer_norm(f"{p}.0.norm1", dt)(x)
            ls = _layer_norm(f"{p}.0.norm2", dt)(lat)
            q = dense(inner, f"{p}.0.to_q", dt, use_bias=False)(ls)
            kv = dense(2 * inner, f"{p}.0.to_kv", dt, use_bias=False)(
                jnp.concatenate([xs, ls], axis=1))
            k, v = jnp.split(kv, 2, axis=-1)
            heads = lambda t: t.reshape(b, -1, self.heads, self.dim_head)
            s = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k),
                           preferred_element_type=jnp.float32) * self.dim_head ** -0.5
            o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(dt), heads(v))
            lat = dense(self.hidden, f"{p}.0.to_out", dt, use_bias=False)(
                o.reshape(b, -1, inner)) + lat
            h = _layer_norm(f"{p}.1.0", dt)(lat)
            h = dense(self.hidden * self.ff_mult, f"{p}.1.1", dt, use_bias=False)(h)
            lat = dense(self.hidden, f"{p}.1.3", dt, use_bias=False)(
                jax.nn.gelu(h, approximate=False)) + lat
        h = dense(self.dim, "proj_out", dt)(lat)
        return _layer_norm("norm_out", dt)(h)


# ------------------------------------------------------------------ the file
def _file(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        found = sorted(q for q in p.glob("*.safetensors") if "ip" in q.name.lower()) \
            or sorted(p.glob("*.safetensors"))
        if len(found) != 1:
            what = ", ".join(q.name for q in found) or "none"
            raise CheckpointError(f"{p}: give the IP-Adapter's .safetensors file itself "
                                  f"(safetensors files in this folder: {what})")
        return found[0]
    if not p.is_file():
        raise CheckpointError(f"{p}: no such IP-Adapter file")
    if p.suffix in checkpoint.PICKLE_SUFFIXES:
        raise CheckpointError(
            f"{p}: a torch pickle; maxdiff reads IP-Adapters as safetensors (a pickle runs code "
            "when loaded; h94/IP-Adapter ships .safetensors beside each .bin). To convert one "
            "where torch is installed: `python -c \"import torch, safetensors.torch as st; "
            "d = torch.load('IN.bin', weights_only=True); st.save_file({f'{g}.{k}': v for g in d "
            "for k, v in d[g].items()}, 'OUT.safetensors')\"`")
    return p


_DIFFUSERS_PLUS = [  # diffusers' converted resampler names -> the original file's
    (re.compile(r"^layers\.(\d+)\.ln0\."), r"layers.\1.0.norm1."),
    (re.compile(r"^layers\.(\d+)\.ln1\."), r"layers.\1.0.norm2."),
    (re.compile(r"^layers\.(\d+)\.attn\.to_q\."), r"layers.\1.0.to_q."),
    (re.compile(r"^layers\.(\d+)\.attn\.to_out\.0\."), r"layers.\1.0.to_out."),
    (re.compile(r"^layers\.(\d+)\.ff\.0\."), r"layers.\1.1.0."),
    (re.compile(r"^layers\.(\d+)\.ff\.1\.net\.0\.proj\."), r"layers.\1.1.1."),
    (re.compile(r"^layers\.(\d+)\.ff\.1\.net\.2\."), r"layers.\1.1.3."),
]


def read_ip_adapter(source: str | os.PathLike | Mapping) -> tuple[dict, dict, str]:
    """(``image_proj`` tensors, ``ip_adapter`` tensors, where) of an IP-Adapter safetensors file
    (or a dict with those two groups, or flat ``image_proj.*`` / ``ip_adapter.*`` keys)."""
    if isinstance(source, Mapping):
        where = "the IP-Adapter state dict"
        flat = dict(source)
        if set(flat) >= {"image_proj", "ip_adapter"} and isinstance(flat["image_proj"], Mapping):
            flat = {f"{g}.{k}": v for g in ("image_proj", "ip_adapter")
                    for k, v in flat[g].items()}
        flat = {k: np.asarray(v) for k, v in flat.items()}
    else:
        path = _file(source)
        where = str(path)
        f = checkpoint.SafetensorsFile(path)
        flat = {k: f.get(k) for k in f.keys()}
    proj = {k[len("image_proj."):]: v for k, v in flat.items() if k.startswith("image_proj.")}
    ip = {k[len("ip_adapter."):]: v for k, v in flat.items() if k.startswith("ip_adapter.")}
    other = [k for k in flat if not k.startswith(("image_proj.", "ip_adapter."))]
    if not proj or not ip or other:
        raise CheckpointError(
            f"{where}: not an IP-Adapter file (it needs image_proj.* and ip_adapter.* tensors"
            + (f"; it has {other[0]!r}" if other else "") + ")")
    if any(".attn." in k for k in proj):  # diffusers' converted resampler
        out = {}
        for k, v in proj.items():
            m = re.match(r"^layers\.(\d+)\.attn\.to_([kv])\.(weight)$", k)
            if m:
                continue
            for pat, rep in _DIFFUSERS_PLUS:
                k = pat.sub(rep, k)
            out[k] = v
        for i in sorted({int(m.group(1)) for k in proj
                         if (m := re.match(r"^layers\.(\d+)\.attn\.to_k\.weight$", k))}):
            out[f"layers.{i}.0.to_kv.weight"] = np.concatenate(
                [proj[f"layers.{i}.attn.to_k.weight"], proj[f"layers.{i}.attn.to_v.weight"]])
        proj = out
    return proj, ip, where


def projection_kind(proj: Mapping) -> str:
    """``basic``, ``plus`` or ``full`` from the ``image_proj`` tensors' names."""
    if "perceiver_resampler.proj_in.weight" in proj or (
            "norm.weight" in proj and "proj.0.weight" in proj):
        raise CheckpointError(f"this is a FaceID IP-Adapter: {_FACEID}")
    if "proj.weight" in proj:
        return "basic"
    if "proj.3.weight" in proj:
        return "full"
    if "latents" in proj:
        return "plus"
    raise CheckpointError(f"unknown IP-Adapter image projection (tensors: "
                          f"{', '.join(sorted(proj)[:6])} ...)")


def projection_module(proj: Mapping, cross_dim: int, dtype: Any) -> tuple[str, nn.Module, int]:
    """(kind, the Flax projection, the encoder width it takes) for the ``image_proj`` tensors
    and the UNet's ``cross_attention_dim``."""
    kind = projection_kind(proj)
    width = int(proj[{"basic": "norm.weight", "full": "proj.3.weight",
                      "plus": "norm_out.weight"}[kind]].shape[0])
    if width != cross_dim:
        raise CheckpointError(f"the adapter's image tokens are {width} wide; this UNet's "
                              f"cross_attention_dim is {cross_dim}: the adapter is for another "
                              "model")
    if kind == "basic":
        out, embed = proj["proj.weight"].shape
        return kind, BasicProjection(cross_dim, out // cross_dim, dtype), embed
    if kind == "full":
        return kind, FullProjection(int(proj["proj.3.weight"].shape[0]), dtype), \
            int(proj["proj.0.weight"].shape[1])
    _, queries, hidden = proj["latents"].shape
    depth = len({k.split(".")[1] for k in proj if k.startswith("layers.")})
    inner = int(proj["layers.0.0.to_q.weight"].shape[0])
    ff = int(proj["layers.0.1.1.weight"].shape[0]) // hidden
    return kind, PlusProjection(int(proj["proj_out.weight"].shape[0]), int(hidden), int(queries),
                                depth, inner // 64, 64, ff, dtype), \
        int(proj["proj_in.weight"].shape[1])


# ------------------------------------------------------------------ the UNet's layers
def _natural(key: str) -> tuple:
    return tuple(int(s) if s.isdigit() else s for s in key.split("."))


def cross_attention_paths(unet_params: Mapping) -> list[tuple[str, ...]]:
    """The UNet's cross-attention layers (``attn2``) as paths in its parameter tree, in
    diffusers' ``attn_processors`` order (down blocks, up blocks, mid block; block, attention,
    transformer block): the order IP-Adapter files number them in."""
    rank = {"down_blocks": 0, "up_blocks": 1, "mid_block": 2}
    out = []
    for top in sorted((k for k in unet_params if k.split(".")[0] in rank and ".attentions." in k),
                      key=lambda k: (rank[k.split(".")[0]], _natural(k))):
        for block in sorted(unet_params[top], key=_natural):
            if block.startswith("transformer_blocks.") and "attn2" in unet_params[top][block]:
                out.append((top, block, "attn2"))
    return out


def _cast_tree(tree, dtype):
    return jax.tree.map(lambda a: np.asarray(a).astype(dtype), tree)


@dataclass
class IPAdapterWeights:
    """A loaded IP-Adapter: ``kind`` (:data:`PROJECTIONS`), its ``projection`` and image
    ``encoder`` modules, ``params`` ({"image_encoder", "image_proj", "layers"}: the last a
    subtree of the UNet's with each ``attn2``'s ``to_k_ip.0`` / ``to_v_ip.0``), ``tokens`` per
    image, and where it came from."""

    kind: str
    projection: nn.Module
    encoder: nn.Module
    params: dict
    tokens: int
    path: str
    encoder_path: str

    @property
    def image_size(self) -> int:
        return self.encoder.config.image_size


class _DictSource:
    """A :class:`maxdiff.checkpoint.WeightSource` over tensors in memory."""

    def __init__(self, tensors: Mapping[str, np.ndarray], where: str):
        self.index = {k: k for k in tensors}
        self._t, self._where = tensors, where

    def keys(self):
        return list(self._t)

    def get(self, key):
        return self._t[key]

    def file_of(self, key):
        return self._where

    def describe(self):
        return self._where


def load_ip_adapter(source, unet_params: Mapping, cross_dim: int, image_encoder, *,
                    dtype: Any = "float32") -> IPAdapterWeights:
    """Read an IP-Adapter (file or dict) for a UNet (its parameter tree and
    ``cross_attention_dim``) with its CLIP vision encoder (a folder, or ``(module, params)``).
    CheckpointError naming the file for a layer count, width or encoder that does not fit."""
    from maxdiff.models import clip_vision

    target = checkpoint.resolve_dtype(dtype)
    proj, ip, where = read_ip_adapter(source)
    try:
        kind, module, embed = projection_module(proj, cross_dim, jnp.dtype(target))
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    if isinstance(image_encoder, (str, os.PathLike)):
        encoder_path = os.fspath(image_encoder)
        encoder, enc_params = clip_vision.load_image_encoder(image_encoder, target)
    else:
        encoder_path = "(given)"
        encoder, enc_params = image_encoder
    c = encoder.config
    width = c.projection_dim if kind == "basic" else c.hidden_size
    if kind == "basic" and not isinstance(encoder, clip_vision.CLIPVisionModelWithProjection):
        raise CheckpointError(f"{where}: a basic IP-Adapter takes image_embeds; the image "
                              f"encoder {encoder_path} has no visual projection")
    if width != embed:
        what = "image_embeds (projection_dim)" if kind == "basic" else "hidden states (hidden_size)"
        raise CheckpointError(
            f"{where}: the adapter takes {embed}-wide {what}; the image encoder {encoder_path} "
            f"gives {width}: it is not this adapter's encoder (SDXL's ViT-H adapters, "
            "'*_vit-h', take h94/IP-Adapter's models/image_encoder; the others sdxl_models/"
            "image_encoder)")
    shapes = checkpoint.init_shapes(module, jax.ShapeDtypeStruct(
        (1, embed) if kind == "basic" else (1, c.num_positions, embed), jnp.float32))
    proj_params = checkpoint.load_params(shapes, _DictSource(proj, where), target,
                                         put=lambda a: a)
    paths = cross_attention_paths(unet_params)
    numbers = sorted({int(k.split(".")[0]) for k in ip}, key=int)
    want = [2 * i + 1 for i in range(len(paths))]
    if numbers != want:
        raise CheckpointError(
            f"{where}: the adapter has {len(numbers)} cross-attention layers; this UNet has "
            f"{len(paths)}: the adapter is for another model")
    layers: dict = {}
    for n, path in zip(want, paths):
        attn = unet_params[path[0]][path[1]]["attn2"]
        inner = int(attn["to_k"]["kernel"].shape[1])
        node = layers.setdefault(path[0], {}).setdefault(path[1], {}).setdefault("attn2", {})
        for name in ("to_k_ip", "to_v_ip"):
            w = ip.get(f"{n}.{name}.weight")
            if w is None or tuple(w.shape) != (inner, cross_dim):
                raise CheckpointError(
                    f"{where}: ip_adapter.{n}.{name}.weight has shape "
                    f"{None if w is None else tuple(w.shape)}; layer {'.'.join(path)} needs "
                    f"{(inner, cross_dim)}: the adapter is for another model")
            node[f"processor.{name}.0"] = {"kernel": np.ascontiguousarray(w.T)}
    params = {"image_encoder": enc_params, "image_proj": _cast_tree(proj_params, target),
              "layers": _cast_tree(layers, target)}
    tokens = module.tokens if kind == "basic" else (
        module.queries if kind == "plus" else c.num_positions)
    return IPAdapterWeights(kind, module, encoder, params, tokens, where, encoder_path)


def with_layers(unet_params: Mapping, layers: Mapping) -> dict:
    """The UNet's parameter tree with the adapter's layers merged in (a traced, free
    restructuring: no array is copied)."""
    out = dict(unet_params)
    for k, sub in layers.items():
        out[k] = with_layers(unet_params[k], sub) if k in unet_params else sub
    return out


def image_tokens(adapter: IPAdapterWeights, params: Mapping, pixels, cfg: bool):
    """(tokens, unconditional tokens or None) (B, T, D) for preprocessed images ``pixels``
    (B, S, S, 3) (:func:`maxdiff.models.clip_vision.preprocess`): traced."""
    enc = lambda px: adapter.encoder.apply({"params": params["image_encoder"]}, px,
                                           output_hidden_states=adapter.kind != "basic")
    project = lambda e: adapter.projection.apply({"params": params["image_proj"]}, e)
    if adapter.kind == "basic":
        embeds = enc(pixels).image_embeds
        return project(embeds), (project(jnp.zeros_like(embeds)) if cfg else None)
    states = enc(pixels).hidden_states[-2]
    uncond = None
    if cfg:
        # per row (a slice of one row would move rows between the devices of a sharded batch)
        uncond = project(enc(jnp.zeros_like(pixels)).hidden_states[-2])
    return project(states), uncond
