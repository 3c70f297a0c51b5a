"""diffusers' ``UNet2DConditionModel`` in Flax, for the SD-1.x, SD-2.x and SDXL families.

``UNet2DConditionModel(config)(sample, timesteps, encoder_hidden_states, text_embeds=,
time_ids=)``: sample (B, H, W, C_in) NHWC latents, timesteps () or (B,), text embeddings
(B, L, cross_attention_dim); for SDXL (``addition_embed_type="text_time"``) also the pooled
text embeddings (B, P) and the six size/crop ids (B, 6). Returns (B, H, W, C_out).

Submodules carry diffusers' names, so :func:`load_unet` fills the parameters straight from a
diffusers folder or a single-file UNet in diffusers key format (SDXL-Lightning's files).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from maxdiff import checkpoint
from maxdiff.models.attention import DEFAULT_CHUNK, KERNELS
from maxdiff.models.layers import Downsample2D, ResnetBlock2D, Upsample2D, conv, dense, group_norm
from maxdiff.models.transformer import Transformer2DModel

DOWN_BLOCKS = ("DownBlock2D", "CrossAttnDownBlock2D")
UP_BLOCKS = ("UpBlock2D", "CrossAttnUpBlock2D")
MID_BLOCKS = ("UNetMidBlock2DCrossAttn", None)

# Config keys diffusers writes whose value we support only at the given default.
_FIXED = {
    "dual_cross_attention": False,
    "class_embed_type": None,
    "num_class_embeds": None,
    "encoder_hid_dim": None,
    "encoder_hid_dim_type": None,
    "resnet_time_scale_shift": "default",
    "resnet_skip_time_act": False,
    "time_embedding_type": "positional",
    "time_embedding_act_fn": None,
    "timestep_post_act": None,
    "attention_type": "default",
    "class_embeddings_concat": False,
    "cross_attention_norm": None,
    "act_fn": "silu",
}
# Keys that do not change the maths.
_IGNORED = {"sample_size", "dropout", "upcast_attention", "addition_embed_type_num_heads",
            "_class_name", "_diffusers_version", "_name_or_path", "_use_default_values"}


@dataclass(frozen=True)
class EncoderConfig:
    """The config fields diffusers' ``UNet2DConditionModel`` and ``ControlNetModel`` share (the
    time embedding, ``conv_in``, down blocks and mid block), with diffusers' defaults.

    Subclasses name the model (``NAME``), the keys supported only at one value (``FIXED``),
    the keys that do not change the maths (``IGNORED``) and the mid blocks they build
    (``MID_BLOCKS``); they also provide ``conv_in_kernel``, ``time_embedding_dim``,
    ``time_cond_proj_dim`` and ``resnet_out_scale_factor`` (fields of the UNet, fixed in a
    ControlNet).
    """

    NAME: ClassVar[str] = "model"
    FIXED: ClassVar[dict] = {}
    IGNORED: ClassVar[set] = set()
    MID_BLOCKS: ClassVar[tuple] = MID_BLOCKS

    in_channels: int = 4
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    down_block_types: tuple = ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",)
    mid_block_type: str | None = "UNetMidBlock2DCrossAttn"
    only_cross_attention: Any = False
    block_out_channels: tuple = (320, 640, 1280, 1280)
    layers_per_block: Any = 2
    downsample_padding: int = 1
    mid_block_scale_factor: float = 1.0
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    cross_attention_dim: Any = 1280
    transformer_layers_per_block: Any = 1
    attention_head_dim: Any = 8
    num_attention_heads: Any = None
    use_linear_projection: bool = False
    addition_embed_type: str | None = None
    addition_time_embed_dim: int | None = None
    projection_class_embeddings_input_dim: int | None = None

    @classmethod
    def from_dict(cls, d: dict):
        """Build from a diffusers ``config.json`` dict; unsupported settings raise ``ValueError``
        naming the key."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {}
        for k, v in d.items():
            if k in fields:
                kw[k] = tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
            elif k in cls.FIXED:
                if v != cls.FIXED[k]:
                    raise ValueError(f"{cls.NAME} config: {k}={v!r} is not supported "
                                     f"(only {cls.FIXED[k]!r})")
            elif k not in cls.IGNORED and not k.startswith("_"):
                raise ValueError(f"{cls.NAME} config: unknown key {k!r}; maxdiff supports "
                                 f"{', '.join(sorted(fields | set(cls.FIXED)))}")
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def _check_block_types(self, field: str, allowed) -> None:
        """``field`` (down_block_types / up_block_types): one supported entry per block."""
        types, n = getattr(self, field), len(self.block_out_channels)
        if len(types) != n:
            raise ValueError(f"{self.NAME} config: {field} has {len(types)} entries, "
                             f"block_out_channels has {n}; they must match")
        for t in types:
            if t not in allowed:
                raise ValueError(f"{self.NAME} config: {field} entry {t!r} is not supported; "
                                 f"use {' or '.join(allowed)}")

    def validate(self) -> None:
        n = len(self.block_out_channels)
        self._check_block_types("down_block_types", DOWN_BLOCKS)
        if self.mid_block_type not in self.MID_BLOCKS:
            allowed = " or ".join("null" if m is None else repr(m) for m in self.MID_BLOCKS)
            raise ValueError(f"{self.NAME} config: mid_block_type={self.mid_block_type!r} is not "
                             f"supported; use {allowed}")
        if self.addition_embed_type not in (None, "text_time"):
            raise ValueError(f"{self.NAME} config: addition_embed_type={self.addition_embed_type!r} "
                             "is not supported; use 'text_time' (SDXL) or null")
        if self.addition_embed_type == "text_time" and (
                self.addition_time_embed_dim is None
                or self.projection_class_embeddings_input_dim is None):
            raise ValueError(f"{self.NAME} config: addition_embed_type='text_time' needs "
                             "addition_time_embed_dim and projection_class_embeddings_input_dim")
        for name in ("only_cross_attention", "layers_per_block", "cross_attention_dim",
                     "transformer_layers_per_block", "attention_head_dim", "num_attention_heads"):
            v = getattr(self, name)
            if isinstance(v, tuple) and len(v) != n:
                raise ValueError(f"{self.NAME} config: {name} has {len(v)} entries, expected {n} "
                                 "(one per block) or a single value")

    def per_block(self, name: str) -> tuple:
        v = getattr(self, name)
        return tuple(v) if isinstance(v, tuple) else (v,) * len(self.block_out_channels)

    @property
    def heads(self) -> tuple:
        """Attention heads per block: diffusers' ``attention_head_dim`` is really the head count
        (its naming quirk); ``num_attention_heads``, when given, takes precedence."""
        v = self.num_attention_heads if self.num_attention_heads is not None else self.attention_head_dim
        return tuple(v) if isinstance(v, tuple) else (v,) * len(self.block_out_channels)


