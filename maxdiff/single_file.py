"""Single-file checkpoints in the original Stability layout (what A1111, ComfyUI and
diffusers' ``from_single_file`` read), both ways, without torch.

One ``.safetensors`` file holds every model of the pipeline under its original prefix:

===============================================  =====================================
prefix                                           model (diffusers component)
===============================================  =====================================
``model.diffusion_model.``                       UNet (``unet``)
``first_stage_model.``                           VAE (``vae``)
``conditioner.embedders.0.transformer.``         CLIP ViT-L, transformers keys (SDXL ``text_encoder``)
``conditioner.embedders.1.model.``               OpenCLIP ViT-bigG (SDXL ``text_encoder_2``)
``cond_stage_model.transformer.``                CLIP ViT-L (SD 1.x)
``cond_stage_model.model.``                      OpenCLIP ViT-H (SD 2.x)
===============================================  =====================================

Each model is read through a *rename*: a function from the diffusers / transformers key
the Flax loader asks for (``down_blocks.1.attentions.0.proj_in.weight``) to the key in
the file (``model.diffusion_model.input_blocks.4.1.proj_in.weight``) and the layout change
between them (:class:`Op`). The same function writes files (:func:`export`), so reading and
writing can never disagree; the tests check the written files with diffusers' own
``from_single_file``, which makes diffusers the oracle of the key mapping.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from maxdiff import checkpoint
from maxdiff.checkpoint import CheckpointError, LazyTensor, WeightSource
from maxdiff.family import (
    FAMILIES,
    REFINER_BIGG,
    SD1_CLIP,
    SD2_OPENCLIP,
    SDXL_BIGG,
    SDXL_CLIP_L,
    Family,
    folder_family,
)

__all__ = ["Op", "MappedSource", "Layout", "inspect", "component_source", "vae_source",
           "unet_source", "controlnet_source", "export", "shipped_config", "FAMILIES"]

UNET = "model.diffusion_model."
VAE_PREFIXES = ("first_stage_model.", "vae.")


@dataclass(frozen=True)
class Op:
    """The layout change from a tensor in the file to the diffusers tensor.

    ``kind``: ``"same"``; ``"conv1x1"`` (the file stores a linear weight as a 1x1 conv,
    ``(out, in, 1, 1)``: the VAE's attention); ``"T"`` (the file stores the transpose:
    OpenCLIP's ``text_projection``); ``"part"`` (the diffusers tensor is rows
    ``[index*n/count, (index+1)*n/count)`` of a fused one: OpenCLIP's ``in_proj`` holds q, k, v).
    """

    kind: str = "same"
    index: int = 0
    count: int = 1

    def read(self, a: np.ndarray) -> np.ndarray:
        if self.kind == "conv1x1":
            return a.reshape(a.shape[:2]) if a.ndim == 4 else a
        if self.kind == "T":
            return np.ascontiguousarray(a.T)
        if self.kind == "part":
            if a.shape[0] % self.count:
                raise CheckpointError(f"a fused tensor of shape {a.shape} does not split into "
                                      f"{self.count} equal parts")
            n = a.shape[0] // self.count
            return a[self.index * n:(self.index + 1) * n]
        return a

    def write(self, parts: list[np.ndarray]) -> np.ndarray:
        """The file's tensor from the diffusers tensor(s) (``count`` of them for a part)."""
        if self.kind == "conv1x1":
            return parts[0][:, :, None, None] if parts[0].ndim == 2 else parts[0]
        if self.kind == "T":
            return np.ascontiguousarray(parts[0].T)
        if self.kind == "part":
            return np.concatenate(parts, axis=0)
        return parts[0]


SAME = Op()
Rename = Callable[[str], "tuple[str, Op]"]

# ----------------------------------------------------------------------------- UNet
_UNET_FIXED = {
    "time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
    "class_embedding.linear_1": "label_emb.0.0", "class_embedding.linear_2": "label_emb.0.2",
    "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2",
}
_UNET_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0",
                "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
                "conv_shortcut": "skip_connection"}


