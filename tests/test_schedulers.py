"""Tests of maxdiff.schedulers.

Parity: every sampler and option is run for a whole denoising loop next to diffusers' PyTorch
scheduler built from the same config, with a fixed fake model (a deterministic function of the
model input and the timestep) and, for the stochastic samplers, the same noise fed to both.

Each step is checked on its own (diffusers' input sample and model output fed to our step) and
over the whole run (each side feeding its own outputs back). Tolerances, and why not zero:
* timesteps: identical, except Euler with Karras sigmas whose fractional timesteps come out of
  ``log(sigma)``: within 1e-3 there (PyTorch's vectorised sqrt, which makes the training sigmas,
  is not always correctly rounded; numpy's is).
* sigmas: within 1e-6 * max(1, sigma) (1e-5 with zero-terminal-SNR betas, whose rescaling
  amplifies those last-bit differences).
* samples: within 1e-5 * (1 + scale), scale being the largest |value| among the step's input,
  its output and its x0 estimate (for the whole run: the largest so far). XLA turns
  ``x / scalar`` into ``x * (1 / scalar)`` and its exp/log differ from PyTorch's in the last
  bit, so results agree to float32 rounding of the largest intermediate. The scale only matters
  for huge noise levels: sigma 4096 with zero-terminal-SNR betas, and x0 = x / sqrt(alpha-bar)
  of ~1e4 at t = 999 of the cosine schedule; for SD/SDXL-like configs errors stay below ~4e-5.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxdiff.schedulers import (
    PRESETS,
    SCHEDULERS,
    SDXL_BASE_SCHEDULER_CONFIG,
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    LCMScheduler,
    PNDMScheduler,
    PNDMState,
    Preset,
    UniPCMultistepScheduler,
    find_sampler,
    get_preset,
    get_sampler,
    load_scheduler,
    resolve_scheduler,
    sampler_config,
)
from maxdiff.schedulers import SAMPLERS as SAMPLER_NAMES

try:  # the PyTorch reference, for the parity tests only
    import diffusers
    import torch
except ImportError:
    diffusers = torch = None
needs_reference = pytest.mark.skipif(diffusers is None, reason="parity tests need torch and diffusers")

SHAPE = (2, 4, 8, 8)
STEPS = [1, 2, 4, 8, 30]  # 30: a long schedule whose spacing divides 1000 unevenly
SD = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000}


def fake_model(x: np.ndarray, t: float) -> np.ndarray:
    """A deterministic stand-in for the UNet: a smooth function of its input and timestep."""
    x = np.asarray(x, np.float32)
    return (0.8 * np.tanh(0.5 * x) + 0.2 * np.sin(0.3 * x + np.float32(0.01 * t))).astype(np.float32)


def noises(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(n)]


def run_reference(name: str, config: dict, n: int, monkeypatch):
    """diffusers' loop. Returns the scheduler (after set_timesteps), the samples (initial one
    first, then each step's output), and per step: the model input, the model output and the
    largest |value| among the step's input sample, its output and its x0 estimate."""
    ref = getattr(diffusers, name).from_config(config)
    ref.set_timesteps(n)
    if hasattr(ref, "set_begin_index"):
        # Start at step 0 as we do. Without it diffusers looks the first timestep up and takes its
        # second occurrence when it repeats (DPM-Solver, cosine betas with Karras sigmas).
        ref.set_begin_index(0)
    queue = [torch.from_numpy(z) for z in noises(len(ref.timesteps))]
    if monkeypatch is not None:  # the stochastic samplers draw their noise through randn_tensor
        module = type(ref).__module__
        monkeypatch.setattr(f"{module}.randn_tensor", lambda *a, **k: queue[len(model_outs) - 1])
    x = torch.from_numpy(np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32))
    x = x * ref.init_noise_sigma
    xs, model_ins, model_outs, scales = [x.numpy().copy()], [], [], []
    for t in ref.timesteps:
        model_in = ref.scale_model_input(x, t)
        model_ins.append(model_in.numpy().copy())
        model_outs.append(fake_model(model_in.numpy(), float(t)))
        out = ref.step(torch.from_numpy(model_outs[-1]), t, x)
        x0 = getattr(out, "pred_original_sample", None)
        x0 = getattr(out, "denoised", x0)
        if x0 is None:  # DPM-Solver keeps its x0 in model_outputs; PNDM has no x0 estimate
            x0 = ref.model_outputs[-1] if hasattr(ref, "model_outputs") else x
        scales.append(max(float(v.abs().max()) for v in (x, out.prev_sample, x0)))
        x = out.prev_sample
        xs.append(x.numpy().copy())
    return ref, xs, model_ins, model_outs, scales


def run_ours(scheduler, n: int):
    """Our loop, eager, step by step. Returns the state from set_timesteps and the samples
    (initial one first, then each step's output)."""
    state0 = state = scheduler.set_timesteps(n, sample_shape=SHAPE)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32))
    x = x * scheduler.init_noise_sigma(state)
    zs = noises(state.timesteps.shape[0])
    xs = [np.asarray(x)]
    for i in range(state.timesteps.shape[0]):
        model_in = scheduler.scale_model_input(state, x, i)
        t = float(scheduler.timestep_for_model(state, i))
        eps = jnp.asarray(fake_model(np.asarray(model_in), t))
        state, x = scheduler.step(state, eps, x, i, noise=jnp.asarray(zs[i]))
        xs.append(np.asarray(x))
    return state0, xs


# Largest differences seen by assert_parity in this session, per sampler (for reports).
MAX_ERRORS: dict[str, dict[str, float]] = {}


def _record(name: str, **errors: float) -> None:
    worst = MAX_ERRORS.setdefault(name, {})
    for k, v in errors.items():
        worst[k] = max(worst.get(k, 0.0), float(v))


