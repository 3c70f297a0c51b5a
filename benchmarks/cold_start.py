"""Cold start: process start to first image, with an empty and a warm persistent compilation
cache, and checkpoint load time from a diffusers folder and from a ``maxdiff convert``ed one.

    python -m benchmarks.cold_start --model /models/sdxl-base --size 1024 --steps 4
    python -m benchmarks.cold_start                       # the embedded demo model, 5 repeats
    python -m benchmarks.cold_start --model /tmp/tiny-sdxl --repeats 1 --json out.json

Every measurement is a fresh Python process (``python -m benchmarks.cold_start --child ...``)
timed by this one from just before it is started to its exit; the child also reports its
phases (imports, ``TextToImagePipeline.from_pretrained``, the first call) against the
parent's start time. Measurements of a pair alternate (A first on even repeats, B first on odd
ones) and the figures are medians over ``--repeats`` (default 5):

- **first image**: start -> import -> ``from_pretrained(model, compile_cache_dir=DIR)`` -> one
  image (``--size``, ``--steps``, the model's guidance unless ``--guidance``) -> exit. *empty*:
  DIR is a new empty folder each time (everything compiles); *warm*: DIR is one folder filled
  by an untimed run first (the compiled program is read back from it).
  ``MAXDIFF_COMPILE_CACHE`` is set to DIR too, for code that reads it.
- **load**: start -> import -> ``from_pretrained(folder, dtype=--dtype, compile_cache_dir=None)``
  -> exit, from ``--model`` as it is and from ``maxdiff convert --dtype DTYPE`` of it (weights
  stored already cast: fewer bytes to read, nothing to cast). Both folders are read once,
  untimed, first, so both are served from the operating system's file cache alike (dropping
  that cache needs root; a first read from disk is slower for both).

Timings on a shared machine are noisy; run it with the machine otherwise idle. Nothing here
imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# --- the child process -----------------------------------------------------------------------

def child(args) -> int:
    """One measurement; prints one JSON line with phase end times relative to ``--t0``."""
    t0 = args.t0
    mark = {}
    import jax  # noqa: F401  (the import is part of a cold start)

    from pipelines import TextToImagePipeline

    mark["import_s"] = time.time() - t0
    cache = args.cache or None
    pipe = TextToImagePipeline.from_pretrained(args.model, dtype=args.dtype,
                                               compile_cache_dir=cache)
    jax.block_until_ready(pipe.params)
    mark["loaded_s"] = time.time() - t0
    mark["load_s"] = mark["loaded_s"] - mark["import_s"]  # from_pretrained alone
    if args.mode == "image":
        kw = dict(num_inference_steps=args.steps, seed=0, output_type="np")
        if args.size:
            kw.update(height=args.size, width=args.size)
        if args.guidance is not None:
            kw["guidance_scale"] = args.guidance
        pipe("a red circle on a blue background", **kw)
        mark["first_image_s"] = time.time() - t0
        mark["first_call_s"] = mark["first_image_s"] - mark["loaded_s"]  # compile (or read) + run
    print("COLD_START " + json.dumps(mark), flush=True)
    return 0


# --- the parent --------------------------------------------------------------------------------

def run_child(mode: str, model: Path, dtype: str, cache: str, size: int | None, steps: int,
              guidance: float | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if cache:
        env["MAXDIFF_COMPILE_CACHE"] = cache
    else:
        env.pop("MAXDIFF_COMPILE_CACHE", None)
    t0 = time.time()
    cmd = [sys.executable, "-m", "benchmarks.cold_start", "--child", mode, "--t0", repr(t0),
           "--model", str(model), "--dtype", dtype, "--steps", str(steps),
           "--cache", cache or ""]
    if size:
        cmd += ["--size", str(size)]
    if guidance is not None:
        cmd += ["--guidance", str(guidance)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    total = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("COLD_START ")][-1]
    return dict(json.loads(line[len("COLD_START "):]), total_s=total)


def alternate(a, b, repeats: int, label_a: str, label_b: str) -> dict[str, list[dict]]:
    """Run ``a()`` and ``b()`` ``repeats`` times each, A first on even repeats, B on odd."""
    out: dict[str, list[dict]] = {label_a: [], label_b: []}
    for r in range(repeats):
        order = [(label_a, a), (label_b, b)] if r % 2 == 0 else [(label_b, b), (label_a, a)]
        for label, fn in order:
            res = fn()
            out[label].append(res)
            print(f"  repeat {r + 1}/{repeats} {label:>10s}: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
    return out


def medians(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="diffusers SDXL folder (default: the embedded demo model)")
    ap.add_argument("--dtype", default="bfloat16", help="load dtype and convert dtype")
    ap.add_argument("--size", type=int, help="image side (default: the model's)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--guidance", type=float, help="default: the model's")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip", nargs="*", default=[], choices=["image", "load"])
    ap.add_argument("--work", help="folder for the caches and the converted model "
                                   "(default: a temporary one, removed at the end)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", choices=["image", "load"], help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.mode = args.child
        return child(args)

    from pipelines.default_model import default_model_path

    model = Path(args.model) if args.model else default_model_path()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="maxdiff-cold-"))
    work.mkdir(parents=True, exist_ok=True)
    result = dict(model=str(model), dtype=args.dtype, size=args.size, steps=args.steps,
                  repeats=args.repeats, python=sys.version.split()[0])
    try:
        if "image" not in args.skip:
            print(f"first image ({model}, {args.dtype}, {args.steps} steps):", flush=True)
            warm = work / "cache-warm"
            shutil.rmtree(warm, ignore_errors=True)
            run = lambda cache: run_child("image", model, args.dtype, str(cache), args.size,
                                          args.steps, args.guidance)
            run(warm)  # fills the warm cache (untimed)
            n = [0]

            def empty():
                n[0] += 1
                folder = work / f"cache-empty-{n[0]}"
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                try:
                    return run(folder)
                finally:
                    shutil.rmtree(folder, ignore_errors=True)

            runs = alternate(empty, lambda: run(warm), args.repeats, "empty", "warm")
            result["first_image"] = {k: medians(v) for k, v in runs.items()}
            result["first_image_runs"] = runs
        if "load" not in args.skip:
            converted = work / f"converted-{args.dtype}"
            if not converted.exists():
                subprocess.run([sys.executable, "-m", "pipelines.cli", "convert", str(model),
                                str(converted), "--dtype", args.dtype], cwd=ROOT, check=True,
                               env=dict(os.environ, PYTHONPATH=str(ROOT)),
                               stdout=subprocess.DEVNULL)
            print(f"load ({args.dtype}): diffusers folder vs maxdiff convert --dtype "
                  f"{args.dtype}:", flush=True)
            load = lambda folder: run_child("load", folder, args.dtype, "", None, args.steps, None)
            load(model), load(converted)  # both into the OS file cache (untimed)
            runs = alternate(lambda: load(model), lambda: load(converted), args.repeats,
                             "diffusers", "converted")
            result["load"] = {k: medians(v) for k, v in runs.items()}
            result["load_runs"] = runs
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print("medians (seconds from process start):")
    for part in ("first_image", "load"):
        for label, m in result.get(part, {}).items():
            print(f"  {part:12s} {label:10s} " + "  ".join(f"{k} {v:.2f}" for k, v in m.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
