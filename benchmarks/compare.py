"""maxdiff against diffusers (PyTorch) on the same weights, side by side in one process.

    python -m benchmarks.compare --quick          # the medium checkpoint
    python -m benchmarks.compare --configs tiny medium [--reps 7] [--full]
    python -m benchmarks.compare --quick --repeats 3 --json cmp.json   # 3 fresh processes
    python -m benchmarks.compare --configs tiny --reps 1 --compile off # smoke run

For each checkpoint it writes random weights with diffusers (``save_pretrained``), loads them
into maxdiff and into diffusers (the tuned variant has its own copy of the UNet and the VAE),
and times, fp32, three contestants per part:

- ``maxdiff``: the jitted JAX function;
- ``diffusers default``: eager PyTorch under ``torch.no_grad()``, as diffusers' examples run it;
- ``diffusers tuned``: what a PyTorch user turns on for the CPU: ``torch.inference_mode()``,
  ``channels_last`` weights and inputs for the UNet and the VAE, and ``torch.compile``
  (inductor, with ``torch._inductor.config.freezing``) of the text encoders, the UNet and
  ``vae.decode`` where it compiles here (``--compile``, below).

``diffusers_best_s`` is the faster of default and tuned for that part (``channels_last`` can be
slower for the VAE decode, so neither variant wins everywhere); ``ratio`` is best diffusers'
time / maxdiff's time (above 1, maxdiff is faster), ``ratio_default`` the same against the
default variant. The parts:

- ``text``: both CLIP text encoders on the batch's prompts, equal work: both sides return
  what SDXL's pipeline uses (the penultimate hidden state of both encoders, concatenated
  (B, 77, D1 + D2), and encoder 2's projected pooled output ``text_embeds`` (B, P)) plus
  CLIP-L's ``last_hidden_state``, so both run every layer of both encoders (maxdiff's
  :func:`maxdiff_text`; diffusers' :func:`diffusers_text` makes the calls
  ``StableDiffusionXLPipeline.encode_prompt`` makes). In maxdiff's pipeline XLA drops CLIP-L's
  last layer, which nothing there uses, while diffusers' runs it: that advantage shows in the
  ``pipeline`` row only;
- ``unet``: one UNet forward at the checkpoint's latent size (one denoising step, no CFG),
  called as the pipelines call it;
- ``vae``: one VAE decode of the batch's latents;
- ``pipeline``: the whole text-to-image call (4 Euler steps with trailing timesteps, no CFG,
  the same initial latents), images out (``output_type="np"``).

Each contestant runs once to warm up (JAX compiles; torch.compile compiles), then ``--reps``
times, the three alternating in an order that rotates every repetition; the figures are
medians. ``max_abs_diff`` is maxdiff's output against diffusers' default one,
``tuned_max_abs_diff`` the tuned output against the default one (both for every part; for the
pipeline, the images in [0, 1]).

torch.compile (``--compile``): ``auto`` (default) compiles each part and times its warm-up call;
a part whose warm-up fails, or takes more than ``--compile-timeout`` seconds, runs the tuned
variant eagerly, and the row says why in ``compile`` (``"failed: <Exception>: <first line>"``,
``"skipped: warm-up took 412.3 s > 300 s"``); ``on`` compiles without the time limit (failures
still fall back and are recorded); ``off`` never compiles. ``tuned`` names what the tuned
variant used (e.g. ``"channels_last+inference_mode+compile"``). The pipeline's tuned variant
uses the compiled modules of the parts that compiled (and compiles again for the pipeline's
own calls; that warm-up is the pipeline row's ``compile``).

Threads (``--threads N``, default all cores) are pinned equal for both frameworks before
either is imported: ``torch.set_num_threads(N)``, and for XLA's CPU client ``NPROC=N`` (the
variable XLA reads to size its intra-op Eigen pool) with
``XLA_FLAGS=--xla_cpu_multi_thread_eigen=true``. (``intra_op_parallelism_threads=N`` in
``XLA_FLAGS`` is a TensorFlow session option: XLA accepts it and ignores it.) The header line
prints both settings and the number of XLA Eigen threads the process actually has.

Parts against the whole: the pipeline row has ``parts_sum_s`` (text + steps x unet + vae, per
contestant: ``maxdiff``, ``diffusers_default``, ``diffusers_tuned``, and ``diffusers_best``,
the faster pipeline variant with its own parts) and ``pipeline_minus_parts_s``. The gap is what
a pipeline does between the parts: maxdiff tokenises the prompts on the host, copies the inputs
to the device, runs the scheduler's arithmetic in its denoising loop (a while loop in the
compiled program), scales the images to [0, 1] (uint8 for PIL output) and copies them back to
numpy (``device_get``); diffusers tokenises, runs the scheduler's step between UNet calls and
post-processes the images (to numpy). The parts' own timings also differ from their calls
inside a pipeline (inputs, caches, memory formats), so the gap can be negative.

FLOPs come from XLA's cost analysis of maxdiff's compiled part (the pipeline's are the sum of
its parts: text + steps x unet + vae); GFLOP/s and the percentage of this machine's fp32 matmul
peak (a 2048^3 matmul in JAX, measured in the same run) are maxdiff's. The last line is
``pipeline ratio maxdiff/diffusers-best: X.XX (default Y.YY)`` for the last checkpoint
measured.

``--repeats K`` runs the whole comparison K times, each in a fresh process (this module with
the same arguments and its own ``--json``), then prints, per (config, part), min-median-max of
``ratio``, ``ratio_default`` and each contestant's seconds, and last
``pipeline ratio maxdiff/diffusers-best: min X.XX median Y.YY max Z.ZZ``; ``--json`` then
holds ``{"repeats", "runs", "summary"}``.

Checkpoints (``--configs``): ``tiny`` (the test suite's tiny SDXL), ``medium`` (SDXL's UNet
blocks at half width with transformer depth 1/2/5, SDXL's real VAE, two 2-layer CLIP encoders
of SDXL's widths; 256x256, batch 2), and with ``--full`` the real SDXL UNet and VAE configs at
512x512, batch 1 (about 30 GB of memory, plus the tuned variant's own copy of the UNet and
the VAE, which it keeps in ``channels_last``, and torch.compile's memory; the text encoders are
shared).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
VOCAB = ROOT / "maxdiff" / "assets" / "demo-model"
PROMPTS = ["a photo of an astronaut riding a horse on the moon", "a red circle on a blue background"]
STEPS = 4

SDXL_VAE = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
                layers_per_block=2, latent_channels=4, norm_num_groups=32, sample_size=1024,
                scaling_factor=0.13025, force_upcast=True)


def sdxl_unet(width: float, depth: tuple[int, int, int], latent: int) -> dict:
    ch = [int(c * width) for c in (320, 640, 1280)]
    return dict(sample_size=latent, in_channels=4, out_channels=4, layers_per_block=2,
                block_out_channels=ch, cross_attention_dim=2048,
                down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
                up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
                attention_head_dim=[5, 10, 20], use_linear_projection=True,
                addition_embed_type="text_time", addition_time_embed_dim=256,
                transformer_layers_per_block=list(depth),
                projection_class_embeddings_input_dim=2816, norm_num_groups=32)


def clip(hidden: int, layers: int, heads: int, projection: int | None) -> dict:
    return dict(vocab_size=49408, hidden_size=hidden, intermediate_size=4 * hidden,
                num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=77,
                hidden_act="gelu" if projection else "quick_gelu",
                projection_dim=projection or 768, bos_token_id=49406, eos_token_id=49407,
                pad_token_id=1)


def configs(full: bool) -> dict:
    out = {
        "tiny": dict(size=32, batch=2, tiny=True),
        "medium": dict(size=256, batch=2, unet=sdxl_unet(0.5, (1, 2, 5), 32), vae=SDXL_VAE,
                       te1=clip(768, 2, 12, None), te2=clip(1280, 2, 20, 1280)),
    }
    if full:
        out["full"] = dict(size=512, batch=1, unet=sdxl_unet(1.0, (1, 2, 10), 64), vae=SDXL_VAE,
                           te1=clip(768, 12, 12, None), te2=clip(1280, 32, 20, 1280))
    return out


def write_checkpoint(folder: Path, spec: dict) -> None:
    """A diffusers SDXL folder with random weights (diffusers' own initialisation)."""
    import torch
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    if spec.get("tiny"):
        sys.path.insert(0, str(ROOT / "tests"))
        import tiny

        tiny.make_sdxl_pipeline(folder)
        return
    torch.manual_seed(0)
    toks = []
    for name, pad in (("tokenizer", "<|endoftext|>"), ("tokenizer_2", "!")):
        toks.append(CLIPTokenizer.from_pretrained(VOCAB / name, pad_token=pad))
    pipe = StableDiffusionXLPipeline(
        vae=AutoencoderKL(**spec["vae"]).eval(),
        text_encoder=CLIPTextModel(CLIPTextConfig(**spec["te1"])).eval(),
        text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**spec["te2"])).eval(),
        tokenizer=toks[0], tokenizer_2=toks[1],
        unet=UNet2DConditionModel(**spec["unet"]).eval(),
        scheduler=EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012,
                                         beta_schedule="scaled_linear", steps_offset=1,
                                         timestep_spacing="trailing"))
    pipe.save_pretrained(folder)


