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
    header, the table's columns, one row per batch with numbers, and the same in the JSON, once
    for the float UNet and once quantized to int8 through qwix (--quantization none int8); then
    the engine comparison (8 images, 2 slots) with both engines' figures."""
    from benchmarks.accelerator import COLUMNS

    out = tmp_path / "acc.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.accelerator", "--smoke",
                           "--reps", "1", "--quantization", "none", "int8", "--json", str(out)],
                          cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = " | ".join(COLUMNS)
    assert COLUMNS == ["batch", "images/s", "ms/UNet step", "ms/VAE decode", "TFLOP/s", "MFU %",
                       "UNet MFU %", "peak GiB"]
    assert lines.count(header) == 2, proc.stdout
    starts = [i for i, line in enumerate(lines) if line == header]
    assert [lines[i - 2] for i in starts] == ["# quantization=none", "# quantization=int8"]
    rows = [line.split(" | ") for line in lines[starts[0] + 1:]
            if not line.startswith("#") and line != header]
    assert [r[0] for r in rows] == ["1", "2", "1", "2"]
    for r in rows:
        assert len(r) == len(COLUMNS)
        assert all(float(v) > 0 for v in r[1:5])  # images/s, ms/UNet, ms/VAE, TFLOP/s
        assert r[5] == r[6] == "-"  # no peak FLOP/s known for a CPU
    assert any("attention dot_product" in line for line in lines)
    result = json.loads(out.read_text())
    assert result["setup"] == "smoke" and result["size"] == 64 and result["steps"] == 4
    assert [(r["quantization"], r["batch"]) for r in result["rows"]] == [
        ("none", 1), ("none", 2), ("int8", 1), ("int8", 2)]
    assert set(result["quantization"]) == {"none", "int8"} and not result["failed_batches"]
    assert set(COLUMNS) <= set(result["rows"][0])
    # engine=step against engine=batch on the mixed 4/30-step workload, in the same run
    engines = result["engines"]
    assert (engines["images"], engines["slots"], engines["steps"]) == (8, 2, [4, 30])
    for name in ("batch", "step"):
        r = engines[name]
        assert r["images_per_s"] == pytest.approx(8 / r["run_s"], rel=1e-2)
        assert 0 < r["p50_latency_4_step_s"] <= r["run_s"]
        assert 0 < r["p50_latency_30_step_s"] <= r["run_s"]
        assert any(line.startswith(f"# engine={name}: 8 images, 4/30 steps mixed, 2 slots: ")
                   for line in lines)
    assert engines["step_over_batch_images_per_s"] == pytest.approx(
        engines["step"]["images_per_s"] / engines["batch"]["images_per_s"], rel=1e-2)
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


def test_loadgen_prints_the_cost_per_1000_images_of_an_offline_run():
    """--price-per-hour: an Offline run at 2 images/s on a replica at 3.6 per hour costs
    3.6 / 3600 / 2 x 1000 = 0.5 per 1,000 images, the figure /v1/stats computes; no price, no
    figure."""
    pytest.importorskip("requests")
    from benchmarks.loadgen import cost_text
    from serving.cost import cost_per_1000_images

    assert cost_per_1000_images(3.6, 2.0) == pytest.approx(0.5)
    assert cost_per_1000_images(None, 2.0) is None and cost_per_1000_images(3.6, 0.0) is None
    run = {"samples_per_s": 2.0, "cost_per_1000_images": cost_per_1000_images(3.6, 2.0)}
    assert cost_text(run, 3.6) == ", 0.5 per 1,000 images at 3.6 per replica-hour"
    assert cost_text({"samples_per_s": 2.0, "cost_per_1000_images": None}, None) == ""


def test_compare_text_parts_do_equal_work(sdxl_dir):
    """benchmarks.compare's text part, on the tiny checkpoint: maxdiff's callable (the
    pipeline's text states plus CLIP-L's last layer) and diffusers' (encode_prompt's calls, plus
    the same) return the same arrays: as many, the same shapes (SDXL's prompt embeddings, pooled
    embedding, CLIP-L's last state: every layer of both encoders runs on both sides), values
    within 1e-4."""
    import numpy as np

    torch = pytest.importorskip("torch")
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from benchmarks.compare import PROMPTS, diffusers_text, maxdiff_text, text_ids
    from pipelines import TextToImagePipeline

    ours = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    ids1, ids2 = text_ids(ours, PROMPTS)
    p = ours.params
    a = maxdiff_text(ours)(p["text_encoder"], p["text_encoder_2"], ids1, ids2)
    te1 = CLIPTextModel.from_pretrained(sdxl_dir / "text_encoder").eval()
    te2 = CLIPTextModelWithProjection.from_pretrained(sdxl_dir / "text_encoder_2").eval()
    with torch.inference_mode():
        b = diffusers_text(te1, te2)(torch.from_numpy(ids1).long(), torch.from_numpy(ids2).long())
    assert len(a) == len(b) == 3
    d1, d2 = te1.config.hidden_size, te2.config.hidden_size
    assert a[0].shape == tuple(b[0].shape) == (len(PROMPTS), 77, d1 + d2)
    assert a[1].shape == tuple(b[1].shape) == (len(PROMPTS), te2.config.projection_dim)
    assert a[2].shape == tuple(b[2].shape) == (len(PROMPTS), 77, d1)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(x), y.numpy(), atol=1e-4, rtol=0)


def test_compare_repeats_summary():
    """benchmarks.compare --repeats' summary: min, median and max per (config, part) over the
    runs, in the order first seen, with each run's compile status."""
    from benchmarks.compare import SUMMARY_FIELDS, summarise

    def row(part, ratio, ours, compile="off"):
        r = {"config": "tiny", "part": part, "ratio": ratio, "ratio_default": 2 * ratio,
             "maxdiff_s": ours, "diffusers_default_s": 2 * ratio * ours,
             "diffusers_tuned_s": ratio * ours, "diffusers_best_s": ratio * ours}
        return {**r, "compile": compile}

    runs = [[row("unet", 3.0, 0.1), row("pipeline", 2.0, 1.0)],
            [row("unet", 1.0, 0.3), row("pipeline", 4.0, 2.0, "failed: X: y")],
            [row("unet", 2.0, 0.2), row("pipeline", 1.0, 3.0)]]
    s = summarise(runs)
    assert [(x["config"], x["part"], x["runs"]) for x in s] == [("tiny", "unet", 3),
                                                                 ("tiny", "pipeline", 3)]
    assert set(SUMMARY_FIELDS) <= set(s[0])
    assert s[0]["ratio"] == {"min": 1.0, "median": 2.0, "max": 3.0}
    assert s[0]["maxdiff_s"] == {"min": 0.1, "median": 0.2, "max": 0.3}
    assert s[1]["ratio_default"] == {"min": 2.0, "median": 4.0, "max": 8.0}
    assert s[1]["compile"] == ["off", "failed: X: y", "off"]
    assert summarise([runs[0][:1], runs[1][:1]])[0]["ratio"]["median"] == 2.0  # even count


