"""Diffusion samplers as pure JAX functions of a small state.

Each sampler is a frozen dataclass built from a diffusers ``scheduler_config.json``; its
``set_timesteps(n)`` computes the schedule on the host and returns a pytree state, and every
other method is a pure function of ``(state, arrays, step_index)`` usable inside ``jax.jit`` and
``lax.scan`` (``step_index`` may be traced). A denoising loop::

    scheduler = load_scheduler("lightning-4step")
    state = scheduler.set_timesteps(4, sample_shape=latents.shape)
    x = noise * scheduler.init_noise_sigma(state)

    def body(carry, i):
        state, x = carry
        t = scheduler.timestep_for_model(state, i)
        eps = unet(scheduler.scale_model_input(state, x, i), t)
        return scheduler.step(state, eps, x, i), None

    (state, x), _ = jax.lax.scan(body, (state, x), jnp.arange(state.timesteps.shape[0]))

The loop runs ``state.timesteps.shape[0]`` model calls, which is not always the number of
inference steps: PLMS (``pndm``) makes ``n + 1`` calls for ``n`` steps. A caller that must know
the count before building the state (e.g. to size a compiled loop) asks
``scheduler.num_model_calls(n)``, equal to ``set_timesteps(n).timesteps.shape[0]`` for every
sampler.

Every step is elementwise in the sample, so any layout works (maxdiff keeps latents NHWC).
Samplers: ``euler`` (Euler), ``euler_ancestral``, ``ddim``, ``dpm_solver`` (DPM-Solver++ 2M,
with Karras sigmas "DPM++ 2M Karras", and its SDE variant "DPM++ 2M SDE"), ``lcm``, ``pndm``
(PLMS, Stable Diffusion 1.5's default), ``unipc`` (UniPC). Named presets (a config with its
steps and guidance) live in ``presets``; the names people type for samplers ("DPM++ 2M
Karras", ``euler_a``, ``unipc``), each a change to a model's own scheduler config, in
``names``::

    pipe.scheduler = load_scheduler("dpmpp_2m_karras", base=pipe.scheduler)
"""

from maxdiff.sampler_names import SAMPLERS, Sampler, find_sampler, get_sampler, sampler_config
from maxdiff.schedulers.common import AlphaState, Scheduler, SigmaState, max_inference_steps
from maxdiff.schedulers.ddim import DDIMScheduler
from maxdiff.schedulers.dpm_solver import DPMSolverMultistepScheduler, DPMSolverState
from maxdiff.schedulers.euler import EulerDiscreteScheduler
from maxdiff.schedulers.euler_ancestral import EulerAncestralDiscreteScheduler
from maxdiff.schedulers.lcm import LCMScheduler
from maxdiff.schedulers.loading import (
    SCHEDULERS,
    base_config,
    load_scheduler,
    read_scheduler_config,
    resolve_scheduler,
    scheduler_from_config,
)
from maxdiff.schedulers.pndm import PNDMScheduler, PNDMState
from maxdiff.schedulers.presets import PRESETS, SDXL_BASE_SCHEDULER_CONFIG, Preset, get_preset
from maxdiff.schedulers.unipc import UniPCMultistepScheduler, UniPCState

__all__ = [
    "AlphaState", "DDIMScheduler", "DPMSolverMultistepScheduler", "DPMSolverState",
    "EulerAncestralDiscreteScheduler", "EulerDiscreteScheduler", "LCMScheduler", "PNDMScheduler",
    "PNDMState", "PRESETS", "Preset", "SAMPLERS", "SCHEDULERS", "SDXL_BASE_SCHEDULER_CONFIG",
    "Sampler", "Scheduler", "SigmaState", "UniPCMultistepScheduler", "UniPCState", "base_config",
    "find_sampler", "get_preset", "get_sampler", "load_scheduler", "max_inference_steps",
    "read_scheduler_config", "resolve_scheduler", "sampler_config", "scheduler_from_config",
]
