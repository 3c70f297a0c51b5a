"""The one program builder and the one runner of every task (text-to-image, image-to-image,
inpainting, ControlNet, base + refiner).

A task (:class:`Task`, one file each in :mod:`pipelines.tasks`) says only what differs: the
starting latents (:meth:`Task.begin`), how the denoiser is wrapped (:meth:`Task.model`), extra
input channels and what follows a step (:meth:`Task.extra`, :meth:`Task.after_step`), where the
loop ends and what runs after it (:meth:`Task.end`, :meth:`Task.then`). A pipeline prepares a
:class:`Job` on the host (its task's rows, scalars, weights and static key) and :func:`run`
does the rest for all of them: validated items -> host inputs -> padded to a bucket and placed
on the mesh -> the compiled program (made by :func:`build`, kept in the pipeline's
:class:`pipelines.program.Programs`) -> the decode tail -> :class:`PipelineOutput`.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from maxdiff import adapters as adapterlib
from maxdiff import mesh as meshlib
from pipelines import loop, step_hooks
from pipelines import program as program_lib
from pipelines.limits import check, sampler_problem
from pipelines.requests import ImageRequest, bucket_size

__all__ = ["Task", "TEXT", "Job", "Static", "Ctx", "build", "run", "given", "checked_items"]


class ProgramKey(NamedTuple):
    """What a batch program is cached under: every static choice it closes over. The
    scheduler, the text encoders and an IP-Adapter go in by object id (the cached program
    keeps them alive, so no id is reused meanwhile)."""
    task: str
    scheduler: int
    bucket: int
    static: Any
    adapters: bool
    tiled: bool
    encoders: tuple
    ip_adapter: int | None = None  # the IP-Adapter of a batch with image prompts


@dataclass(frozen=True)
class Static:
    """A program's static choices: latent size, steps, CFG, output kind (:func:`out_kind`)
    and the task's own ``key``."""

    lh: int
    lw: int
    steps: int
    cfg: bool
    out: str
    key: tuple = ()
    hooks: str = ""  # host callbacks after each step: "" none, "progress", "latents"
    # feature caching on (ImageRequest's): the values are traced scalars ("cfg_cutoff",
    # "deepcache_interval"), so one program serves them all
    cfg_cutoff: bool = False
    deepcache: bool = False


@dataclass
class Ctx:
    """What a task's traced hooks see inside the program: the pipeline (modules, scheduler),
    the weights (``params``; the task's own ``weights``), the batch's inputs, the task's
    ``rows`` and ``scalars``, the scheduler state, the text conditioning, the per-image PRNG
    keys and the adapters; ``memo``: what a task's hooks hand each other."""

    pipe: Any
    static: Static
    params: Any
    weights: Any
    inputs: program_lib.HostInputs
    rows: dict
    scalars: dict
    state: Any
    cond: Any
    uidx: Any
    ad: Any
    keys: tuple
    scheduler: Any = None  # the batch's scheduler (the pipeline's, or a request's sampler)
    memo: dict = field(default_factory=dict)  # what a task's hooks hand each other

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.static.lh, self.static.lw, self.pipe.vae.config.latent_channels)

    def without_cfg(self) -> Ctx:
        """This context for the conditional rows alone (a ``cfg_cutoff``'s unguided steps): the
        conditioning's and the adapter index's second halves, ``inputs.cfg`` off."""
        if not self.inputs.cfg:
            return self
        return dataclasses.replace(
            self, cond=program_lib.conditional_half(self.cond),
            uidx=program_lib.conditional_half(self.uidx),
            inputs=dataclasses.replace(self.inputs, cfg=False), memo=dict(self.memo))

    def denoise(self, scheduler, model, x, state, start, end, *, step_keys, shape, nocfg,
                **more):
        """:func:`pipelines.loop.denoise` with this batch's guidance and feature caching;
        ``nocfg()`` makes the conditional-only model, called where a ``cfg_cutoff`` is on."""
        cutoff = self.scalars["cfg_cutoff"] if self.static.cfg_cutoff else None
        return loop.denoise(scheduler, model, x, state, start, end, cfg=self.inputs.cfg,
                            g=self.inputs.guidance, r=self.inputs.rescale, step_keys=step_keys,
                            shape=shape, cfg_cutoff=cutoff,
                            deepcache=self.scalars.get("deepcache_interval"),
                            model_nocfg=None if cutoff is None else nocfg(), **more)

    def denoiser(self, **extras):
        """``model(xin, t, i)``: the family's denoiser on the batch's conditioning (per-image
        adapters applied), with ``extras`` (ControlNet residuals, from :meth:`Task.model`)."""
        pipe = self.pipe
        unet_params = program_lib.denoiser_weights(self.params, self.cond)

        def model(xin, t, i, **more):
            with adapterlib.applied((self.ad or {}).get("unet"), self.uidx):
                return pipe.family.denoise(pipe.unet, unet_params, self.cond, xin, t,
                                           **extras, **more)
        return model


