"""What the ingress checks before a job reaches a generator: the deadline header, this server's
limits (the serve args tightened by the model), the request rules of :mod:`pipelines.limits`,
adapters, streaming, and the images of an edit. Every problem is a 422 naming its field in the
words of the route that was called ("native" or "openai")."""

from __future__ import annotations

import asyncio
import base64
import math
import time
from typing import Any

from fastapi import Request

from pipelines.conditioned_requests import EditRequest
from pipelines.field_names import field_name
from pipelines.image_files import decode_image, repaint_mask
from pipelines.limits import (
    STRENGTH,
    Limits,
    cfg_cutoff_problem,
    cost_problem,
    deepcache_problem,
    hires_problems,
    ip_adapter_scale_problem,
    prompt_text_problems,
    sampler_problem,
)
from pipelines.limits import problems as rule_problems
from pipelines.requests import HiresFix
from serving.errors import TIMEOUT_HEADER, invalid, invalid_all
from serving.settings import ServeSettings

DEFAULT_MAX_SIZE = 2048  # pixels per side when neither the serve args nor the model say

Problem = tuple[str, str, Any]  # (field, message, value)


def deadline(request: Request, s: ServeSettings) -> float:
    """When the request must be answered (``time.monotonic()``): ``request_timeout_s``, or the
    shorter ``X-Request-Timeout`` header."""
    timeout = s.request_timeout_s
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is not None:
        try:
            asked = float(raw)
        except ValueError:
            asked = math.nan
        if not (math.isfinite(asked) and asked > 0):
            raise invalid(TIMEOUT_HEADER.lower(), f"must be a number of seconds > 0 "
                          f"(at most {timeout:g}), got {raw!r}", raw, where="header")
        timeout = min(timeout, asked)
    return time.monotonic() + timeout


def limits(s: ServeSettings, info: dict) -> Limits:
    """What requests may ask for on this server: the serve args, tightened by the model
    (its scheduler's step limit, its size multiple, its maxdiff.json max_size), with whose
    limit each is (``*_why``) for error messages."""
    steps, steps_why = s.max_steps, "the serve arg max_steps"
    if info.get("max_steps") and info["max_steps"] < steps:
        steps, steps_why = info["max_steps"], f"what this model's {info['scheduler']} allows"
    multiple = math.lcm(s.size_multiple or 1, info["size_multiple"])  # config: stricter only
    hi, size_why = s.max_size, "the serve arg max_size"
    if hi is None and info.get("max_size"):
        hi, size_why = info["max_size"], ("this model's maxdiff.json max_size; the serve arg "
                                          "max_size raises it")
    elif hi is None:
        hi, size_why = DEFAULT_MAX_SIZE, ""
    return Limits(multiple=multiple, min_size=s.min_size, max_size=hi, max_steps=steps,
                  max_guidance=s.max_guidance, max_n=s.max_n, max_cost=s.max_cost,
                  steps_why=steps_why, size_why=size_why,
                  guidance_why="the serve arg max_guidance", n_why="the serve arg max_n")


def problems(s: ServeSettings, info: dict, door: str, *, prompt: str,
             negative_prompt: str | None = None, prompt_syntax: str | None = None, steps,
             guidance=None, seed=None, n, width, height, strength=None) -> list[Problem]:
    """Every problem of a request, (field in ``door``'s words, message, value): the rules of
    :mod:`pipelines.limits` against this server's limits, the prompts' lengths and their
    weighting syntax (the token count is the replicas' to check: they hold the tokenizer)."""
    found = rule_problems(limits(s, info), steps=steps, guidance=guidance, seed=seed, n=n,
                          width=width, height=height, strength=strength)
    out = {}  # one entry per (field, message): OpenAI's one "size" field, both sides
    for p in found:
        out.setdefault((field_name(p.field, door), p.message), p.value)
    errors = [(f, m, v) for (f, m), v in out.items()]
    for field, text in (("prompt", prompt), ("negative_prompt", negative_prompt)):
        if text is not None and len(text) > s.max_prompt_chars:
            errors.append((field, f"{field} has {len(text)} characters; at most "
                           f"{s.max_prompt_chars} are accepted", None))
    errors += [(field_name(p.field, door), p.message, p.value) for p in prompt_text_problems(
        prompt_syntax, prompt=prompt, negative_prompt=negative_prompt)]
    return errors


