"""Train the embedded demo model: a small SDXL-architecture pipeline on procedural shapes.

    python -m maxdiff.training.train --config configs/train-demo.yaml --out DIR

Both phases draw only the training split's (shape, colour, background) combinations
(:data:`maxdiff.training.shapes.SPLITS`); validation and test combinations stay unseen.

Two phases, both jitted ``jax.value_and_grad`` + optax AdamW steps in float32:

1. VAE (diffusers ``AutoencoderKL`` architecture, :mod:`maxdiff.models.vae`): L1 + L2
   reconstruction of 64x64 shape images plus a small KL term. Its latent scaling factor is
   1 / std of the latents of a held-out batch.
2. UNet (SDXL ``UNet2DConditionModel``: ``addition_embed_type="text_time"``, cross attention on
   both text encoders' penultimate hidden states, pooled projection of encoder 2) trained
   jointly with the two CLIP text encoders on the epsilon-prediction loss (min-SNR weighted),
   with offset noise and caption dropout (the dropped captions get ZERO text embeddings, which
   is what SDXL pipelines feed the unconditional branch when ``force_zeros_for_empty_prompt``).
   The latents of a pool of generated images are encoded once, before this phase.

An EMA of the phase-2 weights is exported as a diffusers SDXL folder (``--out``) every
``save_every`` steps and at the end, so a run stopped early still leaves a usable model.
``max_minutes`` bounds the phase-2 wall time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from pydantic import Field
from tqdm import tqdm

from maxdiff import checkpoint
from maxdiff.config import StrictConfig, load_config
from maxdiff.models.clip import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
from maxdiff.models.unet import UNet2DConditionModel, UNetConfig, count_params
from maxdiff.models.vae import AutoencoderKL, AutoencoderKLConfig
from maxdiff.schedulers import SDXL_BASE_SCHEDULER_CONFIG
from maxdiff.training import export, shapes

DEFAULT_VOCAB = Path(__file__).resolve().parent.parent / "assets" / "demo-model" / "tokenizer"


class PhaseConfig(StrictConfig):
    steps: int = Field(1000, ge=1)
    batch: int = Field(16, ge=1)
    lr: float = Field(1e-3, gt=0)
    warmup: int = Field(100, ge=0)
    weight_decay: float = Field(0.0, ge=0)


class TrainConfig(StrictConfig):
    """``configs/train-demo.yaml`` (or ``train-demo`` by name); unknown keys are refused."""

    seed: int = 0
    vae: dict = {}  # diffusers AutoencoderKL config
    unet: dict = {}  # diffusers UNet2DConditionModel config
    text_encoder: dict = {}  # transformers CLIPTextConfig fields
    text_encoder_2: dict = {}
    scheduler: dict = {}  # overrides of SDXL's Euler config
    vae_train: PhaseConfig = PhaseConfig()
    unet_train: PhaseConfig = PhaseConfig()
    kl_weight: float = Field(1e-6, ge=0)
    pool_size: int = Field(16384, ge=1)
    caption_dropout: float = Field(0.1, ge=0, le=1)
    offset_noise: float = Field(0.1, ge=0)
    min_snr_gamma: float = Field(5.0, gt=0)
    ema_decay: float = Field(0.999, ge=0, lt=1)
    save_every: int = Field(1000, ge=1)
    max_minutes: float = Field(0.0, ge=0)  # phase-2 wall-time bound; 0: none
    captions: str = Field("v1", pattern="^(v1|v2)$")  # shapes.CAPTION_SETS
    # phase 2 starts from this diffusers folder's UNet and text encoders (a fine-tuning run;
    # their configs must equal this config's) instead of random weights; "" : from scratch
    init_from: str = ""

    @classmethod
    def load(cls, source: str | Path, overrides=None) -> TrainConfig:
        """From a YAML path or a shipped config's name, with ``key=value`` overrides."""
        return load_config(cls, source, overrides, kind="training config")


def _optimizer(p: PhaseConfig, clip: float = 1.0):
    sched = optax.warmup_constant_schedule(0.0, p.lr, max(p.warmup, 1)) if p.warmup else p.lr
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(sched, weight_decay=p.weight_decay))


