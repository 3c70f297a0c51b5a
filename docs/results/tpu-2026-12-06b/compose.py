"""The v6e base row of composed.jsonl: the whole program (whole.json, from whole.py) composed
with the parts compiled alone (report.jsonl's --parts-only row) by benchmarks.tpu_report.compose.
parts.json holds each part's kernel bytes, recovered from its compiled HLO (not committed:
1.4 MB) as its HBM bytes less its loops' (pipelines.aot.loop_traffic).

    PYTHONPATH=. python docs/results/tpu-2026-12-06b/compose.py docs/results/tpu-2026-12-06b
"""
import json
import sys
from pathlib import Path

from benchmarks import tpu_report as tr
from pipelines import aot

d = Path(sys.argv[1])
row = json.loads((d / "report.jsonl").read_text().splitlines()[-1])
w = json.loads((d / "whole.json").read_text())
kernel = json.loads((d / "parts.json").read_text())
unet, vae = ({"tflop": row[key]["tflop"], "gbytes": row[key]["gbytes"],
              "kernel_gbytes": kernel[name]} for name, key in (("unet", "unet_call"),
                                                              ("vae", "vae_decode")))
unet["collective_ops"] = row["unet_collective_ops"]
out = {k: v for k, v in row.items() if k not in ("parts_only", "parts_hbm_gib")}
out.update(tr.priced(w, unet, vae, aot.CHIPS["TPU v6 lite"], program="base", size=1024,
                     config="sdxl-base", per_chip=2, chips=row["chips"]),
           compile_whole_s=w["compile_whole_s"], composed=True)
print(json.dumps(out, sort_keys=True))