@dataclass(frozen=True)
class UNetConfig(EncoderConfig):
    """The fields of diffusers' ``UNet2DConditionModel`` config that shape the network."""

    NAME: ClassVar[str] = "UNet"
    FIXED: ClassVar[dict] = _FIXED
    IGNORED: ClassVar[set] = _IGNORED

    out_channels: int = 4
    center_input_sample: bool = False
    up_block_types: tuple = ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3
    reverse_transformer_layers_per_block: Any = None
    resnet_out_scale_factor: float = 1.0
    time_embedding_dim: int | None = None
    time_cond_proj_dim: int | None = None
    conv_in_kernel: int = 3
    conv_out_kernel: int = 3
    mid_block_only_cross_attention: bool | None = None

    def validate(self) -> None:
        super().validate()
        self._check_block_types("up_block_types", UP_BLOCKS)


def timestep_embedding(t: jax.Array, dim: int, flip_sin_to_cos: bool, shift: float,
                       max_period: float = 10000.0) -> jax.Array:
    """Sinusoidal embedding of (B,) timesteps -> (B, dim), as diffusers' ``get_timestep_embedding``."""
    half = dim // 2
    exponent = -math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / (half - shift)
    args = t.astype(jnp.float32)[:, None] * jnp.exp(exponent)[None, :]
    emb = jnp.concatenate([jnp.sin(args), jnp.cos(args)], axis=-1)
    if flip_sin_to_cos:
        emb = jnp.concatenate([emb[:, half:], emb[:, :half]], axis=-1)
    if dim % 2:
        emb = jnp.pad(emb, ((0, 0), (0, 1)))
    return emb