class Task:
    """Text-to-image, and what every task does unless it says otherwise."""

    name = "text-to-image"
    n_keys = 2  # per-image PRNG keys; the last draws the step noise
    adapters = True  # per-image adapters (add_adapter) apply

    def begin(self, ctx: Ctx):
        """(starting latents, first model call): the given ``latents`` row or noise from the
        first key, at the scheduler's initial sigma; step 0."""
        latents = ctx.rows.get("latents")
        if latents is None:
            latents = program_lib.normal(ctx.keys[0], ctx.shape)
        return latents.astype(jnp.float32) * ctx.scheduler.init_noise_sigma(ctx.state), 0

    def end(self, ctx: Ctx):
        """The model call the loop stops before (the whole schedule: a static length)."""
        return ctx.state.timesteps.shape[0]

    def model(self, ctx: Ctx):
        return ctx.denoiser()

    def extra(self, ctx: Ctx):
        """Channels appended to every model input (None: none)."""
        return None

    def after_step(self, ctx: Ctx):
        """``after_step(i, state, x) -> x`` after every scheduler step (None: none)."""
        return None

    def then(self, ctx: Ctx, x):
        """After the loop: (latents, the VAE and its weights that decode them)."""
        return x, ctx.pipe.vae, ctx.params["vae"]

    def encode_tiled(self, job: Job, rows: dict) -> dict:
        """``rows`` with its images encoded on the host, tile by tile, where the decoder tiles
        (the program then takes their latents): none for text-to-image."""
        return rows

    # The step engine (pipelines.step_runner): what a task adds to every slot beside the
    # slot's latents, schedule and conditioning. A task without a step program says so here.
    steps_in_slots = True

    def slot_extra(self, pipe, extra):
        """A submitted image's task input (``StepEngine.submit``'s ``controls``), checked:
        text-to-image takes none."""
        if extra is not None:
            raise ValueError("controls: this engine has no ControlNets; make it over a "
                             "ControlNetPipeline to give control images")
        return None

    def slot_weights(self, pipe) -> dict:
        """Weights the step programs take beside the pipeline's (``params`` entries)."""
        return {}

    def slot_state(self, pipe, slots: int, height: int, width: int, max_steps: int) -> dict:
        """Every slot's state of this task, zeros (numpy; the slot is the leading axis)."""
        return {}

    def slot_rows(self, pipe, extras: list, height: int, width: int, steps: list[int],
                  max_steps: int) -> dict:
        """The admitted images' rows of :meth:`slot_state` on the host, from each image's
        checked extra and step count (tables padded at the front to ``max_steps``, like the
        schedules); ``extras`` empty: one warm-up row."""
        return {}

    def slot_model(self, pipe, params, state: dict, index, active, pair):
        """``extras(xin, t, cond) -> denoiser keyword arguments`` for one step of the gathered
        slot ``state`` (each row at its own step ``index``; ``active`` False for padding rows),
        or None: nothing beside the conditioning. ``pair(neg, pos)``: the model call's rows of
        a per-slot value (negative rows first for the guided slots), or None without any."""
        return None


TEXT = Task()  # text-to-image: every default


