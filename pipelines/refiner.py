"""The SDXL refiner, diffusers' "ensemble of experts": the base denoises the first part of the
schedule (``denoising_end``, e.g. 0.8), the refiner the rest (``denoising_start``, the same
fraction) from the base's latents as they are, no decode in between, no noise added.

Two ways, the same numbers (for deterministic samplers):

- two calls, as with diffusers: ``base(prompt, denoising_end=0.8, output_type="latent")``,
  then ``refiner(prompt, image=latents, denoising_start=0.8)`` with the refiner loaded as an
  :class:`pipelines.ImageToImagePipeline`;
- one call: ``TextToImagePipeline.from_pretrained(base, refiner=REFINER)`` (or
  :meth:`~pipelines.TextToImagePipeline.set_refiner`), then ``pipe(prompt)``: ONE jitted
  program runs the base's text encoders, the noise, the base's steps up to the cut, the
  refiner's text encoder, the refiner's steps from the cut and the refiner's VAE decode
  (:func:`build`). The cut is a traced input (a new ``denoising_end`` never recompiles);
  programs are cached per (padded batch, size, steps, CFG on/off, latents given, output kind,
  tiled VAE) on the base pipeline, one per refiner and schedulers.

Where the cut falls follows diffusers exactly (:func:`pipelines.program.end_step`,
:func:`pipelines.program.start_step_at`): the base runs the timesteps at or above
``round(T - fraction * T)``, the refiner its own timesteps below it, starting with a fresh
scheduler state (DPM++ 2M's first refiner step is first order, as diffusers'
``set_begin_index`` gives it). This module also serves a base alone with ``denoising_end`` or
``output_type="latent"`` (the first of the two calls).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxdiff import mesh as meshlib
from pipelines import program as program_lib
from pipelines.limits import (check, denoising_fraction_problem, output_type_problem, problems,
                              split_steps_problems)
from pipelines.requests import ImageRequest, bucket_size
from pipelines.text_to_image import PipelineOutput, _to_pixels, conditioning

__all__ = ["generate", "build"]


def build(base, refiner, lh: int, lw: int, cfg: bool, out: str, tiled: bool):
    """The program of one shape: base steps ``0 .. end - 1``, then (with ``refiner``, an
    image-to-image pipeline) refiner steps ``start ..`` the end of its schedule; ``out``:
    ``"latent"`` (the latents, NHWC), ``"uint8"`` or ``"float"`` pixels; ``tiled``: unscaled
    latents for the tiled decoder."""
    te1, te2, unet, vae, sched = (base.text_encoder, base.text_encoder_2, base.unet, base.vae,
                                  base.scheduler)
    shape = (lh, lw, base.latent_channels)
    if refiner is not None:
        rte1, rte2, runet, rsched = (refiner.text_encoder, refiner.text_encoder_2, refiner.unet,
                                     refiner.scheduler)
    decoder = vae if refiner is None else refiner.vae

    def program(p, ids, neg_ids, zero_negative, seeds, latents, guidance, rescale, time_ids,
                neg_time_ids, state, end, rp=None, r_ids=None, r_neg_ids=None, r_zero=None,
                r_time_ids=None, r_neg_time_ids=None, r_state=None, start=None):
        emb, pooled, tids, _ = conditioning(te1, te2, p, ids, neg_ids, zero_negative, time_ids,
                                            neg_time_ids, cfg)
        init_keys, step_keys = program_lib.image_keys(seeds)  # text-to-image's noise
        if latents is None:
            latents = program_lib.normal(init_keys, shape)
        x = latents.astype(jnp.float32) * sched.init_noise_sigma(state)
        g = guidance[:, None, None, None]
        r = rescale[:, None, None, None]
        x = program_lib.denoise(
            sched, lambda xin, t, i: unet.apply({"params": p["unet"]}, xin, t, emb, pooled,
                                                tids),
            x, state, 0, end, cfg=cfg, g=g, r=r, step_keys=step_keys, shape=shape)
        vae_params = p["vae"]
        if refiner is not None:
            remb, rpooled, rtids, _ = conditioning(rte1, rte2, rp, r_ids, r_neg_ids, r_zero,
                                                   r_time_ids, r_neg_time_ids, cfg)
            x = program_lib.denoise(
                rsched, lambda xin, t, i: runet.apply({"params": rp["unet"]}, xin, t, remb,
                                                      rpooled, rtids),
                x, r_state, start, r_state.timesteps.shape[0], cfg=cfg, g=g, r=r,
                step_keys=step_keys, shape=shape)
            vae_params = rp["vae"]
        if out == "latent":
            return x
        if tiled:  # decoded tile by tile afterwards (decode_tiled)
            return decoder.apply({"params": vae_params}, x, method=decoder.unscale_latents)
        img = program_lib.decode(decoder, vae_params, x)
        return _to_pixels(img, out == "uint8")

    return program


def generate(base, items: Sequence[ImageRequest], *, height: int | None = None,
             width: int | None = None, num_inference_steps: int | None = None,
             latents: Any = None, output_type: str = "pil",
             denoising_end: float | None = None) -> PipelineOutput:
    """:meth:`TextToImagePipeline.generate` with ``base.refiner`` (finishing from
    ``denoising_end``, default ``base.high_noise_frac``), or a base stopped at
    ``denoising_end`` (default: the whole schedule) whose ``output_type`` may be
    ``"latent"``: (N, C, H/f, W/f) float32 NumPy latents, diffusers' layout. The refiner runs
    the same ``num_inference_steps`` with its own scheduler, as diffusers' two pipelines do."""
    t0 = time.perf_counter()
    refiner = base.refiner
    items = list(items)
    if not items:
        raise ValueError("items is empty: give at least one ImageRequest")
    if refiner is not None and denoising_end is None:
        denoising_end = base.high_noise_frac
    steps = base.default_steps if num_inference_steps is None else num_inference_steps
    height = base.default_height if height is None else height
    width = base.default_width if width is None else width
    check([*problems(base.limits, steps=steps, width=width, height=height),
           output_type_problem(output_type, latent=refiner is None),
           None if denoising_end is None else denoising_fraction_problem(denoising_end)])
    if refiner is not None:
        refiner.check_request(steps, height, width)
    for k, it in enumerate(items):
        it.validate(k)
    if base.adapter_index(items) is not None and any(it.adapter for it in items):
        raise ValueError("per-image adapters (add_adapter) do not run with denoising_end or a "
                         "refiner; fuse the LoRA with load_lora_weights instead")
    f, n = base.vae_scale_factor, len(items)
    lh, lw = height // f, width // f
    latents = base.initial_latents(latents, n, height, width)
    (seeds, cfg, ids, neg_ids, zero_negative, time_ids, neg_time_ids, guidance,
     rescale) = base.host_inputs(items, height, width)

    bucket = bucket_size(n, base.mesh.size)
    put = program_lib.BatchPut(base.mesh, bucket)
    rep = meshlib.replicated(base.mesh)
    shape = (bucket, lh, lw, base.latent_channels)
    state = base.scheduler.set_timesteps(steps, shape)
    calls = int(state.timesteps.shape[0])
    end = calls if denoising_end is None else program_lib.end_step(
        np.asarray(state.timesteps), base.scheduler.num_train_timesteps, float(denoising_end))
    args = [base.params, put(ids, ids=True), put(neg_ids, ids=True), put(zero_negative),
            put(np.asarray(seeds, np.uint32)), put(latents), put(guidance), put(rescale),
            put(time_ids), put(neg_time_ids), meshlib.place(state, rep),
            meshlib.place(np.int32(end), rep)]
    refiner_steps = 0
    if refiner is not None:
        seeded = [dataclasses.replace(it, seed=s) for it, s in zip(items, seeds)]
        (_, _, r_ids, r_neg_ids, r_zero, r_time_ids, r_neg_time_ids, _,
         _) = refiner.pipe.host_inputs(seeded, height, width)
        r_state = refiner.scheduler.set_timesteps(steps, shape)
        start = program_lib.start_step_at(np.asarray(r_state.timesteps),
                                          refiner.scheduler.num_train_timesteps,
                                          float(denoising_end))
        refiner_steps = int(r_state.timesteps.shape[0]) - start
        check(split_steps_problems(end, refiner_steps, denoising_end))
        args += [refiner.params, put(r_ids, ids=True), put(r_neg_ids, ids=True), put(r_zero),
                 put(r_time_ids), put(r_neg_time_ids), meshlib.place(r_state, rep),
                 meshlib.place(np.int32(start), rep)]
    else:
        check(split_steps_problems(end, 1, denoising_end))
    decoding = base if refiner is None else refiner
    out_kind = "latent" if output_type == "latent" else (
        "float" if output_type == "np" else "uint8")
    tiled = out_kind != "latent" and decoding.uses_vae_tiling(height, width)
    key = ("two-stage", None if refiner is None else id(refiner.pipe),
           None if refiner is None else id(refiner.scheduler), id(base.scheduler), bucket, lh,
           lw, steps, cfg, latents is not None, out_kind, tiled)
    # (the cached program keeps its refiner and schedulers alive, so their ids stay theirs)
    program = base.cached_program(key, lambda: build(base, refiner, lh, lw, cfg, out_kind,
                                                     tiled))
    t1 = time.perf_counter()
    out = program(*args)
    if out_kind == "latent":
        images = np.asarray(jax.device_get(out))[:n].transpose(0, 3, 1, 2)
    else:
        if tiled:
            out = decoding.decode_tiled(out, out_kind == "uint8")
        images = program_lib.host_images(out, n, output_type)
    t2 = time.perf_counter()
    return PipelineOutput(images, [int(s) for s in seeds],
                          {"prepare_s": t1 - t0, "generate_s": t2 - t1, "batch": bucket,
                           "base_steps": end, "refiner_steps": refiner_steps})