class TimestepEmbedding(nn.Module):
    """``linear_1`` -> SiLU -> ``linear_2`` (with an optional ``cond_proj`` added to the input)."""

    dim: int
    cond_proj_dim: int | None = None
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, cond: jax.Array | None = None) -> jax.Array:
        if self.cond_proj_dim is not None and cond is not None:
            x = x + dense(x.shape[-1], "cond_proj", self.dtype, use_bias=False)(cond)
        x = dense(self.dim, "linear_1", self.dtype)(x)
        return dense(self.dim, "linear_2", self.dtype)(nn.silu(x))


@dataclass(frozen=True)
class _BlockSpec:
    in_ch: int
    out_ch: int
    prev_ch: int  # up blocks: channels coming from the block below
    layers: int
    cross: bool
    heads: int
    transformer_layers: tuple
    only_cross: bool
    resample: bool


class UNetEncoder(nn.Module):
    """The half of the UNet a ControlNet copies: the time (and SDXL size/crop + pooled text)
    embedding, ``conv_in``, the down blocks and the mid block, under diffusers' names.
    :class:`UNet2DConditionModel` and :class:`maxdiff.models.controlnet.ControlNetModel`
    build these pieces from here; ``config`` is an :class:`EncoderConfig`."""

    config: Any
    attention_kernel: str = "auto"
    attention_chunk: int = DEFAULT_CHUNK
    dtype: Any = jnp.float32

    def _transformer(self, ch, heads, layers, only_cross, name):
        c = self.config
        return Transformer2DModel(ch, heads, ch // heads, layers, c.norm_num_groups,
                                  c.use_linear_projection, only_cross, self.attention_kernel,
                                  self.attention_chunk, self.dtype, name=name)

    def _resnet(self, cin, cout, temb, name, scale=None):
        c = self.config
        return ResnetBlock2D(cin, cout, temb, c.norm_num_groups, c.norm_eps,
                             c.resnet_out_scale_factor if scale is None else scale, self.dtype,
                             name=name)

    @property
    def temb_dim(self) -> int:
        c = self.config
        return c.time_embedding_dim or c.block_out_channels[0] * 4

    def _embedding(self, batch: int, timesteps, text_embeds, time_ids, timestep_cond) -> jax.Array:
        """The (B, temb_dim) embedding of the timesteps (plus, for SDXL, of the pooled text
        embeddings and the six size/crop ids)."""
        c = self.config
        dt = self.dtype
        chans = c.block_out_channels
        t = jnp.broadcast_to(jnp.asarray(timesteps, jnp.float32).reshape(-1), (batch,))
        t_emb = timestep_embedding(t, chans[0], c.flip_sin_to_cos, c.freq_shift).astype(dt)
        emb = TimestepEmbedding(self.temb_dim, c.time_cond_proj_dim, dt, name="time_embedding")(
            t_emb, timestep_cond)
        if c.addition_embed_type == "text_time":
            if text_embeds is None or time_ids is None:
                raise ValueError(f"this {c.NAME} (addition_embed_type='text_time', SDXL) needs "
                                 "text_embeds and time_ids")
            tid = timestep_embedding(time_ids.reshape(-1), c.addition_time_embed_dim,
                                     c.flip_sin_to_cos, c.freq_shift).reshape(batch, -1)
            add = jnp.concatenate([text_embeds.astype(dt), tid.astype(dt)], axis=-1)
            emb = emb + TimestepEmbedding(self.temb_dim, dtype=dt, name="add_embedding")(add)
        return emb

    def _conv_in(self, sample: jax.Array) -> jax.Array:
        c = self.config
        return conv(c.block_out_channels[0], "conv_in", self.dtype, kernel=c.conv_in_kernel,
                    padding=(c.conv_in_kernel - 1) // 2)(sample)

    def _down(self, h: jax.Array, emb: jax.Array, context: jax.Array,
              stop: int | None = None) -> tuple[jax.Array, list]:
        """The down blocks: the lowest-resolution features and the skip connections
        (``conv_in``'s output, then every resnet/attention layer's and downsampler's).
        ``stop``: only the first ``stop`` layers of the first block (DeepCache's shallow
        branch)."""
        c = self.config
        chans = c.block_out_channels
        heads = c.heads
        layers = c.per_block("layers_per_block")
        tlayers = c.per_block("transformer_layers_per_block")
        only_cross = c.per_block("only_cross_attention")
        skips = [h]
        for i, btype in enumerate(c.down_block_types):
            cin = chans[i - 1] if i else chans[0]
            cout = chans[i]
            cross = btype == "CrossAttnDownBlock2D"
            tl = tlayers[i] if isinstance(tlayers[i], tuple) else (tlayers[i],) * layers[i]
            for j in range(layers[i]):
                h = self._resnet(cin if j == 0 else cout, cout, self.temb_dim,
                                 f"down_blocks.{i}.resnets.{j}")(h, emb)
                if cross:
                    h = self._transformer(cout, heads[i], tl[j], only_cross[i],
                                          f"down_blocks.{i}.attentions.{j}")(h, context)
                skips.append(h)
                if stop is not None and j + 1 == stop:
                    return h, skips
            if i < len(chans) - 1:
                h = Downsample2D(cout, c.downsample_padding, self.dtype,
                                 name=f"down_blocks.{i}.downsamplers.0")(h)
                skips.append(h)
        return h, skips

    def _mid(self, h: jax.Array, emb: jax.Array, context: jax.Array) -> jax.Array:
        """The mid block: resnet, transformer, resnet (``UNetMidBlock2DCrossAttn``), one resnet
        (``UNetMidBlock2D`` without attention, as a ControlNet builds it) or nothing."""
        c = self.config
        ch = c.block_out_channels[-1]
        scale = c.mid_block_scale_factor
        if c.mid_block_type == "UNetMidBlock2DCrossAttn":
            tl = c.per_block("transformer_layers_per_block")[-1]
            tl = tl[0] if isinstance(tl, tuple) else tl
            h = self._resnet(ch, ch, self.temb_dim, "mid_block.resnets.0", scale)(h, emb)
            h = self._transformer(ch, c.heads[-1], tl, False, "mid_block.attentions.0")(h, context)
            h = self._resnet(ch, ch, self.temb_dim, "mid_block.resnets.1", scale)(h, emb)
        elif c.mid_block_type == "UNetMidBlock2D":
            h = self._resnet(ch, ch, self.temb_dim, "mid_block.resnets.0", scale)(h, emb)
        return h

    def dummy_inputs(self, batch: int = 1, height: int = 8, width: int = 8, seq: int = 77):
        """Abstract inputs of the right shapes, for ``jax.eval_shape(model.init, ...)``."""
        c = self.config
        ctx_dim = c.per_block("cross_attention_dim")[0]
        args = dict(
            sample=jax.ShapeDtypeStruct((batch, height, width, c.in_channels), jnp.float32),
            timesteps=jax.ShapeDtypeStruct((batch,), jnp.float32),
            encoder_hidden_states=jax.ShapeDtypeStruct((batch, seq, ctx_dim), jnp.float32),
        )
        if c.addition_embed_type == "text_time":
            pooled = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
            args["text_embeds"] = jax.ShapeDtypeStruct((batch, pooled), jnp.float32)
            args["time_ids"] = jax.ShapeDtypeStruct((batch, 6), jnp.float32)
        if c.time_cond_proj_dim is not None:
            args["timestep_cond"] = jax.ShapeDtypeStruct((batch, c.time_cond_proj_dim), jnp.float32)
        return args


def _add_residuals(skips: list, mid: jax.Array, down_res, mid_res, dtype) -> tuple[list, jax.Array]:
    """ControlNet residuals added where diffusers' UNet adds them: one per skip connection,
    and one to the mid block's output."""
    if (down_res is None) != (mid_res is None):
        raise ValueError("down_block_additional_residuals and mid_block_additional_residual go "
                         "together (a ControlNet's two outputs): pass both or neither")
    if len(down_res) != len(skips):
        raise ValueError(f"down_block_additional_residuals has {len(down_res)} entries; this UNet "
                         f"has {len(skips)} skip connections (one residual each)")
    for i, (r, s) in enumerate(zip(down_res, skips)):
        _check_residual(f"down_block_additional_residuals[{i}]", r, s)
    _check_residual("mid_block_additional_residual", mid_res, mid)
    return ([s + r.astype(dtype) for s, r in zip(skips, down_res)], mid + mid_res.astype(dtype))


def _check_residual(name: str, r, features: jax.Array) -> None:
    try:
        fits = jnp.broadcast_shapes(jnp.shape(r), features.shape) == features.shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"{name} has shape {tuple(jnp.shape(r))}; the UNet's features there "
                         f"have shape {features.shape}")


