"""int8 / fp8 inference through Google's qwix (post-training quantization, PTQ).

One setting, ``quantization``:

- ``"none"``: the model runs in the pipeline's dtype (float32 / bfloat16 / float16).
- ``"int8-weights"``: the quantized layers keep their weights as int8 (symmetric, one scale per
  output channel, absmax); activations stay in the pipeline's dtype. XLA dequantises the
  weights and runs the matmul in floating point (qwix's "slow path", which XLA fuses): the gain
  is memory (a quarter of float32's bytes, half of bfloat16's), not arithmetic.
- ``"int8"``: int8 weights as above and int8 activations, quantized on the fly (dynamic range,
  one scale per token); the matmul is an int8 x int8 dot accumulating in int32, rescaled to the
  pipeline's dtype afterwards (the MXU / tensor-core path on accelerators).
- ``"fp8"``: the same with float8 e4m3 weights and activations, a float8 x float8 dot. On the
  CPU, XLA upcasts both operands to float32 before the dot (checked in
  ``tests/test_quantization.py``): fp8 runs *emulated* there, with fp8's numbers and no speed,
  and is allowed so that it can be tested anywhere. GPUs with fp8 matmuls (H100 / H200) are
  meant to run it natively; that, and what TPUs without an fp8 unit do, is not checked yet.

What is quantized (:data:`UNET_LAYERS`): the UNet's transformer linear layers (every
``nn.Dense`` inside a ``Transformer2DModel``: ``proj_in`` / ``proj_out`` when linear, the
attention projections ``to_q/to_k/to_v/to_out.0`` and the feed-forward ``ff.net.0.proj`` /
``ff.net.2``). They hold most of an SDXL UNet's matmul work and weights. What stays in the
pipeline's dtype, and why:

- every convolution (``conv_in``, ``conv_out``, the ResNet and resampler convolutions, SD 1.x /
  2.x's 1x1 ``proj_in``/``proj_out``): qwix quantizes a convolution only with weights *and*
  activations of one type (no weight-only convolution), the first and last convolutions are the
  layers most sensitive to precision, and the CPU's Winograd convolutions
  (:mod:`maxdiff.models.conv`) are float32 algorithms. MaxDiffusion's ``quantization: int8``
  likewise quantizes the Dense layers only.
- the time embedding (``time_embedding``, ``add_embedding``) and each ResNet's
  ``time_emb_proj``: a few (batch, 1280) rows, no measurable work, and an error there shifts
  every feature of the block.
- GroupNorm / LayerNorm, the attention scores, softmax and the attention-weighted sum: not
  weight matmuls (the rules name the Dense modules only, so the attention module's own einsums
  are never intercepted).
- the text encoders and the VAE: they run once per image, not once per step; they keep the
  pipeline's dtype in this first step (issue #29).

The quantized weights are computed from the float weights at load (:func:`quantize`), tensor
by tensor; the float UNet weights are dropped once quantized. LoRA adapters (fused or per
request) are refused on a quantized pipeline (:func:`lora_problem`): fusing needs the float
weights and would keep both copies.

qwix is imported only when a quantization other than ``"none"`` is asked for, and JAX only
by the functions that need it (the configs import :data:`Quantization` without JAX).
"""

from __future__ import annotations

import sys
from typing import Any, Literal


MODES = ("none", "int8-weights", "int8", "fp8")
Quantization = Literal["none", "int8-weights", "int8", "fp8"]

# mode -> (weight qtype, activation qtype); "none" has no entry
QTYPES = {
    "int8-weights": ("int8", None),
    "int8": ("int8", "int8"),
    "fp8": ("float8_e4m3fn", "float8_e4m3fn"),
}

# the Dense layers of the UNet's transformers, by module path ("down_blocks.1.attentions.0/
# transformer_blocks.0/attn1/to_q"); the rule's op_names limit it to their dot_general, so a
# 1x1-convolution proj_in (SD 1.x) stays float
UNET_LAYERS = (r"(.*/)?((down|up)_blocks\.\d+|mid_block)\.attentions\.\d+/(.*/)?"
               r"(proj_in|proj_out|to_q|to_k|to_v|to_out\.0|net\.0\.proj|net\.2)")