def assert_parity(name: str, config: dict, n: int, monkeypatch=None, *, timestep_atol: float = 0.0,
                  sigma_rtol: float = 1e-6) -> None:
    """Schedule, per-step and whole-run parity of our sampler with diffusers' (see module doc)."""
    ours = load_scheduler({"_class_name": name, "_diffusers_version": "0.42.1", **config})
    ref, ref_xs, ref_ins, ref_outs, ref_scales = run_reference(name, config, n, monkeypatch)
    state, xs = run_ours(ours, n)

    ref_t = ref.timesteps.numpy()
    assert np.asarray(state.timesteps).shape == ref_t.shape
    _record(name, timesteps=np.abs(np.asarray(state.timesteps, np.float64) - ref_t).max(initial=0))
    if timestep_atol:
        np.testing.assert_allclose(np.asarray(state.timesteps), ref_t, rtol=0, atol=timestep_atol)
    else:
        np.testing.assert_array_equal(np.asarray(state.timesteps), ref_t)
    if hasattr(state, "sigmas"):
        ref_s = ref.sigmas.numpy()
        err = np.abs(np.asarray(state.sigmas) - ref_s) / np.maximum(1, np.abs(ref_s))
        _record(name, sigmas_rel=err.max(), sigmas_abs=np.abs(np.asarray(state.sigmas) - ref_s).max())
        assert err.max() <= sigma_rtol, f"sigmas differ by {err.max():.3g} (relative)"
    init = float(ours.init_noise_sigma(state))
    assert init == pytest.approx(float(ref.init_noise_sigma), rel=sigma_rtol)

    # Each step on its own: diffusers' input sample and model output in, compare the step's output.
    zs = noises(len(ref_outs))
    step_state = state
    for i in range(len(ref_outs)):
        model_in = np.asarray(ours.scale_model_input(step_state, jnp.asarray(ref_xs[i]), i))
        scale = 1 + ref_scales[i]
        err_in = float(np.abs(model_in - ref_ins[i]).max())
        step_state, out = ours.step(step_state, jnp.asarray(ref_outs[i]), jnp.asarray(ref_xs[i]), i,
                                    noise=jnp.asarray(zs[i]))
        err = float(np.abs(np.asarray(out) - ref_xs[i + 1]).max())
        _record(name, step_abs=err, step_scaled=err / scale, model_in_abs=err_in)
        if scale < 100:
            _record(name, step_abs_moderate=err)
        assert err_in <= 1e-5 * scale, f"scale_model_input at step {i}: max error {err_in:.3g}"
        assert err <= 1e-5 * scale, f"step {i}: max error {err:.3g} at scale {scale:.3g}"

    # The whole run, each side feeding its own outputs back.
    assert len(xs) == len(ref_xs)
    for i, (a, b) in enumerate(zip(xs[1:], ref_xs[1:])):
        scale = 1 + max(ref_scales[:i + 1])
        err = float(np.abs(a - b).max())
        _record(name, run_abs=err, run_scaled=err / scale)
        if scale < 100:
            _record(name, run_abs_moderate=err)
        assert err <= 1e-5 * scale, f"after step {i}: max error {err:.3g} at scale {scale:.3g}"
    assert np.isfinite(xs[-1]).all()


# --------------------------------------------------------------------------------------------
# Parity with diffusers.
# --------------------------------------------------------------------------------------------

SPACINGS = ["leading", "linspace", "trailing"]
PREDICTIONS = ["epsilon", "v_prediction", "sample"]


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("n", STEPS)
@pytest.mark.parametrize("karras", [False, True], ids=["plain", "karras"])
@pytest.mark.parametrize("prediction", PREDICTIONS)
@pytest.mark.parametrize("spacing", SPACINGS)
def test_euler_parity(spacing, prediction, karras, n):
    config = dict(SD, steps_offset=1, timestep_spacing=spacing, prediction_type=prediction,
                  use_karras_sigmas=karras)
    assert_parity("EulerDiscreteScheduler", config, n, timestep_atol=1e-3 if karras else 0.0)


EULER_EXTRA = {
    "sdxl-base": dict(SDXL_BASE_SCHEDULER_CONFIG),
    "sigma-min-final": dict(SD, timestep_spacing="trailing", final_sigmas_type="sigma_min"),
    "karras-sigma-min-final": dict(SD, use_karras_sigmas=True, final_sigmas_type="sigma_min"),
    "karras-custom-range": dict(SD, use_karras_sigmas=True, sigma_min=0.05, sigma_max=10.0),
    "zero-snr-v": dict(SD, timestep_spacing="trailing", prediction_type="v_prediction",
                       rescale_betas_zero_snr=True),
    "linear-betas": dict(beta_schedule="linear", timestep_spacing="leading", steps_offset=1),
    "cosine-betas": dict(beta_schedule="squaredcos_cap_v2", timestep_spacing="trailing"),
    "trained-betas": dict(trained_betas=np.linspace(1e-4, 2e-2, 1000).tolist(), timestep_spacing="trailing"),
}


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("n", STEPS)
@pytest.mark.parametrize("variant", sorted(EULER_EXTRA))
def test_euler_parity_options(variant, n):
    config = EULER_EXTRA[variant]
    karras = config.get("use_karras_sigmas", False)
    zero_snr = config.get("rescale_betas_zero_snr", False)
    assert_parity("EulerDiscreteScheduler", config, n, timestep_atol=1e-3 if karras else 0.0,
                  sigma_rtol=1e-5 if zero_snr else 1e-6)


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("n", STEPS)
@pytest.mark.parametrize("variant", ["epsilon", "v_prediction", "zero-snr-v", "leading-offset", "linspace"])
def test_euler_ancestral_parity(variant, n, monkeypatch):
    config = dict(SD, timestep_spacing="trailing")
    if variant == "v_prediction":
        config["prediction_type"] = "v_prediction"
    elif variant == "zero-snr-v":
        config.update(prediction_type="v_prediction", rescale_betas_zero_snr=True)
    elif variant == "leading-offset":
        config.update(timestep_spacing="leading", steps_offset=1)
    elif variant == "linspace":
        config.update(timestep_spacing="linspace")
    assert_parity("EulerAncestralDiscreteScheduler", config, n, monkeypatch,
                  sigma_rtol=1e-5 if variant == "zero-snr-v" else 1e-6)


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("n", STEPS)
@pytest.mark.parametrize("prediction", PREDICTIONS)
@pytest.mark.parametrize("spacing", SPACINGS)
def test_ddim_parity(spacing, prediction, n):
    config = dict(SD, steps_offset=1, timestep_spacing=spacing, prediction_type=prediction,
                  clip_sample=False, set_alpha_to_one=False)
    assert_parity("DDIMScheduler", config, n)


DDIM_EXTRA = {
    "defaults": {},  # linear betas, clip_sample=True, set_alpha_to_one=True, leading
    "clip-range": dict(SD, clip_sample=True, clip_sample_range=0.5, timestep_spacing="trailing"),
    "zero-snr-v": dict(SD, rescale_betas_zero_snr=True, prediction_type="v_prediction",
                       timestep_spacing="trailing", clip_sample=False),
    "cosine": dict(beta_schedule="squaredcos_cap_v2", clip_sample=False, timestep_spacing="linspace"),
}


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("n", STEPS)
@pytest.mark.parametrize("variant", sorted(DDIM_EXTRA))
def test_ddim_parity_options(variant, n):
    assert_parity("DDIMScheduler", DDIM_EXTRA[variant], n)


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("n", STEPS)
@pytest.mark.parametrize("spacing", SPACINGS)
@pytest.mark.parametrize("final", ["zero", "sigma_min"])
@pytest.mark.parametrize("karras", [False, True], ids=["plain", "karras"])
def test_dpm_solver_parity(karras, final, spacing, n):
    config = dict(SD, steps_offset=1, timestep_spacing=spacing, use_karras_sigmas=karras,
                  final_sigmas_type=final)
    assert_parity("DPMSolverMultistepScheduler", config, n)


