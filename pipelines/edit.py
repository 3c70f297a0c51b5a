"""SDXL image-to-image and inpainting: one compiled program per shape, parity with diffusers.

``ImageToImagePipeline`` is diffusers' ``StableDiffusionXLImg2ImgPipeline`` and
``InpaintPipeline`` its ``StableDiffusionXLInpaintPipeline``; both load like
:class:`pipelines.TextToImagePipeline` (``from_pretrained``) or share an already loaded
pipeline's weights (``from_pipe``). Calling one tokenizes and preprocesses the images on the
host, then runs ONE jitted program:

    text encoders -> VAE encode (posterior sample) -> add noise at the strength's start step ->
    while-loop over the remaining scheduler steps (UNet, CFG; inpainting: the 4-channel latent
    blend or the 9-channel [latents, mask, masked-image latents] input) -> VAE decode -> pixels

The strength's start step (diffusers' ``t_start = steps - min(int(steps * strength), steps)``)
and the "pure noise" switch of inpainting at ``strength == 1`` are traced inputs: a new
strength, prompt, seed, guidance, image or mask never recompiles. Programs are cached per
(kind, padded batch, latent height, latent width, steps, CFG on/off, which noises are given,
output kind, tiled VAE); :attr:`num_compiled` counts them. With ``vae_tiling`` on for the size
(``"auto"``: images of more than 2.1 megapixels for SDXL), the input images
are encoded tile by tile before the program (diffusers' tiled encode, whose moments the
program samples from) and the output decoded tile by tile after it.

The SDXL refiner (:mod:`pipelines.refiner`): image-to-image also starts from latents (a base's
``output_type="latent"``) instead of a picture, and ``denoising_start`` (diffusers' rule: the
timesteps below ``round(T - denoising_start * T)``, no noise added) replaces the strength; the
start latents, the start step and whether noise is added are program inputs and keys, and the
loop is :func:`pipelines.program.denoise`, as for every pipeline.

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
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from maxdiff import mesh as meshlib
from pipelines import program as program_lib
from pipelines.limits import (AESTHETIC_SCORE, NEGATIVE_AESTHETIC_SCORE, STRENGTH, check,
                              denoising_fraction_problem, edit_adapter_problem,
                              split_steps_problems, strength_problem)
from pipelines.requests import ImageRequest, bucket_size
from maxdiff.models.vae_tiling import use_tiling
from pipelines.text_to_image import (PipelineOutput, TextToImagePipeline, _to_pixels,
                                     conditioning)

__all__ = ["ImageToImagePipeline", "InpaintPipeline", "start_step"]


def start_step(num_inference_steps: int, strength: float) -> int:
    """diffusers' ``get_timesteps``: the index of the first of the ``num_inference_steps``
    scheduler steps that is run, ``steps - min(int(steps * strength), steps)``."""
    init = min(int(num_inference_steps * strength), num_inference_steps)
    return max(num_inference_steps - init, 0)


# ---------------------------------------------------------------------- host preprocessing
def _is_image(x) -> bool:
    from PIL import Image

    return isinstance(x, (Image.Image, np.ndarray))


def _is_latents(x) -> bool:
    """A (N, C, h, w) array (or torch tensor): a base's ``output_type="latent"``."""
    return getattr(x, "ndim", 0) == 4 and not isinstance(x, list)


def _image_list(x, name: str) -> list:
    if _is_image(x):
        return [x]
    if isinstance(x, (list, tuple)) and x and all(_is_image(i) for i in x):
        return list(x)
    raise ValueError(f"{name} must be a PIL image, a float array (H, W, 3) in [0, 1], or a "
                     f"non-empty list of them; got {type(x).__name__}")


def _size(x) -> tuple[int, int]:
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