@dataclass
class Job:
    """One device batch of a task, prepared on the host by a pipeline: ``pipe`` runs it (its
    modules, scheduler, weights, mesh, ``programs``); ``rows``: the task's per-image arrays
    (None entries are absent inputs); ``scalars``: its replicated traced inputs; ``weights``:
    weights beside the pipeline's (ControlNets, a refiner's); ``key``: its static choices;
    ``timings``: what it adds to the output's; ``decoder``: the pipeline whose VAE decodes
    (default ``pipe``)."""

    task: Task
    pipe: Any
    items: list[ImageRequest]
    height: int
    width: int
    steps: int
    output_type: str
    t0: float
    rows: dict = field(default_factory=dict)
    scalars: dict = field(default_factory=dict)
    weights: Any = None
    key: tuple = ()
    timings: dict = field(default_factory=dict)
    decoder: Any = None
    inputs: program_lib.HostInputs | None = None  # made by run() when None
    scheduler: Any = None  # the sampler the items asked for (None: the pipeline's)
    on_step: Any = None  # on_step(step, timestep, latents (N, C, h, w)) after each step
    denoised: bool = False  # on_step sees each step's estimate of the clean latents instead
    progress: bool = False  # a progress bar over the steps (tqdm)

    @property
    def n(self) -> int:
        return len(self.items)


def given(items: Sequence[ImageRequest]) -> list[ImageRequest]:
    """``items`` as a list; ValueError when there are none."""
    items = list(items)
    if not items:
        raise ValueError("items is empty: give at least one ImageRequest")
    return items


def checked_items(pipe, items: Sequence[ImageRequest], steps, height, width,
                  output_type: str | None, *, size_from=None, samplers: bool = False,
                  more: Sequence = (), no_samplers: str | None = None):
    """The checks and defaults every task shares: at least one item, the step count (default:
    the pipeline's), the size (default: ``size_from``'s (width, height) rounded down to the
    VAE's factor, else the pipeline's), then :meth:`check_request` and each item's
    ``validate``; an item without a guidance scale gets the pipeline's. ``output_type`` None:
    checked by the caller; ``more``: the caller's problems, reported with the request's;
    ``no_samplers``: where a sampler per request does run, when not here. Returns (items,
    steps, height, width)."""
    items = [it.with_defaults(pipe.default_guidance) for it in given(items)]
    steps = pipe.default_steps if steps is None else steps
    if size_from is not None:
        f = pipe.vae_scale_factor
        w0, h0 = size_from
        height = h0 - h0 % f if height is None else height
        width = w0 - w0 % f if width is None else width
    height = pipe.default_height if height is None else height
    width = pipe.default_width if width is None else width
    pipe.check_request(steps, height, width, *(() if output_type is None else (output_type,)),
                       more=more)
    for k, it in enumerate(items):
        it.validate(k)
        check([sampler_problem(it.scheduler)])
    for name in dict.fromkeys(it.scheduler for it in items if it.scheduler is not None):
        if not samplers:
            raise ValueError(f"scheduler={name!r}: a sampler per request runs " + (
                no_samplers or f"text-to-image; this pipeline runs its own "
                f"({type(pipe.scheduler).__name__}): switch pipe.scheduler (or "
                "from_pretrained(scheduler=...))"))
        pipe.check_request(steps, height, width, scheduler=name)
    return items, steps, height, width


def build(task: Task, pipe, static: Static, scheduler=None):
    """The program of one task and shape: conditioning -> the task's start -> the denoising
    loop (:func:`pipelines.loop.denoise`) -> the task's tail -> the decode tail.
    ``scheduler``: the loop's (default: the pipeline's)."""
    encoders = {name: getattr(pipe, name) for name in pipe.family.encoders}
    scheduler = scheduler or pipe.scheduler
    ip_adapter = getattr(pipe, "ip_adapter", None)

    def program(params, weights, inputs, rows, scalars, state, ad=None, aidx=None):
        cond, uidx = program_lib.conditioning(pipe.family, encoders, params, inputs, ad, aidx,
                                              ip_adapter)
        keys = program_lib.image_keys(inputs.seeds, task.n_keys)
        ctx = Ctx(pipe, static, params, weights, inputs, rows, scalars, state, cond, uidx, ad,
                  keys, scheduler)
        x, start = task.begin(ctx)
        x = ctx.denoise(scheduler, task.model(ctx), x, state, start, task.end(ctx),
                        step_keys=keys[-1], shape=ctx.shape,
                        nocfg=lambda: task.model(ctx.without_cfg()), extra=task.extra(ctx),
                        after_step=step_hooks.with_hooks(task.after_step(ctx), static.hooks,
                                                         scheduler),
                        on_denoised=step_hooks.denoised_hook(static.hooks, scheduler))
        x, vae, vae_params = task.then(ctx, x)
        return program_lib.finish(vae, vae_params, x, static.out)

    return program


