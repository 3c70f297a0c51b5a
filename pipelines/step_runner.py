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
from maxdiff.family import Cond
from pipelines import program as program_lib
from pipelines.limits import cfg_on, guided_steps
from pipelines.requests import ImageRequest, bucket_size
from pipelines.step_scheduler import Handle, StepPlan, step_shapes
from pipelines.tasks.controlnet import control_inputs, control_residuals, guided_controls

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
        # ControlNets (a ControlNetPipeline): each slot also holds its control images, its
        # scale table (per ControlNet, padded at the front like the schedules) and guess mode
        self.nets = getattr(pipe, "controlnets", ())
        # an IP-Adapter loaded when the engine is made: each slot also holds its image tokens
        # (and the negative rows') and its scale (0: no image prompt)
        self.ip = getattr(pipe, "ip_adapter", None)
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
        """Every slot's device state, zeros (the leading axis of every leaf is the slot)."""
        s, lat = self.slots, (self.slots, self.lh, self.lw, self.channels)
        p = self.pipe
        tokens = (p.tokenizer or p.tokenizer_2).model_max_length
        encoders = {name: getattr(p, name) for name in p.family.encoders}
        text = jax.eval_shape(
            lambda prm, ids: p.family.encode(encoders, prm, ids), p.params,
            jax.ShapeDtypeStruct((2, 1, tokens), jnp.int32))
        emb, pooled = text.context, text.pooled
        sched, _ = self.schedule(1)
        state = {
            "x": np.zeros(lat, np.float32), "x0": np.zeros(lat, np.float32),
            "sched": jax.tree.map(lambda a: np.zeros((s, *a.shape), a.dtype), sched),
            "keys": np.zeros((s, *jax.random.key_data(jax.random.key(0)).shape), np.uint32),
            "emb": np.zeros((s, *emb.shape[1:]), np.float32),
            "pooled": np.zeros((s, *pooled.shape[1:]), np.float32),
            "time_ids": np.zeros((s, p.family.n_time_ids), np.float32),
            "g": np.ones(s, np.float32), "r": np.zeros(s, np.float32), "cfg": np.zeros(s, bool),
            "cut": np.zeros(s, np.int32), "aidx": np.zeros(s, np.int32),
        }
        if self.ip is not None:
            tok = np.zeros((s, self.ip.tokens, p.unet.config.cross_attention_dim), np.float32)
            state.update(itok=tok, iscale=np.zeros(s, np.float32))
            if self.cfg:
                state["nitok"] = np.zeros_like(tok)
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
        p = self.pipe
        encoders = {name: getattr(p, name) for name in p.family.encoders}
        lh, lw, ch = self.lh, self.lw, self.channels
        cfg_engine = self.cfg
        ip = self.ip

        def admit(params, state, slot, inputs, init_sigma, cfg, cut, sched, aidx, control,
                  ad=None):
            # the pipeline's conditioning and noise, for a batch of new images; rows for slot
            # index == slots are padding and are dropped by the scatter
            cond, _ = program_lib.conditioning(p.family, encoders, params, inputs, ad,
                                               None if ad is None else aidx, ip)
            init_keys, step_keys = program_lib.image_keys(inputs.seeds)
            x = program_lib.normal(init_keys, (lh, lw, ch))
            x = x.astype(jnp.float32) * init_sigma[:, None, None, None]
            new = {"x": x, "x0": jnp.zeros_like(x), "sched": sched,
                   "keys": jax.random.key_data(step_keys), "g": inputs.guidance,
                   "r": inputs.rescale, "cfg": cfg, "cut": cut, "aidx": aidx, **control}
            if cfg_engine:
                (new["nemb"], new["emb"]) = program_lib.cfg_halves(cond.context)
                (new["npooled"], new["pooled"]) = program_lib.cfg_halves(cond.pooled)
                (new["ntime_ids"], new["time_ids"]) = program_lib.cfg_halves(cond.time_ids)
            else:
                new.update(emb=cond.context, pooled=cond.pooled, time_ids=cond.time_ids)
            if ip is not None:
                new["iscale"] = inputs.ip_scale
                if cfg_engine:
                    (new["nitok"], new["itok"]) = program_lib.cfg_halves(cond.image_tokens)
                else:
                    new["itok"] = cond.image_tokens
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
        ip = self.ip

        def step(params, state, active, index, local, variant, ad=None):
            s, x = state["sched"], state["x"]
            xin = jax.vmap(sched.scale_model_input)(s, x, index)
            t = jax.vmap(sched.timestep_for_model)(s, index)
            emb, pooled, tids = state["emb"], state["pooled"], state["time_ids"]
            aidx = state["aidx"]
            itok = iscale = None
            if ip is not None:  # image prompts: each row's tokens and scale
                itok, iscale = state["itok"], state["iscale"]
            if nets:  # this step's scale of each row for each ControlNet (0 for idle rows)
                scale = jnp.take_along_axis(state["cscale"], index[:, None, None], axis=2)[..., 0]
                scale = scale * active[:, None]
                guess, images = state["cguess"], state["cimg"]
            if g:  # negative rows first, for the first g rows (the guided ones)
                def rows(uncond, cond):
                    return jnp.concatenate([uncond[:g], cond])

                xin, t, aidx = rows(xin, xin), rows(t, t), rows(aidx, aidx)
                emb, pooled = rows(state["nemb"], emb), rows(state["npooled"], pooled)
                tids = rows(state["ntime_ids"], tids)
                if ip is not None:
                    itok, iscale = rows(state["nitok"], itok), rows(iscale, iscale)
                if nets:
                    images, scale, guess = guided_controls(images, scale, guess, rows)
            cond = Cond(emb, pooled, tids, itok, iscale)
            down = mid = None
            if nets:
                down, mid = control_residuals(nets, params["controlnets"], xin, t, cond, images,
                                              scale, guess)
            with adapterlib.applied((ad or {}).get("unet"), aidx):
                out = p.family.denoise(unet, program_lib.denoiser_weights(params, cond), cond,
                                       xin, t,
                                       down_block_additional_residuals=down,
                                       mid_block_additional_residual=mid)
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
        """The programs' weights: the pipeline's (live: a LoRA fused later is used), and the
        ControlNets' when there are any."""
        p = self.pipe.params
        if self.ip is not None:
            p = dict(p, ip_adapter=self.ip.params)
        return dict(p, controlnets=self.pipe.controlnet_params) if self.nets else p

    # ------------------------------------------------------------------ running
    def admit(self, take: list[Handle], free: list[int], b: int) -> None:
        """Write ``take`` into slots ``free`` (batch padded to ``b``; ``take`` may be empty):
        their text embeddings, time ids, guidance (and how many of their steps run it: their
        ``cfg_cutoff``), initial latents from their seeds and scheduler tables. Sets each
        handle's ``seed`` (drawn here when the request has none)."""
        p, n = self.pipe, len(take)
        items = [h.request for h in take] or [ImageRequest(prompt="", guidance_scale=0.0, seed=0)]
        inputs = dataclasses.replace(p.host_inputs(items, self.height, self.width),
                                     cfg=self.cfg)  # the engine's rows, whatever the items ask
        if self.ip is not None and inputs.ip_pixels is None:  # no image prompt: scale 0
            size = self.ip.image_size
            inputs = dataclasses.replace(
                inputs, ip_pixels=np.zeros((len(items), size, size, 3), np.float32),
                ip_scale=np.zeros(len(items), np.float32))
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

        put = program_lib.BatchPut(p.mesh, b)
        args = (put(slot), put.tree(inputs), put(init_sigma), put(cfg), put(cut), put.tree(sched),
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
