"""Attention kernels on this machine, side by side with torch's scaled_dot_product_attention.

    python benchmarks/attention.py [--threads 2]

Prints GFLOP/s per kernel and each kernel's time as a ratio of torch's, measured in one run
(the kernels alternating, medians of ``--reps``), for the UNet's self-attention shapes at 512²
(1,024 tokens) and 1024² (4,096 tokens) and its cross-attention to 77 text tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxdiff.models.attention import attention


def side_by_side(fns: dict, reps: int = 5) -> dict:
    """Median seconds of each callable: one warm-up call each, then ``reps`` rounds in which
    every callable runs once, the order rotating by one each round."""
    names = list(fns)
    for name in names:
        fns[name]()
    times = {name: [] for name in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--heads", type=int, default=10)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--cross", type=int, nargs="*", default=[4096, 1024],
                    help="query lengths of cross-attention rows (77 text keys)")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds (medians)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    for L, keys, heads in [(L, L, args.heads) for L in args.tokens] + [
            (L, 77, args.heads) for L in args.cross]:
        rng = np.random.default_rng(0)
        q = rng.standard_normal((1, L, heads, args.dim)).astype(np.float32)
        k, v = (rng.standard_normal((1, keys, heads, args.dim)).astype(np.float32)
                for _ in range(2))
        flops = 4 * L * keys * heads * args.dim
        tq, tk, tv = (torch.from_numpy(x).permute(0, 2, 1, 3).contiguous() for x in (q, k, v))
        fns = {"torch sdpa": lambda tq=tq, tk=tk, tv=tv:
               torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)}
        jq, jk, jv = (jnp.asarray(x) for x in (q, k, v))
        for name, kw in [("xla", {}), ("dot_product", {}), ("chunked 256", {"chunk_size": 256}),
                         ("chunked 512", {"chunk_size": 512}),
                         ("chunked 1024", {"chunk_size": 1024})]:
            kern = name.split()[0]
            f = jax.jit(lambda a, b, c, kern=kern, kw=kw: attention(a, b, c, kern, **kw))
            fns[name] = lambda f=f, a=(jq, jk, jv): f(*a).block_until_ready()
        med = side_by_side(fns, args.reps)
        t_torch = med["torch sdpa"]
        kind = "self" if keys == L else "cross"
        print(f"\n{kind}-attention {L} x {keys}, {heads} heads x {args.dim} (medians of "
              f"{args.reps}, alternating):")
        for name, t in med.items():
            print(f"  {name:14s} {t * 1e3:8.1f} ms  {flops / t / 1e9:6.1f} GFLOP/s  "
                  f"time/torch {t / t_torch:5.2f}")


if __name__ == "__main__":
    main()
