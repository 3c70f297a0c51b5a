"""UniPC: Zhao et al., "UniPC: A Unified Predictor-Corrector Framework for Fast Sampling of
Diffusion Models" (2023): the multistep predictor UniP with the corrector UniC, in the
data-prediction form (``predict_x0``) with the B(h) choices ``bh1`` / ``bh2``, order 1 or 2.

Like DPM-Solver++ it works in ``lambda = log(alpha / sigma)`` of the variance-preserving
process with the model's x0 predictions. Every step first *corrects* the sample the previous
step produced (UniC: the previous predictor's move from ``sigmas[i - 1]`` to ``sigmas[i]`` is
redone from the saved sample with the new x0 prediction as well), then *predicts* the next one
(UniP: an exponential-integrator step from ``sigmas[i]`` to ``sigmas[i + 1]`` using the current
and the previous x0). The corrector costs no model call: the prediction it needs is the one the
model just made at ``sigmas[i]``. ``B(h)`` is ``expm1(-h)`` (``bh2``, diffusers' default) or
``-h`` (``bh1``). The first step is first order (no history, no correction), and with
``lower_order_final`` so is the last predictor step, whatever the run's length.

Matches diffusers' ``UniPCMultistepScheduler`` (``predict_x0=True``, ``solver_order`` 1 or 2,
no ``solver_p``, no ``disable_corrector``, no thresholding).
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
from maxdiff.schedulers.dpm_solver import multistep_timesteps, vp_alpha_sigma

# diffusers accepts DPM-Solver's solver types in a UniPC config and runs them as bh2
DPM_SOLVER_TYPES = ("midpoint", "heun", "logrho")


@struct.dataclass
class UniPCState:
    """Schedule and memory of UniPC.

    Attributes:
      timesteps: (n,) int32, the timestep the UNet receives at step ``i``.
      sigmas: (n + 1,) float32, ``sqrt((1 - ab) / ab)`` of the sample entering step ``i``.
      prev_x0: float32, shaped like the sample: the data prediction of the previous step.
      prev2_x0: float32, shaped like the sample: the one of the step before it.
      last_sample: float32, shaped like the sample: the (corrected) sample the previous step's
        predictor started from, which this step's corrector starts from again.
      order: int32 scalar, the order of the previous step's predictor (the corrector's order).
      lower_order_nums: int32 scalar, steps taken so far (capped at ``solver_order``).
    """

    timesteps: jax.Array
    sigmas: jax.Array
    prev_x0: jax.Array
    prev2_x0: jax.Array
    last_sample: jax.Array
    order: jax.Array
    lower_order_nums: jax.Array


def half_log_snr(sigma: jax.Array) -> jax.Array:
    """``lambda = log(alpha_t) - log(sigma_t)`` at noise level ``sigma`` (inf at sigma 0)."""
    alpha_t, sigma_t = vp_alpha_sigma(sigma)
    return jnp.log(alpha_t) - jnp.log(sigma_t)


@dataclasses.dataclass(frozen=True)
class UniPCMultistepScheduler(UnscaledInput, TrainSchedule):
    """UniPC (Zhao et al. 2023), data prediction, order 1 or 2. Fields are diffusers'
    constructor arguments of ``UniPCMultistepScheduler`` with its defaults (``bh2``, order 2,
    ``lower_order_final``); ``use_karras_sigmas`` spaces the noise levels as in Karras et al.
    2022, eq. 5, between ``sigma_min`` and ``sigma_max`` (default: the training range).

    ``solver_type`` ``midpoint`` / ``heun`` / ``logrho`` (DPM-Solver's, e.g. in a config
    converted from one) run as ``bh2``, as in diffusers. ``bh1`` needs
    ``final_sigmas_type="sigma_min"``: its last step at sigma 0 multiplies -inf by 0, so
    diffusers' run ends in NaN, and we refuse it rather than copy that.
    """

    solver_order: int = 2
    solver_type: str = "bh2"
    lower_order_final: bool = True
    use_karras_sigmas: bool = False
    sigma_min: float | None = None
    sigma_max: float | None = None
    timestep_spacing: str = "linspace"
    steps_offset: int = 0
    final_sigmas_type: str = "zero"

    INERT: ClassVar = {
        "predict_x0": (True,),
        "disable_corrector": ([], ()),
        "solver_p": (None,),
        "thresholding": (False,),
        "dynamic_thresholding_ratio": None,
        "sample_max_value": None,
        "use_exponential_sigmas": (False, None),
        "use_beta_sigmas": (False, None),
        "use_flow_sigmas": (False, None),
        "flow_shift": None,
        "use_dynamic_shifting": (False,),
        "time_shift_type": None,
        "shift_terminal": (None,),
    }
    ZERO_SNR_LAST_ALPHA: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.use_karras_sigmas is None:
            object.__setattr__(self, "use_karras_sigmas", False)
        if self.solver_type in DPM_SOLVER_TYPES:
            object.__setattr__(self, "solver_type", "bh2")
        check_choice(name, "solver_order", self.solver_order, (1, 2))
        check_choice(name, "solver_type", self.solver_type, ("bh1", "bh2", *DPM_SOLVER_TYPES))
        check_choice(name, "lower_order_final", self.lower_order_final, (False, True))
        check_choice(name, "use_karras_sigmas", self.use_karras_sigmas, (False, True))
        check_choice(name, "final_sigmas_type", self.final_sigmas_type, FINAL_SIGMAS_TYPES)
        check_choice(name, "timestep_spacing", self.timestep_spacing, TIMESTEP_SPACINGS)
        check_steps_offset(name, self.steps_offset)
        if self.solver_type == "bh1" and self.final_sigmas_type == "zero":
            raise ValueError(
                f"{name}: solver_type='bh1' needs final_sigmas_type='sigma_min': with 'zero' its "
                "last step multiplies -inf by 0 (diffusers' run ends in NaN); use bh2 or "
                "sigma_min")

    def set_timesteps(self, num_inference_steps: int,
                      sample_shape: tuple[int, ...] | None = None) -> UniPCState:
        """Schedule for ``num_inference_steps`` steps. ``sample_shape`` (the latent shape, e.g.
        (batch, 128, 128, 4)) is required: it sizes the memory carried through the loop."""
        name = type(self).__name__
        if sample_shape is None:
            raise ValueError(f"{name}.set_timesteps needs `sample_shape` (the latent shape) to allocate the "
                             "model-output history it carries from step to step")
        t = self.num_train_timesteps
        n = check_num_inference_steps(name, num_inference_steps, t)
        timesteps = multistep_timesteps(self.timestep_spacing, t, t, n, self.steps_offset)
        train_sigmas = self.train_sigmas
        if self.use_karras_sigmas:
            lo = self.sigma_min if self.sigma_min is not None else float(train_sigmas[0])
            hi = self.sigma_max if self.sigma_max is not None else float(train_sigmas[-1])
            sigmas = karras_sigmas(lo, hi, n)
            timesteps = sigma_to_t(sigmas, np.log(train_sigmas)).round().astype(np.int64)
            final = sigmas[-1] if self.final_sigmas_type == "sigma_min" else 0.0
        else:
            sigmas = np.interp(timesteps, np.arange(t), train_sigmas)
            final = train_sigmas[0] if self.final_sigmas_type == "sigma_min" else 0.0
        check_timesteps_in_range(name, timesteps, t)
        sigmas = np.concatenate([sigmas, [final]]).astype(np.float32)
        sample_shape = tuple(sample_shape)
        zeros = jnp.zeros(sample_shape, jnp.float32)
        return UniPCState(timesteps=jnp.asarray(timesteps, jnp.int32), sigmas=jnp.asarray(sigmas),
                          prev_x0=zeros, prev2_x0=zeros, last_sample=zeros,
                          order=jnp.ones((), jnp.int32), lower_order_nums=jnp.zeros((), jnp.int32))

    def data_prediction(self, model_output: jax.Array, sample: jax.Array, sigma: jax.Array) -> jax.Array:
        """x0 from the UNet output at noise level ``sigma``."""
        if self.prediction_type == "sample":
            return model_output
        alpha_t, sigma_t = vp_alpha_sigma(sigma)
        if self.prediction_type == "epsilon":
            return (sample - sigma_t * model_output) / alpha_t
        return alpha_t * sample - sigma_t * model_output  # v_prediction

    def denoised(self, state: UniPCState, model_output: jax.Array, sample: jax.Array,
                 step_index) -> jax.Array:
        """The data prediction at step ``step_index`` (previews)."""
        return self.data_prediction(model_output, sample, at(state.sigmas, step_index))

    def _coefficients(self, sigma_s0: jax.Array, sigma_t: jax.Array):
        """For a move from ``sigma_s0`` to ``sigma_t``: (h, the first-order sample coefficient
        ``sigma_t / sigma_s0`` in VP terms, ``alpha_t * h_phi_1``, ``alpha_t * B(h)``, b1, b2),
        where ``hh = -h``, ``h_phi_1 = expm1(hh)`` and b_k are the right-hand sides of the
        order conditions (diffusers' ``b``)."""
        alpha_t, sig_t = vp_alpha_sigma(sigma_t)
        _, sig_s0 = vp_alpha_sigma(sigma_s0)
        h = half_log_snr(sigma_t) - half_log_snr(sigma_s0)
        hh = -h
        h_phi_1 = jnp.expm1(hh)
        b_h = hh if self.solver_type == "bh1" else jnp.expm1(hh)
        h_phi_k1 = h_phi_1 / hh - 1.0
        b1 = h_phi_k1 / b_h
        b2 = (h_phi_k1 / hh - 0.5) * 2.0 / b_h
        return h, sig_t / sig_s0, alpha_t * h_phi_1, alpha_t * b_h, b1, b2

    def step(self, state: UniPCState, model_output: jax.Array, sample: jax.Array, step_index,
             key: jax.Array | None = None,
             noise: jax.Array | None = None) -> tuple[UniPCState, jax.Array]:
        """One UniPC step at ``sigmas[i]`` (deterministic; ``key`` and ``noise`` are ignored):
        correct the sample with this step's x0 (from the second step on), then predict the
        sample at ``sigmas[i + 1]``. Returns the updated state and the sample in
        ``sample.dtype``."""
        n = state.timesteps.shape[0]
        i = jnp.asarray(step_index, jnp.int32)
        done = state.lower_order_nums  # steps taken (capped at solver_order)
        sigma_prev2 = at(state.sigmas, jnp.maximum(i - 2, 0))
        sigma_prev = at(state.sigmas, jnp.maximum(i - 1, 0))
        sigma = at(state.sigmas, i)
        sigma_next = at(state.sigmas, i + 1)
        x = sample.astype(jnp.float32)
        x0 = self.data_prediction(model_output.astype(jnp.float32), x, sigma)

        # UniC: redo the previous move (sigma_prev -> sigma) from the saved sample with x0 too.
        m0 = state.prev_x0
        h, ratio, phi, bh, b1, b2 = self._coefficients(sigma_prev, sigma)
        base = ratio * state.last_sample - phi * m0
        d1_t = x0 - m0
        corrected_1 = base - bh * (0.5 * d1_t)
        if self.solver_order == 2:
            r1 = (half_log_snr(sigma_prev2) - half_log_snr(sigma_prev)) / h
            d1 = (state.prev2_x0 - m0) / r1
            rho0 = (b1 - b2) / (1.0 - r1)  # the 2x2 system [[1, 1], [r1, 1]] rho = (b1, b2)
            rho1 = b1 - rho0
            corrected_2 = base - bh * (rho0 * d1 + rho1 * d1_t)
            corrected = jnp.where(state.order == 2, corrected_2, corrected_1)
        else:
            corrected = corrected_1
        x = jnp.where(done >= 1, corrected, x)

        # UniP: sigma -> sigma_next with x0 and, at order 2, the previous x0.
        h, ratio, phi, bh, _, _ = self._coefficients(sigma, sigma_next)
        first = ratio * x - phi * x0
        order = jnp.minimum(done + 1, self.solver_order)
        if self.lower_order_final:
            order = jnp.minimum(order, n - i)
        if self.solver_order == 2:
            r1 = (half_log_snr(sigma_prev) - half_log_snr(sigma)) / h
            d1 = (m0 - x0) / r1
            second = first - bh * (0.5 * d1)
            # A select, not a branch: `second` is inf/nan at sigma_next 0 (h = inf) where unused.
            prev = jnp.where(order == 2, second, first)
        else:
            prev = first
        state = state.replace(prev_x0=x0, prev2_x0=m0, last_sample=x, order=order.astype(jnp.int32),
                              lower_order_nums=jnp.minimum(done + 1, self.solver_order))
        return state, prev.astype(sample.dtype)

    def add_noise(self, state: UniPCState, original_samples: jax.Array, noise: jax.Array,
                  step_index) -> jax.Array:
        """Noise clean samples to the level of step ``step_index``: ``alpha_t * x0 + sigma_t * noise``."""
        alpha_t, sigma_t = vp_alpha_sigma(at(state.sigmas, step_index))
        return alpha_t * original_samples + sigma_t * noise