def test_openvino_peer_summary_check_and_export_copy(tmp_path):
    """benchmarks.openvino_peer without its OpenVINO venv: the summary of made-up rounds
    (per side images/s per round and min-median-max, maxdiff/OpenVINO ratios per round), the
    weight check (passes within its stated tolerance, fails loudly beyond it) and the export
    copy that gives CLIPTextModel's keys their text_model. prefix."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from benchmarks.openvino_peer import (
        F32_TOLERANCE,
        export_copy,
        format_summary,
        summarise,
        weight_check,
    )

    def rnd(md, f32, default):
        return {"order": ["maxdiff", "openvino-f32", "openvino-default"],
                "sides": {"maxdiff": {"images_per_s": md}, "openvino-f32": {"images_per_s": f32},
                          "openvino-default": {"images_per_s": default}}}

    s = summarise([rnd(0.2, 0.2, 0.4), rnd(0.3, 0.1, 0.3), rnd(0.1, 0.2, 0.5)])
    assert s["rounds"] == 3
    assert s["sides"]["maxdiff"]["images_per_s"] == [0.2, 0.3, 0.1]
    assert s["sides"]["openvino-default"]["min_median_max"] == {"min": 0.3, "median": 0.4,
                                                                "max": 0.5}
    assert s["ratios"]["maxdiff/openvino-f32"]["per_round"] == [1.0, 3.0, 0.5]
    assert s["ratios"]["maxdiff/openvino-f32"]["min_median_max"] == {"min": 0.5, "median": 1.0,
                                                                     "max": 3.0}
    assert s["ratios"]["maxdiff/openvino-default"]["per_round"] == [0.5, 1.0, 0.2]

    ref = np.linspace(0, 1, 2 * 8 * 8 * 3, dtype=np.float32).reshape(2, 8, 8, 3)
    check = weight_check({"maxdiff": ref, "openvino-f32": ref + 1e-6,
                          "openvino-default": ref + 0.01})
    assert check["passed"] and check["tolerance"] == F32_TOLERANCE <= 1e-3
    assert check["default_psnr_db"] == pytest.approx(40.0, abs=0.01)
    text = format_summary(s, check)
    assert "ratio maxdiff/openvino-f32" in text and "1.00-1.00-1.00" not in text
    assert "PSNR 40.0 dB" in text
    with pytest.raises(SystemExit, match="WEIGHT CHECK FAILED"):
        weight_check({"maxdiff": ref, "openvino-f32": ref + 0.1, "openvino-default": ref})

    src = tmp_path / "src"
    for name, arch, keys in (("text_encoder", "CLIPTextModel", ["embeddings.w", "text_model.x"]),
                             ("text_encoder_2", "CLIPTextModelWithProjection",
                              ["text_model.w", "text_projection.weight"])):
        (src / name).mkdir(parents=True)
        (src / name / "config.json").write_text(json.dumps({"architectures": [arch]}))
        save_file({k: np.zeros(2, np.float32) for k in keys}, src / name / "model.safetensors")
    (src / "unet").mkdir()
    (src / "model_index.json").write_text("{}")
    assert export_copy(src, tmp_path / "dst") == {"text_encoder": 1, "text_encoder_2": 0}
    assert set(load_file(tmp_path / "dst" / "text_encoder" / "model.safetensors")) == {
        "text_model.embeddings.w", "text_model.x"}
    assert set(load_file(tmp_path / "dst" / "text_encoder_2" / "model.safetensors")) == {
        "text_model.w", "text_projection.weight"}
    assert (tmp_path / "dst" / "unet").is_symlink()
    assert (tmp_path / "dst" / "model_index.json").exists()


def test_quantization_thresholds_are_stated_and_judged():
    """benchmarks.quantization: the acceptance thresholds its docstring states are the ones it
    judges by, and each verdict can fail: a mean above its bound with a worst image below it
    fails the worst-image bound; the demo's drop is in points of the `all` score."""
    import math

    import numpy as np

    from benchmarks import quantization as bq

    rows = {line.split()[0]: line for line in bq.__doc__.splitlines()
            if ">= " in line and line.split()[0] in bq.QUALITY_MODES}  # the table's rows
    assert set(rows) == set(bq.QUALITY_MODES)
    t = bq.THRESHOLDS
    for mode, row in rows.items():
        assert row.split()[1:] == [">=", f"{t['medium_mean_psnr_db'][mode]:g}", "dB", ">=",
                                   f"{t['medium_worst_psnr_db'][mode]:g}", "dB", "at", "most",
                                   f"{t['demo_all_drop_points'][mode]:.1f}", "points",
                                   *(["(when", "measured)"] if mode == "fp8" else [])], row
    medium = {"int8": {"mean_db": 36.0, "worst_db": 29.9}}
    demo = {"float32": {"all": 1.0}, "int8": {"all": 0.98}, "int8-weights": {"all": 0.976}}
    v = bq.verdicts(medium, demo)
    assert v["medium_mean_psnr_db"]["int8"]["pass"]
    assert not v["medium_worst_psnr_db"]["int8"]["pass"]
    assert v["demo_all_drop_points"]["int8"] == {"value": 2.0, "bound": 2.0, "pass": True}
    assert v["demo_all_drop_points"]["int8-weights"]["value"] == 2.4
    assert not bq.all_pass(v) and bq.all_pass({"x": {"int8": {"pass": True}}})
    a = np.zeros((2, 4, 4, 3), np.float32)
    b = a.copy()
    b[1] += 0.01  # MSE 1e-4: 40 dB
    s = bq.psnr_summary(b, a)
    assert s["per_image_db"][0] == math.inf and s["per_image_db"][1] == pytest.approx(40.0)
    assert (s["worst_db"], s["equal_images"]) == (pytest.approx(40.0), 1)