def unet_rename(config: Mapping, prefix: str = UNET) -> Rename:
    """diffusers UNet key -> (original key, op) for a UNet of this diffusers ``config``.

    The original numbers its blocks flat: ``input_blocks.0`` is ``conv_in``, then each down
    block's resnets (``.0``) with their attentions (``.1``) and a downsampler
    (``input_blocks.k.0.op``); ``middle_block.0/1/2`` are resnet, attention, resnet; the
    up blocks' layers follow in ``output_blocks`` with the upsampler after the attention.
    """
    n = len(config["block_out_channels"])
    lpb = config.get("layers_per_block", 2)
    layers = list(lpb) if isinstance(lpb, (list, tuple)) else [lpb] * n
    up_layers = layers[::-1]
    up_types = list(config.get("up_block_types") or ())
    down_start = [1 + sum(layers[i] + 1 for i in range(b)) for b in range(n)]
    up_start = [sum(up_layers[i] + 1 for i in range(b)) for b in range(n)]

    def resnet(rest: list[str]) -> str:
        return ".".join([_UNET_RESNET.get(rest[0], rest[0]), *rest[1:]])

    def rename(key: str) -> tuple[str, Op]:
        mod, leaf = key.rsplit(".", 1)
        if mod in _UNET_FIXED:
            return f"{prefix}{_UNET_FIXED[mod]}.{leaf}", SAME
        p = key.split(".")
        where = None
        if p[0] in ("down_blocks", "up_blocks") and len(p) > 4:
            b, kind, j, rest = int(p[1]), p[2], int(p[3]), p[4:]
            down = p[0] == "down_blocks"
            flat, start = ("input_blocks", down_start) if down else ("output_blocks", up_start)
            if kind == "resnets":
                where = f"{flat}.{start[b] + j}.0.{resnet(rest)}"
            elif kind == "attentions":
                where = f"{flat}.{start[b] + j}.1.{'.'.join(rest)}"
            elif kind == "downsamplers" and rest[0] == "conv":
                where = f"{flat}.{start[b] + layers[b]}.0.op.{'.'.join(rest[1:])}"
            elif kind == "upsamplers" and rest[0] == "conv":
                attn = b < len(up_types) and "Attn" in up_types[b]
                where = (f"{flat}.{start[b] + up_layers[b]}.{2 if attn else 1}.conv."
                         f"{'.'.join(rest[1:])}")
        elif p[0] == "mid_block" and len(p) > 3:
            kind, j = p[1], int(p[2])
            if kind == "resnets":
                where = f"middle_block.{2 * j}.{resnet(p[3:])}"
            elif kind == "attentions":
                where = f"middle_block.{2 * j + 1}.{'.'.join(p[3:])}"
        if where is None:
            raise CheckpointError(f"no original-layout name for UNet key {key!r}")
        return prefix + where, SAME

    return rename


# ----------------------------------------------------------------------------- ControlNet
CONTROLNET = "control_model."


def controlnet_rename(config: Mapping, prefix: str = CONTROLNET) -> Rename:
    """diffusers ControlNet key -> (original key, op): the UNet half is named as in the UNet
    (:func:`unet_rename`); the conditioning encoder is ``input_hint_block`` (its convolutions
    at the even places, SiLUs between), the zero convolutions ``zero_convs.{i}.0`` and
    ``middle_block_out.0``."""
    unet = unet_rename(config, prefix)
    steps = len(config.get("conditioning_embedding_out_channels") or (16, 32, 96, 256)) - 1
    hint = {"conv_in": 0, "conv_out": 4 * steps + 2}

    def rename(key: str) -> tuple[str, Op]:
        mod, leaf = key.rsplit(".", 1)
        p = mod.split(".")
        if p[0] == "controlnet_cond_embedding":
            if len(p) == 2 and p[1] in hint:
                return f"{prefix}input_hint_block.{hint[p[1]]}.{leaf}", SAME
            if len(p) == 3 and p[1] == "blocks":
                return f"{prefix}input_hint_block.{2 * int(p[2]) + 2}.{leaf}", SAME
        elif p[0] == "controlnet_down_blocks" and len(p) == 2:
            return f"{prefix}zero_convs.{p[1]}.0.{leaf}", SAME
        elif mod == "controlnet_mid_block":
            return f"{prefix}middle_block_out.0.{leaf}", SAME
        else:
            return unet(key)
        raise CheckpointError(f"no original-layout name for ControlNet key {key!r}")

    return rename


