"""int8 / fp8 through qwix (issue #29): image quality against float32, memory, CPU speed.

    python -m benchmarks.quantization --part quality --json quality.json   # medium + demo model
    python -m benchmarks.quantization --part memory --json memory.json     # fresh process per mode
    python -m benchmarks.quantization --part speed --json speed.json       # needs an idle machine
    python -m benchmarks.quantization --config tiny --n 4 --demo-n 8 --reps 1 \\
        --part quality memory speed                                          # smoke run

The checkpoint is :mod:`benchmarks.compare`'s ``medium`` one (SDXL's UNet blocks at half width,
transformer depth 1/2/5, SDXL's real VAE config, two 2-layer CLIP encoders; diffusers'
initialisation from ``torch.manual_seed(0)``, written by :func:`benchmarks.compare.write_checkpoint`),
at its size: 256x256, device batches of 2, 4 Euler steps with trailing timesteps, no CFG
(guidance 0), float32 pipelines. ``--checkpoint DIR`` keeps it there (and reuses it next time).

Quality (``--part quality``), every mode in one run on the same weights:

- **medium**: ``--n`` (default 32) images, prompt ``i % 8`` of :data:`PROMPTS` and seed
  ``1000 + i``, made by the float32 pipeline and by one pipeline per quantization (int8-weights,
  int8, fp8), in the same device batches (so int8 / fp8 images come from the same compiled
  batch shape as float32's: with int8 or fp8 activations the pixels depend on the program).
  Per image: PSNR = 10 log10(1 / MSE) of the [0, 1] pixels (``output_type="np"``) against
  float32's; reported: mean, median, worst, best, the largest absolute difference.
- **demo**: the embedded demo model's held-out fidelity (:mod:`pipelines.demo_eval`: the ``test``
  split, 252 images, its analyser and Wilson intervals) with the shipped sampler and settings
  (the folder's DPM++ 2M, 20 steps, guidance 4, from its ``maxdiff.json``), for float32,
  int8-weights and int8 (``--demo-modes``; fp8 optional), the same prompts and noise seeds; and
  each image's PSNR against float32's.

Acceptance thresholds (fixed and committed before the first measurement, 2026-12-04; 40 dB is
an RMS error of about 2.5 / 255, which people do not see; the tests' tiny-checkpoint floors are
30 / 30 / 25 dB):

==============  ===============  ================  ==========================================
mode            medium: mean     medium: worst     demo ``all`` (test split) below float32's
==============  ===============  ================  ==========================================
int8-weights    >= 40 dB         >= 35 dB          at most 2.0 points
int8            >= 35 dB         >= 30 dB          at most 2.0 points
fp8             >= 30 dB         >= 25 dB          at most 5.0 points (when measured)
==============  ===============  ================  ==========================================

(one demo image is 0.4 points of 252). The JSON holds each verdict; the exit status is 1 when
any threshold is missed. A perceptual metric (LPIPS and the like) is not computed: the
maintained ones need torch with its CUDA wheels or downloaded network weights.

Memory (``--part memory``): for each setup (``--memory-setups``; default fp32, bf16,
int8-weights, int8, bf16+int8), a fresh Python process loads the medium checkpoint with that
dtype and quantization and reports the loaded UNet's bytes (the sum of its arrays' ``nbytes``:
int8 / float8 values and their float32 scales included), all parameters' bytes, and the
process's peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) after the imports, after
loading, and after one 256x256 image (batch 1: the compiled program and its buffers), with the
current RSS after loading (``/proc/self/statm``): the weights are quantized after the float
UNet is loaded, so the peak while loading still holds it.

Speed (``--part speed``): the four pipelines (float32, int8-weights, int8, fp8) loaded together;
one UNet forward at batch ``--batch`` and the whole pipeline call, each timed alternating
(:func:`benchmarks.compare.side_by_side`: a warm-up call each, then ``--reps`` (>= 5)
repetitions in rotating order), medians; ``speedup`` is float32's median / the mode's. Timings
mean something on an idle machine only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import compare

ROOT = compare.ROOT
STEPS = 4  # compare.STEPS: Euler, trailing timesteps, no CFG
QUALITY_MODES = ("int8-weights", "int8", "fp8")
DEMO_MODES = ("int8-weights", "int8")
SPEED_MODES = ("none", "int8-weights", "int8", "fp8")
# setup -> (pipeline dtype, quantization)
MEMORY_SETUPS = {"fp32": ("float32", "none"), "bf16": ("bfloat16", "none"),
                 "int8-weights": ("float32", "int8-weights"), "int8": ("float32", "int8"),
                 "fp8": ("float32", "fp8"), "bf16+int8-weights": ("bfloat16", "int8-weights"),
                 "bf16+int8": ("bfloat16", "int8")}
DEFAULT_MEMORY = ("fp32", "bf16", "int8-weights", "int8", "bf16+int8")
PROMPTS = [
    "a photo of an astronaut riding a horse on the moon",
    "a red circle on a blue background",
    "a watercolor painting of a lighthouse at dawn",
    "a close-up of a cat's face, studio lighting",
    "a city street at night in the rain, neon signs",
    "a bowl of fruit on a wooden table",
    "an isometric drawing of a small house with a garden",
    "a mountain lake reflecting snowy peaks",
]

# Fixed before the first measurement (see the module docstring); mode -> bound
THRESHOLDS = {
    "medium_mean_psnr_db": {"int8-weights": 40.0, "int8": 35.0, "fp8": 30.0},
    "medium_worst_psnr_db": {"int8-weights": 35.0, "int8": 30.0, "fp8": 25.0},
    "demo_all_drop_points": {"int8-weights": 2.0, "int8": 2.0, "fp8": 5.0},
}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of [0, 1] images ``a`` against ``b`` (inf when equal)."""
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def psnr_summary(images: np.ndarray, reference: np.ndarray) -> dict:
    """Per-image PSNR of ``images`` (N, H, W, C) against ``reference``, and its summary."""
    per = [psnr(a, b) for a, b in zip(images, reference, strict=True)]
    finite = [p for p in per if np.isfinite(p)]
    return {"n": len(per), "mean_db": float(np.mean(per)), "median_db": float(np.median(per)),
            "worst_db": min(per), "best_db": max(per), "equal_images": len(per) - len(finite),
            "max_abs_diff": float(np.abs(np.asarray(images, np.float32) - reference).max()),
            "per_image_db": [round(p, 2) for p in per]}


