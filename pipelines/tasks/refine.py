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
  (:class:`Refine`). The cut is a traced input (a new ``denoising_end`` never recompiles);
  programs are kept in the base pipeline's :attr:`programs`, one per refiner and schedulers.

Where the cut falls follows diffusers exactly (:func:`pipelines.program.end_step`,
:func:`pipelines.program.start_step_at`): the base runs the timesteps at or above
``round(T - fraction * T)``, the refiner its own timesteps below it, starting with a fresh
scheduler state (DPM++ 2M's first refiner step is first order, as diffusers'
``set_begin_index`` gives it). This module also serves a base alone with ``denoising_end`` or
``output_type="latent"`` (the first of the two calls).

The program's scalars: ``end`` (the base's model calls), with a refiner ``start`` (its first
model call) and ``state`` (its scheduler state); rows: ``latents`` and the refiner's own
:class:`pipelines.program.HostInputs` (``refiner``: its tokenizer, time ids); weights: the
refiner's. Feature caching (``cfg_cutoff``, ``deepcache_interval``) applies to each stage's
own steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipelines import program as program_lib
from pipelines.limits import (
    check,
    denoising_fraction_problem,
    output_type_problem,
    split_steps_problems,
)
from pipelines.program import PipelineOutput
from pipelines.requests import ImageRequest, bucket_size
from pipelines.runner import Ctx, Job, Task, checked_items, run

__all__ = ["Refine", "generate"]


class Refine(Task):
    """The two-stage task with ``refiner`` (a pipeline: its family, modules, scheduler and
    VAE), or a base stopped at ``end`` (``refiner`` None)."""

    name = "base+refiner"
    adapters = False

    def __init__(self, refiner=None):
        self.refiner = refiner

    def end(self, ctx: Ctx):
        return ctx.scalars["end"]

    def then(self, ctx: Ctx, x):
        refiner = self.refiner
        if refiner is None:
            return super().then(ctx, x)
        params, state = ctx.weights, ctx.scalars["state"]
        encoders = {name: getattr(refiner, name) for name in refiner.family.encoders}
        cond, _ = program_lib.conditioning(refiner.family, encoders, params, ctx.rows["refiner"])

        def denoiser(cond):
            def model(xin, t, i, **more):
                return refiner.family.denoise(refiner.unet, params["unet"], cond, xin, t, **more)
            return model

        x = ctx.denoise(refiner.scheduler, denoiser(cond), x, state, ctx.scalars["start"],
                        state.timesteps.shape[0], step_keys=ctx.keys[-1], shape=ctx.shape,
                        nocfg=lambda: denoiser(program_lib.conditional_half(cond)))
        return x, refiner.vae, params["vae"]


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
    if refiner is not None and denoising_end is None:
        denoising_end = base.high_noise_frac
    items, steps, height, width = checked_items(
        base, items, num_inference_steps, height, width, None,
        more=[output_type_problem(output_type, latent=refiner is None),
              None if denoising_end is None else denoising_fraction_problem(denoising_end)],
        no_samplers="text-to-image without a refiner or denoising_end")
    if refiner is not None:
        refiner.check_request(steps, height, width)
    if base.adapter_index(items) is not None and any(it.adapter for it in items):
        raise ValueError("per-image adapters (add_adapter) do not run with denoising_end or a "
                         "refiner; fuse the LoRA with load_lora_weights instead")
    latents = base.initial_latents(latents, len(items), height, width)
    inputs = base.host_inputs(items, height, width)
    timesteps = np.asarray(base.scheduler.set_timesteps(steps, (1, 1, 1, 1)).timesteps)
    end = len(timesteps) if denoising_end is None else program_lib.end_step(
        timesteps, base.scheduler.num_train_timesteps, float(denoising_end))
    rows, scalars = {"latents": latents}, {"end": np.int32(end)}
    weights, key, refiner_steps = None, (), 0
    if refiner is not None:
        # the refiner has no image prompts (an IP-Adapter conditions the base's steps)
        seeded = [dataclasses.replace(it, seed=int(s), ip_adapter_image=None)
                  for it, s in zip(items, inputs.seeds)]
        f = base.vae_scale_factor
        state = refiner.scheduler.set_timesteps(
            steps, (bucket_size(len(items), base.mesh.size), height // f,
                    width // f, base.latent_channels))
        start = program_lib.start_step_at(np.asarray(state.timesteps),
                                          refiner.scheduler.num_train_timesteps,
                                          float(denoising_end))
        refiner_steps = int(state.timesteps.shape[0]) - start
        check(split_steps_problems(end, refiner_steps, denoising_end))
        rows["refiner"] = refiner.host_inputs(seeded, height, width)
        scalars.update(start=np.int32(start), state=state)
        weights = refiner.params
        # the program closes over the refiner's modules and scheduler (kept alive by it)
        key = (id(getattr(refiner, "pipe", refiner)), id(refiner.scheduler))
    else:
        check(split_steps_problems(end, 1, denoising_end))
    return run(Job(Refine(refiner), base, items, height, width, steps, output_type, t0,
                   rows=rows, scalars=scalars, weights=weights, key=key,
                   timings={"base_steps": end, "refiner_steps": refiner_steps},
                   decoder=refiner, inputs=inputs))
