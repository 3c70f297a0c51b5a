"""maxdiff against OpenVINO (optimum-intel) on the same random weights, in fresh processes.

    bash benchmarks/openvino_env.sh                        # once: .venv-openvino (pinned)
    python -m benchmarks.openvino_peer --repeats 3 --json ov.json      # the measurement
    python -m benchmarks.openvino_peer --repeats 1 --reps 2            # smoke run

What it does, in order:

1. The checkpoint: ``--folder`` (a diffusers SDXL folder), or the medium checkpoint of
   :mod:`benchmarks.compare` (:func:`benchmarks.compare.write_checkpoint`: SDXL's UNet blocks at
   half width, SDXL's VAE, two 2-layer CLIP encoders; 256x256, batch 2) written into the work
   folder (``--workdir``, default a temporary one).
2. A copy for the export (:func:`export_copy`) whose text encoders have the keys the older
   transformers in ``.venv-openvino`` expects: transformers 5 in ``.venv`` saves
   ``CLIPTextModel`` without its ``text_model.`` prefix, which transformers 5.5 (the newest
   optimum-intel 2.2.0 accepts) reads as 36 missing weights: the export then "succeeds" with a
   randomly initialised text encoder and only its log says so. The UNet, VAE, tokenizers and
   scheduler are linked, not copied.
3. The export, by a child in ``.venv-openvino`` (``--ov-python``; default: what
   ``benchmarks/openvino_env.sh`` creates or reuses): it first loads both text encoders with
   ``output_loading_info=True`` and fails on any missing, unexpected or mismatched key, then
   exports with ``OVStableDiffusionXLPipeline.from_pretrained(copy, export=True,
   load_in_8bit=False)`` (float32 IR; no weight compression) and saves the IR. The parent also
   fails if the export's log mentions missing or newly initialised weights.
4. ``--repeats K`` measurement rounds. In each round every side runs in its own fresh process,
   the order of the sides rotating by one each round (round r starts with side r mod 3):
   ``maxdiff`` (its ``TextToImagePipeline`` from the original folder, as
   :mod:`benchmarks.compare` times its ``pipeline`` part), ``openvino-f32``
   (``ov_config={"INFERENCE_PRECISION_HINT": "f32"}``) and ``openvino-default`` (no precision
   hint: the CPU plugin's default, bf16 on a CPU with AVX512_BF16 or AMX; the precision the
   compiled UNet reports is recorded). The call: the batch's prompts, 4 Euler steps with
   trailing timesteps, no CFG (``guidance_scale=0``), 256x256, batch 2, the same initial
   latents on every side, ``output_type="np"``; one warm-up call, then ``--reps`` timed calls
   (5 or more for a figure), median. Threads are pinned equal (``--threads``, default 2): XLA's
   Eigen pool through ``NPROC`` (:func:`benchmarks.compare.pin_threads`), and OpenVINO's
   ``INFERENCE_NUM_THREADS`` plus ``torch.set_num_threads`` (optimum's pipeline runs the
   scheduler in torch). OpenVINO runs with dynamic shapes, as optimum loads it: optimum's
   ``reshape()`` assumes classifier-free guidance (it doubles the UNet's batch), which this
   call does not use.
5. The weight check, after round 1 and before any further round: the OpenVINO f32 images
   against maxdiff's float32 images (the same prompts and latents) must agree within
   :data:`F32_TOLERANCE` (max abs difference, images in [0, 1]), else the run fails loudly: a
   text encoder, UNet or VAE that did not load its weights gives differences of order 0.1.
   The PSNR of the OpenVINO-default images against maxdiff's float32 images is reported.

Output: per round a line per side; then the summary (:func:`summarise`): per side images/s per
round and min-median-max; ``ratios``: maxdiff's images/s over each OpenVINO side's, per round
and min-median-max (above 1: maxdiff is faster); ``check``. ``--json`` writes it all.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("maxdiff", "openvino-f32", "openvino-default")
OV_SIDES = {"openvino-f32": {"INFERENCE_PRECISION_HINT": "f32"}, "openvino-default": {}}
# OpenVINO f32 against maxdiff f32 (images in [0, 1], max abs difference). Fixed before the
# first measurement; an earlier run of the same comparison (against diffusers) gave 6e-6, and a
# module with random instead of loaded weights gives differences of order 0.1.
F32_TOLERANCE = 1e-3
# what the export's log says when weights were not loaded (transformers and diffusers)
MISSING_WEIGHTS = re.compile(r"MISSING|newly initiali[sz]ed|were not initiali[sz]ed|"
                             r"missing_keys|Some weights of", re.I)


def _env(threads: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = str(threads)
    env.pop("MAXDIFF_CONV", None)
    return env


# ---------------------------------------------------------------- the export (steps 2 and 3)

def export_copy(src: Path, dst: Path) -> dict:
    """A copy of the SDXL folder ``src`` at ``dst`` whose ``CLIPTextModel`` text encoders carry
    the ``text_model.`` prefix on every key (as transformers 4.x and 5.5 expect); everything
    else is linked. Returns {component: number of keys renamed}."""
    from safetensors.numpy import load_file, save_file

    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    renamed = {}
    for item in sorted(src.iterdir()):
        target = dst / item.name
        config = item / "config.json"
        if not (item.is_dir() and item.name.startswith("text_encoder") and config.exists()):
            target.symlink_to(item.resolve(), target_is_directory=item.is_dir())
            continue
        target.mkdir()
        shutil.copy2(config, target / "config.json")
        arch = json.loads(config.read_text()).get("architectures", [])
        renamed[item.name] = 0
        for f in sorted(item.glob("*.safetensors")):
            tensors = load_file(f)
            if arch == ["CLIPTextModel"]:
                fixed = {}
                for k, v in tensors.items():
                    if not k.startswith("text_model."):
                        k = "text_model." + k
                        renamed[item.name] += 1
                    fixed[k] = v
                tensors = fixed
            save_file(tensors, target / f.name, metadata={"format": "pt"})
        for f in item.iterdir():
            if f.suffix != ".safetensors" and f.name != "config.json":
                (target / f.name).symlink_to(f.resolve())
    return renamed


def ov_python(given: str | None) -> str:
    """The python of .venv-openvino: ``given``, or what benchmarks/openvino_env.sh prints."""
    if given:
        return given
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "openvino_env.sh")], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"benchmarks/openvino_env.sh failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.strip().splitlines()[-1]


def export(py: str, src: Path, ir: Path, threads: int) -> dict:
    """Export the fixed copy ``src`` to OpenVINO IR at ``ir`` in .venv-openvino; fails loudly
    when a weight did not load (the child's own key check, and its log)."""
    cmd = [py, "-m", "benchmarks.openvino_peer", "--child", "export", "--folder", str(src),
           "--ir", str(ir)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(threads), capture_output=True, text=True,
                          check=False)
    log = proc.stdout + proc.stderr
    if proc.returncode:
        raise SystemExit(f"the OpenVINO export failed (exit {proc.returncode}):\n{log[-4000:]}")
    bad = [ln for ln in log.splitlines() if MISSING_WEIGHTS.search(ln)]
    if bad:
        raise SystemExit("the OpenVINO export's log says weights were not loaded:\n"
                         + "\n".join(bad[:20]))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["export_s"] = round(time.perf_counter() - t, 1)
    return out


def child_export(a) -> None:
    """In .venv-openvino: check both text encoders load every weight, export, save the IR."""
    import transformers
    from optimum.intel import OVStableDiffusionXLPipeline

    src = Path(a.folder)
    loaded = {}
    for name in ("text_encoder", "text_encoder_2"):
        arch = json.loads((src / name / "config.json").read_text())["architectures"][0]
        _, info = getattr(transformers, arch).from_pretrained(src / name, output_loading_info=True)
        problems = {k: list(v) for k, v in info.items() if v}
        if problems:
            raise SystemExit(f"{name} ({arch}) does not load every weight under transformers "
                             f"{transformers.__version__}: "
                             + json.dumps({k: v[:5] for k, v in problems.items()}))
        loaded[name] = arch
    pipe = OVStableDiffusionXLPipeline.from_pretrained(src, export=True, compile=False,
                                                       load_in_8bit=False)
    pipe.save_pretrained(a.ir)
    import openvino

    print(json.dumps({"text_encoders_loaded": loaded, "transformers": transformers.__version__,
                      "openvino": openvino.__version__}), flush=True)


# ------------------------------------------------------------------ the timed sides (step 4)

def _latents(batch: int, size: int) -> np.ndarray:
    lh = size // 8
    return np.random.default_rng(0).standard_normal((batch, 4, lh, lh)).astype(np.float32)


def _time(call, reps: int) -> tuple[list[float], object]:
    """One warm-up call (its output returned), then ``reps`` timed calls."""
    out = call()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return times, out


def child_maxdiff(a) -> dict:
    """In .venv: maxdiff's pipeline as benchmarks.compare times its ``pipeline`` part."""
    from benchmarks.compare import PROMPTS, STEPS, _sched, pin_threads, xla_eigen_threads

    pin_threads(a.threads)  # before jax is imported
    from pipelines import TextToImagePipeline

    folder = Path(a.folder)
    pipe = TextToImagePipeline.from_pretrained(
        folder, compile_cache_dir=None,
        scheduler={"_class_name": "EulerDiscreteScheduler", **_sched(folder)})
    prompts = (PROMPTS * a.batch)[:a.batch]
    lat = _latents(a.batch, a.size)
    kw = dict(prompt=prompts, num_inference_steps=STEPS, guidance_scale=0.0, height=a.size,
              width=a.size, output_type="np")
    times, images = _time(lambda: pipe(**kw, latents=lat).images, a.reps)
    import jax

    return {"times_s": times, "images": np.asarray(images, np.float32),
            "info": {"xla_eigen_threads": xla_eigen_threads(), "jax": jax.__version__}}


def child_openvino(a) -> dict:
    """In .venv-openvino: optimum-intel's OVStableDiffusionXLPipeline from the IR."""
    import torch

    torch.set_num_threads(a.threads)
    import openvino
    from optimum.intel import OVStableDiffusionXLPipeline

    from benchmarks.compare import PROMPTS, STEPS

    cfg = {**OV_SIDES[a.child], "INFERENCE_NUM_THREADS": str(a.threads)}
    pipe = OVStableDiffusionXLPipeline.from_pretrained(a.ir, ov_config=cfg, compile=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config,
                                                      timestep_spacing="trailing")
    prompts = (PROMPTS * a.batch)[:a.batch]
    lat = torch.from_numpy(_latents(a.batch, a.size))
    kw = dict(prompt=prompts, num_inference_steps=STEPS, guidance_scale=0.0, height=a.size,
              width=a.size, output_type="np")
    times, images = _time(lambda: pipe(**kw, latents=lat).images, a.reps)
    info = {"ov_config": cfg, "openvino": openvino.__version__,
            "torch_threads": torch.get_num_threads()}
    for part in ("unet", "vae_decoder", "text_encoder"):
        try:
            req = getattr(pipe, part).request
            prec = req.get_property("INFERENCE_PRECISION_HINT")  # an openvino.Type: "bf16"
            info[f"{part}_precision"] = prec.to_string() if hasattr(prec, "to_string") \
                else str(prec)
            info[f"{part}_threads"] = int(req.get_property("INFERENCE_NUM_THREADS"))
        except Exception as e:  # noqa: BLE001 - a property this version lacks: say so
            info[f"{part}_precision"] = f"unknown ({type(e).__name__})"
    return {"times_s": times, "images": np.asarray(images, np.float32), "info": info}


def run_side(side: str, a, py_main: str, py_ov: str, ckpt: Path, ir: Path,
             out_dir: Path) -> dict:
    """One side in a fresh process; {"median_s", "images_per_s", "times_s", "info",
    "images_path"}."""
    out = out_dir / f"{side}.json"
    py = py_main if side == "maxdiff" else py_ov
    cmd = [py, "-m", "benchmarks.openvino_peer", "--child", side, "--folder", str(ckpt),
           "--ir", str(ir), "--reps", str(a.reps), "--threads", str(a.threads),
           "--batch", str(a.batch), "--size", str(a.size), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(a.threads), capture_output=True, text=True,
                          check=False)
    if proc.returncode:
        raise SystemExit(f"side {side} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                         f"{(proc.stdout + proc.stderr)[-4000:]}")
    r = json.loads(out.read_text())
    r["median_s"] = statistics.median(r["times_s"])
    r["images_per_s"] = a.batch / r["median_s"]
    return r


# ------------------------------------------------------------------------------ the summary

def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of images ``a`` against ``b`` (values in [0, 1]); inf where equal."""
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _mmm(v: list[float], nd: int = 3) -> dict:
    return {"min": round(min(v), nd), "median": round(statistics.median(v), nd),
            "max": round(max(v), nd)}


def summarise(rounds: list[dict]) -> dict:
    """``rounds``: [{"order": [side, ...], "sides": {side: {"images_per_s", "median_s", ...}}}].
    Returns {"rounds": K, "sides": {side: {"images_per_s": [per round], "min_median_max"}},
    "ratios": {"maxdiff/<side>": {"per_round": [...], "min_median_max"}}}: the ratio is
    maxdiff's images/s over the OpenVINO side's in the same round (above 1: maxdiff faster)."""
    sides: dict[str, list[float]] = {}
    for r in rounds:
        for side, s in r["sides"].items():
            sides.setdefault(side, []).append(s["images_per_s"])
    out = {"rounds": len(rounds),
           "sides": {k: {"images_per_s": [round(x, 4) for x in v], "min_median_max": _mmm(v)}
                     for k, v in sides.items()},
           "ratios": {}}
    for side in sides:
        if side == "maxdiff" or "maxdiff" not in sides:
            continue
        v = [r["sides"]["maxdiff"]["images_per_s"] / r["sides"][side]["images_per_s"]
             for r in rounds if side in r["sides"] and "maxdiff" in r["sides"]]
        out["ratios"][f"maxdiff/{side}"] = {"per_round": [round(x, 3) for x in v],
                                           "min_median_max": _mmm(v)}
    return out


def format_summary(summary: dict, check: dict | None = None) -> str:
    """The printed summary: one line per side, one per ratio, the check."""
    k = summary["rounds"]
    lines = [f"images/s, min-median-max over {k} round(s):"]
    for side, s in summary["sides"].items():
        m = s["min_median_max"]
        lines.append(f"  {side:<17} {m['min']:.3f}-{m['median']:.3f}-{m['max']:.3f}")
    for name, r in summary["ratios"].items():
        m = r["min_median_max"]
        lines.append(f"  ratio {name:<27} {m['min']:.2f}-{m['median']:.2f}-{m['max']:.2f}")
    if check:
        lines.append(f"  check: openvino-f32 vs maxdiff f32 max |diff| "
                     f"{check['f32_max_abs_diff']:.2e} (tolerance {check['tolerance']:g}); "
                     f"openvino-default vs maxdiff f32 PSNR {check['default_psnr_db']:.1f} dB, "
                     f"max |diff| {check['default_max_abs_diff']:.2e}")
    return "\n".join(lines)


def weight_check(images: dict[str, np.ndarray], tolerance: float = F32_TOLERANCE) -> dict:
    """OpenVINO f32 against maxdiff f32 (fails loudly beyond ``tolerance``), and the PSNR of
    OpenVINO default against maxdiff f32."""
    ref = images["maxdiff"]
    for side, im in images.items():
        if im.shape != ref.shape:
            raise SystemExit(f"{side}'s images have shape {im.shape}, maxdiff's {ref.shape}")
    f32 = float(np.abs(images["openvino-f32"] - ref).max())
    check = {"tolerance": tolerance, "f32_max_abs_diff": f32,
             "f32_psnr_db": psnr(images["openvino-f32"], ref),
             "default_max_abs_diff": float(np.abs(images["openvino-default"] - ref).max()),
             "default_psnr_db": psnr(images["openvino-default"], ref), "passed": f32 <= tolerance}
    if not check["passed"]:
        raise SystemExit(f"WEIGHT CHECK FAILED: OpenVINO f32 images differ from maxdiff's by "
                         f"{f32:.3e} > {tolerance:g}: the export did not load every weight "
                         f"(or computes something else): {json.dumps(check)}")
    return check


# ------------------------------------------------------------------------------------- main

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", help="a diffusers SDXL folder (default: write the medium "
                                     "checkpoint of benchmarks.compare)")
    ap.add_argument("--workdir", help="keep the checkpoint, the export and the images here "
                                      "(default: a temporary folder, removed)")
    ap.add_argument("--ir", help="an IR folder exported by an earlier run (skips the export)")
    ap.add_argument("--ov-python", help="python of the OpenVINO venv (default: run "
                                        "benchmarks/openvino_env.sh, which creates or reuses "
                                        ".venv-openvino)")
    ap.add_argument("--repeats", type=int, default=3, metavar="K",
                    help="measurement rounds, each side a fresh process per round (default 3)")
    ap.add_argument("--reps", type=int, default=5,
                    help="timed calls per side and round after one warm-up (default 5)")
    ap.add_argument("--threads", type=int, default=2, help="threads for every side (default 2)")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--json", help="write the rounds, the check and the summary here")
    ap.add_argument("--child", choices=["export", *SIDES], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _child(a)
        return
    if a.repeats < 1 or a.reps < 1 or a.threads < 1:
        ap.error("--repeats, --reps and --threads must be >= 1")
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="maxdiff-ov-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        _measure(a, work)
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)


def _child(a) -> None:
    if a.child == "export":
        child_export(a)
        return
    r = child_maxdiff(a) if a.child == "maxdiff" else child_openvino(a)
    images = Path(a.out).with_suffix(".npy")
    np.save(images, r.pop("images"))
    Path(a.out).write_text(json.dumps({**r, "images_path": str(images)}))


def _measure(a, work: Path) -> None:
    py_ov = ov_python(a.ov_python)
    header = {"threads": a.threads, "reps": a.reps, "repeats": a.repeats, "size": a.size,
              "batch": a.batch, "steps": 4, "guidance_scale": 0.0, "f32_tolerance": F32_TOLERANCE}
    if a.folder:
        ckpt = Path(a.folder).resolve()
    else:
        from benchmarks.compare import configs, write_checkpoint

        ckpt = work / "medium"
        if not (ckpt / "model_index.json").exists():
            spec = configs(False)["medium"]
            if (a.size, a.batch) != (spec["size"], spec["batch"]):
                print(f"# note: the medium checkpoint is meant for {spec['size']}x{spec['size']}"
                      f", batch {spec['batch']}", flush=True)
            write_checkpoint(ckpt, spec)
    header["folder"] = str(ckpt)
    if a.ir:
        ir = Path(a.ir).resolve()
        header["export"] = {"reused": str(ir)}
    else:
        fixed = work / "export-copy"
        header["renamed_keys"] = export_copy(ckpt, fixed)
        ir = work / "openvino-ir"
        if ir.exists():
            shutil.rmtree(ir)
        header["export"] = export(py_ov, fixed, ir, a.threads)
    print(json.dumps(header), flush=True)
    rounds, check = [], None
    for i in range(a.repeats):
        order = [SIDES[(i + k) % len(SIDES)] for k in range(len(SIDES))]
        out_dir = work / f"round{i}"
        out_dir.mkdir(exist_ok=True)
        sides = {}
        for side in order:
            r = run_side(side, a, sys.executable, py_ov, ckpt, ir, out_dir)
            sides[side] = r
            print(json.dumps({"round": i + 1, "side": side,
                              "images_per_s": round(r["images_per_s"], 4),
                              "median_s": round(r["median_s"], 4),
                              "times_s": [round(t, 4) for t in r["times_s"]],
                              "info": r["info"]}), flush=True)
        if check is None:  # the weight check, before any further round
            check = weight_check({s: np.load(sides[s]["images_path"]) for s in SIDES})
            print(json.dumps({"check": check}), flush=True)
        rounds.append({"order": order, "sides": {
            s: {k: v for k, v in r.items() if k != "images_path"} for s, r in sides.items()}})
    summary = summarise(rounds)
    if a.json:
        Path(a.json).write_text(json.dumps({**header, "check": check, "rounds": rounds,
                                            "summary": summary}, indent=1))
    print()
    print(format_summary(summary, check))


if __name__ == "__main__":
    main()
