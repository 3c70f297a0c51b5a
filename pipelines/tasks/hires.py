"""Hires fix (A1111's "Hires. fix"): text-to-image drawn first at the output size / ``scale``,
its latents upscaled (bilinear) to the output size, then denoised again from them noised to
the strength's start step, in one program. Each pass is what the two calls it replaces would
run: the first is text-to-image at the small size (its noise and step noise from the seeds as
text-to-image draws them, its time ids for the small size), the second image-to-image from
latents (:mod:`pipelines.tasks.edit`'s draws and rule: ``int(steps * strength)`` of ``steps``
run). A request asks for it with a :class:`pipelines.requests.HiresFix`.

Rows: ``base_time_ids`` / ``base_neg_time_ids`` (the first pass's micro-conditioning).
Scalars: ``t_start`` (the second pass's first model call). Key: (first pass latent height,
width, steps). The text encoders run once: both passes share the prompts' conditioning.
Feature caching, samplers per request and per-image adapters apply to both passes.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np

from pipelines import program as program_lib
from pipelines.limits import check, hires_problems
from pipelines.requests import HiresFix, ImageRequest
from pipelines.runner import TEXT, Ctx, Job, Task, checked_items, run

__all__ = ["HIRES", "generate", "upscale"]


def upscale(latents, height: int, width: int):
    """Latents (B, h, w, C) resized to (B, height, width, C), bilinear (half-pixel centres:
    torch's ``interpolate(mode="bilinear")``, A1111's "Latent" upscaler)."""
    b, _, _, c = latents.shape
    return jax.image.resize(latents, (b, height, width, c), method="bilinear")


class Hires(Task):
    name = "hires-fix"
    n_keys = 4  # the second pass draws as image-to-image does (add-noise noise first)

    def begin(self, ctx: Ctx):
        lh0, lw0, steps0 = ctx.static.key
        sched, inputs = ctx.scheduler, ctx.inputs
        shape0 = (lh0, lw0, ctx.shape[-1])
        state0 = sched.set_timesteps(steps0, (inputs.seeds.shape[0], *shape0))
        ids, neg = ctx.rows["base_time_ids"], ctx.rows["base_neg_time_ids"]
        time_ids = program_lib.cfg_rows(neg, ids) if inputs.cfg else ids
        first = dataclasses.replace(ctx, cond=dataclasses.replace(ctx.cond, time_ids=time_ids),
                                    memo={})
        keys0 = program_lib.image_keys(inputs.seeds, TEXT.n_keys)
        x = program_lib.normal(keys0[0], shape0) * sched.init_noise_sigma(state0)
        x = ctx.denoise(sched, first.denoiser(), x, state0, 0, state0.timesteps.shape[0],
                        step_keys=keys0[-1], shape=shape0,
                        nocfg=lambda: first.without_cfg().denoiser())
        lh, lw, _ = ctx.shape
        t_start = ctx.scalars["t_start"]
        noise = program_lib.normal(ctx.keys[0], ctx.shape)
        return sched.add_noise(ctx.state, upscale(x, lh, lw), noise, t_start), t_start


HIRES = Hires()


def generate(pipe, items: Sequence[ImageRequest], hires: HiresFix, *, height: int | None,
             width: int | None, num_inference_steps: int | None, output_type: str = "pil",
             on_step=None, progress: bool | None = None, denoised: bool = False):
    """``items`` drawn with ``hires`` on ``pipe`` (a text-to-image pipeline without a refiner):
    ``height`` x ``width`` is the output's size, ``num_inference_steps`` the first pass's
    steps; ``on_step`` / ``progress`` report the second pass's steps."""
    t0 = time.perf_counter()
    if not isinstance(hires, HiresFix):
        raise ValueError(f"hires must be a HiresFix, got {type(hires).__name__}")
    if pipe.refiner is not None:
        raise ValueError("hires_scale: a hires fix runs without a refiner (set_refiner(None))")
    items, steps, height, width = checked_items(pipe, items, num_inference_steps, height, width,
                                                output_type, samplers=True)
    f = pipe.vae_scale_factor
    lim = pipe.limits
    check(hires_problems(hires.scale, hires.strength, hires.steps, steps, width, height, f,
                         lim.min_size, lim.max_steps, lim.steps_why))
    steps2 = steps if hires.steps is None else hires.steps
    w0, h0 = hires.first_size(width, height, f)
    pairs = [pipe.family.time_ids(it, h0, w0) for it in items]
    n_ids = pipe.family.n_time_ids
    rows = {name: np.array([pair[k] for pair in pairs], np.float32).reshape(len(items), n_ids)
            for k, name in enumerate(("base_time_ids", "base_neg_time_ids"))}
    t_start = program_lib.start_step(steps2, float(hires.strength))
    return run(Job(HIRES, pipe, items, height, width, steps2, output_type, t0, rows=rows,
                   scalars={"t_start": np.int32(t_start)}, key=(h0 // f, w0 // f, steps),
                   timings={"base_steps": steps,
                            "hires_steps": pipe.scheduler.num_model_calls(steps2) - t_start},
                   on_step=on_step, denoised=denoised,
                   progress=sys.stderr.isatty() if progress is None else bool(progress)))