DPM_EXTRA = {
    "v_prediction": dict(SD, prediction_type="v_prediction", use_karras_sigmas=True),
    "sample": dict(SD, prediction_type="sample"),
    "no-lower-order-final": dict(SD, lower_order_final=False, final_sigmas_type="sigma_min"),
    "euler-at-final": dict(SD, euler_at_final=True, final_sigmas_type="sigma_min", use_karras_sigmas=True),
    "heun": dict(SD, solver_type="heun", use_karras_sigmas=True),
    "first-order": dict(SD, solver_order=1),
    "zero-snr-v": dict(SD, rescale_betas_zero_snr=True, prediction_type="v_prediction",
                       timestep_spacing="trailing"),
    "cosine-clipped": dict(beta_schedule="squaredcos_cap_v2", lambda_min_clipped=-5.1,
                           timestep_spacing="trailing"),
    "cosine-karras": dict(beta_schedule="squaredcos_cap_v2", use_karras_sigmas=True),
}


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("n", STEPS)
@pytest.mark.parametrize("variant", sorted(DPM_EXTRA))
def test_dpm_solver_parity_options(variant, n):
    config = DPM_EXTRA[variant]
    assert_parity("DPMSolverMultistepScheduler", config, n,
                  sigma_rtol=1e-5 if config.get("rescale_betas_zero_snr") else 1e-6)


# UniPC, diffusers' defaults: bh2, solver order 2, lower_order_final (the last step first order
# whatever the run's length, unlike DPM-Solver's rule for runs under 15 steps).
UNIPC_SDXL = {k: v for k, v in SDXL_BASE_SCHEDULER_CONFIG.items() if not k.startswith("_")}


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("n", STEPS)
@pytest.mark.parametrize("spacing", SPACINGS)
@pytest.mark.parametrize("karras", [False, True], ids=["plain", "karras"])
def test_unipc_parity(karras, spacing, n):
    config = dict(SD, steps_offset=1, timestep_spacing=spacing, use_karras_sigmas=karras)
    assert_parity("UniPCMultistepScheduler", config, n)


UNIPC_EXTRA = {
    "sdxl-base": UNIPC_SDXL,
    "sdxl-base-karras": dict(UNIPC_SDXL, use_karras_sigmas=True),
    "v_prediction": dict(SD, prediction_type="v_prediction", use_karras_sigmas=True),
    "sample": dict(SD, prediction_type="sample"),
    "sigma-min-final": dict(SD, final_sigmas_type="sigma_min", timestep_spacing="trailing"),
    "karras-sigma-min-final": dict(SD, final_sigmas_type="sigma_min", use_karras_sigmas=True),
    # second order to the end (at sigma 0 that would be inf - inf, in diffusers too)
    "no-lower-order-final": dict(SD, lower_order_final=False, final_sigmas_type="sigma_min"),
    "bh1": dict(SD, solver_type="bh1", final_sigmas_type="sigma_min", use_karras_sigmas=True),
    "first-order": dict(SD, solver_order=1),
    "dpm-solver-type": dict(SD, solver_type="midpoint"),  # a DPM-Solver config's: run as bh2
    "karras-custom-range": dict(SD, use_karras_sigmas=True, sigma_min=0.05, sigma_max=10.0),
    "zero-snr-v": dict(SD, rescale_betas_zero_snr=True, prediction_type="v_prediction",
                       timestep_spacing="trailing"),
    "cosine": dict(beta_schedule="squaredcos_cap_v2", timestep_spacing="trailing"),
    "cosine-karras": dict(beta_schedule="squaredcos_cap_v2", use_karras_sigmas=True),
}


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("n", [1, 2, 3, 8, 25])
@pytest.mark.parametrize("variant", sorted(UNIPC_EXTRA))
def test_unipc_parity_options(variant, n):
    config = UNIPC_EXTRA[variant]
    assert_parity("UniPCMultistepScheduler", config, n,
                  sigma_rtol=1e-5 if config.get("rescale_betas_zero_snr") else 1e-6)


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("n", [3, 12, 25])
@pytest.mark.parametrize("karras", [False, True], ids=["plain", "karras"])
def test_unipc_scan_parity(karras, n):
    """A traced step index in a jitted lax.scan: the order and corrector choices are selects."""
    assert_scan_parity("UniPCMultistepScheduler", dict(UNIPC_SDXL, use_karras_sigmas=karras), n)


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("start", [1, 3, 7])
def test_unipc_loop_from_a_later_step_matches_diffusers(start):
    """img2img starts at a later step with a fresh state: first order there, no corrector, as
    diffusers' set_begin_index leaves it."""
    config = dict(UNIPC_SDXL, use_karras_sigmas=True)
    ref = diffusers.UniPCMultistepScheduler.from_config(config)
    ref.set_timesteps(10)
    ref.set_begin_index(start)
    ours = load_scheduler({"_class_name": "UniPCMultistepScheduler", **config})
    state = ours.set_timesteps(10, sample_shape=SHAPE)
    rng = np.random.default_rng(4)
    clean, noise = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2))
    t = ref.timesteps[start:start + 1].repeat(SHAPE[0])
    x = ref.add_noise(torch.from_numpy(clean), torch.from_numpy(noise), t)
    got_x = ours.add_noise(state, jnp.asarray(clean), jnp.asarray(noise), start)
    np.testing.assert_allclose(np.asarray(got_x), x.numpy(), rtol=1e-6, atol=1e-5)
    want = []
    for t in ref.timesteps[start:]:
        x = ref.step(torch.from_numpy(fake_model(x.numpy(), float(t))), t, x).prev_sample
        want.append(x.numpy())
    got = scan_samples(ours, state, got_x, start)
    assert got.shape == (len(want), *SHAPE)
    for i, (a, b) in enumerate(zip(got, want)):
        err = float(np.abs(a - b).max())
        assert err <= 1e-5 * (1 + np.abs(b).max()), f"step {start + i}: max error {err:.3g}"


DPM_SDE = {  # DPM++ 2M SDE: algorithm_type="sde-dpmsolver++", fresh noise every step
    "plain": dict(SD, algorithm_type="sde-dpmsolver++"),
    "karras": dict(SD, algorithm_type="sde-dpmsolver++", use_karras_sigmas=True),
    "heun-sigma-min": dict(SD, algorithm_type="sde-dpmsolver++", solver_type="heun",
                           final_sigmas_type="sigma_min", timestep_spacing="trailing"),
    "v_prediction-leading": dict(SD, algorithm_type="sde-dpmsolver++", prediction_type="v_prediction",
                                 timestep_spacing="leading", steps_offset=1),
    "first-order": dict(SD, algorithm_type="sde-dpmsolver++", solver_order=1),
}


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("n", STEPS)
@pytest.mark.parametrize("variant", sorted(DPM_SDE))
def test_dpm_solver_sde_parity(variant, n, monkeypatch):
    scheduler = load_scheduler({"_class_name": "DPMSolverMultistepScheduler", **DPM_SDE[variant]})
    assert scheduler.stochastic
    assert_parity("DPMSolverMultistepScheduler", DPM_SDE[variant], n, monkeypatch)


