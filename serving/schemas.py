"""What crosses the service's boundaries.

- The HTTP request/response models (Pydantic; FastAPI shows them at ``/docs``); those of jobs
  are in :mod:`serving.job_schemas`.
- ``JobResult``: what a generator replica sends back for a
  :class:`pipelines.requests.GenerationRequest`.
- ``ServeSettings`` (and ``WarmupShape``, ``AdapterSpec``): the deployment's settings, defined in
  :mod:`serving.settings` and importable from here too.

Nothing here imports JAX: the ingress replicas only need this module, ``pipelines.requests``,
``pipelines.config`` and FastAPI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipelines.control_limits import CONTROL_SCALE_MAX
from pipelines.limits import (
    DEEPCACHE_MAX,
    HIRES_SCALE,
    IP_ADAPTER_SCALE,
    MAX_PROMPT_CHUNKS,
    MAX_SEED,
    STRENGTH,
)
from pipelines.requests import HiresFix
from serving.settings import ServeSettings  # noqa: F401 (re-exported)
from serving.specs import AdapterSpec, WarmupShape  # noqa: F401 (re-exported)

# ---------------------------------------------------------------------------------- HTTP models
ImageFormat = Literal["png", "jpeg", "webp"]
PromptSyntax = Literal["a1111", "compel", "none"]
ResponseFormat = Literal["b64_json", "url"]
Moderation = Literal["auto", "low"]  # OpenAI's values (serving.validation.safety_checker)


def _ip_image_field():
    return Field(None, description="An image prompt for the model's IP-Adapter (serve arg "
                 "ip_adapter): a base64 PNG, JPEG or WebP file (or a data: URL). Requests with "
                 "and without one share device batches (and step-engine ticks).")


def _moderation_field():
    return Field(None, description="'auto' (default): the model's safety checker (SD 1.x "
                 "checkpoints that ship one) checks the images and blacks out the flagged ones "
                 "(content_filtered); 'low': it skips this request's images, where the server "
                 "allows it (serve arg allow_moderation_low; else a 422). Requests with either "
                 "share device batches.")


def _ip_scale_field():
    return Field(None, description="How strongly the image prompt acts: -1 to 5 (0: not at "
                 "all, 1: the adapter as trained); omitted: the model's (serve arg "
                 "ip_adapter_scale).",
                 json_schema_extra={"minimum": IP_ADAPTER_SCALE[0], "maximum": IP_ADAPTER_SCALE[1]})


# feature caching (ImageRequest's): ranges are pipelines.limits' rules, checked by the ingress
def _cfg_cutoff_field():
    return Field(None, description="Faster, approximate: classifier-free guidance on the first "
                 "floor(cfg_cutoff * steps) steps only, in (0, 1]; the conditional pass alone "
                 "after them (one UNet pass a step instead of two). Omitted or null: guidance "
                 "on every step. Requests with different settings share a queue and run as "
                 "separate device batches (engine=step: per image, in the same ticks).",
                 json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})


def _deepcache_field(default):
    return Field(default, description="Faster, approximate (DeepCache): the UNet runs in full "
                 "every N steps and only its outer blocks in between, on the deep features the "
                 f"last full step cached; 1 to {DEEPCACHE_MAX}, 1 (default): off. engine=batch "
                 "(and edits on either engine); a server with engine=step answers a 422 for "
                 "N > 1. Requests with different settings run as separate device batches.",
                 json_schema_extra={"minimum": 1, "maximum": DEEPCACHE_MAX})


# hires fix (pipelines.requests.HiresFix): ranges are pipelines.limits' rules
def _hires_scale_field():
    return Field(None, description="Hires fix (A1111's): draw the image at its width / "
                 "hires_scale x height / hires_scale first, upscale its latents (bilinear) to "
                 f"the full size and denoise again from them; in (1, {HIRES_SCALE:g}]. Omitted: "
                 "off. Runs on engine=batch's backend on either engine; not with control_images.",
                 json_schema_extra={"exclusiveMinimum": 1, "maximum": HIRES_SCALE})


def _hires_strength_field():
    return Field(None, description=f"The hires fix's second pass, in (0, 1] (default "
                 f"{HiresFix.strength:g}): int(hires_steps * hires_strength) of hires_steps "
                 "run, as image-to-image runs its strength. With hires_scale.",
                 json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})


def _hires_steps_field():
    return Field(None, description="The hires fix's second pass's steps (default: the "
                 "request's steps, the first pass's). With hires_scale.",
                 json_schema_extra={"minimum": 1})


class ImagesGenerationRequest(BaseModel):
    """OpenAI Images API ``POST /v1/images/generations``. ``user``, ``quality``, ``style``
    and ``background`` are accepted and ignored; unknown fields too. ``model``
    names a served model (``<model>:<adapter>`` also picks a LoRA adapter it loaded, as does the
    extra field ``lora``)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    prompt: str = Field(min_length=1, description="What to draw.")
    n: int | None = Field(1, description="How many images (up to the server's max_n).",
                          json_schema_extra={"minimum": 1})
    size: str | None = Field("auto", description="'WIDTHxHEIGHT' (e.g. '1024x1024') or 'auto' "
                             "for the model's default size.")
    response_format: str | None = Field("b64_json", description="'b64_json' (the image in the "
                                        "answer) or 'url' (a link to it in the server's output "
                                        "store, valid for its output_ttl_s).")
    output_format: ImageFormat | None = Field(None, description="png (default), jpeg or webp.")
    output_compression: int | None = Field(None, ge=0, le=100,
                                           description="jpeg/webp quality, 0-100.")
    model: str | None = Field(None, description="A served model (see /v1/models), or "
                              "'<model>:<adapter>' for one of its LoRA adapters; omitted: the "
                              "default model. An unknown model is a 404 when the server serves "
                              "a `models` list; a single-model server ignores it.")
    lora: str | None = Field(None, description="A LoRA adapter the server loaded (its name, "
                             "see /v1/models); omitted: the base model.")
    scheduler: str | None = Field(None, description="A sampler for this request (euler_a, "
                                  "dpmpp_2m_karras, 'DPM++ 2M Karras', ...); omitted: the "
                                  "model's (see /v1/generate).")
    prompt_syntax: PromptSyntax | None = Field(
        None, description="How the prompts' weights are written: 'a1111' (default: "
        "(word:1.3), (word), [word], BREAK), 'compel' (word+, word-, (words)1.3) or 'none' "
        "(the text as written). Prompts over 75 tokens are encoded in chunks of 75, up to "
        f"{MAX_PROMPT_CHUNKS} (engine=step: one).")
    ip_adapter_image: str | None = _ip_image_field()
    ip_adapter_scale: float | None = _ip_scale_field()
    cfg_cutoff: float | None = _cfg_cutoff_field()
    deepcache_interval: int | None = _deepcache_field(1)
    hires_scale: float | None = _hires_scale_field()
    hires_strength: float | None = _hires_strength_field()
    hires_steps: int | None = _hires_steps_field()
    user: str | None = None
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    moderation: Moderation | None = _moderation_field()
    stream: bool | None = Field(None, description="Server-Sent Events: `partial_images` "
                                "`image_generation.partial_image` events (servers with "
                                "engine=step), then `image_generation.completed`; n=1.")
    partial_images: int | None = Field(None, ge=0, le=3, description="Partial images to stream "
                                       "before the final one (0-3; with stream).")

    @field_validator("response_format")
    @classmethod
    def _formats(cls, v):
        if v not in (None, "b64_json", "url"):
            raise ValueError("must be 'b64_json' or 'url'")
        return v


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None
    request_id: str | None = None


