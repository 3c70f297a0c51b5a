"""What a ``benchmarks.loadgen`` run's JSON says about ``engine=step`` against ``engine=batch``,
as intervals: each engine's Server capacity is a bracket (the highest rate that held, the
lowest that failed), so the ratio of two capacities lies between the step engine's held rate
over the batch engine's failed one and the step engine's failed rate over the batch engine's
held one. Also the Offline throughputs (every run, not the best alone) and the latencies at
equal load.

    python -m benchmarks.loadgen_intervals docs/results/loadgen-2026-12-03/loadgen.json

A run *holds* as ``benchmarks.loadgen`` decides: no errors, the service kept up, the p99 under
the bound. A search whose highest run held has no upper bracket: its capacity is "at least".
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def held(run: dict, bound: float) -> bool:
    return bool(run.get("kept_up")) and run.get("errors", 0) == 0 and run["p99_s"] <= bound


def bracket(runs: list[dict], bound: float) -> tuple[float, float]:
    """(highest rate that held, lowest rate that failed above it; inf when none did)."""
    ok = [r["target_qps"] for r in runs if held(r, bound)]
    lo = max(ok) if ok else 0.0
    failed = [r["target_qps"] for r in runs if not held(r, bound) and r["target_qps"] > lo]
    return lo, min(failed) if failed else math.inf


def summary(report: dict) -> dict:
    """Per workload: each engine's capacity bracket, Offline runs and equal-load latencies,
    and the step/batch ratios (capacity as an interval, Offline as the range over runs)."""
    bound = report["p99_bound_s"]
    out = {}
    for workload, first in report["engines"]["batch"].items():
        if not isinstance(first, dict) or "server_runs" not in first:
            continue  # the service-overhead figures, not a workload
        per = {}
        for engine, runs in report["engines"].items():
            w = runs[workload]
            eq = w.get("equal_load") or {}
            per[engine] = {"capacity": bracket(w["server_runs"], bound),
                           "offline": [w[k]["samples_per_s"] for k in ("offline", "offline_after")
                                       if w.get(k)],
                           "equal_load": {"qps": eq.get("target_qps"), "p50_s": eq.get("p50_s"),
                                          "p99_s": eq.get("p99_s")}}
        b, s = per["batch"], per["step"]
        out[workload] = {
            **per,
            "capacity_ratio": (s["capacity"][0] / b["capacity"][1],
                               s["capacity"][1] / b["capacity"][0]),
            "offline_ratio": (min(s["offline"]) / max(b["offline"]),
                              max(s["offline"]) / min(b["offline"])),
            "p50_ratio": s["equal_load"]["p50_s"] / b["equal_load"]["p50_s"],
            "p99_ratio": s["equal_load"]["p99_s"] / b["equal_load"]["p99_s"]}
    return out


def table(summary_: dict) -> str:
    """The figures as a Markdown table (what docs/benchmarks.md publishes)."""
    rows = ["| workload | Server capacity, step / batch | Offline, step / batch (any "
            "two runs) | equal load: p50, p99 step / batch |", "| --- | --- | --- | --- |"]
    for workload, s in summary_.items():
        lo, hi = s["capacity_ratio"]
        o_lo, o_hi = s["offline_ratio"]
        rows.append(f"| {workload} | {lo:.2f}–{hi:.2f}× | {o_lo:.2f}–{o_hi:.2f}× | "
                    f"{s['p50_ratio']:.2f}×, {s['p99_ratio']:.2f}× |")
    return "\n".join(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", type=Path, help="a benchmarks.loadgen --json file")
    ap.add_argument("--json", type=Path, help="also write the summary here")
    args = ap.parse_args(argv)
    s = summary(json.loads(args.report.read_text()))
    print(table(s))
    if args.json:
        args.json.write_text(json.dumps(s, indent=1, default=str))


if __name__ == "__main__":
    main()
