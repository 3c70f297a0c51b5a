#!/usr/bin/env bash
# One prepared command for a machine with one accelerator (H100 / H200): SDXL-Lightning-shaped
# random weights, 1024², bf16, 4 Euler trailing steps, no CFG, batches 1 2 4 8 16; prints
# images/s, ms per UNet step, ms per VAE decode, MFU and peak memory, and writes JSON.
# Then engine=step against engine=batch on a mixed 4/30-step workload. Stays under 10 minutes
# including compilation (see benchmarks/accelerator.py).
#
#   bash benchmarks/accelerator.sh                  # results in benchmarks/results/accelerator-*.json
#   bash benchmarks/accelerator.sh --batches 1 4    # any benchmarks.accelerator option
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
"$PY" - <<'PYCHECK'
import sys
try:  # everything the benchmark imports, before any compile: fail in seconds, by name
    import pipelines.step_engine, pipelines.text_to_image  # noqa: F401
except ImportError as e:
    sys.exit(f"# missing module {e.name!r}: install it (or carry its wheel) for {sys.executable}")
import jax
dev = jax.devices()[0]
print(f"# jax {jax.__version__}, backend {jax.default_backend()}, {len(jax.devices())} device(s): {dev.device_kind}")
if jax.default_backend() == "cpu":
    sys.exit("no accelerator visible to JAX (install jax[cuda12] on an NVIDIA machine); "
             "for a CPU check run: python -m benchmarks.accelerator --smoke")
PYCHECK
# JAX preallocates 75 % of the GPU by default; batch 16 at 1024² wants more headroom
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
mkdir -p benchmarks/results
out="benchmarks/results/accelerator-$(date -u +%Y%m%dT%H%M%SZ).json"
timeout 590 "$PY" -m benchmarks.accelerator --json "$out" "$@"
echo "# results: $out"