LCM_VARIANTS = {
    "epsilon": {},
    "v_prediction": dict(prediction_type="v_prediction"),
    "sample": dict(prediction_type="sample"),
    "clip": dict(clip_sample=True, clip_sample_range=0.8),
    "zero-snr-v": dict(rescale_betas_zero_snr=True, prediction_type="v_prediction"),
    "original-100": dict(original_inference_steps=100, timestep_scaling=5.0),
}


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("n", STEPS)
@pytest.mark.parametrize("variant", sorted(LCM_VARIANTS))
def test_lcm_parity(variant, n, monkeypatch):
    assert_parity("LCMScheduler", dict(SD, **LCM_VARIANTS[variant]), n, monkeypatch)


# PLMS as Stable Diffusion 1.5 ships it (its scheduler_config.json, verbatim).
SD15_SCHEDULER_CONFIG = {
    "_class_name": "PNDMScheduler",
    "_diffusers_version": "0.6.0",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
    "clip_sample": False,
}
PNDM_STEPS = [1, 2, 3, 5, 20, 50]
PLMS = dict(SD, skip_prk_steps=True)


def scan_samples(scheduler, state, x, start: int = 0) -> np.ndarray:
    """A jitted lax.scan from call ``start`` to the end with a traced index and the JAX fake
    model; every call's output sample, stacked."""

    def body(carry, i):
        state, x = carry
        out = jax_fake_model(scheduler.scale_model_input(state, x, i), scheduler.timestep_for_model(state, i))
        state, x = scheduler.step(state, out, x, i)
        return (state, x), x

    run = jax.jit(lambda state, x: jax.lax.scan(
        body, (state, x), jnp.arange(start, state.timesteps.shape[0], dtype=jnp.int32))[1])
    return np.asarray(run(state, x))


def assert_scan_parity(name: str, config: dict, n: int) -> None:
    """Our sampler in a jitted lax.scan (traced step index) against diffusers' loop: every
    intermediate sample and the last one, within 1e-5 * (1 + largest |sample| so far)."""
    ours = load_scheduler({"_class_name": name, **config})
    _, ref_xs, _, _, ref_scales = run_reference(name, config, n, None)
    state = ours.set_timesteps(n, sample_shape=SHAPE)
    x = jnp.asarray(ref_xs[0]) * ours.init_noise_sigma(state)
    xs = scan_samples(ours, state, x)
    assert xs.shape == (len(ref_xs) - 1, *SHAPE)
    for i, (a, b) in enumerate(zip(xs, ref_xs[1:])):
        scale = 1 + max(ref_scales[:i + 1])
        err = float(np.abs(a - b).max())
        _record(name, scan_abs=err, scan_scaled=err / scale)
        assert err <= 1e-5 * scale, f"scan, after call {i}: max error {err:.3g} at scale {scale:.3g}"


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("n", PNDM_STEPS)
@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("spacing", SPACINGS)
def test_pndm_parity(spacing, prediction, n):
    """PLMS: n + 1 model calls (1 for n = 1), the redo call, the 2-, 3- and 4-output rules."""
    config = dict(PLMS, steps_offset=1, timestep_spacing=spacing, prediction_type=prediction)
    assert_parity("PNDMScheduler", config, n)
    assert_scan_parity("PNDMScheduler", config, n)


PNDM_EXTRA = {
    "sd15": {k: v for k, v in SD15_SCHEDULER_CONFIG.items() if not k.startswith("_")},
    "defaults": dict(skip_prk_steps=True),  # linear betas, leading, steps_offset 0
    "alpha-to-one": dict(PLMS, set_alpha_to_one=True, timestep_spacing="trailing"),
    "cosine": dict(beta_schedule="squaredcos_cap_v2", skip_prk_steps=True, timestep_spacing="linspace"),
}


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("n", PNDM_STEPS)
@pytest.mark.parametrize("variant", sorted(PNDM_EXTRA))
def test_pndm_parity_options(variant, n):
    assert_parity("PNDMScheduler", PNDM_EXTRA[variant], n)
    assert_scan_parity("PNDMScheduler", PNDM_EXTRA[variant], n)


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("start", [1, 2, 5])
@pytest.mark.parametrize("spacing", ["leading", "linspace"])
def test_pndm_loop_from_a_later_call_matches_diffusers(spacing, start):
    """img2img starts the loop at a later call with a fresh state: like diffusers' counter, the
    redo and multistep rules count the calls made, not the index."""
    config = dict(PLMS, steps_offset=1, timestep_spacing=spacing)
    ref = diffusers.PNDMScheduler.from_config(config)
    ref.set_timesteps(10)
    ours = load_scheduler({"_class_name": "PNDMScheduler", **config})
    state = ours.set_timesteps(10, sample_shape=SHAPE)
    rng = np.random.default_rng(4)
    clean, noise = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2))
    t = ref.timesteps[start:start + 1].repeat(SHAPE[0])
    x = ref.add_noise(torch.from_numpy(clean), torch.from_numpy(noise), t)
    got_x = ours.add_noise(state, jnp.asarray(clean), jnp.asarray(noise), start)
    np.testing.assert_allclose(np.asarray(got_x), x.numpy(), rtol=1e-6, atol=1e-5)
    want = []
    for t in ref.timesteps[start:]:
        x = ref.step(torch.from_numpy(fake_model(x.numpy(), float(t))), t, x).prev_sample
        want.append(x.numpy())
    got = scan_samples(ours, state, got_x, start)
    assert got.shape == (len(want), *SHAPE)
    for i, (a, b) in enumerate(zip(got, want)):
        err = float(np.abs(a - b).max())
        assert err <= 1e-5 * (1 + np.abs(b).max()), f"call {start + i}: max error {err:.3g}"


