"""Shared pieces of the samplers: noise schedules, Karras sigmas, config parsing, states.

Everything in this module runs on the host, in numpy, once per ``set_timesteps``. The
per-step maths lives in the sampler modules and is pure ``jax.numpy``.

Numerics follow diffusers (PyTorch, float32) on purpose, so that a schedule built here from a
diffusers ``scheduler_config.json`` has the same timesteps and, to float32 rounding, the same
sigmas as the reference:

* betas are float32; ``linear`` / ``scaled_linear`` reproduce ``torch.linspace(dtype=float32)``
  (one fused multiply-add per element, counted from whichever end is nearer),
* ``alphas_cumprod`` is a cumulative product accumulated in float64 and rounded to float32
  (what ``torch.cumprod`` does on CPU),
* sigmas are ``sqrt((1 - alphas_cumprod) / alphas_cumprod)`` in float32 and are interpolated at
  the inference timesteps in float64 (``np.interp``), then rounded to float32.

PyTorch's vectorised ``sqrt`` is not always correctly rounded, so sigmas may still differ from
diffusers' by one float32 ulp; nothing here tries to copy that.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
TIMESTEP_SPACINGS = ("linspace", "leading", "trailing")
FINAL_SIGMAS_TYPES = ("zero", "sigma_min")

# Constructor arguments of diffusers schedulers that are *not* arguments of the one being built.
# diffusers ignores such keys (it only logs a warning): SDXL's EulerDiscreteScheduler config, for
# example, carries DDIM's `clip_sample` and PNDM's `skip_prk_steps`. We ignore them too. Any key
# outside this list and outside the sampler's own arguments is refused as a probable typo.
FOREIGN_KEYS = frozenset({
    "algorithm_type", "beta_end", "beta_schedule", "beta_start", "clip_sample", "clip_sample_range",
    "disable_corrector", "dynamic_thresholding_ratio", "euler_at_final", "final_sigmas_type",
    "flow_shift", "interpolation_type", "lambda_min_clipped", "lower_order_final",
    "num_train_timesteps", "original_inference_steps", "predict_x0", "prediction_type",
    "rescale_betas_zero_snr", "rho", "sample_max_value", "set_alpha_to_one", "shift_terminal",
    "sigma_data", "sigma_max", "sigma_min", "sigma_schedule", "skip_prk_steps", "solver_order",
    "solver_p", "solver_type", "steps_offset", "thresholding", "time_shift_type",
    "timestep_scaling", "timestep_spacing", "timestep_type", "trained_betas", "use_beta_sigmas",
    "use_dynamic_shifting", "use_exponential_sigmas", "use_flow_sigmas", "use_karras_sigmas",
    "use_lu_lambdas", "variance_type",
})


# --------------------------------------------------------------------------------------------
# States: small pytrees of device arrays, the only thing that flows through `lax.scan`.
# --------------------------------------------------------------------------------------------

@struct.dataclass
class SigmaState:
    """Schedule of a sampler written in terms of sigma (Karras et al. 2022 notation).

    ``n`` below is the number of denoising steps (``timesteps.shape[0]``).

    Attributes:
      timesteps: (n,) float32, the timestep the UNet receives at step ``i`` (may be fractional
        with Karras sigmas).
      sigmas: (n + 1,) float32, noise level of the sample entering step ``i``; ``sigmas[n]`` is
        the level after the last step (0, or sigma_min with ``final_sigmas_type="sigma_min"``).
    """

    timesteps: jax.Array
    sigmas: jax.Array


@struct.dataclass
class AlphaState:
    """Schedule of a sampler written in terms of alpha-bar (DDPM notation), e.g. DDIM and LCM.

    Attributes:
      timesteps: (n,) int32, the timestep the UNet receives at step ``i``.
      alphas_cumprod: (n,) float32, alpha-bar at ``timesteps[i]``.
      alphas_cumprod_prev: (n,) float32, alpha-bar of the level step ``i`` moves the sample to.
    """

    timesteps: jax.Array
    alphas_cumprod: jax.Array
    alphas_cumprod_prev: jax.Array


def at(values: jax.Array, index) -> jax.Array:
    """``values[index]`` for a 1-D schedule array and an index that may be traced (one dynamic
    slice; the index must be in range)."""
    return jax.lax.dynamic_index_in_dim(values, index, keepdims=False)


class Scheduler(Protocol):
    """What every sampler offers. ``state`` comes from ``set_timesteps``; ``step_index`` may be a
    traced int32 (inside ``lax.scan`` / ``fori_loop``); nothing mutates the scheduler."""

    def set_timesteps(self, num_inference_steps: int,
                      sample_shape: tuple[int, ...] | None = None) -> Any: ...

    def num_model_calls(self, num_inference_steps: int) -> int: ...

    # True when ``step`` adds fresh noise (pass ``noise=``): ancestral samplers, LCM
    stochastic: bool

    def init_noise_sigma(self, state: Any) -> jax.Array: ...

    def timestep_for_model(self, state: Any, step_index: jax.Array | int) -> jax.Array: ...

    def scale_model_input(self, state: Any, sample: jax.Array, step_index: jax.Array | int) -> jax.Array: ...

    def step(self, state: Any, model_output: jax.Array, sample: jax.Array, step_index: jax.Array | int,
             key: jax.Array | None = None, noise: jax.Array | None = None) -> tuple[Any, jax.Array]: ...

    def add_noise(self, state: Any, original_samples: jax.Array, noise: jax.Array,
                  step_index: jax.Array | int) -> jax.Array: ...

    # the model's estimate of the clean sample at a step (previews)
    def denoised(self, state: Any, model_output: jax.Array, sample: jax.Array,
                 step_index: jax.Array | int) -> jax.Array: ...

    # the diffusers scheduler config it was built from (diffusers' ``scheduler.config``)
    @property
    def config(self) -> Mapping[str, Any]: ...

    # samplers whose step reads the run's length statically (DPM++ 2M's lower-order final
    # step): the variants that do not, and which one a run of ``steps`` takes (the step engine
    # runs images of different lengths in one program); None / 0 for the others
    def step_variants(self) -> tuple | None: ...

    def step_variant(self, num_inference_steps: int) -> int: ...


# --------------------------------------------------------------------------------------------
# float32 helpers that reproduce PyTorch's rounding.
# --------------------------------------------------------------------------------------------

def fma_f32(a, b, c) -> np.ndarray:
    """Correctly rounded float32 ``a * b + c`` (a fused multiply-add) for float32 inputs.

    The product of two float32 numbers is exact in float64; the float64 sum is corrected for the
    one case where rounding twice (to float64, then to float32) differs from rounding once: a sum
    that lands exactly half-way between two float32 numbers.
    """
    a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bv = s - p
    err = (p - (s - bv)) + (c - bv)  # Knuth's two-sum: s + err == p + c exactly
    x = s.astype(np.float32)
    xd = x.astype(np.float64)
    toward_s = np.where(s > xd, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32)
    nb = np.nextafter(x, toward_s).astype(np.float64)
    tie = (s != xd) & (np.abs(s - xd) * 2 == np.abs(nb - xd)) & (err != 0)
    fixed = np.where(err > 0, np.maximum(xd, nb), np.minimum(xd, nb)).astype(np.float32)
    return np.where(tie, fixed, x)


def linspace_f32(start: float, end: float, num: int) -> np.ndarray:
    """``num`` evenly spaced float32 values from ``start`` to ``end``, rounded like
    ``torch.linspace(start, end, num, dtype=torch.float32)`` on an x86 CPU: element ``i`` is
    ``fma(step, i, start)`` in the first half and ``fma(-step, num - 1 - i, end)`` in the second.
    """
    s, e = np.float32(start), np.float32(end)
    if num == 1:
        return np.array([s], np.float32)
    step = np.float32((e - s) / np.float32(num - 1))
    i = np.arange(num)
    low = fma_f32(step, i.astype(np.float32), s)
    high = fma_f32(-step, (num - 1 - i).astype(np.float32), e)
    return np.where(i < num // 2, low, high).astype(np.float32)


def cumprod_f32(x: np.ndarray) -> np.ndarray:
    """Cumulative product accumulated in float64, each partial product rounded to float32."""
    return np.cumprod(np.asarray(x, np.float32).astype(np.float64)).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Noise schedules.
# --------------------------------------------------------------------------------------------

def cosine_betas(num_train_timesteps: int, max_beta: float = 0.999) -> np.ndarray:
    """``squaredcos_cap_v2``: the cosine schedule of Nichol & Dhariwal, "Improved Denoising
    Diffusion Probabilistic Models" (2021), eq. 17, with betas capped at ``max_beta``."""

    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    n = num_train_timesteps
    betas = [min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), max_beta) for i in range(n)]
    return np.asarray(betas, np.float64).astype(np.float32)


