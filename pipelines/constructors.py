"""How a pipeline is made: :meth:`Constructors.from_pretrained` (a diffusers folder, a Hugging
Face name, a single file), :meth:`~Constructors.from_single_file`, :meth:`~Constructors.from_config`
(a run config), and :meth:`~Constructors.set_refiner`. A base of
:class:`pipelines.TextToImagePipeline`; the components come from :func:`pipelines.loading.load`."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from maxdiff import checkpoint
from maxdiff.models.vae_tiling import check_tiling_setting
from pipelines import loading
from pipelines.config import RunConfig, load_run_config
from pipelines.limits import HIGH_NOISE_FRAC, check, denoising_fraction_problem
from pipelines.loading import DEFAULT_COMPILE_CACHE

__all__ = ["Constructors"]


class Constructors:
    """The constructors of :class:`pipelines.TextToImagePipeline` (a mixin: ``cls(**parts)``
    makes the pipeline)."""

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike | None = None,
                        dtype: str | Mapping[str, str] = "auto",
                        unet: str | os.PathLike | None = None, scheduler: Any = None,
                        devices: int | Sequence[Any] | None = None, *,
                        attention_kernel: str = "auto", attention_chunk: int = 512,
                        compile_cache_dir: str | os.PathLike | None = DEFAULT_COMPILE_CACHE,
                        variant: str | None = None, vae_tiling: bool | str = "auto",
                        vae: str | os.PathLike | None = None,
                        config: str | os.PathLike | None = None,
                        quantization: str = "none", refiner: Any = None,
                        high_noise_frac: float = HIGH_NOISE_FRAC,
                        revision: str | None = None,
                        safety_checker: bool = True) -> Constructors:
        """Load a diffusers SDXL folder (``model_index.json``, ``unet/``, ``vae/``,
        ``text_encoder/``, ``text_encoder_2/``, ``tokenizer*/``, ``scheduler/``), or a
        single-file SDXL checkpoint (see :meth:`from_single_file`; ``config`` applies to it).

        ``path`` may also name a model on the Hugging Face Hub, ``"org/name"``: its snapshot in
        the local Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``) is loaded, at
        ``revision`` (a branch or tag recorded in the cache, or a commit hash; default
        ``main``); a name not cached is downloaded (the files maxdiff reads) unless
        ``HF_HUB_OFFLINE=1``, which raises an error saying how to download it
        (:func:`maxdiff.hub.resolve`). An existing local path always wins over a name.
        ``safety_checker``: run the checkpoint's safety checker where it ships one (SD 1.x;
        diffusers' default); False turns it off, as diffusers' ``safety_checker=None``.
        ``variant``: read ``*.{variant}.safetensors`` weights (``"fp16"``) where a component
        has them, its plain weights where it has not, as diffusers does. ``vae``, ``config``
        and ``refiner`` take names too.

        ``unet``: a UNet file that replaces the model's: diffusers keys (the SDXL-Lightning
        files) or a whole single-file checkpoint. ``vae``: a VAE that replaces the model's: a
        diffusers VAE folder, or a file (``sdxl_vae.safetensors``, original or diffusers keys),
        or a diffusers ``AutoencoderTiny`` folder (``madebyollin/taesdxl``): fast decodes and
        encodes of lower quality, never tiled (:class:`maxdiff.models.taesd.TinyAutoencoder`).
        ``scheduler``: a diffusers scheduler config dict, a folder or json file, a preset
        name such as ``"lightning-4step"`` (which also sets the default steps and guidance), or
        a sampler name (``"dpmpp_2m_karras"``, ``"DPM++ 2M Karras"``, ``"euler_a"``, ``"unipc"``,
        ...: :mod:`maxdiff.schedulers.names`), the model's own scheduler switched to it.
        ``dtype``: ``"auto"`` (bfloat16 on TPUs and GPUs, float32 on CPUs: the mesh's devices
        decide, :func:`maxdiff.target.default_dtype`), ``"float32"``, ``"bfloat16"`` or
        ``"float16"``; or one per component, ``{"unet": "bfloat16", "vae": "float32", ...}``
        (keys ``unet``, ``vae``, ``text_encoder``, ``text_encoder_2``; one left out is float32;
        another key raises ValueError; :func:`pipelines.loading.component_dtypes`).
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
        compiled program (:mod:`pipelines.tasks.refine`). A refiner folder itself loads here too
        (text_encoder_2 only, aesthetic-score time ids): use it with
        :class:`pipelines.ImageToImagePipeline`.
        """
        vae_tiling = check_tiling_setting(vae_tiling)
        parts, (height, width, max_size) = loading.load(
            path, dtype, unet=unet, scheduler=scheduler, devices=devices,
            attention_kernel=attention_kernel, attention_chunk=attention_chunk,
            compile_cache_dir=compile_cache_dir, variant=variant, vae=vae, config=config,
            quantization=quantization, revision=revision, safety_checker=safety_checker)
        pipe = cls(**parts)
        pipe.default_height = height or pipe.default_height
        pipe.default_width = width or pipe.default_width
        pipe.max_size = max_size
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
        :class:`TextToImagePipeline` or an image-to-image pipeline over one, whose scheduler
        and VAE tiling it then uses; None removes it) from ``high_noise_frac`` of the schedule
        unless a call gives ``denoising_end``."""
        check([denoising_fraction_problem(high_noise_frac, "high_noise_frac")])
        if refiner is not None:
            model = getattr(refiner, "pipe", refiner)
            if not isinstance(model, Constructors):
                raise TypeError(f"refiner: a TextToImagePipeline or a pipeline over one, got "
                                f"{type(refiner).__name__}")
            if model.text_encoder_2 is None or model.latent_channels != self.latent_channels:
                raise ValueError(f"refiner {model.name}: an SDXL refiner (or base) with "
                                 f"{self.latent_channels} latent channels, like this model's")
        self.refiner, self.high_noise_frac = refiner, float(high_noise_frac)

    @classmethod
    def from_single_file(cls, path: str | os.PathLike, config: str | os.PathLike | None = None,
                         **kwargs) -> Constructors:
        """Load a single-file checkpoint in the original Stability layout (the ``.safetensors``
        files A1111 / ComfyUI users download: ``model.diffusion_model.*``,
        ``first_stage_model.*``, ``conditioner.embedders.*`` or ``cond_stage_model.*``), as
        diffusers' ``from_single_file`` does. The architecture is recognised from the keys; its
        configs are the ones maxdiff ships for its family (``maxdiff/assets/configs/``: SDXL
        base and refiner, SD 1.5, SD 2.1) unless ``config`` names a diffusers folder whose
        ``config.json`` files (and tokenizers, when it has them) describe the file. A file
        without a VAE needs ``vae=``. Other keyword arguments as :meth:`from_pretrained`.
        Weights stream tensor by tensor."""
        if not Path(path).is_file():
            raise checkpoint.CheckpointError(f"{path}: no such file (from_single_file reads one "
                                             ".safetensors file; use from_pretrained for a folder)")
        return cls.from_pretrained(path, config=config, **kwargs)

    @classmethod
    def from_config(cls, config: Any = None, overrides: Sequence[str] | dict | None = None
                    ) -> Constructors:
        """Load from a run config (a :class:`pipelines.config.RunConfig`, a YAML path or a name
        in ``configs/``) with optional ``key=value`` overrides. The config's steps, guidance and
        size become this pipeline's defaults; its ``loras`` are fused in order, its
        ``embeddings``, ``ip_adapter`` and ``preview_decoder`` loaded."""
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
        for emb in cfg.embeddings:
            pipe.load_textual_inversion(emb.path, token=emb.token)
        if cfg.preview_decoder is not None:
            pipe.load_preview_decoder(cfg.preview_decoder)
        if cfg.ip_adapter is not None:
            pipe.load_ip_adapter(cfg.ip_adapter, image_encoder=cfg.ip_adapter_image_encoder,
                                 scale=cfg.ip_adapter_scale)
        pipe.run_config = cfg
        return pipe
