"""Textual-inversion embeddings, read as the files people download (no torch).

Layouts (safetensors; diffusers' ``learned_embeds.safetensors`` folders too):

- diffusers: one tensor named by its token, ``{"<cat-toy>": (768,) or (n, 768)}``;
- A1111 / Civitai SD 1.x / 2.x: ``{"emb_params": (n, D)}`` (the token: the file's name, or
  ``token=``);
- SDXL: ``{"clip_l": (n, 768), "clip_g": (n, 1280)}``, one table per text encoder.

A1111's ``.pt`` files are torch pickles: maxdiff does not unpickle them (running a pickle runs
code), and says how to convert one. :func:`read_embedding` returns the token and its vectors per
text encoder; :func:`expand` names the vectors of a multi-vector embedding as diffusers does
(``<tok>``, ``<tok>_1``, ...), and :func:`expand_prompt` writes a prompt's token as all of them
(diffusers' ``maybe_convert_prompt``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from maxdiff.checkpoint import CheckpointError, SafetensorsFile

__all__ = ["read_embedding", "expand", "expand_prompt"]

FILE_NAMES = ("learned_embeds.safetensors",)


def _file(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        for name in FILE_NAMES:
            if (p / name).is_file():
                return p / name
        raise CheckpointError(f"{p}: no learned_embeds.safetensors in this folder")
    if not p.is_file():
        raise CheckpointError(f"{p}: no such embedding file")
    if p.suffix in (".pt", ".bin", ".ckpt"):
        raise CheckpointError(
            f"{p}: a torch pickle; maxdiff reads embeddings as safetensors (a pickle runs code "
            "when loaded). Convert it once where torch is installed: "
            "`python -c \"import torch, safetensors.torch as st; d = torch.load('IN.pt'); "
            "st.save_file({'emb_params': d['string_to_param']['*']}, 'OUT.safetensors')\"`")
    return p


def read_embedding(source: str | os.PathLike | Mapping[str, np.ndarray], widths: Mapping[str, int],
                   token: str | None = None) -> tuple[str, dict[str, np.ndarray]]:
    """(token, {text encoder component: vectors (n, D)}) of an embedding file, folder or dict.

    ``widths``: each text encoder's embedding width (``{"text_encoder": 768,
    "text_encoder_2": 1280}``). An SDXL file (``clip_l`` / ``clip_g``) gives one table per
    encoder it has; a one-table file goes to the encoder of its width (SDXL: CLIP-L's for 768).
    ``token`` None: the diffusers file's key, else the file's name. ValueError for an embedding
    whose width fits no encoder, or an SDXL file for a model without those encoders."""
    name = None
    if isinstance(source, Mapping):
        tables = {k: np.asarray(v, np.float32) for k, v in source.items()}
    else:
        path = _file(source)
        f = SafetensorsFile(path)
        tables = {k: np.asarray(f.get(k), np.float32) for k in f.keys()}
        name = path.stem if path.name not in FILE_NAMES else path.parent.name
    where = "the embedding" if name is None else f"embedding {name!r}"
    if not tables:
        raise ValueError(f"{where} holds no tensor")
    sdxl = {"clip_l": "text_encoder", "clip_g": "text_encoder_2"}
    if set(tables) & set(sdxl):
        out = {}
        for key, vectors in tables.items():
            if key not in sdxl:
                continue
            comp = sdxl[key]
            if comp not in widths:  # the refiner has no CLIP-L: its table is not needed
                continue
            out[comp] = _rows(vectors, widths[comp], f"{where}: {key}")
        if not out:
            raise ValueError(f"{where} is an SDXL embedding (clip_l / clip_g) and this model has "
                             f"neither encoder (it has {', '.join(widths)})")
        missing = [sdxl_key for sdxl_key, comp in sdxl.items()
                   if comp in widths and comp not in out]
        if missing:
            raise ValueError(f"{where} has no {' / '.join(missing)} table for this model's "
                             f"{' / '.join(sdxl[m] for m in missing)}")
        return token or name or _need_token(where), out
    if len(tables) != 1:
        raise ValueError(f"{where} holds {len(tables)} tensors ({', '.join(sorted(tables))}); "
                         "an embedding file holds one (diffusers, A1111) or clip_l + clip_g "
                         "(SDXL)")
    key, vectors = next(iter(tables.items()))
    vectors = vectors[None] if vectors.ndim == 1 else vectors
    fits = [comp for comp, w in widths.items() if vectors.shape[-1] == w]
    if not fits:
        raise ValueError(f"{where} has width {vectors.shape[-1]}; it fits none of this model's "
                         f"text encoders ({', '.join(f'{c}: {w}' for c, w in widths.items())})")
    default = key if key not in ("emb_params", "*") else name
    return token or default or _need_token(where), {fits[0]: _rows(vectors, widths[fits[0]],
                                                                    where)}


def _need_token(where: str) -> str:
    raise ValueError(f"{where} does not name its token: pass token=")


def _rows(vectors: np.ndarray, width: int, where: str) -> np.ndarray:
    vectors = vectors[None] if vectors.ndim == 1 else vectors
    if vectors.ndim != 2 or vectors.shape[-1] != width:
        raise ValueError(f"{where} has shape {tuple(vectors.shape)}; this encoder needs "
                         f"(n, {width})")
    return vectors


def expand(token: str, n: int) -> list[str]:
    """The token of each of ``n`` vectors: ``token``, ``token_1``, ... (diffusers' names)."""
    return [token] + [f"{token}_{i}" for i in range(1, n)]


def expand_prompt(prompt: str, tokens: Mapping[str, Sequence[str]]) -> str:
    """``prompt`` with each embedding token written as all of its vectors' tokens
    (``tokens``: token -> :func:`expand`'s list)."""
    for token, names in tokens.items():
        if len(names) > 1 and token in prompt:
            prompt = prompt.replace(token, " ".join(names))
    return prompt
