"""DDIM sampler: Song et al., "Denoising Diffusion Implicit Models" (2021), eq. 12 with eta = 0
(the deterministic sampler). Matches diffusers' ``DDIMScheduler.step(..., eta=0)``.

From the model output it forms x0 and eps at alpha-bar_t, optionally clips x0, and moves to
alpha-bar_prev: ``x_prev = sqrt(ab_prev) * x0 + sqrt(1 - ab_prev) * eps``. As in diffusers, the
level it moves to is always ``t - num_train_timesteps // num_inference_steps`` (alpha-bar 1 or
alpha-bar_0 below zero, see ``set_alpha_to_one``), whatever the spacing.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from maxdiff.schedulers.common import (
    TIMESTEP_SPACINGS,
    AlphaState,
    TrainSchedule,
    UnscaledInput,
    at,
    check_choice,
    check_num_inference_steps,
    check_steps_offset,
    check_timesteps_in_range,
    spaced_timesteps,
    x0_and_eps,
)


def vp_add_noise(state: AlphaState, original_samples: jax.Array, noise: jax.Array, step_index) -> jax.Array:
    """Noise clean samples to step ``step_index``: ``sqrt(ab) * x0 + sqrt(1 - ab) * noise``."""
    alpha_prod = at(state.alphas_cumprod, step_index)
    return jnp.sqrt(alpha_prod) * original_samples + jnp.sqrt(1 - alpha_prod) * noise


@dataclasses.dataclass(frozen=True)
class DDIMScheduler(UnscaledInput, TrainSchedule):
    """DDIM, eta = 0. Fields are diffusers' constructor arguments of ``DDIMScheduler`` with its
    defaults (note ``clip_sample=True`` by default, as there). Dynamic thresholding is not
    implemented (``thresholding`` must be false)."""

    clip_sample: bool = True
    clip_sample_range: float = 1.0
    set_alpha_to_one: bool = True
    steps_offset: int = 0
    timestep_spacing: str = "leading"

    INERT: ClassVar = {
        "thresholding": (False,),
        "dynamic_thresholding_ratio": None,
        "sample_max_value": None,
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        check_choice(name, "timestep_spacing", self.timestep_spacing, TIMESTEP_SPACINGS)
        check_steps_offset(name, self.steps_offset)
        check_choice(name, "clip_sample", self.clip_sample, (False, True))
        check_choice(name, "set_alpha_to_one", self.set_alpha_to_one, (False, True))

    def set_timesteps(self, num_inference_steps: int,
                      sample_shape: tuple[int, ...] | None = None) -> AlphaState:
        """Schedule for ``num_inference_steps`` steps; ``sample_shape`` is unused."""
        name = type(self).__name__
        t = self.num_train_timesteps
        n = check_num_inference_steps(name, num_inference_steps, t)
        if self.timestep_spacing == "linspace":
            timesteps = np.linspace(0, t - 1, n).round()[::-1]
        else:
            timesteps = spaced_timesteps(self.timestep_spacing, t, n, self.steps_offset)
        timesteps = timesteps.astype(np.int64)
        check_timesteps_in_range(name, timesteps, t)
        alphas_cumprod = self.alphas_cumprod
        final = np.float32(1.0) if self.set_alpha_to_one else alphas_cumprod[0]
        prev = timesteps - t // n
        alphas_prev = np.where(prev >= 0, alphas_cumprod[np.maximum(prev, 0)], final)
        return AlphaState(timesteps=jnp.asarray(timesteps, jnp.int32),
                          alphas_cumprod=jnp.asarray(alphas_cumprod[timesteps], jnp.float32),
                          alphas_cumprod_prev=jnp.asarray(alphas_prev, jnp.float32))

    def step(self, state: AlphaState, model_output: jax.Array, sample: jax.Array, step_index,
             key: jax.Array | None = None, noise: jax.Array | None = None) -> tuple[AlphaState, jax.Array]:
        """One deterministic DDIM step (eta = 0; ``key`` and ``noise`` are ignored).
        Returns ``(state, prev_sample)`` in ``sample.dtype``."""
        alpha_prod_t = at(state.alphas_cumprod, step_index)
        alpha_prod_prev = at(state.alphas_cumprod_prev, step_index)
        x0, eps = x0_and_eps(self.prediction_type, model_output, sample, alpha_prod_t)
        if self.clip_sample:
            x0 = jnp.clip(x0, -self.clip_sample_range, self.clip_sample_range)
        prev = jnp.sqrt(alpha_prod_prev) * x0 + jnp.sqrt(1 - alpha_prod_prev) * eps
        return state, prev.astype(sample.dtype)

    def add_noise(self, state: AlphaState, original_samples: jax.Array, noise: jax.Array,
                  step_index) -> jax.Array:
        """Noise clean samples to the level of step ``step_index`` (img2img)."""
        return vp_add_noise(state, original_samples, noise, step_index)
