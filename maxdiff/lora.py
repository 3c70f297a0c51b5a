"""LoRA adapters, read from safetensors files and fused into the weights (no torch).

A LoRA file holds, per adapted layer, two small matrices ``down`` (r, in) and ``up`` (out, r)
(convolutions: ``down`` (r, in, kh, kw), ``up`` (out, r, 1, 1)) and optionally an ``alpha``.
Fusing adds ``scale * (alpha / r) * up @ down`` to the layer's weight, as diffusers'
``fuse_lora(lora_scale=scale)`` does; the model then runs at its usual speed.

Formats read (the ones people download):

* **diffusers / PEFT** (``StableDiffusionXLPipeline.save_lora_weights``, the diffusers training
  scripts): ``unet.<module>.lora_A.weight`` / ``lora_B.weight``, also spelled
  ``lora.down.weight`` / ``lora.up.weight``, ``lora_linear_layer.down.weight`` / ``.up.weight``
  and the old attention-processor form ``attn1.processor.to_q_lora.down.weight``; the same under
  ``text_encoder.`` and ``text_encoder_2.`` (with or without transformers' ``text_model.``
  prefix). The factor ``alpha / r`` comes, as diffusers takes it, from the PEFT config diffusers
  writes into the file header (``lora_adapter_metadata``: ``r``, ``lora_alpha``,
  ``rank_pattern``, ``alpha_pattern``, ``use_rslora`` per component); without it from
  ``<module>.alpha`` tensors; without either it is 1.
* **kohya** (sd-scripts, most community files): ``lora_unet_<module>.lora_down.weight`` /
  ``.lora_up.weight`` / ``.alpha`` and ``lora_te1_`` / ``lora_te_`` (text_encoder), ``lora_te2_``
  (text_encoder_2), where ``<module>`` is the module path with ``.`` written as ``_``. Names
  are resolved against the model's own module names, in diffusers spelling
  (``down_blocks_1_attentions_0_...``) or in the original SDXL (SGM) spelling kohya uses for SDXL
  (``input_blocks_4_1_transformer_blocks_0_attn1_to_q``, ``middle_block_1_...``,
  ``output_blocks_...``, ``in_layers_2``, ``out_layers_3``, ``emb_layers_1``,
  ``skip_connection``, ``op``). A missing ``alpha`` means ``alpha = r``.

Pickle files (``.bin``, ``.pt``, ``.ckpt``, ...) are refused, as everywhere in maxdiff. A key
that names no layer of the model, a ``down`` / ``up`` pair of different ranks, a delta whose
shape differs from the weight's and LoRA variants not supported (DoRA, LoHa, LoKr, biases)
raise :class:`LoraError` (a ``ValueError``) naming the file and key.

``TextToImagePipeline.load_lora_weights`` / ``unload_lora_weights`` use this module; here:

>>> layers = read_lora("pixel-art-xl.safetensors", pipe.params)   # doctest: +SKIP
>>> params = fuse_loras(pipe.params, [(layers, 0.8)])              # doctest: +SKIP
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from maxdiff import checkpoint

__all__ = ["LoraError", "LoraLayer", "read_lora", "lora_file", "fuse_loras", "COMPONENTS"]

COMPONENTS = ("unet", "text_encoder", "text_encoder_2")
_KOHYA_PREFIXES = {"lora_unet_": "unet", "lora_te1_": "text_encoder", "lora_te_": "text_encoder",
                   "lora_te2_": "text_encoder_2"}
# (suffix of the down key, suffix of the up key), diffusers / PEFT spellings
_PAIR_SUFFIXES = (
    (".lora_A.weight", ".lora_B.weight"),
    (".lora.down.weight", ".lora.up.weight"),
    (".lora_linear_layer.down.weight", ".lora_linear_layer.up.weight"),
    ("_lora.down.weight", "_lora.up.weight"),  # attn1.processor.to_q_lora.down.weight
    (".lora_down.weight", ".lora_up.weight"),  # kohya
)
_UNSUPPORTED = {"dora_scale": "DoRA", "lora_magnitude_vector": "DoRA", ".hada_": "LoHa",
                ".lokr_": "LoKr", ".lora_mid.": "LoCon (Tucker)", "lora_B.bias": "a LoRA bias",
                "lora.up.bias": "a LoRA bias", ".diff": "a full weight difference"}
DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


class LoraError(checkpoint.CheckpointError):
    """A LoRA file cannot be applied to this model; the message names the file and key."""


@dataclass(frozen=True)
class LoraLayer:
    """One adapted weight: ``delta()`` is what fusing adds to it (before the user's scale)."""

    component: str                 # "unet", "text_encoder" or "text_encoder_2"
    path: tuple[str, ...]          # the Flax parameter path of the kernel in that component
    key: str                       # the down key in the file (for messages)
    down: np.ndarray               # (r, in) or (r, in, kh, kw), float32
    up: np.ndarray                 # (out, r) or (out, r, 1, 1), float32
    factor: float                  # alpha / r (PEFT's ``scaling``)

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    def torch_delta(self) -> np.ndarray:
        """``factor * up @ down`` in the PyTorch layout, float32."""
        r = self.rank
        w = self.up.reshape(self.up.shape[0], r) @ self.down.reshape(r, -1)
        return (np.float32(self.factor) * w).reshape((self.up.shape[0],) + self.down.shape[1:])


def lora_file(path: str | os.PathLike) -> Path:
    """The safetensors file of a LoRA: ``path`` itself, or in a folder
    ``pytorch_lora_weights.safetensors`` or its only ``*.safetensors`` file. Pickles are refused."""
    p = Path(path)
    if p.is_dir():
        if (p / DEFAULT_WEIGHT_NAME).is_file():
            return p / DEFAULT_WEIGHT_NAME
        found = sorted(p.glob("*.safetensors"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise LoraError(f"{p}: several .safetensors files ({', '.join(f.name for f in found)});"
                            " pass the path of the LoRA file itself")
        pickles = sorted(x for x in p.iterdir() if x.suffix.lower() in checkpoint.PICKLE_SUFFIXES)
        if pickles:
            checkpoint.refuse_pickle(pickles[0])
        raise LoraError(f"{p}: no .safetensors LoRA file in this folder")
    checkpoint.refuse_pickle(p)
    if not p.is_file():
        raise LoraError(f"{p}: no such file or folder")
    return p


# ----------------------------------------------------------------------------- module names
def _kernels(tree: Mapping) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """torch-style module name -> (Flax kernel path, PyTorch weight shape) for every layer with a
    kernel (linear and conv layers)."""
    out = {}
    for path, leaf in checkpoint._flatten(tree).items():
        if path[-1] == "kernel":
            shape = checkpoint._torch_shape(path, tuple(leaf.shape))
            out[".".join(path[:-1])] = (path, tuple(shape))
    return out


class _Resolver:
    """Finds the model's module for a LoRA module name, per component."""

    def __init__(self, params: Mapping[str, Any], unet_config: Any = None):
        self.modules = {c: _kernels(params[c]) for c in COMPONENTS if c in params}
        self.underscored: dict[str, dict[str, str | None]] = {}
        for c, mods in self.modules.items():
            m: dict[str, str | None] = {}
            for name in mods:
                for alias in self._aliases(c, name):
                    u = alias.replace(".", "_")
                    m[u] = None if u in m and m[u] != name else name  # None: ambiguous
            self.underscored[c] = m
        self.sgm = _SgmNames(unet_config) if unet_config is not None else None

    @staticmethod
    def _aliases(component: str, name: str) -> list[str]:
        if component != "unet" and name.startswith("text_model."):
            # transformers >= 5 drops the text_model. prefix of CLIPTextModel; files have both
            return [name, name[len("text_model."):]]
        return [name]

    def dotted(self, component: str, module: str) -> str | None:
        mods = self.modules.get(component, {})
        for cand in (module, "text_model." + module, module.removeprefix("text_model.")):
            if cand in mods:
                return cand
        return None

    def kohya(self, component: str, module: str) -> str | None:
        names = self.underscored.get(component, {})
        name = names.get(module)
        if name is None and component == "unet" and self.sgm is not None:
            sgm = self.sgm.to_diffusers(module)
            name = names.get(sgm) if sgm is not None else None
        return name

    def hint(self, component: str, module: str) -> str:
        names = list(self.modules.get(component, {}))
        close = difflib.get_close_matches(module, names + [n.replace(".", "_") for n in names], 1)
        return f"; the closest is {close[0]!r}" if close else ""


class _SgmNames:
    """kohya's SDXL module names (the original SGM UNet, ``input_blocks_4_1_...``) -> diffusers
    names with ``_`` for ``.`` (looked up like any kohya name), for this UNet's layout."""

    _RESNET = {"in_layers_2": "conv1", "out_layers_3": "conv2", "emb_layers_1": "time_emb_proj",
               "skip_connection": "conv_shortcut"}
    _SIMPLE = {"time_embed_0": "time_embedding_linear_1", "time_embed_2": "time_embedding_linear_2",
               "label_emb_0_0": "add_embedding_linear_1", "label_emb_0_2": "add_embedding_linear_2",
               "input_blocks_0_0": "conv_in", "out_2": "conv_out"}

    def __init__(self, config: Any):
        self.layers = int(_cfg(config, "layers_per_block"))
        self.n_down = len(_cfg(config, "down_block_types"))
        self.n_up = len(_cfg(config, "up_block_types"))

    def _child(self, block: str, j: int, l: int, rest: str) -> str | None:
        if j == 0:
            return f"{block}_resnets_{l}_{self._RESNET.get(rest, rest)}"
        if j == 1:
            return f"{block}_attentions_{l}_{rest}"
        return None

    def to_diffusers(self, name: str) -> str | None:
        if name in self._SIMPLE:
            return self._SIMPLE[name]
        m = re.match(r"^middle_block_(\d+)_(.+)$", name)
        if m:
            i, rest = int(m.group(1)), m.group(2)
            if i == 1:
                return f"mid_block_attentions_0_{rest}"
            return f"mid_block_resnets_{i // 2}_{self._RESNET.get(rest, rest)}" if i in (0, 2) else None
        m = re.match(r"^(input_blocks|output_blocks)_(\d+)_(\d+)_(.+)$", name)
        if not m:
            return None
        kind, i, j, rest = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        if kind == "input_blocks":
            b, l = divmod(i - 1, self.layers + 1)
            if i < 1 or b >= self.n_down:
                return None
            if l == self.layers:  # the downsampler
                return f"down_blocks_{b}_downsamplers_0_conv" if (j, rest) == (0, "op") else None
            return self._child(f"down_blocks_{b}", j, l, rest)
        b, l = divmod(i, self.layers + 1)
        if b >= self.n_up:
            return None
        if j >= 1 and rest == "conv":  # the upsampler is the block's last child
            return f"up_blocks_{b}_upsamplers_0_conv"
        return self._child(f"up_blocks_{b}", j, l, rest)


def _cfg(config: Any, name: str):
    return config[name] if isinstance(config, Mapping) else getattr(config, name)


# ----------------------------------------------------------------------------- reading
def _peft_metadata(meta: Mapping[str, str], component: str) -> dict | None:
    raw = meta.get("lora_adapter_metadata")
    if not raw:
        return None
    try:
        md = json.loads(raw)
    except json.JSONDecodeError:
        return None
    pre = component + "."
    own = {k[len(pre):]: v for k, v in md.items() if k.startswith(pre)}
    return own if "r" in own and "lora_alpha" in own else None


def _pattern(patterns: Mapping[str, Any], module: str, default):
    """PEFT's ``get_pattern_key``: the first pattern that matches the end of the module name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _split_key(key: str) -> tuple[str, str, str] | None:
    """``key`` -> (component, module, "down" | "up" | "alpha"), or None when no LoRA key."""
    for prefix, comp in _KOHYA_PREFIXES.items():
        if key.startswith(prefix):
            name, _, leaf = key[len(prefix):].partition(".")
            kind = {"lora_down.weight": "down", "lora_up.weight": "up", "alpha": "alpha"}.get(leaf)
            return (comp, "kohya:" + name, kind) if kind else None
    comp = "unet"
    for c in ("text_encoder_2", "text_encoder", "unet"):
        if key.startswith(c + "."):
            comp, key = c, key[len(c) + 1:]
            break
    for down, up in _PAIR_SUFFIXES:
        for suffix, kind in ((down, "down"), (up, "up")):
            if key.endswith(suffix):
                module = key[: -len(suffix)]
                if suffix.startswith("_lora"):  # old attention processors: to_q_lora, to_out_lora
                    module = _processor_module(comp, module)
                return comp, module, kind
    if key.endswith(".alpha"):
        return comp, key[: -len(".alpha")], "alpha"
    return None


def _processor_module(component: str, module: str) -> str:
    module = module.replace(".processor.", ".")
    head, _, last = module.rpartition(".")
    if component == "unet":
        last = {"to_out": "to_out.0"}.get(last, last)
    else:
        last = {"to_q": "q_proj", "to_k": "k_proj", "to_v": "v_proj", "to_out": "out_proj"}.get(last, last)
    return f"{head}.{last}" if head else last


def read_lora(path: str | os.PathLike, params: Mapping[str, Any], *,
              unet_config: Any = None) -> list[LoraLayer]:
    """Read a LoRA file and match it against ``params`` (``{"unet": tree, "text_encoder": tree,
    "text_encoder_2": tree}``, leaves with ``.shape``): one :class:`LoraLayer` per adapted weight.

    ``unet_config`` (the UNet's config, with ``layers_per_block``, ``down_block_types`` and
    ``up_block_types``) lets kohya files in the SGM spelling be read. Every tensor in the file
    must be used; anything that does not fit raises :class:`LoraError`.
    """
    file = lora_file(path)
    st = checkpoint.SafetensorsFile(file)
    where = str(file)
    resolver = _Resolver(params, unet_config)
    groups: dict[tuple[str, str], dict[str, str]] = {}
    for key in st.keys():
        for marker, what in _UNSUPPORTED.items():
            if marker in key:
                raise LoraError(f"{where}: key {key!r} belongs to {what}, which maxdiff does not "
                                "apply (plain LoRA down/up/alpha only)")
        parts = _split_key(key)
        if parts is None:
            raise LoraError(f"{where}: key {key!r} is not a LoRA weight maxdiff knows "
                            "(expected diffusers/PEFT lora_A/lora_B or kohya lora_down/lora_up)")
        comp, module, kind = parts
        slot = groups.setdefault((comp, module), {})
        if kind in slot:
            raise LoraError(f"{where}: keys {slot[kind]!r} and {key!r} both give the {kind} "
                            f"matrix of {comp} module {module!r}")
        slot[kind] = key

    layers: list[LoraLayer] = []
    seen: dict[tuple[str, tuple[str, ...]], str] = {}
    for (comp, module), slot in groups.items():
        if "down" not in slot or "up" not in slot:
            have = next(iter(slot.values()))
            missing = "down (lora_A / lora_down)" if "down" not in slot else "up (lora_B / lora_up)"
            raise LoraError(f"{where}: key {have!r} has no matching {missing} matrix")
        dkey, ukey = slot["down"], slot["up"]
        if comp not in resolver.modules:
            raise LoraError(f"{where}: key {dkey!r} targets {comp}, which this pipeline lacks")
        kohya = module.startswith("kohya:")
        raw = module[len("kohya:"):] if kohya else module
        name = resolver.kohya(comp, raw) if kohya else resolver.dotted(comp, raw)
        if name is None:
            raise LoraError(f"{where}: key {dkey!r} names {comp} module {raw!r}, which this model "
                            f"does not have{resolver.hint(comp, raw)}")
        fpath, wshape = resolver.modules[comp][name]
        down = st.get(dkey).astype(np.float32)
        up = st.get(ukey).astype(np.float32)
        if down.ndim not in (2, 4) or up.ndim != down.ndim:
            raise LoraError(f"{where}: keys {dkey!r} {down.shape} and {ukey!r} {up.shape}: "
                            "expected 2-d (linear) or 4-d (conv) matrices of the same kind")
        r = down.shape[0]
        if up.shape[1] != r:
            raise LoraError(f"{where}: rank mismatch: {dkey!r} has rank {r} (shape {down.shape}) "
                            f"but {ukey!r} has rank {up.shape[1]} (shape {up.shape})")
        if up.ndim == 4 and up.shape[2:] != (1, 1):
            raise LoraError(f"{where}: {ukey!r} has shape {up.shape}; a conv LoRA's up matrix "
                            "must be (out, r, 1, 1)")
        delta_shape = (up.shape[0],) + down.shape[1:]
        if delta_shape != wshape:
            same = (int(np.prod(delta_shape)) == int(np.prod(wshape))
                    and tuple(s for s in delta_shape if s != 1) == tuple(s for s in wshape if s != 1))
            if not same:  # a linear LoRA on a 1x1 conv (or back) only needs a reshape
                raise LoraError(f"{where}: key {dkey!r}: up @ down has shape {delta_shape} but "
                                f"{comp} weight {name}.weight has shape {wshape}")
            down = down.reshape((r,) + wshape[1:])
            up = up.reshape((wshape[0], r) + (1,) * (len(wshape) - 2))
        factor = _factor(st, where, comp, name, slot, r, kohya)
        if (comp, fpath) in seen:
            raise LoraError(f"{where}: keys {seen[(comp, fpath)]!r} and {dkey!r} adapt the same "
                            f"{comp} weight {name}.weight")
        seen[(comp, fpath)] = dkey
        layers.append(LoraLayer(comp, fpath, dkey, down, up, factor))
    if not layers:
        raise LoraError(f"{where}: no LoRA weights in this file")
    return layers


def _factor(st: checkpoint.SafetensorsFile, where: str, comp: str, module: str,
            slot: Mapping[str, str], r: int, kohya: bool) -> float:
    """PEFT's ``scaling``: alpha / r, as diffusers configures it for this file."""
    md = None if kohya else _peft_metadata(st.metadata, comp)
    if md is not None:
        want_r = _pattern(md.get("rank_pattern"), module, md["r"])
        alpha = _pattern(md.get("alpha_pattern"), module, md["lora_alpha"])
        if int(want_r) != r:
            raise LoraError(f"{where}: key {slot['down']!r} has rank {r} but the file's "
                            f"lora_adapter_metadata says r={want_r} for {comp} module {module!r}")
        return float(alpha) / (math.sqrt(r) if md.get("use_rslora") else r)
    if "alpha" in slot:
        a = st.get(slot["alpha"])
        if a.size != 1:
            raise LoraError(f"{where}: {slot['alpha']!r} has shape {a.shape}; alpha is one number")
        return float(a.reshape(())) / r
    return 1.0


# ----------------------------------------------------------------------------- fusing
def fuse_loras(base: Mapping[str, Any], adapters: Sequence[tuple[Iterable[LoraLayer], float]],
               put: Callable[[np.ndarray, Any], Any] | None = None) -> dict:
    """``base`` with every adapter's deltas added: per weight,
    ``cast(float32(w) + sum(scale * factor * up @ down))`` in the weight's own dtype, in its
    Flax layout, placed like the base array (same sharding). Untouched leaves are the base
    objects themselves; the result has the structure, shapes and dtypes of ``base``."""
    sums: dict[tuple[str, tuple[str, ...]], np.ndarray] = {}
    for layers, scale in adapters:
        for layer in layers:
            leaf = _get(base[layer.component], layer.path)
            _, to_flax = checkpoint.flax_to_torch_key(layer.path, leaf.ndim)
            d = np.float32(scale) * to_flax(layer.torch_delta())
            if d.shape != tuple(leaf.shape):  # a reshaped 1x1 conv / linear
                d = d.reshape(leaf.shape)
            k = (layer.component, layer.path)
            sums[k] = d if k not in sums else sums[k] + d
    put = put or (lambda a, like: jax.device_put(a, like.sharding)
                  if hasattr(like, "sharding") else a)
    out = {c: dict(t) if isinstance(t, Mapping) else t for c, t in base.items()}
    for (comp, path), d in sums.items():
        leaf = _get(base[comp], path)
        w = np.asarray(jax.device_get(leaf))
        fused = (w.astype(np.float32) + d).astype(w.dtype)
        out[comp] = _set(out[comp], path, put(np.ascontiguousarray(fused), leaf))
    return out


def _get(tree: Mapping, path: tuple[str, ...]):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: Mapping, path: tuple[str, ...], value) -> dict:
    """A copy of ``tree`` with ``path`` replaced (copies only the dicts along the path)."""
    new = dict(tree)
    new[path[0]] = value if len(path) == 1 else _set(tree[path[0]], path[1:], value)
    return new
