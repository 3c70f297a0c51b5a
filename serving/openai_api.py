"""The OpenAI Images API dialect: a request to a job (defaults from the served model, random
seeds), a result to an ``ImagesResponse`` body or to ``image_generation.*`` stream events."""

from __future__ import annotations

import asyncio
import base64
import time

from fastapi import UploadFile

from pipelines.conditioned_requests import EditRequest
from pipelines.image_files import encode_image
from pipelines.requests import GenerationRequest, parse_size
from serving import validation
from serving.answers import Prepared
from serving.errors import invalid, invalid_all
from serving.models import Catalog
from serving.native_api import image_settings
from serving.schemas import ImagesGenerationRequest, JobResult
from serving.settings import ServeSettings

DOOR = "openai"  # how pipelines.limits names fields for this dialect


def model_name(catalog: Catalog, model: str | None) -> str:
    """The served model an OpenAI request's ``model`` (``<model>`` or ``<model>:<adapter>``)
    names; omitted: the default. A name not served is a 404 naming the choices, except on a
    single-model server (no ``models`` list), which ignores it as before."""
    return catalog.pick(model.partition(":")[0] if model else None, lenient=True)


def adapter(info: dict, body: ImagesGenerationRequest) -> str | None:
    """The adapter an OpenAI request asks for: ``lora``, or ``model: "<base>:<adapter>"``."""
    from_model = None
    if body.model and ":" in body.model:
        from_model = body.model.rpartition(":")[2]
        problem = validation.adapter_problem(info, from_model, "model")
        if problem is not None:
            raise invalid(*problem)
    problem = validation.adapter_problem(info, body.lora, "lora")
    if problem is not None:
        raise invalid(*problem)
    if from_model is not None and body.lora is not None and body.lora != from_model:
        raise invalid("lora", f"lora={body.lora!r} but model names adapter {from_model!r}; "
                      "give one", body.lora)
    return body.lora or from_model


async def prepare(s: ServeSettings, generator, catalog: Catalog, body: ImagesGenerationRequest,
                  deadline: float) -> Prepared:
    """An ``images.generate`` request checked against its model (``generator``: the
    :class:`serving.client.GeneratorClient` that knows the model's limits)."""
    if body.stream and body.response_format == "url":
        raise invalid("response_format", "streams carry the images themselves; omit "
                      "response_format or set it to 'b64_json'", "url")
    model = model_name(catalog, body.model)
    info = await generator.model_info(model, deadline)
    found: list = []  # the image prompt's problems, reported with the others
    image = await validation.image_prompt(s, info, body.ip_adapter_image, body.ip_adapter_scale,
                                          found)
    job = generation_job(s, info, body, found, image)
    fmt, quality = body.output_format or "png", body.output_compression
    return Prepared(model, info, job, fmt,
                    lambda result: images_response(result, job, fmt, quality, info, model), "data")


def generation_job(s: ServeSettings, info: dict, body: ImagesGenerationRequest,
                   errors: list | None = None, prompt_image=None) -> GenerationRequest:
    """The job of an ``images.generate`` request (``prompt_image``: its decoded
    ``ip_adapter_image``), or a 422 naming every problem (those in ``errors`` too)."""
    n = 1 if body.n is None else body.n
    if body.size in (None, "auto"):
        width, height = info["default_width"], info["default_height"]
    else:
        try:
            width, height = parse_size(body.size)
        except ValueError as e:
            raise invalid("size", f"{e}, or 'auto'", body.size) from None
    errors = list(errors or []) + validation.stream_problems(body.stream, n, "n")
    sampler = validation.sampler(info, body.scheduler, errors)
    checked = validation.safety_checker(s, body.moderation, errors)
    errors += validation.problems(s, info, DOOR, prompt=body.prompt,
                                  prompt_syntax=body.prompt_syntax,
                                  steps=info["default_steps"], n=n, width=width, height=height)
    interval = 1 if body.deepcache_interval is None else body.deepcache_interval
    errors += validation.feature_cache_problems(s, DOOR, body.cfg_cutoff, interval)
    hires = validation.hires_fix(s, info, DOOR, body, steps=info["default_steps"], n=n,
                                 width=width, height=height, errors=errors)
    if errors:
        raise invalid_all(errors)
    return GenerationRequest(body.prompt, None, None, n, width, height, info["default_steps"],
                             info["default_guidance"], adapter(info, body), body.prompt_syntax,
                             sampler, prompt_image, body.ip_adapter_scale,
                             safety_checker=checked, cfg_cutoff=body.cfg_cutoff,
                             deepcache_interval=interval, hires=hires)


