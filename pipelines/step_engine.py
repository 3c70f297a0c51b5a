"""Step-level continuous batching: images join and leave a running batch between denoising steps.

:class:`TextToImagePipeline` runs a whole batch (text encoders, every denoising step, VAE
decode) as one program, so an image that arrives while a batch runs waits for all of it, and a
2-step image batched with a 40-step one is held for 40 steps. A :class:`StepEngine` instead
keeps a fixed number of *slots* on the devices (sharded over the mesh's ``data`` axis, like the
pipeline's batch). Each :meth:`StepEngine.tick`:

1. frees the slots of cancelled images,
2. admits queued images into free slots, in the order of the engine's ``policy`` (``"fifo"``:
   submission order; ``"srs"``: shortest remaining steps first, aged so that no image waits
   forever; the rule is in :mod:`pipelines.step_scheduler`): one batched text-encode program writes their text
   embeddings, time ids, guidance, initial latents (from each image's seed, exactly as the
   pipeline draws them) and scheduler tables into their slots,
3. queues ONE jitted step program that advances every active slot by one denoising step, each
   with its own timestep, sigma, step count and scheduler memory (idle slots are masked: their
   state does not change),
4. queues the VAE decode of the images that take their last step (one batched decode) and frees
   their slots for the next tick,
5. waits for the device (below) and reports what it ran: steps, previews, finished images.

**Pacing: the host follows the device.** A jitted call returns as soon as its work is queued
(JAX dispatches asynchronously), so a loop of ticks that never waits runs an image's step
counter to its end in a fraction of a second while the device is still on its third step; an
image submitted meanwhile is admitted only once the first host read (the decode) has waited for
every queued step, and progress, previews, cancellation and deadlines all describe work not yet
done (first seen at real sizes, where a step costs hundreds of ms). So a tick ends by waiting
until at most ``lookahead`` ticks are left unfinished on the device (default 1: the host
prepares and queues tick k + 1 while the device runs tick k, so its per-tick work overlaps the
step instead of adding to it; 0: a tick returns only after its own step ran). An image's
``step`` is what the step program returned for it (each row's step count after the step), read
back when the tick completes; admission, cancellation (no step of a cancelled image is queued
after the next tick) and queue positions therefore act within ``lookahead + 1`` steps of device
time. ``stats["host_s"]`` and ``stats["wait_s"]`` split the ticking thread's time between its
own work and waiting for the device.

**Per-slot schedules.** Each image's schedule comes from the pipeline's own
``scheduler.set_timesteps(steps)`` on the host; its tables (timesteps, sigmas / alpha-bars) are
padded *at the front* to the engine's ``max_steps`` ``N``, and a k-step image starts at table
index ``N - k``. Every scheduler's ``step`` is vmapped over slots unchanged: the conditions that
look at the last step (``i == n - 1`` in DPM++ 2M and LCM) hold at that image's last step, and
DPM++ 2M's first step reads a padded ``sigmas[i - 1]`` equal to ``sigmas[i]``, as the
pipeline's ``max(i - 1, 0)`` does. DPM++ 2M's history (``prev_x0``, ``lower_order_nums``) is
per slot and reset on admission. The one static use of the step count, DPM++ 2M's
``lower_order_final and n < 15`` (it only matters with ``final_sigmas_type="sigma_min"``), is
resolved per slot by running both final-order variants and selecting (elementwise, cheap).
Euler ancestral and LCM draw step ``i``'s noise from ``fold_in(step_key, i)`` with the image's
own key and its own step number, as the pipeline does. So an image's pixels do not depend on
when it joined or what shared its steps (to float32 rounding of differently sized batches:
tested to 1e-5 on [0, 1] pixels).

**CFG on and off side by side.** With ``cfg=True`` (the default) the UNet runs the text
rows of every active slot plus negative rows for the slots whose guidance is > 1 only: a tick
gathers its slots guided-first, so with ``g`` guided images among ``b`` the UNet sees
``b + bucket(g)`` rows (``bucket``: the batch sizes below), the guided ones get ``guide``
(CFG + guidance rescale) with their own scale and the others take the text rows' prediction
exactly (what the pipeline gives that image alone). So an image without guidance never pays
for negative rows, whatever shares its tick (LoadGen's mixed workload showed why: with one
guided image in a tick every image paid twice), and traffic without CFG (SDXL-Lightning, LCM)
runs ``b`` rows. ``cfg=False`` refuses images with guidance > 1 and compiles no guided
programs.

**Compiled programs** (bounded and known; :meth:`StepEngine.warmup` compiles all of them):
the batch sizes ``B`` are the powers of two times the mesh size up to ``slots`` (``slots=8`` on
one device: 1, 2, 4, 8). A tick runs the step program of the smallest batch size ``b`` that
holds its active images and the smallest ``g`` in ``B`` that holds its guided ones (``g = 0``
without any): it gathers their slots, steps them and scatters them back, so a tick with one
image costs one image's UNet step, not ``slots`` of them (first measured with LoadGen: with one
full-width program, a lone 30-step image paid for 8 slots at every step). Step programs: one
per ``(b, g)`` with ``g = 0`` or ``g`` in ``B``, ``g <= b``: ``|B| (|B| + 3) / 2``; plus an
admit (text-encode) and a decode program per ``b``: ``|B| (|B| + 7) / 2`` programs, 22 for 8
slots on one device (``cfg=False``: ``3 |B|``, 12).
New prompts, seeds, guidance, step counts (up to ``max_steps``) never compile anything.

**Previews.** ``submit(..., previews=[k, ...])`` decodes the image's denoised estimate (the
scheduler's x0 prediction, kept per slot) after step ``k`` with the real VAE, queued in the
tick that runs step ``k`` (so the picture is that step's, however far the host has got), through
the same decode programs: no extra compiled program and a faithful picture, at the cost of one
VAE decode per preview (fine for the few partial images a stream asks for; a linear
latent-to-RGB projection would be cheaper but model specific).

Per-image adapters (``ImageRequest.adapter``, ``TextToImagePipeline.add_adapter``) are applied
per slot like the pipeline applies them per row; ``pipe.vae_tiling`` is honoured at decode.

**ControlNets.** Over a :class:`pipelines.ControlNetPipeline` every image is submitted with one
:class:`pipelines.requests.ControlImage` per ControlNet, and each slot also holds its control
images (resized at admission by :func:`pipelines.controlnet.control_inputs`, as the pipeline
resizes them), its scale table (scale x ``controlnet_keep`` over its own steps, padded at the
front like the schedules, so row ``i`` of a k-step image reads its own step's scale) and guess
mode. The step program feeds the tick's rows (negative rows too; in guess mode those get scale
0, as in the pipeline) to :func:`pipelines.controlnet.control_residuals`, the pipeline's own,
before the UNet; idle rows get scale 0, so a ControlNet that no active row needs at this step
is skipped. An image's pixels equal ``ControlNetPipeline.generate`` on it alone.

**Who does what.** The deciding is host-only and JAX-free, in
:class:`pipelines.step_scheduler.SlotScheduler` (queue, slots, admission policy, queue
positions, cancels, aborts, the ``(b, g)`` of each tick, step counting); the device side is a
:class:`StepRunner` (slot state, the compiled admit / step / decode programs, read backs);
:class:`StepEngine` asks the one and runs the other, paces the host with the device and reports
progress, previews and finished images. The engine reaches the pipeline through its public
surface only (``check_request``, ``host_inputs``, ``adapter_index``, ``adapter_tables``,
``uses_vae_tiling``, ``decode_tiled``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxdiff import adapters as adapterlib, mesh as meshlib
from maxdiff.family import Cond
from pipelines import program as program_lib
from pipelines.limits import cfg_on, check, steps_problem
from pipelines.requests import ControlImage, ImageRequest, bucket_size
from pipelines.step_scheduler import Handle, Policy, SlotScheduler, StepPlan, step_shapes
from pipelines.tasks.controlnet import control_inputs, control_residuals

__all__ = ["StepEngine", "StepRunner", "Handle"]

# scheduler-state fields that are schedules indexed by step (padded at the front per slot)
TABLES = ("timesteps", "sigmas", "alphas_cumprod", "alphas_cumprod_prev")


@dataclass
class _Tick:
    """A tick queued on the device, and what the host learns once it has run: ``executed`` is
    the step program's own output (each row's step count after the step; 0 for padding rows),
    ``images`` / ``previews`` the decode programs' outputs for ``finishing`` / ``previewed``."""

    rows: list[Handle]
    executed: Any
    finishing: list[Handle]
    images: Any
    previewed: list[Handle]
    previews: Any


