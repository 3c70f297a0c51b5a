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
parts = {name: {"tflop": row[key]["tflop"], "gbytes": row[key]["gbytes"],
                "kernel_gbytes": kernel[name]}
         for name, key in (("unet", "unet_call"), ("vae", "vae_decode"))}
chip = aot.CHIPS["TPU v6 lite"]
out = {k: v for k, v in row.items() if k not in ("parts_only", "parts_hbm_gib")}
out.update(hbm_gib=w["hbm_gib"], hbm_fraction=w["hbm_fraction"], fits=w["fits"],
           weights_gib=w["arguments_gib"], temp_gib=w["temp_gib"],
           collectives=w["collectives"], collective_ops=w["collective_ops"],
           compile_whole_s=w["compile_whole_s"], composed=True,
           **tr.compose(w, parts["unet"], parts["vae"], tr.loops_gb(w), calls=20, per_chip=2,
                        chip=chip),
           analytic_tflop_per_image=tr.analytic_tflop("base", 1024, "sdxl-base"))
out["images_per_s"] = out["images_per_s_per_chip"] * out["chips"]
out["tflop_vs_analytic"] = out["tflop_per_image"] / out["analytic_tflop_per_image"]
print(json.dumps(out, sort_keys=True))
