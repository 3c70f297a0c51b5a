"""What feature caching buys and costs: ``deepcache_interval`` and ``cfg_cutoff`` against the
uncached run, side by side.

    python -m benchmarks.feature_cache --json speed.json          # speed, 3 fresh processes
    python -m benchmarks.feature_cache --quality --json q.json    # quality on the demo model
    python -m benchmarks.feature_cache --tpu v5e:2x2 --size 1024 --json tpu.json  # compiler

Speed: compare.py's medium checkpoint (SDXL's UNet blocks at half width, the real SDXL VAE,
random weights), one image of ``--size`` pixels, ``--steps`` Euler steps (30) with CFG at
guidance 5, float32. Settings: ``uncached``, ``deepcache3`` (``deepcache_interval=3``),
``cutoff0.5`` (``cfg_cutoff=0.5``) and ``both``. Each process compiles every setting once, then
runs them alternately ``--reps`` times (the order rotates every repetition) and reports the
median seconds per image; ``--repeats`` fresh processes give each speed-up's range
(uncached time / setting's time). The same seed in every run, so each process also reports the
PSNR of each setting's image against the uncached one (random weights: a check that caching
changes little, not a quality figure).

Quality (``--quality``): the embedded demo model on its held-out test prompts
(:mod:`pipelines.demo_eval`: 252 prompts, their noise seeds, the frozen analyser) at
``--steps`` steps of its own sampler and its guidance, each setting against the uncached
images: mean and minimum PSNR, and the analyser's accuracy (all attributes right) with its
95 % Wilson interval. The thresholds (:data:`PSNR_MIN_DB`, :data:`ACCURACY_DROP_MAX`) were
fixed before the first measurement.

TPU (``--tpu``): SDXL base's UNet (bfloat16) compiled for the topology's chips, a full call
and a shallow-branch call with and without CFG rows; each setting's denoising loop is priced as
the sum of its calls' roofline times on the chip's published peaks (text encoders and the
decode, equal for every setting, left out). These are the compiler's estimates, not
measurements.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SETTINGS = {
    "uncached": {},
    "deepcache3": {"deepcache_interval": 3},
    "cutoff0.5": {"cfg_cutoff": 0.5},
    "both": {"deepcache_interval": 3, "cfg_cutoff": 0.5},
}
GUIDANCE = 5.0
# fixed before measuring: a setting passes when its images keep this PSNR against the uncached
# ones (mean over the test prompts) and the analyser's accuracy drops by at most this much
PSNR_MIN_DB = 25.0
ACCURACY_DROP_MAX = 0.05


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of images in [0, 1] (inf when equal)."""
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def one_process(model: str, size: int, steps: int, reps: int) -> dict:
    """One process: every setting compiled, then alternated ``reps`` times."""
    from benchmarks.compare import matmul_peak
    from pipelines import TextToImagePipeline

    peak = matmul_peak()
    pipe = TextToImagePipeline.from_pretrained(model, compile_cache_dir=None)

    def run(name: str) -> tuple[float, np.ndarray]:
        t0 = time.perf_counter()
        out = pipe("a red circle on a blue background", height=size, width=size,
                   num_inference_steps=steps, guidance_scale=GUIDANCE, seed=7,
                   output_type="np", **SETTINGS[name])
        return time.perf_counter() - t0, out.images[0]

    names = list(SETTINGS)
    images = {name: run(name)[1] for name in names}  # compiles
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(run(name)[0])
    med = {name: statistics.median(v) for name, v in times.items()}
    return {"matmul_peak_gflops": peak, **{
        name: dict(s_per_image=med[name], speedup=med["uncached"] / med[name],
                   psnr_db=psnr(images[name], images["uncached"]), times=times[name])
        for name in names}}


