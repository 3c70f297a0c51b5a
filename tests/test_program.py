"""The pieces every task's program shares (pipelines.program, pipelines.loop), tested directly
against diffusers: where a schedule starts and stops (image-to-image's strength, a base's
denoising_end, a refiner's denoising_start), classifier-free guidance with rescale, and the
denoising loop itself (guidance, a cfg_cutoff's unguided tail, traced bounds) on a toy model
beside diffusers' loop with its Euler scheduler."""

from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import EulerDiscreteScheduler as TorchEuler
from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionXLImg2ImgPipeline
from diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl import rescale_noise_cfg

from maxdiff.schedulers import load_scheduler
from pipelines import loop
from pipelines import program as program_lib

CONFIG = {"_class_name": "EulerDiscreteScheduler", "num_train_timesteps": 1000,
          "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
          "timestep_spacing": "leading", "steps_offset": 1}


def _torch_scheduler(steps: int) -> TorchEuler:
    ref = TorchEuler.from_config(CONFIG)
    ref.set_timesteps(steps)
    return ref


@pytest.mark.parametrize("steps", [1, 4, 7, 30])
def test_image_to_images_first_step_is_diffusers(steps):
    for strength in (0.01, 0.2, 0.3, 0.5, 0.75, 0.9999, 1.0):
        holder = types.SimpleNamespace(scheduler=_torch_scheduler(steps))
        timesteps, n = StableDiffusionImg2ImgPipeline.get_timesteps(holder, steps, strength, "cpu")
        assert program_lib.start_step(steps, strength) == steps - n == steps - len(timesteps)


@pytest.mark.parametrize("steps", [5, 20, 40])
def test_a_base_and_its_refiner_split_the_schedule_as_diffusers(steps):
    """The refiner starts where diffusers' SDXL image-to-image starts at ``denoising_start``;
    the base stopped at the same fraction runs every step before it: none lost or run twice."""
    ref = _torch_scheduler(steps)
    timesteps = ref.timesteps.numpy()
    for fraction in (0.1, 0.5, 0.7, 0.8, 0.85, 0.95):
        holder = types.SimpleNamespace(scheduler=_torch_scheduler(steps))
        tail, n = StableDiffusionXLImg2ImgPipeline.get_timesteps(holder, steps, 1.0, "cpu",
                                                                 denoising_start=fraction)
        start = program_lib.start_step_at(timesteps, 1000, fraction)
        assert start == len(timesteps) - n == len(timesteps) - len(tail)
        assert program_lib.end_step(timesteps, 1000, fraction) == start


def test_guidance_with_rescale_is_diffusers():
    rng = np.random.default_rng(0)
    uncond, text = (rng.standard_normal((3, 4, 5, 2)).astype(np.float32) for _ in range(2))
    g = np.array([1.5, 5.0, 9.0], np.float32)[:, None, None, None]
    r = np.array([0.0, 0.7, 1.0], np.float32)[:, None, None, None]
    ours = np.asarray(program_lib.guide_pair(jnp.asarray(uncond), jnp.asarray(text), g, r))
    for k in range(3):
        u, t = torch.from_numpy(uncond[k:k + 1]), torch.from_numpy(text[k:k + 1])
        theirs = u + float(g[k, 0, 0, 0]) * (t - u)
        if r[k] > 0:
            theirs = rescale_noise_cfg(theirs, t, float(r[k, 0, 0, 0]))
        np.testing.assert_allclose(ours[k:k + 1], theirs.numpy(), rtol=1e-5, atol=1e-5)
    rows = program_lib.cfg_rows(jnp.asarray(uncond), jnp.asarray(text))  # one device: [u; t]
    np.testing.assert_array_equal(np.asarray(rows), np.concatenate([uncond, text]))
    halves = program_lib.cfg_halves(rows)
    np.testing.assert_array_equal(np.asarray(program_lib.conditional_half({"a": rows})["a"]),
                                  np.asarray(halves[1]))
    np.testing.assert_allclose(np.asarray(program_lib.guide(rows, True, g, r)), ours, rtol=1e-6)


