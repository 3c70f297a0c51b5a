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
``(module, params)`` pair from :func:`maxdiff.loaders.load_controlnet`, or a list of
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
zeros). The program is the ControlNet task's (:mod:`pipelines.tasks.controlnet`), kept per
(padded batch, latent size, steps, CFG on/off, output kind, tiled VAE) in the pipeline's own
:attr:`programs`; :attr:`num_compiled` counts their compilations.

Noise comes from each image's seed exactly as in :class:`pipelines.TextToImagePipeline`, so an
image whose scales are all 0 is that pipeline's image for the same seed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from maxdiff import hub
from maxdiff import mesh as meshlib
from maxdiff.loaders import load_controlnet
from maxdiff.models.controlnet import ControlNetModel
from pipelines.composed import ComposedPipeline
from pipelines.conditioned_requests import ControlImage
from pipelines.images import image_list, is_image, size_of
from pipelines.limits import describe
from pipelines.program import PipelineOutput
from pipelines.prompting import prompt_items
from pipelines.requests import ImageRequest
from pipelines.runner import Job, checked_items, given, run
from pipelines.tasks.controlnet import CONTROLNET, control_inputs, control_keep, control_residuals
from pipelines.text_to_image import TextToImagePipeline

__all__ = ["ControlNetPipeline", "ControlImage", "control_inputs", "control_keep",
           "control_residuals"]

# UNet settings a ControlNet must share with the UNet it feeds (its residuals' shapes, its
# text and time inputs)
_SHARED = ("in_channels", "block_out_channels", "cross_attention_dim", "addition_time_embed_dim",
           "projection_class_embeddings_input_dim")


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


class ControlNetPipeline(ComposedPipeline):
    """Text-to-image with ControlNets in JAX (diffusers' ``StableDiffusionXLControlNetPipeline``,
    or ``StableDiffusionControlNetPipeline`` for SD 1.x / 2.x; see the module's docstring). Build with
    :meth:`from_pipe` or :meth:`from_pretrained`; call with ``prompt`` and ``image`` (the control
    image, or one per ControlNet)."""

    kind = "controlnet"
    task = CONTROLNET

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
            else:  # a folder, a file, or a Hugging Face name: its snapshot in the local cache
                model, cn_params = load_controlnet(  # a single file: the UNet's config
                    hub.resolve(spec), dtype, unet_config=p.unet.config,
                    attention_kernel=p.unet.attention_kernel,
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
    def from_pipe(cls, pipe, controlnet: Any = None) -> ControlNetPipeline:
        """A ControlNet pipeline over ``pipe`` (a :class:`TextToImagePipeline`, or a pipeline
        that composes on one: its text-to-image pipeline and its own settings): the parent's
        live weights, tokenizers, scheduler, defaults and adapters. ``controlnet``: see the
        module's docstring; None reuses ``pipe``'s ControlNets when it is a ControlNet pipeline.
        Compiled programs are not shared."""
        if controlnet is None and isinstance(pipe, ControlNetPipeline):
            controlnet = list(zip(pipe._nets, pipe._cn_params))
        new = cls(pipe, controlnet)
        if isinstance(pipe, ComposedPipeline):
            for name in cls.OWN_SETTINGS:
                if name in vars(pipe):
                    setattr(new, name, vars(pipe)[name])
        return new

    @classmethod
    def from_pretrained(cls, *args, controlnet: Any = None, **kwargs) -> ControlNetPipeline:
        """Load a model as :meth:`TextToImagePipeline.from_pretrained` (same arguments) and the
        ControlNet(s) ``controlnet`` in its dtype."""
        return cls(TextToImagePipeline.from_pretrained(*args, **kwargs), controlnet)

    @classmethod
    def from_single_file(cls, *args, controlnet: Any = None, **kwargs) -> ControlNetPipeline:
        """Load a single file as :meth:`TextToImagePipeline.from_single_file` (same arguments)."""
        return cls(TextToImagePipeline.from_single_file(*args, **kwargs), controlnet)

    @classmethod
    def from_config(cls, *args, controlnet: Any = None, **kwargs) -> ControlNetPipeline:
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
            if not is_image(c.image):
                name = f"image[{j}]" if k > 1 else "image"
                raise ValueError(f"{where}{name} is a {type(c.image).__name__}; give a PIL "
                                 "image or a float array (H, W, 3) in [0, 1]")

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
                 negative_target_size: tuple[int, int] | None = None,
                 prompt_syntax: str | None = None, ip_adapter_image: Any = None,
                 ip_adapter_scale: float | None = None, cfg_cutoff: float | None = None,
                 deepcache_interval: int = 1) -> PipelineOutput:
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
        per_prompt = {name: image_list(u, name) for name, u in zip(names, units)}
        scales = self._per_net(controlnet_conditioning_scale, "controlnet_conditioning_scale")
        starts = self._per_net(control_guidance_start, "control_guidance_start")
        ends = self._per_net(control_guidance_end, "control_guidance_end")
        if not isinstance(guess_mode, (bool, np.bool_)):
            raise ValueError(f"guess_mode={guess_mode!r}; give True or False")
        guess = bool(guess_mode) or bool(self._nets[0].config.global_pool_conditions)
        items, picked = prompt_items(
            prompt, prompt_2, negative_prompt, negative_prompt_2, num_images_per_prompt, seed,
            per_prompt=per_prompt, guidance_scale=guidance_scale,
            guidance_rescale=guidance_rescale, original_size=original_size,
            crops_coords_top_left=tuple(crops_coords_top_left), target_size=target_size,
            negative_original_size=negative_original_size,
            negative_crops_coords_top_left=negative_crops_coords_top_left,
            negative_target_size=negative_target_size, prompt_syntax=prompt_syntax,
            ip_adapter_image=ip_adapter_image, ip_adapter_scale=ip_adapter_scale,
            cfg_cutoff=cfg_cutoff, deepcache_interval=deepcache_interval)
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
        items = given(items)
        n = len(items)
        controls = [list(row) if isinstance(row, (list, tuple)) else row for row in controls]
        if len(controls) != n:
            raise ValueError(f"give one list of ControlImage per item: {n} item(s), "
                             f"{len(controls)} given")
        for row, entries in enumerate(controls):
            self.check_controls(entries, f"item {row}: " if row else "")
        items, steps, height, width = checked_items(
            self, items, num_inference_steps, height, width, output_type,
            size_from=size_of(controls[0][0].image))
        latents = self.initial_latents(latents, n, height, width)
        images, scales, guess = control_inputs(self._nets, controls, height, width,
                                               self.scheduler.num_model_calls(steps))
        return run(Job(CONTROLNET, self, items, height, width, steps, output_type, t0,
                       rows={"latents": latents, "images": images, "scales": scales,
                             "guess": guess},
                       weights=self._cn_params))
