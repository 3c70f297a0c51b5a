"""Textual-inversion embeddings on a loaded pipeline (diffusers' ``load_textual_inversion``):
:class:`TextualInversion` is a base of :class:`pipelines.TextToImagePipeline`.

Each embedding's tokens are added to the tokenizers of the encoders it has vectors for, and its
vectors become new rows of those encoders' token-embedding tables, at the ids the tokenizers
give the new tokens (the table cut to the tokenizer's length first, as transformers'
``resize_token_embeddings`` does). Step engines made before an embedding is loaded keep the
old tables: make them after. A prompt's token is written as all of its vectors' tokens
before it is read (``<tok>`` -> ``<tok> <tok>_1 ...``), in every syntax. The tables are inputs
of every program: loading an embedding recompiles only for the new table size."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from maxdiff import embeddings as emblib
from maxdiff import mesh as meshlib

__all__ = ["TextualInversion"]

TABLE = ("text_model", "embeddings", "token_embedding", "embedding")


def _table(tree: Mapping) -> Any:
    for key in TABLE:
        tree = tree[key]
    return tree


def _with_table(tree: Mapping, table) -> dict:
    """``tree`` with its token-embedding table replaced (the other arrays shared)."""
    out = dict(tree)
    node = out
    for key in TABLE[:-1]:
        node[key] = dict(node[key])
        node = node[key]
    node[TABLE[-1]] = table
    return out


class TextualInversion:
    """``load_textual_inversion`` for :class:`pipelines.TextToImagePipeline`."""

    @property
    def embedding_tokens(self) -> dict[str, list[str]]:
        """Each loaded embedding's token -> the tokens of its vectors."""
        return self.__dict__.setdefault("_embedding_tokens", {})

    def load_textual_inversion(self, source: str | os.PathLike | Mapping[str, Any],
                               token: str | None = None) -> str:
        """Load a textual-inversion embedding (a ``.safetensors`` file, a folder with
        ``learned_embeds.safetensors``, or a dict of arrays: see :mod:`maxdiff.embeddings`)
        into this pipeline's text encoders; ``token``: the word prompts use (default: the
        file's own, else its name). SDXL files (``clip_l`` / ``clip_g``) load into both
        encoders; a one-table file into the encoder of its width. Returns the token.
        ValueError for a token the tokenizers already know, a width no encoder has, a file of
        another layout; a torch ``.pt`` file is refused with the command that converts it."""
        encoders = self.family.encoders
        tokenizers = {"text_encoder": self.tokenizer, "text_encoder_2": self.tokenizer_2}
        widths = {c: int(_table(self.params[c]).shape[-1]) for c in encoders}
        tok, vectors = emblib.read_embedding(source, widths, token)
        names = {c: emblib.expand(tok, len(vectors[c])) for c in encoders if c in vectors}
        for comp, words in names.items():
            known = [w for w in words if w in tokenizers[comp].get_vocab()]
            if known:
                raise ValueError(f"token {known[0]!r} is already in {comp}'s tokenizer (an "
                                 "embedding loaded already, or a word of the model's vocabulary);"
                                 " pass another token=")
        counts = {len(w) for w in names.values()}
        if len(counts) > 1:
            raise ValueError(f"embedding {tok!r} has a different number of vectors per encoder "
                             f"({', '.join(f'{c}: {len(w)}' for c, w in names.items())})")
        rep = meshlib.replicated(self.mesh)
        for comp, words in names.items():
            module = getattr(self, comp)
            tk = tokenizers[comp]
            start = len(tk)
            tk.add_tokens(words)
            ids = tk.convert_tokens_to_ids(words)
            if ids != list(range(start, start + len(words))):
                raise ValueError(f"{comp}'s tokenizer gave {words} the ids {ids}; expected "
                                 f"{start}..{start + len(words) - 1}")
            for attr in ("params", "_base_params"):
                params = getattr(self, attr, None)
                if params is None:
                    continue
                old = _table(params[comp])
                table = np.concatenate([np.asarray(old)[:start],
                                        vectors[comp].astype(np.asarray(old).dtype)])
                params[comp] = _with_table(params[comp], meshlib.place(table, rep))
            # the module's vocabulary follows (flax checks the table's shape); programs are
            # kept per text-encoder module, so the next call compiles for the new table
            setattr(self, comp, module.clone(config=dataclasses.replace(
                module.config, vocab_size=start + len(words))))
        self.embedding_tokens[tok] = next(iter(names.values()))
        return tok

    def expand_embeddings(self, prompt: str) -> str:
        """``prompt`` with each loaded embedding's token written as its vectors' tokens."""
        return emblib.expand_prompt(prompt, self.embedding_tokens)