def controlnet_source(path: str | os.PathLike, config: Mapping) -> WeightSource:
    """A single-file ControlNet: diffusers keys, or the original layout under
    ``control_model.`` or bare (``time_embed.0.weight``, ``input_hint_block.0.weight``, ...)."""
    path = Path(path)
    source = _open(path)
    keys = source.keys()
    if any(k.startswith(CONTROLNET) for k in keys):
        return _mapped(source, controlnet_rename(config), CONTROLNET,
                       f"a ControlNet in the original layout, {CONTROLNET}*")
    if "input_hint_block.0.weight" in keys:
        return _mapped(source, controlnet_rename(config, ""), "",
                       "a ControlNet in the original layout")
    if "controlnet_cond_embedding.conv_in.weight" in keys:
        return source
    raise CheckpointError(f"{path}: not a ControlNet: {_looks_like(keys)}")


# ----------------------------------------------------------------------------- VAE
_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def vae_rename(config: Mapping, prefix: str = VAE_PREFIXES[0]) -> Rename:
    """diffusers AutoencoderKL key -> (original key, op). The decoder's up blocks are
    numbered from the bottom in the original (``decoder.up.{n-1-i}``); attention weights
    are 1x1 convolutions there."""
    n = len(config["block_out_channels"])

    def rename(key: str) -> tuple[str, Op]:
        mod, leaf = key.rsplit(".", 1)
        p = mod.split(".")
        op, where = SAME, None
        if p[0] in ("quant_conv", "post_quant_conv") and len(p) == 1:
            where = mod
        elif p[0] in ("encoder", "decoder") and len(p) > 1:
            side, rest = p[0], p[1:]
            if rest in (["conv_in"], ["conv_out"]):
                where = f"{side}.{rest[0]}"
            elif rest == ["conv_norm_out"]:
                where = f"{side}.norm_out"
            elif rest[0] in ("down_blocks", "up_blocks") and len(rest) > 3:
                i = int(rest[1])
                level, name = (i, "down") if rest[0] == "down_blocks" else (n - 1 - i, "up")
                if rest[2] == "resnets":
                    sub = ["nin_shortcut" if r == "conv_shortcut" else r for r in rest[4:]]
                    where = f"{side}.{name}.{level}.block.{rest[3]}.{'.'.join(sub)}"
                elif rest[2] in ("downsamplers", "upsamplers") and rest[4:] == ["conv"]:
                    where = f"{side}.{name}.{level}.{name}sample.conv"
            elif rest[0] == "mid_block" and len(rest) > 3:
                if rest[1] == "resnets":
                    where = f"{side}.mid.block_{int(rest[2]) + 1}.{'.'.join(rest[3:])}"
                elif rest[1] == "attentions" and rest[2] == "0":
                    sub = ".".join(rest[3:])
                    if sub in _VAE_ATTN:
                        where = f"{side}.mid.attn_1.{_VAE_ATTN[sub]}"
                        if sub != "group_norm" and leaf == "weight":
                            op = Op("conv1x1")
        if where is None:
            raise CheckpointError(f"no original-layout name for VAE key {key!r}")
        return f"{prefix}{where}.{leaf}", op

    return rename


# ----------------------------------------------------------------------------- text encoders
def clip_rename(prefix: str) -> Rename:
    """transformers CLIP key -> original key: the same names under ``prefix``, always with the
    ``text_model.`` level (transformers 5 saves CLIPTextModel without it)."""

    def rename(key: str) -> tuple[str, Op]:
        if not key.startswith(("text_model.", "text_projection.")):
            key = "text_model." + key
        return prefix + key, SAME

    return rename


_OPENCLIP_FIXED = {
    "text_model.embeddings.token_embedding.weight": ("token_embedding.weight", SAME),
    "text_model.embeddings.position_embedding.weight": ("positional_embedding", SAME),
    "text_model.final_layer_norm.weight": ("ln_final.weight", SAME),
    "text_model.final_layer_norm.bias": ("ln_final.bias", SAME),
    "text_projection.weight": ("text_projection", Op("T")),
}
_OPENCLIP_LAYER = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc",
                   "mlp.fc2": "mlp.c_proj", "self_attn.out_proj": "attn.out_proj"}
