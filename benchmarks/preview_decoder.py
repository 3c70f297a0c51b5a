"""What a preview costs: the SDXL VAE decoder against the tiny autoencoder's (TAESDXL,
:mod:`maxdiff.models.taesd`) on the same latents, side by side.

    python -m benchmarks.preview_decoder                       # 512², 3 fresh processes
    python -m benchmarks.preview_decoder --size 256 --repeats 3 --calls 7 --json out.json

Both decoders have their real shapes (the SDXL VAE config; TAESDXL's 64-channel (3, 3, 3, 1)
blocks) with random weights (the time does not depend on the values; nothing is downloaded),
float32, one image, compiled once before timing. Each process times the two sides alternately,
``--calls`` calls each, and reports the medians; ``--repeats`` fresh processes give the range of
the ratio VAE time / TAESD time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from benchmarks.vae_memory import SDXL_VAE


def _random(shapes, seed: int):
    import jax
    import numpy as np

    rng = np.random.default_rng(seed)
    leaves, tree = jax.tree.flatten(shapes)
    out = []
    for leaf in leaves:
        fan_in = int(np.prod(leaf.shape[:-1])) or 1
        out.append(jax.numpy.asarray(
            rng.standard_normal(leaf.shape).astype(np.float32) / fan_in ** 0.5))
    return jax.tree.unflatten(tree, out)


def one_process(size: int, calls: int) -> dict:
    """Medians of ``calls`` alternating decodes of each side in this process (seconds)."""
    import jax
    import numpy as np

    from maxdiff import checkpoint
    from maxdiff.models.taesd import TinyAutoencoderConfig, TinyDecoder
    from maxdiff.models.vae import AutoencoderKL, AutoencoderKLConfig, param_shapes

    vae = AutoencoderKL(AutoencoderKLConfig.from_dict(SDXL_VAE))
    vae_params = _random(param_shapes(vae), 0)
    tiny = TinyDecoder(TinyAutoencoderConfig(scaling_factor=1.0))
    z = np.random.default_rng(1).standard_normal((1, size // 8, size // 8, 4)).astype(np.float32)
    tiny_params = _random(checkpoint.init_shapes(tiny, jax.ShapeDtypeStruct(z.shape, z.dtype)),
                          2)
    sides = {
        "vae": (jax.jit(lambda p, x: vae.apply({"params": p}, x,
                                               method=vae.latents_to_image)), vae_params),
        "taesd": (jax.jit(lambda p, x: tiny.apply({"params": p}, x)), tiny_params),
    }
    for fn, p in sides.values():  # compile
        jax.block_until_ready(fn(p, z))
    times = {k: [] for k in sides}
    for _ in range(calls):
        for k, (fn, p) in sides.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(p, z))
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=512, help="image side in pixels (default 512)")
    ap.add_argument("--calls", type=int, default=5, help="timed calls per side per process")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(one_process(args.size, args.calls)))
        return 0
    runs = []
    for k in range(args.repeats):
        out = subprocess.run([sys.executable, "-m", "benchmarks.preview_decoder", "--child",
                              "--size", str(args.size), "--calls", str(args.calls)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["ratio"] = r["vae"] / r["taesd"]
        runs.append(r)
        print(f"process {k + 1}: VAE {r['vae']:.3f} s, TAESD {r['taesd']:.4f} s per image at "
              f"{args.size}², VAE / TAESD {r['ratio']:.1f}x", flush=True)
    ratios = sorted(r["ratio"] for r in runs)
    print(f"VAE / TAESD at {args.size}²: {ratios[0]:.1f}-{statistics.median(ratios):.1f}-"
          f"{ratios[-1]:.1f}x (min-median-max of {len(runs)} processes); a TAESD preview costs "
          f"{100 / ratios[-1]:.1f}-{100 / ratios[0]:.1f} % of a VAE decode")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "calls": args.calls, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
