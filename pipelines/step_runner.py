"""The device side of a step engine (:class:`pipelines.step_engine.StepEngine`): every slot's
device state and the compiled admit, step and decode programs. It runs what the host-only
:class:`pipelines.step_scheduler.SlotScheduler` decided and knows nothing of queues; every call
only queues work on the device (:meth:`StepRunner.fetch` waits). Design: docs/step-engine.md."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from maxdiff import adapters as adapterlib
from maxdiff import mesh as meshlib
from pipelines import program as program_lib
from pipelines.limits import cfg_on, guided_steps
from pipelines.requests import ImageRequest, bucket_size
from pipelines.step_scheduler import Handle, StepPlan, step_shapes

__all__ = ["StepRunner", "TABLES"]

# scheduler-state fields that are schedules indexed by step (padded at the front per slot)
TABLES = ("timesteps", "sigmas", "alphas_cumprod", "alphas_cumprod_prev")


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
        # the pipeline's task (text-to-image, ControlNet) adds its own state to every slot
        self.task = pipe.task
        if not self.task.steps_in_slots:
            raise ValueError(f"the step engine does not run the {self.task.name} task of "
                             f"{type(pipe).__name__}; run it on the pipeline (engine=batch)")
        # an IP-Adapter loaded when the engine is made: every slot's conditioning holds image
        # tokens and a scale (0: no image prompt)
        self.ip = pipe.ip_adapter
        self.tiled = pipe.uses_vae_tiling(height, width)  # the pipeline's vae_tiling rule
        self._sharded = meshlib.batch_sharded(pipe.mesh)
        self._schedules: dict[int, tuple] = {}
        self._state = self._empty_state()
        self._state_sharding = jax.tree.map(lambda _: self._sharded, self._state)
        self._programs = program_lib.Programs(pipe.mesh)

    # ------------------------------------------------------------------ state
    def schedule(self, steps: int):
        """(padded per-slot scheduler state as numpy leaves, initial noise sigma) for ``steps``
        (made once per step count)."""
        if steps not in self._schedules:
            self._schedules[steps] = self._schedule(steps)
        return self._schedules[steps]

    def _schedule(self, steps: int):
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
        """Every slot's device state, zeros (the leading axis of every leaf is the slot): its
        latents and denoised estimate, scheduler state, step noise key, conditioning (a
        :class:`maxdiff.family.Cond`; ``ncond``: the negative rows', with CFG), guidance,
        rescale, whether and how many steps it is guided, adapter index, and the task's own."""
        s, lat = self.slots, (self.slots, self.lh, self.lw, self.channels)
        p = self.pipe
        cond = jax.eval_shape(self._conditioning, p.program_weights(self.ip is not None),
                              self._host_inputs([self._idle_item()]))
        cond = jax.tree.map(lambda a: np.zeros((s, *a.shape[1:]), np.float32), cond)
        sched, _ = self.schedule(1)
        state = {
            "x": np.zeros(lat, np.float32), "x0": np.zeros(lat, np.float32),
            "sched": jax.tree.map(lambda a: np.zeros((s, *a.shape), a.dtype), sched),
            "keys": np.zeros((s, *jax.random.key_data(jax.random.key(0)).shape), np.uint32),
            "cond": cond, "g": np.ones(s, np.float32), "r": np.zeros(s, np.float32),
            "cfg": np.zeros(s, bool), "cut": np.zeros(s, np.int32), "aidx": np.zeros(s, np.int32),
            **self.task.slot_state(p, s, self.height, self.width, self.max_steps),
        }
        if self.cfg:
            state["ncond"] = jax.tree.map(np.zeros_like, cond)
        return meshlib.place(state, self._sharded)

    @staticmethod
    def _idle_item() -> ImageRequest:
        return ImageRequest(prompt="", guidance_scale=0.0, seed=0)

    def _host_inputs(self, items):
        """The pipeline's host inputs of ``items`` as the slots hold them: the engine's CFG
        whatever the items ask, image prompts in every row where an IP-Adapter is loaded."""
        return dataclasses.replace(
            self.pipe.host_inputs(items, self.height, self.width, every_row=True), cfg=self.cfg)

    def _conditioning(self, params, inputs, ad=None, aidx=None):
        """The admitted images' conditioning (the pipeline's; rows [negative, positive] with
        CFG)."""
        p = self.pipe
        encoders = {name: getattr(p, name) for name in p.family.encoders}
        return program_lib.conditioning(p.family, encoders, params, inputs, ad, aidx, self.ip)[0]

    # ------------------------------------------------------------------ programs
    def _program(self, kind: str, *key):
        def build():
            return {"step": lambda: self._build_step(key[1]), "admit": self._build_admit,
                    "decode": self._build_decode,
                    "preview": lambda: self._build_preview(self.pipe.preview_decoder[0]),
                    }[kind]()

        shard = {"step": dict(out_shardings=(self._state_sharding, self._sharded),
                              donate_argnums=self._donate(1)),
                 "admit": dict(out_shardings=self._state_sharding,
                               donate_argnums=self._donate(1)),
                 "decode": {}, "preview": {}}[kind]
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
        lh, lw, ch = self.lh, self.lw, self.channels
        cfg_engine = self.cfg

        def admit(params, state, slot, inputs, init_sigma, cfg, cut, sched, aidx, rows,
                  ad=None):
            # the pipeline's conditioning and noise, for a batch of new images; rows for slot
            # index == slots are padding and are dropped by the scatter
            cond = self._conditioning(params, inputs, ad, None if ad is None else aidx)
            init_keys, step_keys = program_lib.image_keys(inputs.seeds)
            x = program_lib.normal(init_keys, (lh, lw, ch))
            x = x.astype(jnp.float32) * init_sigma[:, None, None, None]
            new = {"x": x, "x0": jnp.zeros_like(x), "sched": sched,
                   "keys": jax.random.key_data(step_keys), "g": inputs.guidance,
                   "r": inputs.rescale, "cfg": cfg, "cut": cut, "aidx": aidx, **rows}
            if cfg_engine:
                new["ncond"] = jax.tree.map(lambda a: program_lib.cfg_halves(a)[0], cond)
                new["cond"] = program_lib.conditional_half(cond)
            else:
                new["cond"] = cond
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
        task = self.task

        def step(params, state, active, index, local, variant, ad=None):
            s, x = state["sched"], state["x"]
            xin = jax.vmap(sched.scale_model_input)(s, x, index)
            t = jax.vmap(sched.timestep_for_model)(s, index)
            cond, aidx = state["cond"], state["aidx"]
            pair = None
            if g:  # negative rows first, for the first g rows (the guided ones)
                def pair(uncond, cond):
                    return jnp.concatenate([uncond[:g], cond])

                xin, t, aidx = pair(xin, xin), pair(t, t), pair(aidx, aidx)
                cond = jax.tree.map(pair, state["ncond"], cond)
            extras = task.slot_model(p, params, state, index, active, pair)
            extras = {} if extras is None else extras(xin, t, cond)
            with adapterlib.applied((ad or {}).get("unet"), aidx):
                out = p.family.denoise(unet, program_lib.denoiser_weights(params, cond), cond,
                                       xin, t, **extras)
            out = out.astype(jnp.float32)
            if g:  # a first-g row is guided if its image is, before its cfg_cutoff (a row
                # past it, or unguided, can be there as padding of g: its text pass alone)
                text = out[g:]
                guided = program_lib.guide_pair(out[:g], text[:g], state["g"][:g, None, None, None],
                                                state["r"][:g, None, None, None])
                use = state["cfg"][:g] & (local[:g] < state["cut"][:g])
                out = jnp.concatenate([
                    jnp.where(use[:, None, None, None], guided, text[:g]), text[g:]])
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

    def _build_preview(self, module):
        """Previews drawn by the pipeline's preview decoder (TAESD), never tiled."""
        u8 = self.output_type != "np"

        def preview(params, latents, idx):
            z = jnp.take(latents, idx, axis=0)
            return program_lib.to_pixels(module.apply({"params": params}, z), u8)

        return preview

    def _adapter_args(self):
        tables = self.pipe.adapter_tables
        return () if tables is None else (tables.as_tree(),)

    def _params(self):
        """The programs' weights: the pipeline's (live: a LoRA fused later is used), an
        IP-Adapter's, the task's (ControlNets)."""
        return {**self.pipe.program_weights(self.ip is not None),
                **self.task.slot_weights(self.pipe)}

    # ------------------------------------------------------------------ running
    def admit(self, take: list[Handle], free: list[int], b: int) -> None:
        """Write ``take`` into slots ``free`` (batch padded to ``b``; ``take`` may be empty):
        their text embeddings, time ids, guidance (and how many of their steps run it: their
        ``cfg_cutoff``), initial latents from their seeds and scheduler tables. Sets each
        handle's ``seed`` (drawn here when the request has none)."""
        p, n = self.pipe, len(take)
        items = [h.request for h in take] or [self._idle_item()]
        inputs = self._host_inputs(items)
        for h, sd in zip(take, inputs.seeds):
            h.seed = int(sd)
        cfg = np.array([cfg_on(it.guidance_scale) for it in items])
        steps = [h.steps for h in take] or [1]
        # the steps each image runs guided (its cfg_cutoff), compared with its own step number
        cut = np.array([guided_steps(k, it.cfg_cutoff) for it, k in zip(items, steps)], np.int32)
        scheds = [self.schedule(k) for k in steps]
        sched = jax.tree.map(lambda *a: np.stack(a), *[sc for sc, _ in scheds])
        init_sigma = np.array([sg for _, sg in scheds], np.float32)
        aidx = p.adapter_index(items)
        aidx = np.zeros(len(items), np.int32) if aidx is None else aidx
        slot = np.array(free + [self.slots] * (b - n), np.int32)  # padding rows are dropped
        rows = self.task.slot_rows(p, [h.controls for h in take], self.height, self.width,
                                   steps, self.max_steps)

        put = program_lib.BatchPut(p.mesh, b)
        args = (put(slot), put.tree(inputs), put(init_sigma), put(cfg), put(cut), put.tree(sched),
                put(aidx), put.tree(rows))
        self._state = self._program("admit", b)(self._params(), self._state, *args,
                                                *self._adapter_args())

    def step(self, plan: StepPlan):
        """Queue one step of ``plan``'s rows; returns the device array of each row's step count
        after it (0 for padding rows)."""
        args = meshlib.place((plan.rows, plan.active, plan.index, plan.local, plan.variant),
                              self._sharded)
        self._state, executed = self._program("step", plan.b, plan.g)(
            self._params(), self._state, *args, *self._adapter_args())
        return executed

    def decode(self, slots: list[int], preview: bool = False):
        """Queue the VAE decode of ``slots``' latents (``preview``: their denoised estimates,
        drawn by the pipeline's preview decoder when it has one), batch padded to a bucket;
        returns the device output for :meth:`fetch`."""
        latents = self._state["x0" if preview else "x"]
        n = len(slots)
        b = min(bucket_size(n, self.pipe.mesh.size), self.slots)
        idx = meshlib.place(np.array(slots + [slots[-1]] * (b - n), np.int32), self._sharded)
        tiny = getattr(self.pipe, "preview_decoder", None)
        if preview and tiny is not None:  # the tiny decoder draws previews (a few % the cost)
            return self._program("preview", b, id(tiny[0]))(tiny[1], latents, idx)
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
