"""The denoising loop every task runs (:func:`denoise`): scheduler steps over a range of the
schedule, classifier-free guidance, step noise, a task's after-step hook, and feature caching
(a ``cfg_cutoff``'s unguided tail; DeepCache's full and shallow UNet calls).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pipelines import program as program_lib
from pipelines.limits import guided_steps

__all__ = ["denoise", "guided_end"]


def denoise(sched, model, x, state, start, end, *, cfg: bool, g, r, step_keys, shape,
            extra=None, after_step=None, on_denoised=None, cfg_cutoff: float | None = None,
            model_nocfg=None, deepcache=None):
    """Scheduler steps ``start`` .. ``end - 1`` (model calls) on latents ``x`` (B, h, w, C):
    scale the input, append ``extra`` channels (a 9-channel inpainting UNet's mask and masked
    image), double the batch for CFG, ``model(xin, t, i)`` (the UNet, with whatever it needs
    at step ``i``), :func:`guide` with each image's guidance ``g`` and rescale ``r`` (B,),
    step noise from ``step_keys`` for stochastic samplers, the scheduler step, then
    ``after_step(i, state, x) -> x`` (inpainting's blend); ``on_denoised(i, state, x0)`` sees
    each step's estimate of the clean latents (previews). Returns the latents.

    Feature caching: with ``cfg`` and ``cfg_cutoff``, only the first
    :func:`pipelines.limits.guided_steps` of the loop's steps run CFG; the rest call
    ``model_nocfg`` (the same denoiser on the conditional rows alone) and take its prediction
    as it is. ``deepcache`` N (None: off): the model runs in full on every N-th step of the
    loop (from ``start``) and keeps its deep features; the steps between run its shallow
    branch on them (``model(..., deep_cache=, return_deep_cache=True)``,
    :class:`maxdiff.models.unet.UNet2DConditionModel`). Both values may be traced (one
    program serves every cutoff and every interval).

    Python int bounds run a ``lax.scan`` over ``arange(start, end)``; traced bounds (an edit's
    start step, a base's ``denoising_end``, a refiner's ``denoising_start``) a
    ``lax.fori_loop``, so one program serves every start and end. The scheduler state starts
    from ``state`` (a fresh one at a later ``start`` takes first-order steps first, as
    diffusers' ``set_begin_index`` leaves it).

    """
    stochastic = sched.stochastic
    g, r = g[:, None, None, None], r[:, None, None, None]

    def make_step(model, guided: bool):
        def call(xin, t, i, cache):
            if deepcache is None:
                return model(xin, t, i), cache
            return jax.lax.cond(
                (i - start) % deepcache == 0,
                lambda c: model(xin, t, i, return_deep_cache=True),
                lambda c: model(xin, t, i, deep_cache=c, return_deep_cache=True), cache)

        def step(i, x, state, cache):
            xin = sched.scale_model_input(state, x, i)
            if extra is not None:
                xin = jnp.concatenate([xin, extra], axis=-1)
            t = sched.timestep_for_model(state, i)
            if guided:
                xin = program_lib.cfg_rows(xin, xin)
            out, cache = call(xin, t, i, cache)
            out = program_lib.guide(out.astype(jnp.float32), guided, g, r)
            if on_denoised is not None:
                on_denoised(i, state, sched.denoised(state, out, x, i))
            noise = None
            if stochastic:
                noise = program_lib.step_noise(step_keys, i, shape)
            state, x = sched.step(state, out, x, i, noise=noise)
            if after_step is not None:
                x = after_step(i, state, x)
            return x, state, cache
        return step

    def loop(step, lo, hi, carry):
        if all(isinstance(v, int) for v in (lo, hi)):
            if hi <= lo:
                return carry

            def scan_body(c, i):
                return step(i, *c), None

            c, _ = jax.lax.scan(scan_body, carry, jnp.arange(lo, hi, dtype=jnp.int32))
            return c
        return jax.lax.fori_loop(lo, hi, lambda i, c: step(i, *c), carry)

    def empty_cache(guided: bool):
        """Zeros shaped like the deep features of a model call (the first step fills them)."""
        if deepcache is None:
            return None
        channels = x.shape[-1] + (0 if extra is None else extra.shape[-1])
        xin = jax.ShapeDtypeStruct(x.shape[:-1] + (channels,), x.dtype)
        if guided:
            xin = jax.eval_shape(lambda a: program_lib.cfg_rows(a, a), xin)
        t = jax.eval_shape(lambda: sched.timestep_for_model(state, start))
        feats = jax.eval_shape(lambda a, b: model(a, b, start, return_deep_cache=True)[1], xin, t)
        return jnp.zeros(feats.shape, feats.dtype)

    guided_step = make_step(model, cfg)
    if not cfg or cfg_cutoff is None:
        x, _, _ = loop(guided_step, start, end, (x, state, empty_cache(cfg)))
        return x
    cut = guided_end(start, end, cfg_cutoff)
    x, state, cache = loop(guided_step, start, cut, (x, state, empty_cache(True)))
    if cache is not None:  # the conditional rows' deep features go on
        cache = program_lib.cfg_halves(cache)[1]
    plain_step = make_step(model_nocfg, False)
    x, _, _ = loop(plain_step, cut, end, (x, state, cache))
    return x


def guided_end(start, end, cutoff):
    """The step the loop stops guiding at: ``start`` + :func:`pipelines.limits.guided_steps` of
    its length, in float32 with the same margin where the bounds or the cutoff are traced."""
    if isinstance(start, int) and isinstance(end, int) and isinstance(cutoff, float):
        return start + guided_steps(end - start, cutoff)
    n = jnp.asarray(end, jnp.int32) - jnp.asarray(start, jnp.int32)
    k = jnp.floor(jnp.asarray(cutoff, jnp.float32) * n.astype(jnp.float32) + jnp.float32(1e-4))
    return jnp.asarray(start, jnp.int32) + jnp.clip(k.astype(jnp.int32), 0, n)