def _alphas_cumprod(sched_cfg: dict) -> np.ndarray:
    n = sched_cfg["num_train_timesteps"]
    betas = np.linspace(sched_cfg["beta_start"] ** 0.5, sched_cfg["beta_end"] ** 0.5, n,
                        dtype=np.float64) ** 2  # scaled_linear
    return np.cumprod(1.0 - betas).astype(np.float32)


# ---------------------------------------------------------------------- phase 1: the VAE
def train_vae(cfg: TrainConfig, log=print) -> tuple[dict, dict]:
    """Returns (vae config dict with its scaling_factor, params)."""
    vcfg = dict(cfg.vae)
    model = AutoencoderKL(AutoencoderKLConfig.from_dict(vcfg), attention_kernel="xla")
    key = jax.random.key(cfg.seed)
    params = jax.jit(model.init)(key, jnp.zeros((1, shapes.SIZE, shapes.SIZE, 3)))["params"]
    log(f"VAE: {count_params(params):,} parameters")
    p = cfg.vae_train
    tx = _optimizer(p)
    opt = tx.init(params)

    def loss_fn(params, x, k):
        post = model.apply({"params": params}, x, method="encode")
        rec = model.apply({"params": params}, post.sample(k), method="decode")
        l1 = jnp.mean(jnp.abs(rec - x))
        l2 = jnp.mean((rec - x) ** 2)
        kl = 0.5 * jnp.mean(post.mean ** 2 + jnp.exp(post.logvar) - 1.0 - post.logvar)
        return l1 + l2 + cfg.kl_weight * kl, (l1, kl)

    @jax.jit
    def step(params, opt, x, k):
        (loss, aux), g = jax.value_and_grad(loss_fn, has_aux=True)(params, x, k)
        upd, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, upd), opt, loss, aux

    rng = np.random.default_rng(cfg.seed + 1)
    bar = tqdm(range(p.steps), desc="vae", dynamic_ncols=True, mininterval=2.0)
    for i in bar:
        imgs = np.stack([shapes.sample(rng)[0] for _ in range(p.batch)])
        params, opt, loss, (l1, kl) = step(params, opt, shapes.to_model(imgs),
                                            jax.random.fold_in(key, i))
        if i % 10 == 0:
            bar.set_postfix(loss=f"{float(loss):.4f}", l1=f"{float(l1):.4f}", kl=f"{float(kl):.1f}")
    # scaling factor from the latents of fresh images
    imgs, _, _ = shapes.batch(cfg.seed + 2, 256)
    enc = jax.jit(lambda p, x: model.apply({"params": p}, x, method="encode").mean)
    z = np.asarray(enc(params, shapes.to_model(imgs)))
    vcfg["scaling_factor"] = float(1.0 / z.std())
    rec = jax.jit(lambda p, x: model.apply({"params": p}, x))(params, shapes.to_model(imgs[:64]))
    err = float(np.abs((np.asarray(rec) + 1) * 127.5 - imgs[:64]).mean())
    log(f"VAE: latent std {z.std():.3f} -> scaling_factor {vcfg['scaling_factor']:.4f}; "
        f"mean abs reconstruction error {err:.2f}/255")
    return vcfg, params


# ---------------------------------------------------------------------- phase 2: UNet + text
def _tokenizers(vocab_dir: Path):
    from transformers import CLIPTokenizer

    t1 = CLIPTokenizer(str(vocab_dir / "vocab.json"), str(vocab_dir / "merges.txt"))
    t2 = CLIPTokenizer(str(vocab_dir / "vocab.json"), str(vocab_dir / "merges.txt"), pad_token="!")
    t1.model_max_length = t2.model_max_length = 77
    return t1, t2


def _tokenize(tok, captions: list[str]) -> np.ndarray:
    from maxdiff.tokenizers import tokenize

    return tokenize(tok, captions)


