"""``engine=step`` against ``engine=batch`` with the engines alternated in fresh processes, so
the machine's drift cannot pass for a difference between them: ``repeats`` rounds, each running
``benchmarks.loadgen --rates`` once per engine in its own process, the order swapped every
round (batch first, then step first, ...), every engine at the same p99 bound and the same
Server rates (``--rates``), plus rates of its own (``--batch-rates`` / ``--step-rates``: where
one engine's capacity lies above the other's, so each bracket closes without running the
slower engine far past its capacity).

    python -m benchmarks.loadgen_alternate --repeats 3 --workloads uniform \\
        --rates 15 17 19 --batch-rates 21 --step-rates 23 26 29 32 35 --p99 5.406 \\
        --out docs/results/loadgen-2026-12-06

Each process writes ``round<k>-<engine>.json`` (and LoadGen's logs under ``logs/``); the
summary (``summary.json``, printed) gives per round and engine the capacity bracket among the
rates (the highest rate that held, the lowest above it that failed: ``benchmarks.loadgen``'s
verdict, :func:`benchmarks.loadgen_intervals.held`), and over the rounds the interval each
capacity and the step/batch ratio can lie in; and the latencies at equal load: in each round,
at the highest rate both engines held, step's p50 and p99 over batch's (their range over the
rounds), and the same ratios at every rate both held in every round. ``--summarise DIR``
recomputes it from a finished run's JSON. Not a test: it wants an idle machine.
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
                        "ratio": ratio, **equal_load(reports, k, wl)})
        loads = [r for r in per if r["equal_rate"] is not None]
        out[wl] = {
            "by_rate": by_rate(reports, rounds, wl),
            "rounds": per,
            "batch": (min(r["batch"][0] for r in per), max(r["batch"][1] for r in per)),
            "step": (min(r["step"][0] for r in per), max(r["step"][1] for r in per)),
            "ratio": (min(r["ratio"][0] for r in per), max(r["ratio"][1] for r in per)),
            **{f"{q}_ratio": (min(r[f"{q}_ratio"] for r in loads),
                              max(r[f"{q}_ratio"] for r in loads)) if loads else None
               for q in ("p50", "p99")}}
    return out


def by_rate(reports: dict, rounds: list[int], wl: str) -> dict:
    """At every rate both engines held in every round: the range over the rounds of step's p50
    and p99 over batch's (``{"15": {"p50_ratio": (lo, hi), "p99_ratio": (lo, hi)}}``)."""
    out = {}
    common = set.intersection(*({q for q, r in reports[k, e]["engines"][e][wl]["at_rate"].items()
                                 if held(r, reports[k, e]["p99_bound_s"])}
                                for k in rounds for e in ENGINES))
    for q in sorted(common, key=float):
        ratios = {f"{p}_ratio": [reports[k, "step"]["engines"]["step"][wl]["at_rate"][q][f"{p}_s"]
                                 / reports[k, "batch"]["engines"]["batch"][wl]["at_rate"][q][
                                     f"{p}_s"] for k in rounds] for p in ("p50", "p99")}
        out[q] = {name: (min(v), max(v)) for name, v in ratios.items()}
    return out


def equal_load(reports: dict, k: int, wl: str) -> dict:
    """Round ``k``'s latencies at equal load: at the highest rate both engines held, step's
    p50 and p99 over batch's (None where no rate held for both)."""
    runs = {e: reports[k, e]["engines"][e][wl]["at_rate"] for e in ENGINES}
    bound = reports[k, "batch"]["p99_bound_s"]
    both = [q for q in runs["batch"] if q in runs["step"]
            and all(held(runs[e][q], bound) for e in ENGINES)]
    if not both:
        return {"equal_rate": None, "p50_ratio": None, "p99_ratio": None}
    q = max(both, key=float)
    b, s = runs["batch"][q], runs["step"][q]
    return {"equal_rate": float(q), "p50_ratio": s["p50_s"] / b["p50_s"],
            "p99_ratio": s["p99_s"] / b["p99_s"]}