def matmul_peak(dtype: str = "float32", reps: int = 5) -> float:
    """JAX GFLOP/s of a 2048^3 matmul in ``dtype`` on this machine (median of ``reps``)."""
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(np.random.default_rng(0).standard_normal((2048, 2048), np.float32), dtype)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * 2048**3 / statistics.median(times) / 1e9


def side_by_side(fns, reps: int, warm: bool = True) -> tuple[list[float], list[list[float]]]:
    """Time N callables alternating: (optionally) one warm-up call each, then ``reps``
    repetitions in which every callable runs once, the order rotating by one each repetition
    (repetition r starts with callable r mod N). Returns (medians, all times), per callable."""
    fns = list(fns)
    if warm:
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for r in range(reps):
        for k in range(len(fns)):
            i = (r + k) % len(fns)
            t = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t)
    return [statistics.median(t) for t in times], times


def flops(fn, *args) -> float:
    """FLOPs of ``fn(*args)`` by XLA's cost analysis, traced with the direct algorithms
    (``MAXDIFF_CONV=xla``, callers pass modules with the ``xla`` attention kernel): cost
    analysis counts a loop's body once, so Winograd's and the chunked attention's loops would
    hide most of the work. These are the FLOPs of the computation, not of the algorithm."""
    old = os.environ.get("MAXDIFF_CONV")
    os.environ["MAXDIFF_CONV"] = "xla"
    try:
        import jax

        cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    finally:
        if old is None:
            os.environ.pop("MAXDIFF_CONV")
        else:
            os.environ["MAXDIFF_CONV"] = old
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