def make_pool(cfg: TrainConfig, vae_cfg: dict, vae_params: dict, toks, log=print) -> dict:
    """Encode ``pool_size`` generated images once: latents (diffusion space) and token ids."""
    model = AutoencoderKL(AutoencoderKLConfig.from_dict(vae_cfg), attention_kernel="xla")
    enc = jax.jit(lambda p, x: model.apply({"params": p}, x, method="image_to_latents"))
    rng = np.random.default_rng(cfg.seed + 3)
    lat, caps = [], []
    t0 = time.time()
    for _ in tqdm(range(0, cfg.pool_size, 256), desc="encode pool", dynamic_ncols=True):
        batch = [shapes.sample(rng, "train", cfg.captions) for _ in range(256)]
        lat.append(np.asarray(enc(vae_params, shapes.to_model(np.stack([b[0] for b in batch])))))
        caps += [b[1] for b in batch]
    lat = np.concatenate(lat)[:cfg.pool_size]
    caps = caps[:cfg.pool_size]
    uniq = sorted(set(caps))
    i1, i2 = _tokenize(toks[0], uniq), _tokenize(toks[1], uniq)
    index = {c: k for k, c in enumerate(uniq)}
    sel = np.array([index[c] for c in caps])
    log(f"pool: {len(caps)} images, {len(uniq)} distinct captions, latents std "
        f"{lat.std():.3f}, {time.time() - t0:.0f}s")
    return {"latents": lat, "ids1": i1[sel], "ids2": i2[sel]}


def init_text_and_unet(cfg: TrainConfig, key) -> tuple[dict, tuple]:
    te1 = CLIPTextModel(CLIPTextConfig.from_dict(export.clip_text_config(cfg.text_encoder,
                                                                          projection=False)))
    te2 = CLIPTextModelWithProjection(CLIPTextConfig.from_dict(
        export.clip_text_config(cfg.text_encoder_2, projection=True)))
    unet = UNet2DConditionModel(UNetConfig.from_dict(cfg.unet))
    k1, k2, k3 = jax.random.split(key, 3)
    ids = jnp.zeros((1, 77), jnp.int32)
    p1 = jax.jit(te1.init)(k1, ids)["params"]
    p2 = jax.jit(te2.init)(k2, ids)["params"]
    shapes_in = {k: jnp.zeros(v.shape, v.dtype) for k, v in unet.dummy_inputs(seq=77).items()}
    pu = jax.jit(unet.init)(k3, **shapes_in)["params"]
    return {"unet": pu, "text_encoder": p1, "text_encoder_2": p2}, (te1, te2, unet)


def load_text_and_unet(folder: str | Path, like: dict) -> dict:
    """The UNet and both text encoders of a diffusers folder, as a tree shaped like ``like``
    (what :func:`init_text_and_unet` made from this config); a config mismatch is an error."""
    from maxdiff.models.clip import load_text_encoder
    from maxdiff.models.unet import load_unet

    folder = Path(folder)
    loaded = {"unet": load_unet(folder / "unet")[1],
              "text_encoder": load_text_encoder(folder / "text_encoder")[1],
              "text_encoder_2": load_text_encoder(folder / "text_encoder_2")[1]}
    want = jax.tree_util.tree_map(lambda x: x.shape, like)
    got = jax.tree_util.tree_map(lambda x: x.shape, loaded)
    if want != got:
        raise ValueError(f"init_from={folder}: its UNet / text encoders do not have this "
                         "config's shapes (unet, text_encoder, text_encoder_2 must match)")
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), loaded)


# config keys that do not change the weights a run reaches (a continued run may change them)
_NOT_IN_STATE = ("save_every", "max_minutes")


def _run_identity(cfg: TrainConfig, pool: dict) -> dict:
    """What a state file must match to be continued: the config's keys that shape the weights
    and a digest of the encoded image pool (it also depends on the VAE, ``--vae-from``)."""
    digest = hashlib.sha256()
    for name in ("latents", "ids1", "ids2"):
        digest.update(np.ascontiguousarray(pool[name]).tobytes())
    return {**{k: v for k, v in cfg.model_dump(mode="json").items() if k not in _NOT_IN_STATE},
            "pool_sha256": digest.hexdigest()}


