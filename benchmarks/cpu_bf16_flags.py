"""Can XLA:CPU use this CPU's bf16 dot instructions? A 2048³ matmul in float32 and bfloat16
under each of XLA:CPU's library paths (oneDNN, XNNPACK, YNNPACK), one fresh process per flag
set (XLA reads ``XLA_FLAGS`` once, at start).

    python -m benchmarks.cpu_bf16_flags --json flags.json

Per flag set: the median GFLOP/s of 7 calls of each dtype after a warm-up, and their ratio
(bf16 / fp32; above 1, bf16 is faster). The flags are the ones jaxlib's XLA accepts that route
dots to a library (``strings libjax_common.so | grep xla_cpu``); an unknown flag or value
stops the process, and the row says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

FLAG_SETS = [
    "",
    "--xla_cpu_use_onednn=true",
    "--xla_cpu_experimental_onednn_custom_call=true",
    "--xla_cpu_experimental_onednn_fusion_type=LIBRARY_FUSION_TYPE_DOT",
    "--xla_cpu_use_xnnpack=true",
    "--xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_DOT",
    "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT",
]


def child() -> dict:
    from benchmarks.compare import matmul_peak

    out = {name: matmul_peak(name, reps=7) for name in ("float32", "bfloat16")}
    out["bf16_over_fp32"] = out["bfloat16"] / out["float32"]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child()))
        return
    rows = []
    for flags in FLAG_SETS:
        env = {**os.environ, "XLA_FLAGS": flags}
        p = subprocess.run([sys.executable, "-m", "benchmarks.cpu_bf16_flags", "--child"],
                           capture_output=True, text=True, env=env)
        row = {"flags": flags or "(none)"}
        if p.returncode:
            row["error"] = (p.stderr.strip().splitlines() or ["?"])[-1][:200]
            print(f"{row['flags']}: failed: {row['error']}", flush=True)
        else:
            row.update(json.loads(p.stdout.strip().splitlines()[-1]))
            print(f"{row['flags']}: float32 {row['float32']:.0f} GFLOP/s, bfloat16 "
                  f"{row['bfloat16']:.0f} GFLOP/s, bf16 / fp32 {row['bf16_over_fp32']:.2f}",
                  flush=True)
        rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
