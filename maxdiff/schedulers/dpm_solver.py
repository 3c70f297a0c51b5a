"""DPM-Solver++(2M): Lu et al., "DPM-Solver++: Fast Solver for Guided Sampling of Diffusion
Probabilistic Models" (2022), Algorithm 2 (multistep second order, data prediction).

With ``use_karras_sigmas`` this is the "DPM++ 2M Karras" sampler. The solver works in
``lambda = log(alpha / sigma)`` (half the log-SNR) of the variance-preserving process; each step
uses the current data prediction x0 and, from the second step on, the previous one (kept in the
state). The first step, and the last step under ``lower_order_final`` / ``euler_at_final`` /
``final_sigmas_type="zero"``, are first order (DDIM). Matches diffusers'
``DPMSolverMultistepScheduler`` with ``algorithm_type="dpmsolver++"`` and ``solver_order`` 1 or 2.

``algorithm_type="sde-dpmsolver++"`` is "DPM++ 2M SDE" (Lu et al. 2022, appendix: the SDE
variant of DPM-Solver++): the same multistep data-prediction update of the variance-preserving
SDE rather than the ODE, which keeps ``exp(-2h)`` of the noise, refills the rest with fresh
Gaussian noise each step (``noise=``), and weights x0 by ``1 - exp(-2h)``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from maxdiff.schedulers.common import (
    FINAL_SIGMAS_TYPES,
    TIMESTEP_SPACINGS,
    TrainSchedule,
    UnscaledInput,
    at,
    check_choice,
    check_num_inference_steps,
    check_steps_offset,
    check_timesteps_in_range,
    karras_sigmas,
    sigma_to_t,
)
from maxdiff.schedulers.euler_ancestral import step_noise

# diffusers' DPMSolverMultistepScheduler: ``lower_order_final`` applies to runs of fewer steps
LOWER_ORDER_FINAL_BELOW = 15


@struct.dataclass
class DPMSolverState:
    """Schedule and memory of DPM-Solver++(2M).

    Attributes:
      timesteps: (n,) int32, the timestep the UNet receives at step ``i``.
      sigmas: (n + 1,) float32, ``sqrt((1 - ab) / ab)`` of the sample entering step ``i``.
      prev_x0: float32, shaped like the sample: the data prediction of the previous step.
      lower_order_nums: int32 scalar, steps taken so far (capped at ``solver_order``).
    """

    timesteps: jax.Array
    sigmas: jax.Array
    prev_x0: jax.Array
    lower_order_nums: jax.Array


def multistep_timesteps(spacing: str, last: int, num_train_timesteps: int, n: int,
                        steps_offset: int) -> np.ndarray:
    """The ``n`` integer timesteps (int64, descending) of the multistep samplers (DPM-Solver,
    UniPC): ``n + 1`` points over ``[0, last)`` without the lowest for ``linspace`` and
    ``leading``, as diffusers spaces them; ``trailing`` counts down from ``last`` by
    ``num_train_timesteps / n``. ``last`` is ``num_train_timesteps`` unless timesteps with a
    too-low lambda are dropped (``lambda_min_clipped``)."""
    if spacing == "linspace":
        timesteps = np.linspace(0, last - 1, n + 1).round()[::-1][:-1]
    elif spacing == "leading":
        timesteps = (np.arange(0, n + 1) * (last // (n + 1))).round()[::-1][:-1] + steps_offset
    else:
        timesteps = np.arange(last, 0, -num_train_timesteps / n).round() - 1
    return timesteps.astype(np.int64)


def vp_alpha_sigma(sigma: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(alpha_t, sigma_t) of the variance-preserving process with ``sigma_t / alpha_t = sigma``."""
    alpha_t = 1 / jnp.sqrt(sigma ** 2 + 1)
    return alpha_t, sigma * alpha_t


