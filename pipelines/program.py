"""What every compiled program shares (text-to-image, image editing, the step engine), one copy
each: how an image's seed becomes its noise, how a batch is padded and placed on the mesh, how
the device's pixels become the caller's images, classifier-free guidance (:func:`guide`), the
denoising loop over a range of scheduler steps (:func:`denoise`: text-to-image, editing,
ControlNet, the SDXL refiner's two stages) and where diffusers' ``denoising_end`` /
``denoising_start`` cut a schedule (:func:`end_step`, :func:`start_step_at`). A change here
changes all of them alike, so an image keeps its pixels whichever way it was made.

Noise: image ``i``'s seed makes one PRNG key, split into ``n`` keys (two for text-to-image and
the step engine: initial noise, step noise; four for editing: add-noise noise, the image's
posterior draw, the masked image's, step noise). Step ``k``'s noise (ancestral samplers, LCM)
is drawn from ``fold_in(step_key, k)``, so it depends on neither the batch nor the step the
image joined at.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxdiff import mesh as meshlib

__all__ = ["image_keys", "normal", "step_noise", "pad_rows", "BatchPut", "host_images", "guide",
           "denoise", "cutoff_timestep", "end_step", "start_step_at"]


def image_keys(seeds: jax.Array, n: int = 2) -> tuple[jax.Array, ...]:
    """``n`` per-image key arrays (B,) from per-image uint32 seeds (B,)."""
    keys = jax.vmap(jax.random.key)(seeds)
    return jax.vmap(lambda k: tuple(jax.random.split(k, n)))(keys)


def normal(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """One standard normal array of ``shape`` per key: (B, *shape)."""
    return jax.vmap(lambda k: jax.random.normal(k, shape))(keys)


def step_noise(keys: jax.Array, step: Any, shape: tuple[int, ...]) -> jax.Array:
    """Step noise (B, *shape): image ``b`` draws from ``fold_in(keys[b], step[b])``; ``step``
    is one step index for all or one per image."""
    step = jnp.broadcast_to(jnp.asarray(step), keys.shape[:1])
    return jax.vmap(lambda k, i: jax.random.normal(jax.random.fold_in(k, i), shape))(keys, step)


def pad_rows(a: np.ndarray | None, size: int, axis: int = 0) -> np.ndarray | None:
    """``a`` with its last row along ``axis`` repeated up to ``size`` rows (padding rows are
    computed and dropped, so they repeat a real image rather than add a new shape)."""
    if a is None or a.shape[axis] == size:
        return a
    last = np.take(a, [-1], axis=axis)
    return np.concatenate([a, np.repeat(last, size - a.shape[axis], axis=axis)], axis=axis)


class BatchPut:
    """Places per-image host arrays on the mesh, padded to ``size`` rows and split over its data
    axis (``ids=True``: token ids, (encoders, N, tokens), whose images are axis 1)."""

    def __init__(self, mesh, size: int):
        self.size = size
        self.rows = meshlib.batch_sharded(mesh)
        self.ids_rows = jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(None, meshlib.DATA))

    def __call__(self, a, ids: bool = False):
        if a is None:
            return None
        sharding = self.ids_rows if ids else self.rows
        return jax.device_put(pad_rows(np.asarray(a), self.size, 1 if ids else 0), sharding)

    def tree(self, tree):
        """A pytree of per-image arrays (a batch of scheduler states), each placed as a row."""
        return jax.device_put(jax.tree.map(lambda a: pad_rows(np.asarray(a), self.size), tree),
                              self.rows)


def host_images(out, n: int, output_type: str) -> Sequence:
    """The first ``n`` images of a program's pixels on the host: PIL images for ``"pil"``, else
    the array (uint8 or float32 [0, 1]) as the program made it. Waits for the device."""
    images = np.asarray(jax.device_get(out))[:n]
    if output_type == "pil":
        from PIL import Image

        return [Image.fromarray(im) for im in images]
    return images


def guide(out, cfg: bool, g, r):
    """The UNet's output (float32) -> the guided prediction: ``uncond + g * (text - uncond)``,
    then guidance rescale where ``r > 0`` (Lin et al. 2023, "Common Diffusion Noise Schedules
    and Sample Steps are Flawed", eq. 15-16, with torch's unbiased std)."""
    if not cfg:
        return out
    uncond, text = jnp.split(out, 2)
    out = uncond + g * (text - uncond)
    std_text = jnp.std(text, axis=(1, 2, 3), keepdims=True, ddof=1)
    std_cfg = jnp.std(out, axis=(1, 2, 3), keepdims=True, ddof=1)
    return jnp.where(r > 0, r * out * (std_text / std_cfg) + (1 - r) * out, out)


def denoise(sched, model, x, state, start, end, *, cfg: bool, g, r, step_keys, shape,
            extra=None, after_step=None):
    """Scheduler steps ``start`` .. ``end - 1`` (model calls) on latents ``x`` (B, h, w, C):
    scale the input, append ``extra`` channels (a 9-channel inpainting UNet's mask and masked
    image), double the batch for CFG, ``model(xin, t, i)`` (the UNet, with whatever it needs
    at step ``i``), :func:`guide` with ``g`` / ``r`` (B, 1, 1, 1), step noise from
    ``step_keys`` for stochastic samplers, the scheduler step, then
    ``after_step(i, state, x) -> x`` (inpainting's blend). Returns the latents.

    Python int bounds run a ``lax.scan`` over ``arange(start, end)``; traced bounds (an edit's
    start step, a base's ``denoising_end``, a refiner's ``denoising_start``) a
    ``lax.fori_loop``, so one program serves every start and end. The scheduler state starts
    from ``state`` (a fresh one at a later ``start`` takes first-order steps first, as
    diffusers' ``set_begin_index`` leaves it).

    Text-to-image, image-to-image, inpainting and ControlNet had a copy of this loop each;
    moving them here left their lowered programs byte-identical (sha256 of
    ``jax.jit(f).lower(...).as_text()`` before and after, tiny SDXL: img2img with Euler and
    Euler ancestral, 4-channel inpainting, text-to-image, one ControlNet)."""
    stochastic = sched.stochastic

    def step(i, x, state):
        xin = sched.scale_model_input(state, x, i)
        if extra is not None:
            xin = jnp.concatenate([xin, extra], axis=-1)
        t = sched.timestep_for_model(state, i)
        if cfg:
            xin = jnp.concatenate([xin, xin])
        out = guide(model(xin, t, i).astype(jnp.float32), cfg, g, r)
        noise = None
        if stochastic:
            noise = step_noise(step_keys, i, shape)
        state, x = sched.step(state, out, x, i, noise=noise)
        if after_step is not None:
            x = after_step(i, state, x)
        return x, state

    if isinstance(start, int) and isinstance(end, int):
        def scan_body(carry, i):
            return step(i, *carry), None

        steps = jnp.arange(end, dtype=jnp.int32) if start == 0 else jnp.arange(
            start, end, dtype=jnp.int32)
        (x, _), _ = jax.lax.scan(scan_body, (x, state), steps)
        return x
    x, _ = jax.lax.fori_loop(start, end, lambda i, carry: step(i, *carry), (x, state))
    return x


def cutoff_timestep(num_train_timesteps: int, fraction: float) -> int:
    """diffusers' ``discrete_timestep_cutoff``: ``int(round(T - fraction * T))``."""
    t = num_train_timesteps
    return int(round(t - fraction * t))


def end_step(timesteps, num_train_timesteps: int, fraction: float) -> int:
    """How many of a schedule's model calls a base stopped at ``denoising_end=fraction`` runs
    (diffusers' ``StableDiffusionXLPipeline``: the timesteps ``>= cutoff``)."""
    cut = cutoff_timestep(num_train_timesteps, fraction)
    return int(np.sum(np.asarray(timesteps) >= cut))


def start_step_at(timesteps, num_train_timesteps: int, fraction: float) -> int:
    """The first model call a pipeline started at ``denoising_start=fraction`` runs (diffusers'
    ``StableDiffusionXLImg2ImgPipeline.get_timesteps``: it runs the timesteps ``< cutoff``,
    the last ones of the schedule; first-order samplers only, as maxdiff's all are)."""
    ts = np.asarray(timesteps)
    cut = cutoff_timestep(num_train_timesteps, fraction)
    return int(len(ts) - np.sum(ts < cut))
