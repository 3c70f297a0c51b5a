"""The native dialect (``/v1/generate``, ``/v1/edit``): every setting explicit, a response that
reports each image's seed and the timings; an image ``Accept`` type answers the image itself.

``/v1/generate`` takes its body as JSON or as ``multipart/form-data`` (:func:`generate_body`):
the JSON fields as form fields, and control images as files (``control_image``, once per
ControlNet), so ``curl -F prompt=... -F control_image=@edges.png`` needs no base64."""

from __future__ import annotations

import asyncio
import base64
import json
import time

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from pipelines.conditioned_requests import ControlImage, ControlRequest, EditRequest
from pipelines.control_limits import (
    chosen_controlnet,
    control_scale_problem,
    control_window_problems,
    controlnet_problem,
)
from pipelines.image_files import decode_image, encode_image, image_info
from pipelines.limits import within
from pipelines.requests import GenerationRequest
from serving import validation
from serving.answers import Prepared
from serving.errors import ApiError, invalid, invalid_all
from serving.gate import is_json_type, media_type
from serving.schemas import EditRequest as EditBody
from serving.schemas import GenerateRequest, JobResult
from serving.settings import ServeSettings

DOOR = "native"  # how pipelines.limits names fields for this dialect


# multipart/form-data: the form fields that set each control image's entry of control_images
FORM_CONTROL = {"controlnet": "controlnet", "control_scale": "scale",
                "control_start": "start", "control_end": "end", "control_guess_mode": "guess_mode"}


async def generate_body(request: Request) -> GenerateRequest:
    """The body of a ``/v1/generate`` request, as FastAPI would read it for a JSON body (the same
    422s), or from ``multipart/form-data``: every JSON field as a form field (text, read as
    its type: ``steps=20``, ``stream=true``), an ``ip_adapter_image`` file the image prompt,
    each ``control_image`` file one control image in
    order, and ``controlnet`` / ``control_scale`` / ``control_start`` / ``control_end`` /
    ``control_guess_mode`` given
    once (for every control image) or once per control image. A 422 names every problem; a
    400 when the multipart body cannot be parsed."""
    kind = media_type(request.headers.get("content-type", ""))
    found = []  # the form's own problems, as RequestValidationError entries
    if kind == "multipart/form-data":
        data, problems = await _form_body(request)
        found = invalid_all(problems).errors()
        strict = False  # form values are text: read each as its field's type
    else:
        data, strict = await _json_body(request, kind), None
    try:
        body = GenerateRequest.model_validate(data, strict=strict)
    except ValidationError as e:
        found += [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
    if found:
        raise RequestValidationError(found)
    return body


async def _json_body(request: Request, kind: str):
    raw = await request.body()
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",),
                                       "msg": "Field required", "input": None}])
    if kind and not is_json_type(kind):
        raise RequestValidationError([{  # the gate already read JSON objects as JSON
            "type": "model_type", "loc": ("body",),
            "msg": f"the body ({kind}) is not a JSON object: send the fields as JSON "
                   "(application/json) or as multipart/form-data"}])
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:  # what FastAPI answers (serving.errors words it)
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos),
                                       "msg": "JSON decode error", "input": {},
                                       "ctx": {"error": e.msg}}]) from None
    except UnicodeDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.start),
                                       "msg": "JSON decode error", "input": {},
                                       "ctx": {"error": "the body is not UTF-8"}}]) from None


async def _form_body(request: Request) -> tuple[dict, list]:
    """A multipart body as the dict a JSON body would have been (values still text), and the
    (field, message, value) problems of the form itself."""
    try:
        form = await request.form()
    except Exception as e:  # starlette's MultiPartException and the parser's own errors
        raise ApiError(400, f"the multipart body could not be parsed: {e}") from None
    data, files, per_image, errors = {}, [], {k: [] for k in FORM_CONTROL}, []
    for key, value in form.multi_items():
        is_file = not isinstance(value, str)
        if key == "control_image":
            if is_file:
                files.append(await value.read())
            else:
                errors.append((key, "must be a file (a PNG, JPEG or WebP control image)",
                               None))
        elif key == "ip_adapter_image" and is_file:  # an image prompt, as a file
            if key in data:
                errors.append((key, "is given more than once", None))
            data[key] = base64.b64encode(await value.read()).decode()
        elif is_file:
            errors.append((key, "must be a text field; only control_image and "
                           "ip_adapter_image take a file", None))
        elif key in FORM_CONTROL:
            per_image[key].append(value)
        elif key == "control_images":
            errors.append((key, "in a form, give each control image as a control_image file "
                           "(and controlnet / control_scale / control_start / control_end / "
                           "control_guess_mode)",
                           None))
        elif key in data:
            errors.append((key, "is given more than once", None))
        else:
            data[key] = value
    given = [k for k, v in per_image.items() if v]
    if given and not files:
        errors.append((given[0], "sets a control image's setting: send the control image "
                       "as a control_image file", None))
    if files:
        entries = [{"image": base64.b64encode(f).decode()} for f in files]
        for key in given:
            values = per_image[key]
            if len(values) not in (1, len(files)):
                errors.append((key, f"give it once (for every control image) or once per "
                               f"control_image ({len(files)}), not {len(values)} times", None))
                continue
            for k, entry in enumerate(entries):
                entry[FORM_CONTROL[key]] = values[k if len(values) > 1 else 0]
        data["control_images"] = entries
    return data, errors


