"""Long and weighted prompts -> what a compiled program encodes (:class:`Text`), on the host.

A prompt is read in its syntax (:mod:`maxdiff.prompt_syntax`), tokenized fragment by fragment and
laid out in chunks of the tokenizer's ``model_max_length`` (77): ``<|startoftext|>``, up to 75
tokens, ``<|endoftext|>``, the tokenizer's pad token, as A1111 and compel both do. Every chunk
is encoded on its own and the states are concatenated along the sequence. The split points:

- ``a1111``: 75 tokens a chunk; a chunk that would cut a phrase ends after its last comma when
  that comma is among its last 20 tokens (A1111's ``comma_padding_backtrack``); ``BREAK``
  starts a new chunk. Weights: each chunk's states are multiplied by the per-token weights and
  rescaled so their mean stays what it was (A1111's "Original" emphasis; A1111 takes that mean
  over the whole batch, maxdiff per prompt, so an image does not depend on its batch). The
  pooled embedding (SDXL) is the first chunk's.
- ``compel``: a long text splits at its last sentence end (``.``) in the window, else the last
  phrase end (``. , ; :``), else the last word end (compel's ``SENTENCES`` mode). Weights:
  ``empty + (z - empty) * w`` where the weight is not 1 (``empty``: the states of the empty
  prompt); a fragment weighted below 1 is blended out: the prompt is encoded again with that
  fragment's tokens masked from attention and the two are mixed with weights 1 and
  ``tan((1 - w) pi / 2)`` (compel's ``DownweightMode.MASK``), as ``Compel(...,
  truncate_long_prompts=False)`` does by default. The pooled embedding is that of the prompt
  as written, cut at 77 tokens (compel's ``get_pooled_embeddings``).
- ``none``: the text as written (weight 1), split as compel splits it; the pooled embedding
  as compel's (the text cut at 77 tokens, which is diffusers' encoding of a short prompt).

A prompt with one chunk, no weights and nothing masked encodes exactly as diffusers encodes it.
:func:`plan` makes one prompt's :class:`Plan` per tokenizer; :func:`pack` lays the plans of a
batch out as one :class:`Text` (every row padded with empty chunks to the batch's count, which
the runner keeps equal within a device batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from maxdiff.prompt_syntax import DEFAULT_SYNTAX, parse
from maxdiff.tokenizers import TOKENIZER_LOCK

__all__ = ["Plan", "Text", "plan", "pack", "empty_ids", "COMMA_BACKTRACK"]

COMMA_BACKTRACK = 20  # A1111's comma_padding_backtrack


@dataclass
class Plan:
    """One prompt for one tokenizer: ``ids`` / ``weights`` (C*L,) in C chunks of L tokens,
    ``masks`` (V, C*L) attention masks of the V encodings mixed with ``coefs`` (V,) (variant 0
    is the prompt itself), ``pooled_ids`` (L,) the ids the pooled embedding
    comes from, ``lerp``: compel's weighting (from the empty prompt) rather than A1111's."""

    ids: np.ndarray
    weights: np.ndarray
    masks: np.ndarray
    coefs: np.ndarray
    pooled_ids: np.ndarray
    lerp: bool
    tokens: int  # the prompt's own tokens (no markers, no padding)

    @property
    def chunks(self) -> int:
        return len(self.ids) // len(self.pooled_ids)


@jax.tree_util.register_dataclass
@dataclass
class Text:
    """A batch's prompts as a program encodes them (images on axis 0; E = 2 tokenizer rows,
    the second a copy where a model has one): ``ids`` / ``weights`` (N, E, T),
    ``masks`` (N, E, V, T), ``coefs`` (N, E, V), ``empty`` (N, E, L) the empty prompt's
    chunk, ``pooled_ids`` (N, L), ``lerp`` (N,), ``used`` (N,) the chunks each row needs
    (the rest pad it to the batch's count).
    ``weighted`` / ``own_pooled`` (static): whether any row needs the weighting arithmetic /
    a pooled embedding of its own ids (both False: diffusers' encoding, exactly)."""

    ids: Any
    weights: Any
    masks: Any
    coefs: Any
    empty: Any
    pooled_ids: Any
    lerp: Any
    used: Any
    weighted: bool = field(default=False, metadata={"static": True})
    own_pooled: bool = field(default=False, metadata={"static": True})

    @property
    def chunks(self) -> int:
        return self.ids.shape[-1] // self.pooled_ids.shape[-1]

    def take(self, idx) -> Text:
        """The rows ``idx`` (host arrays), cut to the chunks they use and the encodings they
        mix (padding is a suffix of both), their static flags recomputed."""
        rows = [np.asarray(a)[idx] for a in (self.ids, self.weights, self.masks, self.coefs,
                                               self.empty)]
        n = self.pooled_ids.shape[-1]
        size = int(np.max(np.asarray(self.used)[idx])) * n
        v = int(np.max(np.sum(rows[3] != 0, axis=-1)))
        ids, weights, masks, coefs, empty = rows
        return _text(ids[..., :size], weights[..., :size], masks[:, :, :v, :size],
                     coefs[..., :v], empty, np.asarray(self.pooled_ids)[idx],
                     np.asarray(self.lerp)[idx], np.asarray(self.used)[idx])


def _length(tokenizer) -> int:
    n = tokenizer.model_max_length
    if n is None or n > 100_000:
        raise ValueError(f"tokenizer has no usable model_max_length ({n}); set "
                         "\"model_max_length\": 77 in its tokenizer_config.json")
    return int(n)


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's token ids without start / end markers, untruncated."""
    if not texts:
        return []
    out = tokenizer(texts, truncation=False, padding=False, add_special_tokens=False,
                    verbose=False).input_ids
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return [[t for t in ids if t not in (bos, eos)] for ids in out]


def _layout(tokenizer, chunks: list[tuple[list[int], list[float]]]):
    """Chunks of (tokens, weights) -> ids, weights (C*L,) with markers and padding."""
    n = _length(tokenizer)
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    ids, weights = [], []
    for toks, ws in chunks:
        fill = n - 2 - len(toks)
        ids += [bos, *toks, eos, *[pad] * fill]
        weights += [1.0, *ws, 1.0, *[1.0] * fill]
    return np.asarray(ids, np.int32), np.asarray(weights, np.float32)


def _comma(tokenizer) -> int | None:
    """The id of CLIP's ``,</w>`` token (None where the vocabulary has none): one lookup, not
    ``get_vocab()``, which builds the whole 49,408-entry dict (14 ms a prompt)."""
    tid = tokenizer.convert_tokens_to_ids(",</w>")
    return None if tid is None or (tid == tokenizer.unk_token_id
                                   and tokenizer.unk_token != ",</w>") else int(tid)


def _chunks_a1111(tokenizer, frags, window: int):
    comma = _comma(tokenizer)
    chunks: list[tuple[list[int], list[float]]] = []
    toks: list[int] = []
    ws: list[float] = []
    last_comma = -1

    def close():
        nonlocal toks, ws, last_comma
        chunks.append((toks, ws))
        toks, ws, last_comma = [], [], -1

    texts = [t for t, w in frags if w is not None]
    tokenized = iter(_ids(tokenizer, texts))
    for _, weight in frags:
        if weight is None:  # BREAK
            close()
            continue
        for tok in next(tokenized):
            if tok == comma:
                last_comma = len(toks)
            elif (len(toks) == window and last_comma != -1
                  and len(toks) - last_comma <= COMMA_BACKTRACK):
                cut = last_comma + 1
                moved = (toks[cut:], ws[cut:])
                toks, ws = toks[:cut], ws[:cut]
                close()
                toks, ws = list(moved[0]), list(moved[1])
            if len(toks) == window:
                close()
            toks.append(tok)
            ws.append(weight)
    if toks or not chunks:
        close()
    return chunks


def _split_compel(tokenizer, toks: list[int], window: int) -> int:
    """Where compel's SENTENCES mode ends a chunk of ``toks``: after the last '.' in the
    window, else the last phrase mark, else the last word end, else at the window."""
    if len(toks) <= window:
        return window
    words = tokenizer.convert_ids_to_tokens(toks[:window])
    for marks in ((".</w>",), (".</w>", ",</w>", ";</w>", ":</w>"), None):
        for k in range(len(words) - 1, -1, -1):
            if (words[k].endswith("</w>") if marks is None else words[k] in marks):
                return k + 1
    return window


def _chunks_compel(tokenizer, toks: list[int], ws: list[float], window: int):
    chunks = []
    while True:
        cut = _split_compel(tokenizer, toks, window)
        chunks.append((toks[:cut], ws[:cut]))
        toks, ws = toks[cut:], ws[cut:]
        if not toks:
            return chunks


def plan(text: str, tokenizer, syntax: str = DEFAULT_SYNTAX) -> Plan:
    """One prompt for one tokenizer (:class:`Plan`); PromptSyntaxError for text its syntax
    cannot read. Thread-safe: the tokenizer is used under
    :data:`maxdiff.tokenizers.TOKENIZER_LOCK`."""
    with TOKENIZER_LOCK:
        return _plan(text, tokenizer, syntax)


def _plan(text: str, tokenizer, syntax: str) -> Plan:
    n = _length(tokenizer)
    window = n - 2
    frags = parse(text, syntax)
    pooled = np.asarray(tokenizer([text], padding="max_length", max_length=n, truncation=True,
                                  return_tensors="np").input_ids[0], np.int32)
    if syntax == "a1111":
        chunks = _chunks_a1111(tokenizer, frags, window)
        ids, weights = _layout(tokenizer, chunks)
        size = len(ids)
        return Plan(ids, weights, np.ones((1, size), np.int32), np.ones(1, np.float32),
                    ids[:n].copy(), False,
                    sum(len(t) for t, _ in chunks))
    per_frag = _ids(tokenizer, [t for t, _ in frags])
    toks = [t for ids in per_frag for t in ids]
    ws = [float(w) for ids, (_, w) in zip(per_frag, frags) for _ in ids]
    chunks = _chunks_compel(tokenizer, toks, ws, window)
    ids, weights = _layout(tokenizer, chunks)
    size = len(ids)
    # the position of each fragment's tokens in the chunked layout
    where = [c * n + 1 + j for c, (toks_c, _) in enumerate(chunks) for j in range(len(toks_c))]
    masks, lerps = [np.ones(size, np.int32)], [1.0]
    pos = 0
    for frag_ids, (_, w) in zip(per_frag, frags):
        span = where[pos:pos + len(frag_ids)]
        pos += len(frag_ids)
        if w >= 1 or not span:
            continue
        m = np.ones(size, np.int32)
        m[span[0]:span[-1] + 1] = 0
        m[0::n] = 1
        m[n - 1::n] = 1
        masks.append(m)
        lerps.append(math.tan((1.0 - max(1e-5, w)) * math.pi / 2))
    coefs = np.asarray(lerps, np.float32)
    coefs = coefs / coefs.sum(dtype=np.float32)
    return Plan(ids, weights, np.stack(masks), coefs, pooled, syntax == "compel", len(toks))


def _padded(p: Plan, chunks: int, variants: int, empty: np.ndarray) -> Plan:
    n = len(p.pooled_ids)
    extra = chunks - p.chunks
    size = chunks * n
    ids = np.concatenate([p.ids, np.tile(empty, extra)])
    weights = np.concatenate([p.weights, np.ones(extra * n, np.float32)])
    masks = np.ones((variants, size), np.int32)
    masks[:len(p.masks), :len(p.ids)] = p.masks
    coefs = np.zeros(variants, np.float32)
    coefs[:len(p.coefs)] = p.coefs
    return Plan(ids, weights, masks, coefs, p.pooled_ids, p.lerp, p.tokens)


def empty_ids(tokenizer) -> np.ndarray:
    """The empty prompt's chunk: start, end, padding."""
    return _layout(tokenizer, [([], [])])[0]


def pack(rows: list[tuple[Plan, Plan]], empties: tuple[np.ndarray, np.ndarray],
         chunks: int | None = None) -> Text:
    """Each image's (first tokenizer's, second tokenizer's) plans -> one :class:`Text`, every
    row padded with empty chunks (``empties``: each tokenizer's empty chunk ids) to ``chunks``
    (default: the most any row has) and to the batch's number of masked encodings. The
    pooled ids are the second plan's."""
    c = chunks or max(p.chunks for pair in rows for p in pair)
    v = max(len(p.coefs) for pair in rows for p in pair)
    padded = [tuple(_padded(p, c, v, e) for p, e in zip(pair, empties)) for pair in rows]

    def stack(name):
        return np.stack([np.stack([getattr(p, name) for p in pair]) for pair in padded])
    return _text(stack("ids"), stack("weights"), stack("masks"), stack("coefs"),
                 np.stack([np.stack(empties)] * len(rows)),
                 np.stack([pair[1].pooled_ids for pair in padded]),
                 np.array([pair[1].lerp for pair in padded]),
                 np.array([max(p.chunks for p in pair) for pair in rows], np.int32))


def _text(ids, weights, masks, coefs, empty, pooled_ids, lerp, used) -> Text:
    """A :class:`Text` with its static flags read from its arrays."""
    weighted = bool(masks.shape[2] > 1 or not np.all(weights == 1.0))
    own = not np.array_equal(pooled_ids, ids[:, 1, :pooled_ids.shape[-1]])
    return Text(ids=ids, weights=weights, masks=masks, coefs=coefs, empty=empty,
                pooled_ids=pooled_ids, lerp=lerp, used=used, weighted=weighted, own_pooled=own)
