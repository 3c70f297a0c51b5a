"""Euler ancestral sampler: k-diffusion's ``sample_euler_ancestral``.

Each step takes an Euler step of the probability-flow ODE down to ``sigma_down`` and adds fresh
Gaussian noise of standard deviation ``sigma_up``, with ``sigma_down**2 + sigma_up**2 =
sigma_next**2`` (the ancestral DDPM step of Ho et al. 2020 in the sigma parameterisation of
Karras et al. 2022, eta = 1). Matches diffusers' ``EulerAncestralDiscreteScheduler``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from maxdiff.schedulers.common import (
    TIMESTEP_SPACINGS,
    SigmaState,
    TrainSchedule,
    at,
    check_choice,
    check_num_inference_steps,
    check_steps_offset,
)
from maxdiff.schedulers.euler import SigmaInputScaling, denoised_from_sigma, sigma_schedule


def step_noise(sample: jax.Array, key: jax.Array | None, noise: jax.Array | None, owner: str) -> jax.Array:
    """The standard normal noise of one stochastic step: ``noise`` if given, else drawn from
    ``key`` with the shape of ``sample`` (float32)."""
    if noise is not None:
        return noise
    if key is None:
        raise ValueError(f"{owner}.step adds noise: pass `key` (a jax.random key) or `noise` "
                         "(standard normal, shaped like the sample)")
    return jax.random.normal(key, sample.shape, jnp.float32)


@dataclasses.dataclass(frozen=True)
class EulerAncestralDiscreteScheduler(SigmaInputScaling, TrainSchedule):
    """Euler ancestral (k-diffusion ``sample_euler_ancestral``, eta = 1). Fields are diffusers'
    constructor arguments of ``EulerAncestralDiscreteScheduler`` with its defaults; diffusers
    does not implement ``prediction_type="sample"`` here, so neither do we."""

    stochastic: ClassVar[bool] = True

    timestep_spacing: str = "linspace"
    steps_offset: int = 0

    PREDICTION_TYPES: ClassVar = ("epsilon", "v_prediction")
    ZERO_SNR_LAST_ALPHA: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(type(self).__name__, "timestep_spacing", self.timestep_spacing, TIMESTEP_SPACINGS)
        check_steps_offset(type(self).__name__, self.steps_offset)

    def set_timesteps(self, num_inference_steps: int,
                      sample_shape: tuple[int, ...] | None = None) -> SigmaState:
        """Schedule for ``num_inference_steps`` steps; ``sample_shape`` is unused."""
        n = check_num_inference_steps(type(self).__name__, num_inference_steps, self.num_train_timesteps)
        timesteps, sigmas = sigma_schedule(self, self.timestep_spacing, n, self.steps_offset)
        sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)
        return SigmaState(timesteps=jnp.asarray(timesteps, jnp.float32), sigmas=jnp.asarray(sigmas))

    def step(self, state: SigmaState, model_output: jax.Array, sample: jax.Array, step_index,
             key: jax.Array | None = None, noise: jax.Array | None = None) -> tuple[SigmaState, jax.Array]:
        """One ancestral step. Needs ``noise`` (standard normal, shaped like ``sample``) or a
        ``key`` to draw it from; pass ``noise`` built from per-image keys to keep each image
        independent of its batch. Returns ``(state, prev_sample)`` in ``sample.dtype``."""
        eps = step_noise(sample, key, noise, type(self).__name__)
        x = sample.astype(jnp.float32)
        sigma, sigma_next = at(state.sigmas, step_index), at(state.sigmas, step_index + 1)
        denoised = denoised_from_sigma(self.prediction_type, model_output, x, sigma)
        sigma_up = jnp.sqrt(sigma_next ** 2 * (sigma ** 2 - sigma_next ** 2) / sigma ** 2)
        sigma_down = jnp.sqrt(sigma_next ** 2 - sigma_up ** 2)
        derivative = (x - denoised) / sigma
        prev = x + derivative * (sigma_down - sigma)
        prev = prev + eps * sigma_up
        return state, prev.astype(sample.dtype)

    def add_noise(self, state: SigmaState, original_samples: jax.Array, noise: jax.Array,
                  step_index) -> jax.Array:
        """Noise clean samples to the level of step ``step_index``: ``x0 + sigma * noise``."""
        return original_samples + noise * at(state.sigmas, step_index)