def feature_cache_problems(s: ServeSettings, door: str, cfg_cutoff, deepcache_interval,
                           edit: bool = False) -> list[Problem]:
    """A request's feature caching (``cfg_cutoff``, ``deepcache_interval``: the rules of
    :mod:`pipelines.limits`), and DeepCache on a server with engine=step, which cannot run it
    (its ticks share one UNet call between images at different steps; edits run on
    engine=batch's backend on either engine): refused here, before the request is queued."""
    found = [p for p in (cfg_cutoff_problem(cfg_cutoff), deepcache_problem(deepcache_interval))
             if p is not None]
    errors = [(field_name(p.field, door), p.message, p.value) for p in found]
    if not found and deepcache_interval != 1 and s.engine == "step" and not edit:
        errors.append((field_name("deepcache_interval", door), "this server runs engine=step, "
                       "which cannot run DeepCache (images at different steps share one UNet "
                       "call); send 1 or omit it (engine=batch servers and the Python API run "
                       "it)", deepcache_interval))
    return errors


def hires_fix(s: ServeSettings, info: dict, door: str, body, *, steps, n, width, height,
              errors: list) -> HiresFix | None:
    """A request's hires fix (``body.hires_scale``, ``hires_strength``, ``hires_steps``; None
    when ``hires_scale`` is omitted), its problems added to ``errors``: the rules of
    :mod:`pipelines.limits`, and both passes' cost (the first at the full size: an upper
    bound) against the serve arg ``max_cost``."""
    scale, strength, more = body.hires_scale, body.hires_strength, body.hires_steps
    if scale is None:
        errors += [(field_name(name, door), "needs hires_scale (without it there is no hires "
                    "fix)", v) for name, v in (("hires_strength", strength),
                                               ("hires_steps", more)) if v is not None]
        return None
    strength = HiresFix.strength if strength is None else strength
    lim = limits(s, info)
    found = hires_problems(scale, strength, more, steps, width, height, lim.multiple,
                           lim.min_size, lim.max_steps, lim.steps_why)
    if not found and lim.max_cost is not None and not errors:
        second = int((steps if more is None else more) * strength)
        found += [p for p in [cost_problem(n, steps + second, width, height, lim.max_cost)] if p]
    errors += [(field_name(p.field, door), p.message, p.value) for p in found]
    return None if found else HiresFix(float(scale), float(strength), more)


def sampler(info: dict, name: str | None, errors: list) -> str | None:
    """A request's ``scheduler``: None for the model's own (omitted, or any name of the loaded
    scheduler: its batches and programs), else the sampler name, which the replicas check and
    run; an unknown name adds its problem to ``errors``."""
    if name is None or name.lower() in [n.lower() for n in info["scheduler_names"]]:
        return None
    if (p := sampler_problem(name)) is not None:
        errors.append((p.field, p.message, name))
    return name


def safety_checker(s: ServeSettings, moderation: str | None, errors: list) -> bool:
    """Whether a request's ``moderation`` (``auto``, ``low`` or None: the body's schema
    refuses other values) keeps the model's safety checker on for its images: ``auto`` (or
    omitted) keeps it; ``low`` turns it off where the serve arg ``allow_moderation_low``
    allows, else adds its problem to ``errors``."""
    if moderation != "low":
        return True
    if not s.allow_moderation_low:
        errors.append(("moderation", "'low' turns the model's safety checker off, which this "
                       "server does not allow (serve arg allow_moderation_low); omit it or send "
                       "'auto'", moderation))
        return True
    return False


def adapter_problem(info: dict, name: str | None, field: str) -> Problem | None:
    """None, or (field, message, value) when ``name`` is no adapter the replicas loaded."""
    loaded = [a["name"] for a in info.get("adapters") or []]
    if name is None or name in loaded:
        return None
    have = (f"loaded adapters: {', '.join(loaded)}" if loaded else
            "this server loaded no adapters (serve arg adapters)")
    return field, f"unknown adapter {name!r}; {have}", name