def maxdiff_text(ours):
    """maxdiff's text part, unjitted: ``(p1, p2, ids1, ids2) -> (prompt_embeds, pooled,
    last1)``: what the pipeline's :meth:`maxdiff.family.Family.encode` computes
    (penultimate states of both encoders concatenated, (B, 77, D1 + D2); encoder 2's
    ``text_embeds``, (B, P)) plus encoder 1's ``last_hidden_state``, so that XLA runs CLIP-L's
    last layer as PyTorch does (the pipeline itself does not need it, and XLA drops it there:
    the pipeline row has that advantage, this row does not)."""
    import jax.numpy as jnp

    te1, te2 = ours.text_encoder, ours.text_encoder_2

    def text(p1, p2, ids1, ids2):
        o1 = te1.apply({"params": p1}, ids1)
        o2 = te2.apply({"params": p2}, ids2)
        emb = jnp.concatenate([o1.hidden_states[-2], o2.hidden_states[-2]], axis=-1)
        return emb, o2.text_embeds, o1.last_hidden_state

    return text


def diffusers_text(te1, te2):
    """diffusers' text part: ``(ids1, ids2) -> (prompt_embeds, pooled, last1)`` (torch tensors)
    with the calls ``StableDiffusionXLPipeline.encode_prompt`` makes: each encoder with
    ``output_hidden_states=True``, its ``hidden_states[-2]``, concatenated; encoder 2's
    ``text_embeds``; and encoder 1's ``last_hidden_state`` (as :func:`maxdiff_text`).
    ``te1``/``te2`` may be ``torch.compile``d; the caller sets the grad mode."""
    import torch

    def text(ids1, ids2):
        o1 = te1(ids1, output_hidden_states=True)
        o2 = te2(ids2, output_hidden_states=True)
        return (torch.cat([o1.hidden_states[-2], o2.hidden_states[-2]], dim=-1), o2.text_embeds,
                o1.last_hidden_state)

    return text


