"""The benchmark scripts run (smoke sizes): their output has the columns the docs describe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("MAXDIFF_CONV", None)
    return env


@pytest.mark.slow  # default-suite time: make test-slow runs it
def test_accelerator_smoke_prints_the_table(tmp_path):
    """benchmarks.accelerator --smoke (tiny configs, 64², batches 1 and 2, on the CPU): the
    header, the table's columns, one row per batch with numbers, and the same in the JSON."""
    from benchmarks.accelerator import COLUMNS

    out = tmp_path / "acc.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.accelerator", "--smoke",
                           "--reps", "1", "--json", str(out)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = " | ".join(COLUMNS)
    assert COLUMNS == ["batch", "images/s", "ms/UNet step", "ms/VAE decode", "TFLOP/s", "MFU %",
                       "UNet MFU %", "peak GiB"]
    assert header in lines, proc.stdout
    rows = [line.split(" | ") for line in lines[lines.index(header) + 1:]
            if not line.startswith("#")]
    assert [r[0] for r in rows] == ["1", "2"]
    for r in rows:
        assert len(r) == len(COLUMNS)
        assert all(float(v) > 0 for v in r[1:5])  # images/s, ms/UNet, ms/VAE, TFLOP/s
        assert r[5] == r[6] == "-"  # no peak FLOP/s known for a CPU
    assert any("attention dot_product" in line for line in lines)
    result = json.loads(out.read_text())
    assert result["setup"] == "smoke" and result["size"] == 64 and result["steps"] == 4
    assert [r["batch"] for r in result["rows"]] == [1, 2]
    assert set(COLUMNS) <= set(result["rows"][0])
    assert result["rows"][0]["flops_source"] == "xla cost analysis"
    assert result["rows"][0]["unet_tflop"] > 0 and result["rows"][0]["vae_tflop"] > 0


@pytest.mark.slow  # default-suite time: make test-slow runs it
def test_cold_start_load_runs(sdxl_dir, tmp_path):
    """benchmarks.cold_start, load part only, one repeat, on the tiny checkpoint: it converts
    the folder with `maxdiff convert`, times from_pretrained in fresh processes from both
    folders and reports the phases (no timing asserts)."""
    out = tmp_path / "cold.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cold_start", "--model", str(sdxl_dir),
                           "--skip", "image", "--repeats", "1", "--work", str(tmp_path / "w"),
                           "--json", str(out)], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["load"]) == {"diffusers", "converted"}
    for m in result["load"].values():
        assert 0 < m["import_s"] < m["loaded_s"] <= m["total_s"]
    assert (tmp_path / "w" / "converted-bfloat16" / "model_index.json").is_file()
    assert "first_image" not in result


def test_loadgen_flags_a_capacity_above_the_offline_throughput():
    """benchmarks.loadgen's consistency check (a sustained rate cannot exceed the peak): a row
    whose Server capacity is above the better of its two Offline runs is named, one at or below
    it is not."""
    pytest.importorskip("requests")
    from benchmarks.loadgen import inconsistent_rows

    def row(before, after, cap):
        return {"offline": {"samples_per_s": before}, "offline_after": {"samples_per_s": after},
                "offline_best": max(before, after), "server_capacity_qps": cap}

    results = {"engines": {"batch": {"uniform": row(15.4, 20.0, 17.3), "overhead": []},
                           "step": {"uniform": row(20.9, 21.8, 21.8),
                                    "mixed": row(5.5, 5.9, 6.2)}}}
    assert inconsistent_rows(results) == ["step/mixed: capacity 6.200/s > Offline 5.900 images/s"]