def check_quantization(value: Any, field: str = "quantization") -> str:
    """``value`` if it is one of :data:`MODES`, else ValueError naming ``field`` and the
    allowed values."""
    if not isinstance(value, str) or value not in MODES:
        raise ValueError(f"{field}={value!r}; allowed: {', '.join(MODES)}")
    return value


def lora_problem(quantization: str, what: str = "LoRA adapters") -> str | None:
    """Why ``what`` cannot go with ``quantization`` (None: they can)."""
    if quantization == "none":
        return None
    return (f"{what} are not supported with quantization={quantization!r}: a LoRA adapter "
            "changes the float weights that the quantized weights were computed from; use "
            "quantization='none' with LoRA adapters")


def _qwix(mode: str):
    try:
        import qwix
    except ImportError:
        raise ImportError(f"quantization={mode!r} needs qwix: pip install 'maxdiff[quant]' "
                          "(or qwix>=0.1.8)") from None
    return qwix


def rules(mode: str) -> list:
    """The qwix PTQ rules of ``mode`` (none for ``"none"``)."""
    check_quantization(mode)
    if mode == "none":
        return []
    qwix = _qwix(mode)

    weight, act = QTYPES[mode]
    return [qwix.QuantizationRule(module_path=UNET_LAYERS, op_names=("dot_general",),
                                  weight_qtype=weight, act_qtype=act)]


def quantize(model, params: dict, mode: str, *, example_inputs: dict | None = None
             ) -> tuple[Any, dict]:
    """(the module the pipeline applies, its parameters) for ``mode``.

    ``model``: a Flax linen module (the UNet); ``params``: its float parameters (the
    ``"params"`` collection, unboxed). ``"none"`` returns both unchanged. Otherwise the module
    is qwix's PTQ copy of ``model`` (same fields and config; ``apply`` runs the quantized ops)
    and the parameters are ``params`` with every quantized layer's ``kernel`` replaced by
    qwix's quantized array (int8 or float8 values and float scales); biases and every other
    layer keep their arrays. ``example_inputs``: abstract inputs for tracing the module once
    (default: ``model.dummy_inputs()``). ValueError if no layer matched the rules (a model
    that would silently run unquantized)."""
    check_quantization(mode)
    if mode == "none":
        return model, params
    import jax

    qwix = _qwix(mode)
    provider = qwix.PtqProvider(rules(mode))
    qmodel = qwix.quantize_model(model, provider)
    inputs = example_inputs if example_inputs is not None else model.dummy_inputs()
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), **inputs)["params"]
    if not quantized_layers(abstract):
        raise ValueError(f"quantization={mode!r}: no layer of this {type(model).__name__} "
                         "matches the rules (no transformer linear layers); use "
                         "quantization='none'")
    return qmodel, qwix.quantize_params(params, abstract)


def _is_quantized(x) -> bool:
    """A qwix quantized weight (only possible once qwix is imported, by :func:`quantize`)."""
    ptq = sys.modules.get("qwix._src.providers.ptq")
    return ptq is not None and isinstance(x, ptq.WithAux)


def quantized_layers(params: dict) -> list[str]:
    """The paths ("a/b/kernel") of the quantized weights in a parameter tree (quantized or
    abstract); empty for a float tree."""
    import jax

    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_quantized)[0]
    return ["/".join(str(getattr(k, "key", k)) for k in path) for path, leaf in flat
            if _is_quantized(leaf)]


def weights(params: Any) -> list:
    """One leaf per weight of a parameter tree (quantized or not), with the ``shape`` and
    ``dtype`` it is stored in: a quantized weight is its int8 / float8 values (its scales are not
    counted as weights)."""
    import jax

    return [x.array.qvalue if _is_quantized(x) else x
            for x in jax.tree_util.tree_leaves(params, is_leaf=_is_quantized)]


def nbytes(params: Any) -> int:
    """Bytes of a parameter tree's arrays (quantized values and their scales included)."""
    import jax

    return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(params)))