def _save_state(path: Path, identity: dict, done: int, trees: tuple, rng, avg) -> None:
    """The whole phase-2 state after ``done`` steps (weights, optimizer, EMA as float32 leaves;
    the data order's generator; the run it belongs to), written atomically."""
    leaves = jax.tree_util.tree_leaves(trees)
    meta = {"step": done, "run": identity, "rng": rng.bit_generator.state, "loss": avg,
            "leaves": len(leaves)}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
                 **{f"a{k}": np.asarray(x) for k, x in enumerate(leaves)})
    tmp.replace(path)


def _check_state(path: Path, identity: dict, z=None) -> dict:
    """The metadata of a :func:`_save_state` file; a file from another run (other settings,
    another image pool) is an error naming what differs."""
    if z is None:
        with np.load(path) as z:
            return _check_state(path, identity, z)
    meta = json.loads(bytes(z["meta"]))
    diff = sorted(k for k in set(identity) | set(meta["run"])
                  if identity.get(k) != meta["run"].get(k))
    if diff:
        raise ValueError(f"--state {path}: it is the state of a run with other settings "
                         f"({', '.join(diff)} differ); give this run's own state file or "
                         "remove it to start over")
    return meta


def _load_state(path: Path, identity: dict, like: tuple, rng) -> tuple[int, tuple, object]:
    """(steps done, (params, opt, ema), moving loss) from a :func:`_save_state` file, shaped as
    ``like``; ``rng`` is set to where the data order stopped. A file from another run is an
    error naming what differs."""
    with np.load(path) as z:
        meta = _check_state(path, identity, z)
        ref, tree = jax.tree_util.tree_flatten(like)
        if meta["leaves"] != len(ref):
            raise ValueError(f"--state {path}: it holds {meta['leaves']} arrays, this run has "
                             f"{len(ref)}")
        leaves = [jnp.asarray(z[f"a{k}"], r.dtype) for k, r in enumerate(ref)]
    rng.bit_generator.state = meta["rng"]
    return int(meta["step"]), jax.tree_util.tree_unflatten(tree, leaves), meta["loss"]