async def edit_job(s: ServeSettings, info: dict, *, prompt: str, image: UploadFile | None,
                   mask: UploadFile | None, n: int | None, size: str | None,
                   response_format: str | None, stream: bool | None) -> EditRequest:
    """The job of an ``images.edit`` request (multipart), or a 422 naming every problem."""
    errors = []
    if response_format not in (None, "b64_json", "url"):
        errors.append(("response_format", "must be 'b64_json' or 'url'", response_format))
    if stream:
        errors.append(("stream", "streaming is not supported; omit stream or set it to false",
                       stream))
    width = height = None
    if size not in (None, "auto"):
        try:
            width, height = parse_size(size)
        except ValueError as e:
            errors.append(("size", f"{e}, or 'auto'", size))
    return await validation.edit_job(
        s, info, prompt=prompt, negative_prompt=None,
        image=None if image is None else await image.read(),
        mask=None if mask is None else await mask.read(), transparent_mask=True, strength=None,
        seed=None, n=1 if n is None else n, door=DOOR, width=width, height=height,
        steps=info["default_steps"], guidance=info["default_guidance"], errors=errors)


async def images_response(result: JobResult, job: GenerationRequest, fmt: str,
                          quality: int | None, info: dict, model_id: str
                          ) -> tuple[dict, list[bytes]]:
    """The ``ImagesResponse`` body of a finished job and its encoded images. Each image carries
    its seed (an extra field of its entry, which OpenAI clients keep) and, in its file, the
    settings that redraw it through ``/v1/generate``
    (:func:`serving.native_api.image_settings`)."""
    meta = image_settings(job, result.seeds, info, model_id)
    blobs = await asyncio.to_thread(
        lambda: [encode_image(im, fmt, m, quality=quality) for im, m in zip(result.images, meta)])
    return {"created": int(time.time()), "output_format": fmt,
            "size": f"{job.width}x{job.height}",
            "data": [{"b64_json": base64.b64encode(b).decode(), "revised_prompt": None,
                      "seed": s, **({} if result.filtered is None else {"content_filtered": f})}
                     for b, s, f in zip(blobs, result.seeds,
                                        result.filtered or [None] * len(blobs))]}, blobs


def stream_render(job: GenerationRequest, fmt: str, quality: int | None):
    """``render(event)`` for :meth:`serving.client.GeneratorClient.stream`: a partial image
    or the result as OpenAI's ``image_generation.partial_image`` / ``.completed`` events;
    progress events are not sent."""
    common = {"background": "opaque", "output_format": fmt, "quality": "auto",
              "size": f"{job.width}x{job.height}"}

    async def render(ev):
        if ev["type"] == "progress":
            return []
        im = ev["image"] if ev["type"] == "partial_image" else ev["result"].images[0]
        blob = await asyncio.to_thread(encode_image, im, fmt, quality=quality)
        data = {"b64_json": base64.b64encode(blob).decode(), "created_at": int(time.time()),
                **common}
        if ev["type"] == "partial_image":
            return [("image_generation.partial_image",
                     {"type": "image_generation.partial_image",
                      "partial_image_index": ev["index"], **data})]
        usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                 "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}}
        return [("image_generation.completed",
                 {"type": "image_generation.completed", "usage": usage, **data})]

    return render