def make_betas(beta_schedule: str, beta_start: float, beta_end: float, num_train_timesteps: int,
               trained_betas: tuple[float, ...] | None = None) -> np.ndarray:
    """Training betas, float32, shape (num_train_timesteps,)."""
    if trained_betas is not None:
        return np.asarray(trained_betas, np.float64).astype(np.float32)
    if beta_schedule == "linear":
        return linspace_f32(beta_start, beta_end, num_train_timesteps)
    if beta_schedule == "scaled_linear":  # linear in sqrt(beta): the Stable Diffusion schedule
        root = linspace_f32(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps)
        return root * root
    if beta_schedule == "squaredcos_cap_v2":
        return cosine_betas(num_train_timesteps)
    raise ValueError(f"`beta_schedule` must be one of {BETA_SCHEDULES}, got {beta_schedule!r}")


def rescale_zero_terminal_snr(betas: np.ndarray) -> np.ndarray:
    """Rescale betas so the last timestep has zero SNR: Lin et al., "Common Diffusion Noise
    Schedules and Sample Steps are Flawed" (2023), Algorithm 1. float32 in, float32 out."""
    f32 = np.float32
    alphas = f32(1.0) - betas
    root = np.sqrt(cumprod_f32(alphas))
    first, last = root[0], root[-1]
    root = (root - last) * (first / (first - last))  # shift the last to 0, keep the first
    bar = root * root
    alphas = np.concatenate([bar[:1], bar[1:] / bar[:-1]])
    return (f32(1.0) - alphas).astype(np.float32)


