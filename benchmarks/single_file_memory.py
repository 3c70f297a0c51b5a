"""Peak host memory while loading a full-size single-file SDXL checkpoint.

    python -m benchmarks.single_file_memory                 # write /tmp/maxdiff-sdxl.safetensors, load it
    python -m benchmarks.single_file_memory --dtype bfloat16 --generate --json out.json

No download: the file is written here in the original Stability layout (what A1111 / ComfyUI
users download, about 6.9 GB in float16) with the shapes of the SDXL base configs maxdiff ships
(``jax.eval_shape`` of the Flax modules, mapped by :mod:`maxdiff.single_file`), each tensor a
small random pattern. A fresh process then runs ``TextToImagePipeline.from_single_file`` and
reports its peak resident memory (``ru_maxrss``) against the bytes of the parameters it loaded,
plus the same process's resident memory before loading (the Python + JAX baseline).
``--generate`` runs one 1-step 128x128 image afterwards (proves the shipped configs run end to
end at full size; the pixels mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def write_file(path: Path, dtype: str = "float16") -> int:
    """A full-size SDXL base single file with the shipped configs' shapes."""
    from maxdiff import checkpoint, single_file

    root = single_file.shipped_config("sdxl-base")
    family = single_file.FAMILIES["sdxl-base"]
    dt = checkpoint.resolve_dtype(dtype)
    configs = {name: checkpoint.read_config(root / name)
               for name in single_file.family_models(family)}
    pieces = [(rename, key, shape)
              for name, rename in single_file.renames(family, configs).items()
              for key, shape in single_file._expected(name, configs[name]).items()]
    tensors = {}
    for target, (op, shapes) in single_file.grouped(pieces, root).items():
        shape = op.write([np.broadcast_to(np.empty((), np.uint8), s) for s in shapes]).shape

        def load(shape=shape):
            n = int(np.prod(shape))
            pattern = (np.arange(n, dtype=np.float32) % 97 - 48) / 4800.0  # small, not constant
            return pattern.reshape(shape).astype(dt)

        tensors[target] = checkpoint.LazyTensor(tuple(shape), dt, load)
    return checkpoint.save_safetensors(tensors, path)


CHILD = r"""
import json, resource, sys, time
import jax, numpy as np
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
from pipelines import TextToImagePipeline
path, dtype, generate = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
before = rss()
t0 = time.perf_counter()
pipe = TextToImagePipeline.from_single_file(path, dtype=dtype, compile_cache_dir=None)
load_s = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
params = sum(x.nbytes for x in jax.tree_util.tree_leaves(pipe.params))
out = dict(load_s=round(load_s, 1), baseline_rss=before, peak_rss=peak, param_bytes=params,
           after_rss=rss(), peak_over_params=round(peak / params, 3),
           peak_minus_baseline_over_params=round((peak - before) / params, 3))
if generate:
    t0 = time.perf_counter()
    img = pipe("a lighthouse", num_inference_steps=1, height=128, width=128, seed=0,
               output_type="np").images
    out.update(generate_s=round(time.perf_counter() - t0, 1), image_shape=list(img.shape),
               finite=bool(np.isfinite(img).all()))
print("RESULT " + json.dumps(out))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", default="/tmp/maxdiff-sdxl.safetensors")
    ap.add_argument("--dtype", default="float16", help="load dtype (the file is float16)")
    ap.add_argument("--generate", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the file afterwards")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    path = Path(args.file)
    report = {}
    if not path.is_file():
        t0 = time.perf_counter()
        report["file_bytes"] = write_file(path)
        report["write_s"] = round(time.perf_counter() - t0, 1)
    else:
        report["file_bytes"] = path.stat().st_size
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), args.dtype,
                           "1" if args.generate else "0"], env=env, capture_output=True,
                          text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        print(proc.stderr[-4000:], file=sys.stderr)
        return 1
    report.update(json.loads(lines[0][len("RESULT "):]), dtype=args.dtype)
    if not args.keep:
        path.unlink()
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
