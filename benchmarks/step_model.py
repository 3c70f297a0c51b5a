"""The step engine against the batch engine on a TPU chip, on paper: a discrete-event model.

    python -m benchmarks.step_model --report docs/results/tpu-2026-12-05/report.jsonl \\
        --out docs/results/tpu-2026-12-05/step_model.json

The cost of one UNet call on ``r`` rows comes from the TPU compiler's count for the compiled
UNet call of ``benchmarks/tpu_report.py`` (flops and HBM bytes at its row count), split into
the weights (read once a call: the UNet's bf16 parameter bytes) and a per-row part, and priced
on the chip's roofline: ``t(r) = max(r F / peak_flops, (W + r A) / bandwidth)``. A VAE decode
costs the whole program's remainder per image. At 512² the per-row flops and bytes are a
quarter of 1024²'s (attention's quadratic part ignored: it is small there). No host overhead,
no padding to mesh sizes: one chip, one replica.

Two engines, replayed with Poisson arrivals of LoadGen's workloads (``benchmarks/loadgen.py``:
``uniform`` every request 4 steps without CFG, ``mixed`` 4 / 8 / 30 steps each with and
without CFG):

- ``batch``: requests with the same (steps, CFG) are batched, up to ``--max-batch`` images,
  FIFO by the oldest waiting request; a batch of ``n`` runs ``steps`` calls on ``n`` (or
  ``2n`` with CFG) rows, then ``n`` decodes.
- ``step``: ``--slots`` slots; each tick runs one call on the active rows (plus a negative row
  per guided image), admits waiting requests into free slots, and decodes finished images.

Capacity: the highest arrival rate (bisected) whose p99 latency stays under ``--p99-factor``
times the longest request's time alone, and whose completions keep up with arrivals: LoadGen's
Server rule (``benchmarks/loadgen.py``). Model estimates, never measurements.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

MIXED = [(4, False), (30, True), (8, False), (4, True), (30, False), (8, True)]
UNET_PARAMS = 2_567_463_684  # SDXL's UNet (design notes)


@dataclass(frozen=True)
class Costs:
    """Seconds for one UNet call on ``rows`` rows and one VAE decode, on one chip."""

    flops_per_row: float
    weight_bytes: float
    bytes_per_row: float
    peak_flops: float
    bandwidth: float
    decode_s: float

    def call(self, rows: int) -> float:
        return max(rows * self.flops_per_row / self.peak_flops,
                   (self.weight_bytes + rows * self.bytes_per_row) / self.bandwidth)


def costs_from_report(row: dict, size: int, count: str = "all") -> Costs:
    """A tpu_report row (its compiled UNet call and whole program) -> :class:`Costs` at
    ``size`` (the report's size, or a quarter of the per-row work at half the side), priced
    with XLA's count of bytes (``count="all"``: every memory level) or with the bytes that
    touch HBM (``"hbm"``, rows that have it)."""
    peaks = {"v5e": (197e12, 819e9), "v6e": (918e12, 1640e9), "v5p": (459e12, 2765e9)}
    peak, bw = peaks[row["chip"]]
    rows = row["batch_per_chip"] * (2 if row["guidance"] > 1 else 1)
    u = row["unet_call"]
    pre = "hbm_" if count == "hbm" else ""
    weights = UNET_PARAMS * 2  # bf16
    f_row = u["tflop"] * 1e12 / rows
    b_row = (u[pre + "gbytes"] * 1e9 - weights) / rows
    # the whole program less its UNet calls, per image: the decode (and the text encoders)
    per_image_s = row[pre + "roofline_s"] / row["batch_per_chip"]
    unet_s = row["steps"] * Costs(f_row, weights, b_row, peak, bw, 0).call(rows) / \
        row["batch_per_chip"]
    decode = max(per_image_s - unet_s, 0.0)
    scale = (size / row["size"]) ** 2
    return Costs(f_row * scale, weights, b_row * scale, peak, bw, decode * scale)


def workload(name: str, n: int, rate: float, rng: random.Random) -> list[tuple[float, int, bool]]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        steps, cfg = (4, False) if name == "uniform" else MIXED[rng.randrange(len(MIXED))]
        out.append((t, steps, cfg))
    return out


def run_batch(reqs, c: Costs, max_batch: int) -> list[float]:
    """Latencies under the batch engine."""
    waiting: list[tuple[float, int, bool, int]] = []
    lat = [0.0] * len(reqs)
    now, i = 0.0, 0
    while i < len(reqs) or waiting:
        while i < len(reqs) and reqs[i][0] <= now:
            waiting.append((*reqs[i], i))
            i += 1
        if not waiting:
            now = reqs[i][0]
            continue
        _, steps, cfg, _ = waiting[0]  # the oldest request's shape
        batch = [w for w in waiting if (w[1], w[2]) == (steps, cfg)][:max_batch]
        for w in batch:
            waiting.remove(w)
        n = len(batch)
        now += steps * c.call(n * (2 if cfg else 1)) + n * c.decode_s
        for w in batch:
            lat[w[3]] = now - w[0]
    return lat


def run_step(reqs, c: Costs, slots: int) -> list[float]:
    """Latencies under the step engine."""
    queue: list[tuple[float, int, bool, int]] = []
    active: list[list] = []  # [remaining steps, cfg, index, arrival]
    lat = [0.0] * len(reqs)
    now, i = 0.0, 0
    while i < len(reqs) or queue or active:
        while i < len(reqs) and reqs[i][0] <= now:
            queue.append((*reqs[i], i))
            i += 1
        while queue and len(active) < slots:
            t0, steps, cfg, k = queue.pop(0)
            active.append([steps, cfg, k, t0])
        if not active:
            now = reqs[i][0]
            continue
        rows = len(active) + sum(1 for a in active if a[1])
        now += c.call(rows)
        for a in active:
            a[0] -= 1
        done = [a for a in active if a[0] == 0]
        now += len(done) * c.decode_s
        for a in done:
            lat[a[2]] = now - a[3]
            active.remove(a)
    return lat


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def holds(engine, name, rate, c, args, bound, seed) -> bool:
    rng = random.Random(seed)
    reqs = workload(name, args.queries, rate, rng)
    lat = engine(reqs, c, args.max_batch if engine is run_batch else args.slots)
    span = max(r[0] + x for r, x in zip(reqs, lat)) - reqs[0][0]
    kept_up = len(reqs) / span >= 0.95 * rate
    return p99(lat) <= bound and kept_up


def capacity(engine, name, c, args, bound, seed: int = 0) -> float:
    lo, hi = 0.01, 1.0
    while holds(engine, name, hi, c, args, bound, seed):
        lo, hi = hi, hi * 2
    for _ in range(args.bisect):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if holds(engine, name, mid, c, args, bound, seed) else (lo, mid)
    return lo


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", type=Path, required=True, help="tpu_report's report.jsonl")
    ap.add_argument("--topology", default="v5e:2x2")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 512])
    ap.add_argument("--workloads", nargs="+", default=["uniform", "mixed"])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--p99-factor", type=float, default=10.0)
    ap.add_argument("--bisect", type=int, default=12)
    ap.add_argument("--seeds", type=int, default=5,
                    help="arrival sequences per capacity (the result: their range)")
    ap.add_argument("--bytes", choices=("all", "hbm"), default="all",
                    help="price calls with XLA's count of bytes (all memory levels) or the "
                         "bytes that touch HBM")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = [json.loads(line) for line in args.report.read_text().splitlines() if line.strip()]
    base = [r for r in rows if r.get("unet_call") and r["topology"] == args.topology]
    if not base:
        print(f"{args.report}: no compiled UNet call for {args.topology}", file=sys.stderr)
        return 2
    row = base[0]
    results = []
    for size in args.sizes:
        c = costs_from_report(row, size, args.bytes)
        longest = 30 * c.call(2) + c.decode_s
        bound = args.p99_factor * longest
        for name in args.workloads:
            caps = {e: [capacity(f, name, c, args, bound, seed) for seed in range(args.seeds)]
                    for e, f in (("batch", run_batch), ("step", run_step))}
            ratios = sorted(s / b for s, b in zip(caps["step"], caps["batch"]))
            res = {"size": size, "workload": name, "chip": row["chip"], "bytes": args.bytes,
                   "call_1_row_s": c.call(1), "call_8_rows_s": c.call(8),
                   "decode_s": c.decode_s, "p99_bound_s": bound,
                   "capacity_batch": caps["batch"], "capacity_step": caps["step"],
                   "step_over_batch": ratios[len(ratios) // 2],
                   "step_over_batch_range": [ratios[0], ratios[-1]]}
            results.append(res)
            print(json.dumps(res), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"from": row, "args": {k: str(v) for k, v in
                                                              vars(args).items()},
                                        "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