def _placed(tree, latent_shape: tuple, rows, rep):
    """Scalars or a scheduler state on the mesh: leaves shaped like the batch's latents (a
    multistep sampler's history, one per image) split over the data axis as the latents are,
    the rest (timesteps, sigmas, counters, settings) on every device."""
    return jax.tree.map(
        lambda a: meshlib.place(a, rows if np.shape(a) == latent_shape else rep), tree)


def run(job: Job) -> program_lib.PipelineOutput:
    """Run ``job``: its host inputs (random seeds drawn where an item has none), padded to a
    bucket of the mesh and placed, the program of its key (compiled once), the images back on
    the host (tiled decode where the decoder's ``vae_tiling`` says), the output."""
    pipe, decoder = job.pipe, job.decoder or job.pipe
    inputs = job.inputs if job.inputs is not None else pipe.host_inputs(
        job.items, job.height, job.width)
    groups = _groups(job, inputs)
    if len(groups) > 1:
        return _run_groups(job, inputs, groups)
    if groups[0][0] is not None and job.scheduler is None:
        job = dataclasses.replace(job, scheduler=pipe.scheduler_for(groups[0][0]))
    sched = job.scheduler or pipe.scheduler
    aidx = pipe.adapter_index(job.items) if job.task.adapters else None
    f = pipe.vae_scale_factor
    lh, lw = job.height // f, job.width // f
    bucket = bucket_size(job.n, pipe.mesh.size)
    put = program_lib.BatchPut(pipe.mesh, bucket)
    rep = meshlib.replicated(pipe.mesh)
    tiled = job.output_type != "latent" and decoder.uses_vae_tiling(job.height, job.width)
    hooks = ("denoised" if job.denoised else "latents") if job.on_step is not None \
        else ("progress" if job.progress else "")
    cutoff, interval = _caching(job.items[0])  # one setting per device batch (_groups)
    cutoff = cutoff if inputs.cfg else None
    static = Static(lh, lw, job.steps, inputs.cfg,
                    program_lib.out_kind(job.output_type, tiled), job.key, hooks,
                    cutoff is not None, interval > 1)
    scalars = dict(job.scalars)
    if cutoff is not None:
        scalars["cfg_cutoff"] = np.float32(cutoff)
    if interval > 1:
        scalars["deepcache_interval"] = np.int32(interval)
    latent_shape = (bucket, lh, lw, pipe.vae.config.latent_channels)
    state = sched.set_timesteps(job.steps, latent_shape)
    rows = put.tree(job.rows)
    if tiled:
        rows = job.task.encode_tiled(job, rows)
    ip = pipe.ip_adapter if inputs.ip_pixels is not None else None  # image prompts
    args = [pipe.program_weights(ip is not None), job.weights, put.tree(inputs), rows,
            *(_placed(tree, latent_shape, put.rows, rep) for tree in (scalars, state))]
    if aidx is not None:
        args += [pipe.adapter_tables.as_tree(), put(aidx)]
    # the program closes over the scheduler (its config is static) and the text encoders: one
    # per scheduler object and per text-encoder module (a textual-inversion embedding replaces
    # the module); the cached program keeps them alive, so no id is reused meanwhile
    encoders = tuple(id(getattr(pipe, name)) for name in pipe.family.encoders)
    key = ProgramKey(job.task.name, id(sched), bucket, static, aidx is not None, tiled, encoders,
                     id(ip) if ip is not None else None)
    if job.progress and key not in pipe.programs:
        from tqdm import tqdm

        tqdm.write(f"maxdiff: compiling the {job.task.name} program for {job.width}x{job.height}, "
                   f"{job.steps} steps, batch {bucket} (once; later calls of this shape reuse it)",
                   file=sys.stderr)
    program = pipe.programs.get(key, lambda: build(job.task, pipe, static, sched))
    t1 = time.perf_counter()
    steps = step_hooks.Steps(job, int(state.timesteps.shape[0])) if hooks else None
    step_hooks.LISTENER[0] = steps
    try:
        out = program(*args)
        images = program_lib.collect(out, job.n, job.output_type,
                                     decoder.decode_tiled if tiled else None)
    finally:
        step_hooks.LISTENER[0] = None
        if steps is not None:
            steps.close()
    nsfw = None
    checker = getattr(decoder, "safety_checker", None)
    if checker is not None and job.output_type in ("pil", "np"):  # images whose items keep it
        images, nsfw = checker.check(images, [it.safety_checker for it in job.items])
    return program_lib.output(images, np.asarray(inputs.seeds), job.t0, t1, bucket, nsfw,
                              **job.timings)