class StepRunner:
    """The device side of a :class:`StepEngine`: every slot's device state and the compiled
    admit, step and decode programs (one per batch size in ``batch_sizes``, one step program per
    ``(b, g)`` of :func:`pipelines.step_scheduler.step_shapes`). It runs what the scheduler
    decided and knows nothing of queues or handles' order; every call only queues work on the
    device (:meth:`fetch` waits)."""

    def __init__(self, pipe, height: int, width: int, slots: int, batch_sizes: list[int], *,
                 cfg: bool, max_steps: int, output_type: str):
        self.pipe = pipe
        self.height, self.width, self.slots = height, width, slots
        self.batch_sizes, self.cfg, self.max_steps = batch_sizes, cfg, max_steps
        self.output_type = output_type
        f = pipe.vae_scale_factor
        self.lh, self.lw, self.channels = height // f, width // f, pipe.latent_channels
        self.sched = pipe.scheduler
        self.stochastic = self.sched.stochastic
        # ControlNets (a ControlNetPipeline): each slot also holds its control images, its
        # scale table (per ControlNet, padded at the front like the schedules) and guess mode
        self.nets = getattr(pipe, "controlnets", ())
        self.tiled = pipe.uses_vae_tiling(height, width)  # the pipeline's vae_tiling rule
        self._sharded = meshlib.batch_sharded(pipe.mesh)
        self._state = self._empty_state()
        self._state_sharding = jax.tree.map(lambda _: self._sharded, self._state)
        self._programs = program_lib.Programs(pipe.mesh)

    # ------------------------------------------------------------------ state
    @functools.lru_cache(maxsize=None)
    def schedule(self, steps: int):
        """(padded per-slot scheduler state as numpy leaves, initial noise sigma) for ``steps``."""
        state = self.sched.set_timesteps(steps, (self.lh, self.lw, self.channels))
        init_sigma = float(self.sched.init_noise_sigma(state))
        n = self.max_steps

        def pad(name, a):  # tables are steps (or steps + 1) long: n - steps copies in front
            a = np.asarray(a)
            if name not in TABLES or n == steps:
                return a
            return np.concatenate([np.repeat(a[:1], n - steps, axis=0), a])

        fields = {f.name: pad(f.name, getattr(state, f.name)) for f in dataclasses.fields(state)}
        return type(state)(**fields), init_sigma

    def _empty_state(self) -> dict:
        """Every slot's device state, zeros (the leading axis of every leaf is the slot)."""
        s, lat = self.slots, (self.slots, self.lh, self.lw, self.channels)
        p = self.pipe
        tokens = (p.tokenizer or p.tokenizer_2).model_max_length
        encoders = {name: getattr(p, name) for name in p.family.encoders}
        emb, pooled = jax.eval_shape(
            lambda prm, ids: p.family.encode(encoders, prm, ids), p.params,
            jax.ShapeDtypeStruct((2, 1, tokens), jnp.int32))
        sched, _ = self.schedule(1)
        state = {
            "x": np.zeros(lat, np.float32), "x0": np.zeros(lat, np.float32),
            "sched": jax.tree.map(lambda a: np.zeros((s, *a.shape), a.dtype), sched),
            "keys": np.zeros((s, *jax.random.key_data(jax.random.key(0)).shape), np.uint32),
            "emb": np.zeros((s, *emb.shape[1:]), np.float32),
            "pooled": np.zeros((s, *pooled.shape[1:]), np.float32),
            "time_ids": np.zeros((s, p.family.n_time_ids), np.float32),
            "g": np.ones(s, np.float32), "r": np.zeros(s, np.float32), "cfg": np.zeros(s, bool),
            "aidx": np.zeros(s, np.int32),
        }
        if self.nets:
            k = len(self.nets)
            state.update(
                cimg=tuple(np.zeros((s, self.height, self.width, 3), np.float32)
                           for _ in self.nets),
                cscale=np.zeros((s, k, self.max_steps), np.float32), cguess=np.zeros((s, k), bool))
        if self.cfg:
            state.update(nemb=np.zeros_like(state["emb"]), npooled=np.zeros_like(state["pooled"]),
                         ntime_ids=np.zeros_like(state["time_ids"]))
        return meshlib.place(state, self._sharded)

    # ------------------------------------------------------------------ programs
    def _program(self, kind: str, *key):
        def build():
            return {"step": lambda: self._build_step(key[1]), "admit": self._build_admit,
                    "decode": self._build_decode}[kind]()

        shard = {"step": dict(out_shardings=(self._state_sharding, self._sharded),
                              donate_argnums=self._donate(1)),
                 "admit": dict(out_shardings=self._state_sharding,
                               donate_argnums=self._donate(1)),
                 "decode": {}}[kind]
        return self._programs.get((kind, *key), build, **shard)

    def _donate(self, i):
        # XLA:CPU cannot reuse donated buffers (it would only warn)
        return () if self.pipe.mesh.devices.flat[0].platform == "cpu" else (i,)

    @property
    def num_compiled(self) -> int:
        """Programs compiled so far."""
        return self._programs.num_compiled

    @property
    def step_shapes(self) -> list[tuple[int, int]]:
        return step_shapes(self.batch_sizes, self.cfg)

    @property
    def all_programs(self) -> set[tuple]:
        """Every program this runner can run: ``("step", b, g)``, ``("admit", b)``,
        ``("decode", b)``."""
        return ({("step", b, g) for b, g in self.step_shapes}
                | {(kind, b) for kind in ("admit", "decode") for b in self.batch_sizes})

    @property
    def programs(self) -> set[tuple]:
        """The programs made so far (keys as in :attr:`all_programs`); each is compiled once,
        so :attr:`num_compiled` equals their number."""
        return set(self._programs)

    @property
    def max_programs(self) -> int:
        """The programs this runner can compile (all of them at :meth:`warmup`)."""
        return len(self.all_programs)

    def _build_admit(self):
        p = self.pipe
        encoders = {name: getattr(p, name) for name in p.family.encoders}
        lh, lw, ch = self.lh, self.lw, self.channels
        cfg_engine = self.cfg

        def admit(params, state, slot, inputs, init_sigma, cfg, sched, aidx, control, ad=None):
            # the pipeline's conditioning and noise, for a batch of new images; rows for slot
            # index == slots are padding and are dropped by the scatter
            cond, _ = program_lib.conditioning(p.family, encoders, params, inputs, ad,
                                               None if ad is None else aidx)
            init_keys, step_keys = program_lib.image_keys(inputs.seeds)
            x = program_lib.normal(init_keys, (lh, lw, ch))
            x = x.astype(jnp.float32) * init_sigma[:, None, None, None]
            new = {"x": x, "x0": jnp.zeros_like(x), "sched": sched,
                   "keys": jax.random.key_data(step_keys), "g": inputs.guidance,
                   "r": inputs.rescale, "cfg": cfg, "aidx": aidx, **control}
            if cfg_engine:
                (new["nemb"], new["emb"]) = program_lib.cfg_halves(cond.context)
                (new["npooled"], new["pooled"]) = program_lib.cfg_halves(cond.pooled)
                (new["ntime_ids"], new["time_ids"]) = program_lib.cfg_halves(cond.time_ids)
            else:
                new.update(emb=cond.context, pooled=cond.pooled, time_ids=cond.time_ids)
            return jax.tree.map(lambda old, v: old.at[slot].set(v.astype(old.dtype), mode="drop"),
                                state, new)

        return admit

    def _build_step(self, g: int):
        """The step program whose first ``g`` gathered rows also run negative rows (CFG)."""
        p = self.pipe
        unet, sched = p.unet, self.sched
        lh, lw, ch = self.lh, self.lw, self.channels
        stochastic = self.stochastic
        variants = sched.step_variants()
        nets = self.nets

        def step(params, state, active, index, local, variant, ad=None):
            s, x = state["sched"], state["x"]
            xin = jax.vmap(sched.scale_model_input)(s, x, index)
            t = jax.vmap(sched.timestep_for_model)(s, index)
            emb, pooled, tids = state["emb"], state["pooled"], state["time_ids"]
            aidx = state["aidx"]
            if nets:  # this step's scale of each row for each ControlNet (0 for idle rows)
                scale = jnp.take_along_axis(state["cscale"], index[:, None, None], axis=2)[..., 0]
                scale = scale * active[:, None]
                guess, images = state["cguess"], state["cimg"]
            if g:  # negative rows first, for the first g rows (the guided ones)
                xin, t = jnp.concatenate([xin[:g], xin]), jnp.concatenate([t[:g], t])
                emb = jnp.concatenate([state["nemb"][:g], emb])
                pooled = jnp.concatenate([state["npooled"][:g], pooled])
                tids = jnp.concatenate([state["ntime_ids"][:g], tids])
                aidx = jnp.concatenate([aidx[:g], aidx])
                if nets:  # guess mode: the negative rows get no residuals
                    scale = jnp.concatenate([jnp.where(guess[:g], 0.0, scale[:g]), scale])
                    guess = jnp.concatenate([guess[:g], guess])
                    images = tuple(jnp.concatenate([im[:g], im]) for im in images)
            cond = Cond(emb, pooled, tids)
            down = mid = None
            if nets:
                down, mid = control_residuals(nets, params["controlnets"], xin, t, cond, images,
                                              scale, guess)
            with adapterlib.applied((ad or {}).get("unet"), aidx):
                out = p.family.denoise(unet, params["unet"], cond, xin, t,
                                       down_block_additional_residuals=down,
                                       mid_block_additional_residual=mid)
            out = out.astype(jnp.float32)
            if g:
                text = out[g:]
                guided = program_lib.guide_pair(out[:g], text[:g], state["g"][:g, None, None, None],
                                                state["r"][:g, None, None, None])
                out = jnp.concatenate([
                    jnp.where(state["cfg"][:g, None, None, None], guided, text[:g]), text[g:]])
            noise = None
            if stochastic:
                keys = jax.random.wrap_key_data(state["keys"])
                noise = program_lib.step_noise(keys, local, (lh, lw, ch))

            def one(sc, st, o, xx, i, nz):
                return sc.step(st, o, xx, i, noise=nz)

            in_axes = (0, 0, 0, 0, 0 if stochastic else None)
            new_s, new_x = jax.vmap(functools.partial(one, (variants or (sched,))[0]), in_axes)(
                s, out, x, index, noise)
            for k, v in enumerate((variants or ())[1:], start=1):  # each row's own variant
                _, x_k = jax.vmap(functools.partial(one, v), in_axes)(s, out, x, index, noise)
                new_x = jnp.where((variant == k)[:, None, None, None], x_k, new_x)
            x0 = jax.vmap(sched.denoised)(s, out, x, index)

            def keep(new, old):
                m = active.reshape((-1,) + (1,) * (old.ndim - 1))
                return jnp.where(m, new.astype(old.dtype), old)

            state = dict(state, x=keep(new_x, x), x0=keep(x0, state["x0"]),
                         sched=jax.tree.map(keep, new_s, s))
            return state

        def step_rows(params, state, rows, active, index, local, variant, ad=None):
            # the slots in ``rows`` only (distinct; padding rows are inactive): gather, step,
            # scatter back, so a tick costs what its active images need. Also returns each
            # row's step count after this step (0 for padding): the host reads its progress
            # from what the device ran
            sub = jax.tree.map(lambda a: a[rows], state)
            sub = step(params, sub, active, index, local, variant, ad)
            executed = jnp.where(active, local + 1, 0).astype(jnp.int32)
            return jax.tree.map(lambda a, v: a.at[rows].set(v), state, sub), executed

        return step_rows

    def _build_decode(self):
        vae = self.pipe.vae
        out = program_lib.out_kind(self.output_type, self.tiled)

        def decode(params, latents, idx):
            return program_lib.finish(vae, params["vae"], jnp.take(latents, idx, axis=0), out)

        return decode

    def _adapter_args(self):
        tables = self.pipe.adapter_tables
        return () if tables is None else (tables.as_tree(),)

    def _params(self):
        """The programs' weights: the pipeline's (live: a LoRA fused later is used), and the
        ControlNets' when there are any."""
        p = self.pipe.params
        return dict(p, controlnets=self.pipe.controlnet_params) if self.nets else p

    # ------------------------------------------------------------------ running
    def admit(self, take: list[Handle], free: list[int], b: int) -> None:
        """Write ``take`` into slots ``free`` (batch padded to ``b``; ``take`` may be empty):
        their text embeddings, time ids, guidance, initial latents from their seeds and
        scheduler tables. Sets each handle's ``seed`` (drawn here when the request has none)."""
        p, n = self.pipe, len(take)
        items = [h.request for h in take] or [ImageRequest(prompt="", guidance_scale=0.0, seed=0)]
        inputs = dataclasses.replace(p.host_inputs(items, self.height, self.width),
                                     cfg=self.cfg)  # the engine's rows, whatever the items ask
        for h, sd in zip(take, inputs.seeds):
            h.seed = int(sd)
        cfg = np.array([cfg_on(it.guidance_scale) for it in items])
        steps = [h.steps for h in take] or [1]
        scheds = [self.schedule(k) for k in steps]
        sched = jax.tree.map(lambda *a: np.stack(a), *[sc for sc, _ in scheds])
        init_sigma = np.array([sg for _, sg in scheds], np.float32)
        aidx = p.adapter_index(items)
        aidx = np.zeros(len(items), np.int32) if aidx is None else aidx
        slot = np.array(free + [self.slots] * (b - n), np.int32)  # padding rows are dropped

        put = program_lib.BatchPut(p.mesh, b)
        args = (put(slot), put.tree(inputs), put(init_sigma), put(cfg), put.tree(sched),
                put(aidx), put.tree(self._control_rows(take, steps)))
        self._state = self._program("admit", b)(self._params(), self._state, *args,
                                                *self._adapter_args())

    def _control_rows(self, take: list[Handle], steps: list[int]) -> dict:
        """The admitted images' ControlNet state (none without ControlNets): control images
        resized as the ControlNet pipeline resizes them, scale tables (``scale`` x
        :func:`pipelines.controlnet.control_keep` over each image's own steps, padded at the
        front to ``max_steps`` like the schedules) and guess mode."""
        if not self.nets:
            return {}
        k, n = len(self.nets), self.max_steps
        if not take:  # warm-up: one empty row
            return {"cimg": tuple(np.zeros((1, self.height, self.width, 3), np.float32)
                                  for _ in self.nets),
                    "cscale": np.zeros((1, k, n), np.float32), "cguess": np.zeros((1, k), bool)}
        rows = [control_inputs(self.nets, [h.controls], self.height, self.width, st)
                for h, st in zip(take, steps)]
        return {"cimg": tuple(np.concatenate([r[0][j] for r in rows]) for j in range(k)),
                "cscale": np.concatenate([np.pad(sc, ((0, 0), (0, 0), (n - sc.shape[2], 0)))
                                          for _, sc, _ in rows]),
                "cguess": np.concatenate([gs for _, _, gs in rows])}

    def step(self, plan: StepPlan):
        """Queue one step of ``plan``'s rows; returns the device array of each row's step count
        after it (0 for padding rows)."""
        args = meshlib.place((plan.rows, plan.active, plan.index, plan.local, plan.variant),
                              self._sharded)
        self._state, executed = self._program("step", plan.b, plan.g)(
            self._params(), self._state, *args, *self._adapter_args())
        return executed

    def decode(self, slots: list[int], preview: bool = False):
        """Queue the VAE decode of ``slots``' latents (``preview``: their denoised estimates),
        batch padded to a bucket; returns the device output for :meth:`fetch`."""
        latents = self._state["x0" if preview else "x"]
        n = len(slots)
        b = min(bucket_size(n, self.pipe.mesh.size), self.slots)
        idx = meshlib.place(np.array(slots + [slots[-1]] * (b - n), np.int32), self._sharded)
        out = self._program("decode", b)(self._params(), latents, idx)
        if self.tiled:
            out = self.pipe.decode_tiled(out, self.output_type != "np")
        return out

    def fetch(self, out, n: int) -> list:
        """The first ``n`` decoded images of a decode output, on the host (waits for it)."""
        return list(program_lib.host_images(out, n, self.output_type))

    def warmup(self) -> int:
        """Compile every program without touching any slot; returns how many are compiled."""
        for b in self.batch_sizes:
            self.admit([], [], b)
            self.decode([0] * b)
        for b, g in self.step_shapes:
            args = meshlib.place((np.arange(b, dtype=np.int32), np.zeros(b, bool),
                                   np.zeros(b, np.int32), np.zeros(b, np.int32),
                                   np.zeros(b, np.int32)), self._sharded)
            self._state, _ = self._program("step", b, g)(self._params(), self._state, *args,
                                                         *self._adapter_args())
        jax.block_until_ready(self._state)
        return self.num_compiled