def verdicts(medium: dict | None, demo: dict | None) -> dict:
    """Each threshold of :data:`THRESHOLDS` against the measured figures: ``{name: {mode:
    {"value", "bound", "pass"}}}``; a mode not measured has no entry."""
    out: dict = {}
    for mode, r in (medium or {}).items():
        for key, field, bound in (("medium_mean_psnr_db", "mean_db", THRESHOLDS),
                                  ("medium_worst_psnr_db", "worst_db", THRESHOLDS)):
            b = bound[key][mode]
            out.setdefault(key, {})[mode] = {"value": round(r[field], 2), "bound": b,
                                             "pass": bool(r[field] >= b)}
    if demo:
        base = demo["float32"]["all"]
        for mode, r in demo.items():
            if mode == "float32":
                continue
            drop = round(100 * (base - r["all"]), 2)
            b = THRESHOLDS["demo_all_drop_points"][mode]
            out.setdefault("demo_all_drop_points", {})[mode] = {"value": drop, "bound": b,
                                                                "pass": bool(drop <= b)}
    return out


def all_pass(v: dict) -> bool:
    return all(m["pass"] for per in v.values() for m in per.values())


# ------------------------------------------------------------------------------ the checkpoint
def checkpoint(config: str, folder: str | None) -> tuple[Path, dict, bool]:
    """(the folder of ``config``'s checkpoint, its spec, whether to remove it afterwards):
    ``folder`` reused when it holds one, else written there (or in a temporary folder)."""
    spec = compare.configs(False)[config]
    path = Path(folder) if folder else Path(tempfile.mkdtemp(prefix=f"maxdiff-quant-{config}-"))
    if not (path / "model_index.json").is_file():
        t = time.perf_counter()
        compare.write_checkpoint(path, spec)
        print(f"# wrote the {config} checkpoint to {path} in {time.perf_counter() - t:.0f} s",
              flush=True)
    return path, spec, folder is None