_LAYER = re.compile(r"(?:text_model\.)?encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def openclip_rename(prefix: str) -> Rename:
    """transformers CLIP key -> OpenCLIP key: ``resblocks.i`` with q, k and v fused into
    ``attn.in_proj_*`` and ``text_projection`` stored transposed."""

    def rename(key: str) -> tuple[str, Op]:
        full = key if key.startswith(("text_model.", "text_projection.")) else "text_model." + key
        if full in _OPENCLIP_FIXED:
            name, op = _OPENCLIP_FIXED[full]
            return prefix + name, op
        m = _LAYER.match(full)
        if m:
            i, mod, leaf = m.groups()
            qkv = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2}
            if mod in qkv:
                return f"{prefix}transformer.resblocks.{i}.attn.in_proj_{leaf}", Op("part", qkv[mod], 3)
            if mod in _OPENCLIP_LAYER:
                return f"{prefix}transformer.resblocks.{i}.{_OPENCLIP_LAYER[mod]}.{leaf}", SAME
        raise CheckpointError(f"no OpenCLIP name for text encoder key {key!r}")

    return rename


# ----------------------------------------------------------------------------- reading
@dataclass
class MappedSource(WeightSource):
    """One model's weights inside a single file: :func:`maxdiff.checkpoint.load_params` asks
    for diffusers keys and ``rename`` says where each lives. ``scope``: the prefix of the keys
    that belong to this model (the rest of the file is other models); keys ending in
    ``ignore`` are never used (buffers, OpenCLIP's ``logit_scale``)."""

    rename: Rename | None = None
    scope: str = ""
    ignore: tuple[str, ...] = ()
    unused: Callable[[str], bool] | None = None  # more keys the config leaves out on purpose
    label: str = ""
    hint: str = ""  # added to shape errors: where the config came from

    def describe(self) -> str:
        return f"{super().describe()} ({self.label})" if self.label else super().describe()


_TEXT_IGNORE = ("position_ids", "logit_scale", "attn_mask")


@dataclass(frozen=True)
class Layout:
    """What :func:`inspect` found in a file, and the file opened once for every model in it."""

    path: Path
    source: WeightSource = field(repr=False, compare=False)
    family: Family
    vae_prefix: str | None  # None: the file holds no VAE
    in_channels: int  # 4, or 9 for an inpainting UNet
    # ComfyUI's markers: a ``v_pred`` key (a v-prediction model), ``ztsnr`` (zero terminal SNR)
    v_prediction: bool = False
    zero_snr: bool = False

    def scheduler_config(self, config: Mapping) -> dict:
        """The scheduler config with what the file says of its prediction type."""
        out = dict(config)
        if self.v_prediction:
            out["prediction_type"] = "v_prediction"
        if self.zero_snr:
            out["rescale_betas_zero_snr"] = True
        return out

    @property
    def has_vae(self) -> bool:
        return self.vae_prefix is not None


def _looks_like(keys: list[str]) -> str:
    """A short description of a file that is not a full checkpoint maxdiff reads."""
    ks = set(keys)

    def has(*parts: str) -> bool:
        return any(any(p in k for p in parts) for k in keys)

    if has("lora_down", "lora_up", "lora_A", "lora_B", "lora_unet_", "lora_te"):
        return ("a LoRA file; load it with load_lora_weights() / --lora, not as the model")
    if has("control_model.", "controlnet_cond_embedding", "input_hint_block"):
        return ("a ControlNet; give it to a pipeline as controlnet= (the CLI's --controlnet, "
                "the serve arg controlnets), or load it with maxdiff.loaders.load_controlnet")
    if has("joint_blocks."):
        return "a Stable Diffusion 3 model, which maxdiff does not load"
    if has("double_blocks.", "single_blocks."):
        return "a Flux model, which maxdiff does not load"
    if "conv_in.weight" in ks and has("down_blocks.") and has("attentions."):
        return ("a UNet alone in diffusers keys (like SDXL-Lightning's); pass it as unet= "
                "(--unet) together with the base model")
    if has("encoder.down.", "encoder.down_blocks.") and not has(UNET):
        return "a VAE alone; pass it as vae= (--vae) together with a model"
    if has(UNET):
        return "a Stable Diffusion UNet without the text encoders maxdiff recognises"
    return "no Stable Diffusion model maxdiff recognises"


_WANT = ("maxdiff reads single-file SDXL base and refiner and SD 1.x / 2.x checkpoints "
         "(model.diffusion_model.*, first_stage_model.*, conditioner.embedders.* or "
         "cond_stage_model.*) and diffusers folders")