@dataclasses.dataclass(frozen=True)
class DPMSolverMultistepScheduler(UnscaledInput, TrainSchedule):
    """DPM-Solver++(2M) (Lu et al. 2022, Algorithm 2). Fields are diffusers' constructor arguments
    of ``DPMSolverMultistepScheduler`` with its defaults; only ``algorithm_type``
    ``"dpmsolver++"`` and ``"sde-dpmsolver++"`` (stochastic: pass ``noise=``), ``solver_order`` 1
    or 2, no thresholding and no learned variance are implemented.

    ``lambda_min_clipped`` drops the timesteps whose lambda is below it (used with the cosine
    schedule); ``use_karras_sigmas`` spaces the noise levels as in Karras et al. 2022, eq. 5.
    """

    algorithm_type: str = "dpmsolver++"
    solver_order: int = 2
    solver_type: str = "midpoint"
    lower_order_final: bool = True
    euler_at_final: bool = False
    use_karras_sigmas: bool = False
    final_sigmas_type: str = "zero"
    lambda_min_clipped: float = -float("inf")
    timestep_spacing: str = "linspace"
    steps_offset: int = 0

    INERT: ClassVar = {
        "thresholding": (False,),
        "dynamic_thresholding_ratio": None,
        "sample_max_value": None,
        "variance_type": (None,),
        "use_exponential_sigmas": (False, None),
        "use_beta_sigmas": (False, None),
        "use_lu_lambdas": (False, None),
        "use_flow_sigmas": (False, None),
        "flow_shift": None,
        "use_dynamic_shifting": (False,),
        "time_shift_type": None,
    }
    ZERO_SNR_LAST_ALPHA: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.use_karras_sigmas is None:
            object.__setattr__(self, "use_karras_sigmas", False)
        check_choice(name, "algorithm_type", self.algorithm_type, ("dpmsolver++", "sde-dpmsolver++"))
        check_choice(name, "solver_order", self.solver_order, (1, 2))
        check_choice(name, "solver_type", self.solver_type, ("midpoint", "heun"))
        check_choice(name, "lower_order_final", self.lower_order_final, (False, True))
        check_choice(name, "euler_at_final", self.euler_at_final, (False, True))
        check_choice(name, "use_karras_sigmas", self.use_karras_sigmas, (False, True))
        check_choice(name, "final_sigmas_type", self.final_sigmas_type, FINAL_SIGMAS_TYPES)
        check_choice(name, "timestep_spacing", self.timestep_spacing, TIMESTEP_SPACINGS)
        check_steps_offset(name, self.steps_offset)

    @property
    def stochastic(self) -> bool:
        """DPM++ 2M SDE adds fresh noise every step (``step(..., noise=)``)."""
        return self.algorithm_type == "sde-dpmsolver++"

    def _last_timestep(self) -> int:
        """One past the last timestep whose lambda is at least ``lambda_min_clipped``."""
        alphas_cumprod = self.alphas_cumprod
        lambdas = np.log(np.sqrt(alphas_cumprod)) - np.log(np.sqrt(np.float32(1.0) - alphas_cumprod))
        clipped = np.searchsorted(lambdas[::-1], np.float32(self.lambda_min_clipped), side="left")
        return self.num_train_timesteps - int(clipped)

    def set_timesteps(self, num_inference_steps: int,
                      sample_shape: tuple[int, ...] | None = None) -> DPMSolverState:
        """Schedule for ``num_inference_steps`` steps. ``sample_shape`` (the latent shape, e.g.
        (batch, 128, 128, 4)) is required: it sizes the x0 memory carried through the loop."""
        name = type(self).__name__
        if sample_shape is None:
            raise ValueError(f"{name}.set_timesteps needs `sample_shape` (the latent shape) to allocate the "
                             "model-output history it carries from step to step")
        t = self.num_train_timesteps
        n = check_num_inference_steps(name, num_inference_steps, t)
        timesteps = multistep_timesteps(self.timestep_spacing, self._last_timestep(), t, n,
                                        self.steps_offset)
        train_sigmas = self.train_sigmas
        if self.use_karras_sigmas:
            sigmas = karras_sigmas(float(train_sigmas[0]), float(train_sigmas[-1]), n)
            timesteps = sigma_to_t(sigmas, np.log(train_sigmas))
            if self.beta_schedule != "squaredcos_cap_v2":
                timesteps = timesteps.round()
            timesteps = timesteps.astype(np.int64)
        else:
            sigmas = np.interp(timesteps, np.arange(t), train_sigmas)
        check_timesteps_in_range(name, timesteps, t)
        final = train_sigmas[0] if self.final_sigmas_type == "sigma_min" else 0.0
        sigmas = np.concatenate([sigmas, [final]]).astype(np.float32)
        return DPMSolverState(timesteps=jnp.asarray(timesteps, jnp.int32), sigmas=jnp.asarray(sigmas),
                              prev_x0=jnp.zeros(sample_shape, jnp.float32),
                              lower_order_nums=jnp.zeros((), jnp.int32))

    def denoised(self, state: DPMSolverState, model_output: jax.Array, sample: jax.Array,
                 step_index) -> jax.Array:
        """The data prediction at step ``step_index`` (previews)."""
        return self.data_prediction(model_output, sample, at(state.sigmas, step_index))

    def step_variants(self) -> tuple | None:
        """With ``lower_order_final`` the last step of a run of fewer than
        :data:`LOWER_ORDER_FINAL_BELOW` steps is first order: a static choice from the table
        length. Two variants that do not read it (last step first order; second order), for
        runs of different lengths in one program (:meth:`step_variant` picks), or None when
        the choice is the same for every length."""
        if (self.solver_order == 2 and self.lower_order_final and not self.euler_at_final
                and self.final_sigmas_type != "zero"):
            return (dataclasses.replace(self, euler_at_final=True),
                    dataclasses.replace(self, lower_order_final=False))
        return None

    def step_variant(self, num_inference_steps: int) -> int:
        """Which of :meth:`step_variants` a run of ``num_inference_steps`` takes."""
        return 0 if num_inference_steps < LOWER_ORDER_FINAL_BELOW else 1

    def data_prediction(self, model_output: jax.Array, sample: jax.Array, sigma: jax.Array) -> jax.Array:
        """x0 from the UNet output at noise level ``sigma``."""
        if self.prediction_type == "sample":
            return model_output
        alpha_t, sigma_t = vp_alpha_sigma(sigma)
        if self.prediction_type == "epsilon":
            return (sample - sigma_t * model_output) / alpha_t
        return alpha_t * sample - sigma_t * model_output  # v_prediction

    def step(self, state: DPMSolverState, model_output: jax.Array, sample: jax.Array, step_index,
             key: jax.Array | None = None,
             noise: jax.Array | None = None) -> tuple[DPMSolverState, jax.Array]:
        """One DPM-Solver++ step from ``sigmas[i]`` to ``sigmas[i + 1]``. Deterministic (``key``
        and ``noise`` ignored) but for ``sde-dpmsolver++``, which needs ``noise`` (standard
        normal, shaped like ``sample``) or a ``key`` to draw it from. Returns the updated state
        (x0 memory) and the sample in ``sample.dtype``."""
        n = state.timesteps.shape[0]
        i = jnp.asarray(step_index, jnp.int32)
        sigma_s0, sigma_t = at(state.sigmas, i), at(state.sigmas, i + 1)
        sigma_s1 = at(state.sigmas, jnp.maximum(i - 1, 0))
        x0 = self.data_prediction(model_output, sample, sigma_s0).astype(jnp.float32)
        x = sample.astype(jnp.float32)

        alpha_t, sig_t = vp_alpha_sigma(sigma_t)
        alpha_s0, sig_s0 = vp_alpha_sigma(sigma_s0)
        alpha_s1, sig_s1 = vp_alpha_sigma(sigma_s1)
        lambda_t = jnp.log(alpha_t) - jnp.log(sig_t)
        lambda_s0 = jnp.log(alpha_s0) - jnp.log(sig_s0)
        lambda_s1 = jnp.log(alpha_s1) - jnp.log(sig_s1)
        h = lambda_t - lambda_s0

        # First order (DPM-Solver++(1), i.e. DDIM), then the second-order correction on top.
        if self.stochastic:  # the SDE: exp(-h) of the sample and noise, x0 weighted 1 - exp(-2h)
            eps = step_noise(sample, key, noise, type(self).__name__)
            x0_weight = alpha_t * (1.0 - jnp.exp(-2.0 * h))
            first = (sig_t / sig_s0 * jnp.exp(-h)) * x + x0_weight * x0 \
                + sig_t * jnp.sqrt(1.0 - jnp.exp(-2.0 * h)) * eps
            midpoint = 0.5 * x0_weight
            heun = alpha_t * ((1.0 - jnp.exp(-2.0 * h)) / (-2.0 * h) + 1.0)
        else:
            first = (sig_t / sig_s0) * x - (alpha_t * (jnp.exp(-h) - 1.0)) * x0
            midpoint = -0.5 * (alpha_t * (jnp.exp(-h) - 1.0))
            heun = alpha_t * ((jnp.exp(-h) - 1.0) / h + 1.0)
        if self.solver_order == 1:
            prev = first
        else:
            r0 = (lambda_s0 - lambda_s1) / h
            d1 = (1.0 / r0) * (x0 - state.prev_x0)
            second = first + (midpoint if self.solver_type == "midpoint" else heun) * d1
            final_first_order = self.euler_at_final or (
                self.lower_order_final and n < LOWER_ORDER_FINAL_BELOW) \
                or self.final_sigmas_type == "zero"
            use_first = (state.lower_order_nums < 1) | ((i == n - 1) & final_first_order)
            # A select, not a branch: `second` may be inf/nan where it is not used (h = inf at sigma 0).
            prev = jnp.where(use_first, first, second)
        state = state.replace(prev_x0=x0,
                              lower_order_nums=jnp.minimum(state.lower_order_nums + 1, self.solver_order))
        return state, prev.astype(sample.dtype)

    def add_noise(self, state: DPMSolverState, original_samples: jax.Array, noise: jax.Array,
                  step_index) -> jax.Array:
        """Noise clean samples to the level of step ``step_index``: ``alpha_t * x0 + sigma_t * noise``."""
        alpha_t, sigma_t = vp_alpha_sigma(at(state.sigmas, step_index))
        return alpha_t * original_samples + sigma_t * noise
