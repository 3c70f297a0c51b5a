"""bf16 against float32 on the CPU, per component and for the whole pipeline (issue #39).

    python -m benchmarks.precision --json precision.json --log precision.log   # medium, 8 a mode
    python -m benchmarks.precision --config tiny --n 2 --json smoke.json       # smoke run

The checkpoint is :mod:`benchmarks.compare`'s ``medium`` one (SDXL's UNet blocks at half width,
transformer depth 1/2/5, SDXL's real VAE config, two 2-layer CLIP encoders; diffusers'
initialisation from ``torch.manual_seed(0)``, written by
:func:`benchmarks.compare.write_checkpoint`; ``--checkpoint DIR`` keeps it there and reuses it),
at its size: 256x256, device batches of 2, 4 Euler steps with trailing timesteps, no CFG
(guidance 0). ``--n`` images (default 8): prompt ``i % 8`` of
:data:`benchmarks.quantization.PROMPTS`, seed ``1000 + i``; every mode draws the same noise
(float32, from the seed) in the same device batches.

The float32 pipeline is the reference. Modes, each one pipeline loaded with
``from_pretrained(dtype=...)``: ``text`` (both text encoders in bf16), ``unet``, ``vae`` (that
component alone in bf16, the others float32) and ``all`` (``dtype="bfloat16"``). Per image:
PSNR = 10 log10(1 / MSE) of the [0, 1] pixels (``output_type="np"``) against float32's;
reported per mode: mean, median, worst, best, the largest absolute difference.

Acceptance bar (fixed 2026-12-05, before the first measurement):
each single component in bf16: mean >= 45 dB, worst >= 40 dB; all bf16: mean >= 40 dB, worst >= 35 dB.

The JSON holds each mode's verdict; pass / FAIL is printed per mode, and the exit status is 1
when a mode misses the bar. The ``tiny`` config (random tiny weights, 32x32) is a smoke run of
the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from benchmarks import compare
from benchmarks import quantization as bq

STEPS = bq.STEPS  # Euler, trailing timesteps, no CFG
# mode -> from_pretrained's dtype
MODES = {
    "text": {"text_encoder": "bfloat16", "text_encoder_2": "bfloat16"},
    "unet": {"unet": "bfloat16"},
    "vae": {"vae": "bfloat16"},
    "all": "bfloat16",
}
SINGLE = ("text", "unet", "vae")
# Fixed before the first measurement (the module docstring's bar); mode -> bound in dB
THRESHOLDS = {
    "mean_db": {**dict.fromkeys(SINGLE, 45.0), "all": 40.0},
    "worst_db": {**dict.fromkeys(SINGLE, 40.0), "all": 35.0},
}


def verdicts(measured: dict) -> dict:
    """``{mode: {"mean_db": {"value", "bound", "pass"}, "worst_db": {...}, "pass"}}`` for each
    measured mode against :data:`THRESHOLDS`."""
    out = {}
    for mode, r in measured.items():
        v = {key: {"value": round(r[key], 2), "bound": bound[mode],
                   "pass": bool(r[key] >= bound[mode])} for key, bound in THRESHOLDS.items()}
        v["pass"] = all(x["pass"] for x in v.values())
        out[mode] = v
    return out


class Log:
    """Lines printed and appended to a file (``--log``) as they come."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        if self.path:
            self.path.write_text("")

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        if self.path:
            with self.path.open("a") as f:
                f.write(line + "\n")


def measure(path: Path, spec: dict, n: int, modes, say) -> dict:
    """float32's images, then each mode's against them (one pipeline loaded at a time)."""
    t = time.perf_counter()
    ref = bq.images(bq.load(path), n, spec["size"], spec["batch"])
    say(f"# float32: {n} images in {time.perf_counter() - t:.0f} s")
    out = {}
    for mode in modes:
        t = time.perf_counter()
        pipe = bq.load(path, dtype=MODES[mode])
        got = bq.images(pipe, n, spec["size"], spec["batch"])
        del pipe
        out[mode] = s = bq.psnr_summary(got, ref)
        s["dtype"] = MODES[mode]
        s["seconds"] = round(time.perf_counter() - t, 1)
        say(f"# {mode} in bf16: PSNR mean {s['mean_db']:.2f} dB, median {s['median_db']:.2f}, "
            f"worst {s['worst_db']:.2f}, max abs {s['max_abs_diff']:.4f} ({s['seconds']} s)")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=["medium", "tiny"], default="medium",
                    help="benchmarks.compare's checkpoint (tiny: smoke runs)")
    ap.add_argument("--checkpoint", metavar="DIR",
                    help="where the checkpoint is (reused) or is written (kept)")
    ap.add_argument("--n", type=int, default=8, help="images per mode (default 8)")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--log", help="also write the printed lines here")
    a = ap.parse_args(argv)
    if a.n < 1:
        ap.error("--n must be >= 1")
    if a.threads:
        compare.pin_threads(a.threads)  # before jax is imported

    import jax

    say = Log(a.log)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "command": "python -m benchmarks.precision "
              + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": bq.machine(), "versions": {"jax": jax.__version__},
              "backend": jax.default_backend(), "config": a.config, "steps": STEPS,
              "n": a.n, "thresholds": THRESHOLDS}
    say(f"# {result['command']}")
    path, spec, remove = bq.checkpoint(a.config, a.checkpoint)
    result.update(size=spec["size"], batch=spec["batch"])
    try:
        result["modes"] = measure(path, spec, a.n, a.modes, say)
    finally:
        if remove:
            shutil.rmtree(path, ignore_errors=True)
    result["verdicts"] = verdicts(result["modes"])
    result["pass"] = ok = all(v["pass"] for v in result["verdicts"].values())
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1, default=lambda o: o.item()))
    for mode, v in result["verdicts"].items():
        say(f"{mode:<5} mean {v['mean_db']['value']:>7} dB (bar {v['mean_db']['bound']:g}), "
            f"worst {v['worst_db']['value']:>7} dB (bar {v['worst_db']['bound']:g}): "
            f"{'pass' if v['pass'] else 'FAIL'}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