def inspect(path: str | os.PathLike) -> Layout:
    """Recognise a single-file checkpoint from its keys, or raise :class:`CheckpointError`
    saying what the file looks like and what maxdiff reads."""
    path = Path(path)
    checkpoint.refuse_pickle(path)
    source = _open(path)
    keys = source.keys()
    ks = set(keys)

    def under(prefix: str) -> bool:
        return any(k.startswith(prefix) for k in keys)

    family = None
    if under(UNET):
        if under(SDXL_BIGG) and under(SDXL_CLIP_L):
            family = FAMILIES["sdxl-base"]
        elif under(REFINER_BIGG):
            family = FAMILIES["sdxl-refiner"]
        elif under(SD1_CLIP):
            family = FAMILIES["sd1"]
        elif under(SD2_OPENCLIP):
            family = FAMILIES["sd2"]
    if family is None:
        raise CheckpointError(f"{path}: {_looks_like(keys)}. {_WANT}.")
    vae_prefix = next((p for p in VAE_PREFIXES if under(p + "decoder.")), None)
    conv_in = UNET + "input_blocks.0.0.weight"
    in_ch = source.files[source.file_of(conv_in)].shape(conv_in)[1] if conv_in in ks else 4
    return Layout(path, source, family, vae_prefix, int(in_ch), "v_pred" in ks, "ztsnr" in ks)


def _open(path: Path) -> WeightSource:
    return WeightSource.from_files([path])


def _mapped(source: WeightSource, rename: Rename, scope: str, label: str,
            ignore: tuple[str, ...] = (), hint: str = "") -> MappedSource:
    return MappedSource(source.files, source.index, rename=rename, scope=scope, ignore=ignore,
                        label=label, hint=hint)


def _openclip_unused(config: Mapping, prefix: str) -> Callable[[str], bool]:
    """SD 2.x's text encoder is OpenCLIP-H cut to its penultimate layer (diffusers' config:
    23 of 24 blocks) without the projection: the file's last block and ``text_projection``
    are not used."""
    layers = int(config.get("num_hidden_layers", 0))
    projection = "CLIPTextModelWithProjection" in (config.get("architectures") or ())
    block = re.compile(re.escape(prefix) + r"transformer\.resblocks\.(\d+)\.")

    def unused(key: str) -> bool:
        m = block.match(key)
        if m:
            return int(m.group(1)) >= layers
        return key == prefix + "text_projection" and not projection

    return unused


def component_source(layout: Layout, component: str, config: Mapping,
                     hint: str = "") -> WeightSource:
    """The weights of one diffusers ``component`` (``unet``, ``vae``, ``text_encoder``,
    ``text_encoder_2``) inside the file, for a model of this diffusers ``config``; ``hint``
    ends a shape error (say where the config came from)."""
    source = layout.source
    if component == "unet":
        return _mapped(source, unet_rename(config), UNET, "its UNet, model.diffusion_model.*",
                       hint=hint)
    if component == "vae":
        if not layout.has_vae:
            raise CheckpointError(
                f"{layout.path}: this {layout.family.title} file holds no VAE "
                f"({VAE_PREFIXES[0]}* keys); pass a VAE file or folder as vae= (--vae)")
        return _mapped(source, vae_rename(config, layout.vae_prefix), layout.vae_prefix,
                       f"its VAE, {layout.vae_prefix}*", hint=hint)
    for name, kind, prefix in layout.family.text:
        if name == component:
            fn = clip_rename if kind == "clip" else openclip_rename
            src = _mapped(source, fn(prefix), prefix, f"its {component}, {prefix}*",
                          _TEXT_IGNORE, hint)
            if kind == "openclip":
                src.unused = _openclip_unused(config, prefix)
            return src
    raise CheckpointError(f"{layout.path}: a {layout.family.title} file has no {component}")


def _vae_kind(keys: Iterable[str]) -> tuple[str, bool] | None:
    """(prefix, original layout?) of a VAE's keys, or None."""
    keys = list(keys)
    for prefix in (*VAE_PREFIXES, ""):
        if any(k.startswith(prefix + "decoder.up.") for k in keys):
            return prefix, True
        if any(k.startswith(prefix + "decoder.up_blocks.") for k in keys):
            return prefix, False
    return None


def vae_source(path: str | os.PathLike, config: Mapping) -> WeightSource:
    """A standalone VAE file (``sdxl_vae.safetensors``: original keys, bare or under
    ``first_stage_model.``; or diffusers keys) or a full single-file checkpoint's VAE."""
    path = Path(path)
    source = _open(path)
    found = _vae_kind(source.keys())
    if found is None:
        raise CheckpointError(f"{path}: not a VAE: {_looks_like(source.keys())}")
    prefix, original = found
    if not original and not prefix:
        return source
    if not original:
        return _mapped(source, lambda k: (prefix + k, SAME), prefix, f"VAE under {prefix}*")
    return _mapped(source, vae_rename(config, prefix), prefix,
                   f"VAE in the original layout{', under ' + prefix + '*' if prefix else ''}")


