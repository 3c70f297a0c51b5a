"""Loading a model: where its configs are (a diffusers folder, a Hugging Face model name through
the local cache: :func:`maxdiff.hub.resolve`, or a single file with shipped or given configs;
:func:`model_root`), its components read from the folder or the file (:func:`load`), and JAX's
persistent compilation cache (:func:`enable_compile_cache`)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from maxdiff import checkpoint, hub, single_file, target
from maxdiff import mesh as meshlib
from maxdiff import quantization as quantlib
from maxdiff.family import Family, folder_family
from maxdiff.loaders import load_unet, load_vae
from maxdiff.models.clip import load_text_encoder
from maxdiff.models.unet import unet_module
from maxdiff.schedulers import read_scheduler_config, resolve_scheduler
from maxdiff.tokenizers import load_tokenizer
from pipelines.config import ModelDefaults

__all__ = ["DEFAULT_COMPILE_CACHE", "COMPONENTS", "component_dtypes", "enable_compile_cache",
           "model_root", "load"]

DEFAULT_COMPILE_CACHE = Path(os.environ.get("MAXDIFF_COMPILE_CACHE",
                                            Path.home() / ".cache" / "maxdiff" / "jax"))


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


# the components whose dtype from_pretrained(dtype={...}) sets one by one
COMPONENTS = ("unet", "vae", "text_encoder", "text_encoder_2")


def component_dtypes(dtype: Any, platform: str) -> dict[str, str]:
    """``from_pretrained``'s ``dtype`` -> each of :data:`COMPONENTS`' dtype: one dtype (a
    string such as ``"bfloat16"``, or ``"auto"``: :func:`maxdiff.target.default_dtype` of
    ``platform``) for all of them, or a mapping component -> dtype (``"auto"`` allowed), where a
    component left out is float32. A key that is no component, or a dtype that is none, raises
    ValueError naming it."""
    if not isinstance(dtype, Mapping):
        one = target.default_dtype(platform) if dtype == "auto" else dtype
        return dict.fromkeys(COMPONENTS, one)
    bad = [k for k in dtype if k not in COMPONENTS]
    if bad:
        raise ValueError(f"dtype: unknown component {bad[0]!r}; the components are "
                         f"{', '.join(COMPONENTS)}")
    out = dict.fromkeys(COMPONENTS, "float32")
    for name, value in dtype.items():
        value = target.default_dtype(platform) if value == "auto" else value
        try:
            checkpoint.resolve_dtype(value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"dtype[{name!r}]: {e}") from None
        out[name] = value
    return out


def model_root(path: Path, config: str | os.PathLike | None
               ) -> tuple[Path, single_file.Layout | None, Family]:
    """The folder whose configs describe the model, the single file's layout (None for a
    diffusers folder) and the model's family. Errors name what is missing."""
    if path.is_file():
        layout = single_file.inspect(path)
        if not layout.family.single_file:
            raise checkpoint.CheckpointError(
                f"{path}: a {layout.family.title} single file; maxdiff's pipelines load SDXL "
                "base and refiner and SD 1.x / 2.x single files and diffusers folders")
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
        for comp in layout.family.components:
            if not (root / comp / "config.json").is_file():
                raise checkpoint.CheckpointError(
                    f"{root}: config= needs {comp}/config.json (a diffusers "
                    f"{layout.family.pipeline} folder describing the single file)")
        return root, layout, layout.family
    if config is not None:
        raise ValueError(f"config= describes a single-file checkpoint; {path} is a folder with "
                         "its own configs")
    index = path / "model_index.json"
    if not index.is_file():
        raise checkpoint.CheckpointError(
            f"{path}: not a diffusers pipeline folder (no model_index.json) nor a single-file "
            "checkpoint")
    checkpoint.check_links(path)
    family = folder_family(path, json.loads(index.read_text()))
    needs = (*family.components, *(name for name, _ in family.tokenizers))
    for comp in needs:
        if not (path / comp).is_dir():
            raise checkpoint.CheckpointError(
                f"{path}: missing component folder {comp}/ (this pipeline needs "
                f"{', '.join(needs)}, scheduler)")
    return path, None, family


def _tokenizer_folder(root: Path, name: str, layout: single_file.Layout | None) -> Path:
    """``root/name``; configs without tokenizers (the shipped single-file configs) use the
    embedded model's tokenizer with the same settings: CLIP's own 49,408-token vocabulary,
    padded as the family pads (SDXL's ``tokenizer_2`` and SD 2.x's with ``!``)."""
    if (root / name).is_dir() or layout is None:
        return root / name
    from pipelines.default_model import EMBEDDED

    return EMBEDDED / dict(layout.family.tokenizers).get(name, name)


def _safety_checker(root: Path, model_index: dict):
    """The checkpoint's safety checker (SD 1.x ships ``safety_checker/`` and
    ``feature_extractor/``; :mod:`maxdiff.models.safety_checker`), or None where it has none."""
    if (model_index.get("safety_checker") or [None])[0] is None \
            or not (root / "safety_checker").is_dir():
        return None
    from maxdiff.models.safety_checker import load_safety_checker

    return load_safety_checker(root / "safety_checker", root / "feature_extractor")


