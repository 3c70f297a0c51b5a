"""CLIP text encoders (transformers' ``CLIPTextModel`` / ``CLIPTextModelWithProjection``) in Flax.

SDXL conditions its UNet on two of these: ``text_encoder`` (CLIP ViT-L, ``CLIPTextModel``,
``quick_gelu``) and ``text_encoder_2`` (OpenCLIP bigG, ``CLIPTextModelWithProjection``,
``gelu``). Both are pre-norm causal transformers over 77 token ids::

    input_ids (B, L) int32
      -> token_embedding + position_embedding                     hidden_states[0]  (B, L, D)
      -> N x [x + attn(ln1(x)) ; x + mlp(ln2(x))]  (causal mask)  hidden_states[1..N]
      -> final_layer_norm                                          last_hidden_state (B, L, D)
      -> row at the end-of-text token                              pooler_output     (B, D)
      -> text_projection (no bias; projection model only)          text_embeds       (B, P)

Note that ``hidden_states[-1]`` is the last layer's output *before* ``final_layer_norm``, as
in transformers; SDXL uses ``hidden_states[-2]``.

Parameters follow the shared naming convention of :mod:`maxdiff.checkpoint`: the Flax path
``("text_model", "encoder", "layers.0", "self_attn", "q_proj", "kernel")`` is the PyTorch key
``text_model.encoder.layers.0.self_attn.q_proj.weight``. transformers 5 saves a plain
``CLIPTextModel`` without the ``text_model.`` prefix; :func:`load_text_encoder` reads both.

Matrix products run in the module's ``dtype``; layer norms and the attention softmax run in
float32. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from maxdiff import checkpoint
from maxdiff.models.params import Dense, Embed, LayerNorm

__all__ = [
    "CLIPTextConfig",
    "CLIPTextOutput",
    "CLIPTextModel",
    "CLIPTextModelWithProjection",
    "ARCHITECTURES",
    "load_text_encoder",
]

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # exact (erf), as torch's default
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),  # tanh approximation
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}

# Keys a transformers config.json may carry that do not change the text encoder's maths:
# generic PretrainedConfig fields (generation settings, labels, bookkeeping), training-only
# dropout and init scales, and the storage dtype (the loader's ``dtype`` decides ours).
_IGNORED_KEYS = frozenset("""
    architectures model_type transformers_version dtype torch_dtype use_bfloat16
    attention_dropout dropout initializer_range initializer_factor gradient_checkpointing
    bos_token_id pad_token_id sep_token_id decoder_start_token_id
    return_dict output_hidden_states output_attentions torchscript tf_legacy_loss pruned_heads
    tie_word_embeddings chunk_size_feed_forward is_encoder_decoder is_decoder
    cross_attention_hidden_size add_cross_attention tie_encoder_decoder use_cache
    max_length min_length do_sample early_stopping num_beams num_beam_groups diversity_penalty
    temperature top_k top_p typical_p repetition_penalty length_penalty no_repeat_ngram_size
    encoder_no_repeat_ngram_size bad_words_ids num_return_sequences output_scores
    return_dict_in_generate forced_bos_token_id forced_eos_token_id remove_invalid_values
    exponential_decay_length_penalty suppress_tokens begin_suppress_tokens
    finetuning_task id2label label2id num_labels tokenizer_class prefix task_specific_params
    problem_type