def wanted_image_type(accept: str | None) -> str | None:
    """The image format an ``Accept`` header asks for instead of JSON, if any."""
    if not accept:
        return None
    types = [t.split(";")[0].strip().lower() for t in accept.split(",")]
    images = [t for t in types if t.startswith("image/")]
    if "application/json" in types or not images:
        return None
    for t in types:
        if t in ("image/png", "image/jpeg", "image/webp"):
            return t.split("/")[1]
        if t == "image/*":
            return "*"
    return None


def negotiate(body: GenerateRequest, accept: str | None) -> tuple[str | None, str]:
    """(the image type ``Accept`` asks for or None, the output format): a 406 when an image
    type cannot be answered."""
    fmt = body.output_format
    wanted = wanted_image_type(accept)
    if wanted is not None:
        if body.num_images != 1:
            raise ApiError(406, "an image Accept type returns exactly one image; ask for "
                           "num_images=1 or Accept: application/json", kind="not_acceptable")
        if wanted != "*":
            if "output_format" in body.model_fields_set and wanted != fmt:
                raise ApiError(406, f"Accept asks for image/{wanted} but output_format is "
                               f"{fmt!r}", kind="not_acceptable")
            fmt = wanted
    return wanted, fmt


async def prepare_generate(s: ServeSettings, generator, catalog, body: GenerateRequest,
                           wanted: str | None, fmt: str, deadline: float, t0: float) -> Prepared:
    """A ``/v1/generate`` request checked against its model (``wanted``, ``fmt``:
    :func:`negotiate`'s; ``t0``: when it came, for the timings)."""
    if body.response_format == "url" and (wanted is not None or body.stream):
        raise invalid("response_format", "'url' answers JSON with links; an image Accept type "
                      "and streams carry the images themselves", body.response_format)
    model = catalog.pick(body.model)
    info = await generator.model_info(model, deadline)
    found: list = []  # the image prompt's problems, reported with the others
    image = await validation.image_prompt(s, info, body.ip_adapter_image, body.ip_adapter_scale,
                                          found)
    if body.control_images:
        job = await control_job(s, info, body, wanted, found, image)
    else:
        job = generation_job(s, info, body, wanted, None, found, image)
    return Prepared(model, info, job, fmt,
                    lambda result: response(job, fmt, result, info, model, t0), "images")


async def prepare_edit(s: ServeSettings, generator, catalog, body: EditBody, deadline: float,
                       t0: float) -> Prepared:
    """A ``/v1/edit`` request checked against its model."""
    model = catalog.pick(body.model)
    info = await generator.model_info(model, deadline)
    job = await edit_job(s, info, body)
    fmt = body.output_format
    return Prepared(model, info, job, fmt,
                    lambda result: response(job, fmt, result, info, model, t0), "images")


def generation_job(s: ServeSettings, info: dict, body: GenerateRequest, wanted: str | None,
                   size: tuple[int, int] | None = None, errors: list | None = None,
                   prompt_image=None) -> GenerationRequest:
    """The job of a ``/v1/generate`` request (omitted settings: the model's defaults; ``size``:
    the default (width, height) instead of the model's; ``prompt_image``: its decoded
    ``ip_adapter_image``, :func:`serving.validation.image_prompt`), or a 422 naming every
    problem (those in ``errors`` too)."""
    steps = info["default_steps"] if body.steps is None else body.steps
    guidance = info["default_guidance"] if body.guidance_scale is None else body.guidance_scale
    w0, h0 = size or (info["default_width"], info["default_height"])
    width = w0 if body.width is None else body.width
    height = h0 if body.height is None else body.height
    errors = list(errors or [])
    sampler = validation.sampler(info, body.scheduler, errors)
    checked = validation.safety_checker(s, body.moderation, errors)
    if (problem := validation.adapter_problem(info, body.lora, "lora")) is not None:
        errors.append(problem)
    errors += validation.stream_problems(body.stream, body.num_images, "num_images")
    if body.stream and wanted is not None:
        errors.append(("stream", "a stream answers text/event-stream, not an image Accept "
                       "type", True))
    errors += validation.problems(s, info, DOOR, prompt=body.prompt,
                                  negative_prompt=body.negative_prompt,
                                  prompt_syntax=body.prompt_syntax, steps=steps,
                                  guidance=guidance, seed=body.seed, n=body.num_images,
                                  width=width, height=height)
    errors += validation.feature_cache_problems(s, DOOR, body.cfg_cutoff, body.deepcache_interval)
    hires = validation.hires_fix(s, info, DOOR, body, steps=steps, n=body.num_images,
                                 width=width, height=height, errors=errors)
    if errors:
        raise invalid_all(errors)
    return GenerationRequest(body.prompt, body.negative_prompt, body.seed, body.num_images,
                             width, height, steps, guidance, body.lora, body.prompt_syntax,
                             sampler, prompt_image, body.ip_adapter_scale,
                             safety_checker=checked, cfg_cutoff=body.cfg_cutoff,
                             deepcache_interval=body.deepcache_interval, hires=hires)


