"""Euler sampler: the deterministic Euler method of Karras et al., "Elucidating the Design Space
of Diffusion-Based Generative Models" (2022), Algorithm 2 without churn (s_churn = 0).

The sample is ``x = x0 + sigma * eps``; each step follows the probability-flow ODE
``dx/dsigma = (x - D(x; sigma)) / sigma`` from ``sigmas[i]`` to ``sigmas[i + 1]``. Matches
diffusers' ``EulerDiscreteScheduler`` (the SDXL and SDXL-Lightning default).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from maxdiff.schedulers.common import (
    FINAL_SIGMAS_TYPES,
    TIMESTEP_SPACINGS,
    SigmaState,
    TrainSchedule,
    at,
    check_choice,
    check_num_inference_steps,
    check_steps_offset,
    karras_sigmas,
    sigma_to_t,
    spaced_timesteps,
)


def denoised_from_sigma(prediction_type: str, model_output: jax.Array, sample: jax.Array,
                        sigma: jax.Array) -> jax.Array:
    """The model's estimate of the clean sample x0, for a sample ``x = x0 + sigma * eps``
    (variance exploding) given the UNet output of kind ``prediction_type``."""
    if prediction_type == "epsilon":
        return sample - sigma * model_output
    if prediction_type == "v_prediction":  # Salimans & Ho 2022, in the sigma parameterisation
        return model_output * (-sigma / jnp.sqrt(sigma ** 2 + 1)) + sample / (sigma ** 2 + 1)
    return model_output  # "sample": the model predicts x0 directly


def sigma_schedule(sched: TrainSchedule, spacing: str, num_inference_steps: int,
                   steps_offset: int) -> tuple[np.ndarray, np.ndarray]:
    """Float32 timesteps of ``spacing`` and their sigmas (float64, interpolated linearly in t)."""
    t = sched.num_train_timesteps
    if spacing == "linspace":
        timesteps = np.linspace(0, t - 1, num_inference_steps, dtype=np.float32)[::-1].copy()
    else:
        timesteps = spaced_timesteps(spacing, t, num_inference_steps, steps_offset).astype(np.float32)
    sigmas = np.interp(timesteps, np.arange(t), sched.train_sigmas)
    return timesteps, sigmas


class SigmaInputScaling:
    """The methods the sigma-parameterised samplers (Euler, Euler ancestral) share: initial
    noise scale, the UNet's timestep, and the input scaling back to unit variance."""

    def init_noise_sigma(self, state: SigmaState) -> jax.Array:
        """Standard deviation of the initial latent noise (multiply unit Gaussian noise by it)."""
        sigma = jnp.max(state.sigmas)
        if self.timestep_spacing in ("linspace", "trailing"):
            return sigma
        return jnp.sqrt(sigma ** 2 + 1)

    def timestep_for_model(self, state: SigmaState, step_index) -> jax.Array:
        """The (float32) timestep the UNet receives at step ``step_index``."""
        return at(state.timesteps, step_index)

    def scale_model_input(self, state: SigmaState, sample: jax.Array, step_index) -> jax.Array:
        """UNet input at step ``step_index``: ``sample / sqrt(sigma**2 + 1)`` (back to unit variance)."""
        sigma = at(state.sigmas, step_index)
        return sample / jnp.sqrt(sigma ** 2 + 1)

    def denoised(self, state: SigmaState, model_output: jax.Array, sample: jax.Array,
                 step_index) -> jax.Array:
        """The model's estimate of the clean sample at step ``step_index`` (previews)."""
        return denoised_from_sigma(self.prediction_type, model_output, sample,
                                   at(state.sigmas, step_index))


@dataclasses.dataclass(frozen=True)
class EulerDiscreteScheduler(SigmaInputScaling, TrainSchedule):
    """Euler (Karras et al. 2022, Algorithm 2, no churn). Fields are diffusers' constructor
    arguments of ``EulerDiscreteScheduler`` with its defaults.

    ``use_karras_sigmas`` spaces the noise levels as in Karras et al. eq. 5 (rho = 7) between
    ``sigma_max`` and ``sigma_min`` (default: the first and last levels of the spacing), and gives
    the UNet the matching fractional timestep.
    """

    use_karras_sigmas: bool = False
    sigma_min: float | None = None
    sigma_max: float | None = None
    timestep_spacing: str = "linspace"
    steps_offset: int = 0
    final_sigmas_type: str = "zero"

    INERT: ClassVar = {
        "interpolation_type": ("linear",),
        "use_exponential_sigmas": (False, None),
        "use_beta_sigmas": (False, None),
        "timestep_type": ("discrete",),
    }
    ZERO_SNR_LAST_ALPHA: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.use_karras_sigmas is None:
            object.__setattr__(self, "use_karras_sigmas", False)
        check_choice(name, "use_karras_sigmas", self.use_karras_sigmas, (False, True))
        check_choice(name, "timestep_spacing", self.timestep_spacing, TIMESTEP_SPACINGS)
        check_steps_offset(name, self.steps_offset)
        check_choice(name, "final_sigmas_type", self.final_sigmas_type, FINAL_SIGMAS_TYPES)

    def set_timesteps(self, num_inference_steps: int,
                      sample_shape: tuple[int, ...] | None = None) -> SigmaState:
        """Schedule for ``num_inference_steps`` steps (host-side numpy; returns device arrays).
        ``sample_shape`` is unused (kept for a uniform signature)."""
        n = check_num_inference_steps(type(self).__name__, num_inference_steps, self.num_train_timesteps)
        timesteps, sigmas = sigma_schedule(self, self.timestep_spacing, n, self.steps_offset)
        if self.use_karras_sigmas:
            lo = self.sigma_min if self.sigma_min is not None else float(sigmas[-1])
            hi = self.sigma_max if self.sigma_max is not None else float(sigmas[0])
            sigmas = karras_sigmas(lo, hi, n)
            timesteps = sigma_to_t(sigmas, np.log(self.train_sigmas))
        if self.final_sigmas_type == "sigma_min":
            final = self.train_sigmas[0]
        else:
            final = 0.0
        sigmas = np.concatenate([sigmas, [final]]).astype(np.float32)
        return SigmaState(timesteps=jnp.asarray(timesteps, jnp.float32), sigmas=jnp.asarray(sigmas))

    def step(self, state: SigmaState, model_output: jax.Array, sample: jax.Array, step_index,
             key: jax.Array | None = None, noise: jax.Array | None = None) -> tuple[SigmaState, jax.Array]:
        """One Euler step from ``sigmas[i]`` to ``sigmas[i + 1]``. Deterministic: ``key`` and
        ``noise`` are ignored. Computes in float32, returns ``(state, prev_sample)`` with
        ``prev_sample`` in ``sample.dtype``."""
        x = sample.astype(jnp.float32)
        sigma, sigma_next = at(state.sigmas, step_index), at(state.sigmas, step_index + 1)
        denoised = denoised_from_sigma(self.prediction_type, model_output, x, sigma)
        derivative = (x - denoised) / sigma
        prev = x + derivative * (sigma_next - sigma)
        return state, prev.astype(sample.dtype)

    def add_noise(self, state: SigmaState, original_samples: jax.Array, noise: jax.Array,
                  step_index) -> jax.Array:
        """Noise clean samples to the level of step ``step_index``: ``x0 + sigma * noise``
        (the img2img starting point)."""
        return original_samples + noise * at(state.sigmas, step_index)