@needs_reference
@pytest.mark.parametrize("spacing", SPACINGS)
def test_pndm_num_model_calls_matches_diffusers(spacing):
    """num_model_calls(n) is diffusers' len(timesteps) after set_timesteps(n), for every n, and
    the length of our state's timesteps: n + 1 (1 for n = 1). For 62 values of n (61, 103, ...)
    the trailing spacing's float ``arange`` yields one timestep too many, -1; diffusers counts
    it (and would index alpha-bar[-1]); set_timesteps refuses those n, as for DDIM."""
    config = dict(PLMS, timestep_spacing=spacing)
    ref = diffusers.PNDMScheduler.from_config(config)
    ours = load_scheduler({"_class_name": "PNDMScheduler", **config})
    refused = []
    for n in range(1, 1001):
        ref.set_timesteps(n)
        calls = ours.num_model_calls(n)
        assert calls == len(ref.timesteps), n
        if ref.timesteps.min() < 0:
            refused.append(n)
            with pytest.raises(ValueError, match="outside"):
                ours.set_timesteps(n, sample_shape=SHAPE)
            continue
        assert calls == (n + 1 if n > 1 else 1), n
        if n in (1, 2, 3, 5, 20, 50, 999, 1000) or n % 97 == 0:
            state = ours.set_timesteps(n, sample_shape=(1,))  # (each new shape costs ~15 ms)
            assert state.timesteps.shape == (calls,), n
    assert len(refused) == (62 if spacing == "trailing" else 0)
    with pytest.raises(ValueError, match="num_inference_steps"):
        ours.num_model_calls(0)


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_lightning_presets_match_diffusers(name):
    """A Lightning preset is diffusers' SDXL scheduler with trailing spacing (x0 for 1 step)."""
    preset = get_preset(name)
    config = dict(SDXL_BASE_SCHEDULER_CONFIG, timestep_spacing="trailing")
    if preset.num_inference_steps == 1:
        config["prediction_type"] = "sample"
    assert dict(preset.scheduler_config) == config
    assert preset.guidance_scale == 0
    assert_parity("EulerDiscreteScheduler", config, preset.num_inference_steps)


@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("name,config", [
    ("EulerDiscreteScheduler", dict(SD, timestep_spacing="trailing")),
    ("EulerAncestralDiscreteScheduler", dict(SD, timestep_spacing="leading", steps_offset=1)),
    ("DDIMScheduler", dict(SD, timestep_spacing="leading", steps_offset=1)),
    ("DPMSolverMultistepScheduler", dict(SD, use_karras_sigmas=True)),
    ("LCMScheduler", dict(SD)),
    ("PNDMScheduler", dict(PLMS, timestep_spacing="leading", steps_offset=1)),
    ("UniPCMultistepScheduler", dict(SD, use_karras_sigmas=True)),
])
def test_add_noise_parity(name, config):
    """add_noise(step i) is diffusers' add_noise at timesteps[i] (the img2img starting point)."""
    ref = getattr(diffusers, name).from_config(config)
    ref.set_timesteps(8)
    ours = load_scheduler({"_class_name": name, **config})
    state = ours.set_timesteps(8, sample_shape=SHAPE)
    rng = np.random.default_rng(3)
    x0, noise = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2))
    for i in (0, 3, 7):
        t = ref.timesteps[i:i + 1].repeat(SHAPE[0])
        want = ref.add_noise(torch.from_numpy(x0), torch.from_numpy(noise), t).numpy()
        got = np.asarray(ours.add_noise(state, jnp.asarray(x0), jnp.asarray(noise), i))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


# --------------------------------------------------------------------------------------------
# jit and lax.scan.
# --------------------------------------------------------------------------------------------

def jax_fake_model(x: jax.Array, t: jax.Array) -> jax.Array:
    return 0.8 * jnp.tanh(0.5 * x) + 0.2 * jnp.sin(0.3 * x + 0.01 * t.astype(jnp.float32))


def python_loop(scheduler, state, x, key):
    keys = jax.random.split(key, state.timesteps.shape[0])
    for i in range(state.timesteps.shape[0]):
        model_in = scheduler.scale_model_input(state, x, i)
        out = jax_fake_model(model_in, scheduler.timestep_for_model(state, i))
        state, x = scheduler.step(state, out, x, i, key=keys[i])
    return x


def scan_loop(scheduler, state, x, key):
    keys = jax.random.split(key, state.timesteps.shape[0])

    def body(carry, inputs):
        state, x = carry
        i, k = inputs
        model_in = scheduler.scale_model_input(state, x, i)
        out = jax_fake_model(model_in, scheduler.timestep_for_model(state, i))
        return scheduler.step(state, out, x, i, key=k), None

    steps = jnp.arange(state.timesteps.shape[0], dtype=jnp.int32)
    (_, x), _ = jax.lax.scan(body, (state, x), (steps, keys))
    return x


def test_lightning_4step_scan_matches_python_loop():
    scheduler = load_scheduler("lightning-4step")
    preset = get_preset("lightning-4step")
    state = scheduler.set_timesteps(preset.num_inference_steps, sample_shape=SHAPE)
    np.testing.assert_array_equal(np.asarray(state.timesteps), [999, 749, 499, 249])
    key = jax.random.key(0)
    x = jax.random.normal(jax.random.key(1), SHAPE) * scheduler.init_noise_sigma(state)
    want = python_loop(scheduler, state, x, key)
    got = jax.jit(scan_loop, static_argnums=0)(scheduler, state, x, key)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,config", [
    ("EulerAncestralDiscreteScheduler", dict(SD, timestep_spacing="trailing")),
    ("DDIMScheduler", dict(SD, timestep_spacing="trailing")),
    ("DPMSolverMultistepScheduler", dict(SD, use_karras_sigmas=True)),
    ("LCMScheduler", dict(SD)),
    ("PNDMScheduler", dict(PLMS, timestep_spacing="leading", steps_offset=1)),
    ("PNDMScheduler", dict(PLMS, timestep_spacing="linspace", prediction_type="v_prediction")),
    ("UniPCMultistepScheduler", dict(SD, use_karras_sigmas=True)),
    ("DPMSolverMultistepScheduler", dict(SD, use_karras_sigmas=True, algorithm_type="sde-dpmsolver++")),
])
def test_scan_matches_python_loop(name, config):
    """Every sampler's step works with a traced step index inside a jitted lax.scan."""
    scheduler = load_scheduler({"_class_name": name, **config})
    state = scheduler.set_timesteps(6, sample_shape=SHAPE)
    key = jax.random.key(2)
    x = jax.random.normal(jax.random.key(3), SHAPE) * scheduler.init_noise_sigma(state)
    want = python_loop(scheduler, state, x, key)
    got = jax.jit(scan_loop, static_argnums=0)(scheduler, state, x, key)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_ancestral_noise_from_key_is_standard_normal():
    scheduler = EulerAncestralDiscreteScheduler(**SD)
    state = scheduler.set_timesteps(4)
    x = jnp.zeros(SHAPE)
    out = jnp.zeros(SHAPE)
    key = jax.random.key(5)
    _, a = scheduler.step(state, out, x, 0, key=key)
    _, b = scheduler.step(state, out, x, 0, noise=jax.random.normal(key, SHAPE))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="key"):
        scheduler.step(state, out, x, 0)


def test_schedulers_are_hashable_static_arguments():
    a = load_scheduler("lightning-4step")
    b = EulerDiscreteScheduler.from_config(dict(SDXL_BASE_SCHEDULER_CONFIG, timestep_spacing="trailing"))
    assert a == b and hash(a) == hash(b)
    c = load_scheduler(SD15_SCHEDULER_CONFIG)
    d = PNDMScheduler(**{k: v for k, v in SD15_SCHEDULER_CONFIG.items()
                         if not k.startswith("_") and k != "clip_sample"})
    assert c == d and hash(c) == hash(d) and c != PNDMScheduler(skip_prk_steps=True)


