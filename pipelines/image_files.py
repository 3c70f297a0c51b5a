"""Image files in and out, for every way in (JAX-free: NumPy and Pillow only):
:func:`encode_image` / :func:`read_image_info` (PNG / JPEG / WebP bytes carrying the settings
that made them, :func:`image_info`), :func:`decode_image` (an uploaded file -> uint8 RGB and
alpha) and :func:`repaint_mask` (a mask file's pixels -> 255 = repaint)."""

from __future__ import annotations

import io
import json
import os
from typing import Any

import numpy as np

FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
IMAGE_KEYS = ("prompt", "negative_prompt", "seed", "steps", "guidance", "size", "scheduler",
              "model", "unet", "vae", "lora", "adapter", "dtype", "quantization", "mode", "strength",
              "controlnet", "prompt_syntax", "ip_adapter_image", "ip_adapter_scale",
              "cfg_cutoff", "deepcache_interval", "hires_scale", "hires_strength", "hires_steps")


def image_info(**settings: Any) -> dict[str, str]:
    """The settings stored inside an image file (:data:`IMAGE_KEYS`, those given and not None;
    no time or path, so files reproduce)."""
    return {k: str(settings[k]) for k in IMAGE_KEYS if settings.get(k) is not None}


def encode_image(image: Any, fmt: str = "png", info: dict[str, str] | None = None,
                 quality: int | None = None) -> bytes:
    """A PIL image or uint8 (H, W, 3) array -> PNG / JPEG / WebP bytes. ``info`` (settings) goes
    into PNG text chunks, or as JSON into EXIF ImageDescription for JPEG and WebP; PNG is
    lossless, JPEG/WebP use ``quality`` (default 95). The same pixels and info give the same
    bytes."""
    from PIL import Image, PngImagePlugin

    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}; use one of {', '.join(FORMATS)}")
    if not isinstance(image, Image.Image):
        image = Image.fromarray(np.asarray(image))
    buf = io.BytesIO()
    if fmt == "png":
        png = None
        if info is not None:
            png = PngImagePlugin.PngInfo()
            for k, v in info.items():
                png.add_text(k, v)
            png.add_text("software", "maxdiff")
        image.save(buf, "PNG", pnginfo=png)
    else:
        kw: dict[str, Any] = {"quality": 95 if quality is None else quality}
        if info is not None:
            exif = Image.Exif()
            exif[0x010E] = json.dumps(info, sort_keys=True)  # ImageDescription (ASCII JSON)
            exif[0x0131] = "maxdiff"  # Software
            kw["exif"] = exif.tobytes()
        image.save(buf, FORMATS[fmt], **kw)
    return buf.getvalue()


def read_image_info(path: str | os.PathLike) -> dict[str, str]:
    """The settings an image file carries (PNG text chunks or EXIF ImageDescription JSON)."""
    from PIL import Image

    with Image.open(path) as im:
        if im.format == "PNG":
            return dict(im.text)
        desc = im.getexif().get(0x010E)
        return json.loads(desc) if desc else {}


MAX_INPUT_SIDE = 8192  # pixels per side of an image to edit (decoded before any resize)


def decode_image(data: bytes, name: str = "image") -> tuple[np.ndarray, np.ndarray | None]:
    """PNG / JPEG / WebP bytes -> (uint8 (H, W, 3) RGB, uint8 (H, W) alpha or None when the
    file has no transparency channel). ValueError naming ``name`` when the bytes are not such
    an image or it has a side above :data:`MAX_INPUT_SIDE`."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ValueError(f"{name} is empty")
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format not in ("PNG", "JPEG", "WEBP"):
                raise ValueError(f"{name} is a {im.format} image; give PNG, JPEG or WebP")
            w, h = im.size
            if max(w, h) > MAX_INPUT_SIDE:
                raise ValueError(f"{name} is {w}x{h}; sides of at most {MAX_INPUT_SIDE} pixels "
                                 "are accepted")
            im.load()
            alpha = None
            if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
                rgba = im.convert("RGBA")
                alpha = np.asarray(rgba)[..., 3].copy()
                rgb = np.asarray(rgba.convert("RGB"))
            else:
                rgb = np.asarray(im.convert("RGB"))
    except (UnidentifiedImageError, OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"{name} could not be decoded as a PNG, JPEG or WebP image "
                         f"({type(e).__name__})") from None
    return np.ascontiguousarray(rgb, np.uint8), alpha


def repaint_mask(rgb: np.ndarray, alpha: np.ndarray | None, transparent: bool | None = None
                 ) -> np.ndarray:
    """A mask file's decoded pixels -> uint8 (H, W): 255 where to repaint, 0 where to keep.

    ``transparent=True`` (OpenAI's convention): fully transparent pixels (alpha 0) are
    repainted (a mask without an alpha channel falls back to white = repaint).
    ``transparent=None`` (automatic, the native API): a mask with an alpha channel that has a
    pixel below 255 uses the transparent rule; any other mask is grayscale, white (>= 128 after
    conversion to gray) = repaint. ``transparent=False``: always white = repaint."""
    use_alpha = alpha is not None and (transparent or (transparent is None and
                                                       bool((alpha < 255).any())))
    if use_alpha:
        return np.where(alpha == 0, 255, 0).astype(np.uint8)
    from PIL import Image

    gray = np.asarray(Image.fromarray(rgb).convert("L"))
    return np.where(gray >= 128, 255, 0).astype(np.uint8)
