"""Compile the whole base program (20 Euler steps, CFG 8, 1024², 2 images a chip) for v6e:2x2
and save its analysis (whole.json), to be composed with the parts compiled alone by
``tpu_report --parts-only`` (compose.py):

    PYTHONPATH=. python docs/results/tpu-2026-12-06b/whole.py OUT
"""
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

from pipelines import aot

out = Path(sys.argv[1])
with tempfile.TemporaryDirectory() as tmp:
    folder = aot.model_folder("sdxl-base", Path(tmp) / "model")
    t0 = time.perf_counter()
    pipe = aot.load(folder, "v6e:2x2", "bfloat16")
    chip = aot.chip_of(pipe.mesh)
    with aot.recording() as whole:
        pipe(["a photo of a cat"] * 8, num_inference_steps=20, guidance_scale=8.0,
             height=1024, width=1024, seed=0)
    w = aot.analyse(whole[-1], chip, 2)
    w["compile_whole_s"] = time.perf_counter() - t0
    (out / "whole.json").write_text(json.dumps(w, indent=1, sort_keys=True))
    (out / "hlo").mkdir(parents=True, exist_ok=True)
    with gzip.open(out / "hlo" / "v6e-2x2-base-1024-2-whole.hlo.txt.gz", "wt") as f:
        f.write(whole[-1]["compiled"].as_text())
    print("done", w["hbm_gib"], w["hbm_gbytes_by_loop"], w["compile_whole_s"])