# --------------------------------------------------------------------------------------------
# Configs, presets and errors.
# --------------------------------------------------------------------------------------------

def test_presets():
    assert sorted(PRESETS) == ["lightning-1step", "lightning-2step", "lightning-4step", "lightning-8step"]
    for name, preset in PRESETS.items():
        assert isinstance(preset, Preset)
        assert preset.num_inference_steps == int(name.split("-")[1].removesuffix("step"))
        assert preset.guidance_scale == 0.0
        scheduler = load_scheduler(name)
        assert isinstance(scheduler, EulerDiscreteScheduler)
        assert scheduler.timestep_spacing == "trailing"
        assert scheduler.prediction_type == ("sample" if preset.num_inference_steps == 1 else "epsilon")
    with pytest.raises(ValueError, match="lightning-4step"):
        get_preset("lightning-3step")


def test_load_scheduler_from_files(tmp_path):
    (tmp_path / "model" / "scheduler").mkdir(parents=True)
    path = tmp_path / "model" / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps(dict(SDXL_BASE_SCHEDULER_CONFIG)))
    want = EulerDiscreteScheduler.from_config(SDXL_BASE_SCHEDULER_CONFIG)
    for source in (path, str(path), path.parent, tmp_path / "model"):
        assert load_scheduler(source) == want
    with pytest.raises(ValueError, match="scheduler_config.json"):
        load_scheduler(tmp_path)
    with pytest.raises(ValueError, match="preset"):
        load_scheduler("no-such-preset")


def test_load_a_unipc_scheduler_folder(tmp_path):
    """A model folder whose scheduler_config.json names UniPCMultistepScheduler (as diffusers'
    ``save_pretrained`` writes it after ``pipe.scheduler = UniPCMultistepScheduler...``)."""
    ref = diffusers.UniPCMultistepScheduler.from_config(dict(SDXL_BASE_SCHEDULER_CONFIG)) \
        if diffusers is not None else None
    config = dict(ref.config) if ref is not None else dict(
        SDXL_BASE_SCHEDULER_CONFIG, _class_name="UniPCMultistepScheduler")
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    scheduler = load_scheduler(tmp_path)
    assert scheduler == UniPCMultistepScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1,
        timestep_spacing="leading")
    assert (scheduler.solver_type, scheduler.solver_order, scheduler.lower_order_final) == ("bh2", 2, True)


def test_load_sd15_scheduler_config(tmp_path):
    """Stable Diffusion 1.5's scheduler folder gives PLMS (its `clip_sample` is DDIM's: ignored)."""
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(SD15_SCHEDULER_CONFIG))
    scheduler = load_scheduler(tmp_path)
    assert isinstance(scheduler, PNDMScheduler)
    assert scheduler == PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                      skip_prk_steps=True, steps_offset=1, set_alpha_to_one=False)
    assert scheduler.timestep_spacing == "leading" and scheduler.prediction_type == "epsilon"
    assert scheduler.num_model_calls(50) == 51
    state = scheduler.set_timesteps(50, sample_shape=SHAPE)
    assert isinstance(state, PNDMState)
    np.testing.assert_array_equal(np.asarray(state.timesteps)[:4], [981, 961, 961, 941])
    assert int(state.timesteps[-1]) == 1
    assert float(scheduler.init_noise_sigma(state)) == 1.0
    x = jnp.ones(SHAPE)
    assert scheduler.scale_model_input(state, x, 3) is x
    assert int(scheduler.timestep_for_model(state, jnp.int32(2))) == 961


def test_num_model_calls_is_the_state_length():
    """One model call per step, except PLMS (one more; the redo of the first step)."""
    for name in SAMPLERS:
        scheduler = load_scheduler({"_class_name": name, **SD, **BASE_CONFIGS.get(name, {})})
        for n in (1, 2, 4, 25):
            calls = scheduler.num_model_calls(n)
            assert calls == scheduler.set_timesteps(n, sample_shape=SHAPE).timesteps.shape[0]
            assert calls == (n + 1 if name == PNDM and n > 1 else n)
        with pytest.raises(ValueError, match="num_inference_steps"):
            scheduler.num_model_calls(0)


def test_config_keys_of_other_schedulers_are_ignored():
    """SDXL's Euler config carries DDIM/PNDM keys that diffusers ignores; so do we."""
    scheduler = load_scheduler(dict(SDXL_BASE_SCHEDULER_CONFIG))
    assert scheduler.steps_offset == 1 and scheduler.timestep_spacing == "leading"
    dpm = load_scheduler(dict(SDXL_BASE_SCHEDULER_CONFIG, _class_name="DPMSolverMultistepScheduler",
                              use_karras_sigmas=True, algorithm_type="dpmsolver++"))
    assert isinstance(dpm, DPMSolverMultistepScheduler) and dpm.use_karras_sigmas


SAMPLERS = ("EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler", "DDIMScheduler",
            "DPMSolverMultistepScheduler", "LCMScheduler", "PNDMScheduler",
            "UniPCMultistepScheduler")
