"""``engine=step`` against ``engine=batch`` with the engines alternated in fresh processes, so
the machine's drift cannot pass for a difference between them: ``repeats`` rounds, each running
``benchmarks.loadgen --rates`` once per engine in its own process, the order swapped every
round (batch first, then step first, ...), every engine at the same Server rates and p99 bound.

    python -m benchmarks.loadgen_alternate --repeats 3 --workloads uniform \\
        --rates 17 19 21 23 --p99 5.406 --out docs/results/loadgen-2026-12-06

Each process writes ``round<k>-<engine>.json`` (and LoadGen's logs under ``logs/``); the
summary (``summary.json``, printed) gives per round and engine the capacity bracket among the
rates (the highest rate that held, the lowest above it that failed: ``benchmarks.loadgen``'s
verdict, :func:`benchmarks.loadgen_intervals.held`), and over the rounds the interval each
capacity and the step/batch ratio can lie in. Not a test: it wants an idle machine.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from benchmarks.loadgen_intervals import held

ENGINES = ("batch", "step")


def order(k: int) -> tuple[str, ...]:
    """The engines' order in round ``k`` (0-based): batch first in even rounds."""
    return ENGINES if k % 2 == 0 else ENGINES[::-1]


def bracket(at_rate: dict, bound: float) -> tuple[float, float]:
    """(highest rate that held, lowest rate above it that failed; inf when none did) of one
    engine's ``--rates`` runs (``{"17": run, ...}``)."""
    runs = sorted((float(q), r) for q, r in at_rate.items())
    ok = [q for q, r in runs if held(r, bound)]
    lo = max(ok) if ok else 0.0
    failed = [q for q, r in runs if not held(r, bound) and q > lo]
    return lo, min(failed) if failed else math.inf


def summarise(reports: dict[tuple[int, str], dict]) -> dict:
    """``{(round, engine): loadgen JSON}`` -> per workload: each round's brackets and ratio
    interval (step's held over batch's failed .. step's failed over batch's held), and over
    the rounds each engine's capacity interval (lowest held .. highest failed) and the ratio's
    (lowest lower end .. highest upper end)."""
    rounds = sorted({k for k, _ in reports})
    out: dict = {}
    for wl in reports[rounds[0], "batch"]["engines"]["batch"]:
        per = []
        for k in rounds:
            b = bracket(reports[k, "batch"]["engines"]["batch"][wl]["at_rate"],
                        reports[k, "batch"]["p99_bound_s"])
            s = bracket(reports[k, "step"]["engines"]["step"][wl]["at_rate"],
                        reports[k, "step"]["p99_bound_s"])
            ratio = (s[0] / b[1], s[1] / b[0] if b[0] else math.inf)
            per.append({"round": k + 1, "first": order(k)[0], "batch": b, "step": s,
                        "ratio": ratio})
        out[wl] = {
            "rounds": per,
            "batch": (min(r["batch"][0] for r in per), max(r["batch"][1] for r in per)),
            "step": (min(r["step"][0] for r in per), max(r["step"][1] for r in per)),
            "ratio": (min(r["ratio"][0] for r in per), max(r["ratio"][1] for r in per))}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", nargs="+", default=["uniform"])
    ap.add_argument("--rates", type=float, nargs="+", required=True)
    ap.add_argument("--p99", type=float, required=True, help="the Server p99 bound, seconds")
    ap.add_argument("--seconds", type=float, default=60.0, help="per LoadGen run")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    reports = {}
    for k in range(a.repeats):
        for engine in order(k):
            path = a.out / f"round{k + 1}-{engine}.json"
            cmd = [sys.executable, "-m", "benchmarks.loadgen", "--engines", engine,
                   "--workloads", *a.workloads, "--rates", *map(str, a.rates),
                   "--p99", str(a.p99), "--seconds", str(a.seconds), "--parts", "loadgen",
                   "--json", str(path), "--logs", str(a.out / "logs" / f"round{k + 1}")]
            print(f"round {k + 1}, {engine}: {' '.join(cmd[1:])}", flush=True)
            subprocess.run(cmd, check=True)
            reports[k, engine] = json.loads(path.read_text())
    summary = summarise(reports)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    for wl, s in summary.items():
        for r in s["rounds"]:
            print(f"{wl} round {r['round']} ({r['first']} first): batch {r['batch']}, "
                  f"step {r['step']}, ratio {r['ratio'][0]:.2f}-{r['ratio'][1]:.2f}")
        print(f"{wl}: batch {s['batch']}, step {s['step']}, ratio "
              f"{s['ratio'][0]:.2f}-{s['ratio'][1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