async def image_prompt(s: ServeSettings, info: dict, image: str | None, scale: float | None,
                       errors: list):
    """A request's ``ip_adapter_image`` (base64) decoded to uint8 (H, W, 3), or None; its
    problems (no IP-Adapter on this model, a bad file, a scale out of range)
    are added to ``errors``."""
    if scale is not None and (p := ip_adapter_scale_problem(scale)) is not None:
        errors.append((p.field, p.message, scale))
    if image is None:
        if scale is not None:
            errors.append(("ip_adapter_scale", "only used with an ip_adapter_image", scale))
        return None
    if not info.get("ip_adapter"):
        errors.append(("ip_adapter_image", "this model has no IP-Adapter (serve arg "
                       "ip_adapter)", None))
        return None
    try:
        data = b64(image)
    except ValueError as e:
        errors.append(("ip_adapter_image", f"ip_adapter_image {e}", None))
        return None
    try:
        rgb, _ = await asyncio.to_thread(decode_image, data, "ip_adapter_image")
    except ValueError as e:
        errors.append(("ip_adapter_image", str(e), None))
        return None
    return rgb


def stream_problems(stream: bool | None, n: int, n_field: str) -> list[Problem]:
    if not stream:
        return []
    if n != 1:
        return [(n_field, "a stream returns one image; ask for 1", n)]
    return []


def b64(value: str) -> bytes:
    """Base64 text (optionally a ``data:...;base64,`` URL) -> bytes; ValueError if it is not."""
    text = value.strip()
    if text.startswith("data:"):
        head, _, text = text.partition(",")
        if not head.endswith(";base64"):
            raise ValueError("is a data URL without ;base64")
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise ValueError("is not valid base64 (give a base64 PNG, JPEG or WebP file)") from None


async def edit_job(s: ServeSettings, info: dict, *, prompt: str, negative_prompt: str | None,
                   image: bytes | None, mask: bytes | None, transparent_mask: bool | None,
                   strength: float | None, seed: int | None, n: int, door: str,
                   width: int | None, height: int | None, steps: int, guidance: float,
                   errors: list | None = None, prompt_syntax: str | None = None,
                   cfg_cutoff: float | None = None, deepcache_interval: int = 1) -> EditRequest:
    """Decode the image (and mask) and check an edit request: every problem (``errors``
    found before, then these) is a 422. ``transparent_mask``: see
    :func:`pipelines.requests.repaint_mask`. Width and height default to the image's size
    rounded down to the size multiple."""
    errors = list(errors or [])

    def decode(data: bytes | None, field: str):
        if data is None:
            return None
        try:
            return decode_image(data, field)
        except ValueError as e:
            errors.append((field, str(e), None))
            return None

    if image is None:
        errors.append(("image", "an image to edit is required", None))
    img, msk = await asyncio.to_thread(lambda: (decode(image, "image"), decode(mask, "mask")))
    repaint = None
    if img is not None and msk is not None:
        (ih, iw), (mh, mw) = img[0].shape[:2], msk[0].shape[:2]
        if (ih, iw) != (mh, mw):
            errors.append(("mask", f"mask is {mw}x{mh} but image is {iw}x{ih} (width x "
                           "height); give a mask of the image's size", None))
        else:
            repaint = repaint_mask(*msk, transparent=transparent_mask)
    if errors and img is None:  # no image: sizes and costs cannot be checked
        raise invalid_all(errors)
    multiple = limits(s, info).multiple
    ih, iw = img[0].shape[:2]
    width = iw - iw % multiple if width is None else width
    height = ih - ih % multiple if height is None else height
    if strength is None:
        strength = STRENGTH["inpaint" if mask is not None else "img2img"]
    errors += problems(s, info, door, prompt=prompt, negative_prompt=negative_prompt,
                       prompt_syntax=prompt_syntax, steps=steps, guidance=guidance, seed=seed,
                       n=n, width=width, height=height, strength=strength)
    errors += feature_cache_problems(s, door, cfg_cutoff, deepcache_interval, edit=True)
    if errors:
        raise invalid_all(errors)
    return EditRequest(prompt, negative_prompt, seed, n, width, height, steps, guidance,
                       prompt_syntax=prompt_syntax, cfg_cutoff=cfg_cutoff,
                       deepcache_interval=deepcache_interval, strength=float(strength),
                       image=img[0], mask=repaint)