def table(summary: dict) -> str:
    """The summary as a Markdown table (what the pages publish): per workload each engine's
    capacity interval over the rounds, the ratio's, and the equal-load latency ratios' ranges
    (min-max over the rounds)."""
    def span(lo, hi, unit="×", fmt=".2f"):
        return f"{lo:{fmt}}–{hi:{fmt}}{unit}" if hi != math.inf else f"≥ {lo:{fmt}}{unit}"

    rows = ["| workload | batch capacity (req/s) | step capacity (req/s) | step / batch "
            "capacity | equal load: step / batch p50, p99 |", "| --- | --- | --- | --- | --- |"]
    for wl, s in summary.items():
        lat = "—" if s["p50_ratio"] is None else (
            f"{span(*s['p50_ratio'])}, {span(*s['p99_ratio'])}")
        rows.append(f"| {wl} | {span(*s['batch'], '', 'g')} | {span(*s['step'], '', 'g')} | "
                    f"{span(*s['ratio'])} | {lat} |")
    return "\n".join(rows)


def read_run(out: Path) -> dict[tuple[int, str], dict]:
    """A finished run's ``round<k>-<engine>.json`` files, as :func:`summarise` takes them."""
    reports = {}
    for path in sorted(out.glob("round*-*.json")):
        k, engine = path.stem.removeprefix("round").split("-")
        reports[int(k) - 1, engine] = json.loads(path.read_text())
    return reports


def report(summary: dict) -> str:
    lines = []
    for wl, s in summary.items():
        for r in s["rounds"]:
            eq = "" if r["equal_rate"] is None else (
                f"; at {r['equal_rate']:g}/s p50 {r['p50_ratio']:.2f}x, p99 {r['p99_ratio']:.2f}x")
            lines.append(f"{wl} round {r['round']} ({r['first']} first): batch {r['batch']}, "
                         f"step {r['step']}, ratio {r['ratio'][0]:.2f}-{r['ratio'][1]:.2f}{eq}")
        for q, r in s["by_rate"].items():
            lines.append(f"{wl} at {q}/s, held by both in every round: step / batch p50 "
                         f"{r['p50_ratio'][0]:.2f}-{r['p50_ratio'][1]:.2f}x, p99 "
                         f"{r['p99_ratio'][0]:.2f}-{r['p99_ratio'][1]:.2f}x")
    return "\n".join(lines + ["", table(summary)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--first-round", type=int, default=1,
                    help="resume a run in --out at this round (the earlier rounds' JSON kept)")
    ap.add_argument("--workloads", nargs="+", default=["uniform"])
    ap.add_argument("--rates", type=float, nargs="+", help="Server rates (req/s) for both")
    for engine in ENGINES:
        ap.add_argument(f"--{engine}-rates", type=float, nargs="+", default=[],
                        help=f"more rates for engine={engine} alone")
    ap.add_argument("--p99", type=float, help="the Server p99 bound, seconds")
    ap.add_argument("--seconds", type=float, default=60.0, help="per LoadGen run")
    ap.add_argument("--out", type=Path, help="where each round's JSON and the summary go")
    ap.add_argument("--summarise", type=Path, metavar="DIR",
                    help="recompute the summary of a finished run in DIR (its summary.json) "
                         "and print it")
    a = ap.parse_args(argv)
    if a.summarise is not None:
        summary = summarise(read_run(a.summarise))
        (a.summarise / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(report(summary))
        return 0
    if a.out is None or a.rates is None or a.p99 is None:
        ap.error("--out, --rates and --p99 are required unless --summarise")
    a.out.mkdir(parents=True, exist_ok=True)
    reports = {key: r for key, r in read_run(a.out).items() if key[0] < a.first_round - 1}
    for k in range(a.first_round - 1, a.repeats):
        for engine in order(k):
            path = a.out / f"round{k + 1}-{engine}.json"
            cmd = [sys.executable, "-m", "benchmarks.loadgen", "--engines", engine,
                   "--workloads", *a.workloads, "--rates",
                   *map(str, sorted({*a.rates, *getattr(a, f"{engine}_rates")})),
                   "--p99", str(a.p99), "--seconds", str(a.seconds), "--parts", "loadgen",
                   "--json", str(path), "--logs", str(a.out / "logs" / f"round{k + 1}")]
            print(f"round {k + 1}, {engine}: {' '.join(cmd[1:])}", flush=True)
            subprocess.run(cmd, check=True)
            reports[k, engine] = json.loads(path.read_text())
    summary = summarise(reports)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(report(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