def quality(steps: int) -> dict:
    """The demo model's held-out test prompts under every setting (:mod:`pipelines.demo_eval`)."""
    from maxdiff.training import shapes
    from pipelines import demo_eval
    from pipelines.config import ModelDefaults
    from pipelines.default_model import default_model_path
    from pipelines.requests import ImageRequest

    demo = ModelDefaults.read(default_model_path())
    pipe = demo_eval.load_pipeline()
    pairs = demo_eval.eval_set("test")
    prompts = [p for p, _, _ in pairs]
    scenes = [sc for _, _, sc in pairs]
    out, images = {}, {}
    for name, kw in SETTINGS.items():
        items = [ImageRequest(prompt=p, seed=s, guidance_scale=demo.guidance, **kw)
                 for p, s, _ in pairs]
        t0 = time.perf_counter()
        res = pipe.generate(items, height=shapes.SIZE, width=shapes.SIZE,
                            num_inference_steps=steps, output_type="np")
        seconds = time.perf_counter() - t0
        images[name] = res.images
        uint8 = np.round(res.images * 255).astype(np.uint8)
        s = demo_eval.score(uint8, scenes, prompts)
        out[name] = {"accuracy": s["all"], "accuracy_ci95": s["ci"]["all"],
                     "scores": {k: v for k, v in s.items() if k != "failures"},
                     "seconds": round(seconds, 1)}
    for name in SETTINGS:
        p = [psnr(a, b) for a, b in zip(images[name], images["uncached"])]
        finite = [v for v in p if np.isfinite(v)]
        out[name]["psnr_mean_db"] = float(np.mean(finite)) if finite else float("inf")
        out[name]["psnr_min_db"] = float(min(p))
        drop = out["uncached"]["accuracy"] - out[name]["accuracy"]
        out[name]["passes"] = bool(name == "uncached" or (
            out[name]["psnr_mean_db"] >= PSNR_MIN_DB and drop <= ACCURACY_DROP_MAX))
    return {"model": "embedded demo model", "steps": steps, "guidance": demo.guidance,
            "prompts": len(pairs), "psnr_min_db": PSNR_MIN_DB,
            "accuracy_drop_max": ACCURACY_DROP_MAX, "settings": out}


def loop_calls(steps: int, setting: dict) -> dict[tuple[bool, bool], int]:
    """How many UNet calls of each kind a ``steps``-step loop under ``setting`` makes:
    {(guided, full): count} (guided: CFG rows; full: the whole UNet, else the shallow
    branch)."""
    from pipelines.limits import guided_steps

    cut = guided_steps(steps, setting.get("cfg_cutoff"))
    n = setting.get("deepcache_interval", 1)
    out: dict[tuple[bool, bool], int] = {}
    for i in range(steps):
        key = (i < cut, i % n == 0)  # as pipelines.program.denoise counts them
        out[key] = out.get(key, 0) + 1
    return out