def load(path, quantization: str = "none", dtype: str = "float32"):
    from pipelines import TextToImagePipeline

    return TextToImagePipeline.from_pretrained(path, dtype=dtype, quantization=quantization,
                                               compile_cache_dir=None)


def images(pipe, n: int, size: int, batch: int) -> np.ndarray:
    """(n, size, size, 3) float images in [0, 1]: prompt ``i % 8``, seed ``1000 + i``, device
    batches of ``batch``."""
    from pipelines.requests import ImageRequest

    items = [ImageRequest(PROMPTS[i % len(PROMPTS)], seed=1000 + i, guidance_scale=0.0)
             for i in range(n)]
    out = [pipe.generate(items[i:i + batch], height=size, width=size, num_inference_steps=STEPS,
                         output_type="np").images for i in range(0, n, batch)]
    return np.concatenate(out)


# ------------------------------------------------------------------------------ quality
def quality_medium(path: Path, spec: dict, n: int, modes) -> dict:
    t = time.perf_counter()
    ref = images(load(path), n, spec["size"], spec["batch"])
    print(f"# float32: {n} images in {time.perf_counter() - t:.0f} s", flush=True)
    out = {}
    for mode in modes:
        t = time.perf_counter()
        got = images(load(path, mode), n, spec["size"], spec["batch"])
        out[mode] = psnr_summary(got, ref)
        out[mode]["seconds"] = round(time.perf_counter() - t, 1)
        s = out[mode]
        print(f"# medium {mode}: PSNR mean {s['mean_db']:.2f} dB, median {s['median_db']:.2f}, "
              f"worst {s['worst_db']:.2f}, max abs {s['max_abs_diff']:.4f} ({s['seconds']} s)",
              flush=True)
    return out


def quality_demo(modes, n: int | None) -> dict:
    """The demo model's test-split scores per mode (float32 first) and PSNR against float32."""
    from pipelines import demo_eval
    from pipelines.config import ModelDefaults
    from pipelines.default_model import default_model_path

    path = default_model_path()
    shipped = ModelDefaults.read(path)
    steps, guidance = shipped.steps, shipped.guidance
    pairs = demo_eval.eval_set("test", n)
    prompts, seeds = [p for p, _, _ in pairs], [s for _, s, _ in pairs]
    out, ref = {}, None
    for mode in ("float32", *modes):
        t = time.perf_counter()
        pipe = load(path, "none" if mode == "float32" else mode)
        ims = demo_eval.generate(pipe, prompts, seeds, steps, guidance)
        res = demo_eval.score(ims, [sc for _, _, sc in pairs], prompts)
        res.update(split="test", steps=steps, guidance=guidance, sampler="model default",
                   failures=len(res["failures"]), seconds=round(time.perf_counter() - t, 1))
        as_float = ims.astype(np.float32) / 255
        if ref is None:
            ref = as_float
        else:
            res["psnr_vs_float32"] = {k: v for k, v in psnr_summary(as_float, ref).items()
                                      if k != "per_image_db"}
        out[mode] = res
        print(f"# demo {mode}: all {100 * res['all']:.1f} % (colour {100 * res['shape_color']:.1f}"
              f", background {100 * res['background']:.1f}, shape {100 * res['shape']:.1f}) "
              f"({res['seconds']} s)", flush=True)
    return out