def load(path, dtype, *, unet, scheduler, devices, attention_kernel, attention_chunk,
         compile_cache_dir, variant, vae, config, quantization,
         revision=None, safety_checker: bool = True) -> tuple[dict, tuple]:
    """What :meth:`pipelines.TextToImagePipeline.from_pretrained` loads (its arguments mean
    the same; ``dtype`` one dtype or one per component: :func:`component_dtypes`): the
    pipeline's constructor arguments, and the model's (default height, default width, largest
    side) from its configs and ``maxdiff.json`` (None where unknown). ``path``, ``vae`` and
    ``config`` may be Hugging Face model names (``org/name``), found in the local cache or
    downloaded (:func:`maxdiff.hub.resolve`; ``revision`` applies to ``path``)."""
    quantlib.check_quantization(quantization)
    if path is None:
        from pipelines.default_model import default_model_path

        path = default_model_path()
    if config is not None:  # configs only: a name's weights are not fetched
        config = hub.resolve(config, weights=False)
    if vae is not None:
        vae = hub.resolve(vae)
    root, layout, family = model_root(hub.resolve(path, revision=revision, variant=variant),
                                      config)
    model_index = json.loads((root / "model_index.json").read_text())
    enable_compile_cache(compile_cache_dir)
    mesh = meshlib.make_mesh(devices)
    put = meshlib.put_replicated(mesh)
    dtypes = component_dtypes(dtype, target.mesh_platform(mesh))

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
            unet_module(unet_cfg, dtypes["unet"], attention_kernel, attention_chunk),
            root / "unet" / quantlib.WEIGHTS_FILE, stored, put=put)
    else:
        unet_model, unet_params = load_unet(
            unet if unet is not None else root / "unet", dtypes["unet"], config=unet_cfg,
            attention_kernel=attention_kernel, attention_chunk=attention_chunk, put=put,
            variant=None if unet is not None else variant,
            source=None if unet is not None else unet_src)
    if quantization != "none" and stored is None:  # the float weights go once quantized
        unet_model, unet_params = quantlib.quantize(unet_model, unet_params, quantization)
        unet_params = put(unet_params)
    if vae is None:
        vae_cfg, vae_src = part("vae")
        vae_model, vae_params = load_vae(root / "vae", dtypes["vae"], variant=variant, put=put,
                                         config=vae_cfg, source=vae_src)
    else:  # a folder brings its config; a file is read with the model's
        vae_cfg = None if Path(vae).is_dir() else checkpoint.read_config(root / "vae")
        vae_model, vae_params = load_vae(vae, dtypes["vae"], put=put, config=vae_cfg)
    encoders = {}
    for name in family.encoders:
        cfg, src = part(name)
        encoders[name] = load_text_encoder(root / name, dtypes[name], variant=variant,
                                           config=cfg, source=src)
    te1, te1_params = encoders.get("text_encoder", (None, None))
    te2, te2_params = encoders.get("text_encoder_2", (None, None))
    te1_params, te2_params = meshlib.place((te1_params, te2_params), meshlib.replicated(mesh))

    measured = ModelDefaults.read(root)
    steps = measured.steps or family.steps
    guidance = family.guidance if measured.guidance is None else measured.guidance
    # the model's own scheduler (None), a preset (its steps and guidance become the defaults),
    # a sampler name (the model's config switched to it), a config or a path
    model_sched = (layout.scheduler_config(read_scheduler_config(root)) if layout
                   else root / "scheduler")
    sched, preset = resolve_scheduler(scheduler, model_sched)
    if preset is not None:
        steps, guidance = preset.num_inference_steps, preset.guidance_scale

    # the refiner's five time ids (size, crop, aesthetic score) or the base's six
    n_ids = family.n_time_ids
    aesthetic = n_ids == 5
    expected = (unet_model.config.addition_time_embed_dim or 0) * n_ids + (
        te2.config.projection_dim if family.pooled else 0)
    if family.pooled and unet_model.config.projection_class_embeddings_input_dim != expected:
        raise checkpoint.CheckpointError(
            f"{root}: unet projection_class_embeddings_input_dim="
            f"{unet_model.config.projection_class_embeddings_input_dim} but text_encoder_2 "
            f"projection_dim={te2.config.projection_dim} and addition_time_embed_dim="
            f"{unet_model.config.addition_time_embed_dim} need {expected} ({n_ids} time ids: "
            f"model_index.json requires_aesthetics_score={aesthetic})")
    toks = {name: load_tokenizer(_tokenizer_folder(root, name, layout))
            for name, _ in family.tokenizers}
    params = {"unet": unet_params, "vae": vae_params}
    if te1 is not None:
        params["text_encoder"] = te1_params
    if te2 is not None:
        params["text_encoder_2"] = te2_params
    parts = dict(
        tokenizer=toks.get("tokenizer"), tokenizer_2=toks.get("tokenizer_2"),
        text_encoder=te1, text_encoder_2=te2, unet=unet_model, vae=vae_model,
        scheduler=sched, params=params, mesh=mesh,
        # SDXL zeroes an omitted negative prompt; SD 1.x / 2.x encode "" (no such key)
        force_zeros_for_empty_prompt=bool(model_index.get("force_zeros_for_empty_prompt",
                                                          family.zero_negative)),
        default_steps=steps, default_guidance=guidance, name=str(path),
        quantization=quantization, family=family,
        safety_checker=_safety_checker(root, model_index) if safety_checker else None,
    )
    sample_size = unet_cfg.get("sample_size")
    side = sample_size * vae_model.config.vae_scale_factor if isinstance(sample_size, int) \
        else None
    return parts, (measured.height or side, measured.width or side, measured.max_size)
