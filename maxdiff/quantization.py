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
  pipeline's dtype.

The quantized weights are computed from the float weights at load (:func:`quantize`), tensor
by tensor; the float UNet weights are dropped once quantized. LoRA adapters (fused or per
request) are refused on a quantized pipeline (:func:`lora_problem`): fusing needs the float
weights and would keep both copies.

qwix is imported only when a quantization other than ``"none"`` is asked for, and JAX only
by the functions that need it (the configs import :data:`Quantization` without JAX).

Quantized checkpoints (``maxdiff convert SRC DST --quantize MODE``): :func:`save_quantized`
writes the quantized UNet's parameter tree as one safetensors file, :data:`WEIGHTS_FILE` in
``unet/``, every leaf under its tree path (``.../attn1/to_q/kernel/array/qvalue`` int8 or
float8 values, ``.../array/scale`` their float32 scales, ``.../conv_in/kernel`` a float weight
in the Flax layout), with :data:`CONFIG_KEY` naming the mode in ``unet/config.json`` and in the
file's metadata. :func:`load_quantized` reads it back strictly: the mode must be the one asked
for, every leaf the quantized model needs must be there with its shape, the quantized values in
their exact dtype, and nothing else may be in the file.
"""

from __future__ import annotations

import sys
from typing import Any, Literal

MODES = ("none", "int8-weights", "int8", "fp8")
CONFIG_KEY = "_maxdiff_quantization"  # in a quantized folder's unet/config.json
WEIGHTS_FILE = "maxdiff_quantized.safetensors"  # its weights, in unet/
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
    return [_leaf_key(path) for path, leaf in flat if _is_quantized(leaf)]


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


def _leaf_key(path) -> str:
    """A tree path as "a/b/kernel/array/qvalue" (dict keys and dataclass fields alike)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _quantized_abstract(model, mode: str, dtype, example_inputs: dict | None = None):
    """(qwix's PTQ copy of ``model``, the abstract tree of its quantized parameters when the
    float ones are ``dtype``): what :func:`quantize` would make, computed without any weights."""
    import jax

    from maxdiff.models.unet import param_shapes

    qwix = _qwix(mode)
    qmodel = qwix.quantize_model(model, qwix.PtqProvider(rules(mode)))
    inputs = example_inputs if example_inputs is not None else model.dummy_inputs()
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), **inputs)["params"]
    floats = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), param_shapes(model))
    return qmodel, jax.eval_shape(lambda p: qwix.quantize_params(p, abstract), floats)


def save_quantized(params: dict, path, mode: str, float_dtype=None) -> int:
    """Write a quantized parameter tree (from :func:`quantize`) to the safetensors file
    ``path``, one tensor at a time: the quantized values and their scales as they are, the
    float leaves cast to ``float_dtype`` (None: as they are). Returns the file's size."""
    import jax
    import numpy as np

    from maxdiff import checkpoint

    check_quantization(mode)
    layers = quantized_layers(params)
    if mode == "none" or not layers:
        raise ValueError(f"save_quantized: the parameters are not quantized (mode {mode!r})")
    quantized = tuple(f"{layer}/" for layer in layers)
    target = None if float_dtype is None else checkpoint.resolve_dtype(float_dtype)
    tensors = {}
    for where, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        key = _leaf_key(where)
        dtype = np.dtype(leaf.dtype)
        if target is not None and not key.startswith(quantized) and checkpoint._is_float(dtype):
            dtype = target
        tensors[key] = checkpoint.LazyTensor(
            tuple(leaf.shape), dtype, lambda leaf=leaf, dtype=dtype: np.asarray(leaf).astype(dtype))
    return checkpoint.save_safetensors(tensors, path, {"format": "maxdiff", CONFIG_KEY: mode})


def load_quantized(model, path, mode: str, *, put=None, example_inputs: dict | None = None
                   ) -> tuple[Any, dict]:
    """(qwix's PTQ module of ``model``, its quantized parameters) read from a file written by
    :func:`save_quantized`: what :func:`quantize` makes from the float weights, without them.
    Float leaves are cast to the model's dtype; the quantized values must have the dtype
    ``mode`` gives them (int8 / float8) and every leaf its shape. CheckpointError naming the
    file and the key otherwise, or when the file holds another mode or extra tensors."""
    import jax
    import numpy as np

    from maxdiff import checkpoint

    check_quantization(mode)
    if mode == "none":
        raise ValueError("load_quantized needs a quantization mode, not 'none'")
    file = checkpoint.SafetensorsFile(path)
    stored = file.metadata.get(CONFIG_KEY)
    if stored != mode:
        raise checkpoint.CheckpointError(
            f"{path}: holds UNet weights quantized to {stored!r}, not {mode!r}; load it with "
            f"quantization={stored!r} (or convert the float model again)")
    qmodel, abstract = _quantized_abstract(model, mode, model.dtype, example_inputs)
    layers = tuple(f"{layer}/" for layer in quantized_layers(abstract))
    put = put or jax.device_put
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    leaves, used = [], set()
    for p, want in flat:
        key = _leaf_key(p)
        if key not in file:
            raise checkpoint.CheckpointError(
                f"{path}: missing tensor {key!r} (shape {tuple(want.shape)}, {want.dtype}): "
                "the file does not belong to this UNet config and quantization")
        shape, dtype = file.shape(key), file.dtype(key)
        if shape != tuple(want.shape):
            raise checkpoint.CheckpointError(
                f"{path}: tensor {key!r} has shape {shape}, expected {tuple(want.shape)} (does "
                "unet/config.json match these weights?)")
        exact = key.startswith(layers) and key.endswith("/qvalue")
        if (dtype != np.dtype(want.dtype)) if exact else not checkpoint._is_float(dtype):
            raise checkpoint.CheckpointError(
                f"{path}: tensor {key!r} is {dtype}, expected "
                f"{np.dtype(want.dtype) if exact else 'a float dtype'} for quantization={mode!r}")
        leaves.append(put(file.get(key).astype(want.dtype, copy=False)))
        used.add(key)
    extra = sorted(set(file.keys()) - used)
    if extra:
        raise checkpoint.CheckpointError(
            f"{path}: unexpected tensor {extra[0]!r}"
            f"{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}: the file does not "
            "belong to this UNet config and quantization")
    return qmodel, jax.tree_util.tree_unflatten(treedef, leaves)
