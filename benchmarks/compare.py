"""maxdiff against diffusers (PyTorch) on the same weights, side by side in one process.

    python -m benchmarks.compare --quick          # the medium checkpoint (under 10 minutes here)
    python -m benchmarks.compare --configs tiny medium [--reps 7] [--full]

For each checkpoint it writes random weights with diffusers (``save_pretrained``), loads them
into both, and times, fp32, with the same thread count:

- ``text``: both CLIP text encoders on the batch's prompts;
- ``unet``: one UNet forward at the checkpoint's latent size (one denoising step, no CFG);
- ``vae``: one VAE decode of the batch's latents;
- ``pipeline``: the whole text-to-image call (4 Euler steps with trailing timesteps, no CFG,
  the same initial latents), images out.

Each part runs once to warm up (JAX compiles), then ``--reps`` times per side, the two sides
alternating (maxdiff first on even repetitions, diffusers first on odd ones); the figures are
medians. FLOPs come from XLA's cost analysis of maxdiff's compiled part (the pipeline's are the
sum of its parts: text + steps x unet + vae); GFLOP/s and the percentage of this machine's fp32
matmul peak (a 2048^3 matmul in JAX, measured in the same run) are maxdiff's. ``ratio`` is
diffusers' time / maxdiff's time: above 1, maxdiff is faster. The last line is
``pipeline ratio maxdiff/diffusers: X.XX`` for the last checkpoint measured.

Checkpoints (``--configs``): ``tiny`` (the test suite's tiny SDXL), ``medium`` (SDXL's UNet
blocks at half width with transformer depth 1/2/5, SDXL's real VAE, two 2-layer CLIP encoders
of SDXL's widths; 256x256, batch 2), and with ``--full`` the real SDXL UNet and VAE configs at
512x512, batch 1 (about 30 GB of memory in all).
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
    from diffusers import (AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline,
                           UNet2DConditionModel)
    from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection,
                              CLIPTokenizer)

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


def matmul_peak() -> float:
    """JAX fp32 GFLOP/s of a 2048^3 matmul on this machine (median of 5)."""
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(np.random.default_rng(0).standard_normal((2048, 2048), np.float32))
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * 2048**3 / statistics.median(times) / 1e9


def side_by_side(ours, theirs, reps: int) -> tuple[float, float, list, list]:
    """Warm both up, then alternate; returns (median ours, median theirs, all times)."""
    ours()
    theirs()
    a, b = [], []
    for r in range(reps):
        order = [(ours, a), (theirs, b)] if r % 2 == 0 else [(theirs, b), (ours, a)]
        for fn, into in order:
            t = time.perf_counter()
            fn()
            into.append(time.perf_counter() - t)
    return statistics.median(a), statistics.median(b), a, b


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


def measure(name: str, spec: dict, folder: Path, reps: int, peak: float) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import torch
    from diffusers import StableDiffusionXLPipeline

    from maxdiff.tokenizers import tokenize
    from pipelines import TextToImagePipeline

    size, batch = spec["size"], spec["batch"]
    prompts = (PROMPTS * batch)[:batch]
    ours = TextToImagePipeline.from_pretrained(folder, compile_cache_dir=None,
                                               scheduler={"_class_name": "EulerDiscreteScheduler",
                                                          **_sched(folder)})
    theirs = StableDiffusionXLPipeline.from_pretrained(folder).to("cpu")
    theirs.set_progress_bar_config(disable=True)
    theirs.scheduler = type(theirs.scheduler).from_config(theirs.scheduler.config,
                                                          timestep_spacing="trailing")
    f = ours.vae_scale_factor
    lh = size // f
    rng = np.random.default_rng(0)
    lat = rng.standard_normal((batch, 4, lh, lh)).astype(np.float32)
    rows = []

    def report(part, t_ours, t_theirs, fl, extra=None):
        row = dict(config=name, part=part, maxdiff_s=round(t_ours, 4),
                   diffusers_s=round(t_theirs, 4), ratio=round(t_theirs / t_ours, 3),
                   gflops=round(fl / 1e9, 1), gflops_per_s=round(fl / t_ours / 1e9, 1),
                   pct_peak=round(100 * fl / t_ours / 1e9 / peak, 1), **(extra or {}))
        rows.append(row)
        print(json.dumps(row), flush=True)

    p = ours.params
    # text encoders
    ids1 = jnp.asarray(tokenize(ours.tokenizer, prompts))
    ids2 = jnp.asarray(tokenize(ours.tokenizer_2, prompts))
    te1, te2 = ours.text_encoder, ours.text_encoder_2
    text = jax.jit(lambda p1, p2, a, b: (te1.apply({"params": p1}, a).hidden_states[-2],
                                         te2.apply({"params": p2}, b).text_embeds))
    t_ids1 = torch.from_numpy(np.array(ids1)).long()
    t_ids2 = torch.from_numpy(np.array(ids2)).long()

    def text_theirs():
        with torch.no_grad():
            theirs.text_encoder(t_ids1, output_hidden_states=True)
            theirs.text_encoder_2(t_ids2, output_hidden_states=True)

    args = (p["text_encoder"], p["text_encoder_2"], ids1, ids2)
    a, b, *_ = side_by_side(lambda: jax.block_until_ready(text(*args)), text_theirs, reps)
    fl_text = flops(lambda p1, p2, a, b: (te1.apply({"params": p1}, a).hidden_states[-2],
                                          te2.apply({"params": p2}, b).text_embeds), *args)
    report("text", a, b, fl_text)

    # one UNet step
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
    tctx = torch.from_numpy(np.asarray(ctx))
    cond = {"text_embeds": torch.from_numpy(np.asarray(pooled)),
            "time_ids": torch.from_numpy(np.asarray(tid))}

    def unet_theirs():
        with torch.no_grad():
            theirs.unet(tx, 999, encoder_hidden_states=tctx, added_cond_kwargs=cond)

    a, b, *_ = side_by_side(lambda: jax.block_until_ready(step(*uargs)), unet_theirs, reps)
    unet_x = unet.clone(attention_kernel="xla")
    fl_unet = flops(lambda pu, x, t, c, pl, ti: unet_x.apply({"params": pu}, x, t, c, pl, ti),
                    *uargs)
    report("unet", a, b, fl_unet)

    # VAE decode
    vae = ours.vae
    dec = jax.jit(lambda pv, z: vae.apply({"params": pv}, z, method="decode"))
    vargs = (p["vae"], x)

    def vae_theirs():
        with torch.no_grad():
            theirs.vae.decode(tx)

    a, b, *_ = side_by_side(lambda: jax.block_until_ready(dec(*vargs)), vae_theirs, reps)
    vae_x = vae.clone(attention_kernel="xla")
    fl_vae = flops(lambda pv, z: vae_x.apply({"params": pv}, z, method="decode"), *vargs)
    report("vae", a, b, fl_vae)

    # whole pipeline
    kw = dict(prompt=prompts, num_inference_steps=STEPS, guidance_scale=0.0, height=size,
              width=size, output_type="np")
    tlat = torch.from_numpy(lat)

    def pipe_theirs():
        with torch.no_grad():
            return theirs(**kw, latents=tlat).images

    a, b, *_ = side_by_side(lambda: ours(**kw, latents=lat), pipe_theirs, reps)
    diff = float(np.abs(ours(**kw, latents=lat).images - pipe_theirs()).max())
    report("pipeline", a, b, fl_text + STEPS * fl_unet + fl_vae,
           {"images_per_s": round(batch / a, 3), "max_abs_diff": diff})
    return rows


def _sched(folder: Path) -> dict:
    cfg = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    cfg["timestep_spacing"] = "trailing"
    cfg.pop("_class_name", None)
    return cfg


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["tiny", "medium"],
                    help="checkpoints to measure: tiny, medium, full (needs --full)")
    ap.add_argument("--quick", action="store_true", help="the medium checkpoint only")
    ap.add_argument("--full", action="store_true", help="allow the full SDXL config (512x512)")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per side (default 5)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch threads (JAX uses every core; default: all cores)")
    ap.add_argument("--json", help="also write every row to this file")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    names = ["medium"] if a.quick else a.configs
    specs = configs(a.full or "full" in names)
    unknown = [n for n in names if n not in specs]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; use tiny, medium, or full with --full")
    peak = matmul_peak()
    print(json.dumps({"matmul_peak_gflops": round(peak, 1), "threads": a.threads,
                      "reps": a.reps, "MAXDIFF_CONV": os.environ.get("MAXDIFF_CONV", "auto")}),
          flush=True)
    rows = []
    for name in names:
        folder = Path(tempfile.mkdtemp(prefix=f"maxdiff-bench-{name}-"))
        try:
            write_checkpoint(folder, specs[name])
            rows += measure(name, specs[name], folder, a.reps, peak)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print()
    for r in rows:
        print(f"{r['config']:<7} {r['part']:<9} maxdiff {r['maxdiff_s']:8.3f} s  diffusers "
              f"{r['diffusers_s']:8.3f} s  ratio {r['ratio']:5.2f}  {r['gflops_per_s']:6.1f} "
              f"GFLOP/s ({r['pct_peak']:.0f} % of peak)")
    last = [r for r in rows if r["part"] == "pipeline"][-1]
    print(f"pipeline ratio maxdiff/diffusers: {last['ratio']:.2f}")


if __name__ == "__main__":
    main()
