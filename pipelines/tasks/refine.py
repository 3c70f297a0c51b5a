"""Base + refiner, diffusers' "ensemble of experts": the base denoises the schedule up to the
cut (``denoising_end``), the refiner its own schedule from there (``denoising_start``, the same
fraction) on the base's latents as they are, in one program; the refiner's VAE decodes. Without
a refiner: a base stopped at the cut (its latents for a refiner's ``image=``).

Scalars: ``end`` (the base's model calls), and with a refiner ``start`` (its first model call)
and ``state`` (its scheduler state: a fresh one, so DPM++ 2M's first refiner step is first
order, as diffusers' ``set_begin_index`` leaves it). Rows: ``latents`` and the refiner's own
:class:`pipelines.program.HostInputs` (``refiner``: its tokenizer, time ids). Weights: the
refiner's. The cut is traced: a new ``denoising_end`` never recompiles. Feature caching
(``cfg_cutoff``, ``deepcache_interval``) applies to each stage's own steps.
"""

from __future__ import annotations

from pipelines import program as program_lib
from pipelines.runner import Ctx, Task

__all__ = ["Refine"]


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