def _noise_array(x, name: str, want: tuple[int, ...], f: int) -> np.ndarray | None:
    if x is None:
        return None
    a = np.asarray(x, np.float32)
    if a.shape != want:
        raise ValueError(f"{name} has shape {a.shape}; it must be {want} (N, C, H/{f}, W/{f})")
    return a.transpose(0, 2, 3, 1)


# ---------------------------------------------------------------------- the pipelines
class _EditPipeline:
    """What image-to-image and inpainting share (and :class:`pipelines.controlnet.ControlNetPipeline`,
    which composes on a text-to-image pipeline the same way): the text-to-image pipeline they
    run on, the program, calling.

    An edit pipeline holds its text-to-image pipeline (:attr:`pipe`) and reads the model from it
    on every call: weights (``params``, fused LoRAs included), text encoders, tokenizers, UNet,
    VAE, mesh, scheduler, defaults and adapters are the parent's live ones, so a LoRA loaded on
    the parent after :meth:`from_pipe` is used by the next edit. Every other attribute (``name``,
    ``default_steps``, ``limits``, ``load_lora_weights`` ...) is the parent's too; only
    :data:`OWN_SETTINGS` (``scheduler``, ``vae_tiling``, ``vae_tiling_threshold``) may be set
    on an edit pipeline, for it alone (its parent keeps its own). Compiled programs are the
    edit pipeline's; the weights are an input of every program (a new LoRA never recompiles
    nor goes stale) and a program is kept per scheduler object."""

    kind = "img2img"
    OWN_SETTINGS = ("scheduler", "vae_tiling", "vae_tiling_threshold")

    def __init__(self, pipe: TextToImagePipeline):
        if isinstance(pipe, _EditPipeline):
            pipe = pipe.pipe
        if not isinstance(pipe, TextToImagePipeline):
            raise TypeError(f"an edit pipeline runs on a TextToImagePipeline, got "
                            f"{type(pipe).__name__}")
        object.__setattr__(self, "pipe", pipe)
        object.__setattr__(self, "_programs", {})

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """Load a model as :meth:`TextToImagePipeline.from_pretrained` (same arguments) and
        edit with it."""
        return cls(TextToImagePipeline.from_pretrained(*args, **kwargs))

    @classmethod
    def from_single_file(cls, *args, **kwargs):
        """Load a single file as :meth:`TextToImagePipeline.from_single_file` (same arguments)."""
        return cls(TextToImagePipeline.from_single_file(*args, **kwargs))

    @classmethod
    def from_config(cls, *args, **kwargs):
        """Load a run config as :meth:`TextToImagePipeline.from_config` (same arguments)."""
        return cls(TextToImagePipeline.from_config(*args, **kwargs))

    @classmethod
    def from_pipe(cls, pipe):
        """A pipeline of this kind over ``pipe`` (a :class:`TextToImagePipeline`, or an edit
        pipeline: its text-to-image pipeline and its own settings): the parent's live weights,
        tokenizers, scheduler, defaults and adapters, nothing copied; compiled programs are
        not shared."""
        new = cls(pipe)
        if isinstance(pipe, _EditPipeline):
            for name in cls.OWN_SETTINGS:
                if name in vars(pipe):
                    setattr(new, name, vars(pipe)[name])
        return new

    def __getattr__(self, name: str):
        # only called for names not found on the edit pipeline: the parent's, live
        if name == "pipe":  # not set yet (e.g. during unpickling)
            raise AttributeError(name)
        return getattr(self.pipe, name)

    def __setattr__(self, name: str, value) -> None:
        if name not in self.OWN_SETTINGS:
            raise AttributeError(
                f"{type(self).__name__}.{name} is its text-to-image pipeline's (shared, live); "
                f"set it there (.pipe.{name} = ...), for every pipeline that shares it; only "
                f"{', '.join(self.OWN_SETTINGS)} can be set for one edit pipeline alone")
        object.__setattr__(self, name, value)

    @property
    def latent_channels(self) -> int:
        """The VAE's latent channels (the UNet of an inpainting model takes 9)."""
        return self.vae.config.latent_channels

    @property
    def unet_channels(self) -> int:
        return self.unet.config.in_channels

    @property
    def num_compiled(self) -> int:
        """How many programs this edit pipeline has compiled (one per distinct shape key)."""
        return sum(fn._cache_size() for fn in self._programs.values())

    def _program(self, key: tuple):
        # the program closes over the scheduler (its config is static): one per scheduler object,
        # so a new scheduler on the parent or here is never run with an old program. The cached
        # program keeps its scheduler alive, so its id is never reused meanwhile
        key = (id(self.scheduler), *key)
        fn = self._programs.get(key)
        if fn is None:
            fn = self._programs[key] = program_lib.jit(self.mesh, self._build(*key[1:]))
        return fn

    def uses_vae_tiling(self, height: int, width: int) -> bool:
        """Whether images of this size are encoded / decoded tile by tile (this pipeline's
        ``vae_tiling``, which is the parent's unless set here)."""
        return use_tiling(self.vae_tiling, self.vae.config, height, width,
                          self.vae_tiling_threshold)

    # ------------------------------------------------------------------ the program
    def _build(self, mode: str, batch: int, lh: int, lw: int, steps: int, cfg: bool,
               given_noise: bool, given_post: bool, given_masked_post: bool, as_uint8: bool,
               tiled: bool = False, from_latents: bool = False, noised: bool = True):
        # from_latents: ``images`` are latents (B, h, w, C) to start from (a base's output);
        # noised: they get the noise of the start step (False: ``denoising_start``, where the
        # latents are a base's, at that step's noise level already)
        te1, te2, unet, vae, sched = (self.text_encoder, self.text_encoder_2, self.unet, self.vae,
                                      self.scheduler)
        channels = self.latent_channels
        shape = (lh, lw, channels)

        def to_latents(p, images, eps):
            if tiled:  # images are the tiled encoder's moments (encode_tiled)
                return vae.apply({"params": p["vae"]}, images, None, eps,
                                 method=vae.moments_to_latents)
            return vae.apply({"params": p["vae"]}, images, None, eps, method=vae.image_to_latents)

        def program(p, ids, neg_ids, zero_negative, seeds, images, masks, masked_images, noise,
                    post_noise, masked_post_noise, guidance, rescale, time_ids, neg_time_ids,
                    sched_state, t_start, pure_noise):
            emb, pooled, time_ids, _ = conditioning(te1, te2, p, ids, neg_ids, zero_negative,
                                                    time_ids, neg_time_ids, cfg)
            calls = sched_state.timesteps.shape[0]  # model calls: steps (PNDM: steps + 1)
            k_noise, k_post, k_masked, k_steps = program_lib.image_keys(seeds, 4)

            def draw(keys):
                return program_lib.normal(keys, shape)
            if noise is None:
                noise = draw(k_noise)
            if from_latents:
                image_latents = images
            else:
                if post_noise is None:
                    post_noise = draw(k_post)
                image_latents = to_latents(p, images, post_noise)
            latents = (sched.add_noise(sched_state, image_latents, noise, t_start) if noised
                       else image_latents)
            if mode != "img2img":  # diffusers' inpainting starts from pure noise at strength 1
                latents = jnp.where(pure_noise, noise * sched.init_noise_sigma(sched_state),
                                    latents)
            extra = None
            if mode == "inpaint9":
                if masked_post_noise is None:
                    masked_post_noise = draw(k_masked)
                masked_latents = to_latents(p, masked_images, masked_post_noise)
                extra = jnp.concatenate([masks, masked_latents], axis=-1)
            g = guidance[:, None, None, None]
            r = rescale[:, None, None, None]

            def keep_unmasked(i, state, x):  # inpaint4: the unmasked part is the image,
                # noised to the next step's level
                nxt = jnp.minimum(i + 1, calls - 1)
                proper = jnp.where(i < calls - 1,
                                   sched.add_noise(state, image_latents, noise, nxt),
                                   image_latents)
                return (1 - masks) * proper + masks * x

            latents = program_lib.denoise(
                sched, lambda xin, t, i: unet.apply({"params": p["unet"]}, xin, t, emb, pooled,
                                                    time_ids),
                latents, sched_state, t_start, calls, cfg=cfg, g=g, r=r, step_keys=k_steps,
                shape=shape, extra=extra,
                after_step=keep_unmasked if mode == "inpaint4" else None)
            if tiled:
                return vae.apply({"params": p["vae"]}, latents, method=vae.unscale_latents)
            img = program_lib.decode(vae, p["vae"], latents)
            return _to_pixels(img, as_uint8)

        return program

    # ------------------------------------------------------------------ calling
    def _call(self, prompt, image, mask_image, *, strength, prompt_2, negative_prompt,
              negative_prompt_2, num_inference_steps, guidance_scale, guidance_rescale, height,
              width, num_images_per_prompt, seed, noise, image_latents_noise,
              masked_image_latents_noise, output_type, original_size, crops_coords_top_left,
              target_size, denoising_start=None, aesthetic_score=AESTHETIC_SCORE,
              negative_aesthetic_score=NEGATIVE_AESTHETIC_SCORE) -> PipelineOutput:
        if image is None:
            raise ValueError("image is required: the picture to start from")
        image_latents = None
        if _is_latents(image):  # a base's output_type="latent": (N, C, H/f, W/f)
            image_latents, per_prompt = image, {}
        else:
            per_prompt = {"image": _image_list(image, "image")}
        if self.kind == "inpaint":
            if mask_image is None:
                raise ValueError("mask_image is required: white (>= 0.5) marks what to repaint")
            per_prompt["mask_image"] = _image_list(mask_image, "mask_image")
        items, picked = self.pipe.prompt_items(
            prompt, prompt_2, negative_prompt, negative_prompt_2, num_images_per_prompt, seed,
            per_prompt=per_prompt, guidance_scale=guidance_scale,
            guidance_rescale=guidance_rescale, original_size=original_size,
            crops_coords_top_left=tuple(crops_coords_top_left), target_size=target_size,
            aesthetic_score=aesthetic_score, negative_aesthetic_score=negative_aesthetic_score)
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
        items = list(items)
        if not items:
            raise ValueError("items is empty: give at least one ImageRequest")
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
        steps = self.default_steps if num_inference_steps is None else num_inference_steps
        strength = STRENGTH[self.kind] if strength is None else strength
        for k, img in enumerate(images):
            if from_latents:
                break
            if not _is_image(img):
                raise ValueError(f"image {k} is a {type(img).__name__}; give a PIL image or a "
                                 "float array (H, W, 3) in [0, 1]")
            if inpaint:
                if not _is_image(masks[k]):
                    raise ValueError(f"mask_image {k} is a {type(masks[k]).__name__}; give a "
                                     "PIL image or a float array (H, W) in [0, 1]")
                (iw, ih), (mw, mh) = _size(img), _size(masks[k])
                if (iw, ih) != (mw, mh):
                    raise ValueError(f"mask_image is {mw}x{mh} but image is {iw}x{ih} "
                                     f"(width x height); give a mask of the image's size")
        if not from_latents:
            w0, h0 = _size(images[0])
            height = h0 - h0 % f if height is None else height
            width = w0 - w0 % f if width is None else width
        self.check_request(steps, height, width, output_type)
        if denoising_start is None:
            check([strength_problem(strength, steps)])
            t_start = start_step(steps, float(strength))
        else:
            t_start = self.start_step_at(steps, denoising_start)
        for k, it in enumerate(items):
            it.validate(k)
        lh, lw = height // f, width // f
        mode = ("inpaint9" if self.unet_channels > self.latent_channels else "inpaint4") \
            if inpaint else "img2img"
        if inpaint and mode == "inpaint9" and self.unet_channels != 2 * self.latent_channels + 1:
            raise ValueError(f"this UNet takes {self.unet_channels} input channels; inpainting "
                             f"needs {self.latent_channels} (latent blending) or "
                             f"{2 * self.latent_channels + 1} (latents, mask, masked image)")
        if mode == "img2img" and self.unet_channels != self.latent_channels:
            raise ValueError(f"this UNet takes {self.unet_channels} input channels (an "
                             "inpainting UNet); use InpaintPipeline")
        want = (n, self.latent_channels, lh, lw)
        noise = _noise_array(noise, "noise", want, f)
        post = _noise_array(image_latents_noise, "image_latents_noise", want, f)
        masked_post = _noise_array(masked_image_latents_noise, "masked_image_latents_noise",
                                   want, f)
        if mode != "inpaint9":
            masked_post = None

        cache: dict[int, np.ndarray] = {}

        def prep(obj, fn, *a):
            if id(obj) not in cache:
                cache[id(obj)] = fn(obj, *a)
            return cache[id(obj)]

        pix = image_latents if from_latents else np.stack(
            [prep(img, preprocess_image, height, width) for img in images])
        mask_lat = masked_pix = None
        if inpaint:
            mask_px = np.stack([prep(m, preprocess_mask, height, width) for m in masks])
            mask_lat = mask_px[:, ::f, ::f]  # torch's nearest downsampling by the factor f
            if mode == "inpaint9":
                masked_pix = pix * (mask_px < 0.5)

        (seeds, cfg, ids, neg_ids, zero_negative, time_ids, neg_time_ids, guidance,
         rescale) = self.pipe.host_inputs(items, height, width)

        bucket = bucket_size(n, self.mesh.size)
        put = program_lib.BatchPut(self.mesh, bucket)
        args = (put(ids, ids=True), put(neg_ids, ids=True), put(zero_negative),
                put(np.asarray(seeds, np.uint32)), put(pix), put(mask_lat), put(masked_pix),
                put(noise), put(post), put(masked_post), put(guidance), put(rescale),
                put(time_ids), put(neg_time_ids))
        rep = meshlib.replicated(self.mesh)
        state = self.scheduler.set_timesteps(steps, (bucket, lh, lw, self.latent_channels))
        state = meshlib.place(state, rep)
        scalars = meshlib.place((np.int32(t_start), np.bool_(inpaint and strength == 1.0)), rep)
        as_uint8 = output_type != "np"
        t1 = time.perf_counter()
        tiled = self.uses_vae_tiling(height, width)
        if tiled:  # the images (and masked images) become their tiled encoder moments
            args = list(args)
            for k in (4, 6):
                if args[k] is not None and not (k == 4 and from_latents):
                    args[k] = self.pipe.encode_tiled(args[k])
        program = self._program((mode, bucket, lh, lw, steps, cfg, noise is not None,
                                 post is not None, masked_post is not None, as_uint8, tiled,
                                 from_latents, denoising_start is None))
        out = program(self.params, *args, state, *scalars)
        if tiled:
            out = self.pipe.decode_tiled(out, as_uint8)
        out_images = program_lib.host_images(out, n, output_type)
        t2 = time.perf_counter()
        return PipelineOutput(out_images, [int(s) for s in seeds],
                              {"prepare_s": t1 - t0, "generate_s": t2 - t1, "batch": bucket,
                               "denoising_steps": self.scheduler.num_model_calls(steps)
                                                  - t_start})

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
                 negative_aesthetic_score: float = NEGATIVE_AESTHETIC_SCORE) -> PipelineOutput:
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
        unused, as in diffusers).
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
                          negative_aesthetic_score=negative_aesthetic_score)


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
                 target_size: tuple[int, int] | None = None) -> PipelineOutput:
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
                          crops_coords_top_left=crops_coords_top_left, target_size=target_size)