class ErrorResponse(BaseModel):
    """Every error: OpenAI's ``{"error": {...}}`` shape (the openai client reads it) plus
    ``detail`` (FastAPI's: a message, or for a 422 the list of problems)."""

    error: ErrorDetail
    detail: Any = None


ERROR_RESPONSES: dict[int | str, dict] = {
    code: {"model": ErrorResponse, "description": what} for code, what in (
        (401, "API keys are on and the request has no valid `Authorization: Bearer` key."),
        (404, "`model` names no served model (`model_not_found`; GET /v1/models lists them)."),
        (406, "An image Accept type with more than one image."),
        (413, "The body is larger than max_body_bytes (max_image_bytes on the edit routes)."),
        (429, "The key's rate limit is reached (`Retry-After` says when to retry)."),
        (500, "An unexpected server error (the request id finds it in the log)."),
        (503, "At capacity, warming up, or a replica was lost (`Retry-After`)."),
        (504, "The request's deadline passed."))}


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = Field(None, description="With response_format 'url': where to download "
                            "the image (until expires_at).")
    expires_at: int | None = Field(None, description="When url stops working (unix seconds; "
                                   "not in OpenAI's schema).")
    revised_prompt: str | None = None
    seed: int | None = Field(None, description="The image's seed (not in OpenAI's schema; "
                             "clients keep it): /v1/generate with it and the settings in the "
                             "image file's text chunks redraws the image.")
    content_filtered: bool | None = Field(
        None, description="Whether the model's safety checker blacked this image out (models "
        "that ship one, SD 1.x); absent where none ran (no checker, or moderation 'low').")


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: str | None = None
    size: str | None = None