def _is_inputs(x) -> bool:
    return isinstance(x, program_lib.HostInputs)


def _caching(item: ImageRequest) -> tuple[float | None, int]:
    """An item's feature caching as its program sees it: (``cfg_cutoff``, None where it
    guides every step; ``deepcache_interval``)."""
    cutoff = item.cfg_cutoff
    return (None if cutoff is None or cutoff >= 1 else float(cutoff)), int(item.deepcache_interval)


def _groups(job: Job, inputs: program_lib.HostInputs) -> list[tuple[str | None, np.ndarray]]:
    """The job's images grouped by their sampler (None: the pipeline's), the prompt chunks
    they need (their own prompts' and, for a refiner, its) and their feature caching
    (``cfg_cutoff``, ``deepcache_interval``): (sampler, indices) per group, in order of first
    appearance. Each group is one device batch, so an image's conditioning
    never depends on a longer prompt beside it."""
    more = [x for x in jax.tree.leaves(job.rows, is_leaf=_is_inputs) if _is_inputs(x)]
    chunks = np.stack([h.chunks() for h in (inputs, *more)], axis=1).tolist()
    keys = [(it.scheduler, tuple(c), *_caching(it)) for it, c in zip(job.items, chunks)]
    return [(key[0], np.array([i for i, k in enumerate(keys) if k == key]))
            for key in dict.fromkeys(keys)]


def _run_groups(job: Job, inputs: program_lib.HostInputs, groups) -> program_lib.PipelineOutput:
    """``job`` as one run per group of :func:`_chunk_groups`, merged in the items' order."""
    def take(tree, idx):
        return jax.tree.map(lambda a: a.take(idx) if _is_inputs(a) else np.asarray(a)[idx],
                            tree, is_leaf=_is_inputs)

    outs = [run(dataclasses.replace(job, items=[job.items[i] for i in idx], inputs=inputs.take(idx),
                                    rows=take(job.rows, idx),
                                    scheduler=name and job.pipe.scheduler_for(name)))
            for name, idx in groups]
    order = np.argsort(np.concatenate([idx for _, idx in groups]), kind="stable")
    seeds = [s for o in outs for s in o.seeds]
    if isinstance(outs[0].images, np.ndarray):
        images = np.concatenate([o.images for o in outs])[order]
    else:
        flat = [im for o in outs for im in o.images]
        images = [flat[k] for k in order]
    timings = dict(outs[0].timings)
    for key in ("prepare_s", "generate_s", "batch"):
        timings[key] = sum(o.timings[key] for o in outs)
    timings["device_batches"] = len(outs)
    nsfw = None if outs[0].nsfw_content_detected is None else [
        [f for o in outs for f in o.nsfw_content_detected][k] for k in order]
    return program_lib.PipelineOutput(images, [seeds[k] for k in order], timings, nsfw)
