"""The SDXL text-to-image pipeline: one compiled, data-parallel program per shape.

``TextToImagePipeline.from_pretrained(folder)`` reads a diffusers SDXL folder; calling the
pipeline tokenizes on the host, then runs ONE jitted program over the device mesh:

    text encoders -> initial noise from per-image seeds -> lax.scan over scheduler steps
    (UNet, classifier-free guidance) -> VAE decode -> pixels

Token ids, seeds, guidance and the scheduler's timesteps/sigmas are traced inputs, so a new
prompt, seed or guidance never recompiles. Programs are cached per (padded batch, height,
width, steps, CFG on/off, latents given, output kind); JAX's persistent compilation cache
makes a restarted process start warm.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxdiff import adapters as adapterlib, checkpoint, mesh as meshlib, single_file, target
from maxdiff import quantization as quantlib
from maxdiff.models.clip import load_text_encoder
from maxdiff.models.unet import load_unet, unet_module
from maxdiff.models.vae import load_vae
from maxdiff.schedulers import (get_preset, load_scheduler, max_inference_steps,
                                read_scheduler_config)
from maxdiff.tokenizers import load_tokenizer, tokenize
from maxdiff.models.vae_tiling import (check_tiling_setting, tile_decoder, tile_encoder,
                                       tiled_decode, tiled_encode, use_tiling)
from pipelines import program as program_lib
from pipelines.config import ModelDefaults, RunConfig, load_run_config
from pipelines.limits import (AESTHETIC_SCORE, HIGH_NOISE_FRAC, MAX_SEED,
                              NEGATIVE_AESTHETIC_SCORE, Limits, cfg_on, check,
                              denoising_fraction_problem, n_problem, output_type_problem,
                              problems, seed_problem)
from pipelines.requests import ImageRequest, bucket_size, image_seeds

DEFAULT_COMPILE_CACHE = Path(os.environ.get("MAXDIFF_COMPILE_CACHE",
                                            Path.home() / ".cache" / "maxdiff" / "jax"))


@dataclass
class PipelineOutput:
    """``images``: PIL images, or float32 NumPy (N, H, W, 3) in [0, 1] for ``output_type="np"``;
    ``seeds``: the seed of each image (pass it back as ``seed=`` to reproduce that image)."""

    images: Any
    seeds: list[int]
    timings: dict[str, float] = field(default_factory=dict)


def enable_compile_cache(path: str | os.PathLike | None = DEFAULT_COMPILE_CACHE) -> None:
    """Turn on JAX's persistent compilation cache in ``path`` (None or "" turns nothing on).
    Programs that compile in under a second are not written, unless JAX's own variable
    ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` says otherwise (the test suite sets 0: its
    tiny models' programs often compile in a fraction of a second)."""
    if not path:
        return
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def _as_list(x, name: str) -> list[str] | None:
    if x is None:
        return None
    if isinstance(x, str):
        return [x]
    if isinstance(x, (list, tuple)) and all(isinstance(p, str) for p in x):
        return list(x)
    raise ValueError(f"{name} must be a string or a list of strings, got {type(x).__name__}")


def _to_pixels(img, as_uint8: bool):
    """Decoder output in ~[-1, 1] -> float32 [0, 1], or uint8."""
    img = jnp.clip(img.astype(jnp.float32) / 2 + 0.5, 0.0, 1.0)
    return jnp.round(img * 255).astype(jnp.uint8) if as_uint8 else img


_abs_sum = jax.jit(lambda x: jnp.sum(jnp.abs(x.astype(jnp.float32))))


def encode_prompts(te1, te2, p, ids1, ids2, ad=None, aidx=None):
    """SDXL's two CLIP encoders: (penultimate states of both, concatenated; encoder 2's pooled
    projection). SD 1.x / 2.x (``te2`` None): (the one encoder's last state after its final
    layer norm, as diffusers' StableDiffusionPipeline; an empty (B, 0) pooled). The SDXL
    refiner (``te1`` None): encoder 2's penultimate states and pooled projection (``ids1`` is
    unused). ``ad``/``aidx``: per-image adapter tables and indices (or None)."""
    ad = ad or {}
    if te1 is None:
        with adapterlib.applied(ad.get("text_encoder_2"), aidx):
            o2 = te2.apply({"params": p["text_encoder_2"]}, ids2)
        return o2.hidden_states[-2], o2.text_embeds
    with adapterlib.applied(ad.get("text_encoder"), aidx):
        o1 = te1.apply({"params": p["text_encoder"]}, ids1)
    if te2 is None:
        return o1.last_hidden_state, jnp.zeros((ids1.shape[0], 0), o1.last_hidden_state.dtype)
    with adapterlib.applied(ad.get("text_encoder_2"), aidx):
        o2 = te2.apply({"params": p["text_encoder_2"]}, ids2)
    emb = jnp.concatenate([o1.hidden_states[-2], o2.hidden_states[-2]], axis=-1)
    return emb, o2.text_embeds


def conditioning(te1, te2, p, ids, neg_ids, zero_negative, time_ids, neg_time_ids, cfg: bool,
                 ad=None, aidx=None):
    """(text states, pooled, time ids, per-row adapter index) for the UNet. With ``cfg`` the
    rows are [negative, positive] (a negative without a prompt is zeros where the model says
    ``force_zeros_for_empty_prompt``: ``zero_negative``), as diffusers concatenates them, on
    each device (:func:`pipelines.program.cfg_rows`)."""
    emb, pooled = encode_prompts(te1, te2, p, ids[0], ids[1], ad, aidx)
    if not cfg:
        return emb, pooled, time_ids, aidx
    nemb, npooled = encode_prompts(te1, te2, p, neg_ids[0], neg_ids[1], ad, aidx)
    nemb = jnp.where(zero_negative[:, None, None], 0.0, nemb)
    npooled = jnp.where(zero_negative[:, None], 0.0, npooled)
    uidx = program_lib.cfg_rows(aidx, aidx)  # uncond: the image's too
    return (program_lib.cfg_rows(nemb, emb), program_lib.cfg_rows(npooled, pooled),
            program_lib.cfg_rows(neg_time_ids, time_ids), uidx)


# diffusers pipeline class -> (model components, tokenizer folders): SDXL or SD 1.x / 2.x
_KINDS = {f.pipeline: (single_file.family_models(f), tuple(name for name, _ in f.tokenizers))
          for f in single_file.FAMILIES.values() if f.supported}
# an SDXL image-to-image folder: the base's components, less those model_index.json marks
# [null, null] (the refiner has neither text_encoder nor tokenizer)
_IMG2IMG = "StableDiffusionXLImg2ImgPipeline"
_KINDS[_IMG2IMG] = _KINDS["StableDiffusionXLPipeline"]


def _kind(model_index: dict, where: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    name = model_index.get("_class_name")
    if name not in _KINDS:
        raise checkpoint.CheckpointError(
            f"{where}: model_index.json names a {name}; maxdiff loads "
            f"{' and '.join(_KINDS)} folders")
    comps, tokenizers = _KINDS[name]
    if name == _IMG2IMG:  # the refiner: text_encoder_2 and tokenizer_2 only

        def present(c):
            return c in ("unet", "vae") or model_index.get(c, [None])[0] is not None
        comps, tokenizers = (tuple(filter(present, comps)), tuple(filter(present, tokenizers)))
        if "text_encoder_2" not in comps or "tokenizer_2" not in tokenizers:
            raise checkpoint.CheckpointError(
                f"{where}: an SDXL image-to-image folder without text_encoder_2 / tokenizer_2; "
                "maxdiff loads SDXL base and refiner folders")
    return comps, tokenizers


def model_root(path: Path, config: str | os.PathLike | None
                ) -> tuple[Path, single_file.Layout | None]:
    """The folder whose configs describe the model, and the single file's layout (None for a
    diffusers folder). Errors name what is missing."""
    if path.is_file():
        layout = single_file.inspect(path)
        if not layout.family.supported:
            raise checkpoint.CheckpointError(
                f"{path}: a {layout.family.title} single file; maxdiff's pipelines load SDXL "
                "base and SD 1.x / 2.x single files and diffusers folders")
        if layout.in_channels != 4:
            raise checkpoint.CheckpointError(
                f"{path}: an inpainting UNet ({layout.in_channels} input channels); maxdiff "
                "inpaints with the base model (InpaintPipeline)")
        root = Path(config) if config is not None else single_file.shipped_config(
            layout.family.name)
        described = json.loads((root / "model_index.json").read_text()).get("_class_name")
        if described != layout.family.pipeline:
            raise checkpoint.CheckpointError(
                f"{path}: a {layout.family.title} file, but {root} describes a {described}; "
                f"pass config= a {layout.family.pipeline} folder (or none)")
        for comp in single_file.family_models(layout.family):
            if not (root / comp / "config.json").is_file():
                raise checkpoint.CheckpointError(
                    f"{root}: config= needs {comp}/config.json (a diffusers "
                    f"{layout.family.pipeline} folder describing the single file)")
        return root, layout
    if config is not None:
        raise ValueError(f"config= describes a single-file checkpoint; {path} is a folder with "
                         "its own configs")
    index = path / "model_index.json"
    if not index.is_file():
        raise checkpoint.CheckpointError(
            f"{path}: not a diffusers pipeline folder (no model_index.json) nor a single-file "
            "checkpoint")
    checkpoint.check_links(path)
    comps, tokenizers = _kind(json.loads(index.read_text()), index)
    for comp in (*comps, *tokenizers):
        if not (path / comp).is_dir():
            raise checkpoint.CheckpointError(
                f"{path}: missing component folder {comp}/ (this pipeline needs "
                f"{', '.join((*comps, *tokenizers))}, scheduler)")
    return path, None


def _tokenizer_folder(root: Path, name: str, layout: single_file.Layout | None) -> Path:
    """``root/name``; configs without tokenizers (the shipped single-file configs) use the
    embedded model's tokenizer with the same settings: CLIP's own 49,408-token vocabulary,
    padded as the family pads (SDXL's ``tokenizer_2`` and SD 2.x's with ``!``)."""
    if (root / name).is_dir() or layout is None:
        return root / name
    from pipelines.default_model import EMBEDDED

    return EMBEDDED / dict(layout.family.tokenizers).get(name, name)


class TextToImagePipeline:
    """SDXL text-to-image in JAX. Build with :meth:`from_pretrained`; call like diffusers'
    ``StableDiffusionXLPipeline``."""

    def __init__(self, *, tokenizer, tokenizer_2, text_encoder, text_encoder_2, unet, vae,
                 scheduler, params: dict, mesh, force_zeros_for_empty_prompt: bool = True,
                 default_steps: int = 50, default_guidance: float = 5.0, name: str = "",
                 quantization: str = "none", requires_aesthetics_score: bool = False):
        self.tokenizer, self.tokenizer_2 = tokenizer, tokenizer_2
        self.text_encoder, self.text_encoder_2 = text_encoder, text_encoder_2
        self.unet, self.vae, self.scheduler = unet, vae, scheduler
        self.params = params
        self.mesh = mesh
        self.force_zeros_for_empty_prompt = force_zeros_for_empty_prompt
        # the SDXL refiner's time ids: (original size, crop corner, aesthetic score), five
        self.requires_aesthetics_score = requires_aesthetics_score
        # an SDXL refiner (an ImageToImagePipeline) that finishes every image from
        # ``high_noise_frac`` of the schedule, base and refiner in one program; None: no refiner
        self.refiner = None
        self.high_noise_frac = HIGH_NOISE_FRAC
        self.default_steps = default_steps
        self.default_guidance = default_guidance
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
        self._programs: dict[tuple, Any] = {}
        self._base_params: dict | None = None  # the weights before any LoRA was fused
        self._loras: list[tuple[str, str, float, list]] = []  # (name, file, scale, layers)
        # per-image adapters (add_adapter), unfused: (name, file, scale, layers), index order
        self._adapters: list[tuple[str, str, float, list]] = []
        self._adapter_tables = None  # maxdiff.adapters.AdapterTables, None without adapters

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike | None = None, dtype: str = "auto",
                        unet: str | os.PathLike | None = None, scheduler: Any = None,
                        devices: int | Sequence[Any] | None = None, *,
                        attention_kernel: str = "auto", attention_chunk: int = 512,
                        compile_cache_dir: str | os.PathLike | None = DEFAULT_COMPILE_CACHE,
                        variant: str | None = None, vae_tiling: bool | str = "auto",
                        vae: str | os.PathLike | None = None,
                        config: str | os.PathLike | None = None,
                        quantization: str = "none", refiner: Any = None,
                        high_noise_frac: float = HIGH_NOISE_FRAC) -> "TextToImagePipeline":
        """Load a diffusers SDXL folder (``model_index.json``, ``unet/``, ``vae/``,
        ``text_encoder/``, ``text_encoder_2/``, ``tokenizer*/``, ``scheduler/``), or a
        single-file SDXL checkpoint (see :meth:`from_single_file`; ``config`` applies to it).

        ``unet``: a UNet file that replaces the model's: diffusers keys (the SDXL-Lightning
        files) or a whole single-file checkpoint. ``vae``: a VAE that replaces the model's: a
        diffusers VAE folder, or a file (``sdxl_vae.safetensors``, original or diffusers keys).
        ``scheduler``: a diffusers scheduler config dict, a folder or json file, or a preset
        name such as ``"lightning-4step"`` (which also sets the default steps and guidance).
        ``dtype``: ``"auto"`` (bfloat16 on TPUs and GPUs, float32 on CPUs: the mesh's devices
        decide, :func:`maxdiff.target.default_dtype`), ``"float32"``, ``"bfloat16"`` or
        ``"float16"``.
        ``devices``: None for all local devices, N for the first N. ``vae_tiling``:
        ``"auto"`` (encode and decode images of more than ``vae_tiling_threshold`` pixels tile
        by tile; default 2 x the VAE's ``sample_size²``, at least 2,097,152), True (tile
        whenever diffusers' ``enable_tiling`` would) or False (never); see
        :func:`maxdiff.models.vae_tiling.use_tiling`. ``quantization``: ``"none"``,
        ``"int8-weights"``, ``"int8"`` or ``"fp8"``: the UNet's transformer linear layers run
        with int8 (or float8) weights, and with ``int8`` / ``fp8`` activations too, through
        qwix (:mod:`maxdiff.quantization`; LoRA adapters are then refused).

        ``refiner``: an SDXL refiner that finishes every image (:attr:`refiner`): a diffusers
        refiner folder (``StableDiffusionXLImg2ImgPipeline``, loaded with this call's dtype,
        devices and compile cache) or a loaded pipeline; calls then run the base to
        ``denoising_end`` (default ``high_noise_frac``, 0.8) and the refiner from there, in one
        compiled program (:mod:`pipelines.refiner`). A refiner folder itself loads here too
        (text_encoder_2 only, aesthetic-score time ids): use it with
        :class:`pipelines.ImageToImagePipeline`.
        """
        vae_tiling = check_tiling_setting(vae_tiling)
        quantlib.check_quantization(quantization)
        if path is None:
            from pipelines.default_model import default_model_path

            path = default_model_path()
        root, layout = model_root(Path(path), config)
        model_index = json.loads((root / "model_index.json").read_text())
        comps, tokenizers = _kind(model_index, root / "model_index.json")
        xl = "text_encoder_2" in comps
        enable_compile_cache(compile_cache_dir)
        mesh = meshlib.make_mesh(devices)
        put = meshlib.put_replicated(mesh)
        if dtype == "auto":
            dtype = target.default_dtype(target.mesh_platform(mesh))

        hint = "" if config is not None else (
            f"maxdiff's shipped {layout.family.title} configs do not describe this file; pass "
            "config= (CLI --single-file-config) a diffusers folder that does") if layout else ""

        def part(name: str) -> tuple[dict, Any]:
            """A component's config and, for a single file, where its weights are."""
            cfg = checkpoint.read_config(root / name)
            return cfg, (single_file.component_source(layout, name, cfg, hint=hint)
                         if layout else None)

        unet_cfg, unet_src = part("unet")
        stored = unet_cfg.get(quantlib.CONFIG_KEY) if unet is None else None
        if stored is not None:  # maxdiff convert --quantize: the quantized weights themselves
            if quantization != stored:
                raise checkpoint.CheckpointError(
                    f"{root / 'unet'}: holds UNet weights quantized to {stored!r} (maxdiff "
                    f"convert --quantize); load it with quantization={stored!r}, not "
                    f"{quantization!r}")
            unet_model, unet_params = quantlib.load_quantized(
                unet_module(unet_cfg, dtype, attention_kernel, attention_chunk),
                root / "unet" / quantlib.WEIGHTS_FILE, stored, put=put)
        else:
            unet_model, unet_params = load_unet(
                unet if unet is not None else root / "unet", dtype, config=unet_cfg,
                attention_kernel=attention_kernel, attention_chunk=attention_chunk, put=put,
                variant=None if unet is not None else variant,
                source=None if unet is not None else unet_src)
        if quantization != "none" and stored is None:  # the float weights go once quantized
            unet_model, unet_params = quantlib.quantize(unet_model, unet_params, quantization)
            unet_params = put(unet_params)
        if vae is None:
            vae_cfg, vae_src = part("vae")
            vae_model, vae_params = load_vae(root / "vae", dtype, variant=variant, put=put,
                                             config=vae_cfg, source=vae_src)
        else:  # a folder brings its config; a file is read with the model's
            vae_cfg = None if Path(vae).is_dir() else checkpoint.read_config(root / "vae")
            vae_model, vae_params = load_vae(vae, dtype, put=put, config=vae_cfg)
        encoders = {}
        for name in comps[2:]:
            cfg, src = part(name)
            encoders[name] = load_text_encoder(root / name, dtype, variant=variant, config=cfg,
                                               source=src)
        te1, te1_params = encoders.get("text_encoder", (None, None))
        te2, te2_params = encoders.get("text_encoder_2", (None, None))
        te1_params, te2_params = meshlib.place((te1_params, te2_params), meshlib.replicated(mesh))

        measured = ModelDefaults.read(root)
        steps = measured.steps or 50
        # diffusers' defaults: SDXL 5.0, StableDiffusionPipeline 7.5
        guidance = (5.0 if xl else 7.5) if measured.guidance is None else measured.guidance
        if scheduler is None:
            sched = load_scheduler(layout.scheduler_config(read_scheduler_config(root)) if layout
                                   else root / "scheduler")
        elif isinstance(scheduler, str) and not Path(scheduler).exists():
            preset = get_preset(scheduler)
            sched = load_scheduler(scheduler)
            steps, guidance = preset.num_inference_steps, preset.guidance_scale
        else:
            sched = load_scheduler(scheduler)

        # the refiner's five time ids (size, crop, aesthetic score) or the base's six
        aesthetic = bool(model_index.get("requires_aesthetics_score", False))
        n_ids = 5 if aesthetic else 6
        expected = (unet_model.config.addition_time_embed_dim or 0) * n_ids + (
            te2.config.projection_dim if xl else 0)
        if xl and unet_model.config.projection_class_embeddings_input_dim != expected:
            raise checkpoint.CheckpointError(
                f"{root}: unet projection_class_embeddings_input_dim="
                f"{unet_model.config.projection_class_embeddings_input_dim} but text_encoder_2 "
                f"projection_dim={te2.config.projection_dim} and addition_time_embed_dim="
                f"{unet_model.config.addition_time_embed_dim} need {expected} ({n_ids} time ids: "
                f"model_index.json requires_aesthetics_score={aesthetic})")
        toks = {name: load_tokenizer(_tokenizer_folder(root, name, layout))
                for name in tokenizers}
        params = {"unet": unet_params, "vae": vae_params}
        if te1 is not None:
            params["text_encoder"] = te1_params
        if xl:
            params["text_encoder_2"] = te2_params
        pipe = cls(
            tokenizer=toks.get("tokenizer"), tokenizer_2=toks.get("tokenizer_2") if xl else None,
            text_encoder=te1, text_encoder_2=te2, unet=unet_model, vae=vae_model,
            scheduler=sched, params=params, mesh=mesh,
            # SDXL zeroes an omitted negative prompt; SD 1.x / 2.x encode "" (no such key)
            force_zeros_for_empty_prompt=bool(model_index.get("force_zeros_for_empty_prompt", xl)),
            default_steps=steps, default_guidance=guidance, name=str(path),
            quantization=quantization, requires_aesthetics_score=aesthetic,
        )
        sample_size = unet_cfg.get("sample_size")
        if isinstance(sample_size, int):
            pipe.default_height = pipe.default_width = sample_size * pipe.vae_scale_factor
        pipe.default_height = measured.height or pipe.default_height
        pipe.default_width = measured.width or pipe.default_width
        pipe.max_size = measured.max_size
        pipe.vae_tiling = vae_tiling
        if refiner is not None:
            if isinstance(refiner, (str, os.PathLike)):
                refiner = cls.from_pretrained(
                    refiner, dtype, devices=devices, attention_kernel=attention_kernel,
                    attention_chunk=attention_chunk, compile_cache_dir=compile_cache_dir,
                    variant=variant, vae_tiling=vae_tiling)
            pipe.set_refiner(refiner, high_noise_frac)
        return pipe

    def set_refiner(self, refiner: Any, high_noise_frac: float = HIGH_NOISE_FRAC) -> None:
        """Finish every image with ``refiner`` (a loaded SDXL refiner or base: a
        :class:`TextToImagePipeline` or an image-to-image pipeline over one; None removes it)
        from ``high_noise_frac`` of the schedule unless a call gives ``denoising_end``."""
        check([denoising_fraction_problem(high_noise_frac, "high_noise_frac")])
        if refiner is not None:
            from pipelines.edit import ImageToImagePipeline

            refiner = ImageToImagePipeline.from_pipe(refiner)
            if refiner.text_encoder_2 is None or refiner.latent_channels != self.latent_channels:
                raise ValueError(f"refiner {refiner.name}: an SDXL refiner (or base) with "
                                 f"{self.latent_channels} latent channels, like this model's")
        self.refiner, self.high_noise_frac = refiner, float(high_noise_frac)

    @classmethod
    def from_single_file(cls, path: str | os.PathLike, config: str | os.PathLike | None = None,
                         **kwargs) -> "TextToImagePipeline":
        """Load a single-file SDXL checkpoint in the original Stability layout (the
        ``.safetensors`` files A1111 / ComfyUI users download: ``model.diffusion_model.*``,
        ``first_stage_model.*``, ``conditioner.embedders.*``), as diffusers'
        ``from_single_file`` does. The architecture is recognised from the keys; its configs
        are the SDXL base configs maxdiff ships (``maxdiff/assets/configs/sdxl-base``) unless
        ``config`` names a diffusers folder whose ``config.json`` files (and tokenizers, when
        it has them) describe the file. A file without a VAE needs ``vae=``. Other keyword
        arguments as :meth:`from_pretrained`. Weights stream tensor by tensor."""
        if not Path(path).is_file():
            raise checkpoint.CheckpointError(f"{path}: no such file (from_single_file reads one "
                                             ".safetensors file; use from_pretrained for a folder)")
        return cls.from_pretrained(path, config=config, **kwargs)

    @classmethod
    def from_config(cls, config: Any = None, overrides: Sequence[str] | dict | None = None
                    ) -> "TextToImagePipeline":
        """Load from a run config (a :class:`pipelines.config.RunConfig`, a YAML path or a name
        in ``configs/``) with optional ``key=value`` overrides. The config's steps, guidance and
        size become this pipeline's defaults; its ``loras`` are fused in order."""
        cfg = config if isinstance(config, RunConfig) else load_run_config(config, overrides)
        pipe = cls.from_pretrained(**cfg.pipeline_kwargs())
        if cfg.steps is not None:
            pipe.default_steps = cfg.steps
        if cfg.guidance is not None:
            pipe.default_guidance = cfg.guidance
        pipe.default_height = cfg.height or pipe.default_height
        pipe.default_width = cfg.width or pipe.default_width
        for spec in cfg.loras:
            pipe.load_lora_weights(spec.path, adapter_name=spec.name, scale=spec.scale)
        pipe.run_config = cfg
        return pipe

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora_weights(self, path: str | os.PathLike, adapter_name: str | None = None,
                          scale: float = 1.0) -> str:
        """Fuse a LoRA adapter (a ``.safetensors`` file, or a folder holding
        ``pytorch_lora_weights.safetensors``) into the UNet and text encoder weights: each
        adapted weight becomes ``w + scale * alpha / r * up @ down``, computed in float32 and
        cast back to the pipeline's dtype, as diffusers' ``load_lora_weights`` +
        ``fuse_lora(lora_scale=scale)`` gives it. diffusers/PEFT and kohya files are read
        (:mod:`maxdiff.lora`). Several calls stack. The compiled programs are kept (the weights
        are an input of the program, and their shapes and dtypes do not change). The original
        arrays are kept while an adapter is loaded, so the adapted weights take twice their
        memory. Returns the adapter's name (``adapter_name``, or ``default_N``)."""
        from maxdiff import lora

        if (problem := quantlib.lora_problem(self.quantization)) is not None:
            raise ValueError(problem)
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) \
                or not np.isfinite(scale):
            raise ValueError(f"scale={scale!r}; it must be a finite number")
        names = [n for n, *_ in self._loras]
        if adapter_name is None:
            k = len(names)
            while f"default_{k}" in names:
                k += 1
            adapter_name = f"default_{k}"
        elif adapter_name in names:
            raise ValueError(f"adapter_name={adapter_name!r} is already loaded; unload it first "
                             "or choose another name")
        base = self._base_params if self._base_params is not None else self.params
        layers = lora.read_lora(path, base, unet_config=self.unet.config)
        loras = self._loras + [(adapter_name, str(lora.lora_file(path)), float(scale), layers)]
        self.params = lora.fuse_loras(base, [(ls, s) for _, _, s, ls in loras])
        self._base_params, self._loras = base, loras
        return adapter_name

    def unload_lora_weights(self, adapter_name: str | None = None) -> None:
        """Remove every LoRA adapter (``adapter_name=None``: the original weights come back,
        the very arrays loaded), or only the named one (the others are fused again onto the
        original weights)."""
        from maxdiff import lora

        if adapter_name is not None and adapter_name not in [n for n, *_ in self._loras]:
            raise ValueError(f"no LoRA adapter named {adapter_name!r} is loaded (loaded: "
                             f"{[n for n, *_ in self._loras] or 'none'})")
        if self._base_params is None:
            return
        keep = [x for x in self._loras if adapter_name is not None and x[0] != adapter_name]
        if keep:
            self.params = lora.fuse_loras(self._base_params, [(ls, s) for _, _, s, ls in keep])
            self._loras = keep
        else:
            self.params, self._base_params, self._loras = self._base_params, None, []

    def add_adapter(self, name: str, path: str | os.PathLike, scale: float = 1.0) -> int:
        """Preload a LoRA adapter *unfused*, for images that ask for it by ``name``
        (``ImageRequest(adapter=name)``); the weights stay as they are. Only its low-rank factors
        are kept (memory about the file's size, never a copy of the model), stacked with the
        other adapters' into zero-padded per-layer tables (:mod:`maxdiff.adapters`). In the
        compiled program each adapted projection (UNet linear and conv layers, both text
        encoders' linear layers) adds each image's own ``scale * alpha / r * up @ down`` update
        (index 0 = no adapter); the index is a traced input, so images with different adapters
        and none share one device batch and one program. Adding an adapter changes the tables'
        shapes: programs compiled before are compiled again on their next use (add adapters
        before warming up). Returns the adapter's index (1, 2, ...)."""
        from maxdiff import lora

        if (problem := quantlib.lora_problem(self.quantization, "per-image adapters")) is not None:
            raise ValueError(problem)
        if not isinstance(name, str) or not name:
            raise ValueError(f"adapter name {name!r}; give a non-empty string")
        if name in [n for n, *_ in self._adapters]:
            raise ValueError(f"an adapter named {name!r} is already added (added: "
                             f"{', '.join(n for n, *_ in self._adapters)})")
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) \
                or not np.isfinite(scale):
            raise ValueError(f"scale={scale!r}; it must be a finite number")
        base = self._base_params if self._base_params is not None else self.params
        layers = lora.read_lora(path, base, unet_config=self.unet.config)
        entries = self._adapters + [(name, str(lora.lora_file(path)), float(scale), layers)]
        dtype = jax.tree_util.tree_leaves(base["unet"])[0].dtype
        tables = adapterlib.build_tables([(n, ls, s) for n, _, s, ls in entries], dtype=dtype,
                                         put=lambda a: jax.device_put(
                                             a, meshlib.replicated(self.mesh)))
        self._adapters, self._adapter_tables = entries, tables
        return len(entries)

    def remove_adapters(self) -> None:
        """Drop every adapter added with :meth:`add_adapter` (the no-adapter programs run
        again)."""
        self._adapters, self._adapter_tables = [], None

    @property
    def adapters(self) -> list[dict]:
        """The adapters added with :meth:`add_adapter`, in index order (1, 2, ...): name,
        file, scale, layers adapted and largest rank."""
        return [{"name": n, "path": p, "scale": s, "layers": len(ls),
                 "rank": max(x.rank for x in ls)} for n, p, s, ls in self._adapters]

    @property
    def adapter_tables(self):
        """The per-image adapters' stacked low-rank tables (:class:`maxdiff.adapters.AdapterTables`,
        a program input: ``adapter_tables.as_tree()``), or None when none is added."""
        return self._adapter_tables

    def adapter_index(self, items) -> np.ndarray | None:
        """Each item's adapter index (int32 (N,), 0: none; the program input that picks each
        image's rows of :attr:`adapter_tables`), or None when no adapter is added. ValueError
        naming the item and the added adapters when an item names one that is not added."""
        names = {n: k for k, (n, *_) in enumerate(self._adapters, start=1)}
        out = []
        for k, it in enumerate(items):
            a = getattr(it, "adapter", None)
            if a is not None and a not in names:
                where = f"item {k}: " if k else ""
                raise ValueError(f"{where}adapter={a!r} is not added; added adapters: "
                                 f"{', '.join(names) or 'none (see add_adapter)'}")
            out.append(0 if a is None else names[a])
        return None if self._adapter_tables is None else np.asarray(out, np.int32)

    @property
    def lora_adapters(self) -> list[dict]:
        """The fused LoRA adapters, in loading order: name, file, scale and layer count."""
        return [{"name": n, "path": p, "scale": s, "layers": len(ls)}
                for n, p, s, ls in self._loras]

    # ------------------------------------------------------------------ the program
    @property
    def max_steps(self) -> int:
        """The most denoising steps the loaded scheduler allows (its ``num_train_timesteps``;
        for LCM its ``original_inference_steps``)."""
        return max_inference_steps(self.scheduler)

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
        return sum(fn._cache_size() for fn in self._programs.values())

    def _program(self, key: tuple):
        fn = self._programs.get(key)
        if fn is None:
            fn = program_lib.jit(self.mesh, self._build(*key))
            self._programs[key] = fn
        return fn

    def cached_program(self, key: tuple, build) -> Any:
        """The jitted program kept under ``key``, made once from ``build()`` (a function of
        the program's inputs): programs that compose this pipeline with others (the SDXL
        refiner's, :mod:`pipelines.refiner`) live with its own, and :attr:`num_compiled`
        counts them. A key must name every static choice the program closes over."""
        fn = self._programs.get(key)
        if fn is None:
            fn = self._programs[key] = program_lib.jit(self.mesh, build())
        return fn

    def _build(self, batch: int, lh: int, lw: int, steps: int, cfg: bool, given_latents: bool,
               as_uint8: bool, tiled: bool = False):
        te1, te2, unet, vae, sched = (self.text_encoder, self.text_encoder_2, self.unet, self.vae,
                                      self.scheduler)
        channels = self.latent_channels

        def program(p, ids, neg_ids, zero_negative, seeds, latents, guidance, rescale, time_ids,
                    neg_time_ids, sched_state, ad=None, aidx=None):
            # ad / aidx: the adapter tables and each image's adapter index (add_adapter); None
            # without adapters, which traces exactly the program without them
            emb, pooled, time_ids, uidx = conditioning(te1, te2, p, ids, neg_ids, zero_negative,
                                                       time_ids, neg_time_ids, cfg, ad, aidx)
            init_keys, step_keys = program_lib.image_keys(seeds)
            if latents is None:
                latents = program_lib.normal(init_keys, (lh, lw, channels))
            latents = latents.astype(jnp.float32) * sched.init_noise_sigma(sched_state)
            g = guidance[:, None, None, None]
            r = rescale[:, None, None, None]

            def model(xin, t, i):
                with adapterlib.applied((ad or {}).get("unet"), uidx):
                    return unet.apply({"params": p["unet"]}, xin, t, emb, pooled, time_ids)

            # one iteration per model call: steps, or steps + 1 for PNDM (num_model_calls)
            calls = sched_state.timesteps.shape[0]
            latents = program_lib.denoise(sched, model, latents, sched_state, 0, calls, cfg=cfg,
                                          g=g, r=r, step_keys=step_keys,
                                          shape=(lh, lw, channels))
            if tiled:  # decoded tile by tile afterwards (decode_tiled)
                return vae.apply({"params": p["vae"]}, latents, method=vae.unscale_latents)
            img = program_lib.decode(vae, p["vae"], latents)
            return _to_pixels(img, as_uint8)

        return program

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
        return _to_pixels(img, as_uint8)

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
                 negative_aesthetic_score: float = NEGATIVE_AESTHETIC_SCORE) -> PipelineOutput:
        """Generate images; arguments mean what diffusers' ``StableDiffusionXLPipeline`` gives
        them. ``seed``: one int (image k gets ``seed + k``), one int per image, or None (random
        seeds, reported in the output). ``latents``: initial noise in diffusers' layout
        (N, C, H/f, W/f), scaled by the scheduler's initial sigma as diffusers does.

        ``denoising_end`` in (0, 1): stop at that fraction of the schedule (the timesteps at or
        above ``round(T - denoising_end * T)`` run). With a :attr:`refiner` the refiner then
        finishes each image from there in the same compiled program (``denoising_end``
        defaults to :attr:`high_noise_frac`; ``aesthetic_score`` / ``negative_aesthetic_score``
        are the refiner's); without one, ``output_type="latent"`` returns the latents
        (N, C, H/f, W/f) for a refiner's ``image=`` (``denoising_start``), as in diffusers."""
        neg_size = None
        if negative_original_size is not None and negative_target_size is not None:
            neg_size = (tuple(negative_original_size), tuple(negative_crops_coords_top_left),
                        tuple(negative_target_size))
        items, _ = self.prompt_items(
            prompt, prompt_2, negative_prompt, negative_prompt_2, num_images_per_prompt, seed,
            guidance_scale=guidance_scale, guidance_rescale=guidance_rescale,
            original_size=original_size, crops_coords_top_left=tuple(crops_coords_top_left),
            target_size=target_size, negative_size=neg_size, aesthetic_score=aesthetic_score,
            negative_aesthetic_score=negative_aesthetic_score)
        return self.generate(items, height=height, width=width, num_inference_steps=num_inference_steps,
                             latents=latents, output_type=output_type,
                             denoising_end=denoising_end)

    def prompt_items(self, prompt, prompt_2, negative_prompt, negative_prompt_2,
                      num_images_per_prompt: int, seed, *, per_prompt: dict | None = None,
                      guidance_scale: float | None, **fields) -> tuple[list[ImageRequest], dict]:
        """The diffusers-style ``__call__`` arguments -> one :class:`ImageRequest` per image.

        ``prompt_2`` and the negatives (and each list in ``per_prompt``, e.g. the edit
        pipelines' images) give one entry per prompt or a single one for all; image k gets
        prompt ``k // num_images_per_prompt``. ``fields`` go to every request as they are.
        Returns the requests and, per ``per_prompt`` name, each image's entry."""
        prompts = _as_list(prompt, "prompt")
        if not prompts:
            raise ValueError("prompt is empty: give a prompt string or a non-empty list of prompts")
        n_prompts = len(prompts)
        check([n_problem(num_images_per_prompt)])
        lists = {"prompt_2": _as_list(prompt_2, "prompt_2") or prompts,
                 "negative_prompt": _as_list(negative_prompt, "negative_prompt"),
                 "negative_prompt_2": _as_list(negative_prompt_2, "negative_prompt_2"),
                 **(per_prompt or {})}
        for name, lst in lists.items():
            if lst is not None and len(lst) == 1 and n_prompts > 1:
                lists[name] = lst * n_prompts
            if lists[name] is not None and len(lists[name]) != n_prompts:
                raise ValueError(f"{name} has {len(lst)} entries but prompt has {n_prompts}; "
                                 "give one per prompt (or a single one)")
        n = n_prompts * num_images_per_prompt
        seeds = self._seeds(seed, n)
        guidance = self.default_guidance if guidance_scale is None else guidance_scale
        per_image = [k // num_images_per_prompt for k in range(n)]

        def pick(name, i):
            return None if lists[name] is None else lists[name][i]

        items = [ImageRequest(prompt=prompts[i], prompt_2=pick("prompt_2", i),
                              negative_prompt=pick("negative_prompt", i),
                              negative_prompt_2=pick("negative_prompt_2", i), seed=seeds[k],
                              guidance_scale=guidance, **fields)
                 for k, i in enumerate(per_image)]
        return items, {name: [pick(name, i) for i in per_image] for name in (per_prompt or {})}

    def generate(self, items: Sequence["ImageRequest"], *, height: int | None = None,
                 width: int | None = None, num_inference_steps: int | None = None,
                 latents: np.ndarray | None = None, output_type: str = "pil",
                 denoising_end: float | None = None) -> PipelineOutput:
        """Generate one image per :class:`ImageRequest` in one device batch (padded to a bucket).

        Every item has its own prompt, negative prompt, seed and guidance; they share the size
        and step count. Classifier-free guidance runs when any item's guidance is > 1 (items at
        <= 1 then get exactly the text-conditioned prediction). The serving batcher and the CLI
        fill batches across prompts with this. With a :attr:`refiner`, ``denoising_end`` or
        ``output_type="latent"`` the two-stage program runs (:mod:`pipelines.refiner`).
        """
        if self.refiner is not None or denoising_end is not None or output_type not in ("pil", "np"):
            from pipelines import refiner as refiner_lib

            return refiner_lib.generate(
                self, items, height=height, width=width, num_inference_steps=num_inference_steps,
                latents=latents, output_type=output_type, denoising_end=denoising_end)
        t0 = time.perf_counter()
        items = list(items)
        if not items:
            raise ValueError("items is empty: give at least one ImageRequest")
        steps = self.default_steps if num_inference_steps is None else num_inference_steps
        height = self.default_height if height is None else height
        width = self.default_width if width is None else width
        self.check_request(steps, height, width, output_type)
        for k, it in enumerate(items):
            it.validate(k)
        f = self.vae_scale_factor
        n = len(items)
        lh, lw = height // f, width // f
        latents = self.initial_latents(latents, n, height, width)
        (seeds, cfg, ids, neg_ids, zero_negative, time_ids, neg_time_ids, guidance,
         rescale) = self.host_inputs(items, height, width)
        adapter_idx = self.adapter_index(items)

        bucket = bucket_size(n, self.mesh.size)
        put = program_lib.BatchPut(self.mesh, bucket)
        args = (put(ids, ids=True), put(neg_ids, ids=True), put(zero_negative),
                put(np.asarray(seeds, np.uint32)), put(latents), put(guidance), put(rescale),
                put(time_ids), put(neg_time_ids))
        state = self.scheduler.set_timesteps(steps, (bucket, lh, lw, self.latent_channels))
        state = meshlib.place(state, meshlib.replicated(self.mesh))
        as_uint8 = output_type != "np"
        tiled = self.uses_vae_tiling(height, width)
        program = self._program((bucket, lh, lw, steps, cfg, latents is not None, as_uint8,
                                 tiled))
        t1 = time.perf_counter()
        if adapter_idx is None:
            out = program(self.params, *args, state)
        else:
            out = program(self.params, *args, state, self._adapter_tables.as_tree(),
                          put(adapter_idx))
        if tiled:
            out = self.decode_tiled(out, as_uint8)
        images = program_lib.host_images(out, n, output_type)
        t2 = time.perf_counter()
        return PipelineOutput(images, [int(s) for s in seeds],
                              {"prepare_s": t1 - t0, "generate_s": t2 - t1, "batch": bucket})

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

    def host_inputs(self, items: Sequence[ImageRequest], height: int, width: int) -> tuple:
        """Per-image program inputs made on the host: (seeds (random where None), CFG on?,
        token ids (2, N, 77), negative token ids, zero_negative, time ids, negative time ids,
        guidance (1 where CFG is off for that image), guidance rescale)."""
        seeds = [it.seed if it.seed is not None else secrets.randbelow(MAX_SEED + 1)
                 for it in items]
        cfg = any(cfg_on(it.guidance_scale) for it in items)
        negs = [it.negative_prompt or "" for it in items]
        ids, neg_ids = self.token_ids([it.prompt for it in items],
                                      [it.prompt_2 or it.prompt for it in items],
                                      negs, [it.negative_prompt_2 or neg
                                             for it, neg in zip(items, negs)])
        zero_negative = np.array([it.negative_prompt is None and self.force_zeros_for_empty_prompt
                                  for it in items])
        if self.requires_aesthetics_score:  # the refiner's (size, crop, aesthetic score)
            pairs = [it.aesthetic_time_ids(height, width) for it in items]
            time_ids = np.array([pos for pos, _ in pairs], np.float32)
            neg_time_ids = np.array([neg for _, neg in pairs], np.float32)
        else:
            time_ids = np.array([it.time_ids(height, width) for it in items], np.float32)
            neg_time_ids = np.array([it.negative_time_ids(height, width) for it in items],
                                    np.float32)
        guidance = np.array([it.guidance_scale if cfg_on(it.guidance_scale) else 1.0
                             for it in items], np.float32)
        rescale = np.array([it.guidance_rescale for it in items], np.float32)
        return (seeds, cfg, ids, neg_ids, zero_negative, time_ids, neg_time_ids, guidance,
                rescale)

    def token_ids(self, prompts, prompts_2, negatives, negatives_2) -> tuple[np.ndarray, ...]:
        """Token ids (2, N, 77) of the prompts and of the negatives, one row per tokenizer; a
        model with one text encoder (SD 1.x / 2.x) repeats its ids in the second row, which
        its program never reads. The SDXL refiner (``tokenizer_2`` only) tokenizes ``prompts``
        and ``negatives`` with it, as diffusers does (``prompt_2`` is then unused), in both
        rows."""
        if self.tokenizer is None:
            one = (tokenize(self.tokenizer_2, prompts), tokenize(self.tokenizer_2, negatives))
            return np.stack([one[0], one[0]]), np.stack([one[1], one[1]])
        first = (tokenize(self.tokenizer, prompts), tokenize(self.tokenizer, negatives))
        second = first if self.tokenizer_2 is None else (
            tokenize(self.tokenizer_2, prompts_2), tokenize(self.tokenizer_2, negatives_2))
        return np.stack([first[0], second[0]]), np.stack([first[1], second[1]])

    def _seeds(self, seed, n: int) -> list[int | None]:
        """Per-image seeds from ``seed``: one int (image k gets seed + k), one per image, or None
        (stays None: :meth:`generate` draws them)."""
        if seed is None or isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
            return image_seeds(seed, n)
        if not isinstance(seed, (list, tuple, np.ndarray)):
            raise ValueError(f"seed={seed!r}; give one int in 0..{MAX_SEED}, a list of one int "
                             "per image, or None")
        seeds = list(seed)
        check(seed_problem(s) for s in seeds)
        seeds = [int(s) for s in seeds]
        if len(seeds) != n:
            raise ValueError(f"seed has {len(seeds)} values but {n} image(s) are generated; "
                             "give one int, or one per image")
        return seeds

    @property
    def limits(self) -> Limits:
        """What a request may ask of this pipeline: sides multiples of the VAE's scale factor,
        at most the scheduler's step limit (the rules: :mod:`pipelines.limits`)."""
        return Limits(multiple=self.vae_scale_factor, max_steps=self.max_steps,
                      steps_why=f"what {type(self.scheduler).__name__} allows")

    def check_request(self, steps: int, height: int, width: int, output_type: str = "pil") -> None:
        """ValueError naming every field of a request this pipeline cannot run: the step count,
        the size (:attr:`limits`) and the output type, by the rules of :mod:`pipelines.limits`
        (the step engine and the service's replicas check their requests here too)."""
        check([*problems(self.limits, steps=steps, width=width, height=height),
               output_type_problem(output_type)])