def test_step_model_prices_calls_on_the_roofline_and_replays_both_engines():
    """benchmarks/step_model.py: a call's time is the roofline of its rows; a lone request
    takes its steps' calls plus a decode under either engine; under load, the step engine
    never gives a 4-step request the wait of a 30-step batch ahead of it."""
    from benchmarks import step_model as sm

    c = sm.Costs(flops_per_row=7e12, weight_bytes=5e9, bytes_per_row=30e9, peak_flops=197e12,
                 bandwidth=819e9, decode_s=0.15)
    assert c.call(1) == pytest.approx((5e9 + 30e9) / 819e9)  # memory-bound
    fast = sm.Costs(7e12, 5e9, 1e9, 197e12, 819e9, 0.15)
    assert fast.call(4) == pytest.approx(4 * 7e12 / 197e12)  # compute-bound
    alone = [(0.0, 30, True)]
    want = 30 * c.call(2) + c.decode_s
    assert sm.run_batch(alone, c, 8) == [pytest.approx(want)]
    assert sm.run_step(alone, c, 8) == [pytest.approx(want)]
    long_then_short = [(0.0, 30, False), (0.01, 4, False)]
    assert sm.run_step(long_then_short, c, 8)[1] < sm.run_batch(long_then_short, c, 8)[1]
    # a report row prices calls from XLA's count of bytes or from the bytes that touch HBM
    row = {"chip": "v5e", "batch_per_chip": 2, "guidance": 0.0, "steps": 4, "size": 1024,
           "roofline_s": 0.6, "hbm_roofline_s": 0.4,
           "unet_call": {"tflop": 14.0, "gbytes": 70.0, "hbm_gbytes": 16.0}}
    everything, hbm = sm.costs_from_report(row, 1024), sm.costs_from_report(row, 1024, "hbm")
    assert everything.bytes_per_row == pytest.approx((70e9 - sm.UNET_PARAMS * 2) / 2)
    assert hbm.bytes_per_row == pytest.approx((16e9 - sm.UNET_PARAMS * 2) / 2)
    assert hbm.call(2) == pytest.approx(14e12 / 197e12)  # compute-bound by the HBM count
    assert everything.call(2) == pytest.approx(70e9 / 819e9)


def test_precision_bar_is_stated_and_judged():
    """benchmarks.precision: the bar its docstring states (fixed before measuring) is the one
    it judges by, and a mean above its bound with a worst image below it fails."""
    from benchmarks import precision

    bar = ("each single component in bf16: mean >= 45 dB, worst >= 40 dB; "
           "all bf16: mean >= 40 dB, worst >= 35 dB.")
    assert bar in precision.__doc__
    t = precision.THRESHOLDS
    assert {m: (t["mean_db"][m], t["worst_db"][m]) for m in precision.MODES} == {
        "text": (45, 40), "unet": (45, 40), "vae": (45, 40), "all": (40, 35)}
    v = precision.verdicts({"vae": {"mean_db": 46.0, "worst_db": 39.9}})["vae"]
    assert v["mean_db"]["pass"] and not v["worst_db"]["pass"] and not v["pass"]


@pytest.mark.slow  # default-suite time (90 s: five pipelines compiled): make test-slow runs it
def test_precision_smoke_reports_every_mode(sdxl_dir, tmp_path):
    """benchmarks.precision --config tiny --n 2 (the suite's tiny checkpoint, 32x32): float32 and the
    four bf16 modes run; the JSON has each mode's PSNR summary over both images and a verdict
    against THRESHOLDS, the log the lines it printed, and the exit status says whether every
    mode passed (the tiny random weights' figures are not judged here)."""
    from benchmarks import precision

    t = precision.THRESHOLDS
    out, log = tmp_path / "p.json", tmp_path / "p.log"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.precision", "--config", "tiny",
                           "--n", "2", "--checkpoint", str(sdxl_dir), "--json", str(out),
                           "--log", str(log)], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=480)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["config"], result["n"], result["size"], result["steps"]) == ("tiny", 2, 32, 4)
    assert list(result["modes"]) == list(result["verdicts"]) == ["text", "unet", "vae", "all"]
    assert result["modes"]["all"]["dtype"] == "bfloat16"
    assert result["modes"]["unet"]["dtype"] == {"unet": "bfloat16"}
    for mode, s in result["modes"].items():
        assert s["n"] == 2 and len(s["per_image_db"]) == 2
        assert s["worst_db"] <= s["mean_db"] and s["max_abs_diff"] >= 0
        v = result["verdicts"][mode]
        assert v["mean_db"]["bound"] == t["mean_db"][mode]
        assert v["pass"] == (v["mean_db"]["pass"] and v["worst_db"]["pass"])
    assert result["pass"] == all(v["pass"] for v in result["verdicts"].values())
    assert proc.returncode == (0 if result["pass"] else 1)
    lines = log.read_text().splitlines()
    assert lines and all(line in proc.stdout.splitlines() for line in lines)
    assert sum(line.endswith((": pass", ": FAIL")) for line in lines) == 4


def test_tpu_report_sums_each_parts_roofline():
    """benchmarks.tpu_report.compose: the whole program holds one UNet call and one decode
    (XLA counts a loop's body once); the program is ``calls`` UNet calls, ``per_chip`` decodes
    and the rest, each on its own roofline (a compute-bound UNet does not hide a memory-bound
    decode), with HBM bytes from the whole program's loops."""
    from benchmarks.tpu_report import compose
    from pipelines.aot import CHIPS

    chip = CHIPS["TPU v5 lite"]  # 197 TFLOP/s, 819 GB/s
    unet = dict(tflop=19.7, gbytes=81.9, kernel_gbytes=0.19)  # 0.1 s compute, 0.1 s by XLA
    vae = dict(tflop=1.97, gbytes=81.9, kernel_gbytes=0.0)  # 0.01 s compute, 0.1 s memory
    whole = dict(tflop=19.7 + 1.97 + 0.197, gbytes=81.9 * 2, kernel_gbytes=0.19)
    loops = {"unet": 8.0, "vae": 81.9, "entry": 0.0}  # HBM in the program's own loops, GB
    got = compose(whole, unet, vae, loops, calls=4, per_chip=2, chip=chip)
    assert got["tflop_per_image"] == pytest.approx((4 * 19.7 + 2 * 1.97 + 0.197) / 2)
    # by HBM bytes: 4 calls x 0.1 s (compute) + 2 decodes x 0.1 s (memory) + the rest 1 ms
    assert got["hbm_roofline_s"] == pytest.approx(0.4 + 0.2 + 0.001, rel=1e-3)
    assert got["hbm_gbytes_per_image"] == pytest.approx((4 * 8.19 + 2 * 81.9) / 2)
    assert got["hbm_bound"] == "compute" and got["hbm_images_per_s_per_chip"] == pytest.approx(
        2 / 0.601, rel=1e-3)
    assert got["roofline_s"] == pytest.approx(0.601, rel=1e-3)  # XLA's count: 0.1 s both ways
    assert got["vae_decode"]["hbm_bound"] == "memory" and got["unet_call"]["hbm_bound"] == "compute"


