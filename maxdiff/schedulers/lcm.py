"""LCM sampler: multistep consistency sampling of Luo et al., "Latent Consistency Models"
(2023), Algorithm 1 (after Song et al., "Consistency Models", 2023, Algorithm 1).

At each step the consistency function ``f(x, t) = c_skip(t) * x + c_out(t) * x0(x, t)`` gives a
denoised sample; every step but the last re-noises it to the next timestep with fresh Gaussian
noise. Timesteps are a subset of the ``original_inference_steps`` skipping schedule the model
was distilled on. Matches diffusers' ``LCMScheduler`` (``strength`` 1).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from maxdiff.schedulers.common import (
    AlphaState,
    TrainSchedule,
    UnscaledInput,
    at,
    check_choice,
    check_num_inference_steps,
    x0_and_eps,
)
from maxdiff.schedulers.ddim import vp_add_noise
from maxdiff.schedulers.euler_ancestral import step_noise

SIGMA_DATA = 0.5  # the data standard deviation of the consistency-model boundary condition


@dataclasses.dataclass(frozen=True)
class LCMScheduler(UnscaledInput, TrainSchedule):
    """LCM multistep sampler. Fields are diffusers' constructor arguments of ``LCMScheduler`` with
    its defaults (the Stable Diffusion schedule). Dynamic thresholding is not implemented;
    ``timestep_spacing``, ``steps_offset`` and ``set_alpha_to_one`` do not affect LCM's maths
    (diffusers ignores them too) and are accepted with any value."""

    stochastic: ClassVar[bool] = True

    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"
    original_inference_steps: int = 50
    clip_sample: bool = False
    clip_sample_range: float = 1.0
    timestep_scaling: float = 10.0

    INERT: ClassVar = {
        "thresholding": (False,),
        "dynamic_thresholding_ratio": None,
        "sample_max_value": None,
        "timestep_spacing": None,
        "steps_offset": None,
        "set_alpha_to_one": None,
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        check_choice(name, "clip_sample", self.clip_sample, (False, True))
        if not isinstance(self.original_inference_steps, int) or \
                not 1 <= self.original_inference_steps <= self.num_train_timesteps:
            raise ValueError(f"{name}: `original_inference_steps` must be an int in [1, num_train_timesteps="
                             f"{self.num_train_timesteps}], got {self.original_inference_steps!r}")

    def set_timesteps(self, num_inference_steps: int,
                      sample_shape: tuple[int, ...] | None = None) -> AlphaState:
        """Schedule for ``num_inference_steps`` steps (at most ``original_inference_steps``);
        ``sample_shape`` is unused."""
        name = type(self).__name__
        n = check_num_inference_steps(name, num_inference_steps, self.num_train_timesteps)
        original = self.original_inference_steps
        if n > original:
            raise ValueError(f"{name}: `num_inference_steps` must be at most `original_inference_steps`="
                             f"{original}, got {n}")
        k = self.num_train_timesteps // original
        origin = (np.arange(1, original + 1) * k - 1)[::-1]  # the distillation schedule, descending
        pick = np.floor(np.linspace(0, len(origin), num=n, endpoint=False)).astype(np.int64)
        timesteps = origin[pick]
        alphas_cumprod = self.alphas_cumprod
        # Step i re-noises to timesteps[i + 1]; the last step returns the denoised sample.
        prev = np.concatenate([timesteps[1:], timesteps[-1:]])
        return AlphaState(timesteps=jnp.asarray(timesteps, jnp.int32),
                          alphas_cumprod=jnp.asarray(alphas_cumprod[timesteps]),
                          alphas_cumprod_prev=jnp.asarray(alphas_cumprod[prev]))

    def boundary_scalings(self, timestep: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(c_skip, c_out) of the consistency-model boundary condition at ``timestep``
        (Song et al. 2023, appendix C, with t scaled by ``timestep_scaling``)."""
        scaled = timestep.astype(jnp.float32) * self.timestep_scaling
        c_skip = SIGMA_DATA ** 2 / (scaled ** 2 + SIGMA_DATA ** 2)
        c_out = scaled / jnp.sqrt(scaled ** 2 + SIGMA_DATA ** 2)
        return c_skip, c_out

    def denoised(self, state: AlphaState, model_output: jax.Array, sample: jax.Array,
                 step_index) -> jax.Array:
        """The consistency model's denoised sample at step ``step_index`` (previews)."""
        x0, _ = x0_and_eps(self.prediction_type, model_output, sample,
                           at(state.alphas_cumprod, step_index))
        c_skip, c_out = self.boundary_scalings(at(state.timesteps, step_index))
        return c_out * x0 + c_skip * sample

    def step(self, state: AlphaState, model_output: jax.Array, sample: jax.Array, step_index,
             key: jax.Array | None = None, noise: jax.Array | None = None) -> tuple[AlphaState, jax.Array]:
        """One LCM step. Every step but the last adds noise: pass ``noise`` (standard normal,
        shaped like ``sample``) or a ``key`` (both may be omitted for a 1-step schedule).
        Returns ``(state, prev_sample)``; after the last step ``prev_sample`` is the denoised
        sample."""
        n = state.timesteps.shape[0]
        alpha_prod_t = at(state.alphas_cumprod, step_index)
        alpha_prod_prev = at(state.alphas_cumprod_prev, step_index)
        c_skip, c_out = self.boundary_scalings(at(state.timesteps, step_index))
        x0, _ = x0_and_eps(self.prediction_type, model_output, sample, alpha_prod_t)
        if self.clip_sample:
            x0 = jnp.clip(x0, -self.clip_sample_range, self.clip_sample_range)
        denoised = c_out * x0 + c_skip * sample
        if n == 1:
            return state, denoised.astype(sample.dtype)
        eps = step_noise(sample, key, noise, type(self).__name__)
        renoised = jnp.sqrt(alpha_prod_prev) * denoised + jnp.sqrt(1 - alpha_prod_prev) * eps
        prev = jnp.where(step_index == n - 1, denoised, renoised)
        return state, prev.astype(sample.dtype)

    def add_noise(self, state: AlphaState, original_samples: jax.Array, noise: jax.Array,
                  step_index) -> jax.Array:
        """Noise clean samples to the level of step ``step_index`` (img2img)."""
        return vp_add_noise(state, original_samples, noise, step_index)