def unet_source(path: str | os.PathLike, config: Mapping) -> WeightSource:
    """A UNet file in diffusers keys (SDXL-Lightning's) or a full single-file checkpoint's UNet."""
    source = _open(Path(path))
    if any(k.startswith(UNET) for k in source.keys()):
        return _mapped(source, unet_rename(config), UNET, "its UNet, model.diffusion_model.*")
    return source


# ----------------------------------------------------------------------------- configs
def shipped_config(family: str) -> Path:
    """The diffusers folder of configs (no weights) maxdiff ships for a family: model_index,
    each component's config.json, the scheduler and the CLIP tokenizers."""
    root = Path(str(resources.files("maxdiff") / "assets" / "configs" / family))
    if not (root / "model_index.json").is_file():
        raise CheckpointError(f"no shipped configs for {family!r}; pass config= a diffusers folder")
    return root


# ----------------------------------------------------------------------------- writing
def export(folder: str | os.PathLike, out: str | os.PathLike, *, dtype=None,
           variant: str | None = None, include_vae: bool = True) -> int:
    """Write a diffusers SDXL (base or refiner) or SD 1.x / 2.x folder as one single file in
    the original layout (what diffusers' ``from_single_file`` and the A1111 / ComfyUI loaders
    read). Tensors stream one at a time; ``dtype`` (e.g. ``"float16"``) casts floating
    tensors. Returns the size."""
    folder = Path(folder)
    family = folder_family(folder)
    if not family.single_file:
        raise CheckpointError(f"{folder}: a {family.title} folder; single files hold SDXL base "
                              "and refiner and SD 1.x / 2.x models")
    cast = checkpoint.resolve_dtype(dtype) if dtype is not None else None
    configs = {name: checkpoint.read_config(folder / name) for name in family.components
               if include_vae or name != "vae"}
    pieces = []
    for name, rename in renames(family, configs).items():
        src = checkpoint.open_weights(folder / name, variant)
        pieces += [(rename, key, (src, key)) for key in src.keys()
                   if not key.endswith(_TEXT_IGNORE)]
    tensors = {target: _lazy(op, parts, cast)
               for target, (op, parts) in grouped(pieces, folder).items()}
    return checkpoint.save_safetensors(tensors, out, {"format": "pt"})


def renames(family: Family, configs: Mapping[str, Mapping]) -> dict[str, Rename]:
    """{component: rename} for the components of ``configs`` (their diffusers configs)."""
    out: dict[str, Rename] = {}
    text = {name: (kind, prefix) for name, kind, prefix in family.text}
    for name, cfg in configs.items():
        if name == "unet":
            out[name] = unet_rename(cfg)
        elif name == "vae":
            out[name] = vae_rename(cfg)
        else:
            kind, prefix = text[name]
            out[name] = (clip_rename if kind == "clip" else openclip_rename)(prefix)
    return out


def grouped(pieces: Iterable[tuple[Rename, str, object]], where: object = "") -> dict[str, tuple]:
    """{file key: (op, [part, ...])} from (rename, diffusers key, part) triples: the parts of a
    fused tensor (OpenCLIP's q, k, v) in their order. Every fused tensor must be complete."""
    groups: dict[str, tuple] = {}
    for rename, key, part in pieces:
        target, op = rename(key)
        groups.setdefault(target, (op, [None] * op.count))[1][op.index] = part
    for target, (op, parts) in groups.items():
        if any(p is None for p in parts):
            raise CheckpointError(f"{where}: {target} needs {op.count} tensors, found "
                                  f"{sum(p is not None for p in parts)}")
    return groups


def _lazy(op: Op, parts: list, cast) -> LazyTensor:
    files = [(src.files[src.file_of(k)], k) for src, k in parts]
    shapes = [f.shape(k) for f, k in files]
    dt = files[0][0].dtype(files[0][1])
    if cast is not None and checkpoint._is_float(dt):
        dt = cast
    probe = op.write([np.broadcast_to(np.empty((), np.uint8), s) for s in shapes])

    def load() -> np.ndarray:
        return op.write([f.get(k) for f, k in files]).astype(dt, copy=False)

    return LazyTensor(tuple(probe.shape), np.dtype(dt), load)