def text_ids(ours, prompts) -> tuple[np.ndarray, np.ndarray]:
    """The token ids (B, 77) of both tokenizers, as both pipelines make them."""
    from maxdiff.tokenizers import tokenize

    return tokenize(ours.tokenizer, prompts), tokenize(ours.tokenizer_2, prompts)


def max_abs_diff(a, b) -> float:
    """Largest |a - b| over two outputs (arrays, tensors, or tuples of them); a 4-D pair whose
    shapes differ is compared NHWC against NCHW."""
    if isinstance(a, (tuple, list)):
        return max(max_abs_diff(x, y) for x, y in zip(a, b, strict=True))
    a = np.asarray(a.detach() if hasattr(a, "detach") else a, np.float32)
    b = np.asarray(b.detach() if hasattr(b, "detach") else b, np.float32)
    if a.shape != b.shape and a.ndim == 4:
        a = a.transpose(0, 3, 1, 2)
    return float(np.abs(a - b).max())


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}".rstrip(": ")


class Compiler:
    """``--compile``: warms a part's tuned variant up, compiled if it compiles (within the
    time budget under ``auto``), else eager; says what happened."""

    def __init__(self, mode: str, timeout: float):
        self.mode, self.timeout = mode, timeout

    def warm(self, eager, compiled):
        """(callable to time, status, warm-up output). ``eager``/``compiled``: zero-argument
        callables of the tuned variant; ``compiled`` is None where nothing is compiled."""
        if self.mode == "off" or compiled is None:
            return eager, "off", eager()
        t = time.perf_counter()
        try:
            out = compiled()
        except Exception as e:  # noqa: BLE001 - any compile failure falls back, recorded
            return eager, f"failed: {_first_line(e)}", eager()
        dt = time.perf_counter() - t
        if self.mode == "auto" and dt > self.timeout:
            return eager, f"skipped: warm-up took {dt:.1f} s > {self.timeout:g} s", eager()
        return compiled, f"on: warm-up {dt:.1f} s", out


def load_diffusers(folder: Path):
    """diffusers' SDXL pipeline from ``folder``, trailing timesteps, no progress bar."""
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(folder).to("cpu")
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config,
                                                      timestep_spacing="trailing")
    return pipe