# The native routes' shared settings. Their ranges are pipelines.limits' rules, checked by the
# ingress against the server's limits (so a 422 states the same range as the Python API and the
# CLI); the schema only shows them.
def _model_field():
    return Field(None, description="A served model's name (see /v1/models); omitted: the "
                 "default (first) model. Another name is a 404 naming the served ones.")


def _seed_field():
    return Field(None, description="Image k gets seed + k; omitted: random (reported).",
                 json_schema_extra={"minimum": 0, "maximum": MAX_SEED})


def _steps_field():
    return Field(None, description="Default: the model's / run config's.",
                 json_schema_extra={"minimum": 1})


def _guidance_field():
    return Field(None, description="<= 1 turns CFG off.", json_schema_extra={"minimum": 0})


class ControlImageInput(BaseModel):
    """One control image of a ``/v1/generate`` request and the ControlNet that reads it."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    image: str = Field(min_length=1, description="The control image (edges, depth, pose, ...): "
                       "base64 PNG, JPEG or WebP (a `data:image/...;base64,` prefix is "
                       "allowed); resized to the output size.")
    controlnet: str | None = Field(None, description="A ControlNet the server loaded (serve "
                                   "arg controlnets; /v1/models lists them as "
                                   "`maxdiff.controlnets`); omitted: the only one loaded.")
    scale: float = Field(1.0, description=f"Conditioning scale in [0, {CONTROL_SCALE_MAX:g}] "
                         "(0: no effect, 1: the ControlNet's full strength).",
                         json_schema_extra={"minimum": 0, "maximum": CONTROL_SCALE_MAX})
    start: float = Field(0.0, description="The fraction of the denoising steps the ControlNet "
                         "starts acting at (0 <= start < end <= 1).",
                         json_schema_extra={"minimum": 0, "maximum": 1})
    end: float = Field(1.0, description="... and stops at.",
                       json_schema_extra={"minimum": 0, "maximum": 1})
    guess_mode: bool = Field(False, description="diffusers' guess mode (A1111's \"ControlNet "
                             "is more important\"): the residuals ramp from 0.1 to 1 over the "
                             "blocks and, with guidance, only the prompt-conditioned half gets "
                             "them. Forced on for a ControlNet with global_pool_conditions.")


class GenerateRequest(BaseModel):
    """Native generation: every setting explicit, seeds reported, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: str = Field(min_length=1)
    model: str | None = _model_field()
    negative_prompt: str | None = None
    prompt_syntax: PromptSyntax | None = Field(
        None, description="How the prompts' weights are written: 'a1111' (default: "
        "(word:1.3), (word), [word], BREAK), 'compel' (word+, word-, (words)1.3) or 'none' "
        "(the text as written). Prompts over 75 tokens are encoded in chunks of 75, up to "
        f"{MAX_PROMPT_CHUNKS} (engine=step: one).")
    seed: int | None = _seed_field()
    steps: int | None = _steps_field()
    guidance_scale: float | None = _guidance_field()
    width: int | None = Field(None, json_schema_extra={"minimum": 1})
    height: int | None = Field(None, json_schema_extra={"minimum": 1})
    num_images: int = Field(1, json_schema_extra={"minimum": 1})
    scheduler: str | None = Field(None, description="A sampler for this request: a short name "
                                  "(euler, euler_a, dpmpp_2m, dpmpp_2m_karras, "
                                  "dpmpp_2m_sde_karras, ddim, lcm, unipc, ...), A1111's name "
                                  "('DPM++ 2M Karras') or a diffusers class name; the model's "
                                  "scheduler switched to it. Omitted or the loaded one's name "
                                  "(/v1/models): the model's own. engine=batch text-to-image; "
                                  "requests with different samplers share a queue and run as "
                                  "separate device batches.")
    lora: str | None = Field(None, description="A LoRA adapter the server loaded (its name, see "
                             "/v1/models `maxdiff.adapters`); omitted: the base model. Requests "
                             "with different adapters share batches.")
    ip_adapter_image: str | None = _ip_image_field()
    ip_adapter_scale: float | None = _ip_scale_field()
    cfg_cutoff: float | None = _cfg_cutoff_field()
    deepcache_interval: int = _deepcache_field(1)
    hires_scale: float | None = _hires_scale_field()
    hires_strength: float | None = _hires_strength_field()
    hires_steps: int | None = _hires_steps_field()
    moderation: Moderation | None = _moderation_field()
    output_format: ImageFormat = "png"
    response_format: ResponseFormat = Field("b64_json", description="'b64_json': each image in "
                                            "the answer; 'url': a link to it in the server's "
                                            "output store (expires after output_ttl_s).")
    stream: bool = Field(False, description="Server-Sent Events: `progress` events (step, "
                         "total, queue_position; engine=batch: queued and done only), "
                         "`partial_image` events (partial_images; engine=step), then `result` "
                         "(this route's JSON response). num_images=1.")
    partial_images: int = Field(0, ge=0, le=3, description="Partial images (the current "
                                "denoised estimate) to stream before the result (with stream).")
    control_images: list[ControlImageInput] | None = Field(
        None, description="ControlNet text-to-image: one control image per ControlNet (several: "
        "their residuals are summed), each naming a ControlNet the server loaded. The size "
        "defaults to the first control image's (rounded down to the size multiple). Requests "
        "with the same ControlNets, size, steps and CFG on/off share device batches (engine=step: "
        "steps, whatever the size of their steps), whatever their control images, scales, "
        "windows and guess modes.")