""".split())


@dataclass(frozen=True)
class CLIPTextConfig:
    """The fields of transformers' ``CLIPTextConfig`` that shape the computation.

    Defaults are transformers' (CLIP ViT-B/32), so a ``config.json`` that omits a key means
    the same thing here as there.
    """

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    projection_dim: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    eos_token_id: int = 49407
    architectures: tuple[str, ...] = ()

    def __post_init__(self):
        check_tower_config(self, ("vocab_size", "max_position_embeddings"))
        if not isinstance(self.eos_token_id, int) or isinstance(self.eos_token_id, bool):
            raise ValueError(
                f"CLIPTextConfig.eos_token_id={self.eos_token_id!r}: expected one integer "
                "(the end-of-text token id the pooled output is read at)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def legacy_pooling(self) -> bool:
        """transformers' rule: ``eos_token_id == 2`` (configs older than transformers PR
        #24773, e.g. SDXL's ``text_encoder``) pools at ``argmax(input_ids)``; otherwise at
        the first ``eos_token_id``."""
        return self.eos_token_id == 2

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CLIPTextConfig:
        """Build from a transformers ``config.json`` dict; unknown keys raise ValueError."""
        return config_from_dict(cls, d, "clip_text_model", "text")


TOWER_INTS = ("hidden_size", "intermediate_size", "projection_dim", "num_hidden_layers",
              "num_attention_heads")


def check_tower_config(config, more_ints: tuple[str, ...] = ()) -> None:
    """The checks a CLIP tower's config (text or vision) shares: positive sizes, a known
    activation, heads that divide the width, a positive layer-norm epsilon."""
    name = type(config).__name__
    for f in (*TOWER_INTS, *more_ints):
        v = getattr(config, f)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name}.{f}={v!r}: expected a positive integer")
    if config.hidden_act not in _ACTIVATIONS:
        raise ValueError(f"{name}.hidden_act={config.hidden_act!r} is not supported; use one "
                         f"of {', '.join(sorted(_ACTIVATIONS))}")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(f"{name}.hidden_size={config.hidden_size} is not a multiple of "
                         f"num_attention_heads={config.num_attention_heads}")
    if not isinstance(config.layer_norm_eps, (int, float)) or config.layer_norm_eps <= 0:
        raise ValueError(f"{name}.layer_norm_eps={config.layer_norm_eps!r}: expected a "
                         "positive number")


def config_from_dict(cls, d: Mapping[str, Any], model_type: str, what: str):
    """A CLIP tower's config dataclass ``cls`` from a transformers ``config.json`` dict of
    ``model_type``; another model type or an unknown key raises ValueError."""
    d = dict(d)
    got = d.get("model_type", model_type)
    if got != model_type:
        hint = (f" (a full CLIP model config: point at a {what} encoder folder instead)"
                if f"{what}_config" in d else "")
        raise ValueError(f"model_type={got!r} is not a CLIP {what} encoder; expected "
                         f"{model_type!r}{hint}")
    fields = {f.name for f in dataclasses.fields(cls)} - {"architectures"}
    unknown = sorted(k for k in d if k not in fields and k not in _IGNORED_KEYS
                     and not k.startswith("_"))
    if unknown:
        raise ValueError(f"CLIP {what} config key(s) {', '.join(map(repr, unknown))} are not "
                         "supported: maxdiff does not know whether they change the model; "
                         "remove them from config.json if they do not")
    kw = {k: d[k] for k in fields if k in d and d[k] is not None}
    return cls(architectures=tuple(d.get("architectures") or ()), **kw)


@flax.struct.dataclass
class CLIPTextOutput:
    """What the text encoders return (a pytree, so it can leave a jitted function).

    ``last_hidden_state`` (B, L, D) after the final layer norm; ``pooler_output`` (B, D)
    its row at the end-of-text token; ``hidden_states`` a tuple of N + 1 arrays (B, L, D)
    (embeddings, then each layer's output; None unless asked for); ``text_embeds`` (B, P)
    only from :class:`CLIPTextModelWithProjection`.
    """

    last_hidden_state: jax.Array
    pooler_output: jax.Array
    hidden_states: tuple[jax.Array, ...] | None = None
    text_embeds: jax.Array | None = None


def _layer_norm(x: jax.Array, eps: float, name: str) -> jax.Array:
    """torch.nn.LayerNorm over the last axis, computed in float32, returned in x's dtype."""
    ln = LayerNorm(epsilon=eps, dtype=jnp.float32, param_dtype=jnp.float32,
                   use_fast_variance=False, name=name)
    return ln(x.astype(jnp.float32)).astype(x.dtype)


class CLIPAttention(nn.Module):
    """Multi-head self-attention; x (B, L, D), bias (B or 1, 1, L, L) float32 additive."""

    config: CLIPTextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        c = self.config
        b, n, _ = x.shape

        def proj(name):
            y = Dense(c.hidden_size, dtype=self.dtype, name=name)(x)
            return y.reshape(b, n, c.num_attention_heads, c.head_dim)

        q, k, v = proj("q_proj"), proj("k_proj"), proj("v_proj")
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        scores = scores * (c.head_dim ** -0.5) + bias
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, c.hidden_size)
        return Dense(c.hidden_size, dtype=self.dtype, name="out_proj")(out)


