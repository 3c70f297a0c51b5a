"""What every compiled program shares (every task, the step engine), one copy each: how
programs are made and counted (:func:`jit`, :class:`Programs`), a batch's host inputs
(:class:`HostInputs`) and how they are padded and placed on the mesh (:class:`BatchPut`), the
text conditioning with classifier-free guidance rows (:func:`conditioning`, :func:`cfg_rows`),
how an image's seed becomes its noise, the decode tail (:func:`finish` on the device,
:func:`collect` on the host), the output (:class:`PipelineOutput`) and where diffusers'
``denoising_end`` / ``denoising_start`` cut a schedule (:func:`end_step`, :func:`start_step_at`).
The denoising loop itself is :func:`pipelines.loop.denoise`. A change here changes every task
alike, so an image keeps its pixels whichever way it was made.

Noise: image ``i``'s seed makes one PRNG key, split into ``n`` keys (two for text-to-image and
the step engine: initial noise, step noise; four for editing: add-noise noise, the image's
posterior draw, the masked image's, step noise). Step ``k``'s noise (ancestral samplers, LCM)
is drawn from ``fold_in(step_key, k)``, so it depends on neither the batch nor the step the
image joined at.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxdiff import mesh as meshlib
from maxdiff import target
from pipelines.compile_only import CompileOnly

__all__ = ["jit", "Programs", "HostInputs", "PipelineOutput", "image_keys", "normal",
           "step_noise", "pad_rows", "BatchPut", "host_images", "conditioning", "cfg_rows",
           "cfg_halves", "conditional_half", "guide", "guide_pair", "decode",
           "to_pixels", "finish", "collect", "cutoff_timestep", "end_step", "start_step",
           "start_step_at"]


def jit(mesh, fn, **kwargs):
    """``jax.jit(fn, **kwargs)`` with ``fn`` traced under ``mesh``, so the kernels and
    algorithms chosen inside are those of the mesh's devices (:mod:`maxdiff.target`), whatever
    machine compiles it. Every pipeline program is made here. For a compile-only mesh (a TPU
    topology on a CPU host, :func:`maxdiff.mesh.topology_mesh`) the result compiles when
    called instead of running (:class:`pipelines.compile_only.CompileOnly`)."""
    fn = jax.jit(target.traced_under(mesh, fn), **kwargs)
    return CompileOnly(fn, mesh.size) if meshlib.compile_only(mesh) else fn


class Program:
    """A jitted program that knows how many times it was compiled: once per distinct
    signature of its arguments (tree structure, shapes, dtypes, shardings), which is what makes
    JAX trace and compile it again. An argument that is the very object of the previous call
    (the weights, call after call) keeps its signature: the weights are replaced, never
    mutated, when they change (LoRA), and a call costs a flatten of its new arguments only."""

    def __init__(self, fn):
        self.fn = fn
        self.signatures: set = set()
        self._last: dict[int, tuple] = {}  # argument position -> (object, its signature)

    def __call__(self, *args):
        sig = []
        for k, a in enumerate(args):
            last = self._last.get(k)
            if last is None or last[0] is not a:
                leaves, tree = jax.tree.flatten(a)
                last = self._last[k] = (a, (tree, tuple(map(_leaf_signature, leaves))))
            sig.append(last[1])
        self.signatures.add(tuple(sig))
        return self.fn(*args)


def _leaf_signature(a) -> tuple:
    if isinstance(a, jax.Array):
        return a.shape, a.dtype, a.weak_type, a.sharding
    return np.shape(a), getattr(a, "dtype", type(a).__name__), False, getattr(a, "sharding", None)


class Programs:
    """A pipeline's compiled programs under keys of its own (a key names every static choice
    the program closes over: the task, the scheduler, batch, size, steps, CFG, output kind ...).
    Iterating gives the keys in the order they were made; :attr:`num_compiled` counts the
    compilations (a program called with new argument shapes, e.g. adapter tables, compiles
    again)."""

    def __init__(self, mesh):
        self.mesh = mesh
        self._programs: dict[tuple, Program] = {}

    def get(self, key: tuple, build: Callable[[], Callable], **jit_kwargs) -> Program:
        """The program under ``key``, made from ``build()`` (a function of the program's
        inputs) the first time."""
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = Program(jit(self.mesh, build(), **jit_kwargs))
        return program

    def __iter__(self):
        return iter(self._programs)

    def __len__(self) -> int:
        return len(self._programs)

    def __contains__(self, key) -> bool:
        return key in self._programs

    @property
    def num_compiled(self) -> int:
        return sum(len(p.signatures) for p in self._programs.values())


@jax.tree_util.register_dataclass
@dataclass
class HostInputs:
    """What every task's program takes for its images, made on the host: ``seeds`` (N,)
    uint32; the prompts and the negatives as the program encodes them (``text`` / ``neg_text``,
    :class:`maxdiff.prompts.Text`: token ids, weights, chunks); ``zero_negative`` (N,): an
    omitted negative prompt that is zeros; ``time_ids`` / ``neg_time_ids`` (N, n)
    micro-conditioning (n from the family); ``guidance`` (N,) (1 where an image runs without
    CFG) and ``rescale`` (N,); ``ip_pixels`` / ``ip_scale``: image prompts for an IP-Adapter
    (:mod:`pipelines.ip_adapting`; None without any). ``cfg`` (static): whether the batch runs
    classifier-free guidance (any image's guidance > 1)."""

    seeds: Any
    text: Any
    neg_text: Any
    zero_negative: Any
    time_ids: Any
    neg_time_ids: Any
    guidance: Any
    rescale: Any
    ip_pixels: Any = None  # (N, S, S, 3) an IP-Adapter's CLIP pixels (None: no image prompts)
    ip_scale: Any = None  # (N,) each image's IP-Adapter scale (0: none)
    cfg: bool = field(default=False, metadata={"static": True})

    def chunks(self) -> np.ndarray:
        """(N,) the prompt chunks each image needs (its prompt's or its negative's)."""
        return np.maximum(np.asarray(self.text.used), np.asarray(self.neg_text.used))

    def take(self, idx) -> HostInputs:
        """The images ``idx`` (host arrays; texts cut to what those images need)."""
        return dataclasses.replace(self, **{
            f.name: (getattr(self, f.name).take(idx) if f.name in ("text", "neg_text")
                     else np.asarray(getattr(self, f.name))[idx])
            for f in dataclasses.fields(self)
            if f.name != "cfg" and getattr(self, f.name) is not None})


@dataclass
class PipelineOutput:
    """``images``: PIL images, or float32 NumPy (N, H, W, 3) in [0, 1] for ``output_type="np"``
    (latents (N, C, H/f, W/f) for ``"latent"``); ``seeds``: the seed of each image (pass it back
    as ``seed=`` to reproduce that image); ``timings``: ``prepare_s`` (host work before the
    program), ``generate_s`` (the program and the images' way back), ``batch`` (the padded
    device batch) and what the task adds."""

    images: Any
    seeds: list[int]
    timings: dict[str, float] = field(default_factory=dict)
    # per image, whether the safety checker blacked it out (None: no checker ran; an entry
    # None: the image's ImageRequest turned it off; diffusers' name)
    nsfw_content_detected: list[bool | None] | None = None


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
    axis (every leaf's images are its axis 0)."""

    def __init__(self, mesh, size: int):
        self.size = size
        self.rows = meshlib.batch_sharded(mesh)

    def __call__(self, a):
        if a is None:
            return None
        return meshlib.place(pad_rows(np.asarray(a), self.size), self.rows)

    def tree(self, tree):
        """A pytree of per-image arrays (a batch of scheduler states, a task's rows,
        :class:`HostInputs`; None leaves stay None), each placed as a row."""
        return jax.tree.map(self, tree)


def host_images(out, n: int, output_type: str) -> Sequence:
    """The first ``n`` images of a program's pixels on the host: PIL images for ``"pil"``, else
    the array (uint8 or float32 [0, 1]) as the program made it. Waits for the device. (A
    compile-only program's output is a shape: its images are zeros.)"""
    if isinstance(out, jax.ShapeDtypeStruct):
        images = np.zeros(out.shape, out.dtype)[:n]
    else:
        images = np.asarray(jax.device_get(out))[:n]
    if output_type == "pil":
        from PIL import Image

        return [Image.fromarray(im) for im in images]
    return images


def _per_device(fn, n_out: int):
    """``fn`` over each device's rows of the traced mesh's ``data`` axis (``shard_map``), or
    ``fn`` itself without one: a batch-wise rearrangement that moves no row off its device."""
    shards = target.data_shards()
    if shards == 1:
        return fn
    spec = jax.sharding.PartitionSpec(meshlib.DATA)
    return jax.shard_map(fn, in_specs=spec, out_specs=(spec,) * n_out if n_out > 1 else spec,
                         check_vma=False)


def cfg_rows(uncond, cond):
    """The rows of a classifier-free-guided model call: ``uncond`` then ``cond`` on each device
    (its own images' rows only, so the data-parallel program needs no collective; on one
    device, diffusers' ``[uncond; cond]``). :func:`cfg_halves` undoes it; the model sees each
    row alone, so only this pair must agree on the order."""
    if uncond is None:
        return None
    return _per_device(lambda a, b: jnp.concatenate([a, b]), 1)(uncond, cond)


def cfg_halves(x):
    """(uncond, cond) rows of a :func:`cfg_rows` batch."""
    return _per_device(lambda a: tuple(jnp.split(a, 2)), 2)(x)


def conditional_half(tree):
    """The conditional rows of every array in ``tree`` laid out by :func:`cfg_rows` (Nones
    stay): what a ``cfg_cutoff``'s unguided steps condition on."""
    return jax.tree.map(lambda a: None if a is None else cfg_halves(a)[1], tree)


def denoiser_weights(params, cond):
    """The UNet's weights for a call on ``cond``: ``params["unet"]``, with the IP-Adapter's
    cross-attention layers (``params["ip_adapter"]``) where ``cond`` carries image tokens."""
    if cond.image_tokens is None:
        return params["unet"]
    from maxdiff.ip_adapter import with_layers

    return with_layers(params["unet"], params["ip_adapter"]["layers"])


def conditioning(family, encoders, params, inputs: HostInputs, ad=None, aidx=None,
                 ip_adapter=None):
    """(:class:`maxdiff.family.Cond`, per-row adapter index) for the denoiser: the family's
    text encoding of ``inputs``' prompts, and with ``inputs.cfg`` the rows [negative, positive]
    on each device (:func:`cfg_rows`; a negative without a prompt is zeros where
    ``zero_negative``), as diffusers concatenates them. ``encoders``: {component: module}.
    With image prompts (``inputs.ip_pixels``) and ``ip_adapter`` (its weights in
    ``params["ip_adapter"]``), the image tokens and scales too (:mod:`maxdiff.ip_adapter`)."""
    from maxdiff.family import Cond

    tokens = utokens = None
    if inputs.ip_pixels is not None:
        from maxdiff import ip_adapter as ipa

        tokens, utokens = ipa.image_tokens(ip_adapter, params["ip_adapter"], inputs.ip_pixels,
                                           inputs.cfg)
    cond = dataclasses.replace(family.encode(encoders, params, inputs.text, ad, aidx),
                               time_ids=inputs.time_ids, image_tokens=tokens,
                               image_scale=inputs.ip_scale)
    if not inputs.cfg:
        return cond, aidx
    neg = family.encode(encoders, params, inputs.neg_text, ad, aidx)
    zero = inputs.zero_negative
    uncond = Cond(jnp.where(zero[:, None, None], 0.0, neg.context),
                  jnp.where(zero[:, None], 0.0, neg.pooled), inputs.neg_time_ids, utokens,
                  inputs.ip_scale)
    return (jax.tree.map(cfg_rows, uncond, cond),
            cfg_rows(aidx, aidx))  # the unconditional rows use the image's adapter too


def guide(out, cfg: bool, g, r):
    """The UNet's output (float32, :func:`cfg_rows` rows with ``cfg``) -> the guided
    prediction (:func:`guide_pair`)."""
    if not cfg:
        return out
    return guide_pair(*cfg_halves(out), g, r)


def guide_pair(uncond, text, g, r):
    """``uncond + g * (text - uncond)``, then guidance rescale where ``r > 0`` (Lin et al.
    2023, "Common Diffusion Noise Schedules and Sample Steps are Flawed", eq. 15-16, with
    torch's unbiased std)."""
    out = uncond + g * (text - uncond)
    std_text = jnp.std(text, axis=(1, 2, 3), keepdims=True, ddof=1)
    std_cfg = jnp.std(out, axis=(1, 2, 3), keepdims=True, ddof=1)
    return jnp.where(r > 0, r * out * (std_text / std_cfg) + (1 - r) * out, out)


def decode(vae, params, latents):
    """Latents (B, h, w, C) in the diffusion model's space -> the VAE decoder's images
    (B, H, W, 3) in ~[-1, 1]. On accelerators each device decodes its images one at a time
    (``lax.map`` under :func:`_per_device`): a 1024² image alone fills a chip, the VAE's weights
    are small, and the decoder's full-resolution activations, which set a program's peak
    memory, then no longer grow with the batch. On CPUs the batch is decoded at once."""
    def run(z):
        return vae.apply({"params": params}, z, method=vae.latents_to_image)

    if not target.is_accelerator():
        return run(latents)
    return _per_device(lambda z: jax.lax.map(lambda one: run(one[None])[0], z), 1)(latents)


def to_pixels(img, as_uint8: bool):
    """Decoder output in ~[-1, 1] -> float32 [0, 1], or uint8."""
    img = jnp.clip(img.astype(jnp.float32) / 2 + 0.5, 0.0, 1.0)
    return jnp.round(img * 255).astype(jnp.uint8) if as_uint8 else img


OUTPUTS = ("uint8", "float", "latent", "unscaled")


def out_kind(output_type: str, tiled: bool) -> str:
    """What a program returns for ``output_type``: ``"latent"`` (the latents), ``"unscaled"``
    (unscaled latents for the tiled decoder after the program), ``"float"`` ([0, 1] pixels,
    ``"np"``) or ``"uint8"`` (pixels for PIL images)."""
    if output_type == "latent":
        return "latent"
    return "unscaled" if tiled else "float" if output_type == "np" else "uint8"


def finish(vae, params, latents, out: str):
    """The decode tail of every program: the latents as ``out`` (:func:`out_kind`) asks."""
    if out == "latent":
        return latents
    if out == "unscaled":
        return vae.apply({"params": params}, latents, method=vae.unscale_latents)
    return to_pixels(decode(vae, params, latents), out == "uint8")


def collect(out, n: int, output_type: str, tiled_decoder=None) -> Any:
    """The first ``n`` images of a program's output on the host (waits for the device):
    latents (N, C, H/f, W/f) for ``"latent"``, else :func:`host_images`, decoded tile by tile
    first by ``tiled_decoder(out, as_uint8)`` when the program returned unscaled latents."""
    if output_type == "latent":
        return np.asarray(jax.device_get(out))[:n].transpose(0, 3, 1, 2)
    if tiled_decoder is not None:
        out = tiled_decoder(out, output_type != "np")
    return host_images(out, n, output_type)


def output(images, seeds: Sequence[int], t0: float, t1: float, batch: int,
           nsfw: list[bool | None] | None = None, **timings) -> PipelineOutput:
    """The :class:`PipelineOutput` of a run that started at ``t0`` and launched its program at
    ``t1`` (``time.perf_counter()``), with the task's own ``timings``."""
    return PipelineOutput(images, [int(s) for s in seeds],
                          {"prepare_s": t1 - t0, "generate_s": time.perf_counter() - t1,
                           "batch": batch, **timings}, nsfw)


def cutoff_timestep(num_train_timesteps: int, fraction: float) -> int:
    """diffusers' ``discrete_timestep_cutoff``: ``int(round(T - fraction * T))``."""
    t = num_train_timesteps
    return int(round(t - fraction * t))


def end_step(timesteps, num_train_timesteps: int, fraction: float) -> int:
    """How many of a schedule's model calls a base stopped at ``denoising_end=fraction`` runs
    (diffusers' ``StableDiffusionXLPipeline``: the timesteps ``>= cutoff``)."""
    cut = cutoff_timestep(num_train_timesteps, fraction)
    return int(np.sum(np.asarray(timesteps) >= cut))


def start_step(num_inference_steps: int, strength: float) -> int:
    """diffusers' ``get_timesteps``: the index of the first of the ``num_inference_steps``
    scheduler steps that is run, ``steps - min(int(steps * strength), steps)`` (image-to-image,
    a hires fix's second pass)."""
    init = min(int(num_inference_steps * strength), num_inference_steps)
    return max(num_inference_steps - init, 0)


def start_step_at(timesteps, num_train_timesteps: int, fraction: float) -> int:
    """The first model call a pipeline started at ``denoising_start=fraction`` runs (diffusers'
    ``StableDiffusionXLImg2ImgPipeline.get_timesteps``: it runs the timesteps ``< cutoff``,
    the last ones of the schedule; first-order samplers only, as maxdiff's all are)."""
    ts = np.asarray(timesteps)
    cut = cutoff_timestep(num_train_timesteps, fraction)
    return int(len(ts) - np.sum(ts < cut))