def train_unet(cfg: TrainConfig, vae_cfg: dict, vae_params: dict, vocab_dir: Path, out: Path,
               sched_cfg: dict, log=print, snapshots: Path | None = None,
               state: Path | None = None, state_every: int = 250,
               stop_at: int | None = None) -> dict:
    """Phase 2. ``state``: a file that holds the whole training state every ``state_every``
    steps (and when the run stops early or is interrupted); a run given an existing one
    continues from it, to the same weights as a run never stopped. ``stop_at``: stop after that
    many steps (with ``state``: to continue later)."""
    toks = _tokenizers(vocab_dir)
    pool = make_pool(cfg, vae_cfg, vae_params, toks, log)
    identity = _run_identity(cfg, pool) if state is not None else None
    if state is not None and state.exists():
        _check_state(state, identity)  # before the models are built
    key = jax.random.key(cfg.seed + 4)
    params, (te1, te2, unet) = init_text_and_unet(cfg, key)
    if cfg.init_from:
        params = load_text_and_unet(cfg.init_from, params)
        log(f"UNet and text encoders: from {cfg.init_from}")
    log("UNet: {:,} parameters; text encoders: {:,} + {:,}".format(
        *(count_params(params[k]) for k in ("unet", "text_encoder", "text_encoder_2"))))
    p = cfg.unet_train
    tx = _optimizer(p)
    opt = tx.init(params)
    ema = jax.tree_util.tree_map(jnp.copy, params)
    ac = jnp.asarray(_alphas_cumprod(sched_cfg))
    n_t = ac.shape[0]
    size = shapes.SIZE
    time_ids = jnp.asarray([[size, size, 0, 0, size, size]], jnp.float32)

    def loss_fn(params, lat, ids1, ids2, k):
        b = lat.shape[0]
        kd, kt, kn, ko = jax.random.split(k, 4)
        o1 = te1.apply({"params": params["text_encoder"]}, ids1)
        o2 = te2.apply({"params": params["text_encoder_2"]}, ids2)
        emb = jnp.concatenate([o1.hidden_states[-2], o2.hidden_states[-2]], axis=-1)
        pooled = o2.text_embeds
        keep = (jax.random.uniform(kd, (b,)) >= cfg.caption_dropout).astype(jnp.float32)
        emb = emb * keep[:, None, None]
        pooled = pooled * keep[:, None]
        t = jax.random.randint(kt, (b,), 0, n_t)
        a = ac[t][:, None, None, None]
        noise = jax.random.normal(kn, lat.shape)
        noise = noise + cfg.offset_noise * jax.random.normal(ko, (b, 1, 1, lat.shape[-1]))
        x = jnp.sqrt(a) * lat + jnp.sqrt(1 - a) * noise
        pred = unet.apply({"params": params["unet"]}, x, t, emb, pooled,
                          jnp.broadcast_to(time_ids, (b, 6)))
        snr = ac[t] / (1 - ac[t])
        w = jnp.minimum(snr, cfg.min_snr_gamma) / snr if cfg.min_snr_gamma else 1.0
        per = jnp.mean((pred - noise) ** 2, axis=(1, 2, 3))
        return jnp.mean(w * per), jnp.mean(per)

    @jax.jit
    def step(params, opt, ema, i, lat, ids1, ids2, k):
        (loss, raw), g = jax.value_and_grad(loss_fn, has_aux=True)(params, lat, ids1, ids2, k)
        upd, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, upd)
        d = jnp.minimum(cfg.ema_decay, (1.0 + i) / (10.0 + i))
        ema = jax.tree_util.tree_map(lambda e, q: d * e + (1 - d) * q, ema, params)
        return params, opt, ema, loss, raw

    def save(tag: str):
        export.export_pipeline(
            out, unet_config=cfg.unet, unet_params=ema["unet"], vae_config=vae_cfg,
            vae_params=vae_params, te1_config=cfg.text_encoder, te1_params=ema["text_encoder"],
            te2_config=cfg.text_encoder_2, te2_params=ema["text_encoder_2"],
            scheduler_config=sched_cfg, vocab_dir=vocab_dir,
            metadata={"maxdiff_train_step": tag})
        if snapshots is not None:  # the learning rate is constant after warm-up, so step-N here
            dst = snapshots / f"step-{tag}"  # is exactly what a run with steps=N ships
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(out, dst)

    rng = np.random.default_rng(cfg.seed + 5)
    n = pool["latents"].shape[0]
    avg = None
    done = 0
    if state is not None and state.exists():
        done, (params, opt, ema), avg = _load_state(state, identity, (params, opt, ema), rng)
        log(f"continuing from {state}: step {done} of {p.steps}")
    t0 = time.time()
    limit = cfg.max_minutes * 60 if cfg.max_minutes else float("inf")
    last = p.steps if stop_at is None else min(p.steps, stop_at)
    bar = tqdm(range(done, last), desc="unet", dynamic_ncols=True, mininterval=2.0,
               initial=done, total=p.steps)
    interrupted = None
    try:
        for i in bar:
            idx = rng.integers(0, n, p.batch)
            params, opt, ema, loss, raw = step(params, opt, ema, jnp.float32(i),
                                               pool["latents"][idx], pool["ids1"][idx],
                                               pool["ids2"][idx], jax.random.fold_in(key, i))
            done = i + 1
            if i % 10 == 0:
                lv = float(raw)
                avg = lv if avg is None else 0.9 * avg + 0.1 * lv
                bar.set_postfix(loss=f"{avg:.4f}")
            if done % cfg.save_every == 0:
                save(str(done))
            if state is not None and done % state_every == 0 and done < p.steps:
                _save_state(state, identity, done, (params, opt, ema), rng, avg)
            if time.time() - t0 > limit:
                log(f"stopping at step {done}: max_minutes={cfg.max_minutes} reached")
                break
            if _STOP.is_set():  # SIGTERM / Ctrl-C (main's handler): stop between steps
                interrupted = KeyboardInterrupt()
                break
    except KeyboardInterrupt as e:  # a second Ctrl-C, or no handler: keep what was done
        interrupted = e
    bar.close()
    if state is not None and done < p.steps:
        _save_state(state, identity, done, (params, opt, ema), rng, avg)
        log(f"stopped at step {done} of {p.steps}; the same command continues from {state}")
    if interrupted is not None:
        raise interrupted
    save(str(done))
    if state is not None and done == p.steps and state.exists():
        state.unlink()  # the run is complete: the same command now starts a new one
    return {"steps": done, "seconds": time.time() - t0, "loss": avg}