def tpu(topology: str, size: int, steps: int, per_chip: int, log=print) -> dict:
    """The denoising loop under every setting by the TPU compiler's roofline: SDXL base's
    UNet (the shipped config, bfloat16, no weights) compiled for ``topology`` as one full call
    and one shallow-branch call, each with CFG rows and without, ``per_chip`` images a chip;
    a setting's loop costs the sum of its calls' roofline times (:func:`loop_calls`)."""
    from pipelines import aot

    work = Path(tempfile.mkdtemp(prefix="maxdiff-feature-cache-tpu-"))
    try:
        pipe = aot.load(aot.model_folder("sdxl-base", work / "sdxl-base"), topology)
        chip = aot.chip_of(pipe.mesh)
        n = per_chip * pipe.mesh.size
        calls = {}
        for guided in (True, False):
            for full in (True, False):
                t0 = time.perf_counter()
                with aot.recording() as rec:
                    aot.unet_call(pipe, n * (2 if guided else 1), size, size, shallow=not full)
                a = aot.analyse(rec[-1], chip, per_chip)
                calls[(guided, full)] = {k: a[k] for k in (
                    "tflop", "gbytes", "hbm_gbytes", "flops_per_byte", "bound", "roofline_s",
                    "hbm_roofline_s", "hbm_gib")}
                log(f"  {'CFG' if guided else 'no CFG'} {'full' if full else 'shallow'} call: "
                    f"{a['tflop']:.2f} TFLOP, {a['gbytes']:.1f} GB, {a['roofline_s'] * 1e3:.1f} ms"
                    f" ({a['bound']}-bound), compiled in {time.perf_counter() - t0:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    settings = {}
    for name, setting in SETTINGS.items():
        mix = loop_calls(steps, setting)
        settings[name] = {
            "calls": {f"{'cfg' if g else 'nocfg'}-{'full' if f else 'shallow'}": c
                      for (g, f), c in mix.items()},
            **{key: sum(c * calls[k][key] for k, c in mix.items())
               for key in ("roofline_s", "hbm_roofline_s", "tflop")}}
    for r in settings.values():
        base = settings["uncached"]
        r["speedup"] = base["roofline_s"] / r["roofline_s"]
        r["hbm_speedup"] = base["hbm_roofline_s"] / r["hbm_roofline_s"]
    return {"topology": topology, "chip": chip.name, "size": size, "steps": steps,
            "images_per_chip": per_chip, "dtype": "bfloat16", "config": "sdxl-base",
            "calls": {f"{'cfg' if g else 'nocfg'}-{'full' if f else 'shallow'}": v
                      for (g, f), v in calls.items()}, "settings": settings}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=256, help="image side in pixels (speed; 256)")
    ap.add_argument("--steps", type=int, default=30, help="denoising steps (30)")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per setting per process")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes (speed)")
    ap.add_argument("--quality", action="store_true",
                    help="the demo model's held-out accuracy and PSNR instead of speed")
    ap.add_argument("--tpu", metavar="TOPOLOGY",
                    help="the denoising loop's roofline on this TPU topology (e.g. v5e:2x2) "
                         "from the TPU compiler instead of a CPU timing (--size 1024 for SDXL)")
    ap.add_argument("--per-chip", type=int, default=1, help="images per chip (--tpu)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", metavar="MODEL", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(one_process(a.child, a.size, a.steps, a.reps)))
        return
    if a.tpu or a.quality:
        res = tpu(a.tpu, a.size, a.steps, a.per_chip) if a.tpu else quality(a.steps)
        for name, r in res["settings"].items():
            print(f"{name}: " + (
                f"loop {r['roofline_s']:.2f} s by the roofline ({r['speedup']:.2f}x; HBM bytes "
                f"only {r['hbm_roofline_s']:.2f} s, {r['hbm_speedup']:.2f}x), {r['tflop']:.0f} "
                "TFLOP per chip" if a.tpu else
                f"accuracy {r['accuracy']:.3f}, PSNR vs uncached mean {r['psnr_mean_db']:.1f} dB "
                f"(min {r['psnr_min_db']:.1f}), {r['seconds']} s, "
                f"{'passes' if r['passes'] else 'FAILS'}"), flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
        return
    from benchmarks.compare import configs, write_checkpoint

    work = Path(tempfile.mkdtemp(prefix="maxdiff-feature-cache-"))
    try:
        write_checkpoint(work / "medium", configs(False)["medium"])
        runs = []
        for k in range(a.repeats):
            out = subprocess.run([sys.executable, "-m", "benchmarks.feature_cache", "--child",
                                  str(work / "medium"), "--size", str(a.size), "--steps",
                                  str(a.steps), "--reps", str(a.reps)],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            runs.append(r)
            print(f"process {k + 1} (matmul peak {r['matmul_peak_gflops']:.0f} GFLOP/s): " +
                  ", ".join(f"{n} {r[n]['s_per_image']:.2f} s ({r[n]['speedup']:.2f}x, "
                            f"{r[n]['psnr_db']:.1f} dB)" for n in SETTINGS), flush=True)
        summary = {}
        for name in list(SETTINGS)[1:]:
            v = sorted(r[name]["speedup"] for r in runs)
            summary[name] = [v[0], statistics.median(v), v[-1]]
            print(f"{name}: {v[0]:.2f}-{statistics.median(v):.2f}-{v[-1]:.2f}x faster than "
                  f"uncached (min-median-max of {len(v)} processes)")
        if a.json:
            Path(a.json).write_text(json.dumps({
                "checkpoint": "compare.py medium", "size": a.size, "steps": a.steps,
                "guidance": GUIDANCE, "reps": a.reps, "settings": SETTINGS, "runs": runs,
                "speedup_min_median_max": summary}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