def tuned_pipeline(default):
    """A second diffusers pipeline sharing ``default``'s text encoders and tokenizers, with
    its own UNet and VAE in ``channels_last`` and its own scheduler."""
    import copy

    import torch
    from diffusers import StableDiffusionXLPipeline

    cl = torch.channels_last
    comps = dict(default.components)
    comps["unet"] = copy.deepcopy(default.unet).to(memory_format=cl)
    comps["vae"] = copy.deepcopy(default.vae).to(memory_format=cl)
    comps["scheduler"] = type(default.scheduler).from_config(default.scheduler.config)
    pipe = StableDiffusionXLPipeline(**comps)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def measure(name: str, spec: dict, folder: Path, reps: int, peak: float,
            compiler: Compiler | None = None) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import torch

    from pipelines import TextToImagePipeline

    compiler = compiler or Compiler("off", 0)
    if compiler.mode != "off":
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True  # weights as constants: prepacked for the CPU
    size, batch = spec["size"], spec["batch"]
    prompts = (PROMPTS * batch)[:batch]
    ours = TextToImagePipeline.from_pretrained(folder, compile_cache_dir=None,
                                               scheduler={"_class_name": "EulerDiscreteScheduler",
                                                          **_sched(folder)})
    theirs = load_diffusers(folder)
    tuned = tuned_pipeline(theirs)
    cl = torch.channels_last
    eager = {"text_encoder": tuned.text_encoder, "text_encoder_2": tuned.text_encoder_2,
             "unet": tuned.unet}
    comp = {}
    if compiler.mode != "off":
        comp = {k: torch.compile(m) for k, m in eager.items()}
        comp["decode"] = torch.compile(tuned.vae.decode)
    f = ours.vae_scale_factor
    lh = size // f
    rng = np.random.default_rng(0)
    lat = rng.standard_normal((batch, 4, lh, lh)).astype(np.float32)
    rows, secs = [], {}

    def no_grad(fn):
        def call():
            with torch.no_grad():
                return fn()
        return call

    def inference(fn):
        if fn is None:
            return None

        def call():
            with torch.inference_mode():
                return fn()
        return call

    def run(part, ours_fn, default_fn, tuned_eager, tuned_compiled, cl_used=True):
        """Warm up the three contestants, time them alternating; (medians, row fields)."""
        out_ours = ours_fn()
        out_default = default_fn()
        tuned_fn, status, out_tuned = compiler.warm(tuned_eager, tuned_compiled)
        (t_ours, t_def, t_tuned), _ = side_by_side([ours_fn, default_fn, tuned_fn], reps,
                                                     warm=False)
        compiled = status.startswith("on")
        what = ("channels_last+" if cl_used else "") + "inference_mode"
        fields = {"tuned": what + ("+compile" if compiled else ""), "compile": status,
                  "max_abs_diff": max_abs_diff(out_ours, out_default),
                  "tuned_max_abs_diff": max_abs_diff(out_tuned, out_default)}
        secs[part] = {"maxdiff": t_ours, "diffusers_default": t_def, "diffusers_tuned": t_tuned}
        return (t_ours, t_def, t_tuned), fields, compiled

    def report(part, times, fl, extra):
        t_ours, t_def, t_tuned = times
        best = min(t_def, t_tuned)
        row = dict(config=name, part=part, maxdiff_s=round(t_ours, 4),
                   diffusers_default_s=round(t_def, 4), diffusers_tuned_s=round(t_tuned, 4),
                   diffusers_best_s=round(best, 4),
                   diffusers_best="default" if t_def <= t_tuned else "tuned",
                   ratio=round(best / t_ours, 3), ratio_default=round(t_def / t_ours, 3),
                   gflops=round(fl / 1e9, 1), gflops_per_s=round(fl / t_ours / 1e9, 1),
                   pct_peak=round(100 * fl / t_ours / 1e9 / peak, 1), **extra)
        rows.append(row)
        print(json.dumps(row), flush=True)

    p = ours.params
    # text encoders: the same two outputs on every side (see maxdiff_text / diffusers_text)
    ids1, ids2 = text_ids(ours, prompts)
    text_fn = maxdiff_text(ours)
    text = jax.jit(text_fn)
    args = (p["text_encoder"], p["text_encoder_2"], jnp.asarray(ids1), jnp.asarray(ids2))
    t_ids1, t_ids2 = torch.from_numpy(ids1).long(), torch.from_numpy(ids2).long()
    d_text = diffusers_text(theirs.text_encoder, theirs.text_encoder_2)
    e_text = diffusers_text(tuned.text_encoder, tuned.text_encoder_2)
    c_text = diffusers_text(comp["text_encoder"], comp["text_encoder_2"]) if comp else None
    times, extra, text_compiled = run(
        "text", lambda: jax.block_until_ready(text(*args)),
        no_grad(lambda: d_text(t_ids1, t_ids2)), inference(lambda: e_text(t_ids1, t_ids2)),
        inference((lambda: c_text(t_ids1, t_ids2)) if comp else None), cl_used=False)
    fl_text = flops(text_fn, *args)
    report("text", times, fl_text, extra)

    # one UNet step, called as the pipelines call it
    emb_dim = ours.unet.config.cross_attention_dim
    x = jnp.asarray(lat.transpose(0, 2, 3, 1))
    ctx = jnp.asarray(rng.standard_normal((batch, 77, emb_dim)).astype(np.float32))
    pooled_dim = ours.text_encoder_2.config.projection_dim
    pooled = jnp.asarray(rng.standard_normal((batch, pooled_dim)).astype(np.float32))
    tid = jnp.asarray(np.tile([size, size, 0, 0, size, size], (batch, 1)).astype(np.float32))
    t = jnp.float32(999.0)
    unet = ours.unet
    step = jax.jit(lambda pu, x, t, c, pl, ti: unet.apply({"params": pu}, x, t, c, pl, ti))
    uargs = (p["unet"], x, t, ctx, pooled, tid)
    tx = torch.from_numpy(lat)
    tx_cl = tx.contiguous(memory_format=cl)
    tt = torch.tensor(999.0)
    tctx = torch.from_numpy(np.array(ctx))  # np.array: a writable copy
    cond = {"text_embeds": torch.from_numpy(np.array(pooled)),
            "time_ids": torch.from_numpy(np.array(tid))}

    def unet_call(u, xin):
        return lambda: u(xin, tt, encoder_hidden_states=tctx, timestep_cond=None,
                         cross_attention_kwargs=None, added_cond_kwargs=cond,
                         return_dict=False)[0]

    times, extra, unet_compiled = run(
        "unet", lambda: jax.block_until_ready(step(*uargs)), no_grad(unet_call(theirs.unet, tx)),
        inference(unet_call(tuned.unet, tx_cl)),
        inference(unet_call(comp["unet"], tx_cl) if comp else None))
    unet_x = unet.clone(attention_kernel="xla")
    fl_unet = flops(lambda pu, x, t, c, pl, ti: unet_x.apply({"params": pu}, x, t, c, pl, ti),
                    *uargs)
    report("unet", times, fl_unet, extra)

    # VAE decode
    vae = ours.vae
    dec = jax.jit(lambda pv, z: vae.apply({"params": pv}, z, method="decode"))
    vargs = (p["vae"], x)

    def decode_call(d, z):
        return lambda: d(z, return_dict=False)[0]

    times, extra, vae_compiled = run(
        "vae", lambda: jax.block_until_ready(dec(*vargs)),
        no_grad(decode_call(theirs.vae.decode, tx)),
        inference(decode_call(tuned.vae.decode, tx_cl)),
        inference(decode_call(comp["decode"], tx_cl) if comp else None))
    vae_x = vae.clone(attention_kernel="xla")
    fl_vae = flops(lambda pv, z: vae_x.apply({"params": pv}, z, method="decode"), *vargs)
    report("vae", times, fl_vae, extra)

    # whole pipeline; the tuned one uses the compiled modules of the parts that compiled
    kw = dict(prompt=prompts, num_inference_steps=STEPS, guidance_scale=0.0, height=size,
              width=size, output_type="np")
    swaps = {}
    if text_compiled:
        swaps.update(text_encoder=comp["text_encoder"], text_encoder_2=comp["text_encoder_2"])
    if unet_compiled:
        swaps["unet"] = comp["unet"]

    state = [False]  # whether the tuned pipeline holds the compiled modules now

    def tuned_pipe(compiled: bool):
        def call():
            if state[0] != compiled:  # swap modules only when switching
                for k, module in swaps.items():
                    setattr(tuned, k, module if compiled else eager[k])
                if compiled and vae_compiled:
                    tuned.vae.decode = comp["decode"]
                else:
                    tuned.vae.__dict__.pop("decode", None)
                state[0] = compiled
            return tuned(**kw, latents=tx_cl).images
        return call

    times, extra, _ = run("pipeline", lambda: ours(**kw, latents=lat).images,
                          no_grad(lambda: theirs(**kw, latents=tx).images),
                          inference(tuned_pipe(False)),
                          inference(tuned_pipe(True) if swaps or vae_compiled else None))
    compiled_pipe = swaps or vae_compiled
    if compiled_pipe:
        names = [k for k in ("text_encoder", "unet") if k in swaps] + \
                (["vae.decode"] if vae_compiled else [])
        extra["compile"] += f" ({', '.join(names)})"
    elif compiler.mode != "off":
        extra["compile"] = "not tried: no part compiled"
    sums = {k: secs["text"][k] + STEPS * secs["unet"][k] + secs["vae"][k]
            for k in ("maxdiff", "diffusers_default", "diffusers_tuned")}
    whole = secs["pipeline"]
    best = "diffusers_default" if whole["diffusers_default"] <= whole["diffusers_tuned"] \
        else "diffusers_tuned"
    sums["diffusers_best"], whole = sums[best], {**whole, "diffusers_best": whole[best]}
    extra.update(images_per_s=round(batch / times[0], 3),
                 parts_sum_s={k: round(v, 4) for k, v in sums.items()},
                 pipeline_minus_parts_s={k: round(whole[k] - sums[k], 4) for k in sums})
    report("pipeline", times, fl_text + STEPS * fl_unet + fl_vae, extra)
    return rows