_STOP = threading.Event()  # set by SIGTERM / Ctrl-C while the UNet phase runs (main)


def _interrupt(signum, frame):
    """SIGTERM or Ctrl-C: the UNet loop stops after its current step and keeps its state (a
    flag: an exception raised here could land where Python ignores it, such as a garbage
    collector callback, and the run would go on); a second one stops at once."""
    if _STOP.is_set():
        raise KeyboardInterrupt
    _STOP.set()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Train the maxdiff demo model (see module doc).")
    ap.add_argument("--config", default="train-demo",
                    help="training config: a YAML path or a shipped name (default train-demo)")
    ap.add_argument("--out", required=True, help="diffusers folder to write (replaced)")
    ap.add_argument("--vocab", default=str(DEFAULT_VOCAB),
                    help="folder with CLIP's vocab.json + merges.txt (scripts/clip_vocab.py)")
    ap.add_argument("--vae-from", default=None,
                    help="reuse the VAE of an earlier run's folder instead of training one")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=YAML",
                    help="override top-level config keys, e.g. max_minutes=5")
    ap.add_argument("--snapshots", default=None, metavar="DIR",
                    help="also keep every saved UNet checkpoint as DIR/step-N (for a training "
                         "curve: evaluate them with pipelines.demo_eval --model DIR/step-N)")
    ap.add_argument("--state", default=None, metavar="FILE",
                    help="keep the UNet phase's whole state (weights, optimizer, EMA, data order) "
                         "in FILE every --state-every steps and when stopped (Ctrl-C, SIGTERM, "
                         "--stop-at); a run whose FILE exists continues from it, to the same "
                         "weights as a run never stopped")
    ap.add_argument("--state-every", type=int, default=250, metavar="N",
                    help="steps between --state writes (default 250)")
    ap.add_argument("--stop-at", type=int, default=None, metavar="N",
                    help="stop the UNet phase after N steps (with --state: continue later)")
    a = ap.parse_args(argv)
    if a.state_every < 1 or (a.stop_at is not None and a.stop_at < 1):
        ap.error("--state-every and --stop-at must be >= 1")
    cfg = TrainConfig.load(a.config, a.set)
    out = Path(a.out)
    t0 = time.time()
    # keep a private copy of the vocabulary: --out may be the folder it came from
    tmp = Path(tempfile.mkdtemp(prefix="maxdiff-vocab-"))
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(Path(a.vocab) / name, tmp / name)
    sched_cfg = dict(SDXL_BASE_SCHEDULER_CONFIG, **cfg.scheduler)
    if a.vae_from:
        from maxdiff.models.vae import load_vae

        vae_cfg = {k: v for k, v in checkpoint.read_config(Path(a.vae_from) / "vae").items()
                   if not k.startswith("_")}
        _, vae_params = load_vae(Path(a.vae_from) / "vae")
        vae_params = jax.tree_util.tree_map(np.asarray, vae_params)
        print(f"VAE: reused from {a.vae_from}")
    else:
        vae_cfg, vae_params = train_vae(cfg)
    t1 = time.time()
    # SIGTERM and Ctrl-C stop the run between steps (its state is kept); the caller's handlers
    # are put back
    main_thread = threading.current_thread() is threading.main_thread()
    _STOP.clear()
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)
                } if main_thread else {}
    try:
        stats = train_unet(cfg, vae_cfg, vae_params, tmp, out, sched_cfg,
                           snapshots=Path(a.snapshots) if a.snapshots else None,
                           state=Path(a.state) if a.state else None,
                           state_every=a.state_every, stop_at=a.stop_at)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(tmp)
    total = time.time() - t0
    print(json.dumps({"out": str(out), "vae_s": round(t1 - t0), "unet_s": round(stats["seconds"]),
                      "unet_steps": stats["steps"], "total_s": round(total),
                      "size_bytes": export.folder_size(out)}))


if __name__ == "__main__":
    main()