# ------------------------------------------------------------------------------ memory
def _maxrss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_child(path: str, setup: str, size: int) -> dict:
    """One setup's figures, in this (fresh) process."""
    import jax

    from maxdiff import quantization as quantlib
    from pipelines import TextToImagePipeline  # noqa: F401  (its imports count as "imports")
    from pipelines.requests import ImageRequest

    dtype, mode = MEMORY_SETUPS[setup]
    after_imports = _maxrss_mib()
    pipe = load(path, mode, dtype)
    jax.block_until_ready(pipe.params)
    row = {"setup": setup, "dtype": dtype, "quantization": mode,
           "unet_bytes": quantlib.nbytes(pipe.params["unet"]),
           "params_bytes": quantlib.nbytes(pipe.params),
           "peak_rss_after_imports_mib": round(after_imports, 1),
           "peak_rss_after_load_mib": round(_maxrss_mib(), 1),
           "rss_after_load_mib": round(_rss_mib(), 1)}
    if size:  # 0: loading only (--memory-no-image)
        pipe.generate([ImageRequest(PROMPTS[0], seed=1, guidance_scale=0.0)], height=size,
                      width=size, num_inference_steps=STEPS, output_type="np")
        row["peak_rss_after_image_mib"] = round(_maxrss_mib(), 1)
    return row