def _sched(folder: Path) -> dict:
    cfg = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    cfg["timestep_spacing"] = "trailing"
    cfg.pop("_class_name", None)
    return cfg


def pin_threads(n: int) -> dict:
    """Set XLA's CPU thread pool to ``n`` threads; must run before jax is imported (returns
    the settings, with a note where jax was imported already and they cannot apply)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_cpu_multi_thread_eigen")]
    os.environ["XLA_FLAGS"] = " ".join(flags + ["--xla_cpu_multi_thread_eigen=true"])
    os.environ["NPROC"] = str(n)
    out = {"NPROC": os.environ["NPROC"], "XLA_FLAGS": os.environ["XLA_FLAGS"]}
    if "jax" in sys.modules:
        out["note"] = "jax was imported before main(): these did not apply"
    return out


def xla_eigen_threads() -> int | None:
    """How many threads of XLA's intra-op Eigen pool this process has (Linux; else None)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    n = 0
    for t in tasks.iterdir():
        try:
            n += "XLAEigen" in (t / "comm").read_text()
        except OSError:
            pass
    return n


SUMMARY_FIELDS = ("ratio", "ratio_default", "maxdiff_s", "diffusers_default_s",
                  "diffusers_tuned_s", "diffusers_best_s")


def summarise(runs: list[list[dict]]) -> list[dict]:
    """Per (config, part), in the order first seen: ``runs`` (how many runs had it), and for
    each of :data:`SUMMARY_FIELDS` ``{"min", "median", "max"}`` over the runs; ``compile``:
    each run's compile status."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for rows in runs:
        for r in rows:
            groups.setdefault((r["config"], r["part"]), []).append(r)
    out = []
    for (config, part), rs in groups.items():
        s = {"config": config, "part": part, "runs": len(rs)}
        for k in SUMMARY_FIELDS:
            v = [r[k] for r in rs if k in r]
            if v:
                s[k] = {"min": min(v), "median": round(statistics.median(v), 4), "max": max(v)}
        s["compile"] = [r.get("compile") for r in rs]
        out.append(s)
    return out


def _mmm(d: dict, fmt: str = ".2f") -> str:
    return f"{d['min']:{fmt}}-{d['median']:{fmt}}-{d['max']:{fmt}}"


def print_summary(summary: list[dict]) -> None:
    print()
    print("min-median-max over the repeats:")
    for s in summary:
        print(f"{s['config']:<7} {s['part']:<9} ratio {_mmm(s['ratio'])} (default "
              f"{_mmm(s['ratio_default'])})  maxdiff {_mmm(s['maxdiff_s'], '.3f')} s  "
              f"diffusers default {_mmm(s['diffusers_default_s'], '.3f')} s  tuned "
              f"{_mmm(s['diffusers_tuned_s'], '.3f')} s  best "
              f"{_mmm(s['diffusers_best_s'], '.3f')} s")
    r = [s for s in summary if s["part"] == "pipeline"][-1]["ratio"]
    print(f"pipeline ratio maxdiff/diffusers-best: min {r['min']:.2f} median {r['median']:.2f} "
          f"max {r['max']:.2f}")


def child_argv(a, names: list[str], out: Path) -> list[str]:
    """This module's arguments for one fresh run of ``--repeats``."""
    argv = ["--configs", *names, "--reps", str(a.reps), "--threads", str(a.threads),
            "--compile", a.compile, "--compile-timeout", str(a.compile_timeout),
            "--json", str(out)]
    return argv + (["--full"] if a.full else [])


