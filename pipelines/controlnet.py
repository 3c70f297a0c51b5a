"""ControlNet text-to-image: one compiled program per shape, parity with diffusers.

``ControlNetPipeline`` is diffusers' ``StableDiffusionXLControlNetPipeline`` (on an SD 1.x /
2.x model its ``StableDiffusionControlNetPipeline``), with one
ControlNet or several at once (diffusers' ``MultiControlNetModel``: each ControlNet reads its
own control image, their residuals are summed). It holds a text-to-image pipeline (:attr:`pipe`)
and composes on it as the edit pipelines do (:mod:`pipelines.edit`): the weights, tokenizers,
scheduler, defaults and adapters are the parent's, live; only the ControlNets are its own.
Build it with ``ControlNetPipeline.from_pipe(pipe, controlnet=...)`` or
``from_pretrained(path, controlnet=...)``; ``controlnet`` is a diffusers ControlNet folder, a
single ``.safetensors`` file (diffusers keys or the original layout; without its config.json it
takes the config made from this model's UNet, as diffusers' ``ControlNetModel.from_unet``), a
``(module, params)`` pair from :func:`maxdiff.models.controlnet.load_controlnet`, or a list of
them (loaded in the parent's dtype, on its mesh).

Calling it preprocesses the control images on the host (diffusers' control image processor:
resized to the output size, Lanczos for PIL images, nearest for arrays, RGB in [0, 1], no
normalisation), then runs ONE jitted program:

    text encoders -> initial noise from per-image seeds -> lax.scan over scheduler steps
    (ControlNets -> summed residuals -> UNet, classifier-free guidance) -> VAE decode -> pixels

Each image's conditioning scale for each ControlNet and step (``scale`` times diffusers'
``controlnet_keep``: 1 for step i of n when ``i / n >= start`` and ``(i + 1) / n <= end``,
else 0) and its guess mode are traced inputs, so a new scale, window, guess mode, control image,
prompt or seed never recompiles; images of one batch may each have their own. A ControlNet whose
scales are all 0 at a step (outside every image's window) is skipped at that step
(``lax.cond``), not run and multiplied by 0. Guess mode with classifier-free guidance: the
unconditional rows get no residuals (diffusers runs the ControlNet on the conditional half only
and adds zeros to the other; here the unconditional rows' scale is 0, which gives the same
zeros). Programs are cached per (padded batch, latent size, steps, CFG on/off, latents given,
output kind, tiled VAE); :attr:`num_compiled` counts them.

Noise comes from each image's seed exactly as in :class:`pipelines.TextToImagePipeline`, so an
image whose scales are all 0 is that pipeline's image for the same seed.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxdiff import adapters as adapterlib, mesh as meshlib
from maxdiff.models.controlnet import ControlNetModel, load_controlnet
from pipelines import program as program_lib
from pipelines.edit import _EditPipeline, _image_list, _is_image, _size, image_pixels
from pipelines.limits import describe
from pipelines.requests import ControlImage, ImageRequest, bucket_size
from pipelines.text_to_image import (PipelineOutput, TextToImagePipeline, _to_pixels,
                                     conditioning)

__all__ = ["ControlNetPipeline", "ControlImage", "control_inputs", "control_keep",
           "control_residuals"]

# UNet settings a ControlNet must share with the UNet it feeds (its residuals' shapes, its
# text and time inputs)
_SHARED = ("in_channels", "block_out_channels", "cross_attention_dim", "addition_time_embed_dim",
           "projection_class_embeddings_input_dim")


def control_keep(calls: int, start: float, end: float) -> np.ndarray:
    """diffusers' ``controlnet_keep`` for a run of ``calls`` model calls: float32 (calls,), 1
    where step i runs the ControlNet (``i / calls >= start`` and ``(i + 1) / calls <= end``),
    else 0. Computed on the host in float64, as diffusers does."""
    return np.array([1.0 - float(i / calls < start or (i + 1) / calls > end)
                     for i in range(calls)], np.float32)


def control_residuals(nets, cps, x, t, emb, pooled, time_ids, images, scales, guess):
    """The UNet's additional residuals from ControlNets ``nets`` (weights ``cps``) for one
    model call on rows ``x`` (the UNet's inputs ``t``, ``emb``, ``pooled``, ``time_ids``):
    ``images`` one (B, H, W, 3) control batch per ControlNet, ``scales`` (B, K) this call's
    scale of each row for each ControlNet (0 outside its window), ``guess`` (B, K). Summed over
    the ControlNets in order (diffusers' ``MultiControlNetModel``); a ControlNet whose scales
    are all 0 at this call is skipped (``lax.cond``), not run and multiplied by 0. Returns
    ``(down residuals, mid residual)``; what :class:`ControlNetPipeline`'s program and the step
    engine (:mod:`pipelines.step_engine`) both feed the UNet."""
    down = mid = None
    for k, net in enumerate(nets):
        def run(net=net, k=k):
            return net.apply({"params": cps[k]}, x, t, emb, images[k], scales[:, k],
                             text_embeds=pooled, time_ids=time_ids, guess_mode=guess[:, k])

        shapes = jax.eval_shape(run)
        d, m = jax.lax.cond(jnp.any(scales[:, k] != 0), run, lambda shapes=shapes: jax.tree.map(
            lambda s: jnp.zeros(s.shape, s.dtype), shapes))
        down = d if down is None else tuple(a + b for a, b in zip(down, d))
        mid = m if mid is None else mid + m
    return down, mid


def control_inputs(nets, controls: Sequence[Sequence[ControlImage]], height: int, width: int,
                   calls: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The host side of :func:`control_residuals` for images of ``height`` x ``width`` and a
    run of ``calls`` model calls: ``controls`` has one row per image, one
    :class:`ControlImage` per ControlNet of ``nets``. Returns the control images (one float32
    (n, H, W, 3) batch per ControlNet, resized as diffusers' control image processor does), the
    scales (n, K, calls: scale times :func:`control_keep`) and guess mode (n, K: the
    ControlImage's, or the ControlNet's ``global_pool_conditions``)."""
    k = len(nets)
    cache: dict[int, np.ndarray] = {}  # an image given for several rows is resized once

    def pixels(img, name):
        if id(img) not in cache:
            cache[id(img)] = image_pixels(img, height, width, name)
        return cache[id(img)]

    images = [np.stack([pixels(row[j].image, f"image[{j}]" if k > 1 else "image")
                        for row in controls]) for j in range(k)]
    scales = np.array([[c.scale * control_keep(calls, c.start, c.end) for c in row]
                       for row in controls], np.float32).reshape(len(controls), k, calls)
    guess = np.array([[bool(c.guess_mode) or bool(net.config.global_pool_conditions)
                       for c, net in zip(row, nets)] for row in controls]).reshape(-1, k)
    return images, scales, guess


def _as_pairs(controlnet) -> list:
    """``controlnet=`` as a list of specs (a path, or a ``(module, params)`` pair)."""
    def one(x):
        return isinstance(x, (str, os.PathLike)) or (
            isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], ControlNetModel))
    if one(controlnet):
        return [controlnet]
    if isinstance(controlnet, (list, tuple)) and controlnet and all(one(x) for x in controlnet):
        return list(controlnet)
    raise TypeError("controlnet must be a ControlNet folder or file, a (module, params) pair from "
                    "load_controlnet, or a non-empty list of them; got "
                    f"{type(controlnet).__name__}")