def test_tpu_report_parts_only_prices_the_two_parts_and_nothing_else():
    """--parts-only: the program is ``calls`` UNet calls and ``per_chip`` decodes with each
    part's bytes as compiled alone (its loops' HBM traffic plus its kernels'), no rest."""
    from benchmarks.tpu_report import analytic_tflop, compose, parts_as_whole
    from pipelines.aot import CHIPS

    chip = CHIPS["TPU v5 lite"]
    unet = dict(tflop=19.7, gbytes=81.9, kernel_gbytes=0.5,
                hbm_gbytes_by_loop={"entry": 7.0, "UNet2DConditionModel": 1.19})
    vae = dict(tflop=1.97, gbytes=8.19, kernel_gbytes=0.0, hbm_gbytes_by_loop={"entry": 8.19})
    whole, loops = parts_as_whole(unet, vae)
    assert loops == {"unet": pytest.approx(8.19), "vae": pytest.approx(8.19), "entry": 0.0}
    got = compose(whole, unet, vae, loops, calls=20, per_chip=2, chip=chip)
    assert got["rest"]["tflop"] == 0.0 and got["rest"]["hbm_gbytes"] == 0.0
    assert got["tflop_per_image"] == pytest.approx((20 * 19.7 + 2 * 1.97) / 2)
    # by HBM bytes: 20 calls x 0.1 s (compute-bound) + 2 decodes x 0.01 s (8.19 GB: memory)
    assert got["hbm_roofline_s"] == pytest.approx(2.0 + 0.02, rel=1e-3)
    assert analytic_tflop("base", 1024, "sdxl-base", text=False) == pytest.approx(
        20 * 2 * 6.75 + 10.5)
    assert analytic_tflop("base", 1024, "sdxl-base") == pytest.approx(
        20 * 2 * 6.75 + 10.5 + 2 * 0.11)


