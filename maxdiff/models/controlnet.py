"""diffusers' ``ControlNetModel`` in Flax, for the SD-1.x, SD-2.x and SDXL families.

A ControlNet is a trainable copy of the UNet's first half (time embedding, ``conv_in``, down
blocks, mid block, built here by the same code as the UNet's: :class:`maxdiff.models.unet.UNetEncoder`)
that also reads a conditioning image through a small convolutional encoder
(``controlnet_cond_embedding``), and turns every skip connection and the mid block's output
into a residual for the UNet through a 1x1 "zero" convolution.

``ControlNetModel(config)(sample, timesteps, encoder_hidden_states, controlnet_cond,
conditioning_scale=1.0, text_embeds=, time_ids=, guess_mode=False)``: NHWC like the UNet:
sample (B, H, W, C_in) latents, controlnet_cond (B, f*H, f*W, conditioning_channels) the
conditioning image (``f = 2 ** (len(conditioning_embedding_out_channels) - 1)``, 8 for the
released models), in RGB order (the config's ``controlnet_conditioning_channel_order="bgr"``
flips it, as diffusers does). Returns ``(down_block_res_samples, mid_block_res_sample)``: a
tuple of one (B, h, w, C) array per UNet skip connection, and the mid block's; pass them to
:class:`maxdiff.models.unet.UNet2DConditionModel` as ``down_block_additional_residuals`` and
``mid_block_additional_residual``.

``conditioning_scale`` and ``guess_mode`` are traced inputs (one compiled program serves
every value): scalars, or one value per batch row (B,).
"""

from __future__ import annotations

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
from maxdiff.models.layers import conv
from maxdiff.models.unet import EncoderConfig, UNetEncoder, param_shapes

__all__ = ["ControlNetConfig", "ControlNetModel", "ControlNetConditioningEmbedding",
           "load_controlnet", "param_shapes"]

CHANNEL_ORDERS = ("rgb", "bgr")


@dataclass(frozen=True)
class ControlNetConfig(EncoderConfig):
    """The fields of diffusers' ``ControlNetModel`` config, with diffusers' defaults (the
    shared UNet fields are :class:`maxdiff.models.unet.EncoderConfig`'s)."""

    NAME: ClassVar[str] = "ControlNet"
    FIXED: ClassVar[dict] = {
        "act_fn": "silu",
        "class_embed_type": None,
        "num_class_embeds": None,
        "encoder_hid_dim": None,
        "encoder_hid_dim_type": None,
        "resnet_time_scale_shift": "default",
    }
    # keys that do not change the maths (some published configs carry the UNet's sample_size)
    IGNORED: ClassVar[set] = {"upcast_attention", "addition_embed_type_num_heads", "sample_size",
                              "dropout"}
    MID_BLOCKS: ClassVar[tuple] = ("UNetMidBlock2DCrossAttn", "UNetMidBlock2D")
    # UNet settings a ControlNet does not have (diffusers builds it with these values)
    conv_in_kernel: ClassVar[int] = 3
    time_embedding_dim: ClassVar[None] = None
    time_cond_proj_dim: ClassVar[None] = None
    resnet_out_scale_factor: ClassVar[float] = 1.0

    conditioning_channels: int = 3
    controlnet_conditioning_channel_order: str = "rgb"
    conditioning_embedding_out_channels: tuple = (16, 32, 96, 256)
    global_pool_conditions: bool = False

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.layers_per_block, int):
            raise ValueError(f"ControlNet config: layers_per_block={self.layers_per_block!r}; a "
                             "ControlNet takes one number for every block")
        if self.controlnet_conditioning_channel_order not in CHANNEL_ORDERS:
            raise ValueError("ControlNet config: controlnet_conditioning_channel_order="
                             f"{self.controlnet_conditioning_channel_order!r}; use 'rgb' or 'bgr'")
        ch = self.conditioning_embedding_out_channels
        if not isinstance(ch, tuple) or not ch or not all(isinstance(x, int) and x > 0 for x in ch):
            raise ValueError(f"ControlNet config: conditioning_embedding_out_channels={ch!r}; use a "
                             "list of one or more positive channel counts, e.g. [16, 32, 96, 256]")
        if not isinstance(self.conditioning_channels, int) or self.conditioning_channels < 1:
            raise ValueError(f"ControlNet config: conditioning_channels={self.conditioning_channels!r}; "
                             "use a positive number (3 for an RGB image)")

    @property
    def conditioning_factor(self) -> int:
        """How many times larger than the latents the conditioning image is (8 when released)."""
        return 2 ** (len(self.conditioning_embedding_out_channels) - 1)


class ControlNetConditioningEmbedding(nn.Module):
    """The conditioning image's encoder: ``conv_in``, then per step a 3x3 convolution and a
    strided one (``blocks.{2i}``, ``blocks.{2i+1}``), SiLU after each, and ``conv_out``."""

    out_channels: int
    block_out_channels: tuple = (16, 32, 96, 256)
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        ch = self.block_out_channels
        x = nn.silu(conv(ch[0], "conv_in", self.dtype)(x))
        for i in range(len(ch) - 1):
            x = nn.silu(conv(ch[i], f"blocks.{2 * i}", self.dtype)(x))
            x = nn.silu(conv(ch[i + 1], f"blocks.{2 * i + 1}", self.dtype, stride=2)(x))
        return conv(self.out_channels, "conv_out", self.dtype)(x)