class StepEngine:
    """Continuous batching over denoising steps for one (height, width) of ``pipe``: a
    host-only :class:`pipelines.step_scheduler.SlotScheduler` (queue, slots, policy, batch
    shapes) and a :class:`StepRunner` (compiled programs, device state), paced by the device.

    ``slots``: images advanced together per tick (a multiple of the mesh size); ``cfg``: see the
    module docstring; ``max_steps``: the most steps an image may take (default: the
    scheduler's limit; the per-slot tables have this length, the programs do not depend on it);
    ``output_type``: ``"pil"`` or ``"np"`` (float32 [0, 1]); ``lookahead``: ticks left queued
    on the device when :meth:`tick` returns (see *Pacing* in the module docstring): 1 (default)
    overlaps the host's work for the next tick with the device's step, 0 returns only once the
    tick's own step has run; ``policy``: the order queued images take free slots in, ``"fifo"``
    (default: submission order), ``"srs"`` (shortest remaining steps first, aged so that a long
    image is never starved; the rule: :mod:`pipelines.step_scheduler`) or a
    :class:`pipelines.step_scheduler.Policy`.

    Not thread-safe for concurrent :meth:`tick` calls; :meth:`submit` and :meth:`cancel` may be
    called from other threads while one thread ticks.
    """

    def __init__(self, pipe, height: int | None = None, width: int | None = None, slots: int = 8,
                 *, cfg: bool = True, max_steps: int | None = None, output_type: str = "pil",
                 lookahead: int = 1, policy: str | Policy = "fifo"):
        self.pipe = pipe
        self.height = pipe.default_height if height is None else height
        self.width = pipe.default_width if width is None else width
        self.max_steps = pipe.max_steps if max_steps is None else int(max_steps)
        pipe.check_request(1, self.height, self.width, output_type)
        if not 1 <= self.max_steps <= pipe.max_steps:
            raise ValueError(f"max_steps={max_steps}; {type(pipe.scheduler).__name__} allows "
                             f"1..{pipe.max_steps}")
        if pipe.scheduler.num_model_calls(2) != 2:  # PNDM: steps + 1 calls, a redone step
            raise ValueError(
                f"{type(pipe.scheduler).__name__} makes more model calls than steps, which the "
                "step engine does not schedule; use engine=batch (the pipeline) or another "
                "scheduler (e.g. EulerDiscreteScheduler, DPMSolverMultistepScheduler)")
        if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
            raise ValueError(f"lookahead={lookahead!r}; it must be an integer >= 0 (ticks left "
                             "queued on the device when tick() returns)")
        self.scheduler = SlotScheduler(slots, pipe.mesh.size, self.max_steps, cfg=bool(cfg),
                                       policy=policy, variant_of=pipe.scheduler.step_variant)
        self.slots, self.cfg, self.output_type = slots, bool(cfg), output_type
        self.lookahead = lookahead
        self.batch_sizes = self.scheduler.batch_sizes
        self.runner = StepRunner(pipe, self.height, self.width, slots, self.batch_sizes,
                                 cfg=self.cfg, max_steps=self.max_steps, output_type=output_type)
        self._inflight: collections.deque[_Tick] = collections.deque()  # oldest first
        # images in and out; ticks run (and those with guided images); slot-steps done (active
        # slots summed over ticks; guided_slot_steps: those with negative rows); tick_images:
        # ticks by the number of images they stepped ({"1": 40, "2": 12}); host_s: seconds the
        # ticking thread spent working (scheduling, dispatch, callbacks), wait_s: seconds it
        # waited for the device (a tick's step, its decodes)
        self.stats = self.scheduler.stats
        self.stats.update(host_s=0.0, wait_s=0.0)

    @property
    def policy(self) -> Policy:
        return self.scheduler.policy

    @property
    def num_compiled(self) -> int:
        """Programs compiled so far (at most :attr:`max_programs`)."""
        return self.runner.num_compiled

    @property
    def max_programs(self) -> int:
        """The programs this engine can compile (all of them at :meth:`warmup`)."""
        return self.runner.max_programs

    # ------------------------------------------------------------------ public API
    def submit(self, request: ImageRequest, steps: int | None = None,
               on_progress: Callable[[Handle], None] | None = None,
               previews: Iterable[int] = (), controls: Sequence[ControlImage] | None = None
               ) -> Handle:
        """Queue one image (``steps`` None: the pipeline's default). It joins a free slot at
        a coming tick, in the policy's order. ``on_progress(handle)`` is called from the
        ticking thread once the device has run each of its steps (``handle.step`` is then that
        step), and at ticks where it stays queued but its ``queue_position`` changed.
        ``previews``: steps (1 to ``steps``) after which its denoised estimate is VAE-decoded on
        the device, in the tick that runs that step; ``handle.preview`` / ``preview_step`` hold
        it when ``on_progress`` reports that step. ``controls``: with an engine over a
        :class:`pipelines.ControlNetPipeline` (and only then), one
        :class:`pipelines.requests.ControlImage` per ControlNet: the image's control image,
        scale, window (fractions of its own steps) and guess mode."""
        steps = self.pipe.default_steps if steps is None else steps
        self.pipe.check_request(steps, self.height, self.width, self.output_type)
        check([steps_problem(steps, self.max_steps, "this engine's max_steps")])
        request.validate()
        if self.runner.nets:
            if controls is None:
                raise ValueError("controls is required: this engine runs ControlNets; give one "
                                 f"ControlImage per ControlNet ({len(self.runner.nets)})")
            controls = list(controls) if isinstance(controls, (list, tuple)) else controls
            self.pipe.check_controls(controls)
        elif controls is not None:
            raise ValueError("controls: this engine has no ControlNets; make it over a "
                             "ControlNetPipeline to give control images")
        if self.pipe.adapter_index([request]) is None and request.adapter is not None:
            raise ValueError(f"adapter={request.adapter!r} is not added; no adapters are added")
        if not self.cfg and cfg_on(request.guidance_scale):
            raise ValueError(f"guidance_scale={request.guidance_scale}: this engine runs without "
                             "classifier-free guidance (cfg=False); use guidance <= 1")
        previews = frozenset(previews)
        bad = sorted(k for k in previews if not isinstance(k, (int, np.integer))
                     or isinstance(k, bool) or not 1 <= k <= steps)
        if bad:
            raise ValueError(f"previews={sorted(previews, key=str)}: {bad} not in 1..{steps} "
                             "(the steps after which to decode a preview)")
        return self.scheduler.submit(Handle(request=request, steps=int(steps),
                                            on_progress=on_progress, previews=previews,
                                            controls=controls))

    def cancel(self, handle: Handle) -> None:
        """Cancel an image: a queued one leaves the queue, a running one frees its slot at the
        next tick (no step of it is queued on the device after that; one already queued still
        runs). Images whose last step is already queued are not affected."""
        self.scheduler.cancel(handle)

    def queue_position(self, handle: Handle) -> int:
        """0 when the image holds a slot (or is done), else 1 + the images ahead of it in the
        policy's order."""
        return self.scheduler.queue_position(handle)

    @property
    def active(self) -> int:
        """Slots held by images with steps still to queue."""
        return self.scheduler.active

    @property
    def queued(self) -> int:
        return self.scheduler.queued

    @property
    def idle(self) -> bool:
        """Nothing queued, no slot held, no tick left on the device."""
        return not self.queued and not self.active and not self._inflight

    def tick(self) -> list[Handle]:
        """One scheduling round, paced by the device. Frees the slots of cancelled images,
        admits queued images into free slots, queues one step of every active slot on the
        device (and the VAE decode of the images that take their last step), then waits until
        at most ``lookahead`` ticks are left unfinished on the device (all of them when nothing
        was queued) and reports those that finished: progress from the step program's output,
        previews, finished images. Returns the images finished or cancelled in this call."""
        t0, waited = time.perf_counter(), self.stats["wait_s"]
        out = self.scheduler.reap_cancelled()
        take, free, b = self.scheduler.admit()
        if take:
            self.runner.admit(take, free, b)
        for h in self.scheduler.report_queue_positions():
            if h.on_progress is not None:
                h.on_progress(h)
        launched = self._launch()
        while self._inflight and (launched is None or len(self._inflight) > self.lookahead):
            out += self._complete(self._inflight.popleft())
        self.stats["host_s"] += time.perf_counter() - t0 - (self.stats["wait_s"] - waited)
        return out

    def run_until_idle(self, max_ticks: int | None = None) -> list[Handle]:
        """Tick until no image is queued or running; returns the finished handles in order."""
        done = []
        ticks = 0
        while not self.idle and (max_ticks is None or ticks < max_ticks):
            done += self.tick()
            ticks += 1
        return done

    def abort(self) -> list[Handle]:
        """Give up on every image not finished (after a failed tick): they are marked cancelled,
        the queue, the slots and the ticks in flight are dropped; returns them. The engine is
        usable afterwards."""
        ticks, self._inflight = list(self._inflight), collections.deque()
        return self.scheduler.abort([h for t in ticks for h in t.finishing])

    def warmup(self) -> int:
        """Compile every program this engine can run (the step programs and the admit and
        decode programs of each batch size) without touching any slot; returns how many."""
        return self.runner.warmup()

    # ------------------------------------------------------------------ execution
    def _launch(self) -> _Tick | None:
        """Queue one step of every active slot on the device (the scheduler's plan), then the
        decodes of the images that took their last step (their slots are free for the next
        tick: the decode reads this tick's latents, whatever is admitted there later) and of
        the previews asked for at this step. Returns the tick, or None when no slot is
        active."""
        plan = self.scheduler.plan_step()
        if plan is None:
            return None
        executed = self.runner.step(plan)
        finishing, previewed = self.scheduler.stepped(plan)
        images = self.runner.decode([h.slot for h in finishing]) if finishing else None
        previews = (self.runner.decode([h.slot for h in previewed], preview=True)
                    if previewed else None)
        tick = _Tick(plan.handles, executed, finishing, images, previewed, previews)
        self._inflight.append(tick)
        return tick

    def _complete(self, tick: _Tick) -> list[Handle]:
        """Wait for a queued tick to run and report it: each image's step as the step program
        returned it, then its preview, then the finished images. Returns those."""
        t0 = time.perf_counter()
        executed = np.asarray(jax.device_get(tick.executed))  # blocks until the step has run
        self.stats["wait_s"] += time.perf_counter() - t0
        live = [h for h in tick.rows if h.status == "running"]  # not cancelled meanwhile
        for h, k in zip(tick.rows, executed):
            if h.status == "running":
                h.step = int(k)
        for h in live:
            if h.on_progress is not None and h not in tick.previewed and h not in tick.finishing:
                h.on_progress(h)
        if tick.previewed:
            for h, im in zip(tick.previewed, self._fetch(tick.previews, len(tick.previewed))):
                h.preview, h.preview_step = im, h.step
                if h.on_progress is not None and h.status == "running" and h not in tick.finishing:
                    h.on_progress(h)
        if not tick.finishing:
            return []
        self.scheduler.finished(tick.finishing, self._fetch(tick.images, len(tick.finishing)))
        for h in tick.finishing:
            if h.on_progress is not None:
                h.on_progress(h)
        return list(tick.finishing)

    def _fetch(self, out, n: int) -> list:
        t0 = time.perf_counter()
        images = self.runner.fetch(out, n)
        self.stats["wait_s"] += time.perf_counter() - t0
        return images