def generate_openapi_body() -> tuple[dict, dict]:
    """``/v1/generate``'s OpenAPI request body (JSON or ``multipart/form-data``) and the
    component schemas it references: the form is the JSON body's fields with the control images
    as ``control_image`` files and their settings as form fields (see
    :func:`serving.native_api.generate_body`)."""
    ref = "#/components/schemas/{model}"
    json_schema = GenerateRequest.model_json_schema(ref_template=ref)
    components = json_schema.pop("$defs", {})
    components["GenerateRequest"] = json_schema
    props = {k: v for k, v in json_schema["properties"].items() if k != "control_images"}
    control = ControlImageInput.model_json_schema()["properties"]

    def each(schema: dict, what: str) -> dict:
        return {"type": "array", "items": schema, "description": f"{what}: once for every "
                "control image, or once per control_image, in their order."}

    def bounded(field: str) -> dict:  # ControlImageInput's type and range of the field
        return {k: control[field][k] for k in ("type", "minimum", "maximum")}

    props.update(
        ip_adapter_image={"type": "string", "format": "binary",
                          "description": "An image prompt (a PNG, JPEG or WebP file) for the "
                          "model's IP-Adapter."},
        control_image={"type": "array", "items": {"type": "string", "format": "binary"},
                       "description": "Control images (PNG, JPEG or WebP files), one per "
                       "ControlNet, in order: ControlNet text-to-image."},
        controlnet=each({"type": "string"}, "The ControlNet that reads each control image"),
        control_scale=each(bounded("scale"), "Conditioning scale"),
        control_start=each(bounded("start"), "Window start"),
        control_end=each(bounded("end"), "Window end"),
        control_guess_mode=each({"type": "boolean"}, "Guess mode"))
    components["GenerateForm"] = {
        "title": "GenerateForm", "type": "object", "required": ["prompt"], "properties": props,
        "additionalProperties": False,
        "description": "/v1/generate as multipart/form-data: the JSON body's fields as form "
                       "fields, control images as files."}
    body = {"required": True, "content": {
        "application/json": {"schema": {"$ref": ref.format(model="GenerateRequest")}},
        "multipart/form-data": {"schema": {"$ref": ref.format(model="GenerateForm")}}}}
    return body, components