def memory(path: Path, spec: dict, setups, image: bool = True) -> list[dict]:
    """Each setup in a fresh process (this module with ``--memory-child``); ``image``: also
    make one image there."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    rows = []
    for setup in setups:
        cmd = [sys.executable, "-m", "benchmarks.quantization", "--memory-child", setup,
               "--checkpoint", str(path), "--size", str(spec["size"] if image else 0)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if proc.returncode:
            raise SystemExit(f"memory {setup} failed (exit {proc.returncode}):\n"
                             f"{proc.stderr[-3000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"# memory {setup}: UNet {row['unet_bytes'] / 2**20:.1f} MiB, peak RSS "
              f"{row['peak_rss_after_load_mib']:.0f} MiB loaded "
              f"({row['rss_after_load_mib']:.0f} MiB resident then), "
              f"{row.get('peak_rss_after_image_mib', '-')} MiB after one image", flush=True)
    base = rows[0]["unet_bytes"] if rows else 0
    for r in rows:
        r["unet_bytes_vs_first"] = round(r["unet_bytes"] / base, 4) if base else None
    return rows


# ------------------------------------------------------------------------------ speed
def speed(path: Path, spec: dict, reps: int, modes) -> dict:
    import jax
    import jax.numpy as jnp

    size, batch = spec["size"], spec["batch"]
    pipes = {m: load(path, m) for m in modes}
    ref = pipes[modes[0]]
    rng = np.random.default_rng(0)
    lat = size // ref.vae_scale_factor
    x = jnp.asarray(rng.standard_normal((batch, lat, lat, 4)).astype(np.float32))
    ctx = jnp.asarray(rng.standard_normal(
        (batch, 77, ref.unet.config.cross_attention_dim)).astype(np.float32))
    pooled = jnp.asarray(rng.standard_normal(
        (batch, ref.text_encoder_2.config.projection_dim)).astype(np.float32))
    tid = jnp.asarray(np.tile([size, size, 0, 0, size, size], (batch, 1)).astype(np.float32))
    t = jnp.float32(999.0)

    def unet_step(p):
        f = jax.jit(lambda pu, *a: p.unet.apply({"params": pu}, *a))
        return lambda: jax.block_until_ready(f(p.params["unet"], x, t, ctx, pooled, tid))

    def pipeline(p):
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        return lambda: p(prompts, seed=1, num_inference_steps=STEPS, guidance_scale=0.0,
                         height=size, width=size, output_type="np").images

    out = {"reps": reps, "batch": batch, "size": size, "steps": STEPS}
    for part, make in (("unet_step", unet_step), ("pipeline", pipeline)):
        medians, times = compare.side_by_side([make(pipes[m]) for m in modes], reps)
        out[part] = {m: {"median_s": round(med, 4), "times_s": [round(x, 4) for x in ts],
                         "speedup_vs_float32": round(medians[0] / med, 3)}
                     for m, med, ts in zip(modes, medians, times)}
        print(f"# speed {part}: " + ", ".join(f"{m} {med:.3f} s" for m, med in
                                              zip(modes, medians)), flush=True)
    return out


# ------------------------------------------------------------------------------ main
def machine() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", nargs="+", choices=["quality", "memory", "speed"],
                    default=["quality"])
    ap.add_argument("--config", choices=["medium", "tiny"], default="medium",
                    help="benchmarks.compare's checkpoint (tiny: smoke runs)")
    ap.add_argument("--checkpoint", metavar="DIR",
                    help="where the checkpoint is (reused) or is written (kept)")
    ap.add_argument("--n", type=int, default=32, help="medium images per mode (default 32)")
    ap.add_argument("--demo-n", type=int, default=None,
                    help="demo evaluation pairs (default: the test split's 252)")
    ap.add_argument("--modes", nargs="+", choices=QUALITY_MODES, default=list(QUALITY_MODES))
    ap.add_argument("--demo-modes", nargs="*", choices=QUALITY_MODES, default=list(DEMO_MODES))
    ap.add_argument("--no-demo", action="store_true", help="skip the demo model")
    ap.add_argument("--no-medium", action="store_true",
                    help="quality: the demo model only (no checkpoint is written: a machine "
                         "without diffusers)")
    ap.add_argument("--memory-setups", nargs="+", choices=list(MEMORY_SETUPS),
                    default=list(DEFAULT_MEMORY))
    ap.add_argument("--memory-no-image", action="store_true",
                    help="--part memory: loading only (no image, no compile)")
    ap.add_argument("--reps", type=int, default=5, help="--part speed: timed repetitions (>= 5 "
                                                        "for a published figure)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--memory-child", choices=list(MEMORY_SETUPS), help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    compare.pin_threads(a.threads)  # before jax is imported
    if a.memory_child:
        print(json.dumps(memory_child(a.checkpoint, a.memory_child, a.size)), flush=True)
        return
    if a.n < 1 or a.reps < 1:
        ap.error("--n and --reps must be >= 1")

    import jax

    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    result = {"date": started, "command": "python -m benchmarks.quantization "
              + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine(), "versions": {"jax": jax.__version__},
              "config": a.config, "steps": STEPS, "thresholds": THRESHOLDS}
    try:
        from importlib.metadata import version

        import qwix  # noqa: F401

        result["versions"]["qwix"] = version("qwix")
    except Exception:  # noqa: BLE001 (quantize() says what to install)
        pass
    need = a.part != ["quality"] or not a.no_medium
    path, spec, remove = checkpoint(a.config, a.checkpoint) if need else (None, {}, False)
    result.update(size=spec.get("size"), batch=spec.get("batch"))
    ok = True
    try:
        if "quality" in a.part:
            result["medium"] = None if a.no_medium else quality_medium(path, spec, a.n, a.modes)
            result["demo"] = None if a.no_demo else quality_demo(a.demo_modes, a.demo_n)
            result["verdicts"] = verdicts(result["medium"], result["demo"])
            ok = all_pass(result["verdicts"])
            result["pass"] = ok
        if "memory" in a.part:
            result["memory"] = memory(path, spec, a.memory_setups, not a.memory_no_image)
        if "speed" in a.part:
            result["speed"] = speed(path, spec, a.reps, ["none", *a.modes])
    finally:
        if remove:
            shutil.rmtree(path, ignore_errors=True)
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    if a.json:
        # numpy scalars (a verdict of np.float64 figures) as Python numbers: the run of
        # 2026-12-05 lost its JSON to a numpy bool after 20 minutes of measuring
        Path(a.json).write_text(json.dumps(result, indent=1, default=lambda o: o.item()))
    for name, per in result.get("verdicts", {}).items():
        for mode, v in per.items():
            print(f"{name:<22} {mode:<13} {v['value']:>8} (bound {v['bound']}): "
                  f"{'pass' if v['pass'] else 'FAIL'}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