class CLIPMLP(nn.Module):
    config: CLIPTextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        h = Dense(c.intermediate_size, dtype=self.dtype, name="fc1")(x)
        h = _ACTIVATIONS[c.hidden_act](h)
        return Dense(c.hidden_size, dtype=self.dtype, name="fc2")(h)


class CLIPEncoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    config: CLIPTextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        eps = self.config.layer_norm_eps
        x = x + CLIPAttention(self.config, self.dtype, name="self_attn")(
            _layer_norm(x, eps, "layer_norm1"), bias)
        return x + CLIPMLP(self.config, self.dtype, name="mlp")(_layer_norm(x, eps, "layer_norm2"))


class CLIPTextEmbeddings(nn.Module):
    config: CLIPTextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array) -> jax.Array:
        c = self.config
        tok = Embed(c.vocab_size, c.hidden_size, dtype=self.dtype, name="token_embedding")
        pos = Embed(c.max_position_embeddings, c.hidden_size, dtype=self.dtype,
                    name="position_embedding")
        return tok(input_ids) + pos(jnp.arange(input_ids.shape[-1]))[None]


class CLIPEncoder(nn.Module):
    config: CLIPTextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, bias: jax.Array) -> tuple[jax.Array, ...]:
        """Returns the input followed by every layer's output."""
        states = [x]
        for i in range(self.config.num_hidden_layers):
            x = CLIPEncoderLayer(self.config, self.dtype, name=f"layers.{i}")(x, bias)
            states.append(x)
        return tuple(states)


def _attention_bias(n: int, attention_mask: jax.Array | None) -> jax.Array:
    """Causal (and optional key padding) mask as a float32 additive bias (B|1, 1, n, n)."""
    allowed = jnp.tril(jnp.ones((n, n), bool))[None, None]
    if attention_mask is not None:
        allowed = allowed & (attention_mask[:, None, None, :] != 0)
    return jnp.where(allowed, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)


class CLIPTextTransformer(nn.Module):
    """The body both classes share (``text_model`` in the checkpoint)."""

    config: CLIPTextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                 output_hidden_states: bool = True) -> CLIPTextOutput:
        c = self.config
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be (batch, length), got shape {input_ids.shape}")
        n = input_ids.shape[-1]
        if n > c.max_position_embeddings:
            raise ValueError(f"input_ids has {n} tokens; this text encoder takes at most "
                             f"{c.max_position_embeddings} (tokenize with truncation)")
        x = CLIPTextEmbeddings(c, self.dtype, name="embeddings")(input_ids)
        states = CLIPEncoder(c, self.dtype, name="encoder")(x, _attention_bias(n, attention_mask))
        last = _layer_norm(states[-1], c.layer_norm_eps, "final_layer_norm")
        if c.legacy_pooling:
            eot = jnp.argmax(input_ids, axis=-1)
        else:
            eot = jnp.argmax((input_ids == c.eos_token_id).astype(jnp.int32), axis=-1)
        pooled = jnp.take_along_axis(last, eot[:, None, None], axis=1)[:, 0]
        return CLIPTextOutput(last_hidden_state=last, pooler_output=pooled,
                              hidden_states=states if output_hidden_states else None)


class CLIPTextModel(nn.Module):
    """transformers' ``CLIPTextModel``: ``(input_ids (B, L) int32) -> CLIPTextOutput``.

    ``attention_mask`` (B, L), optional, masks padded keys on top of the causal mask (SDXL
    passes none).
    """

    config: CLIPTextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                 output_hidden_states: bool = True) -> CLIPTextOutput:
        return CLIPTextTransformer(self.config, self.dtype, name="text_model")(
            input_ids, attention_mask, output_hidden_states)


