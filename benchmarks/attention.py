"""Attention kernels on this machine, side by side with torch's scaled_dot_product_attention.

    python benchmarks/attention.py [--threads 2]

Prints GFLOP/s per kernel and each kernel's time as a ratio of torch's, measured in one run,
for the UNet's self-attention shapes at 512² (1,024 tokens) and 1024² (4,096 tokens).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxdiff.models.attention import attention


def best_of(fn, reps=3):
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--heads", type=int, default=10)
    ap.add_argument("--dim", type=int, default=64)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    for L in args.tokens:
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, L, args.heads, args.dim)).astype(np.float32) for _ in range(3))
        flops = 4 * L * L * args.heads * args.dim
        tq, tk, tv = (torch.from_numpy(x).permute(0, 2, 1, 3).contiguous() for x in (q, k, v))
        t_torch = best_of(
            lambda tq=tq, tk=tk, tv=tv: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv))
        rows = [("torch sdpa", t_torch)]
        jq, jk, jv = (jnp.asarray(x) for x in (q, k, v))
        for name, kw in [("xla", {}), ("dot_product", {}), ("chunked 256", {"chunk_size": 256}),
                         ("chunked 512", {"chunk_size": 512}), ("chunked 1024", {"chunk_size": 1024})]:
            kern = name.split()[0]
            f = jax.jit(lambda a, b, c, kern=kern, kw=kw: attention(a, b, c, kern, **kw))
            rows.append((name, best_of(lambda f=f, a=(jq, jk, jv): f(*a).block_until_ready())))
        print(f"\n{L} tokens, {args.heads} heads x {args.dim}:")
        for name, t in rows:
            print(f"  {name:14s} {t * 1e3:8.1f} ms  {flops / t / 1e9:6.1f} GFLOP/s  "
                  f"time/torch {t / t_torch:5.2f}")


if __name__ == "__main__":
    main()
