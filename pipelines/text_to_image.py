"""Text-to-image (diffusers' ``StableDiffusionXLPipeline`` / ``StableDiffusionPipeline``), and
the loaded model every other pipeline composes on.

``TextToImagePipeline.from_pretrained(folder)`` reads a diffusers folder (or a single file) of
a model family (:mod:`maxdiff.family`); calling the pipeline tokenizes on the host, then runs ONE
jitted program over the device mesh (:mod:`pipelines.runner`):

    text encoders -> initial noise from per-image seeds -> lax.scan over scheduler steps
    (UNet, classifier-free guidance) -> VAE decode -> pixels

Token ids, seeds, guidance and the scheduler's timesteps/sigmas are traced inputs, so a new
prompt, seed or guidance never recompiles. Programs are kept per shape key
(:attr:`TextToImagePipeline.programs`); JAX's persistent compilation cache makes a restarted
process start warm.
"""

from __future__ import annotations

import dataclasses
import secrets
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxdiff import quantization as quantlib
from maxdiff.family import FAMILIES, Family
from maxdiff.models.vae_tiling import (
    tile_decoder,
    tile_encoder,
    tiled_decode,
    tiled_encode,
    use_tiling,
)
from maxdiff.schedulers import max_inference_steps
from pipelines import program as program_lib
from pipelines import prompting
from pipelines.adapting import LoraAdapters
from pipelines.constructors import Constructors
from pipelines.embeddings import TextualInversion
from pipelines.ip_adapting import ImagePrompts
from pipelines.limits import (
    AESTHETIC_SCORE,
    HIGH_NOISE_FRAC,
    MAX_SEED,
    NEGATIVE_AESTHETIC_SCORE,
    Limits,
    cfg_on,
    check,
    output_type_problem,
    problems,
)
from pipelines.loading import enable_compile_cache, model_root
from pipelines.previews import Previews
from pipelines.program import HostInputs, PipelineOutput
from pipelines.prompting import prompt_items
from pipelines.requests import HiresFix, ImageRequest
from pipelines.runner import TEXT, Job, checked_items, run

__all__ = ["TextToImagePipeline", "PipelineOutput", "enable_compile_cache", "model_root"]

_abs_sum = jax.jit(lambda x: jnp.sum(jnp.abs(x.astype(jnp.float32))))


