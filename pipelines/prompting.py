"""diffusers-style call arguments -> one :class:`pipelines.requests.ImageRequest` per image
(every pipeline's ``__call__``): prompts and their per-prompt lists fanned out over
``num_images_per_prompt``, and the seeds (:func:`call_seeds`)."""

from __future__ import annotations

import numpy as np

from pipelines.limits import MAX_SEED, check, n_problem, seed_problem
from pipelines.requests import ImageRequest, image_seeds

__all__ = ["prompt_items", "call_seeds"]


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
                 **fields) -> tuple[list[ImageRequest], dict]:
    """The diffusers-style ``__call__`` arguments -> one :class:`ImageRequest` per image.

    ``prompt_2`` and the negatives (and each list in ``per_prompt``, e.g. the edit
    pipelines' images) give one entry per prompt or a single one for all; image k gets
    prompt ``k // num_images_per_prompt``. ``fields`` go to every request as they are;
    ``guidance_scale`` None is the pipeline's default, set where the items are checked. The
    ``negative_*`` size conditioning (SDXL's, as diffusers names it) applies when both sizes
    are given.
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
                          guidance_scale=guidance_scale, **fields)
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