def _toy(xin, t, i):
    """A denoiser whose unconditional and conditional rows differ: [uncond; cond] rows for a
    guided call (twice the images), the conditional rows alone otherwise."""
    n = xin.shape[0]
    w = jnp.where(jnp.arange(n) < n // 2, 0.9, 1.1) if n == 2 * IMAGES else jnp.full(n, 1.1)
    return jnp.sin(xin) * w[:, None, None, None] + 0.01 * t / 1000


IMAGES = 2


def _torch_loop(x0, steps, g, r, cutoff):
    """diffusers' loop (SDXL's __call__: scale, guide, rescale, step) with the same toy."""
    ref = _torch_scheduler(steps)
    x = torch.from_numpy(x0) * ref.init_noise_sigma
    guided_steps = steps if cutoff is None else math.floor(cutoff * steps)
    for k, t in enumerate(ref.timesteps):
        xin = ref.scale_model_input(x, t)
        text = torch.sin(xin) * 1.1 + 0.01 * t / 1000
        if k < guided_steps:
            uncond = torch.sin(xin) * 0.9 + 0.01 * t / 1000
            out = torch.cat([rescale_noise_cfg(uncond[j:j + 1] + g[j] * (text[j:j + 1] -
                                                                        uncond[j:j + 1]),
                                               text[j:j + 1], r[j]) if r[j] > 0 else
                             uncond[j:j + 1] + g[j] * (text[j:j + 1] - uncond[j:j + 1])
                             for j in range(IMAGES)])
        else:
            out = text
        x = ref.step(out, t, x).prev_sample
    return x.numpy()


@pytest.mark.parametrize("cutoff", [None, 0.5])
def test_the_loop_is_diffusers_loop_on_a_toy_model(cutoff):
    steps = 6
    x0 = np.random.default_rng(1).standard_normal((IMAGES, 4, 4, 3)).astype(np.float32)
    g, r = [3.0, 7.5], [0.0, 0.7]
    ours = load_scheduler(CONFIG)
    state = ours.set_timesteps(steps, x0.shape)
    x = jnp.asarray(x0) * ours.init_noise_sigma(state)
    got = loop.denoise(ours, _toy, x, state, 0, steps, cfg=True,
                       g=jnp.asarray(g, jnp.float32), r=jnp.asarray(r, jnp.float32),
                       step_keys=None, shape=x0.shape[1:], cfg_cutoff=cutoff, model_nocfg=_toy)
    np.testing.assert_allclose(np.asarray(got), _torch_loop(x0, steps, g, r, cutoff),
                               rtol=1e-4, atol=1e-4)


def test_traced_bounds_run_the_steps_python_bounds_run():
    """An edit's start step and a base's end are traced (one program for every value): the
    fori_loop they take equals the scan of the same Python bounds, the cutoff's end too."""
    steps = 8
    x0 = np.random.default_rng(2).standard_normal((IMAGES, 4, 4, 3)).astype(np.float32)
    ours = load_scheduler(CONFIG)
    state = ours.set_timesteps(steps, x0.shape)
    kw = dict(cfg=True, g=jnp.full(IMAGES, 4.0), r=jnp.zeros(IMAGES), step_keys=None,
              shape=x0.shape[1:], model_nocfg=_toy)

    def run(start, end, cutoff):
        return loop.denoise(ours, _toy, jnp.asarray(x0), state, start, end, cfg_cutoff=cutoff,
                            **kw)

    traced = jax.jit(run)
    for start, end, cutoff in ((2, 8, 0.5), (0, 5, 0.3), (3, 7, 1.0)):
        np.testing.assert_allclose(np.asarray(traced(start, end, cutoff)),
                                   np.asarray(run(start, end, cutoff)), rtol=1e-6, atol=1e-6)
    for n in range(0, 41):
        for cutoff in (0.1, 0.25, 1 / 3, 0.5, 0.7, 0.9, 1.0):
            assert int(loop.guided_end(jnp.int32(3), jnp.int32(3 + n), jnp.float32(cutoff))) \
                == loop.guided_end(3, 3 + n, cutoff)