async def control_job(s: ServeSettings, info: dict, body: GenerateRequest, wanted: str | None,
                      errors: list | None = None, prompt_image=None) -> ControlRequest:
    """The job of a ``/v1/generate`` request with ``control_images`` (decoded; the size
    defaults to the first control image's, rounded down to the size multiple), or a 422
    naming every problem: an unknown ControlNet names the loaded ones."""
    loaded = [c["name"] for c in info.get("controlnets") or []]
    errors, raw = list(errors or []), []
    if body.hires_scale is not None:
        errors.append(("hires_scale", "a hires fix runs text-to-image without control_images; "
                       "leave out one of them", body.hires_scale))
    for k, entry in enumerate(body.control_images):
        where = f"control_images[{k}]"
        name = chosen_controlnet(entry.controlnet, loaded)
        if name is None:
            have = ", ".join(loaded) or "none (serve arg controlnets)"
            errors.append((f"{where}.controlnet", f"name the ControlNet that reads this image; "
                           f"loaded ControlNets: {have}", None))
        elif (p := controlnet_problem(name, loaded)) is not None:
            errors.append((f"{where}.controlnet", p.message, name))
        found = [p for p in [control_scale_problem(entry.scale),
                             *control_window_problems(entry.start, entry.end)] if p]
        errors += [(within(p, DOOR, where).field, p.message, p.value) for p in found]
        try:
            data = validation.b64(entry.image)
        except ValueError as e:
            errors.append((f"{where}.image", f"{where}.image {e}", None))
            data = None
        raw.append((name, data))

    def decode():
        out = []
        for k, (_, data) in enumerate(raw):
            if data is None:
                out.append(None)
                continue
            try:
                out.append(decode_image(data, f"control_images[{k}].image")[0])
            except ValueError as e:
                errors.append((f"control_images[{k}].image", str(e), None))
                out.append(None)
        return out

    images = await asyncio.to_thread(decode)
    size = None
    if images and images[0] is not None:
        multiple = validation.limits(s, info).multiple
        h, w = images[0].shape[:2]
        size = (w - w % multiple, h - h % multiple)
    job = generation_job(s, info, body, wanted, size, errors,  # a 422 naming every problem
                         prompt_image)
    controls = tuple((name, ControlImage(img, float(e.scale), float(e.start), float(e.end),
                                         e.guess_mode))
                     for (name, _), img, e in zip(raw, images, body.control_images))
    return ControlRequest(job.prompt, job.negative_prompt, job.seed, job.n, job.width,
                          job.height, job.steps, job.guidance_scale, job.adapter,
                          job.prompt_syntax, job.scheduler, job.ip_adapter_image,
                          job.ip_adapter_scale, safety_checker=job.safety_checker,
                          cfg_cutoff=job.cfg_cutoff, deepcache_interval=job.deepcache_interval,
                          controls=controls)


async def edit_job(s: ServeSettings, info: dict, body: EditBody) -> EditRequest:
    """The job of a ``/v1/edit`` request (base64 image and mask), or a 422 naming every
    problem."""
    errors = []
    raw = {}
    for field in ("image", "mask"):
        value = getattr(body, field)
        if value is None:
            continue
        try:
            raw[field] = validation.b64(value)
        except ValueError as e:
            errors.append((field, f"{field} {e}", None))
    if "image" not in raw and not any(f == "image" for f, _, _ in errors):
        errors.append(("image", "an image to edit is required", None))
    if any(f in ("image", "mask") for f, _, _ in errors):
        raise invalid_all(errors)
    return await validation.edit_job(
        s, info, prompt=body.prompt, negative_prompt=body.negative_prompt, image=raw["image"],
        mask=raw.get("mask"), transparent_mask=None, strength=body.strength, seed=body.seed,
        n=body.num_images, door=DOOR, width=body.width, height=body.height,
        steps=info["default_steps"] if body.steps is None else body.steps,
        guidance=info["default_guidance"] if body.guidance_scale is None
        else body.guidance_scale, errors=errors, prompt_syntax=body.prompt_syntax,
        cfg_cutoff=body.cfg_cutoff, deepcache_interval=body.deepcache_interval)