class CLIPTextModelWithProjection(nn.Module):
    """transformers' ``CLIPTextModelWithProjection``: adds ``text_embeds`` (B, projection_dim)."""

    config: CLIPTextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                 output_hidden_states: bool = True) -> CLIPTextOutput:
        out = CLIPTextTransformer(self.config, self.dtype, name="text_model")(
            input_ids, attention_mask, output_hidden_states)
        embeds = Dense(self.config.projection_dim, use_bias=False, dtype=self.dtype,
                       name="text_projection")(out.pooler_output)
        return out.replace(text_embeds=embeds)


ARCHITECTURES = {
    "CLIPTextModel": CLIPTextModel,
    "CLIPTextModelWithProjection": CLIPTextModelWithProjection,
}


def param_shapes(module: nn.Module) -> dict:
    """The parameter tree's shapes (``jax.ShapeDtypeStruct`` leaves) of a CLIP text encoder,
    without running init (as :func:`maxdiff.models.unet.param_shapes`)."""
    ids = jax.ShapeDtypeStruct((1, module.config.max_position_embeddings), jnp.int32)
    return checkpoint.init_shapes(module, ids)


def load_text_encoder(
    folder: str | os.PathLike,
    dtype: Any = "float32",
    *,
    architecture: str | None = None,
    variant: str | None = None,
    config: Mapping | None = None,
    source: Any = None,
) -> tuple[nn.Module, dict]:
    """Load a transformers CLIP text encoder folder (``config.json`` + safetensors).

    The class is ``architecture`` if given, else the config's ``architectures``, else
    ``CLIPTextModelWithProjection`` when the weights hold ``text_projection.weight``.
    Returns ``(module, params)``; call ``module.apply({"params": params}, input_ids)``.
    Parameters are stored in ``dtype`` and the module computes in it (norms and softmax in
    float32). ``config`` / ``source``: the config dict and opened weights instead of the
    folder's (a text encoder inside a single file, :mod:`maxdiff.single_file`). A config
    that does not match the weights raises :class:`maxdiff.checkpoint.CheckpointError`
    naming the key.
    """
    target = checkpoint.resolve_dtype(dtype)
    raw = dict(config) if config is not None else checkpoint.read_config(folder)
    try:
        config = CLIPTextConfig.from_dict(raw)
    except ValueError as e:
        raise ValueError(f"{os.fspath(folder)}/config.json: {e}") from None
    if source is None:
        source = checkpoint.open_weights(folder, variant)

    if architecture is None:
        known = [a for a in config.architectures if a in ARCHITECTURES]
        if known:
            architecture = known[0]
        elif config.architectures:
            raise ValueError(
                f"{os.fspath(folder)}/config.json: architectures={list(config.architectures)} "
                f"names no supported text encoder ({', '.join(ARCHITECTURES)}); pass "
                "architecture= to choose one"
            )
        else:
            keys = set(source.keys())
            architecture = ("CLIPTextModelWithProjection" if "text_projection.weight" in keys
                            else "CLIPTextModel")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture={architecture!r} is not supported; use one of "
                         f"{', '.join(ARCHITECTURES)}")

    module = ARCHITECTURES[architecture](config, dtype=jnp.dtype(target))
    shapes = param_shapes(module)
    ignore = ("position_ids",)
    keys = set(source.keys())
    bare = ("text_model.embeddings.token_embedding.weight" not in keys
            and "embeddings.token_embedding.weight" in keys)
    if architecture == "CLIPTextModel" and bare:
        # transformers >= 5 saves CLIPTextModel without the "text_model." prefix.
        params = {"text_model": checkpoint.load_params(shapes["text_model"], source, target,
                                                       ignore_unexpected=ignore)}
    else:
        params = checkpoint.load_params(shapes, source, target, ignore_unexpected=ignore)
    return module, params