class EditRequest(BaseModel):
    """Native editing: image-to-image, or inpainting with a mask. Every setting explicit,
    seeds reported, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: str = Field(min_length=1)
    model: str | None = _model_field()
    negative_prompt: str | None = None
    prompt_syntax: PromptSyntax | None = Field(
        None, description="How the prompts' weights are written: 'a1111' (default: "
        "(word:1.3), (word), [word], BREAK), 'compel' (word+, word-, (words)1.3) or 'none' "
        "(the text as written). Prompts over 75 tokens are encoded in chunks of 75, up to "
        f"{MAX_PROMPT_CHUNKS} (engine=step: one).")
    image: str = Field(min_length=1, description="The image to edit: base64 PNG, JPEG or WebP "
                       "(a `data:image/...;base64,` prefix is allowed).")
    mask: str | None = Field(None, description="Inpainting mask, base64 PNG/JPEG/WebP of the "
                             "image's size: white = repaint, black = keep; a mask with "
                             "transparent pixels (alpha < 255 somewhere) is read the OpenAI way "
                             "instead: fully transparent = repaint. Omitted: image-to-image.")
    strength: float | None = Field(
        None, description="In (0, 1]: how far from the image to go (int(steps * strength) "
        f"denoising steps run). Default: {STRENGTH['img2img']} without a mask, "
        f"{STRENGTH['inpaint']} with one.",
        json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    seed: int | None = _seed_field()
    steps: int | None = _steps_field()
    guidance_scale: float | None = _guidance_field()
    width: int | None = Field(None, json_schema_extra={"minimum": 1}, description="Default: "
                              "the image's width (rounded down to the model's size multiple); "
                              "the image is resized to it.")
    height: int | None = Field(None, json_schema_extra={"minimum": 1},
                               description="Default: the image's height.")
    num_images: int = Field(1, json_schema_extra={"minimum": 1})
    cfg_cutoff: float | None = _cfg_cutoff_field()
    deepcache_interval: int = _deepcache_field(1)
    output_format: ImageFormat = "png"
    response_format: ResponseFormat = Field("b64_json", description="'b64_json': each image in "
                                            "the answer; 'url': a link to it in the server's "
                                            "output store (expires after output_ttl_s).")


class GeneratedImage(BaseModel):
    b64_json: str | None = Field(None, description="The image (response_format 'b64_json').")
    url: str | None = Field(None, description="Where to download the image (response_format "
                            "'url').")
    expires_at: int | None = Field(None, description="When the url stops working (unix "
                                   "seconds; null: never).")
    seed: int
    content_filtered: bool | None = Field(
        None, description="Whether the model's safety checker blacked this image out (only for "
        "models that ship one, SD 1.x: diffusers' nsfw_content_detected); absent where none "
        "ran (no checker, or moderation 'low').")


class GenerateResponse(BaseModel):
    created: int
    model: str
    images: list[GeneratedImage]
    seeds: list[int]
    width: int
    height: int
    steps: int
    guidance_scale: float
    scheduler: str
    output_format: str
    timings: dict[str, float]
    lora: str | None = None
    controlnets: list[str] | None = Field(None, description="The ControlNets of a request with "
                                          "control_images, in its order.")


class EditResponse(GenerateResponse):
    """A generation's answer plus how the image was edited (edits take no adapter: ``lora``
    is always null here)."""

    mode: Literal["img2img", "inpaint"]
    strength: float


# ---------------------------------------------------------------------------------- jobs
@dataclass
class JobResult:
    images: list[np.ndarray]  # uint8 (H, W, 3)
    seeds: list[int]
    timings: dict[str, float]
    batch: dict  # the batch it ran in: id, requests, images, device_batches, shape
    replica: dict  # id, node_id
    # per image, whether the model's safety checker blacked it out (None: no image was checked:
    # the model has no checker, or the request turned it off)
    filtered: list[bool] | None = None