def _per_row(value: Any, dtype: Any) -> jax.Array:
    """A scalar or a (B,) array as a (1, 1) or (B, 1) array, for per-row scaling."""
    v = jnp.asarray(value, dtype)
    if v.ndim > 1:
        raise ValueError(f"expected a scalar or one value per batch row, got shape {v.shape}")
    return v.reshape(-1, 1)


class ControlNetModel(UNetEncoder):
    """diffusers' ``ControlNetModel`` (see the module's docstring for the inputs and outputs)."""

    config: ControlNetConfig

    @nn.compact
    def __call__(self, sample: jax.Array, timesteps: jax.Array, encoder_hidden_states: jax.Array,
                 controlnet_cond: jax.Array, conditioning_scale: Any = 1.0,
                 text_embeds: jax.Array | None = None, time_ids: jax.Array | None = None,
                 guess_mode: Any = False) -> tuple[tuple[jax.Array, ...], jax.Array]:
        c = self.config
        dt = self.dtype
        sample = sample.astype(dt)
        context = encoder_hidden_states.astype(dt)
        cond = controlnet_cond.astype(dt)
        if cond.ndim != 4 or cond.shape[-1] != c.conditioning_channels:
            raise ValueError(f"controlnet_cond has shape {cond.shape}; this ControlNet takes "
                             f"(B, H, W, {c.conditioning_channels}) images (NHWC)")
        if c.controlnet_conditioning_channel_order == "bgr":
            cond = cond[..., ::-1]

        emb = self._embedding(sample.shape[0], timesteps, text_embeds, time_ids, None)
        h = self._conv_in(sample)
        hint = ControlNetConditioningEmbedding(c.block_out_channels[0],
                                               c.conditioning_embedding_out_channels, dt,
                                               name="controlnet_cond_embedding")(cond)
        if hint.shape[1:] != h.shape[1:] or hint.shape[0] not in (1, h.shape[0]):
            f = c.conditioning_factor
            raise ValueError(
                f"controlnet_cond has shape {controlnet_cond.shape}; for latents of shape "
                f"{sample.shape} this ControlNet needs ({h.shape[0]}, {f * h.shape[1]}, "
                f"{f * h.shape[2]}, {c.conditioning_channels}): the image is {f}x the latents")
        h = h + hint
        h, skips = self._down(h, emb, context)
        h = self._mid(h, emb, context)

        down = [conv(s.shape[-1], f"controlnet_down_blocks.{i}", dt, kernel=1, padding=0)(s)
                for i, s in enumerate(skips)]
        mid = conv(h.shape[-1], "controlnet_mid_block", dt, kernel=1, padding=0)(h)

        # scaling: guess mode weights the residuals from 0.1 (first) to 1.0 (mid), log-spaced
        n = len(down)
        scale = _per_row(conditioning_scale, jnp.float32)
        if c.global_pool_conditions:
            scales = jnp.broadcast_to(scale, (scale.shape[0], n + 1))
        else:
            ramp = jnp.asarray(np.logspace(-1.0, 0.0, n + 1, dtype=np.float32))[None, :]
            scales = jnp.where(_per_row(guess_mode, bool), ramp, 1.0) * scale
        rows = scales[:, :, None, None, None].astype(dt)  # (1 | B, n + 1, 1, 1, 1)
        down = [r * rows[:, i] for i, r in enumerate(down)]
        mid = mid * rows[:, n]
        if c.global_pool_conditions:
            down = [jnp.mean(r, axis=(1, 2), keepdims=True) for r in down]
            mid = jnp.mean(mid, axis=(1, 2), keepdims=True)
        return tuple(down), mid

    def dummy_inputs(self, batch: int = 1, height: int = 8, width: int = 8, seq: int = 77):
        """Abstract inputs of the right shapes, for ``jax.eval_shape(model.init, ...)``."""
        c = self.config
        f = c.conditioning_factor
        args = super().dummy_inputs(batch, height, width, seq)
        args["controlnet_cond"] = jax.ShapeDtypeStruct(
            (batch, f * height, f * width, c.conditioning_channels), jnp.float32)
        return args


def load_controlnet(path: str | os.PathLike, dtype: Any = "float32", *, config: dict | None = None,
                    source: checkpoint.WeightSource | None = None,
                    attention_kernel: str = "auto", attention_chunk: int = DEFAULT_CHUNK,
                    put=None, variant: str | None = None) -> tuple[ControlNetModel, dict]:
    """Load a ControlNet from a diffusers folder (``config.json`` and
    ``diffusion_pytorch_model[.fp16].safetensors``, single or sharded; ``variant`` picks one),
    or from an opened weight ``source`` with its diffusers ``config`` (single files:
    :func:`maxdiff.loaders.load_controlnet`). Returns ``(module, params)``; params are cast to
    ``dtype`` tensor by tensor."""
    path = Path(path)
    config = checkpoint.read_config(path) if config is None else config
    if attention_kernel not in KERNELS:
        raise ValueError(f"attention_kernel={attention_kernel!r}; use one of {', '.join(KERNELS)}")
    cfg = ControlNetConfig.from_dict(config)
    np_dtype = checkpoint.resolve_dtype(dtype)
    model = ControlNetModel(cfg, attention_kernel, attention_chunk, jnp.dtype(np_dtype))
    source = checkpoint.open_weights(path, variant) if source is None else source
    params = checkpoint.load_params(param_shapes(model), source, np_dtype, put=put)
    return model, params