def karras_sigmas(sigma_min: float, sigma_max: float, num: int, rho: float = 7.0) -> np.ndarray:
    """Noise levels of Karras et al., "Elucidating the Design Space of Diffusion-Based Generative
    Models" (2022), eq. 5: evenly spaced in ``sigma ** (1 / rho)``, from sigma_max down to
    sigma_min. float64, shape (num,)."""
    ramp = np.linspace(0, 1, num)
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return (hi + ramp * (lo - hi)) ** rho


def sigma_to_t(sigmas: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """Fractional training timestep of each sigma: linear interpolation of ``log(sigma)`` between
    the two neighbouring training levels. ``log_sigmas`` is ascending in t. float64."""
    log_sigma = np.log(np.maximum(sigmas, 1e-10))
    dists = log_sigma - log_sigmas[:, None]
    low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=log_sigmas.shape[0] - 2)
    high = low + 1
    w = np.clip((log_sigmas[low] - log_sigma) / (log_sigmas[low] - log_sigmas[high]), 0, 1)
    return ((1 - w) * low + w * high).reshape(np.shape(sigmas))


# --------------------------------------------------------------------------------------------
# Configs.
# --------------------------------------------------------------------------------------------

def check_choice(owner: str, field: str, value: Any, allowed: tuple) -> None:
    """Raise a ValueError naming ``field`` and the allowed values unless ``value`` is one of them."""
    if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
        raise ValueError(f"{owner}: `{field}` must be one of {allowed}, got {value!r}")


def check_steps_offset(owner: str, steps_offset: Any) -> None:
    """``steps_offset`` (added to ``leading`` timesteps) must be a non-negative int."""
    if isinstance(steps_offset, bool) or not isinstance(steps_offset, int) or steps_offset < 0:
        raise ValueError(f"{owner}: `steps_offset` must be a non-negative int, got {steps_offset!r}")


def max_inference_steps(scheduler: Any) -> int:
    """The most denoising steps ``scheduler.set_timesteps`` accepts: its ``num_train_timesteps``
    (1000 for SDXL), and for LCM at most its ``original_inference_steps`` (50)."""
    original = getattr(scheduler, "original_inference_steps", None)
    limit = scheduler.num_train_timesteps
    return min(limit, original) if original else limit


def check_num_inference_steps(owner: str, num_inference_steps: Any, num_train_timesteps: int) -> int:
    """The number of denoising steps: an int in [1, num_train_timesteps]."""
    n = num_inference_steps
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise ValueError(
            f"{owner}: `num_inference_steps` must be an int in [1, {num_train_timesteps}], got {n!r}")
    if not 1 <= n <= num_train_timesteps:
        raise ValueError(
            f"{owner}: `num_inference_steps` must be in [1, num_train_timesteps={num_train_timesteps}], "
            f"got {n}")
    return int(n)


