"""diffusers-style call arguments -> one :class:`pipelines.requests.ImageRequest` per image
(every pipeline's ``__call__``): prompts and their per-prompt lists fanned out over
``num_images_per_prompt``, and the seeds (:func:`call_seeds`); a batch's prompts -> what its
program encodes (:func:`texts`: long and weighted prompts, :mod:`maxdiff.prompts`)."""

from __future__ import annotations

import numpy as np

from maxdiff import prompts as promptlib
from maxdiff.prompt_syntax import DEFAULT_SYNTAX, PromptSyntaxError
from pipelines.limits import (
    MAX_SEED,
    check,
    n_problem,
    prompt_length_problem,
    seed_problem,
)
from pipelines.requests import ImageRequest, image_seeds

__all__ = ["prompt_items", "call_seeds", "texts"]


def _as_list(x, name: str) -> list[str] | None:
    if x is None:
        return None
    if isinstance(x, str):
        return [x]
    if isinstance(x, (list, tuple)) and all(isinstance(p, str) for p in x):
        return list(x)
    raise ValueError(f"{name} must be a string or a list of strings, got {type(x).__name__}")


def prompt_items(prompt, prompt_2, negative_prompt, negative_prompt_2,
                 num_images_per_prompt: int, seed, *, per_prompt: dict | None = None,
                 guidance_scale: float | None, negative_original_size=None,
                 negative_crops_coords_top_left=(0, 0), negative_target_size=None,
                 ip_adapter_image=None, **fields) -> tuple[list[ImageRequest], dict]:
    """The diffusers-style ``__call__`` arguments -> one :class:`ImageRequest` per image.

    ``prompt_2`` and the negatives (and each list in ``per_prompt``, e.g. the edit
    pipelines' images) give one entry per prompt or a single one for all; image k gets
    prompt ``k // num_images_per_prompt``. ``fields`` go to every request as they are;
    ``guidance_scale`` None is the pipeline's default, set where the items are checked. The
    ``negative_*`` size conditioning (SDXL's, as diffusers names it) applies when both sizes
    are given. ``ip_adapter_image``: an image prompt for every image, or a list of one per
    prompt (None entries: none).
    Returns the requests and, per ``per_prompt`` name, each image's entry."""
    prompts = _as_list(prompt, "prompt")
    if not prompts:
        raise ValueError("prompt is empty: give a prompt string or a non-empty list of prompts")
    n_prompts = len(prompts)
    check([n_problem(num_images_per_prompt)])
    lists = {"prompt_2": _as_list(prompt_2, "prompt_2") or prompts,
             "negative_prompt": _as_list(negative_prompt, "negative_prompt"),
             "negative_prompt_2": _as_list(negative_prompt_2, "negative_prompt_2"),
             **(per_prompt or {})}
    if ip_adapter_image is not None:
        lists["ip_adapter_image"] = (list(ip_adapter_image)
                                     if isinstance(ip_adapter_image, (list, tuple))
                                     else [ip_adapter_image])
    for name, lst in lists.items():
        if lst is not None and len(lst) == 1 and n_prompts > 1:
            lists[name] = lst * n_prompts
        if lists[name] is not None and len(lists[name]) != n_prompts:
            raise ValueError(f"{name} has {len(lst)} entries but prompt has {n_prompts}; "
                             "give one per prompt (or a single one)")
    if negative_original_size is not None and negative_target_size is not None:
        fields["negative_size"] = (tuple(negative_original_size),
                                   tuple(negative_crops_coords_top_left),
                                   tuple(negative_target_size))
    n = n_prompts * num_images_per_prompt
    seeds = call_seeds(seed, n)
    per_image = [k // num_images_per_prompt for k in range(n)]

    def pick(name, i):
        return None if lists[name] is None else lists[name][i]

    items = [ImageRequest(prompt=prompts[i], prompt_2=pick("prompt_2", i),
                          negative_prompt=pick("negative_prompt", i),
                          negative_prompt_2=pick("negative_prompt_2", i), seed=seeds[k],
                          guidance_scale=guidance_scale,
                          ip_adapter_image=pick("ip_adapter_image", i) if ip_adapter_image
                          is not None else None, **fields)
             for k, i in enumerate(per_image)]
    return items, {name: [pick(name, i) for i in per_image] for name in (per_prompt or {})}


def call_seeds(seed, n: int) -> list[int | None]:
    """Per-image seeds from ``seed``: one int (image k gets seed + k), one per image, or None
    (stays None: the pipeline draws them)."""
    if seed is None or isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return image_seeds(seed, n)
    if not isinstance(seed, (list, tuple, np.ndarray)):
        raise ValueError(f"seed={seed!r}; give one int in 0..{MAX_SEED}, a list of one int "
                         "per image, or None")
    seeds = list(seed)
    check(seed_problem(s) for s in seeds)
    seeds = [int(s) for s in seeds]
    if len(seeds) != n:
        raise ValueError(f"seed has {len(seeds)} values but {n} image(s) are generated; "
                         "give one int, or one per image")
    return seeds


def check_prompts(pipe, items, max_chunks: int | None = None, why: str = "") -> None:
    """ValueError naming the field of any item's prompt or negative that ``pipe`` cannot
    encode: unreadable in its syntax, longer than the limit (``max_chunks`` chunks with
    ``why``, else :data:`pipelines.limits.MAX_PROMPT_CHUNKS`)."""
    for it in items:
        for name, pair in zip(("prompt", "negative_prompt"), _plans(pipe, it)):
            worst = max(pair, key=lambda p: p.chunks)
            if max_chunks is not None and worst.chunks > max_chunks:
                raise ValueError(f"{name}: has {worst.tokens} tokens in {worst.chunks} chunks of "
                                 f"75; at most {max_chunks} here ({why})")


def _plans(pipe, item: ImageRequest) -> tuple[tuple, tuple]:
    """(prompt, negative) plans of one image, one per tokenizer row (:func:`texts`)."""
    syntax = item.prompt_syntax or DEFAULT_SYNTAX
    first, second = pipe.tokenizer or pipe.tokenizer_2, pipe.tokenizer_2 or pipe.tokenizer
    refiner = pipe.tokenizer is None  # tokenizer_2 reads the prompt itself, as diffusers does
    neg = item.negative_prompt or ""
    fields = (("prompt", item.prompt, item.prompt if refiner else item.prompt_2 or item.prompt),
              ("negative_prompt", neg, neg if refiner else item.negative_prompt_2 or neg))
    expand = getattr(pipe, "expand_embeddings", None)  # textual-inversion tokens
    if expand is not None and pipe.embedding_tokens:
        fields = tuple((name, expand(a), expand(b)) for name, a, b in fields)
    pairs, problems = [], []
    for name, text, text_2 in fields:
        try:
            one = promptlib.plan(text, first, syntax)
            two = one if second is first and text_2 == text else promptlib.plan(text_2, second,
                                                                                syntax)
        except PromptSyntaxError as e:
            raise ValueError(f"{name}: {e} (prompt_syntax={syntax!r})") from None
        pairs.append((one, two))
        worst = max((one, two), key=lambda p: p.chunks)
        problems.append(prompt_length_problem(worst.chunks, worst.tokens, name))
    check(problems)
    return pairs[0], pairs[1]


def texts(pipe, items) -> tuple[promptlib.Text, promptlib.Text]:
    """The batch's prompts and negatives as its program encodes them
    (:class:`maxdiff.prompts.Text`), each image padded to the chunks the longer of its prompt
    and negative needs and the batch to its longest image (:func:`pipelines.runner.run` keeps
    images with different chunk counts in separate device batches). ValueError naming the
    field for a prompt its syntax cannot read or one over the length limit."""
    plans = [_plans(pipe, it) for it in items]
    first, second = pipe.tokenizer or pipe.tokenizer_2, pipe.tokenizer_2 or pipe.tokenizer
    empties = (promptlib.empty_ids(first), promptlib.empty_ids(second))
    pos = [p for p, _ in plans]
    neg = [n for _, n in plans]
    used = np.array([max(q.chunks for pair in (p, n) for q in pair) for p, n in plans])
    chunks = int(used.max())
    text, neg_text = promptlib.pack(pos, empties, chunks), promptlib.pack(neg, empties, chunks)
    text.used = neg_text.used = used.astype(np.int32)
    return text, neg_text