EULER, ANCESTRAL, DDIM, DPM, LCM, PNDM, UNIPC = SAMPLERS
# What a sampler needs beyond its defaults to be built (diffusers' PNDM default is the
# Runge-Kutta warm-up, which is not implemented).
BASE_CONFIGS = {PNDM: {"skip_prk_steps": True}}
BAD_CONFIGS = [
    ({"_class_name": "HeunDiscreteScheduler"}, "_class_name"),
    ({"beta_schedule": "scaled_linear"}, "_class_name"),
    ({"_class_name": EULER, "timestep_spacing": "uniform"}, "timestep_spacing.*linspace"),
    ({"_class_name": DDIM, "timestep_spacing": "karras"}, "timestep_spacing.*trailing"),
    ({"_class_name": EULER, "beta_schedule": "sigmoid"}, "beta_schedule.*squaredcos_cap_v2"),
    ({"_class_name": EULER, "prediction_type": "flow_prediction"}, "prediction_type.*epsilon"),
    ({"_class_name": ANCESTRAL, "prediction_type": "sample"}, "prediction_type.*v_prediction"),
    ({"_class_name": EULER, "interpolation_type": "log_linear"}, "interpolation_type.*linear"),
    ({"_class_name": EULER, "use_exponential_sigmas": True}, "use_exponential_sigmas"),
    ({"_class_name": EULER, "timestep_type": "continuous"}, "timestep_type.*discrete"),
    ({"_class_name": EULER, "final_sigmas_type": "one"}, "final_sigmas_type.*sigma_min"),
    ({"_class_name": EULER, "beta_shedule": "linear"}, "unknown config key `beta_shedule`"),
    ({"_class_name": DDIM, "thresholding": True}, "thresholding.*False"),
    ({"_class_name": DPM, "algorithm_type": "dpmsolver"}, "algorithm_type.*dpmsolver\\+\\+"),
    ({"_class_name": DPM, "solver_order": 3}, "solver_order.*1, 2"),
    ({"_class_name": DPM, "solver_type": "bh2"}, "solver_type.*midpoint"),
    ({"_class_name": DPM, "variance_type": "learned_range"}, "variance_type"),
    ({"_class_name": DPM, "use_lu_lambdas": True}, "use_lu_lambdas"),
    ({"_class_name": LCM, "thresholding": True}, "thresholding"),
    ({"_class_name": EULER, "trained_betas": [0.1, 0.2]}, "trained_betas.*num_train_timesteps"),
    ({"_class_name": DDIM, "steps_offset": -1}, "steps_offset"),
    ({"_class_name": LCM, "original_inference_steps": 0}, "original_inference_steps"),
    ({"_class_name": PNDM}, "skip_prk_steps.*true"),
    ({"_class_name": PNDM, "skip_prk_steps": False}, "skip_prk_steps.*true"),
    ({"_class_name": PNDM, "skip_prk_steps": True, "prediction_type": "sample"},
     "prediction_type.*v_prediction"),
    ({"_class_name": PNDM, "skip_prk_steps": True, "rescale_betas_zero_snr": True}, "rescale_betas_zero_snr"),
    ({"_class_name": PNDM, "skip_prk_steps": True, "timestep_spacing": "karras"},
     "timestep_spacing.*trailing"),
    ({"_class_name": PNDM, "skip_prk_steps": True, "set_alpha_to_one": "yes"}, "set_alpha_to_one"),
    ({"_class_name": PNDM, "skip_prk_steps": True, "steps_offset": -1}, "steps_offset"),
    ({"_class_name": PNDM, "skip_prk_steps": True, "pndm_order": 4}, "unknown config key `pndm_order`"),
    ({"_class_name": UNIPC, "solver_order": 3}, "solver_order.*1, 2"),
    ({"_class_name": UNIPC, "solver_type": "bh3"}, "solver_type.*bh1"),
    ({"_class_name": UNIPC, "solver_type": "bh1"}, "bh1.*sigma_min"),
    ({"_class_name": UNIPC, "predict_x0": False}, "predict_x0.*True"),
    ({"_class_name": UNIPC, "disable_corrector": [0]}, "disable_corrector"),
    ({"_class_name": UNIPC, "prediction_type": "flow_prediction"}, "prediction_type.*epsilon"),
    ({"_class_name": UNIPC, "use_flow_sigmas": True}, "use_flow_sigmas"),
    ({"_class_name": UNIPC, "thresholding": True}, "thresholding"),
]


@pytest.mark.parametrize("config,message", BAD_CONFIGS)
def test_bad_configs_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        load_scheduler(config)


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("steps", [0, -1, 1001, 2.5, True])
def test_bad_step_counts_are_refused(name, steps):
    scheduler = load_scheduler({"_class_name": name, **BASE_CONFIGS.get(name, {})})
    with pytest.raises(ValueError, match="num_inference_steps"):
        scheduler.set_timesteps(steps, sample_shape=SHAPE)


def test_lcm_steps_beyond_original_schedule_are_refused():
    with pytest.raises(ValueError, match="original_inference_steps"):
        LCMScheduler().set_timesteps(51)


@pytest.mark.parametrize("scheduler", [DPMSolverMultistepScheduler(), PNDMScheduler(skip_prk_steps=True),
                                       UniPCMultistepScheduler()], ids=["dpm_solver", "pndm", "unipc"])
def test_multistep_samplers_need_sample_shape(scheduler):
    with pytest.raises(ValueError, match="sample_shape"):
        scheduler.set_timesteps(10)


@pytest.mark.parametrize("name", [DDIM, PNDM])
def test_steps_offset_past_the_schedule_is_refused(name):
    scheduler = load_scheduler({"_class_name": name, "steps_offset": 1, **BASE_CONFIGS.get(name, {})})
    with pytest.raises(ValueError, match="steps_offset"):
        scheduler.set_timesteps(1000, sample_shape=SHAPE)


@pytest.mark.parametrize("name", SAMPLERS)
def test_step_keeps_the_sample_dtype(name):
    """A bfloat16 sample stays bfloat16 (the lax.scan carry keeps its type); maths is float32."""
    scheduler = load_scheduler({"_class_name": name, **SD, **BASE_CONFIGS.get(name, {})})
    state = scheduler.set_timesteps(4, sample_shape=SHAPE)
    x = jnp.ones(SHAPE, jnp.bfloat16)
    new_state, out = scheduler.step(state, jnp.ones(SHAPE, jnp.bfloat16), x, 0, noise=jnp.zeros(SHAPE))
    assert out.dtype == jnp.bfloat16
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(state)):
        assert a.shape == b.shape and a.dtype == b.dtype


# --------------------------------------------------------------------------------------------
# Samplers by name (maxdiff/schedulers/names.py).
# --------------------------------------------------------------------------------------------

@pytest.mark.parity
@needs_reference
@pytest.mark.parametrize("name", sorted(SAMPLER_NAMES))
def test_a_sampler_name_is_diffusers_from_config(name, monkeypatch):
    """Each name is diffusers' ``Class.from_config(model_config, **keys)``, the way its docs map
    A1111's names: the SDXL base config switched by it builds the scheduler diffusers builds
    (every argument equal) and runs as diffusers' does."""
    sampler = SAMPLER_NAMES[name]
    config = sampler_config(name, SDXL_BASE_SCHEDULER_CONFIG)
    assert config["_class_name"] == sampler.class_name
    ours = load_scheduler(config)
    assert type(ours).__name__ == sampler.class_name
    ref = getattr(diffusers, sampler.class_name).from_config(dict(SDXL_BASE_SCHEDULER_CONFIG),
                                                             **sampler.settings)
    for field in dataclasses.fields(ours):  # (diffusers' PNDM has no rescale_betas_zero_snr)
        if field.name in ref.config:
            assert getattr(ours, field.name) == ref.config[field.name], field.name
    stochastic = monkeypatch if ours.stochastic else None
    assert_parity(sampler.class_name, {k: v for k, v in config.items() if not k.startswith("_")},
                  8, stochastic, timestep_atol=1e-3 if name == "euler_karras" else 0.0)


@pytest.mark.parametrize("spellings", [
    ("dpmpp_2m_karras", "DPM++ 2M Karras", "dpm++2m-karras", " Dpm++ 2m  KARRAS ", "DPMPP-2M-Karras"),
    ("dpmpp_2m", "DPM++ 2M", "dpm++_2m"),
    ("euler_a", "Euler a", "euler_ancestral", "Euler Ancestral", "EULER-A"),
    ("euler", "Euler"),
    ("pndm", "PLMS", "plms"),
    ("unipc", "UniPC", "uni_pc", "uni_pc_bh2"),
    ("unipc_karras", "UniPC Karras"),
    ("UniPCMultistepScheduler", "unipcmultistepscheduler"),
    ("DPMSolverMultistepScheduler", "dpm_solver_multistep_scheduler"),
])
def test_sampler_names_match_loosely(spellings):
    found = {find_sampler(s) for s in spellings}
    assert len(found) == 1 and None not in found, spellings