def check_timesteps_in_range(owner: str, timesteps: np.ndarray, num_train_timesteps: int) -> None:
    """Refuse schedules that index past the training schedule (e.g. a large ``steps_offset``)."""
    if timesteps.size and (timesteps.max() > num_train_timesteps - 1 or timesteps.min() < 0):
        raise ValueError(
            f"{owner}: timesteps {timesteps.min()}..{timesteps.max()} fall outside "
            f"[0, {num_train_timesteps - 1}]; "
            "lower `steps_offset` or `num_inference_steps`")


def x0_and_eps(prediction_type: str, model_output: jax.Array, sample: jax.Array,
               alpha_prod_t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x0 and eps from a model output, for ``x = sqrt(ab) * x0 + sqrt(1 - ab) * eps``."""
    beta_prod_t = 1 - alpha_prod_t
    if prediction_type == "epsilon":
        x0 = (sample - jnp.sqrt(beta_prod_t) * model_output) / jnp.sqrt(alpha_prod_t)
        return x0, model_output
    if prediction_type == "sample":
        eps = (sample - jnp.sqrt(alpha_prod_t) * model_output) / jnp.sqrt(beta_prod_t)
        return model_output, eps
    # v_prediction (Salimans & Ho 2022): v = sqrt(ab) * eps - sqrt(1 - ab) * x0
    x0 = jnp.sqrt(alpha_prod_t) * sample - jnp.sqrt(beta_prod_t) * model_output
    eps = jnp.sqrt(alpha_prod_t) * model_output + jnp.sqrt(beta_prod_t) * sample
    return x0, eps


class UnscaledInput:
    """The methods the variance-preserving samplers (DDIM, DPM-Solver, LCM) share: unit initial
    noise, the integer timestep of step ``i`` for the UNet, and no input scaling."""

    def init_noise_sigma(self, state) -> jax.Array:
        """Standard deviation of the initial latent noise: 1 (variance preserving)."""
        return jnp.float32(1.0)

    def timestep_for_model(self, state, step_index) -> jax.Array:
        """The (int32) timestep the UNet receives at step ``step_index``."""
        return at(state.timesteps, step_index)

    def scale_model_input(self, state, sample: jax.Array, step_index) -> jax.Array:
        """These samplers feed the sample to the UNet unscaled."""
        return sample

    def denoised(self, state, model_output: jax.Array, sample: jax.Array, step_index) -> jax.Array:
        """The model's estimate of the clean sample at step ``step_index`` (previews)."""
        x0, _ = x0_and_eps(self.prediction_type, model_output, sample,
                           at(state.alphas_cumprod, step_index))
        return x0


@dataclasses.dataclass(frozen=True)
class TrainSchedule:
    """The training noise schedule every sampler starts from (diffusers' shared constructor
    arguments). Subclasses are frozen dataclasses, one per sampler.

    Class variables a subclass sets:
      PREDICTION_TYPES: the ``prediction_type`` values it implements.
      INERT: constructor arguments of the diffusers class that we do not implement, mapped to
        the values that leave the maths unchanged (None: any value, the argument is unused).
      ZERO_SNR_LAST_ALPHA: with ``rescale_betas_zero_snr``, replace the last alpha-bar (exactly 0)
        by 2**-24 so its sigma stays finite (what the sigma-based diffusers samplers do).
      stochastic: ``step`` adds fresh noise each step (``noise=``), drawn by the pipelines from
        the image's step key (:func:`pipelines.program.step_noise`).
    """

    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    trained_betas: tuple[float, ...] | None = None
    prediction_type: str = "epsilon"
    rescale_betas_zero_snr: bool = False

    PREDICTION_TYPES: ClassVar[tuple[str, ...]] = ("epsilon", "v_prediction", "sample")
    INERT: ClassVar[Mapping[str, tuple | None]] = {}
    ZERO_SNR_LAST_ALPHA: ClassVar[bool] = False
    stochastic: ClassVar[bool] = False

    def step_variants(self) -> tuple | None:
        """None: ``step`` does not read the run's length statically (see :class:`Scheduler`)."""
        return None

    def step_variant(self, num_inference_steps: int) -> int:
        return 0

    def __post_init__(self) -> None:
        name = type(self).__name__
        if isinstance(self.num_train_timesteps, bool) or not isinstance(self.num_train_timesteps, int) \
                or self.num_train_timesteps < 2:
            raise ValueError(
                f"{name}: `num_train_timesteps` must be an int >= 2, got {self.num_train_timesteps!r}")
        if self.trained_betas is not None:
            betas = tuple(float(b) for b in np.asarray(self.trained_betas, np.float64).reshape(-1))
            object.__setattr__(self, "trained_betas", betas)
            if len(betas) != self.num_train_timesteps:
                raise ValueError(f"{name}: `trained_betas` has {len(betas)} values but "
                                 f"`num_train_timesteps` is {self.num_train_timesteps}; they must match")
        else:
            check_choice(name, "beta_schedule", self.beta_schedule, BETA_SCHEDULES)
        check_choice(name, "prediction_type", self.prediction_type, self.PREDICTION_TYPES)
        check_choice(name, "rescale_betas_zero_snr", self.rescale_betas_zero_snr, (False, True))

    @classmethod
    def from_config(cls, config: Mapping[str, Any]):
        """Build from a diffusers ``scheduler_config.json`` dict.

        Keys starting with ``_`` (``_class_name``, ``_diffusers_version``) and keys that belong to
        other diffusers schedulers are ignored, as diffusers does; unsupported values of this
        sampler's own keys and unknown keys raise a ValueError naming the key.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in config.items():
            if key.startswith("_"):
                continue
            if key in fields:
                kwargs[key] = value
            elif key in cls.INERT:
                allowed = cls.INERT[key]
                if allowed is not None:
                    check_choice(cls.__name__, key, value, allowed)
            elif key not in FOREIGN_KEYS:
                known = sorted(fields | set(cls.INERT))
                raise ValueError(
                    f"{cls.__name__}: unknown config key `{key}`; the keys it understands are {known}")
        scheduler = cls(**kwargs)
        object.__setattr__(scheduler, "_source_config", MappingProxyType(dict(config)))
        return scheduler

    @property
    def config(self) -> Mapping[str, Any]:
        """The diffusers scheduler config of this sampler, as diffusers keeps it in
        ``scheduler.config``: the config it was built from (keys of other samplers included,
        which a switch to another sampler may need: SDXL's ``clip_sample`` for DDIM), with its
        own arguments as it reads them and its ``_class_name``. For a sampler built by its
        constructor: its arguments and ``_class_name``."""
        source = self.__dict__.get("_source_config", {})
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return MappingProxyType({**source, **own, "_class_name": type(self).__name__})

    def num_model_calls(self, num_inference_steps: int) -> int:
        """How many model calls (denoising loop iterations, ``step`` calls) ``num_inference_steps``
        steps take: ``set_timesteps(n).timesteps.shape[0]``, without building the state. One per
        step here; PLMS (``PNDMScheduler``) takes one more. Checks the count as
        ``set_timesteps`` does (an int in [1, num_train_timesteps]; a sampler may refuse more)."""
        return check_num_inference_steps(type(self).__name__, num_inference_steps, self.num_train_timesteps)

    @functools.cached_property
    def alphas_cumprod(self) -> np.ndarray:
        """Training alpha-bar, float32, shape (num_train_timesteps,)."""
        betas = make_betas(self.beta_schedule, self.beta_start, self.beta_end, self.num_train_timesteps,
                           self.trained_betas)
        if self.rescale_betas_zero_snr:
            betas = rescale_zero_terminal_snr(betas)
        alphas_cumprod = cumprod_f32(np.float32(1.0) - betas)
        if self.rescale_betas_zero_snr and self.ZERO_SNR_LAST_ALPHA:
            alphas_cumprod[-1] = 2.0 ** -24
        alphas_cumprod.setflags(write=False)
        return alphas_cumprod

    @functools.cached_property
    def train_sigmas(self) -> np.ndarray:
        """sqrt((1 - alpha-bar) / alpha-bar) at every training timestep, float32, ascending in t."""
        a = self.alphas_cumprod
        sigmas = np.sqrt((np.float32(1.0) - a) / a)
        sigmas.setflags(write=False)
        return sigmas


def spaced_timesteps(spacing: str, num_train_timesteps: int, num_inference_steps: int,
                     steps_offset: int) -> np.ndarray:
    """Integer-valued timesteps, descending, for the ``leading`` and ``trailing`` spacings of
    Lin et al. 2023, Table 2 (float64; callers cast). ``linspace`` differs per sampler."""
    t, n = num_train_timesteps, num_inference_steps
    if spacing == "leading":
        return (np.arange(0, n) * (t // n)).round()[::-1] + steps_offset
    if spacing == "trailing":
        return np.arange(t, 0, -t / n).round() - 1
    raise ValueError(f"`timestep_spacing` must be one of {TIMESTEP_SPACINGS}, got {spacing!r}")
