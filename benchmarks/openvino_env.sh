#!/usr/bin/env bash
# The isolated environment benchmarks/openvino_peer.py exports and runs OpenVINO in:
# creates (or reuses) .venv-openvino beside .venv and never touches .venv (which keeps
# transformers 5.x: optimum-intel 2.2.0 accepts transformers >=4.51,<5.6 only).
#
#     bash benchmarks/openvino_env.sh            # create or reuse; prints the venv's python
#     OV_VENV=/elsewhere bash benchmarks/openvino_env.sh
#
# Every version is pinned. torch is exactly 2.13.0 (the machine's local CPU wheel, as .venv
# has it): an unpinned torch would pull a multi-GB CUDA build, so it is installed first and
# held by a constraints file through the rest of the install. optimum-intel 2.2.0 requires
# optimum ~=2.3.0, nncf >=3.3.0, openvino(-tokenizers) >=2026.0, huggingface-hub <1.22 (so
# diffusers 0.39.0, the newest release that accepts it; .venv has 0.42.0) and torchvision,
# which it imports only for visual-language models: the registry's torchvision is a CUDA build
# that cannot load beside the CPU torch and breaks `import transformers`' CLIP models, so
# optimum-intel is installed with --no-deps after its other requirements, pinned here.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${OV_VENV:-$ROOT/.venv-openvino}"
PYTHON="${PYTHON:-python3}"

PINS=(
  "openvino==2026.4.1"
  "openvino-tokenizers==2026.4.1.0"
  "optimum==2.3.0"
  "nncf==3.4.0"
  "transformers==5.5.4"
  "diffusers==0.39.0"
  "huggingface-hub==1.21.0"
  "setuptools"
  "requests>=2.33,<3"
)
OPTIMUM_INTEL="optimum-intel==2.2.0"
TORCH="torch==2.13.0"
STAMP="$VENV/.openvino-peer-installed"
WANT="$(printf '%s\n' "$TORCH" "${PINS[@]}" "$OPTIMUM_INTEL")"

if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  echo "$VENV/bin/python"
  exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
CONSTRAINTS="$VENV/openvino-peer-constraints.txt"
printf '%s\n' "$TORCH" > "$CONSTRAINTS"
"$PY" -m pip install -q --upgrade pip >&2
"$PY" -m pip install -q "$TORCH" >&2
"$PY" -m pip install -q -c "$CONSTRAINTS" "${PINS[@]}" >&2
"$PY" -m pip install -q --no-deps "$OPTIMUM_INTEL" >&2
"$PY" -m pip uninstall -q -y torchvision >&2 2>/dev/null || true  # from an older run of this script
"$PY" - <<'EOF' >&2
import torch, transformers, diffusers, openvino, optimum.intel  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert not torch.version.cuda, f"a CUDA torch ({torch.version.cuda}) got in"
print("openvino", openvino.__version__, "transformers", transformers.__version__,
      "diffusers", diffusers.__version__, "torch", torch.__version__)
EOF
printf '%s\n' "$WANT" > "$STAMP"
echo "$PY"
