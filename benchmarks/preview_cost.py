"""What previews cost a step-engine request, side by side in one process: a 4-step image with no
previews, with 3 previews decoded by the VAE, and with 3 drawn by the tiny autoencoder.

    python -m benchmarks.preview_cost                      # 3 fresh processes
    python -m benchmarks.preview_cost --rounds 1 --reps 3 --json out.json

The workload is the service's ``partial_images=3`` on ``engine=step``: one image of 4 steps at
256x256 on compare.py's medium checkpoint (SDXL's UNet blocks at half width, the real SDXL VAE),
Euler with trailing timesteps, no CFG, previews after steps 1, 2 and 3. The tiny decoder has
TAESDXL's shapes (diffusers' ``AutoencoderTiny()`` defaults) with random weights. Each round
runs in a fresh process; the three settings alternate (the order rotates every repetition),
``--reps`` times after one warm-up run each. Per setting: the median seconds per image and its
ratio to the run without previews; the summary gives each ratio's range over the rounds.
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

SETTINGS = ("none", "vae", "taesd")
SIZE, STEPS, PREVIEWS = 256, 4, (1, 2, 3)


def one_round(model: str, taesd: str, reps: int, size: int = SIZE) -> dict:
    """One process: the three settings alternated ``reps`` times."""
    from pipelines import TextToImagePipeline
    from pipelines.requests import ImageRequest
    from pipelines.step_engine import StepEngine

    pipe = TextToImagePipeline.from_pretrained(
        model, compile_cache_dir=None,
        scheduler={"_class_name": "EulerDiscreteScheduler", "timestep_spacing": "trailing"})
    eng = StepEngine(pipe, size, size, slots=1, output_type="np")
    eng.warmup()
    pipe.load_preview_decoder(taesd)
    tiny = pipe.preview_decoder  # set and unset below (a new load would compile again)

    def run(setting: str, k: int) -> float:
        pipe.preview_decoder = tiny if setting == "taesd" else None
        t0 = time.perf_counter()
        h = eng.submit(ImageRequest("a red circle", seed=k, guidance_scale=0.0), STEPS,
                       previews=() if setting == "none" else PREVIEWS)
        eng.run_until_idle()
        assert h.status == "done"
        return time.perf_counter() - t0

    for s in SETTINGS:  # warm-up (compiles the preview programs)
        run(s, 0)
    times = {s: [] for s in SETTINGS}
    for r in range(reps):
        for s in SETTINGS[r % 3:] + SETTINGS[:r % 3]:
            times[s].append(run(s, r + 1))
    med = {s: statistics.median(v) for s, v in times.items()}
    return {s: dict(s_per_image=med[s], vs_none=med[s] / med["none"]) for s in SETTINGS}


def _checkpoints(folder: Path) -> tuple[Path, Path]:
    import torch
    from diffusers import AutoencoderTiny

    from benchmarks.compare import configs, write_checkpoint

    write_checkpoint(folder / "medium", configs(False)["medium"])
    torch.manual_seed(0)
    AutoencoderTiny().save_pretrained(folder / "taesdxl")
    return folder / "medium", folder / "taesdxl"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per setting per round")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "TAESD"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(one_round(*a.child, a.reps)))
        return
    work = Path(tempfile.mkdtemp(prefix="maxdiff-previews-"))
    try:
        model, taesd = _checkpoints(work)
        rounds = []
        for k in range(a.rounds):
            out = subprocess.run([sys.executable, "-m", "benchmarks.preview_cost", "--child",
                                  str(model), str(taesd), "--reps", str(a.reps)],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rounds.append(r)
            print(f"round {k + 1}: " + ", ".join(
                f"{s} {r[s]['s_per_image']:.2f} s ({r[s]['vs_none']:.3f}x)" for s in SETTINGS),
                flush=True)
        for s in SETTINGS[1:]:
            v = sorted(r[s]["vs_none"] for r in rounds)
            print(f"3 previews by {s}: {v[0]:.3f}-{statistics.median(v):.3f}-{v[-1]:.3f}x the "
                  f"time of an image without previews (min-median-max of {len(v)} rounds)")
        if a.json:
            Path(a.json).write_text(json.dumps({"size": SIZE, "steps": STEPS,
                                                "previews": PREVIEWS, "reps": a.reps,
                                                "rounds": rounds}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