class TextToImagePipeline(Constructors, LoraAdapters, TextualInversion, ImagePrompts, Previews):
    """Text-to-image in JAX. Build with :meth:`from_pretrained`; call like diffusers'
    ``StableDiffusionXLPipeline``. ``family``: the model family (:mod:`maxdiff.family`; default
    SDXL base, or SD 1.x without ``text_encoder_2``)."""

    task = TEXT  # the task its calls and step engines run (pipelines.runner.Task)

    def __init__(self, *, tokenizer, tokenizer_2, text_encoder, text_encoder_2, unet, vae,
                 scheduler, params: dict, mesh, force_zeros_for_empty_prompt: bool | None = None,
                 default_steps: int | None = None, default_guidance: float | None = None,
                 name: str = "", quantization: str = "none", family: Family | None = None,
                 safety_checker=None):
        if family is None:
            family = FAMILIES["sdxl-base" if text_encoder_2 is not None else "sd1"]
        self.family = family
        # SD 1.x's safety checker where the checkpoint ships one (diffusers runs it by
        # default): flagged images come back black, ``nsfw_content_detected`` says which
        self.safety_checker = safety_checker
        self.tokenizer, self.tokenizer_2 = tokenizer, tokenizer_2
        self.text_encoder, self.text_encoder_2 = text_encoder, text_encoder_2
        self.unet, self.vae, self.scheduler = unet, vae, scheduler
        self.params = params
        self.mesh = mesh
        self.force_zeros_for_empty_prompt = (family.zero_negative if force_zeros_for_empty_prompt
                                             is None else force_zeros_for_empty_prompt)
        # an SDXL refiner (a pipeline, or an image-to-image pipeline over one) that finishes
        # every image from ``high_noise_frac`` of the schedule, base and refiner in one
        # program (:mod:`pipelines.tasks.refine`); None: no refiner
        self.refiner = None
        self.high_noise_frac = HIGH_NOISE_FRAC
        self.default_steps = family.steps if default_steps is None else default_steps
        self.default_guidance = family.guidance if default_guidance is None else default_guidance
        self.name = name
        # "none", "int8-weights", "int8" or "fp8": how the UNet's weights (and activations) are
        # quantized (maxdiff.quantization); ``unet`` and ``params["unet"]`` are then qwix's
        self.quantization = quantlib.check_quantization(quantization)
        self.vae_scale_factor = vae.config.vae_scale_factor
        self.latent_channels = unet.config.in_channels
        self.default_height = self.default_width = None
        self.max_size = None  # largest side the model is meant for (maxdiff.json), if stated
        # encode / decode large images tile by tile (diffusers' enable_tiling): "auto", True,
        # False (maxdiff.models.vae_tiling.use_tiling)
        self.vae_tiling: bool | str = "auto"
        # "auto" tiles images of more than this many pixels; None: auto_tile_pixels(vae config)
        self.vae_tiling_threshold: int | None = None
        # (the VAE weights, their jitted tile decoder / encoder), made again for new VAE weights
        self._tile_decoder = None
        self._tile_encoder = None
        self.run_config = None
        self.programs = program_lib.Programs(mesh)  # compiled programs, by shape key
        self._base_params: dict | None = None  # the weights before any LoRA was fused
        self._loras: list[tuple[str, str, float, list]] = []  # (name, file, scale, layers)
        # per-image adapters (add_adapter), unfused: (name, file, scale, layers), index order
        self._adapters: list[tuple[str, str, float, list]] = []
        self._adapter_tables = None  # maxdiff.adapters.AdapterTables, None without adapters

    # ------------------------------------------------------------------ the program
    @property
    def max_steps(self) -> int:
        """The most denoising steps the loaded scheduler allows (its ``num_train_timesteps``;
        for LCM its ``original_inference_steps``)."""
        return max_inference_steps(self.scheduler)

    def scheduler_for(self, name: str):
        """The scheduler of sampler ``name`` (:mod:`maxdiff.schedulers.names`) for this model:
        :attr:`scheduler` switched to it, made once (a new :attr:`scheduler` makes them again).
        ValueError naming the field for a name that is no sampler."""
        from maxdiff.sampler_names import normalise, sampler_problem
        from maxdiff.schedulers import load_scheduler

        if (problem := sampler_problem(name)) is not None:
            raise ValueError(f"scheduler: {problem}")
        made = self.__dict__.setdefault("_samplers", {})
        if made.get(None) is not self.scheduler:  # made from another scheduler: forget them
            made.clear()
            made[None] = self.scheduler
        key = normalise(name)
        if key not in made:
            made[key] = load_scheduler(name, base=self.scheduler)
        return made[key]

    def probe(self) -> float:
        """Run a tiny program on the devices with the loaded weights (health checks); raises if
        the devices or the weights are unusable."""
        leaf = jax.tree_util.tree_leaves(self.params)[-1]
        value = float(_abs_sum(leaf))
        if not np.isfinite(value):
            raise RuntimeError("the loaded weights are not finite")
        return value

    @property
    def num_compiled(self) -> int:
        """How many programs have been compiled (one per distinct shape key)."""
        return self.programs.num_compiled

    @property
    def requires_aesthetics_score(self) -> bool:
        """Whether the model's time ids are the SDXL refiner's five (size, crop, aesthetic
        score)."""
        return self.family.n_time_ids == 5

    def uses_vae_tiling(self, height: int, width: int) -> bool:
        """Whether images of this size are encoded / decoded tile by tile (``vae_tiling``,
        ``vae_tiling_threshold``; the rule: :func:`maxdiff.models.vae_tiling.use_tiling`). When
        they are, a program returns unscaled latents and :meth:`decode_tiled` makes the pixels."""
        return use_tiling(self.vae_tiling, self.vae.config, height, width,
                          self.vae_tiling_threshold)

    def encode_tiled(self, images):
        """Images (B, H, W, 3) in [-1, 1] -> the VAE encoder's moments (B, H/f, W/f, 2C), tile
        by tile (diffusers' tiled encode; bounded memory), with the current VAE weights."""
        vae_params = self.params["vae"]
        if self._tile_encoder is None or self._tile_encoder[0] is not vae_params:
            self._tile_encoder = (vae_params, tile_encoder(self.vae, vae_params))
        return tiled_encode(self.vae.config, self._tile_encoder[1], images)

    def decode_tiled(self, z, as_uint8: bool):
        """Unscaled VAE latents (B, H/f, W/f, C) -> pixels (B, H, W, 3), uint8 or float32 in
        [0, 1], with diffusers' tiled decode (bounded memory), with the current VAE weights."""
        vae_params = self.params["vae"]
        if self._tile_decoder is None or self._tile_decoder[0] is not vae_params:
            self._tile_decoder = (vae_params, tile_decoder(self.vae, vae_params))
        img = tiled_decode(self.vae.config, self._tile_decoder[1], z)
        return program_lib.to_pixels(img, as_uint8)

    # ------------------------------------------------------------------ calling
    def __call__(self, prompt: str | list[str], prompt_2: str | list[str] | None = None,
                 negative_prompt: str | list[str] | None = None,
                 negative_prompt_2: str | list[str] | None = None,
                 num_inference_steps: int | None = None, guidance_scale: float | None = None,
                 guidance_rescale: float = 0.0, height: int | None = None, width: int | None = None,
                 num_images_per_prompt: int = 1, seed: int | Sequence[int] | None = None,
                 latents: np.ndarray | None = None, output_type: str = "pil",
                 original_size: tuple[int, int] | None = None,
                 crops_coords_top_left: tuple[int, int] = (0, 0),
                 target_size: tuple[int, int] | None = None,
                 negative_original_size: tuple[int, int] | None = None,
                 negative_crops_coords_top_left: tuple[int, int] = (0, 0),
                 negative_target_size: tuple[int, int] | None = None,
                 denoising_end: float | None = None,
                 aesthetic_score: float = AESTHETIC_SCORE,
                 negative_aesthetic_score: float = NEGATIVE_AESTHETIC_SCORE,
                 prompt_syntax: str | None = None, scheduler: str | None = None,
                 ip_adapter_image: Any = None, ip_adapter_scale: float | None = None,
                 callback_on_step_end=None, progress: bool | None = None,
                 cfg_cutoff: float | None = None, deepcache_interval: int = 1,
                 hires_scale: float | None = None, hires_strength: float = HiresFix.strength,
                 hires_steps: int | None = None) -> PipelineOutput:
        """Generate images; arguments mean what diffusers' ``StableDiffusionXLPipeline`` gives
        them. ``seed``: one int (image k gets ``seed + k``), one int per image, or None (random
        seeds, reported in the output). ``latents``: initial noise in diffusers' layout
        (N, C, H/f, W/f), scaled by the scheduler's initial sigma as diffusers does.

        ``denoising_end`` in (0, 1): stop at that fraction of the schedule (the timesteps at or
        above ``round(T - denoising_end * T)`` run). With a :attr:`refiner` the refiner then
        finishes each image from there in the same compiled program (``denoising_end``
        defaults to :attr:`high_noise_frac`; ``aesthetic_score`` / ``negative_aesthetic_score``
        are the refiner's); without one, ``output_type="latent"`` returns the latents
        (N, C, H/f, W/f) for a refiner's ``image=`` (``denoising_start``), as in diffusers.

        ``prompt_syntax``: how the prompts' weights are written, ``"a1111"`` (default:
        ``(word:1.3)``, ``(word)``, ``[word]``, ``BREAK``), ``"compel"`` (``word+``,
        ``(words)1.3``) or ``"none"`` (the text as written). Prompts longer than 75 tokens are
        encoded in chunks of 75, as A1111 and compel do (:mod:`maxdiff.prompts`), up to
        :data:`pipelines.limits.MAX_PROMPT_CHUNKS` chunks. ``scheduler``: a sampler name for
        this call (``"dpmpp_2m_karras"``, ``"Euler a"``, ...), the pipeline's scheduler switched
        to it (:meth:`scheduler_for`); None: :attr:`scheduler`.

        ``ip_adapter_image``: an image prompt (PIL image or (H, W, 3) array; or a list of one
        per prompt) for the loaded IP-Adapter (:meth:`load_ip_adapter`), at
        ``ip_adapter_scale`` (None: :attr:`ip_adapter_scale`, set by
        :meth:`set_ip_adapter_scale`).

        ``progress``: a progress bar over the steps and a line when a call compiles (None: when
        stderr is a terminal). ``callback_on_step_end(pipe, step, timestep, {"latents": ...})``
        is called on the host after each step with the latents (N, C, H/f, W/f), as diffusers
        calls it; its return value is ignored (the latents cannot be changed: they stay on the
        devices). Either one runs the program with a host callback after each step (compiled
        once more); without them the program has none.

        Feature caching (faster, approximate): ``cfg_cutoff`` in (0, 1] runs classifier-free
        guidance on the first ``floor(cfg_cutoff * steps)`` steps only; ``deepcache_interval``
        N > 1 runs the UNet in full every N steps and its outer blocks alone in between, on the
        deep features the last full step cached (:class:`pipelines.requests.ImageRequest`).

        Hires fix (A1111's): ``hires_scale`` in (1, 4] draws each image at ``height`` /
        ``hires_scale`` x ``width`` / ``hires_scale`` first (``num_inference_steps``), upscales
        its latents to ``height`` x ``width`` and denoises them again at ``hires_strength``
        (image-to-image's rule, ``int(hires_steps * hires_strength)`` of ``hires_steps`` run;
        None: ``num_inference_steps``), in one program (:class:`pipelines.requests.HiresFix`,
        :mod:`pipelines.tasks.hires`)."""
        items, _ = prompt_items(
            prompt, prompt_2, negative_prompt, negative_prompt_2, num_images_per_prompt, seed,
            guidance_scale=guidance_scale, guidance_rescale=guidance_rescale,
            prompt_syntax=prompt_syntax, scheduler=scheduler, cfg_cutoff=cfg_cutoff,
            deepcache_interval=deepcache_interval, ip_adapter_image=ip_adapter_image,
            ip_adapter_scale=ip_adapter_scale,
            original_size=original_size, crops_coords_top_left=tuple(crops_coords_top_left),
            target_size=target_size, negative_original_size=negative_original_size,
            negative_crops_coords_top_left=negative_crops_coords_top_left,
            negative_target_size=negative_target_size, aesthetic_score=aesthetic_score,
            negative_aesthetic_score=negative_aesthetic_score)
        on_step = None
        if callback_on_step_end is not None:
            def on_step(i, t, x):
                callback_on_step_end(self, i, t, {"latents": x})
        hires = None if hires_scale is None else HiresFix(hires_scale, hires_strength, hires_steps)
        return self.generate(items, height=height, width=width, num_inference_steps=num_inference_steps,
                             latents=latents, output_type=output_type,
                             denoising_end=denoising_end, on_step=on_step, progress=progress,
                             hires=hires)

    def generate(self, items: Sequence[ImageRequest], *, height: int | None = None,
                 width: int | None = None, num_inference_steps: int | None = None,
                 latents: np.ndarray | None = None, output_type: str = "pil",
                 denoising_end: float | None = None, on_step=None,
                 progress: bool | None = None, denoised: bool = False,
                 hires: HiresFix | None = None) -> PipelineOutput:
        """Generate one image per :class:`ImageRequest` in one device batch (padded to a bucket).

        Every item has its own prompt, negative prompt, seed and guidance; they share the size
        and step count. Classifier-free guidance runs when any item's guidance is > 1 (items at
        <= 1 then get exactly the text-conditioned prediction). The serving batcher and the CLI
        fill batches across prompts with this. With a :attr:`refiner`, ``denoising_end`` or
        ``output_type="latent"`` the two-stage program runs (:mod:`pipelines.tasks.refine`).
        ``on_step(step, timestep, latents (N, C, H/f, W/f))`` and ``progress``: see
        :meth:`__call__` (text-to-image; the two-stage program reports no steps); with
        ``denoised`` ``on_step`` gets each step's estimate of the clean latents instead (what
        previews draw: :meth:`preview`). ``hires``: a hires fix (:meth:`__call__`'s
        ``hires_scale``).
        """
        t0 = time.perf_counter()
        if hires is not None:  # the tasks that are more than one pass
            from pipelines.tasks import hires as hires_task

            if latents is not None or denoising_end is not None:
                raise ValueError("hires_scale: a hires fix draws its own noise and runs the whole "
                                 "schedule: leave out latents and denoising_end")
            return hires_task.generate(self, items, hires, height=height, width=width,
                                       num_inference_steps=num_inference_steps,
                                       output_type=output_type, on_step=on_step,
                                       progress=progress, denoised=denoised)
        if self.refiner is not None or denoising_end is not None or output_type not in ("pil", "np"):
            from pipelines.tasks import refine

            return refine.generate(
                self, items, height=height, width=width, num_inference_steps=num_inference_steps,
                latents=latents, output_type=output_type, denoising_end=denoising_end)
        items, steps, height, width = checked_items(self, items, num_inference_steps, height,
                                                    width, output_type, samplers=True)
        latents = self.initial_latents(latents, len(items), height, width)
        return run(Job(TEXT, self, items, height, width, steps, output_type, t0,
                       rows={"latents": latents}, on_step=on_step, denoised=denoised,
                       progress=sys.stderr.isatty() if progress is None else bool(progress)))

    def initial_latents(self, latents, n: int, height: int, width: int) -> np.ndarray | None:
        """Given initial noise in diffusers' layout (N, C, H/f, W/f) -> NHWC float32, checked
        (None stays None: the program draws it from the seeds)."""
        if latents is None:
            return None
        f = self.vae_scale_factor
        latents = np.asarray(latents, np.float32)
        want = (n, self.latent_channels, height // f, width // f)
        if latents.shape != want:
            raise ValueError(f"latents has shape {latents.shape}; for {n} image(s) of "
                             f"{width}x{height} it must be {want} (N, C, H/{f}, W/{f})")
        return latents.transpose(0, 2, 3, 1)

    def host_inputs(self, items: Sequence[ImageRequest], height: int, width: int, *,
                    every_row: bool = False) -> HostInputs:
        """The per-image program inputs made on the host (:class:`pipelines.program.HostInputs`):
        seeds (random where an item has none), token ids of the prompts and negatives, which
        negatives are zeros, the family's time ids, guidance (1 where CFG is off for that image),
        guidance rescale and image prompts (``every_row``: see
        :meth:`~pipelines.ip_adapting.ImagePrompts.image_prompt_inputs`)."""
        seeds = [it.seed if it.seed is not None else secrets.randbelow(MAX_SEED + 1)
                 for it in items]
        text, neg_text = prompting.texts(self, items)
        pairs = [self.family.time_ids(it, height, width) for it in items]
        n_ids = self.family.n_time_ids
        ip_pixels, ip_scale = self.image_prompt_inputs(items, every_row)
        return HostInputs(
            seeds=np.asarray(seeds, np.uint32), text=text, neg_text=neg_text,
            zero_negative=np.array([it.negative_prompt is None
                                    and self.force_zeros_for_empty_prompt for it in items]),
            time_ids=np.array([pos for pos, _ in pairs], np.float32).reshape(len(items), n_ids),
            neg_time_ids=np.array([neg for _, neg in pairs], np.float32).reshape(len(items), n_ids),
            guidance=np.array([it.guidance_scale if cfg_on(it.guidance_scale) else 1.0
                               for it in items], np.float32),
            rescale=np.array([it.guidance_rescale for it in items], np.float32),
            ip_pixels=ip_pixels, ip_scale=ip_scale,
            cfg=any(cfg_on(it.guidance_scale) for it in items))

    @property
    def limits(self) -> Limits:
        """What a request may ask of this pipeline: sides multiples of the VAE's scale factor,
        at most the scheduler's step limit (the rules: :mod:`pipelines.limits`)."""
        return Limits(multiple=self.vae_scale_factor, max_steps=self.max_steps,
                      steps_why=f"what {type(self.scheduler).__name__} allows")

    def check_request(self, steps: int, height: int, width: int, output_type: str = "pil",
                      scheduler: str | None = None, more: Sequence = ()) -> None:
        """ValueError naming every field of a request this pipeline cannot run: the step count,
        the size (:attr:`limits`) and the output type, by the rules of :mod:`pipelines.limits`
        (the step engine and the service's replicas check their requests here too); with
        ``scheduler`` (a sampler name) the steps that sampler allows; ``more``: the caller's
        problems (:class:`pipelines.limits.Problem` or None), named with them."""
        limits = self.limits
        if scheduler is not None:
            limits = dataclasses.replace(limits, steps_why=f"what {scheduler!r} allows",
                                         max_steps=max_inference_steps(
                                             self.scheduler_for(scheduler)))
        check([*problems(limits, steps=steps, width=width, height=height),
               output_type_problem(output_type), *more])