def test_sampler_names_cover_what_the_brief_lists():
    for name in ("euler", "euler_a", "dpmpp_2m", "dpmpp_2m_karras", "ddim", "lcm", "unipc", "pndm",
                 "Euler a", "DPM++ 2M Karras", *SCHEDULERS):
        assert find_sampler(name) is not None, name
    for cls in SCHEDULERS:  # a class name alone: the model's config, that class
        assert get_sampler(cls).class_name == cls


def test_a_sampler_keeps_the_models_schedule():
    """The model's training schedule stays (betas, prediction type, spacing, zero SNR); the
    name decides the sampler, Karras sigmas included, whatever the model's config said."""
    model = dict(SD, _class_name="EulerDiscreteScheduler", prediction_type="v_prediction",
                 rescale_betas_zero_snr=True, timestep_spacing="trailing", steps_offset=1,
                 use_karras_sigmas=True, clip_sample=True)
    for name, karras in (("dpmpp_2m", False), ("DPM++ 2M Karras", True), ("unipc", False),
                         ("unipc_karras", True), ("euler", False), ("euler_karras", True)):
        sched = load_scheduler(name, base=model)
        assert sched.use_karras_sigmas is karras, name
        assert (sched.prediction_type, sched.rescale_betas_zero_snr, sched.timestep_spacing,
                sched.beta_schedule, sched.beta_end) == ("v_prediction", True, "trailing",
                                                         "scaled_linear", 0.012), name
    ddim = load_scheduler("ddim", base=model)
    assert isinstance(ddim, DDIMScheduler) and ddim.clip_sample is False  # latents: never clipped
    assert load_scheduler("DDIMScheduler", base=model).clip_sample is True  # diffusers' from_config
    dpm = load_scheduler("dpmpp_2m", base=dict(model, algorithm_type="sde-dpmsolver++"))
    assert (dpm.solver_order, dpm.solver_type) == (2, "midpoint")


def test_a_sampler_from_a_loaded_scheduler():
    """``base=`` a loaded scheduler: its ``config`` is the one it was built from, keys of other
    samplers included (SDXL's ``clip_sample`` and ``set_alpha_to_one`` reach DDIM), as diffusers'
    ``scheduler.config``."""
    euler = load_scheduler(dict(SDXL_BASE_SCHEDULER_CONFIG))
    assert euler.config["clip_sample"] is False and euler.config["use_karras_sigmas"] is False
    assert euler.config["_class_name"] == "EulerDiscreteScheduler"
    ddim = load_scheduler("DDIMScheduler", base=euler)
    assert ddim == load_scheduler(dict(SDXL_BASE_SCHEDULER_CONFIG, _class_name="DDIMScheduler"))
    assert (ddim.clip_sample, ddim.set_alpha_to_one, ddim.steps_offset) == (False, False, 1)
    assert load_scheduler("unipc", base=load_scheduler("lightning-4step")).timestep_spacing == "trailing"
    built = UniPCMultistepScheduler(**SD)  # built by its constructor: its own arguments
    assert load_scheduler(dict(built.config)) == built
    assert load_scheduler("euler", base=built).beta_schedule == "scaled_linear"


def test_diffusers_default_values_are_left_out():
    """A diffusers ``scheduler.config`` lists in ``_use_default_values`` the keys it did not
    set: the new class takes its own defaults there, as diffusers' ``from_config`` does."""
    base = dict(SD, _class_name="EulerDiscreteScheduler", final_sigmas_type="sigma_min",
                _use_default_values=["final_sigmas_type"])
    config = sampler_config("unipc", base)
    assert "final_sigmas_type" not in config and "_use_default_values" not in config
    assert sampler_config("unipc", dict(base, _use_default_values=[]))["final_sigmas_type"] == "sigma_min"


@pytest.mark.parametrize("name,message", [
    ("dpmpp_2m_karas", "unknown sampler 'dpmpp_2m_karas' \\(did you mean 'dpmpp_2m_karras'\\?\\)"),
    ("DPM++ SDE", "DPM\\+\\+ SDE \\(diffusers' DPMSolverSinglestepScheduler\\) is not implemented"),
    ("heun", "HeunDiscreteScheduler.*not implemented"),
    ("dpmpp_3m_sde_karras", "not implemented"),
    ("nonsense", "unknown sampler 'nonsense'; the samplers are euler, .*dpmpp_2m_karras.*unipc.*"
                 "'Euler a'.*'DPM\\+\\+ 2M Karras'.*UniPCMultistepScheduler"),
])
def test_unknown_sampler_names_list_the_choices(name, message):
    with pytest.raises(ValueError, match=message):
        get_sampler(name)
    with pytest.raises(ValueError, match="no preset \\(lightning-1step.*" + message):
        load_scheduler(name, base=dict(SDXL_BASE_SCHEDULER_CONFIG))


def test_a_sampler_name_needs_the_models_config():
    with pytest.raises(ValueError, match="names a sampler.*base="):
        load_scheduler("unipc")
    with pytest.raises(ValueError, match="names a sampler \\(UniPC\\), not a preset.*base=pipe.scheduler"):
        get_preset("unipc")
    with pytest.raises(ValueError, match="base: a scheduler config dict"):
        load_scheduler("unipc", base=3)


def test_resolve_scheduler(tmp_path):
    """What a pipeline loads for its ``scheduler`` argument: None the model's own, a preset
    (with its steps and guidance), a sampler name on the model's config, a dict or a path on
    their own (the model's config is then not read)."""
    model = tmp_path / "scheduler"
    model.mkdir()
    (model / "scheduler_config.json").write_text(json.dumps(dict(SDXL_BASE_SCHEDULER_CONFIG)))
    assert resolve_scheduler(None, model) == (load_scheduler(dict(SDXL_BASE_SCHEDULER_CONFIG)), None)
    sched, preset = resolve_scheduler("lightning-4step", model)
    assert preset is get_preset("lightning-4step") and sched == load_scheduler("lightning-4step")
    sched, preset = resolve_scheduler("DPM++ 2M Karras", model)
    assert preset is None and sched == load_scheduler(
        sampler_config("dpmpp_2m_karras", SDXL_BASE_SCHEDULER_CONFIG))
    missing = tmp_path / "no-model"
    dpm = dict(SD, _class_name="DPMSolverMultistepScheduler")
    assert resolve_scheduler(dpm, missing) == (load_scheduler(dpm), None)
    assert resolve_scheduler(str(model), missing)[0] == load_scheduler(model)
    with pytest.raises(ValueError, match="model's scheduler config .*no-model'. no such file"):
        resolve_scheduler("unipc", missing)


def test_runtime_code_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, maxdiff.schedulers; assert not {'torch', 'diffusers'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