class ControlNetPipeline(_EditPipeline):
    """Text-to-image with ControlNets in JAX (diffusers' ``StableDiffusionXLControlNetPipeline``,
    or ``StableDiffusionControlNetPipeline`` for SD 1.x / 2.x; see the module's docstring). Build with
    :meth:`from_pipe` or :meth:`from_pretrained`; call with ``prompt`` and ``image`` (the control
    image, or one per ControlNet)."""

    kind = "controlnet"

    def __init__(self, pipe: TextToImagePipeline, controlnet: Any = None):
        super().__init__(pipe)
        if controlnet is None:
            raise TypeError("controlnet= is required: a ControlNet folder or file, a (module, params) "
                            "pair from load_controlnet, or a list of them")
        p = self.pipe
        dtype = p.unet.dtype  # the UNet's compute dtype (its weights may be quantized)
        rep = meshlib.replicated(p.mesh)
        nets, params, names = [], [], []
        for spec in _as_pairs(controlnet):
            if isinstance(spec, tuple):
                model, cn_params = spec
                cn_params = meshlib.place(cn_params, rep)
                name = "ControlNet"
            else:
                model, cn_params = load_controlnet(  # a single file: the UNet's config
                    spec, dtype, unet_config=p.unet.config, attention_kernel=p.unet.attention_kernel,
                    attention_chunk=p.unet.attention_chunk, put=meshlib.put_replicated(p.mesh))
                name = str(spec)
            self._check_fits(model, name)
            nets.append(model)
            params.append(cn_params)
            names.append(name)
        if self.unet.config.in_channels != self.latent_channels:
            raise ValueError(f"this UNet takes {self.unet.config.in_channels} input channels (an "
                             "inpainting UNet); ControlNet text-to-image needs "
                             f"{self.latent_channels}")
        object.__setattr__(self, "_nets", tuple(nets))
        object.__setattr__(self, "_cn_params", tuple(params))
        object.__setattr__(self, "_cn_names", tuple(names))

    def _check_fits(self, model: ControlNetModel, name: str) -> None:
        c, u = model.config, self.unet.config
        for key in _SHARED:
            a, b = getattr(c, key), getattr(u, key)
            if (tuple(a) if isinstance(a, (list, tuple)) else a) != (
                    tuple(b) if isinstance(b, (list, tuple)) else b):
                raise ValueError(f"{name}: its config has {key}={a!r} but this model's UNet has "
                                 f"{b!r}; it is a ControlNet for another model")
        if c.conditioning_factor != self.vae_scale_factor:
            raise ValueError(f"{name}: its conditioning image is {c.conditioning_factor}x the "
                             f"latents (conditioning_embedding_out_channels="
                             f"{list(c.conditioning_embedding_out_channels)}) but this model's "
                             f"images are {self.vae_scale_factor}x; it is a ControlNet for "
                             "another model")
        if c.conditioning_channels != 3:
            raise ValueError(f"{name}: it reads {c.conditioning_channels}-channel control "
                             "images; this pipeline feeds RGB images (3 channels)")

    @classmethod
    def from_pipe(cls, pipe, controlnet: Any = None) -> "ControlNetPipeline":
        """A ControlNet pipeline over ``pipe`` (a :class:`TextToImagePipeline`, or a pipeline
        that composes on one: its text-to-image pipeline and its own settings): the parent's
        live weights, tokenizers, scheduler, defaults and adapters. ``controlnet``: see the
        module's docstring; None reuses ``pipe``'s ControlNets when it is a ControlNet pipeline.
        Compiled programs are not shared."""
        if controlnet is None and isinstance(pipe, ControlNetPipeline):
            controlnet = list(zip(pipe._nets, pipe._cn_params))
        new = cls(pipe, controlnet)
        if isinstance(pipe, _EditPipeline):
            for name in cls.OWN_SETTINGS:
                if name in vars(pipe):
                    setattr(new, name, vars(pipe)[name])
        return new

    @classmethod
    def from_pretrained(cls, *args, controlnet: Any = None, **kwargs) -> "ControlNetPipeline":
        """Load a model as :meth:`TextToImagePipeline.from_pretrained` (same arguments) and the
        ControlNet(s) ``controlnet`` in its dtype."""
        return cls(TextToImagePipeline.from_pretrained(*args, **kwargs), controlnet)

    @classmethod
    def from_single_file(cls, *args, controlnet: Any = None, **kwargs) -> "ControlNetPipeline":
        """Load a single file as :meth:`TextToImagePipeline.from_single_file` (same arguments)."""
        return cls(TextToImagePipeline.from_single_file(*args, **kwargs), controlnet)

    @classmethod
    def from_config(cls, *args, controlnet: Any = None, **kwargs) -> "ControlNetPipeline":
        """Load a run config as :meth:`TextToImagePipeline.from_config` (same arguments)."""
        return cls(TextToImagePipeline.from_config(*args, **kwargs), controlnet)

    @property
    def controlnets(self) -> tuple[ControlNetModel, ...]:
        """The ControlNet modules, in the order their images and scales are given."""
        return self._nets

    @property
    def controlnet_params(self) -> tuple[dict, ...]:
        """Each ControlNet's weights (on the parent's mesh, replicated)."""
        return self._cn_params

    def check_controls(self, entries, where: str = "") -> None:
        """ValueError unless ``entries`` is one image's conditioning: a list of one
        :class:`ControlImage` per ControlNet, each with a valid scale and window and an image
        (PIL, or a float (H, W, 3) array); ``where`` starts the message."""
        k = len(self._nets)
        if not isinstance(entries, list) or len(entries) != k or not all(
                isinstance(c, ControlImage) for c in entries):
            raise ValueError(f"{where}give one ControlImage per ControlNet ({k}), got "
                             f"{entries!r:.80}")
        for j, c in enumerate(entries):
            found = c.problems(f"ControlNet {j}" if k > 1 else "")
            if found:
                raise ValueError(where + "; ".join(describe(p) for p in found))
            if not _is_image(c.image):
                name = f"image[{j}]" if k > 1 else "image"
                raise ValueError(f"{where}{name} is a {type(c.image).__name__}; give a PIL "
                                 "image or a float array (H, W, 3) in [0, 1]")

    # ------------------------------------------------------------------ the program
    def _build(self, batch: int, lh: int, lw: int, steps: int, cfg: bool, given_latents: bool,
               as_uint8: bool, tiled: bool):
        te1, te2, unet, vae, sched = (self.text_encoder, self.text_encoder_2, self.unet, self.vae,
                                      self.scheduler)
        nets = self._nets
        channels = self.latent_channels

        def program(p, cps, ids, neg_ids, zero_negative, seeds, latents, guidance, rescale,
                    time_ids, neg_time_ids, images, scales, guess, sched_state, ad=None,
                    aidx=None):
            # images: one (B, H, W, 3) per ControlNet; scales (B, K, calls): scale x keep;
            # guess (B, K)
            emb, pooled, time_ids, uidx = conditioning(te1, te2, p, ids, neg_ids, zero_negative,
                                                       time_ids, neg_time_ids, cfg, ad, aidx)
            init_keys, step_keys = program_lib.image_keys(seeds)
            if latents is None:
                latents = program_lib.normal(init_keys, (lh, lw, channels))
            latents = latents.astype(jnp.float32) * sched.init_noise_sigma(sched_state)
            g = guidance[:, None, None, None]
            r = rescale[:, None, None, None]
            if cfg:  # rows [unconditional, conditional]; guess mode: no residuals for the first
                images = [program_lib.cfg_rows(im, im) for im in images]
                scales = program_lib.cfg_rows(jnp.where(guess[..., None], 0.0, scales), scales)
                guess = program_lib.cfg_rows(guess, guess)

            def model(xin, t, i):
                down, mid = control_residuals(nets, cps, xin, t, emb, pooled, time_ids, images,
                                              scales[:, :, i], guess)
                with adapterlib.applied((ad or {}).get("unet"), uidx):
                    return unet.apply({"params": p["unet"]}, xin, t, emb, pooled, time_ids,
                                      down_block_additional_residuals=down,
                                      mid_block_additional_residual=mid)

            calls = sched_state.timesteps.shape[0]
            latents = program_lib.denoise(sched, model, latents, sched_state, 0, calls, cfg=cfg,
                                          g=g, r=r, step_keys=step_keys,
                                          shape=(lh, lw, channels))
            if tiled:  # decoded tile by tile afterwards (decode_tiled)
                return vae.apply({"params": p["vae"]}, latents, method=vae.unscale_latents)
            img = program_lib.decode(vae, p["vae"], latents)
            return _to_pixels(img, as_uint8)

        return program

    # ------------------------------------------------------------------ calling
    def _per_net(self, value, name: str) -> list:
        k = len(self._nets)
        if isinstance(value, (list, tuple)):
            if len(value) != k:
                raise ValueError(f"{name} has {len(value)} values but this pipeline has {k} "
                                 "ControlNet(s); give one number, or one per ControlNet")
            return list(value)
        return [value] * k

    def __call__(self, prompt: str | list[str], image: Any = None,
                 num_inference_steps: int | None = None, guidance_scale: float | None = None,
                 negative_prompt: str | list[str] | None = None, *,
                 controlnet_conditioning_scale: float | Sequence[float] = 1.0,
                 control_guidance_start: float | Sequence[float] = 0.0,
                 control_guidance_end: float | Sequence[float] = 1.0, guess_mode: bool = False,
                 prompt_2: str | list[str] | None = None,
                 negative_prompt_2: str | list[str] | None = None,
                 guidance_rescale: float = 0.0, height: int | None = None,
                 width: int | None = None, num_images_per_prompt: int = 1,
                 seed: int | Sequence[int] | None = None, latents: np.ndarray | None = None,
                 output_type: str = "pil", original_size: tuple[int, int] | None = None,
                 crops_coords_top_left: tuple[int, int] = (0, 0),
                 target_size: tuple[int, int] | None = None,
                 negative_original_size: tuple[int, int] | None = None,
                 negative_crops_coords_top_left: tuple[int, int] = (0, 0),
                 negative_target_size: tuple[int, int] | None = None) -> PipelineOutput:
        """Generate images following ``prompt`` and the control image(s); the arguments mean
        what diffusers' ``StableDiffusionXLControlNetPipeline`` gives them.

        ``image``: with one ControlNet, a PIL image or float (H, W, 3) array in [0, 1], or one
        per prompt; with several, a list of one such entry per ControlNet.
        ``controlnet_conditioning_scale`` (in [0, 10]), ``control_guidance_start`` /
        ``control_guidance_end`` (0 <= start < end <= 1, fractions of the steps): one number
        for every ControlNet or one per ControlNet. ``guess_mode``: diffusers' (forced on when
        the first ControlNet has ``global_pool_conditions``). ``height``/``width`` default to
        the first control image's size rounded down to a multiple of the VAE scale factor;
        control images are resized to the output size. ``latents``: initial noise (N, C, H/f,
        W/f) as diffusers takes it. The other arguments mean what they mean for
        :class:`TextToImagePipeline`."""
        k = len(self._nets)
        if image is None:
            raise ValueError("image is required: the control image (one per ControlNet)")
        if k == 1:
            names, units = ["image"], [image]
        else:
            if not isinstance(image, (list, tuple)) or len(image) != k:
                got = f"{len(image)} entries" if isinstance(image, (list, tuple)) else \
                    f"one {type(image).__name__}"
                raise ValueError(f"image: this pipeline has {k} ControlNets; give a list of {k} "
                                 "control images, one per ControlNet (each an image or a list "
                                 f"of one per prompt), got {got}")
            names, units = [f"image[{j}]" for j in range(k)], list(image)
        per_prompt = {name: _image_list(u, name) for name, u in zip(names, units)}
        scales = self._per_net(controlnet_conditioning_scale, "controlnet_conditioning_scale")
        starts = self._per_net(control_guidance_start, "control_guidance_start")
        ends = self._per_net(control_guidance_end, "control_guidance_end")
        if not isinstance(guess_mode, (bool, np.bool_)):
            raise ValueError(f"guess_mode={guess_mode!r}; give True or False")
        guess = bool(guess_mode) or bool(self._nets[0].config.global_pool_conditions)
        neg_size = None
        if negative_original_size is not None and negative_target_size is not None:
            neg_size = (tuple(negative_original_size), tuple(negative_crops_coords_top_left),
                        tuple(negative_target_size))
        items, picked = self.pipe.prompt_items(
            prompt, prompt_2, negative_prompt, negative_prompt_2, num_images_per_prompt, seed,
            per_prompt=per_prompt, guidance_scale=guidance_scale,
            guidance_rescale=guidance_rescale, original_size=original_size,
            crops_coords_top_left=tuple(crops_coords_top_left), target_size=target_size,
            negative_size=neg_size)
        controls = [[ControlImage(picked[name][row], scales[j], starts[j], ends[j], guess)
                     for j, name in enumerate(names)] for row in range(len(items))]
        return self.generate(items, controls, height=height, width=width,
                             num_inference_steps=num_inference_steps, latents=latents,
                             output_type=output_type)

    def generate(self, items: Sequence[ImageRequest], controls: Sequence[Sequence[ControlImage]],
                 *, height: int | None = None, width: int | None = None,
                 num_inference_steps: int | None = None, latents: np.ndarray | None = None,
                 output_type: str = "pil") -> PipelineOutput:
        """One output image per :class:`ImageRequest`, conditioned by ``controls[k]``: one
        :class:`ControlImage` per ControlNet (in :attr:`controlnets` order) with that image's
        control image, scale, window and guess mode, in one device batch padded to a bucket.
        Items share the size and step count; ``height``/``width`` default to the first control
        image's size rounded down to a multiple of the VAE scale factor."""
        t0 = time.perf_counter()
        items = list(items)
        if not items:
            raise ValueError("items is empty: give at least one ImageRequest")
        n = len(items)
        controls = [list(row) if isinstance(row, (list, tuple)) else row for row in controls]
        if len(controls) != n:
            raise ValueError(f"give one list of ControlImage per item: {n} item(s), "
                             f"{len(controls)} given")
        for row, entries in enumerate(controls):
            self.check_controls(entries, f"item {row}: " if row else "")
        steps = self.default_steps if num_inference_steps is None else num_inference_steps
        f = self.vae_scale_factor
        w0, h0 = _size(controls[0][0].image)
        height = h0 - h0 % f if height is None else height
        width = w0 - w0 % f if width is None else width
        self.check_request(steps, height, width, output_type)
        for row, it in enumerate(items):
            it.validate(row)
        lh, lw = height // f, width // f
        if latents is not None:
            latents = np.asarray(latents, np.float32)
            want = (n, self.latent_channels, lh, lw)
            if latents.shape != want:
                raise ValueError(f"latents has shape {latents.shape}; for {n} image(s) of "
                                 f"{width}x{height} it must be {want} (N, C, H/{f}, W/{f})")
            latents = latents.transpose(0, 2, 3, 1)

        images, scales, guess = control_inputs(self._nets, controls, height, width,
                                               self.scheduler.num_model_calls(steps))
        (seeds, cfg, ids, neg_ids, zero_negative, time_ids, neg_time_ids, guidance,
         rescale) = self.pipe.host_inputs(items, height, width)
        adapter_idx = self.pipe.adapter_index(items)

        bucket = bucket_size(n, self.mesh.size)
        put = program_lib.BatchPut(self.mesh, bucket)
        args = (put(ids, ids=True), put(neg_ids, ids=True), put(zero_negative),
                put(np.asarray(seeds, np.uint32)), put(latents), put(guidance), put(rescale),
                put(time_ids), put(neg_time_ids), [put(im) for im in images], put(scales),
                put(guess))
        state = self.scheduler.set_timesteps(steps, (bucket, lh, lw, self.latent_channels))
        state = meshlib.place(state, meshlib.replicated(self.mesh))
        as_uint8 = output_type != "np"
        tiled = self.uses_vae_tiling(height, width)
        program = self._program((bucket, lh, lw, steps, cfg, latents is not None, as_uint8,
                                 tiled))
        t1 = time.perf_counter()
        if adapter_idx is None:
            out = program(self.params, self._cn_params, *args, state)
        else:
            out = program(self.params, self._cn_params, *args, state,
                          self.adapter_tables.as_tree(), put(adapter_idx))
        if tiled:
            out = self.pipe.decode_tiled(out, as_uint8)
        out_images = program_lib.host_images(out, n, output_type)
        t2 = time.perf_counter()
        return PipelineOutput(out_images, [int(s) for s in seeds],
                              {"prepare_s": t1 - t0, "generate_s": t2 - t1, "batch": bucket})
