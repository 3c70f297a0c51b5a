"""CLIP tokenizers of a diffusers checkpoint, and prompt -> token id arrays.

SDXL has two: ``tokenizer/`` (pads with ``<|endoftext|>``) and ``tokenizer_2/`` (pads with
``!``, id 0). Both are transformers' ``CLIPTokenizer`` (backed by the ``tokenizers`` library in
transformers 5), read from either ``tokenizer.json`` or ``vocab.json`` + ``merges.txt``.

:func:`tokenize` produces exactly the ids diffusers' ``StableDiffusionXLPipeline.encode_prompt``
feeds its text encoders: ``<|startoftext|>``, the prompt truncated to fit, ``<|endoftext|>``,
then the tokenizer's own pad token up to ``model_max_length`` (77). Runs on the host; no torch.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["bytes_to_unicode", "load_tokenizer", "load_tokenizers", "tokenize"]

_TOKENIZER_FILES = ("tokenizer.json", "vocab.json")


def load_tokenizer(folder: str | os.PathLike) -> Any:
    """A ``transformers.CLIPTokenizer`` from one tokenizer folder.

    The folder holds ``tokenizer.json`` or ``vocab.json`` + ``merges.txt`` (and usually
    ``tokenizer_config.json``, which sets the pad token and ``model_max_length``).
    """
    from transformers import CLIPTokenizer  # tokenizers only; transformers' torch models never

    p = Path(folder)
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such tokenizer folder")
    if not any((p / f).is_file() for f in _TOKENIZER_FILES):
        found = sorted(x.name for x in p.iterdir())
        raise FileNotFoundError(
            f"{p}: no tokenizer.json or vocab.json + merges.txt found; the folder holds: "
            f"{found or 'nothing'}"
        )
    if (p / "vocab.json").is_file() and not (p / "tokenizer.json").is_file() \
            and not (p / "merges.txt").is_file():
        raise FileNotFoundError(f"{p}: vocab.json without merges.txt; a CLIP tokenizer needs both")
    return CLIPTokenizer.from_pretrained(str(p))


def load_tokenizers(root: str | os.PathLike,
                    names: Sequence[str] = ("tokenizer", "tokenizer_2")) -> tuple[Any, ...]:
    """The tokenizers of a diffusers pipeline folder, in the order of ``names``.

    SDXL base: ``(tokenizer, tokenizer_2)``; the SDXL refiner has only ``tokenizer_2``, so
    pass ``names=("tokenizer_2",)`` for it.
    """
    return tuple(load_tokenizer(Path(root) / n) for n in names)


# A fast tokenizer keeps its truncation and padding settings in the tokenizer object itself:
# each call sets them, then encodes, so two threads tokenizing at once can encode with the
# other's settings (a prompt padded to 77 tokens where padding was off reads as 2 chunks).
# Every call of a tokenizer here holds this lock (the step engine plans a tick's prompts on its
# thread while the event loop checks new ones).
TOKENIZER_LOCK = threading.RLock()


def tokenize(tokenizer: Any, prompts: Sequence[str]) -> np.ndarray:
    """Token ids (B, model_max_length) int32 for a list of prompts, as diffusers makes them.

    Same call as ``StableDiffusionXLPipeline.encode_prompt``: ``padding="max_length"``,
    ``max_length=tokenizer.model_max_length``, ``truncation=True`` (a long prompt keeps its
    first ``model_max_length - 2`` tokens and still ends with ``<|endoftext|>``).
    """
    if isinstance(prompts, str):
        raise TypeError("tokenize() takes a list of prompts, not a single string")
    prompts = list(prompts)
    n = tokenizer.model_max_length
    if n is None or n > 100_000:
        raise ValueError(
            f"tokenizer has no usable model_max_length ({n}); set \"model_max_length\": 77 "
            "in its tokenizer_config.json"
        )
    if not prompts:
        return np.zeros((0, n), np.int32)
    with TOKENIZER_LOCK:
        ids = tokenizer(prompts, padding="max_length", max_length=n, truncation=True,
                        return_tensors="np").input_ids
    return np.asarray(ids, dtype=np.int32)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))
