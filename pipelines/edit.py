"""SDXL image-to-image and inpainting: one compiled program per shape, parity with diffusers.

``ImageToImagePipeline`` is diffusers' ``StableDiffusionXLImg2ImgPipeline`` and
``InpaintPipeline`` its ``StableDiffusionXLInpaintPipeline``; both load like
:class:`pipelines.TextToImagePipeline` (``from_pretrained``) or share an already loaded
pipeline's weights (``from_pipe``). Calling one tokenizes and preprocesses the images on the
host, then runs ONE jitted program (the edit task, :mod:`pipelines.tasks.edit`, run by
:mod:`pipelines.runner`):

    text encoders -> VAE encode (posterior sample) -> add noise at the strength's start step ->
    while-loop over the remaining scheduler steps (UNet, CFG; inpainting: the 4-channel latent
    blend or the 9-channel [latents, mask, masked-image latents] input) -> VAE decode -> pixels

The strength's start step (diffusers' ``t_start = steps - min(int(steps * strength), steps)``)
and the "pure noise" switch of inpainting at ``strength == 1`` are traced inputs: a new
strength, prompt, seed, guidance, image or mask never recompiles. Programs are kept per
(mode, padded batch, latent size, steps, CFG on/off, output kind, tiled VAE) in the
pipeline's own :attr:`programs`; :attr:`num_compiled` counts their compilations. With
``vae_tiling`` on for the size (``"auto"``: images of more than 2.1 megapixels for SDXL), the
input images are encoded tile by tile before the program (diffusers' tiled encode, whose moments the
program samples from) and the output decoded tile by tile after it.

The SDXL refiner (:mod:`pipelines.tasks.refine`): image-to-image also starts from latents (a base's
``output_type="latent"``) instead of a picture, and ``denoising_start`` (diffusers' rule: the
timesteps below ``round(T - denoising_start * T)``, no noise added) replaces the strength; the
start latents, the start step and whether noise is added are program inputs and keys, and the
loop is :func:`pipelines.loop.denoise`, as for every task.

Noise: ``noise`` (the add-noise noise) and ``image_latents_noise`` (the standard normal draw of
the VAE posterior sample; ``masked_image_latents_noise`` for the masked image of a 9-channel
inpainting UNet) may be given in diffusers' layout (N, C, H/f, W/f) to reproduce diffusers'
generator draws; otherwise they come from each image's seed (deterministic per seed and
independent of the batch).

Known differences from diffusers (none affects SDXL base with one image per prompt):
inpainting encodes images with the VAE's full latent normalisation (``latents_mean`` /
``latents_std`` when the config has them, as diffusers' img2img and every decode do; diffusers'
inpainting multiplies by ``scaling_factor`` only); with ``num_images_per_prompt > 1`` and one
image per prompt, prompt i's images all start from image i (diffusers tiles the image batch)
and each gets its own posterior draw (diffusers draws once per input image); the negative time
ids use the negative crop coordinates (diffusers' img2img uses the positive ones).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipelines import program as program_lib
from pipelines.composed import ComposedPipeline
from pipelines.images import (
    image_list,
    is_image,
    is_latents,
    noise_array,
    preprocess_image,
    preprocess_mask,
    size_of,
)
from pipelines.limits import (
    AESTHETIC_SCORE,
    NEGATIVE_AESTHETIC_SCORE,
    STRENGTH,
    check,
    denoising_fraction_problem,
    edit_adapter_problem,
    split_steps_problems,
    strength_problem,
)
from pipelines.program import PipelineOutput, start_step
from pipelines.prompting import prompt_items
from pipelines.requests import ImageRequest
from pipelines.runner import Job, checked_items, given, run
from pipelines.tasks.edit import EDIT

__all__ = ["ImageToImagePipeline", "InpaintPipeline", "start_step"]


# ---------------------------------------------------------------------- the pipelines
class _EditPipeline(ComposedPipeline):
    """What image-to-image and inpainting share: the host side of the edit task
    (:mod:`pipelines.tasks.edit`)."""

    kind = "img2img"
    task = EDIT

    def _call(self, prompt, image, mask_image, *, strength, prompt_2, negative_prompt,
              negative_prompt_2, num_inference_steps, guidance_scale, guidance_rescale, height,
              width, num_images_per_prompt, seed, noise, image_latents_noise,
              masked_image_latents_noise, output_type, original_size, crops_coords_top_left,
              target_size, denoising_start=None, aesthetic_score=AESTHETIC_SCORE,
              negative_aesthetic_score=NEGATIVE_AESTHETIC_SCORE,
              prompt_syntax=None, ip_adapter_image=None, ip_adapter_scale=None,
              cfg_cutoff=None, deepcache_interval=1) -> PipelineOutput:
        if image is None:
            raise ValueError("image is required: the picture to start from")
        image_latents = None
        if is_latents(image):  # a base's output_type="latent": (N, C, H/f, W/f)
            image_latents, per_prompt = image, {}
        else:
            per_prompt = {"image": image_list(image, "image")}
        if self.kind == "inpaint":
            if mask_image is None:
                raise ValueError("mask_image is required: white (>= 0.5) marks what to repaint")
            per_prompt["mask_image"] = image_list(mask_image, "mask_image")
        items, picked = prompt_items(
            prompt, prompt_2, negative_prompt, negative_prompt_2, num_images_per_prompt, seed,
            per_prompt=per_prompt, guidance_scale=guidance_scale,
            guidance_rescale=guidance_rescale, original_size=original_size,
            crops_coords_top_left=tuple(crops_coords_top_left), target_size=target_size,
            aesthetic_score=aesthetic_score, negative_aesthetic_score=negative_aesthetic_score,
            prompt_syntax=prompt_syntax, ip_adapter_image=ip_adapter_image,
            ip_adapter_scale=ip_adapter_scale, cfg_cutoff=cfg_cutoff,
            deepcache_interval=deepcache_interval)
        images, masks = picked.get("image"), picked.get("mask_image")
        return self.generate(items, images, masks,
                             strength=strength, height=height, width=width,
                             num_inference_steps=num_inference_steps, noise=noise,
                             image_latents_noise=image_latents_noise,
                             masked_image_latents_noise=masked_image_latents_noise,
                             output_type=output_type, image_latents=image_latents,
                             denoising_start=denoising_start)

    def generate(self, items: Sequence[ImageRequest], images: Sequence[Any] | None = None,
                 masks: Sequence[Any] | None = None, *, strength: float | None = None,
                 height: int | None = None, width: int | None = None,
                 num_inference_steps: int | None = None, noise: np.ndarray | None = None,
                 image_latents_noise: np.ndarray | None = None,
                 masked_image_latents_noise: np.ndarray | None = None,
                 output_type: str = "pil", latents: Any = None,
                 image_latents: np.ndarray | None = None,
                 denoising_start: float | None = None) -> PipelineOutput:
        """One output image per :class:`ImageRequest`, from ``images[k]`` (and ``masks[k]``
        for inpainting), in one device batch padded to a bucket. Items share the size, the
        step count and the strength. ``height``/``width`` default to the first image's size
        rounded down to a multiple of the VAE scale factor; every image (and mask) is resized
        to it as diffusers does.

        Image-to-image only: ``image_latents`` (N or 1, C, H/f, W/f), diffusers' layout,
        instead of ``images``: the latents to start from (a base's ``output_type="latent"``),
        not encoded. ``denoising_start`` in (0, 1): start at that fraction of the schedule
        without adding noise (the latents are a base's stopped at ``denoising_end``; diffusers'
        rule, which ignores ``strength``)."""
        t0 = time.perf_counter()
        if latents is not None:
            raise ValueError("latents= is not used here: pass noise= (the add-noise noise) and "
                             "image_latents_noise= (the VAE posterior noise)")
        items = given(items)
        check([edit_adapter_problem(it.adapter) for it in items])
        n = len(items)
        f = self.vae_scale_factor
        from_latents = image_latents is not None
        if from_latents:
            image_latents = self._start_latents(image_latents, images, n, height, width)
            images = [None] * n
            height, width = image_latents.shape[1] * f, image_latents.shape[2] * f
        if images is None or len(images) != n:
            raise ValueError(f"give one image per item: {n} item(s), "
                             f"{0 if images is None else len(images)} image(s)")
        inpaint = self.kind == "inpaint"
        if inpaint and (masks is None or len(masks) != n):
            raise ValueError(f"give one mask_image per item: {n} item(s), "
                             f"{0 if masks is None else len(masks)} mask(s)")
        if not from_latents:
            self._check_images(images, masks)
        items, steps, height, width = checked_items(
            self, items, num_inference_steps, height, width, output_type,
            size_from=None if from_latents else size_of(images[0]))
        strength = STRENGTH[self.kind] if strength is None else strength
        if denoising_start is None:
            check([strength_problem(strength, steps)])
            t_start = start_step(steps, float(strength))
        else:
            t_start = self.start_step_at(steps, denoising_start)
        mode = self._mode()
        want = (n, self.latent_channels, height // f, width // f)
        rows = {"noise": noise_array(noise, "noise", want, f),
                "post_noise": noise_array(image_latents_noise, "image_latents_noise", want, f),
                "masked_post_noise": noise_array(masked_image_latents_noise,
                                                 "masked_image_latents_noise", want, f)
                if mode == "inpaint9" else None}
        rows.update(self._pixels(image_latents if from_latents else images, masks, mode,
                                 height, width))
        job = Job(EDIT, self, items, height, width, steps, output_type, t0, rows=rows,
                  scalars={"t_start": np.int32(t_start),
                           "pure_noise": np.bool_(inpaint and strength == 1.0)},
                  key=(mode, from_latents, denoising_start is None),
                  timings={"denoising_steps": self.scheduler.num_model_calls(steps) - t_start})
        return run(job)

    def _check_images(self, images, masks) -> None:
        for k, img in enumerate(images):
            if not is_image(img):
                raise ValueError(f"image {k} is a {type(img).__name__}; give a PIL image or a "
                                 "float array (H, W, 3) in [0, 1]")
            if self.kind == "inpaint":
                if not is_image(masks[k]):
                    raise ValueError(f"mask_image {k} is a {type(masks[k]).__name__}; give a "
                                     "PIL image or a float array (H, W) in [0, 1]")
                (iw, ih), (mw, mh) = size_of(img), size_of(masks[k])
                if (iw, ih) != (mw, mh):
                    raise ValueError(f"mask_image is {mw}x{mh} but image is {iw}x{ih} "
                                     f"(width x height); give a mask of the image's size")

    def _mode(self) -> str:
        """``"img2img"``, ``"inpaint4"`` (latent blending) or ``"inpaint9"`` (a 9-channel
        inpainting UNet); ValueError when the UNet does not fit this pipeline's kind."""
        unet, latent = self.unet_channels, self.latent_channels
        if self.kind != "inpaint":
            if unet != latent:
                raise ValueError(f"this UNet takes {unet} input channels (an inpainting UNet); "
                                 "use InpaintPipeline")
            return "img2img"
        if unet == latent:
            return "inpaint4"
        if unet != 2 * latent + 1:
            raise ValueError(f"this UNet takes {unet} input channels; inpainting needs {latent} "
                             f"(latent blending) or {2 * latent + 1} (latents, mask, masked image)")
        return "inpaint9"

    def _pixels(self, images, masks, mode: str, height: int, width: int) -> dict:
        """The task's image rows: ``images`` (pixels in [-1, 1], or the given start latents),
        ``masks`` at latent resolution and ``masked_images`` (inpainting)."""
        if isinstance(images, np.ndarray):  # start latents, checked
            return {"images": images, "masks": None, "masked_images": None}
        cache: dict[int, np.ndarray] = {}  # an image given for several items is prepared once

        def prep(obj, fn, *a):
            if id(obj) not in cache:
                cache[id(obj)] = fn(obj, *a)
            return cache[id(obj)]

        f = self.vae_scale_factor
        pix = np.stack([prep(img, preprocess_image, height, width) for img in images])
        rows = {"images": pix, "masks": None, "masked_images": None}
        if mode != "img2img":
            mask_px = np.stack([prep(m, preprocess_mask, height, width) for m in masks])
            rows["masks"] = mask_px[:, ::f, ::f]  # torch's nearest downsampling by the factor f
            if mode == "inpaint9":
                rows["masked_images"] = pix * (mask_px < 0.5)
        return rows

    def start_step_at(self, steps: int, denoising_start: Any) -> int:
        """The first model call of ``steps`` that runs from ``denoising_start`` (diffusers'
        ``get_timesteps``; :func:`pipelines.program.start_step_at`); ValueError unless it is
        in (0, 1) and leaves a step."""
        check([denoising_fraction_problem(denoising_start, "denoising_start")])
        sched = self.scheduler
        timesteps = np.asarray(sched.set_timesteps(steps, (1, 1, 1, self.latent_channels))
                               .timesteps)
        t_start = program_lib.start_step_at(timesteps, sched.num_train_timesteps,
                                            float(denoising_start))
        check(split_steps_problems(1, len(timesteps) - t_start, denoising_start,
                                   "denoising_start"))
        return t_start

    def _start_latents(self, latents, images, n: int, height, width) -> np.ndarray:
        """Given start latents (N or 1, C, H/f, W/f) -> (n, H/f, W/f, C) float32, checked."""
        if self.kind != "img2img":
            raise ValueError("starting from latents is image-to-image's (give image=)")
        if images is not None:
            raise ValueError("give image= pixels or latents, not both")
        a = np.asarray(latents, np.float32)
        c, f = self.latent_channels, self.vae_scale_factor
        if a.ndim != 4 or a.shape[1] != c or a.shape[0] not in (1, n):
            raise ValueError(f"image latents have shape {a.shape}; give ({n} or 1, {c}, H/{f}, "
                             f"W/{f}) (a base's output_type='latent')")
        if not np.isfinite(a).all():
            raise ValueError("image latents are not finite")
        size = (a.shape[2] * f, a.shape[3] * f)
        if (height or size[0], width or size[1]) != size:
            raise ValueError(f"height x width {height}x{width} differs from the latents' "
                             f"{size[0]}x{size[1]}; leave them out to use the latents' size")
        return np.repeat(a, n // a.shape[0], axis=0).transpose(0, 2, 3, 1)


class ImageToImagePipeline(_EditPipeline):
    """SDXL image-to-image in JAX (diffusers' ``StableDiffusionXLImg2ImgPipeline``). Build with
    :meth:`from_pretrained` or :meth:`from_pipe`; call with ``prompt``, ``image`` and
    ``strength``."""

    kind = "img2img"

    def __call__(self, prompt: str | list[str], image: Any = None, strength: float | None = None,
                 num_inference_steps: int | None = None, guidance_scale: float | None = None,
                 negative_prompt: str | list[str] | None = None, *,
                 prompt_2: str | list[str] | None = None,
                 negative_prompt_2: str | list[str] | None = None,
                 guidance_rescale: float = 0.0, height: int | None = None,
                 width: int | None = None, num_images_per_prompt: int = 1,
                 seed: int | Sequence[int] | None = None, noise: np.ndarray | None = None,
                 image_latents_noise: np.ndarray | None = None, output_type: str = "pil",
                 original_size: tuple[int, int] | None = None,
                 crops_coords_top_left: tuple[int, int] = (0, 0),
                 target_size: tuple[int, int] | None = None,
                 denoising_start: float | None = None,
                 aesthetic_score: float = AESTHETIC_SCORE,
                 negative_aesthetic_score: float = NEGATIVE_AESTHETIC_SCORE,
                 prompt_syntax: str | None = None, ip_adapter_image: Any = None,
                 ip_adapter_scale: float | None = None, cfg_cutoff: float | None = None,
                 deepcache_interval: int = 1) -> PipelineOutput:
        """Repaint ``image`` (a PIL image or float (H, W, 3) array in [0, 1], or one per prompt)
        following ``prompt``. ``strength`` in (0, 1] (default 0.75, every front door's:
        :data:`pipelines.limits.STRENGTH`; diffusers' SDXL pipeline defaults to 0.3): the run
        starts at step ``steps - int(steps * strength)`` of ``num_inference_steps`` from the
        image's latents noised to that step's level (diffusers' rule), so ``int(steps * strength)``
        UNet steps run. ``height``/``width``: default the image's size (rounded down to a multiple
        of the VAE scale factor). ``noise`` / ``image_latents_noise``: the add-noise noise and the
        VAE posterior's standard normal draw, (N, C, H/f, W/f); by default drawn from the seeds.

        The SDXL refiner (diffusers' two-stage "ensemble of experts"): ``image`` may be latents
        (N or 1, C, H/f, W/f), a base's ``output_type="latent"`` output, which are not encoded;
        with ``denoising_start`` in (0, 1) the run starts at that fraction of the schedule (the
        timesteps below ``round(T - denoising_start * T)``) from those latents as they are, no
        noise added (``strength`` is then ignored, as in diffusers). ``aesthetic_score`` /
        ``negative_aesthetic_score`` (default 6 and 2.5) are the refiner's time ids (a model
        whose model_index.json has ``requires_aesthetics_score``; others ignore them). A refiner
        encodes ``prompt`` / ``negative_prompt`` with its one text encoder (``prompt_2`` is
        unused, as in diffusers). ``cfg_cutoff`` / ``deepcache_interval`` count the steps that
        run (:class:`pipelines.requests.ImageRequest`).
        The other arguments mean what they mean for :class:`TextToImagePipeline`."""
        return self._call(prompt, image, None, strength=strength, prompt_2=prompt_2,
                          negative_prompt=negative_prompt, negative_prompt_2=negative_prompt_2,
                          num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                          guidance_rescale=guidance_rescale, height=height, width=width,
                          num_images_per_prompt=num_images_per_prompt, seed=seed, noise=noise,
                          image_latents_noise=image_latents_noise,
                          masked_image_latents_noise=None, output_type=output_type,
                          original_size=original_size, crops_coords_top_left=crops_coords_top_left,
                          target_size=target_size, denoising_start=denoising_start,
                          aesthetic_score=aesthetic_score,
                          negative_aesthetic_score=negative_aesthetic_score,
                          prompt_syntax=prompt_syntax, ip_adapter_image=ip_adapter_image,
                          ip_adapter_scale=ip_adapter_scale, cfg_cutoff=cfg_cutoff,
                          deepcache_interval=deepcache_interval)


class InpaintPipeline(_EditPipeline):
    """SDXL inpainting in JAX (diffusers' ``StableDiffusionXLInpaintPipeline``): with a
    4-channel UNet the unmasked latents are reset to the (noised) image after every step; with
    a 9-channel inpainting UNet the mask and the masked image's latents are extra UNet
    inputs."""

    kind = "inpaint"

    def __call__(self, prompt: str | list[str], image: Any = None, mask_image: Any = None,
                 strength: float | None = None, num_inference_steps: int | None = None,
                 guidance_scale: float | None = None,
                 negative_prompt: str | list[str] | None = None, *,
                 prompt_2: str | list[str] | None = None,
                 negative_prompt_2: str | list[str] | None = None,
                 guidance_rescale: float = 0.0, height: int | None = None,
                 width: int | None = None, num_images_per_prompt: int = 1,
                 seed: int | Sequence[int] | None = None, noise: np.ndarray | None = None,
                 image_latents_noise: np.ndarray | None = None,
                 masked_image_latents_noise: np.ndarray | None = None,
                 output_type: str = "pil", original_size: tuple[int, int] | None = None,
                 crops_coords_top_left: tuple[int, int] = (0, 0),
                 target_size: tuple[int, int] | None = None,
                 prompt_syntax: str | None = None, ip_adapter_image: Any = None,
                 ip_adapter_scale: float | None = None, cfg_cutoff: float | None = None,
                 deepcache_interval: int = 1) -> PipelineOutput:
        """Repaint the white part of ``mask_image`` (PIL image or float (H, W) array in [0, 1],
        binarised at 0.5, the image's size) in ``image``. ``strength`` as for
        :class:`ImageToImagePipeline`, default 0.9999 (diffusers'); at exactly 1 the latents start
        from pure noise (diffusers). ``masked_image_latents_noise``: the posterior draw for the
        masked image (9-channel UNets only). ``height``/``width`` default to the image's size
        (diffusers defaults to the model's size)."""
        return self._call(prompt, image, mask_image, strength=strength, prompt_2=prompt_2,
                          negative_prompt=negative_prompt, negative_prompt_2=negative_prompt_2,
                          num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                          guidance_rescale=guidance_rescale, height=height, width=width,
                          num_images_per_prompt=num_images_per_prompt, seed=seed, noise=noise,
                          image_latents_noise=image_latents_noise,
                          masked_image_latents_noise=masked_image_latents_noise,
                          output_type=output_type, original_size=original_size,
                          crops_coords_top_left=crops_coords_top_left, target_size=target_size,
                          prompt_syntax=prompt_syntax, ip_adapter_image=ip_adapter_image,
                          ip_adapter_scale=ip_adapter_scale, cfg_cutoff=cfg_cutoff,
                          deepcache_interval=deepcache_interval)
