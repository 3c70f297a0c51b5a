"""Can XLA:CPU use this CPU's bf16 dot instructions? A 2048³ matmul and two 3x3 convolutions (the
VAE decoder's 512 channels at 64², the tiny decoder's 64 channels at 256²; batch 1, NHWC,
XLA's own ``conv_general_dilated``) in float32 and bfloat16 under each of XLA:CPU's library
paths (oneDNN, XNNPACK, YNNPACK; for dots and for convolutions), one fresh process per flag set
(XLA reads ``XLA_FLAGS`` once, at start).

    python -m benchmarks.cpu_bf16_flags --json flags.json
    python -m benchmarks.cpu_bf16_flags --repeats 3 --json flags.json   # ranges over 3 rounds

Per flag set and operation: the median GFLOP/s of 7 calls of each dtype after a warm-up (the
convolutions' two dtypes alternating, 9 calls each; their FLOPs counted directly: 2 x 9 x in x
out per output pixel), and their ratio (bf16 / fp32; above 1, bf16 is faster); and whether the
convolutions' outputs differ from the run without flags (a flag that changes nothing computes
bit for bit the same). The flags are the ones jaxlib's XLA accepts that route dots or
convolutions to a library (``strings libjax_common.so | grep xla_cpu``); an unknown flag or
value stops the process, and the row says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
    "--xla_cpu_experimental_onednn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION",
    "--xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION",
    "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION",
]
CONVS = {"conv512@64": (64, 512), "conv64@256": (256, 64)}  # name -> (side, channels)


def conv_rates(side: int, ch: int, reps: int = 9) -> dict:
    """GFLOP/s of a 3x3 convolution (stride 1, padding 1) of a (1, side, side, ch) input to ch
    channels in float32 and in bfloat16, the two timed alternately (medians of ``reps``), and
    the sum of each one's output as float32 (a fingerprint of the kernel that ran)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.compare import side_by_side

    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((1, side, side, ch), np.float32)
    k0 = rng.standard_normal((3, 3, ch, ch), np.float32) * 0.05
    f = jax.jit(lambda x, k: jax.lax.conv_general_dilated(
        x, k, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC")))
    args = {d: (jnp.asarray(x0, d), jnp.asarray(k0, d)) for d in ("float32", "bfloat16")}
    out = {f"{d}_sum": float(jnp.sum(f(*a).astype(jnp.float32))) for d, a in args.items()}
    meds, _ = side_by_side([lambda a=a: f(*a).block_until_ready() for a in args.values()], reps)
    work = 2 * 9 * ch * ch * side * side
    out.update({d: work / m / 1e9 for d, m in zip(args, meds)})
    return out


def cpu_vector_flags() -> list[str]:
    """The CPU's AVX-512 / AMX / VNNI / bf16 flags from /proc/cpuinfo (empty where none, or
    where the file is not there): without ``avx512_bf16`` or ``amx_bf16`` the chip has no bf16
    arithmetic, and bf16 against float32 says nothing about XLA:CPU's use of it."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return []
    return sorted(w for w in line.split()[2:]
                  if w.startswith(("avx512", "amx")) or "vnni" in w or "bf16" in w)


def child() -> dict:
    from benchmarks.compare import matmul_peak

    out = {"cpu_flags": cpu_vector_flags()}
    out.update({name: matmul_peak(name, reps=7) for name in ("float32", "bfloat16")})
    out["bf16_over_fp32"] = out["bfloat16"] / out["float32"]
    for conv, (side, ch) in CONVS.items():
        out.update({f"{conv}_{k}": v for k, v in conv_rates(side, ch).items()})
        out[f"{conv}_bf16_over_fp32"] = out[f"{conv}_bfloat16"] / out[f"{conv}_float32"]
    return out


RATIOS = ("bf16_over_fp32", *(f"{c}_bf16_over_fp32" for c in CONVS))


def one_row(flags: str, default: dict | None) -> dict:
    """One fresh process under ``flags``; ``default``: the row without flags of the same round
    (to tell whether a flag changed the convolutions' kernel)."""
    env = {**os.environ, "XLA_FLAGS": flags}
    p = subprocess.run([sys.executable, "-m", "benchmarks.cpu_bf16_flags", "--child"],
                       capture_output=True, text=True, env=env)
    row = {"flags": flags or "(none)"}
    if p.returncode:
        row["error"] = (p.stderr.strip().splitlines() or ["?"])[-1][:200]
        print(f"{row['flags']}: failed: {row['error']}", flush=True)
        return row
    row.update(json.loads(p.stdout.strip().splitlines()[-1]))
    if default is not None and "error" not in default:
        for conv in CONVS:
            row[f"{conv}_same_as_default"] = all(
                row[f"{conv}_{d}_sum"] == default[f"{conv}_{d}_sum"]
                for d in ("float32", "bfloat16"))
    convs = "; ".join(
        f"{c} {row[f'{c}_float32']:.0f} / {row[f'{c}_bfloat16']:.0f} "
        f"({row[f'{c}_bf16_over_fp32']:.2f})"
        + ("" if row.get(f"{c}_same_as_default", True) else ", other kernel")
        for c in CONVS)
    print(f"{row['flags']}: matmul float32 {row['float32']:.0f} GFLOP/s, bfloat16 "
          f"{row['bfloat16']:.0f} GFLOP/s, bf16 / fp32 {row['bf16_over_fp32']:.2f}; "
          f"fp32 / bf16 GFLOP/s: {convs}", flush=True)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds over every flag set (fresh processes); ranges when above 1")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child()))
        return
    vec = cpu_vector_flags()
    print(f"# CPU vector flags: {' '.join(vec) or 'none of AVX-512, AMX, VNNI, bf16'}"
          + ("" if {"avx512_bf16", "amx_bf16"} & set(vec) else
             " (no bf16 arithmetic on this CPU: bf16 / fp32 says nothing about its use)"),
          flush=True)
    rows = []
    for rnd in range(a.repeats):
        if a.repeats > 1:
            print(f"# round {rnd + 1}", flush=True)
        default = None
        for flags in FLAG_SETS:
            row = dict(one_row(flags, default), round=rnd + 1)
            default = default or row  # the round's first row: the run without flags
            rows.append(row)
    if a.repeats > 1:
        print("# bf16 / fp32, min-median-max over the rounds: matmul; " + "; ".join(CONVS))
        for flags in FLAG_SETS:
            ok = [r for r in rows if r["flags"] == (flags or "(none)") and "error" not in r]
            if ok:
                spans = [sorted(r[k] for r in ok) for k in RATIOS]
                print(f"{flags or '(none)'}: " + "; ".join(
                    f"{v[0]:.2f}-{statistics.median(v):.2f}-{v[-1]:.2f}" for v in spans),
                    flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
