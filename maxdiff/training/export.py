"""Write trained Flax parameters as a diffusers SDXL pipeline folder (no torch).

Layout (what ``StableDiffusionXLPipeline.from_pretrained`` and maxdiff's
``TextToImagePipeline.from_pretrained`` read)::

    model_index.json            _class_name: StableDiffusionXLPipeline
    unet/       config.json + diffusion_pytorch_model.safetensors
    vae/        config.json + diffusion_pytorch_model.safetensors
    text_encoder/    config.json + model.safetensors   (CLIPTextModel, "text_model." keys)
    text_encoder_2/  config.json + model.safetensors   (CLIPTextModelWithProjection)
    tokenizer/, tokenizer_2/   vocab.json + merges.txt + tokenizer_config.json (pad "!" in _2)
    scheduler/  scheduler_config.json (EulerDiscreteScheduler)

Parameter paths map to PyTorch keys with :func:`maxdiff.checkpoint.flax_to_torch_key` and the
layout is changed back with :func:`maxdiff.checkpoint.flax_to_torch_layout`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from maxdiff import checkpoint

DIFFUSERS_VERSION = "0.42.1"
TRANSFORMERS_VERSION = "5.24.0"

MODEL_INDEX = {
    "_class_name": "StableDiffusionXLPipeline",
    "_diffusers_version": DIFFUSERS_VERSION,
    "feature_extractor": [None, None],
    "force_zeros_for_empty_prompt": True,
    "image_encoder": [None, None],
    "scheduler": ["diffusers", "EulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "CLIPTokenizer"],
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def torch_state_dict(params: Mapping, dtype: Any = np.float16) -> dict[str, np.ndarray]:
    """Flax parameter tree -> {PyTorch key: array in PyTorch layout, cast to ``dtype``}."""
    out = {}
    for path, arr in checkpoint._flatten(params).items():
        a = np.asarray(arr, np.float32)
        key, _ = checkpoint.flax_to_torch_key(path, a.ndim)
        out[key] = np.ascontiguousarray(checkpoint.flax_to_torch_layout(path, a)).astype(dtype)
    return out


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def clip_text_config(cfg: Mapping, *, projection: bool) -> dict:
    """A transformers ``config.json`` for a CLIP text encoder from our small config dict."""
    d = {
        "architectures": ["CLIPTextModelWithProjection" if projection else "CLIPTextModel"],
        "model_type": "clip_text_model",
        "attention_dropout": 0.0,
        "dropout": 0.0,
        "initializer_factor": 1.0,
        "initializer_range": 0.02,
        "bos_token_id": 49406,
        "eos_token_id": 49407,
        "pad_token_id": 1,
        "vocab_size": 49408,
        "max_position_embeddings": 77,
        "layer_norm_eps": 1e-5,
        "dtype": "float32",
        "transformers_version": TRANSFORMERS_VERSION,
    }
    d.update(cfg)
    if not projection:
        d.setdefault("projection_dim", d["hidden_size"])
    return d


def write_tokenizer(folder: Path, vocab_dir: Path, pad_token: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(vocab_dir / name, folder / name)
    _write_json(folder / "tokenizer_config.json", {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": pad_token,
        "model_max_length": 77,
        "clean_up_tokenization_spaces": False,
        "do_lower_case": True,
        "tokenizer_class": "CLIPTokenizer",
    })
    _write_json(folder / "special_tokens_map.json", {
        "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>", "pad_token": pad_token})


def export_pipeline(out: str | os.PathLike, *, unet_config: Mapping, unet_params: Mapping,
                    vae_config: Mapping, vae_params: Mapping, te1_config: Mapping,
                    te1_params: Mapping, te2_config: Mapping, te2_params: Mapping,
                    scheduler_config: Mapping, vocab_dir: str | os.PathLike,
                    dtype: Any = np.float16, metadata: Mapping[str, str] | None = None) -> Path:
    """Write the whole pipeline folder (atomically: into ``out.tmp``, then renamed)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    meta = dict(metadata or {}, format="pt")
    index = dict(MODEL_INDEX, scheduler=["diffusers", scheduler_config.get(
        "_class_name", "EulerDiscreteScheduler")])
    _write_json(tmp / "model_index.json", index)
    _write_json(tmp / "unet" / "config.json", {"_class_name": "UNet2DConditionModel",
                                               "_diffusers_version": DIFFUSERS_VERSION,
                                               **unet_config})
    checkpoint.save_safetensors(torch_state_dict(unet_params, dtype),
                                tmp / "unet" / "diffusion_pytorch_model.safetensors", meta)
    _write_json(tmp / "vae" / "config.json", {"_class_name": "AutoencoderKL",
                                              "_diffusers_version": DIFFUSERS_VERSION,
                                              **vae_config})
    checkpoint.save_safetensors(torch_state_dict(vae_params, dtype),
                                tmp / "vae" / "diffusion_pytorch_model.safetensors", meta)
    for name, cfg, params, proj in (("text_encoder", te1_config, te1_params, False),
                                    ("text_encoder_2", te2_config, te2_params, True)):
        _write_json(tmp / name / "config.json", clip_text_config(cfg, projection=proj))
        checkpoint.save_safetensors(torch_state_dict(params, dtype), tmp / name / "model.safetensors",
                                    meta)
    vocab_dir = Path(vocab_dir)
    write_tokenizer(tmp / "tokenizer", vocab_dir, "<|endoftext|>")
    write_tokenizer(tmp / "tokenizer_2", vocab_dir, "!")
    _write_json(tmp / "scheduler" / "scheduler_config.json",
                {"_diffusers_version": DIFFUSERS_VERSION, **scheduler_config})
    for keep in ("README.md", "maxdiff.json"):  # model card and measured defaults: hand-written
        if (out / keep).is_file():
            shutil.copyfile(out / keep, tmp / keep)
    if out.exists():
        old = out.with_name(out.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    return out


def folder_size(path: str | os.PathLike) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
