"""What pacing the step engine with the device costs, side by side in one process.

    python -m benchmarks.step_pacing                       # demo and medium, 3 fresh processes
    python -m benchmarks.step_pacing --configs demo --rounds 1 --reps 5 --json out.json

:class:`pipelines.step_engine.StepEngine` ends each tick by waiting until at most
``lookahead`` ticks are left unfinished on the device. This script runs the same workload on
one engine at three settings, alternating them (the order rotates every repetition):

- ``lookahead=0``: a tick returns once its own step has run (the host's work for the next tick
  then adds to the step time);
- ``lookahead=1`` (the default): the host prepares and queues tick k + 1 while the device runs
  tick k;
- ``unpaced``: a lookahead of more than the workload's steps, so the host queues every step
  before it waits: the engine before pacing, whose figures are those of an engine that keeps the
  device busiest, and whose admission, progress and cancellation were wrong.

Workloads (``--configs``): ``demo``, the embedded model at 64x64 (its DPM++ 2M, guidance 4),
8 images of 20 steps in 8 slots; ``medium``, compare.py's medium checkpoint (SDXL's UNet blocks
at half width, the real SDXL VAE) at 128x128, Euler with trailing timesteps, no CFG, 2 images of
8 steps in 2 slots. Each round runs in a fresh process (``--rounds``); each setting runs
``--reps`` times per round after one warm-up run. Per setting: images/s (median of the reps),
the ticking thread's own work per tick (``host_s / ticks``: scheduling, dispatch, callbacks),
wall time per tick, and images/s relative to ``unpaced``; the summary gives each figure's
range over the rounds.
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

SETTINGS = ("lookahead=0", "lookahead=1", "unpaced")
WORKLOADS = {
    "demo": dict(size=64, slots=8, images=8, steps=20, guidance=None),
    "medium": dict(size=128, slots=2, images=2, steps=8, guidance=0.0),
}


def _lookahead(setting: str, steps: int) -> int:
    return steps + 2 if setting == "unpaced" else int(setting.split("=")[1])


def one_round(config: str, model: str | None, reps: int) -> dict:
    """One process: the three settings alternated ``reps`` times on one engine."""
    from pipelines import TextToImagePipeline
    from pipelines.requests import ImageRequest
    from pipelines.step_engine import StepEngine

    w = WORKLOADS[config]
    kw = {} if model is None else {"scheduler": {"_class_name": "EulerDiscreteScheduler",
                                                 "timestep_spacing": "trailing"}}
    pipe = TextToImagePipeline.from_pretrained(model, compile_cache_dir=None, **kw)
    guidance = pipe.default_guidance if w["guidance"] is None else w["guidance"]
    eng = StepEngine(pipe, w["size"], w["size"], slots=w["slots"], output_type="np")
    eng.warmup()

    def run(setting: str) -> dict:
        eng.lookahead = _lookahead(setting, w["steps"])
        before = dict(eng.stats)
        t0 = time.perf_counter()
        for k in range(w["images"]):
            eng.submit(ImageRequest(f"a red circle {k}", seed=k, guidance_scale=guidance),
                       w["steps"])
        eng.run_until_idle()
        wall = time.perf_counter() - t0
        d = {k: eng.stats[k] - before[k] for k in ("ticks", "host_s", "wait_s")}
        return dict(wall_s=wall, **d)

    for s in SETTINGS:  # warm-up
        run(s)
    runs = {s: [] for s in SETTINGS}
    for r in range(reps):
        order = SETTINGS[r % 3:] + SETTINGS[:r % 3]
        for s in order:
            runs[s].append(run(s))
    out = {}
    for s, rs in runs.items():
        wall = statistics.median(x["wall_s"] for x in rs)
        out[s] = dict(images_per_s=w["images"] / wall,
                      host_ms_per_tick=1e3 * statistics.median(x["host_s"] / x["ticks"]
                                                               for x in rs),
                      wall_ms_per_tick=1e3 * statistics.median(x["wall_s"] / x["ticks"]
                                                               for x in rs),
                      ticks=rs[0]["ticks"])
    for s in SETTINGS:
        out[s]["vs_unpaced"] = out[s]["images_per_s"] / out["unpaced"]["images_per_s"]
    return out


def _medium_checkpoint(folder: Path) -> None:
    from benchmarks.compare import configs, write_checkpoint

    write_checkpoint(folder, configs(False)["medium"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes (default 3)")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per setting and round")
    ap.add_argument("--json", help="also write every round's figures to this file")
    ap.add_argument("--one-round", nargs=2, metavar=("CONFIG", "MODEL"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one_round:
        config, model = a.one_round
        print(json.dumps(one_round(config, None if model == "-" else model, a.reps)))
        return
    results = {}
    tmp = Path(tempfile.mkdtemp(prefix="maxdiff-pacing-"))
    try:
        for config in a.configs:
            model = "-"
            if config == "medium":
                model = str(tmp / "medium")
                _medium_checkpoint(Path(model))
            results[config] = []
            for r in range(a.rounds):
                p = subprocess.run([sys.executable, "-m", "benchmarks.step_pacing", "--reps",
                                    str(a.reps), "--one-round", config, model],
                                   capture_output=True, text=True, check=False)
                if p.returncode:
                    sys.exit(f"round {r} of {config} failed:\n{p.stderr[-3000:]}")
                got = json.loads(p.stdout.strip().splitlines()[-1])
                results[config].append(got)
                print(json.dumps({"config": config, "round": r, **got}), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    print()
    for config, rounds in results.items():
        for s in SETTINGS:
            def span(key, fmt, s=s, rounds=rounds):
                vals = [r[s][key] for r in rounds]
                return (fmt.format(min(vals)) if len(vals) == 1 or fmt.format(min(vals)) ==
                        fmt.format(max(vals)) else
                        f"{fmt.format(min(vals))}-{fmt.format(max(vals))}")
            print(f"{config:<7} {s:<12} {span('images_per_s', '{:.2f}')} images/s  "
                  f"x{span('vs_unpaced', '{:.3f}')} of unpaced  host "
                  f"{span('host_ms_per_tick', '{:.1f}')} ms/tick  wall "
                  f"{span('wall_ms_per_tick', '{:.1f}')} ms/tick  ({rounds[0][s]['ticks']} ticks)")


if __name__ == "__main__":
    main()