def test_published_v6e_estimate_is_the_composed_row():
    """The MLPerf-setting estimate on v6e the pages publish is docs/results/tpu-2026-12-06b's
    composed row, and compose.py recomputes that row from the committed parts and whole."""
    run = ROOT / "docs/results/tpu-2026-12-06b"
    proc = subprocess.run([sys.executable, str(run / "compose.py"), str(run)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row == json.loads((run / "composed.jsonl").read_text())
    assert row["collective_ops"] == 0 and row["fits"]
    assert abs(row["tflop_vs_analytic"] - 1) < 0.1  # nothing computed twice
    ips = f"{row['images_per_s_per_chip']:.2f} / {row['hbm_images_per_s_per_chip']:.2f} images/s"
    for page in ("README.md", "docs/performance.md", "docs/results/tpu-2026-12-06b/README.md"):
        text = " ".join((ROOT / page).read_text().replace("**", "").split())
        assert ips in text, page
        assert f"{row['hbm_gib']:.1f} GiB" in text or f"{row['hbm_gib']:.2f} GiB" in text, page


def test_published_tpu_scaling_and_fits_come_from_their_reports():
    """The v5e-8 scaling figures and the full-size fits the performance page publishes are the
    rows in docs/results/tpu-2026-12-07b: per chip, SDXL-Lightning on v5e:2x4 costs what it
    costs on v5e:2x2 (docs/results/tpu-2026-12-05b), with no collectives; base + refiner and
    the MLPerf base setting fit a v5e chip."""
    run = ROOT / "docs/results/tpu-2026-12-07b"

    def row(path):
        return json.loads(path.read_text().splitlines()[0])

    four, eight = row(ROOT / "docs/results/tpu-2026-12-05b/report.jsonl"), row(
        run / "v5e-2x4-lightning/report.jsonl")
    assert (four["chips"], eight["chips"]) == (4, 8) and eight["collective_ops"] == 0
    for part in ("unet_call", "vae_decode"):
        for key in ("tflop", "gbytes", "hbm_gbytes"):
            assert eight[part][key] == pytest.approx(four[part][key], rel=1e-3), (part, key)
    assert eight["hbm_gib"] == pytest.approx(four["hbm_gib"], rel=1e-3)
    perf = " ".join((ROOT / "docs/performance.md").read_text().replace("**", "").split())
    ips, hbm = eight["images_per_s_per_chip"], eight["hbm_images_per_s_per_chip"]
    assert (f"{ips:.2f} / {hbm:.2f} images/s per chip, {8 * ips:.1f} / {8 * hbm:.1f} for the "
            "eight chips") in perf
    refiner, base = row(run / "refiner/report.jsonl"), row(run / "v5e-base/report.jsonl")
    assert refiner["program"] == "refiner" and refiner["refiner_config"] == "sdxl-refiner"
    for r in (refiner, base):
        assert r["compiled"] and r["fits"] and r["collective_ops"] == 0
    assert f"{refiner['hbm_gib']:.1f} GiB of 16" in perf
    assert f"compiles for v5e:2x2 in {base['hbm_gib']:.1f} GiB" in perf
    # SDXL-Lightning on v6e: the UNet compute-bound by the bytes touching HBM, the decode not
    v6e = row(run / "v6e-lightning/report.jsonl")
    assert v6e["chip"] == "v6e" and v6e["collective_ops"] == 0 and v6e["fits"]
    assert v6e["unet_call"]["hbm_bound"] == "compute" and v6e["vae_decode"]["bound"] == \
        v6e["vae_decode"]["hbm_bound"] == "memory"
    assert (f"{v6e['hbm_gib']:.1f} GiB of 32" in perf and f"{v6e['images_per_s_per_chip']:.2f} / "
            f"{v6e['hbm_images_per_s_per_chip']:.2f} images/s per chip" in perf)
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"(on v6e: {v6e['images_per_s_per_chip']:.1f} / "
            f"{v6e['hbm_images_per_s_per_chip']:.1f})") in readme
    per_image_ms = 1000 * v6e["hbm_roofline_s"] / v6e["batch_per_chip"]
    decode_ms = 1000 * v6e["vae_decode"]["hbm_roofline_s"]
    assert f"({decode_ms:.0f} of {per_image_ms:.0f} ms)" in perf
    # MLPerf's setting on v6e at 4 images a chip, priced from its parts, against 2 a chip
    four_a_chip = row(run / "v6e-base4/report.jsonl")
    two_a_chip = row(ROOT / "docs/results/tpu-2026-12-06b/report.jsonl")
    assert (four_a_chip["batch_per_chip"], two_a_chip["batch_per_chip"]) == (4, 2)
    assert four_a_chip["parts_only"] and two_a_chip["parts_only"]
    call, before = four_a_chip["unet_call"], two_a_chip["unet_call"]
    assert call["hbm_flops_per_byte"] > before["hbm_flops_per_byte"]
    assert (f"{call['tflop']:.1f} TFLOP on {call['gbytes']:.1f} / {call['hbm_gbytes']:.1f} GB, "
            f"{call['flops_per_byte']:.0f} / {call['hbm_flops_per_byte']:.0f} flops/byte (at 2 a "
            f"chip, compiled alone: {before['flops_per_byte']:.0f} / "
            f"{before['hbm_flops_per_byte']:.0f})") in perf
    assert f"at {100 * call['hbm_flops_per_byte'] / four_a_chip['ridge']:.0f} % of the ridge" in perf
    for r in (four_a_chip, two_a_chip):
        assert (f"{r['images_per_s_per_chip']:.2f} / {r['hbm_images_per_s_per_chip']:.2f}"
                in perf)


def test_the_deployment_pages_tpu_table_is_the_compiled_rows():
    """docs/deployment.md's table of what fits a TPU chip: each cell is the committed row of
    that program and chip (HBM per chip, collectives, the roofline's two ends)."""
    res = ROOT / "docs/results"

    def row(path, n=0):
        return json.loads((res / path).read_text().splitlines()[n])

    lightning = {"v5e-4": row("tpu-2026-12-05b/report.jsonl"),
                 "v5e-8": row("tpu-2026-12-07b/v5e-2x4-lightning/report.jsonl"),
                 "v6e": row("tpu-2026-12-07b/v6e-lightning/report.jsonl")}
    base = {"v5e": row("tpu-2026-12-07b/v5e-base/report.jsonl"),
            "v5e-8": row("tpu-2026-12-07d/v5e-2x4-base/report.jsonl"),
            "v6e": json.loads((res / "tpu-2026-12-06b/whole.json").read_text())}
    cells = {  # table row label -> the committed rows its HBM cells come from
        "SDXL-Lightning, 4 steps (2)": lightning,
        "SDXL-Lightning, 4 steps (8)": {"v5e": row("tpu-2026-12-05/report.jsonl")},
        "SDXL base, 20 steps, CFG 8 (2)": base,
        "image-to-image, inpainting (1)": {
            "v5e": row("tpu-2026-12-06/report.jsonl"),
            "v5e-8": row("tpu-2026-12-07d/v5e-2x4-img2img/report.jsonl"),
            "v5e inpaint": row("tpu-2026-12-07/report.jsonl"),
            "v5e-8 inpaint": row("tpu-2026-12-07d/v5e-2x4-inpaint/report.jsonl"),
            "v6e": row("tpu-2026-12-07c/v6e-img2img/report.jsonl"),
            "v6e inpaint": row("tpu-2026-12-07c/v6e-inpaint/report.jsonl")},
        "ControlNet (1)": {"v5e": row("tpu-2026-12-07/report.jsonl", 1),
                           "v5e-8": row("tpu-2026-12-07d/v5e-2x4-controlnet/report.jsonl"),
                           "v6e": row("tpu-2026-12-07c/v6e-controlnet/report.jsonl")},
        "base + refiner (1)": {"v5e-4": row("tpu-2026-12-07b/refiner/report.jsonl"),
                               "v5e-8": row("tpu-2026-12-07d/v5e-2x4-refiner/report.jsonl"),
                               "v6e": row("tpu-2026-12-07b/v6e-refiner/report.jsonl")},
        "step engine, one slot a chip": {"v5e": row("tpu-2026-12-07/report.jsonl", 2),
                                         "v6e": row("tpu-2026-12-07d/v6e-step/report.jsonl")},
    }
    step8 = row("tpu-2026-12-07d/v5e-2x4-step/report.jsonl")  # its collectives change
    lines = {line.split("|")[1].strip(): line for line in
             (ROOT / "docs/deployment.md").read_text().splitlines() if line.startswith("| ")}
    for label, rows in cells.items():
        line = lines[label]
        ops = {r["collective_ops"] for r in rows.values()}
        assert len(ops) == 1 and f"| {ops.pop()}" in line, label
        for name, r in rows.items():
            assert f"{r['hbm_gib']:.2f} GiB" in line, (label, name)
            chip = name.split()[0].split("-")[0]  # tpu-2026-12-06b/whole.json names none
            assert r.get("chip", chip) == chip and r.get("compiled", True), (label, name)

    assert step8["chips"] == 8 and step8["program"] == "step"
    assert (f"(v5e-8: {step8['hbm_gib']:.2f} GiB)" in lines["step engine, one slot a chip"]
            and f"; {step8['collective_ops']} on v5e-8)" in lines["step engine, one slot a chip"])

    def roofline(r):
        return f"{r['images_per_s_per_chip']:.2f}-{r['hbm_images_per_s_per_chip']:.2f}"
    assert (f"v5e {roofline(lightning['v5e-8'])}, v6e {roofline(lightning['v6e'])}"
            in lines["SDXL-Lightning, 4 steps (2)"])
    assert f"v6e {roofline(row('tpu-2026-12-06b/composed.jsonl'))}" in lines[
        "SDXL base, 20 steps, CFG 8 (2)"]


def test_preview_cost_times_all_three_settings(sdxl_dir, tmp_path):
    """benchmarks.preview_cost's round on the tiny model with a tiny random TAESD: every setting
    runs (the previews' programs compile in the warm-up) and is priced against no previews."""
    import torch
    from diffusers import AutoencoderTiny

    from benchmarks.preview_cost import SETTINGS, one_round

    torch.manual_seed(0)
    AutoencoderTiny(encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                    num_encoder_blocks=(1, 1), num_decoder_blocks=(1, 1)).save_pretrained(
        tmp_path / "taesd")
    out = one_round(str(sdxl_dir), str(tmp_path / "taesd"), reps=1, size=32)
    assert set(out) == set(SETTINGS) and out["none"]["vs_none"] == 1.0
    assert all(r["s_per_image"] > 0 for r in out.values())


def test_published_step_vs_batch_figures_come_from_their_logs():
    """Every step-against-batch figure the pages publish is computed from committed JSON: both
    workloads from the alternated runs (benchmarks.loadgen_alternate: capacity intervals over
    three rounds, equal-load latency ratios; each run's summary.json is that computation); the
    2026-12-03 run's table (one run, benchmarks.loadgen_intervals), which the benchmarks page
    keeps as history, from its own JSON."""
    from benchmarks import loadgen_alternate, loadgen_intervals

    runs = {}
    for wl in ("uniform", "mixed"):
        run = ROOT / "docs/results/loadgen-2026-12-06" / wl
        reports = loadgen_alternate.read_run(run)
        assert sorted(reports) == [(k, e) for k in range(3) for e in ("batch", "step")]
        runs[wl] = loadgen_alternate.summarise(reports)
        assert json.loads(json.dumps(runs[wl])) == json.loads((run / "summary.json").read_text())
    old = loadgen_intervals.summary(json.loads(
        (ROOT / "docs/results/loadgen-2026-12-03/loadgen.json").read_text()))
    assert old["uniform"]["batch"]["capacity"] == (17.2931, 19.2145)  # held, failed
    uniform, mixed = ("{:.2f}–{:.2f}×".format(*runs[wl][wl]["ratio"])
                      for wl in ("uniform", "mixed"))
    pages = {p: (ROOT / p).read_text() for p in ("README.md", "docs/performance.md",
                                                  "docs/service.md", "docs/benchmarks.md")}
    assert f"{uniform} / {mixed}" in pages["README.md"]
    for wl in ("uniform", "mixed"):
        assert loadgen_alternate.table(runs[wl]) in pages["docs/benchmarks.md"], wl
    assert loadgen_intervals.table(old) in pages["docs/benchmarks.md"]

    def pair(ratios, q):
        return "{:.2f}–{:.2f}×".format(*ratios[f"{q}_ratio"])

    pages = {p: " ".join(text.split()) for p, text in pages.items()}  # prose wraps anywhere
    for page in ("docs/performance.md", "docs/service.md"):
        assert uniform in pages[page] and mixed in pages[page], page
    u, m = runs["uniform"]["uniform"], runs["mixed"]["mixed"]
    assert f"p50 {pair(u, 'p50')}, p99 {pair(u, 'p99')}" in pages["docs/performance.md"]
    at15 = u["by_rate"]["15"]
    assert f"15/s, which both held in every round: p50 {pair(at15, 'p50')}, p99 " \
        f"{pair(at15, 'p99')}" in pages["docs/performance.md"]
    at5 = m["by_rate"]["5"]
    for page in ("docs/performance.md", "docs/service.md"):
        assert f"p50 {pair(m, 'p50')}, p99 {pair(m, 'p99')}" in pages[page], page
    for page in ("docs/performance.md", "docs/benchmarks.md"):
        assert f"5/s: p50 {pair(at5, 'p50')}, p99 {pair(at5, 'p99')}" in pages[page], page


def test_feature_cache_benchmark_times_every_setting_and_prices_the_loop(sdxl_dir):
    """benchmarks.feature_cache's process on the tiny model: every setting runs and is priced
    against the uncached run (speed-up and PSNR); the TPU pricing counts each loop's calls as
    pipelines.loop.denoise makes them."""
    from benchmarks.feature_cache import SETTINGS, loop_calls, one_process

    out = one_process(str(sdxl_dir), size=32, steps=4, reps=1)
    assert out.pop("matmul_peak_gflops") > 0
    assert set(out) == set(SETTINGS) and out["uncached"]["speedup"] == 1.0
    assert out["uncached"]["psnr_db"] == float("inf")
    assert all(r["s_per_image"] > 0 for r in out.values())
    assert all(0 < r["psnr_db"] < float("inf") for k, r in out.items() if k != "uncached")
    assert loop_calls(30, SETTINGS["uncached"]) == {(True, True): 30}
    assert loop_calls(30, SETTINGS["deepcache3"]) == {(True, True): 10, (True, False): 20}
    assert loop_calls(30, SETTINGS["cutoff0.5"]) == {(True, True): 15, (False, True): 15}
    assert loop_calls(7, {"deepcache_interval": 3, "cfg_cutoff": 0.5}) == {
        (True, True): 1, (True, False): 2, (False, True): 2, (False, False): 2}


def test_published_feature_cache_figures_come_from_the_committed_json():
    """The feature-caching speed-ups, TPU loop times and quality the pages publish are the
    committed runs' (docs/results/feature-cache-2026-12-06/)."""
    import statistics

    from benchmarks.feature_cache import ACCURACY_DROP_MAX, PSNR_MIN_DB

    res = ROOT / "docs/results/feature-cache-2026-12-06"
    perf = (ROOT / "docs/performance.md").read_text()
    speed = json.loads((res / "speed.json").read_text())
    for name, label in (("deepcache3", "`deepcache_interval=3`"), ("cutoff0.5", "`cfg_cutoff=0.5`"),
                        ("both", "both")):
        v = sorted(r[name]["speedup"] for r in speed["runs"])
        mmm = f"{v[0]:.2f}–{statistics.median(v):.2f}–{v[-1]:.2f}×"
        assert [round(x, 2) for x in speed["speedup_min_median_max"][name]] == [
            round(v[0], 2), round(statistics.median(v), 2), round(v[-1], 2)]
        row = next(line for line in perf.splitlines() if line.startswith(f"| {label} |")
                   and "dB |" in line and "PSNR" not in line and "%" not in line)
        assert mmm in row, (name, row)
    tpu = json.loads((res / "tpu-v5e-2x2.json").read_text())["settings"]
    for name, label in (("deepcache3", "`deepcache_interval=3`"), ("cutoff0.5", "`cfg_cutoff=0.5`")):
        r = tpu[name]
        assert (f"| {label} | {r['roofline_s']:.2f} s | " in perf
                and f"{r['speedup']:.2f}×" in perf and f"{r['hbm_speedup']:.2f}×" in perf), name
    quality = json.loads((res / "quality.json").read_text())
    assert (quality["psnr_min_db"], quality["accuracy_drop_max"]) == (PSNR_MIN_DB,
                                                                      ACCURACY_DROP_MAX)
    for name, r in quality["settings"].items():
        assert r["passes"]
        if name != "uncached":
            assert f"{r['psnr_mean_db']:.1f} dB ({r['psnr_min_db']:.1f})" in perf, name


def test_published_openvino_figures_come_from_the_committed_json():
    """The OpenVINO table in docs/benchmarks.md is the committed run's summary
    (docs/results/openvino-2026-12-06/), recomputed from its rounds."""
    from benchmarks.openvino_peer import summarise

    run = json.loads((ROOT / "docs/results/openvino-2026-12-06/ov-peer.json").read_text())
    assert run["check"]["passed"] and run["summary"] == summarise(run["rounds"])
    page = (ROOT / "docs/benchmarks.md").read_text()
    for side, label in (("maxdiff", "maxdiff (float32)"), ("openvino-f32", "OpenVINO f32"),
                        ("openvino-default", "OpenVINO default (bf16)")):
        v = run["summary"]["sides"][side]["min_median_max"]
        row = next(line for line in page.splitlines() if line.startswith(f"| {label} |"))
        assert f"{v['min']:.3f}–{v['median']:.3f}–{v['max']:.3f}" in row, row
        if side != "maxdiff":
            r = run["summary"]["ratios"][f"maxdiff/{side}"]["min_median_max"]
            assert f"{r['min']:.2f}–{r['median']:.2f}–{r['max']:.2f}×" in row, row


def test_alternating_loadgen_rounds_summarised_as_intervals():
    """benchmarks.loadgen_alternate: the engines' order swaps every round; each round's
    capacity bracket comes from LoadGen's verdicts at the rates (held: kept up, no error, p99
    in bound), and over the rounds each capacity and the step/batch ratio is an interval."""
    import math

    from benchmarks.loadgen_alternate import bracket, order, summarise, table

    assert [order(k) for k in range(3)] == [("batch", "step"), ("step", "batch"),
                                          ("batch", "step")]

    def runs(held_up_to: float, bound: float = 5.0, lat: float = 1.0) -> dict:
        return {f"{q:g}": {"kept_up": q <= held_up_to, "errors": 0, "p50_s": lat * q / 40,
                           "p99_s": lat * q / 20 if q <= held_up_to else 2 * bound}
                for q in (17, 19, 21, 23)}

    assert bracket(runs(19), 5.0) == (19, 21)
    assert bracket(runs(30), 5.0) == (23, math.inf)
    assert bracket(runs(0), 5.0) == (0.0, 17)

    def report(engine, held_up_to, lat=1.0):
        return {"p99_bound_s": 5.0,
                "engines": {engine: {"uniform": {"at_rate": runs(held_up_to, lat=lat)}}}}

    reports = {(0, "batch"): report("batch", 17), (0, "step"): report("step", 21, 1.5),
               (1, "batch"): report("batch", 19), (1, "step"): report("step", 21, 2.0)}
    summary = summarise(reports)
    s = summary["uniform"]
    assert [r["first"] for r in s["rounds"]] == ["batch", "step"]
    assert s["rounds"][0]["ratio"] == (21 / 19, 23 / 17)
    assert s["batch"] == (17, 21) and s["step"] == (21, 23)
    assert s["ratio"] == (min(21 / 19, 21 / 21), max(23 / 17, 23 / 19))
    # equal load: the highest rate both held in each round (17, then 19)
    assert [r["equal_rate"] for r in s["rounds"]] == [17, 19]
    assert s["p50_ratio"] == pytest.approx((1.5, 2.0)) and s["p99_ratio"] == pytest.approx(
        (1.5, 2.0))
    assert "| uniform | 17–21 | 21–23 | 1.00–1.35× | 1.50–2.00×, 1.50–2.00× |" in table(summary)
    # and at every rate both held in every round (17 only)
    assert s["by_rate"] == {"17": {"p50_ratio": pytest.approx((1.5, 2.0)),
                                   "p99_ratio": pytest.approx((1.5, 2.0))}}


def test_cpu_bf16_convolution_probe_runs_both_dtypes():
    """benchmarks.cpu_bf16_flags' convolution probe on a small shape: both dtypes timed, and
    each one's output fingerprinted (how a flag that changes the kernel is told apart)."""
    from benchmarks.cpu_bf16_flags import conv_rates

    out = conv_rates(8, 4, reps=1)
    assert out["float32"] > 0 and out["bfloat16"] > 0
    assert abs(out["float32_sum"] - out["bfloat16_sum"]) < 0.05 * abs(out["float32_sum"]) + 1


def test_published_cpu_bf16_convolution_run_is_read_as_its_host_allows():
    """The 2026-12-07 convolution rows came from a host without AVX-512 (its /proc/cpuinfo
    flags are committed beside them), so the pages draw no bf16 conclusion from them: they say
    convolutions are not measured on an AVX512-BF16 host yet, and only which flags made a
    library take the convolutions (YNNPACK's, in every round)."""
    run = ROOT / "docs/results/cpu-bf16-2026-12-07"
    flags = next(line for line in (run / "cpuinfo.txt").read_text().splitlines()
                 if line.startswith("flags")).split()
    assert "avx2" in flags and not any(f.startswith("avx512") for f in flags)
    rows = json.loads((run / "flags.json").read_text())
    assert {r["round"] for r in rows} == {1, 2, 3} and not any("error" in r for r in rows)
    lib = [r for r in rows if r["flags"] != "(none)"]
    took = {r["flags"] for r in lib if not r["conv64@256_same_as_default"]}
    assert took and all("ynn" in f for f in took)
    perf = " ".join((ROOT / "docs/performance.md").read_text().split())
    assert "Convolutions are not measured on such a host yet" in perf
    assert "convolutions: not yet measured on an AVX512-BF16 host" in perf
    assert "no AVX-512" in (run / "README.md").read_text()


def test_how_far_float32_goes_is_the_compare_runs():
    """performance.md's float32 ceiling: each part's share of the matmul peak in the three
    compare.py runs, and the share a 1.5x pipeline / 1.3x VAE decode would need in those runs."""
    runs = json.loads((ROOT / "docs/results/compare-2026-12-03/repeats-3-compile-off.json")
                      .read_text())["runs"]
    page = " ".join((ROOT / "docs/performance.md").read_text().split())
    part = {p: [next(r for r in run if r["part"] == p) for run in runs]
            for p in ("pipeline", "vae", "unet")}

    def pct(rows, scale=None):
        v = [r["pct_peak"] * (scale / r["ratio"] if scale else 1) for r in rows]
        return f"{min(v):.0f}–{max(v):.0f} %"

    assert f"whole pipeline ran at {pct(part['pipeline'])} of the float32 matmul peak" in page
    assert f"VAE decode at {pct(part['vae'])} and a UNet step at {pct(part['unet'])}" in page
    assert f"1.5× diffusers' would need {pct(part['pipeline'], 1.5)} of that" in page
    assert f"1.3× diffusers' {pct(part['vae'], 1.3)}" in page


def test_published_v6e_task_fits_come_from_their_rows():
    """performance.md's v6e:2x2 figures for image-to-image, inpainting and ControlNet are the
    rows in docs/results/tpu-2026-12-07c: each compiled whole and fits, with the collectives
    the v5e:2x2 programs have (none; ControlNet's one scale flag)."""
    run = ROOT / "docs/results/tpu-2026-12-07c"
    rows = {p: json.loads((run / f"v6e-{p}/report.jsonl").read_text().splitlines()[0])
            for p in ("img2img", "inpaint", "controlnet")}
    perf = " ".join((ROOT / "docs/performance.md").read_text().replace("**", "").split())
    for program, r in rows.items():
        assert (r["program"], r["topology"], r["size"]) == (program, "v6e:2x2", 1024)
        assert r["compiled"] and r["fits"] and r["collective_ops"] == (program == "controlnet")
    edit, inpaint, net = rows["img2img"], rows["inpaint"], rows["controlnet"]
    assert f"{edit['hbm_gib']:.1f}" == f"{inpaint['hbm_gib']:.1f}"
    assert (f"image-to-image and inpainting {edit['hbm_gib']:.1f} GiB of 32 (weights "
            f"{edit['weights_gib']:.1f} GiB, temporaries {edit['temp_gib']:.1f} GiB), 0 "
            f"collectives; ControlNet {net['hbm_gib']:.1f} GiB, the same 1") in perf


def test_every_data_parallel_program_costs_a_v5e_8_chip_what_it_costs_a_v5e_4_chip():
    """docs/results/tpu-2026-12-07d/tiny-64: every served program compiled for v5e:2x2 and
    v5e:2x4 on the embedded model. The data-parallel ones keep their collectives (none;
    ControlNet's one flag) and their per-chip HBM (within 2 KiB), flops and bytes (within
    0.01 %) on twice the chips; the step engine, which moves slots between chips, does not."""
    rows = [json.loads(line) for line in
            (ROOT / "docs/results/tpu-2026-12-07d/tiny-64/report.jsonl").read_text().splitlines()]
    by = {(r["program"], r["topology"]): r for r in rows}
    assert {p for p, _ in by} == {"lightning", "base", "img2img", "inpaint", "controlnet", "step"}
    for program in ("lightning", "base", "img2img", "inpaint", "controlnet"):
        four, eight = by[program, "v5e:2x2"], by[program, "v5e:2x4"]
        assert (four["chips"], eight["chips"]) == (4, 8) and four["compiled"] and eight["compiled"]
        assert four["collectives"] == eight["collectives"] == by[program, "v6e:2x2"]["collectives"]
        assert eight["collective_ops"] == (1 if program == "controlnet" else 0), program
        for key in ("hbm_gib", "weights_gib", "temp_gib"):
            assert abs(eight[key] - four[key]) * 2**30 <= 2048, (program, key)
        for key in ("tflop_per_image", "gbytes_per_image", "hbm_gbytes_per_image"):
            if key in four:
                assert eight[key] == pytest.approx(four[key], rel=1e-4), (program, key)
    step4, step8 = by["step", "v5e:2x2"], by["step", "v5e:2x4"]
    assert step4["collective_ops"] != step8["collective_ops"]  # slots move between chips
    perf = " ".join((ROOT / "docs/performance.md").read_text().split())
    assert (f"({step4['collective_ops']} collectives on four chips, {step8['collective_ops']} on "
            "eight)") in perf

    # at full size, every data-parallel program compiled for both (base + refiner: the one
    # with the least room on a v5e chip)
    def first(path, n=0):
        return json.loads((ROOT / "docs/results" / path / "report.jsonl").read_text()
                          .splitlines()[n])
    pairs = {  # program -> (its v5e:2x2 row, its v5e:2x4 row)
        "refiner": (first("tpu-2026-12-07b/refiner"), first("tpu-2026-12-07d/v5e-2x4-refiner")),
        "img2img": (first("tpu-2026-12-06"), first("tpu-2026-12-07d/v5e-2x4-img2img")),
        "inpaint": (first("tpu-2026-12-07"), first("tpu-2026-12-07d/v5e-2x4-inpaint")),
        "controlnet": (first("tpu-2026-12-07", 1), first("tpu-2026-12-07d/v5e-2x4-controlnet")),
        "base": (first("tpu-2026-12-07b/v5e-base"), first("tpu-2026-12-07d/v5e-2x4-base"))}
    for program, (four, eight) in pairs.items():
        assert (four["chips"], eight["chips"]) == (4, 8), program
        assert four["program"] == eight["program"] == program
        for key in ("hbm_gib", "weights_gib", "temp_gib", "collectives"):
            assert four[key] == eight[key], (program, key)
    refiner8 = pairs["refiner"][1]
    assert f"base + refiner at full size compiled for v5e:2x4: {refiner8['hbm_gib']:.2f} GiB" in perf
    # the step engine at full size: its collectives and temporaries change with the chips
    four, eight = first("tpu-2026-12-07", 2), first("tpu-2026-12-07d/v5e-2x4-step")
    assert four["program"] == eight["program"] == "step" and (four["chips"], eight["chips"]) == (4, 8)
    assert four["weights_gib"] == eight["weights_gib"] and four["temp_gib"] < eight["temp_gib"]
    assert (f"{eight['collective_ops']} collectives on eight chips against "
            f"{four['collective_ops']} on four, and "
            f"{round((eight['temp_gib'] - four['temp_gib']) * 1024)} MiB more temporaries a chip "
            f"({eight['hbm_gib']:.2f} GiB") in perf
