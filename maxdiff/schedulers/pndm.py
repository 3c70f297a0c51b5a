"""PLMS, the pseudo linear multistep sampler of Liu et al., "Pseudo Numerical Methods for
Diffusion Models on Manifolds" (PNDM, 2022): the default sampler of Stable Diffusion 1.x.
Matches diffusers' ``PNDMScheduler`` with ``skip_prk_steps=True`` (what SD 1.5's
``scheduler_config.json`` sets); the Runge-Kutta warm-up (``skip_prk_steps=False``) is not
implemented.

Every step moves the sample with the transfer of the paper's eq. 9 (``_get_prev_sample`` in
diffusers) from alpha-bar_t to alpha-bar_prev, ``prev = t - num_train_timesteps // n`` (alpha-bar
of a negative ``prev`` is ``final_alpha_cumprod``: 1 with ``set_alpha_to_one``, else alpha-bar_0),
driven by a combination of the current and previous model outputs, which depends on how many
model calls came before (``counter``):

* call 0: the output itself; the sample is saved,
* call 1: the same move is redone from the saved sample with the mean of the two outputs (a
  second-order, Heun-like start). It starts from the level ``timesteps[i] + num_train_timesteps
  // n`` and lands on ``timesteps[i]``; this call's output is not kept in the history,
* calls 2, 3, >= 4: Adams-Bashforth combinations of 2, 3, 4 outputs:
  ``(3 e0 - e1) / 2``, ``(23 e0 - 16 e1 + 5 e2) / 12``, ``(55 e0 - 59 e1 + 37 e2 - 9 e3) / 24``
  (``e0`` the current output, ``e1`` the previous kept one, ...).

So ``n`` inference steps take ``n + 1`` model calls (1 for ``n = 1``): the second-to-last spaced
timestep is visited twice. ``set_timesteps(n)`` returns all of them in ``state.timesteps`` and
``num_model_calls(n)`` says how many without building the state.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from maxdiff.schedulers.common import (
    TIMESTEP_SPACINGS,
    TrainSchedule,
    UnscaledInput,
    at,
    check_choice,
    check_num_inference_steps,
    check_steps_offset,
    check_timesteps_in_range,
    spaced_timesteps,
)
from maxdiff.schedulers.ddim import vp_add_noise

# History kept between calls: the previous 3 kept model outputs (the 4th-order rule uses them
# with the current one).
HISTORY = 3


@struct.dataclass
class PNDMState:
    """Schedule and memory of PLMS. ``m`` below is the number of model calls,
    ``num_model_calls(n)`` (``n + 1`` for ``n >= 2`` inference steps, 1 for ``n = 1``).

    Attributes:
      timesteps: (m,) int32, the timestep the UNet receives at call ``i`` (descending; the
        second-to-last spaced timestep appears twice).
      alphas_cumprod: (m,) float32, alpha-bar at ``timesteps[i]`` (the level of the sample
        entering call ``i``; what ``add_noise`` uses).
      alphas_cumprod_prev: (m,) float32, alpha-bar at ``timesteps[i] - num_train_timesteps // n``
        (``final_alpha_cumprod`` below 0): where a regular call moves the sample.
      alphas_cumprod_redo: (m,) float32, alpha-bar at ``timesteps[i] + num_train_timesteps // n``:
        the level the redo call (``counter == 1``) restarts from; it lands on
        ``alphas_cumprod[i]``. Unused at index 0 (clamped to the schedule there).
      ets: (3, *sample_shape) float32, the last kept model outputs, most recent first.
      cur_sample: float32, shaped like the sample: the sample entering call 0 (for the redo).
      counter: int32 scalar, model calls so far, capped at 4 (later calls all use the 4th-order
        rule).
    """

    timesteps: jax.Array
    alphas_cumprod: jax.Array
    alphas_cumprod_prev: jax.Array
    alphas_cumprod_redo: jax.Array
    ets: jax.Array
    cur_sample: jax.Array
    counter: jax.Array


@dataclasses.dataclass(frozen=True)
class PNDMScheduler(UnscaledInput, TrainSchedule):
    """PLMS (PNDM with ``skip_prk_steps=True``). Fields are diffusers' constructor arguments of
    ``PNDMScheduler`` with its defaults; ``skip_prk_steps`` must be set true, as SD 1.5's config
    does (diffusers' default, false, adds a Runge-Kutta warm-up that is not implemented).
    ``prediction_type`` is ``epsilon`` or ``v_prediction`` (diffusers' PNDM has no ``sample``);
    ``rescale_betas_zero_snr`` is refused (diffusers' PNDM has no such option, and the step
    divides by alpha-bar, 0 at the last training timestep once rescaled)."""

    skip_prk_steps: bool = False
    set_alpha_to_one: bool = False
    timestep_spacing: str = "leading"
    steps_offset: int = 0

    PREDICTION_TYPES: ClassVar[tuple[str, ...]] = ("epsilon", "v_prediction")

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.skip_prk_steps is not True:
            raise ValueError(
                f"{name}: `skip_prk_steps` must be true (PLMS, as Stable Diffusion 1.5's scheduler config "
                f"sets it); the Runge-Kutta warm-up of skip_prk_steps=false is not implemented, "
                f"got {self.skip_prk_steps!r}")
        if self.rescale_betas_zero_snr is not False:
            raise ValueError(
                f"{name}: `rescale_betas_zero_snr` must be false: diffusers' PNDMScheduler has no "
                "zero-terminal-SNR option, and PLMS divides by alpha-bar, which that rescaling makes 0 "
                f"at the last training timestep; got {self.rescale_betas_zero_snr!r}")
        check_choice(name, "timestep_spacing", self.timestep_spacing, TIMESTEP_SPACINGS)
        check_steps_offset(name, self.steps_offset)
        check_choice(name, "set_alpha_to_one", self.set_alpha_to_one, (False, True))

    def _model_timesteps(self, num_inference_steps: int) -> np.ndarray:
        """The timesteps of the model calls (int64, descending), as diffusers' PNDM
        ``set_timesteps`` with ``skip_prk_steps`` makes them."""
        t = self.num_train_timesteps
        n = check_num_inference_steps(type(self).__name__, num_inference_steps, t)
        if self.timestep_spacing == "linspace":
            spaced = np.linspace(0, t - 1, n).round()
        else:
            spaced = spaced_timesteps(self.timestep_spacing, t, n, self.steps_offset)[::-1]
        spaced = spaced.astype(np.int64)  # ascending
        return np.concatenate([spaced[:-1], spaced[-2:-1], spaced[-1:]])[::-1]

    def num_model_calls(self, num_inference_steps: int) -> int:
        """Model calls (denoising loop iterations) of ``num_inference_steps`` steps:
        ``num_inference_steps + 1`` (the redo call), or 1 for a single step. Equals
        ``set_timesteps(n).timesteps.shape[0]`` and diffusers' ``len(scheduler.timesteps)``."""
        return int(self._model_timesteps(num_inference_steps).shape[0])

    def set_timesteps(self, num_inference_steps: int,
                      sample_shape: tuple[int, ...] | None = None) -> PNDMState:
        """Schedule for ``num_inference_steps`` steps (``num_model_calls(n)`` model calls).
        ``sample_shape`` (the latent shape) is required: it sizes the model-output history and
        the saved sample carried through the loop."""
        name = type(self).__name__
        if sample_shape is None:
            raise ValueError(f"{name}.set_timesteps needs `sample_shape` (the latent shape) to allocate the "
                             "model-output history it carries from step to step")
        t = self.num_train_timesteps
        timesteps = self._model_timesteps(num_inference_steps)
        check_timesteps_in_range(name, timesteps, t)
        ratio = t // num_inference_steps
        redo = timesteps + ratio
        # Only the calls after the first can be a redo; diffusers would index past the schedule.
        check_timesteps_in_range(name, redo[1:], t)
        alphas_cumprod = self.alphas_cumprod
        final = np.float32(1.0) if self.set_alpha_to_one else alphas_cumprod[0]
        prev = timesteps - ratio
        alphas_prev = np.where(prev >= 0, alphas_cumprod[np.maximum(prev, 0)], final)
        alphas_redo = alphas_cumprod[np.minimum(redo, t - 1)]
        sample_shape = tuple(sample_shape)
        return PNDMState(timesteps=jnp.asarray(timesteps, jnp.int32),
                         alphas_cumprod=jnp.asarray(alphas_cumprod[timesteps], jnp.float32),
                         alphas_cumprod_prev=jnp.asarray(alphas_prev, jnp.float32),
                         alphas_cumprod_redo=jnp.asarray(alphas_redo, jnp.float32),
                         ets=jnp.zeros((HISTORY, *sample_shape), jnp.float32),
                         cur_sample=jnp.zeros(sample_shape, jnp.float32),
                         counter=jnp.zeros((), jnp.int32))

    def transfer(self, sample: jax.Array, model_output: jax.Array, alpha_prod_t: jax.Array,
                 alpha_prod_prev: jax.Array) -> jax.Array:
        """Move ``sample`` from alpha-bar_t to alpha-bar_prev driven by ``model_output`` (eps, or
        v converted to eps at alpha-bar_t): PNDM eq. 9, i.e. the deterministic DDIM update."""
        beta_prod_t = 1 - alpha_prod_t
        beta_prod_prev = 1 - alpha_prod_prev
        if self.prediction_type == "v_prediction":
            model_output = jnp.sqrt(alpha_prod_t) * model_output + jnp.sqrt(beta_prod_t) * sample
        sample_coeff = jnp.sqrt(alpha_prod_prev / alpha_prod_t)
        denom = (alpha_prod_t * jnp.sqrt(beta_prod_prev)
                 + jnp.sqrt(alpha_prod_t * beta_prod_t * alpha_prod_prev))
        return sample_coeff * sample - (alpha_prod_prev - alpha_prod_t) * model_output / denom

    def step(self, state: PNDMState, model_output: jax.Array, sample: jax.Array, step_index,
             key: jax.Array | None = None, noise: jax.Array | None = None) -> tuple[PNDMState, jax.Array]:
        """One PLMS model call's update (deterministic; ``key`` and ``noise`` are ignored). Which
        combination of outputs it uses follows ``state.counter`` (calls so far), not
        ``step_index``, as diffusers' counter does (so a loop may start at any index, e.g. for
        img2img). Returns the updated state and the sample in ``sample.dtype``."""
        i = jnp.asarray(step_index, jnp.int32)
        c = state.counter
        e = model_output.astype(jnp.float32)
        x = sample.astype(jnp.float32)
        e1, e2, e3 = state.ets[0], state.ets[1], state.ets[2]

        redo = c == 1
        combined = jnp.where(c == 0, e,
                   jnp.where(redo, (e + e1) / 2,
                   jnp.where(c == 2, (3 * e - e1) / 2,
                   jnp.where(c == 3, (23 * e - 16 * e1 + 5 * e2) / 12,
                             (1 / 24) * (55 * e - 59 * e1 + 37 * e2 - 9 * e3)))))
        alpha_t = jnp.where(redo, at(state.alphas_cumprod_redo, i), at(state.alphas_cumprod, i))
        alpha_prev = jnp.where(redo, at(state.alphas_cumprod, i), at(state.alphas_cumprod_prev, i))
        start = jnp.where(redo, state.cur_sample, x)
        prev = self.transfer(start, combined, alpha_t, alpha_prev)

        kept = jnp.concatenate([e[None], state.ets[:HISTORY - 1]])
        state = state.replace(ets=jnp.where(redo, state.ets, kept),
                              cur_sample=jnp.where(c == 0, x, state.cur_sample),
                              counter=jnp.minimum(c + 1, 4))
        return state, prev.astype(sample.dtype)

    def add_noise(self, state: PNDMState, original_samples: jax.Array, noise: jax.Array,
                  step_index) -> jax.Array:
        """Noise clean samples to the level of call ``step_index`` (img2img)."""
        return vp_add_noise(state, original_samples, noise, step_index)