def repeat(a, names: list[str]) -> None:
    """``--repeats``: the comparison in ``a.repeats`` fresh processes, then the summary."""
    import subprocess

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    runs = []
    with tempfile.TemporaryDirectory(prefix="maxdiff-compare-") as tmp:
        for i in range(a.repeats):
            out = Path(tmp) / f"run{i}.json"
            print(f"# run {i + 1}/{a.repeats} (fresh process)", flush=True)
            cmd = [sys.executable, "-m", "benchmarks.compare", *child_argv(a, names, out)]
            proc = subprocess.run(cmd, cwd=ROOT, env=env, check=False)
            if proc.returncode:
                raise SystemExit(f"run {i + 1} failed (exit {proc.returncode}): {' '.join(cmd)}")
            runs.append(json.loads(out.read_text()))
    summary = summarise(runs)
    if a.json:
        Path(a.json).write_text(json.dumps({"repeats": a.repeats, "runs": runs,
                                            "summary": summary}, indent=1))
    print_summary(summary)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Rows: maxdiff_s, diffusers_default_s, diffusers_tuned_s, diffusers_best_s, "
               "ratio (best diffusers / maxdiff), ratio_default, tuned, compile, max_abs_diff, "
               "tuned_max_abs_diff; the pipeline row adds parts_sum_s and "
               "pipeline_minus_parts_s. See the module docstring.")
    ap.add_argument("--configs", nargs="+", default=["tiny", "medium"],
                    help="checkpoints to measure: tiny, medium, full (needs --full)")
    ap.add_argument("--quick", action="store_true", help="the medium checkpoint only")
    ap.add_argument("--full", action="store_true", help="allow the full SDXL config (512x512)")
    ap.add_argument("--reps", type=int, default=5,
                    help="timed runs per contestant (default 5), alternating in rotating order")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="threads for both frameworks: torch.set_num_threads and XLA's CPU pool "
                         "(NPROC); default: all cores")
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                    help="torch.compile for diffusers' tuned variant: auto (default) = try it, "
                         "eager if it fails or its warm-up exceeds --compile-timeout; on = try "
                         "it without a time limit (eager if it fails); off = never. The row's "
                         "'compile' says what happened")
    ap.add_argument("--compile-timeout", type=float, default=300.0, metavar="S",
                    help="--compile auto: the most seconds a part's compiling warm-up call may "
                         "take for the compiled variant to be used (default 300)")
    ap.add_argument("--repeats", type=int, default=1, metavar="K",
                    help="run the whole comparison K times, each in a fresh process, and "
                         "summarise min-median-max per (config, part) (default 1: this process)")
    ap.add_argument("--json", help="also write every row (with --repeats: the runs and the "
                                   "summary) to this file")
    a = ap.parse_args(argv)
    names = ["medium"] if a.quick else a.configs
    specs = configs(a.full or "full" in names)
    unknown = [n for n in names if n not in specs]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; use tiny, medium, or full with --full")
    if a.repeats < 1 or a.reps < 1 or a.threads < 1:
        ap.error("--repeats, --reps and --threads must be >= 1")
    if a.repeats > 1:
        repeat(a, names)
        return
    xla_env = pin_threads(a.threads)  # before jax is imported
    import torch

    torch.set_num_threads(a.threads)
    peak = matmul_peak()
    import diffusers
    import jax

    print(json.dumps({"matmul_peak_gflops": round(peak, 1), "threads": a.threads,
                      "torch_threads": torch.get_num_threads(),
                      "torch_interop_threads": torch.get_num_interop_threads(),
                      "xla_threads_env": xla_env, "xla_eigen_threads": xla_eigen_threads(),
                      "reps": a.reps, "compile": a.compile,
                      "compile_timeout_s": a.compile_timeout,
                      "MAXDIFF_CONV": os.environ.get("MAXDIFF_CONV", "auto"),
                      "versions": {"jax": jax.__version__, "torch": torch.__version__,
                                   "diffusers": diffusers.__version__}}), flush=True)
    compiler = Compiler(a.compile, a.compile_timeout)
    rows = []
    for name in names:
        folder = Path(tempfile.mkdtemp(prefix=f"maxdiff-bench-{name}-"))
        try:
            write_checkpoint(folder, specs[name])
            rows += measure(name, specs[name], folder, a.reps, peak, compiler)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print()
    for r in rows:
        print(f"{r['config']:<7} {r['part']:<9} maxdiff {r['maxdiff_s']:8.3f} s  diffusers "
              f"default {r['diffusers_default_s']:8.3f} s tuned {r['diffusers_tuned_s']:8.3f} s"
              f"  ratio {r['ratio']:5.2f} (default {r['ratio_default']:5.2f})  "
              f"{r['gflops_per_s']:6.1f} GFLOP/s ({r['pct_peak']:.0f} % of peak)  "
              f"compile: {r['compile']}")
    last = [r for r in rows if r["part"] == "pipeline"][-1]
    print(f"pipeline ratio maxdiff/diffusers-best: {last['ratio']:.2f} "
          f"(default {last['ratio_default']:.2f})")


if __name__ == "__main__":
    main()