def _expected(component: str, config: Mapping) -> dict[str, tuple[int, ...]]:
    """{diffusers / transformers key: PyTorch shape} of a model of this config (no weights:
    the Flax module's ``eval_shape``)."""
    from maxdiff.models import clip, unet, vae

    if component == "unet":
        shapes = unet.param_shapes(unet.UNet2DConditionModel(unet.UNetConfig.from_dict(config)))
    elif component == "vae":
        shapes = vae.param_shapes(vae.AutoencoderKL(vae.AutoencoderKLConfig.from_dict(config)))
    else:
        cfg = clip.CLIPTextConfig.from_dict(dict(config))
        arch = next((a for a in cfg.architectures if a in clip.ARCHITECTURES), "CLIPTextModel")
        shapes = clip.param_shapes(clip.ARCHITECTURES[arch](cfg))
    out = {}
    for path, leaf in checkpoint._flatten(shapes).items():
        key, _ = checkpoint.flax_to_torch_key(path, len(leaf.shape))
        out[key] = checkpoint._torch_shape(path, tuple(leaf.shape))
    return out


def to_folder(path: str | os.PathLike, out: str | os.PathLike, config: str | os.PathLike | None
              = None, dtype=None, vae: str | os.PathLike | None = None) -> Path:
    """Write a single-file checkpoint as a diffusers folder (what ``from_pretrained`` of
    diffusers and maxdiff read): the configs of ``config`` (a diffusers folder; default the
    configs maxdiff ships for the file's family), tokenizers (the config folder's, else CLIP's
    vocabulary from the embedded model) and each model's weights, tensor by tensor, cast to
    ``dtype`` if given. ``vae``: a VAE file for a checkpoint that holds none. Written into
    ``out.tmp`` and renamed at the end."""
    import shutil

    layout = inspect(path)
    if not layout.family.single_file:
        raise CheckpointError(f"{path}: a {layout.family.title} file, which maxdiff does not "
                              "convert yet")
    root = Path(config) if config is not None else shipped_config(layout.family.name)
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    cast = checkpoint.resolve_dtype(dtype) if dtype is not None else None
    try:
        shutil.copytree(root, tmp, ignore=shutil.ignore_patterns(
            "*.safetensors", "*.safetensors.index.json", "*.bin", "*.ckpt", "*.pt", "*.pth"))
        embedded = Path(str(resources.files("maxdiff") / "assets" / "demo-model"))
        for name, same in layout.family.tokenizers:
            if not (tmp / name).is_dir():
                shutil.copytree(embedded / same, tmp / name)
        for name in layout.family.components:
            cfg = checkpoint.read_config(root / name)
            if name == "vae" and vae is not None:
                src = vae_source(vae, cfg)
            else:
                src = component_source(layout, name, cfg)
            tensors = {}
            for key, shape in _expected(name, cfg).items():
                stored, op = src.rename(key) if getattr(src, "rename", None) else (key, SAME)
                if stored not in src.index:
                    raise CheckpointError(f"{src.describe()}: missing key {stored!r} "
                                          f"(diffusers {key!r})")
                tensors[_folder_key(name, cfg, key)] = _read_lazy(src, stored, op, shape, cast)
            stem = "diffusion_pytorch_model" if name in ("unet", "vae") else "model"
            checkpoint.save_safetensors(tensors, tmp / name / f"{stem}.safetensors",
                                        {"format": "pt"})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _folder_key(component: str, config: Mapping, key: str) -> str:
    """transformers 5 saves ``CLIPTextModel`` without its ``text_model.`` level."""
    if "CLIPTextModel" in (config.get("architectures") or ()):
        return key.removeprefix("text_model.")
    return key


def _read_lazy(src: WeightSource, stored: str, op: Op, shape: tuple[int, ...], cast
               ) -> LazyTensor:
    f = src.files[src.file_of(stored)]
    dt = f.dtype(stored)
    if cast is not None and checkpoint._is_float(dt):
        dt = cast

    def load() -> np.ndarray:
        a = checkpoint.as_linear_if_1x1(op.read(f.get(stored)), len(shape))
        if tuple(a.shape) != tuple(shape):
            raise CheckpointError(f"{f.path}: key {stored!r} gives shape {a.shape}, the config "
                                  f"needs {shape}")
        return a.astype(dt, copy=False)

    return LazyTensor(tuple(shape), np.dtype(dt), load)
