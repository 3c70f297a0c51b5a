"""Images on the host, as diffusers' image processors prepare them: PIL images or float arrays
in [0, 1] resized to the output size (Lanczos for PIL, nearest for arrays), normalised for the
VAE (:func:`preprocess_image`), masks binarised (:func:`preprocess_mask`), control images in
[0, 1] (:func:`image_pixels`); and the checks that name the bad argument."""

from __future__ import annotations

import numpy as np

__all__ = ["image_pixels", "preprocess_image", "preprocess_mask", "is_image", "is_latents",
           "image_list", "size_of", "noise_array"]


def is_image(x) -> bool:
    from PIL import Image

    return isinstance(x, (Image.Image, np.ndarray))


def is_latents(x) -> bool:
    """A (N, C, h, w) array (or torch tensor): a base's ``output_type="latent"``."""
    return getattr(x, "ndim", 0) == 4 and not isinstance(x, list)


def image_list(x, name: str) -> list:
    if is_image(x):
        return [x]
    if isinstance(x, (list, tuple)) and x and all(is_image(i) for i in x):
        return list(x)
    raise ValueError(f"{name} must be a PIL image, a float array (H, W, 3) in [0, 1], or a "
                     f"non-empty list of them; got {type(x).__name__}")


def size_of(x) -> tuple[int, int]:
    """(width, height) of a PIL image or an (H, W[, C]) array."""
    if isinstance(x, np.ndarray):
        return int(x.shape[1]), int(x.shape[0])
    return x.size


def _nearest(a: np.ndarray, height: int, width: int) -> np.ndarray:
    """torch.nn.functional.interpolate(mode="nearest") on an (H, W, C) array."""
    h, w = a.shape[:2]
    if (h, w) == (height, width):
        return a
    rows = np.minimum(np.floor(np.arange(height) * np.float32(h / height)).astype(int), h - 1)
    cols = np.minimum(np.floor(np.arange(width) * np.float32(w / width)).astype(int), w - 1)
    return a[rows][:, cols]


def _float_array(a: np.ndarray, name: str, channels: tuple[int, ...]) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim == 2 and 1 in channels:
        a = a[..., None]
    if a.ndim != 3 or a.shape[-1] not in channels:
        want = "(H, W, 3)" if channels == (3,) else "(H, W) or (H, W, 1)"
        raise ValueError(f"{name} array has shape {a.shape}; give {want}")
    if not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"{name} array has dtype {a.dtype}; give floats in [0, 1] (or a PIL image)")
    a = a.astype(np.float32)
    if a.size and (not np.isfinite(a).all() or a.min() < 0 or a.max() > 1):
        raise ValueError(f"{name} array has values in [{a.min()}, {a.max()}]; give floats in [0, 1]")
    return a


def image_pixels(img, height: int, width: int, name: str = "image") -> np.ndarray:
    """diffusers' ``VaeImageProcessor.preprocess`` for one image without the normalisation (its
    ``do_normalize=False``, as the ControlNet pipelines' control image processor): PIL images
    are resized with Lanczos and converted to RGB, arrays resized with nearest neighbour, to
    (height, width); returns float32 (H, W, 3) in [0, 1]."""
    from PIL import Image

    if isinstance(img, Image.Image):
        if img.size != (width, height):
            img = img.resize((width, height), resample=Image.LANCZOS)
        return np.asarray(img.convert("RGB")).astype(np.float32) / 255.0
    return _nearest(_float_array(img, name, (3,)), height, width)


def preprocess_image(img, height: int, width: int, name: str = "image") -> np.ndarray:
    """diffusers' ``VaeImageProcessor.preprocess`` for one image (:func:`image_pixels`),
    normalised to [-1, 1]: float32 (H, W, 3)."""
    return image_pixels(img, height, width, name) * 2.0 - 1.0


def preprocess_mask(mask, height: int, width: int) -> np.ndarray:
    """diffusers' mask processor: grayscale, resized to (height, width) (Lanczos for PIL,
    nearest for arrays), binarised at 0.5. Returns float32 (H, W, 1) of 0 (keep) / 1 (repaint)."""
    from PIL import Image

    if isinstance(mask, Image.Image):
        if mask.size != (width, height):
            mask = mask.resize((width, height), resample=Image.LANCZOS)
        a = np.asarray(mask.convert("L")).astype(np.float32)[..., None] / 255.0
    else:
        a = _nearest(_float_array(mask, "mask_image", (1,)), height, width)
    return (a >= 0.5).astype(np.float32)


def noise_array(x, name: str, want: tuple[int, ...], f: int) -> np.ndarray | None:
    if x is None:
        return None
    a = np.asarray(x, np.float32)
    if a.shape != want:
        raise ValueError(f"{name} has shape {a.shape}; it must be {want} (N, C, H/{f}, W/{f})")
    return a.transpose(0, 2, 3, 1)