def image_settings(job: GenerationRequest, seeds, info: dict, model_id: str) -> list[dict]:
    """What each image's file records (PNG text chunks, EXIF): the settings that redraw it
    through ``/v1/generate`` (its seed among them), one dict per seed."""
    mode = job.file_settings()  # the request's kind: an edit's mode, the ControlNets
    if job.ip_adapter_image is not None:  # an image prompt: its scale (the image is the caller's)
        scale = info["ip_adapter"]["scale"] if job.ip_adapter_scale is None \
            else job.ip_adapter_scale
        mode = {**mode, "ip_adapter_image": "given", "ip_adapter_scale": f"{scale:g}"}
    if not job.safety_checker:  # moderation "low": redrawn unchecked only with it
        mode = {**mode, "moderation": "low"}
    if job.cfg_cutoff is not None:  # feature caching, where on
        mode = {**mode, "cfg_cutoff": f"{job.cfg_cutoff:g}"}
    if job.deepcache_interval != 1:
        mode = {**mode, "deepcache_interval": str(job.deepcache_interval)}
    if (h := job.hires) is not None:
        mode = {**mode, "hires_scale": f"{h.scale:g}", "hires_strength": f"{h.strength:g}",
                **({} if h.steps is None else {"hires_steps": str(h.steps)})}
    return [image_info(prompt=job.prompt, negative_prompt=job.negative_prompt, seed=seed,
                       steps=job.steps, guidance=job.guidance_scale,
                       size=f"{job.width}x{job.height}",
                       scheduler=job.scheduler or info["scheduler"],
                       model=model_id, dtype=info["dtype"], adapter=job.adapter,
                       prompt_syntax=job.prompt_syntax,
                       quantization=None if info.get("quantization", "none") == "none"
                       else info["quantization"]) | mode
            for seed in seeds]


async def response(job: GenerationRequest, fmt: str, result: JobResult, info: dict,
                   model_id: str, t0: float) -> tuple[dict, list[bytes]]:
    """The response body of a finished job (``GenerateResponse``, or ``EditResponse`` for an
    edit) and its encoded images, each carrying its settings; ``t0``: when the request came."""
    t1 = time.perf_counter()
    edit = isinstance(job, EditRequest)
    meta = image_settings(job, result.seeds, info, model_id)
    blobs = await asyncio.to_thread(lambda: [encode_image(im, fmt, m)
                                             for im, m in zip(result.images, meta)])
    timings = dict(result.timings, encode_s=time.perf_counter() - t1,
                   total_s=time.perf_counter() - t0, batch_requests=result.batch["requests"],
                   batch_images=result.batch["images"])
    if not edit:
        timings["batch_id"] = result.batch["id"]
    data = {"created": int(time.time()), "model": model_id,
            "images": [{"b64_json": base64.b64encode(b).decode(), "seed": s,
                        **({} if result.filtered is None else {"content_filtered": f})}
                       for b, s, f in zip(blobs, result.seeds,
                                          result.filtered or [None] * len(blobs))],
            "seeds": result.seeds}
    if edit:
        data.update(mode=job.kind, strength=job.strength)
    data.update(width=job.width, height=job.height, steps=job.steps,
                guidance_scale=job.guidance_scale, scheduler=job.scheduler or info["scheduler"],
                output_format=fmt, timings=timings)
    if not edit:
        data["lora"] = job.adapter
    if job.controlnets:
        data["controlnets"] = list(job.controlnets)
    return data, blobs


def stream_render(job: GenerationRequest, fmt: str, info: dict, model_id: str, t0: float):
    """``render(event)`` for :meth:`serving.client.GeneratorClient.stream`: ``progress``,
    ``partial_image`` and ``result`` (the route's JSON response) events."""

    async def render(ev):
        if ev["type"] == "progress":
            return [("progress", {k: ev[k] for k in ("step", "total", "queue_position")})]
        if ev["type"] == "partial_image":
            blob = await asyncio.to_thread(encode_image, ev["image"], fmt)
            return [("partial_image", {"index": ev["index"], "step": ev["step"],
                                       "b64_json": base64.b64encode(blob).decode()})]
        return [("result", (await response(job, fmt, ev["result"], info, model_id, t0))[0])]

    return render