class UNet2DConditionModel(UNetEncoder):
    """diffusers' ``UNet2DConditionModel``. ``down_block_additional_residuals`` (one array per
    skip connection) and ``mid_block_additional_residual``: a ControlNet's outputs, added to
    the skip connections and to the mid block's output as diffusers does; without them the
    program is the plain UNet's. ``image_context``: an IP-Adapter's
    :class:`maxdiff.ip_adapter.ImageContext` (its ``text`` is replaced by
    ``encoder_hidden_states``); the parameters then hold each cross-attention's
    ``processor.to_k_ip.0`` / ``to_v_ip.0`` (:func:`maxdiff.ip_adapter.with_layers`)."""

    config: UNetConfig

    @nn.compact
    def __call__(self, sample: jax.Array, timesteps: jax.Array, encoder_hidden_states: jax.Array,
                 text_embeds: jax.Array | None = None, time_ids: jax.Array | None = None,
                 timestep_cond: jax.Array | None = None,
                 down_block_additional_residuals: tuple | None = None,
                 mid_block_additional_residual: jax.Array | None = None,
                 image_context=None, deep_cache: jax.Array | None = None,
                 return_deep_cache: bool = False, cache_branch: int = 0):
        """The UNet's prediction. DeepCache (Ma et al. 2023, "DeepCache: Accelerating Diffusion
        Models for Free"): ``return_deep_cache`` also returns the features the last up block
        holds just before it takes the skip connection of the first down block's layer
        ``cache_branch`` (:meth:`deep_cache_shape`); given those as ``deep_cache`` (from an
        earlier step), only the shallow branch runs: ``conv_in``, the first down block's
        layers ``0..cache_branch`` and the last up block's layers that take their skip
        connections. At the same inputs the two ways give the same prediction."""
        c = self.config
        dt = self.dtype
        n_skip = self._branch_skips(cache_branch) if (
            deep_cache is not None or return_deep_cache) else None
        sample = sample.astype(dt)
        encoder_hidden_states = encoder_hidden_states.astype(dt)
        if image_context is not None:  # an IP-Adapter's tokens and scale (maxdiff.ip_adapter)
            encoder_hidden_states = image_context.replace(
                text=encoder_hidden_states, tokens=image_context.tokens.astype(dt))
        if c.center_input_sample:
            sample = 2 * sample - 1.0

        emb = self._embedding(sample.shape[0], timesteps, text_embeds, time_ids, timestep_cond)
        h = self._conv_in(sample)
        if deep_cache is not None:  # the shallow branch on cached deep features
            _, skips = self._down(h, emb, encoder_hidden_states, stop=cache_branch + 1)
            if down_block_additional_residuals is not None:  # those of the skips made here
                skips = [s + r.astype(dt) for s, r in zip(skips, down_block_additional_residuals)]
            h, _ = self._up(deep_cache.astype(dt), emb, encoder_hidden_states, skips, n_skip)
        else:
            h, skips = self._down(h, emb, encoder_hidden_states)
            h = self._mid(h, emb, encoder_hidden_states)
            if down_block_additional_residuals is not None or \
                    mid_block_additional_residual is not None:
                skips, h = _add_residuals(skips, h, down_block_additional_residuals,
                                          mid_block_additional_residual, dt)
            h, cached = self._up(h, emb, encoder_hidden_states, skips, None, n_skip)

        h = group_norm(c.norm_num_groups, c.norm_eps, "conv_norm_out", dt)(h)
        h = nn.silu(h)
        out = conv(c.out_channels, "conv_out", dt, kernel=c.conv_out_kernel,
                   padding=(c.conv_out_kernel - 1) // 2)(h)
        if return_deep_cache:
            return out, (deep_cache if deep_cache is not None else cached)
        return out

    def _branch_skips(self, branch: int) -> int:
        """The skip connections DeepCache's shallow branch makes (``conv_in``'s and the first
        down block's layers ``0..branch``); checks ``branch``."""
        lpb = self.config.per_block("layers_per_block")[0]
        if not isinstance(branch, int) or not 0 <= branch < lpb:
            raise ValueError(f"cache_branch={branch!r}: must be a layer of the first down block, "
                             f"0..{lpb - 1}")
        return branch + 2

    def _up(self, h, emb, context, skips: list, shallow: int | None = None,
            capture: int | None = None):
        """The up blocks on ``h`` taking ``skips`` (last first). ``shallow`` (DeepCache's
        branch): ``h`` is cached features and only the last ``shallow`` layers of the last up
        block run. ``capture``: also return ``h`` from just before the layer of the last up
        block that takes the ``capture``-th last skip connection (else None)."""
        c = self.config
        chans = c.block_out_channels
        n = len(chans)
        dt = self.dtype
        heads = c.heads
        layers = c.per_block("layers_per_block")
        tlayers = c.per_block("transformer_layers_per_block")
        only_cross = c.per_block("only_cross_attention")
        rchans = chans[::-1]
        rheads = heads[::-1]
        rlayers = layers[::-1]
        ronly = only_cross[::-1]
        if c.reverse_transformer_layers_per_block is not None:
            rtl = [tuple(x) if isinstance(x, (tuple, list)) else x
                   for x in c.reverse_transformer_layers_per_block]
        else:
            rtl = list(tlayers[::-1])
        cached = None
        for i, btype in enumerate(c.up_block_types):
            cout = rchans[i]
            cin = rchans[min(i + 1, n - 1)]
            nl = rlayers[i] + 1
            prev = rchans[i - 1] if i else rchans[0]
            if shallow is not None and i < n - 1:
                continue
            cross = btype == "CrossAttnUpBlock2D"
            tl = rtl[i] if isinstance(rtl[i], tuple) else (rtl[i],) * nl
            for j in range(nl):
                if i == n - 1 and shallow is not None and j < nl - shallow:
                    continue
                if i == n - 1 and capture is not None and j == nl - capture:
                    cached = h
                skip = skips.pop()
                h = jnp.concatenate([h, skip], axis=-1)
                h = self._resnet((prev if j == 0 else cout) + (cin if j == nl - 1 else cout), cout,
                                 self.temb_dim, f"up_blocks.{i}.resnets.{j}")(h, emb)
                if cross:
                    h = self._transformer(cout, rheads[i], tl[j], ronly[i],
                                          f"up_blocks.{i}.attentions.{j}")(h, context)
            if i < n - 1:
                size = skips[-1].shape[1:3]
                h = Upsample2D(cout, dt, name=f"up_blocks.{i}.upsamplers.0")(h, size)
        return h, cached


def param_shapes(model: UNetEncoder) -> dict:
    """The parameter tree's shapes (``jax.ShapeDtypeStruct`` leaves), without running init."""
    inputs = model.dummy_inputs()
    return checkpoint.init_shapes(model, **inputs)


def unet_module(config: dict, dtype: Any = "float32", attention_kernel: str = "auto",
                attention_chunk: int = DEFAULT_CHUNK) -> UNet2DConditionModel:
    """The UNet module of a diffusers ``config.json`` dict, computing in ``dtype`` (no weights)."""
    if attention_kernel not in KERNELS:
        raise ValueError(f"attention_kernel={attention_kernel!r}; use one of {', '.join(KERNELS)}")
    return UNet2DConditionModel(UNetConfig.from_dict(config), attention_kernel, attention_chunk,
                                jnp.dtype(checkpoint.resolve_dtype(dtype)))


def load_unet(path: str | os.PathLike, dtype: Any = "float32", *, config: dict | None = None,
              attention_kernel: str = "auto", attention_chunk: int = DEFAULT_CHUNK,
              put=None, variant: str | None = None, source=None
              ) -> tuple[UNet2DConditionModel, dict]:
    """Load a UNet from a diffusers ``unet/`` folder, or from ``source`` (weights already
    opened, e.g. a single file's UNet: :func:`maxdiff.loaders.load_unet` opens files) with
    ``config`` (the model's ``unet/config.json``). ``variant`` picks
    ``diffusion_pytorch_model.{variant}.safetensors`` in a folder.

    Returns ``(module, params)``; params are cast to ``dtype`` tensor by tensor.
    """
    path = Path(path)
    if config is None:
        if path.is_file():
            raise checkpoint.CheckpointError(
                f"{path}: a single-file UNet needs the config of the model it belongs to "
                "(pass config=, e.g. the base model's unet/config.json)")
        config = checkpoint.read_config(path)
    np_dtype = checkpoint.resolve_dtype(dtype)
    model = unet_module(config, dtype, attention_kernel, attention_chunk)
    if source is None:
        if path.is_file():
            raise checkpoint.CheckpointError(
                f"{path}: a single file; load it with maxdiff.loaders.load_unet, which reads "
                "its keys (diffusers or the original layout)")
        source = checkpoint.open_weights(path, variant)
    params = checkpoint.load_params(param_shapes(model), source, np_dtype, put=put)
    return model, params


def count_params(tree: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))
