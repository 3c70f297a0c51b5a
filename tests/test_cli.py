"""The ``maxdiff`` command line, end to end: the real console script in a subprocess on the tiny
checkpoint. Every generating run shares one shape where it can (32x32, 1 step, guidance on,
device batch 2) and one compile cache, so most runs reuse a compiled program."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from maxdiff.checkpoint import open_weights
from pipelines import cli, image_files, requests
from pipelines.cli.jobs import RunSettings, plan_jobs
from pipelines.cli.output import TMP_MARK
from pipelines.cli.prompts import read_prompts

REPO = Path(__file__).resolve().parent.parent
_SCRIPT = Path(sys.executable).parent / "maxdiff"
CLI = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "pipelines.cli"]
COMMON = ["--steps", "1", "--batch-size", "2"]  # with the model's 32x32 and guidance 5.0


@pytest.fixture(scope="module")
def env():
    """The run's compile cache and XLA flags (-O0) for every run (conftest.py sets
    MAXDIFF_COMPILE_CACHE and XLA_FLAGS): the tests compare runs with each other, never with
    another optimisation level."""
    e = dict(os.environ, PYTHONPATH=str(REPO))
    e.pop("MAXDIFF_DEFAULT_MODEL", None)
    return e


def _one_cpu():
    """Pin a run to one CPU: XLA:CPU with several intra-op threads can differ in the last bit
    between runs (jax-ml/jax#39741), which now and then moves a pixel by one level and would make
    the byte-for-byte comparisons flaky. On one thread every run is bit-identical."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def run(env, *args, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + [str(a) for a in args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=_one_cpu)


def metadata(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metadata.jsonl").read_text().splitlines()]


def images(out: Path, ext="png") -> list[str]:
    return sorted(p.name for p in out.glob(f"*.{ext}"))


@pytest.fixture(scope="module")
def text_run(sdxl_dir, env, tmp_path_factory):
    """One positional prompt plus a text file with a comment and a blank line, 2 images each."""
    d = tmp_path_factory.mktemp("text-run")
    prompts = d / "prompts.txt"
    prompts.write_text("# a comment line\na red circle\n\n  the cat on a blue square  \n")
    args = ["generate", "a photo of a dog", "--prompts", prompts, "--model", sdxl_dir, *COMMON,
            "--num-images", "2", "--seed", "7"]
    res = run(env, *args, "--out", d / "out")
    assert res.returncode == 0, res.stderr
    return d / "out", args, res


@pytest.fixture(scope="module")
def converted(sdxl_dir, env, tmp_path_factory):
    """``maxdiff convert`` of the tiny checkpoint to float32 and to bfloat16."""
    d = tmp_path_factory.mktemp("converted")
    for dtype in ("float32", "bf16"):
        res = run(env, "convert", sdxl_dir, d / dtype, "--dtype", dtype)
        assert res.returncode == 0, res.stderr
    assert not [p for p in d.iterdir() if TMP_MARK in p.name]
    return d / "float32", d / "bf16"


# ---------------------------------------------------------------------------------- generate
def test_text_prompts_files_metadata_and_png_chunks(text_run, sdxl_dir):
    out, _, res = text_run
    names = images(out)
    assert len(names) == 6
    assert [n[:8] for n in names] == ["00000-00", "00000-01", "00001-00", "00001-01",
                                      "00002-00", "00002-01"]
    assert names[2].startswith("00001-00-a-red-circle-")
    recs = metadata(out)
    assert sorted(r["file"] for r in recs) == names
    by_file = {r["file"]: r for r in recs}
    assert [by_file[n]["prompt"] for n in names[::2]] == [
        "a photo of a dog", "a red circle", "the cat on a blue square"]
    assert len({r["seed"] for r in recs}) == 6 and all(r["run_seed"] == 7 for r in recs)
    for r in recs:
        assert (r["steps"], r["guidance"], r["size"], r["dtype"]) == (1, 5.0, "32x32", "float32")
        assert r["scheduler"] == "EulerDiscreteScheduler" and r["model"] == str(sdxl_dir.resolve())
        assert r["negative_prompt"] is None and r["time"] and r["id"][:8] in r["file"]
        with Image.open(out / r["file"]) as im:
            assert im.size == (32, 32)
            text = dict(im.text)
        assert text["prompt"] == r["prompt"] and text["seed"] == str(r["seed"])
        assert (text["steps"], text["guidance"], text["size"]) == ("1", "5.0", "32x32")
        assert text["model"] == r["model"] and "negative_prompt" not in text
    assert "done: 6 new image(s)" in res.stderr and "img/s" in res.stderr


def test_same_command_reproduces_the_same_bytes(text_run, env, tmp_path):
    out, args, _ = text_run
    res = run(env, *args, "--out", tmp_path / "again", "--quiet")
    assert res.returncode == 0, res.stderr
    assert "%|" not in res.stderr  # --quiet: no progress bar, plain log lines
    assert images(tmp_path / "again") == images(out)
    for name in images(out):
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes(), name


def test_jsonl_per_line_overrides_and_webp(converted, env, tmp_path):
    """On the bfloat16-converted checkpoint, which so shows that it loads and runs."""
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("\n".join([
        json.dumps({"prompt": "a red circle", "seed": 5, "n": 2}),
        "# the next line has its own negative prompt and guidance",
        json.dumps({"prompt": "a blue square", "negative_prompt": "green", "guidance": 3.0}),
        "",
        json.dumps({"prompt": "the cat", "size": "16x24", "steps": 2, "seed": 11}),
        json.dumps({"prompt": "a dog"}),
    ]) + "\n")
    out = tmp_path / "out"
    res = run(env, "generate", "--prompts", jobs, "--model", converted[1], *COMMON, "--seed", "1",
              "--negative", "blurry", "--format", "webp", "--out", out)
    assert res.returncode == 0, res.stderr
    recs = {(r["line"], r["image"]): r for r in metadata(out)}
    assert sorted(recs) == [(0, 0), (0, 1), (1, 0), (2, 0), (3, 0)]
    assert [recs[0, k]["seed"] for k in (0, 1)] == [5, 6]  # a line's seed: seed, seed+1, ...
    assert recs[1, 0]["negative_prompt"] == "green" and recs[1, 0]["guidance"] == 3.0
    assert recs[3, 0]["negative_prompt"] == "blurry" and recs[3, 0]["guidance"] == 5.0
    assert recs[3, 0]["seed"] == requests.derive_seed(1, 3, 0)
    assert recs[2, 0]["source"] == f"{jobs}:5" and recs[2, 0]["model"] == str(converted[1])
    assert (recs[2, 0]["steps"], recs[2, 0]["size"]) == (2, "16x24")
    assert sorted(r["file"] for r in recs.values()) == images(out, "webp")
    with Image.open(out / recs[2, 0]["file"]) as im:
        assert im.format == "WEBP" and im.size == (16, 24)
    info = image_files.read_image_info(out / recs[1, 0]["file"])
    assert info["negative_prompt"] == "green" and info["seed"] == str(recs[1, 0]["seed"])


def _python_api(env, model, tmp_path, common: str, kws: list[dict]) -> np.ndarray:
    """``pipe('a red circle', seed=5, <common>, **kw)``'s image for each of ``kws``, made by
    the Python API in another process (JAX in this one would be forked by later runs)."""
    script = (
        "import sys, numpy as np\n"
        "from pipelines import TextToImagePipeline\n"
        "pipe = TextToImagePipeline.from_pretrained(sys.argv[1])\n"
        f"kws = {kws!r}\n"
        f"np.save(sys.argv[2], np.stack([np.asarray(pipe('a red circle', seed=5, {common}, "
        "**kw).images[0]) for kw in kws]))\n")
    res = subprocess.run([sys.executable, "-c", script, str(model), str(tmp_path / "ref.npy")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    return np.load(tmp_path / "ref.npy").astype(int)


def test_feature_caching_flags_and_lines_give_the_python_apis_pixels(sdxl_dir, env, tmp_path):
    """--deepcache-interval for the run, a JSONL line's own cfg_cutoff and deepcache_interval:
    each image equals the Python API's with the same keywords (to one level: the CLI runs on
    one CPU thread), and its metadata and PNG text chunks record them (only where on)."""
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("\n".join(json.dumps(d) for d in [
        {"prompt": "a red circle", "seed": 5},  # the run's --deepcache-interval 2
        {"prompt": "a red circle", "seed": 5, "deepcache_interval": 1, "cfg_cutoff": 0.5},
    ]) + "\n")
    out = tmp_path / "out"
    res = run(env, "generate", "--prompts", jobs, "--model", sdxl_dir, "--steps", "2",
              "--batch-size", "2", "--deepcache-interval", "2", "--out", out)
    assert res.returncode == 0, res.stderr
    recs = {r["line"]: r for r in metadata(out)}
    assert recs[0]["deepcache_interval"] == 2 and "cfg_cutoff" not in recs[0]
    assert recs[1]["cfg_cutoff"] == 0.5 and "deepcache_interval" not in recs[1]
    info = image_files.read_image_info(out / recs[0]["file"])
    assert info["deepcache_interval"] == "2" and "cfg_cutoff" not in info
    *ours, plain = _python_api(env, sdxl_dir, tmp_path, "num_inference_steps=2",
                               [dict(deepcache_interval=2), dict(cfg_cutoff=0.5), {}])
    for line, mine in enumerate(ours):
        got = np.asarray(Image.open(out / recs[line]["file"]).convert("RGB"), int)
        assert np.abs(got - mine).max() <= 1, line
        assert np.abs(got - plain).max() > 1, line  # the setting changed the image


@pytest.mark.slow  # default-suite time: make test-slow runs it
def test_hires_fix_flags_and_lines_give_the_python_apis_pixels(sdxl_dir, env, tmp_path):
    """--hires-scale / --hires-strength for the run, a JSONL line's own hires_scale and
    hires_steps: each image equals the Python API's with the same keywords (to one level) and
    its PNG text chunks record them."""
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("\n".join(json.dumps(d) for d in [
        {"prompt": "a red circle", "seed": 5},  # the run's --hires-scale 2 --hires-strength 0.6
        {"prompt": "a red circle", "seed": 5, "hires_scale": 1.5, "hires_steps": 3},
    ]) + "\n")
    out = tmp_path / "out"
    res = run(env, "generate", "--prompts", jobs, "--model", sdxl_dir, "--steps", "2",
              "--size", "64x64", "--hires-scale", "2", "--hires-strength", "0.6", "--out", out)
    assert res.returncode == 0, res.stderr
    recs = {r["line"]: r for r in metadata(out)}
    info = image_files.read_image_info(out / recs[1]["file"])
    assert (info["hires_scale"], info["hires_strength"], info["hires_steps"]) == \
        ("1.5", "0.6", "3")
    ours = _python_api(env, sdxl_dir, tmp_path, "height=64, width=64, num_inference_steps=2, "
                       "hires_strength=0.6", [dict(hires_scale=2.0),
                                              dict(hires_scale=1.5, hires_steps=3)])
    for line, mine in enumerate(ours):
        got = np.asarray(Image.open(out / recs[line]["file"]).convert("RGB"), int)
        assert np.abs(got - mine).max() <= 1, line


def test_bad_feature_caching_values_exit_2_naming_the_field(sdxl_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["generate", "x", "--deepcache-interval", "0", "--out", str(out)]) == 2
    assert "argument --deepcache-interval: must be an integer in 1..100" in \
        capsys.readouterr().err
    assert cli.main(["generate", "x", "--cfg-cutoff", "1.5", "--out", str(out)]) == 2
    assert "argument --cfg-cutoff: must be a number in (0, 1]" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "cfg_cutoff": 0}) + "\n"
                   + json.dumps({"prompt": "x", "deepcache_interval": 2.5}) + "\n")
    assert cli.main(["generate", "--prompts", str(bad), "--model", str(sdxl_dir),
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:1: field 'cfg_cutoff': must be a number in (0, 1]" in err
    assert f"{bad}:2: field 'deepcache_interval': must be an integer in 1..100" in err
    assert not out.exists()


def test_feature_caching_of_a_line_overrides_the_runs():
    s = RunSettings(model="m", scheduler="s", dtype="float32", steps=1, guidance=5.0,
                    width=32, height=32, run_seed=0, cfg_cutoff=0.5)
    lines = read_prompts(file="p.jsonl", file_text="\n".join(json.dumps(d) for d in [
        {"prompt": "a"}, {"prompt": "a", "cfg_cutoff": 0.25, "deepcache_interval": 3}]))
    jobs = plan_jobs(lines, s)
    assert [(j.request().cfg_cutoff, j.request().deepcache_interval) for j in jobs] == [
        (0.5, 1), (0.25, 3)]
    plain = plan_jobs(lines[:1], RunSettings(**{**s.__dict__, "cfg_cutoff": None}))
    assert jobs[0].id != plain[0].id  # another setting, another file


def test_hires_fix_of_a_line_overrides_the_runs_and_is_its_own_file():
    s = RunSettings(model="m", scheduler="s", dtype="float32", steps=4, guidance=5.0,
                    width=64, height=64, run_seed=0, hires_scale=2.0, hires_strength=0.5)
    lines = read_prompts(file="p.jsonl", file_text="\n".join(json.dumps(d) for d in [
        {"prompt": "a"}, {"prompt": "a", "hires_scale": 1.5, "hires_steps": 6}]))
    jobs = plan_jobs(lines, s)
    assert [j.shape.hires for j in jobs] == [requests.HiresFix(2.0, 0.5),
                                             requests.HiresFix(1.5, 0.5, 6)]
    assert jobs[1].record()["hires_steps"] == 6 and "hires_steps" not in jobs[0].record()
    assert jobs[0].image_info()["hires_scale"] == "2.0"
    plain = plan_jobs(lines[:1], RunSettings(**{**s.__dict__, "hires_scale": None}))
    assert plain[0].shape.hires is None and "hires_scale" not in plain[0].record()
    assert jobs[0].id != plain[0].id  # another setting, another file


@pytest.mark.parametrize("line,match", [
    ({"prompt": "a", "hires_strength": 0.5}, "'hires_strength' and 'hires_steps' need "
     "'hires_scale'"),
    ({"prompt": "a", "hires_scale": 2, "hires_strength": 0.1}, "field 'hires_strength': with 4 "
     "step(s) leaves no denoising step"),
])
def test_bad_hires_lines_are_named(line, match):
    s = RunSettings(model="m", scheduler="s", dtype="float32", steps=4, guidance=5.0,
                    width=64, height=64, run_seed=0)
    lines = read_prompts(file="p.jsonl", file_text=json.dumps(line))
    with pytest.raises(cli.InputError, match=re.escape(match)):
        plan_jobs(lines, s)


def test_another_vae_is_another_image():
    """--vae changes the pixels: a resumed run with another VAE makes new files (the id holds
    it) and records it; runs without one keep the ids they had."""
    s = RunSettings(model="m", scheduler="s", dtype="float32", steps=1, guidance=5.0,
                    width=32, height=32, run_seed=0)
    lines = read_prompts(file="p.txt", file_text="a red circle")
    plain = plan_jobs(lines, s)[0]
    tiny = plan_jobs(lines, RunSettings(**{**s.__dict__, "vae": "/models/taesdxl"}))[0]
    assert tiny.id != plain.id and "vae" not in plain.record()
    assert tiny.record()["vae"] == tiny.image_info()["vae"] == "/models/taesdxl"


def test_resume_after_sigterm(sdxl_dir, env, tmp_path):
    """SIGTERM once the first image exists: exit 143, no temp files, only finished images kept
    (at most the batch in flight lost); a truncated last metadata line (as a SIGKILL leaves) is
    dropped; the rerun writes only the missing images and leaves finished ones untouched."""
    n = 24
    prompts = tmp_path / "many.txt"
    prompts.write_text("".join(f"a small red circle {i}\n" for i in range(n)))
    out = tmp_path / "out"
    args = ["generate", "--prompts", prompts, "--model", sdxl_dir, *COMMON, "--seed", "3",
            "--out", out, "--quiet"]
    proc = subprocess.Popen(CLI + [str(a) for a in args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_one_cpu)
    deadline = time.monotonic() + 150
    record = out / "metadata.jsonl"  # an image counts once its line is written (after its file)
    while not (record.is_file() and record.read_text().count("\n") >= 1):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no image appeared"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "interrupted by SIGTERM" in err and "Rerun the same command" in err
    assert not [p for p in out.iterdir() if TMP_MARK in p.name]
    first = metadata(out)
    assert 1 <= len(first) < n
    files = images(out)
    assert {r["file"] for r in first} <= set(files) and len(files) - len(first) <= 2
    mtimes = {r["file"]: (out / r["file"]).stat().st_mtime_ns for r in first}
    with open(out / "metadata.jsonl", "a") as f:
        f.write('{"line": 23, "image": 0, "prom')  # a line cut short by SIGKILL

    res = run(env, *args)
    assert res.returncode == 0, res.stderr
    assert "dropping an incomplete last line" in res.stderr
    assert f"{len(first)} already in" in res.stderr
    recs = metadata(out)  # every line parses: the cut line is gone
    assert len(recs) == n and recs[:len(first)] == first
    assert sorted(r["file"] for r in recs) == images(out) and len(images(out)) == n
    assert {r["line"] for r in recs} == set(range(n))
    for name, mtime in mtimes.items():
        assert (out / name).stat().st_mtime_ns == mtime, f"{name} was rewritten"


def test_bad_lines_are_all_reported_and_nothing_is_written(sdxl_dir, env, tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text("\n".join([
        json.dumps({"prompt": "fine"}),
        json.dumps({"negative_prompt": "no prompt here"}),
        json.dumps({"prompt": "x", "steps": -2}),
        "# comment",
        json.dumps({"prompt": "x", "size": "33x32"}),
        json.dumps({"prompt": "x", "stpes": 3}),
        '{"prompt": "unclosed',
        json.dumps({"prompt": "too many steps", "steps": 1001}),
    ]) + "\n")
    out = tmp_path / "out"
    res = run(env, "generate", "--prompts", bad, "--model", sdxl_dir, "--out", out)
    assert res.returncode == 2
    err = res.stderr
    assert f"{bad}:2: field 'prompt' is missing" in err
    assert f"{bad}:3: field 'steps': must be an integer >= 1, got -2" in err
    assert f"{bad}:5: field 'size': 33 is not a multiple of 2" in err
    assert f"{bad}:6: unknown field 'stpes'" in err
    assert f"{bad}:7: not valid JSON" in err
    assert (f"{bad}:8: field 'steps': must be an integer in 1..1000 (what "
            "EulerDiscreteScheduler allows), got 1001") in err
    assert f"{bad}:1" not in err
    assert not out.exists()
    # the run's own steps are checked against the scheduler before anything is loaded
    res = run(env, "generate", "fine", "--steps", "2000", "--model", sdxl_dir, "--out", out)
    assert res.returncode == 2 and "--steps: must be an integer in 1..1000 (what " \
        "EulerDiscreteScheduler allows), got 2000" in res.stderr, res.stderr
    lcm = tmp_path / "lcm.json"
    lcm.write_text(json.dumps({"_class_name": "LCMScheduler", "beta_schedule": "scaled_linear",
                               "beta_start": 0.00085, "beta_end": 0.012,
                               "original_inference_steps": 50}))
    res = run(env, "generate", "fine", "--steps", "51", "--scheduler", lcm, "--model", sdxl_dir,
              "--out", out)
    assert res.returncode == 2 and "in 1..50 (what LCMScheduler allows)" in res.stderr, res.stderr
    assert not out.exists()


def test_usage_errors_exit_2_with_a_clear_message(sdxl_dir, env, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    res = run(env, "generate", "a cat", "--model", sdxl_dir, "--out", a_file / "out")
    assert res.returncode == 2
    assert f"output folder {a_file / 'out'}" in res.stderr and "choose another --out" in res.stderr

    missing = tmp_path / "no-such-model"
    res = run(env, "generate", "a cat", "--model", missing, "--out", tmp_path / "o")
    assert res.returncode == 2 and f"model {missing}: no such folder" in res.stderr

    res = run(dict(env, MAXDIFF_DEFAULT_MODEL=str(missing)), "info")
    assert res.returncode == 2 and f"no default model at {missing}" in res.stderr
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------- editing
def _edit_files(d: Path) -> dict[str, Path]:
    """A 32x32 picture, a white = repaint mask (left half) and a 16x16 mask, in ``d/in``."""
    (d / "in").mkdir()
    rng = np.random.default_rng(0)
    white = np.zeros((32, 32), np.uint8)
    white[:, :16] = 255
    files = {"image": (rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), "photo.png"),
             "mask": (white, "mask.png"), "small": (white[:16, :16], "small.png")}
    out = {}
    for k, (a, name) in files.items():
        Image.fromarray(a).save(d / "in" / name)
        out[k] = d / "in" / name
    return out


@pytest.mark.slow  # default-suite time: make test-slow runs it
def test_image_and_mask_edits(sdxl_dir, env, tmp_path):
    """--image (image-to-image), --image with --mask (inpainting) and JSONL lines with image,
    mask and strength (paths relative to the file): images of the input's size, metadata with
    the mode, input paths and strength; a rerun skips them all."""
    f = _edit_files(tmp_path)
    jobs = tmp_path / "in" / "jobs.jsonl"
    jobs.write_text("\n".join([
        json.dumps({"prompt": "a red hat", "image": "photo.png", "mask": "mask.png",
                    "strength": 1.0, "seed": 3}),
        json.dumps({"prompt": "a cat"}),
    ]) + "\n")
    out = tmp_path / "out"
    args = ["generate", "a watercolor", "--image", f["image"], "--strength", "0.5", "--prompts",
            jobs, "--model", sdxl_dir, "--steps", "2", "--batch-size", "2", "--seed", "5",
            "--out", out]
    res = run(env, *args, timeout=300)
    assert res.returncode == 0, res.stderr
    meta = metadata(out)
    assert len(meta) == 3 and len(images(out)) == 3
    by_prompt = {m["prompt"]: m for m in meta}
    edit = by_prompt["a watercolor"]
    assert (edit["mode"], edit["strength"], edit["input_image"], edit["mask"]) == (
        "img2img", 0.5, str(f["image"].resolve()), None)
    inpaint = by_prompt["a red hat"]
    assert (inpaint["mode"], inpaint["strength"], inpaint["seed"]) == ("inpaint", 1.0, 3)
    assert inpaint["mask"] == str(f["mask"].resolve())
    # a line without an image of its own takes --image and --strength
    assert (by_prompt["a cat"]["mode"], by_prompt["a cat"]["strength"]) == ("img2img", 0.5)
    for m in meta:
        assert Image.open(out / m["file"]).size == (32, 32)
        info = image_files.read_image_info(out / m["file"])
        assert info["mode"] == m["mode"] and float(info["strength"]) == m["strength"]
    a, b = (np.asarray(Image.open(out / by_prompt[p]["file"]), int) for p in ("a watercolor",
                                                                               "a cat"))
    assert not np.array_equal(a, b)
    res = run(env, *args, timeout=300)  # resume: nothing new
    assert res.returncode == 0 and "0 to generate" in res.stderr, res.stderr
    assert len(metadata(out)) == 3


def test_edit_errors_exit_2_before_loading(sdxl_dir, env, tmp_path):
    f = _edit_files(tmp_path)
    out = tmp_path / "out"
    cases = [
        (["--image", tmp_path / "nope.png"], f"--image {tmp_path / 'nope.png'}: cannot read it"),
        (["--image", f["image"], "--mask", f["small"]],
         f"--mask {f['small']} is 16x16 but --image {f['image']} is 32x32"),
        (["--image", f["image"], "--strength", "1.5"], "--strength: must be a number in (0, 1]"),
        (["--mask", f["mask"]], "a mask needs an image to edit (--image)"),
        (["--image", f["image"], "--strength", "0.3", "--steps", "1"],
         "prompt argument 1: strength=0.3: with 1 step(s) leaves no denoising step"),
    ]
    for extra, message in cases:
        res = run(env, "generate", "a cat", "--model", sdxl_dir, "--out", out, *extra)
        assert res.returncode == 2 and message in res.stderr, (extra, res.stderr)
        assert "loaded" not in res.stderr and not out.exists()
    jobs = tmp_path / "in" / "jobs.jsonl"
    jobs.write_text("\n".join([
        json.dumps({"prompt": "x", "image": "photo.png", "mask": "small.png"}),
        json.dumps({"prompt": "x", "image": "missing.png"}),
        json.dumps({"prompt": "x", "image": "photo.png", "strength": 0}),
        json.dumps({"prompt": "x", "mask": "mask.png"}),
    ]) + "\n")
    res = run(env, "generate", "--prompts", jobs, "--model", sdxl_dir, "--out", out)
    assert res.returncode == 2, res.stderr
    err = res.stderr
    assert f"{jobs}:1: field 'mask' mask.png".replace("mask.png", "small.png") in err
    assert "is 16x16 but field 'image' photo.png is 32x32" in err
    assert f"{jobs}:2: field 'image' missing.png: cannot read it" in err
    assert f"{jobs}:3: field 'strength': must be a number in (0, 1] (" in err
    assert "small values stay close to the image), got 0" in err
    assert f"{jobs}:4: field 'mask' mask.png: a mask needs an image to edit" in err
    assert "loaded" not in err and not out.exists()


# ---------------------------------------------------------------------------------- convert, info
def test_convert_roundtrip_and_info(converted, text_run, sdxl_dir, env, tmp_path):
    import torch
    from diffusers import StableDiffusionXLPipeline

    fp32, bf16 = converted
    for comp, stem in (("unet", "diffusion_pytorch_model"), ("vae", "diffusion_pytorch_model"),
                       ("text_encoder", "model"), ("text_encoder_2", "model")):
        orig = open_weights(sdxl_dir / comp)
        conv = open_weights(bf16 / comp / f"{stem}.safetensors")
        assert sorted(conv.keys()) == sorted(orig.keys())
        for k in orig.keys():
            assert str(conv.get(k).dtype) == "bfloat16" and conv.get(k).shape == orig.get(k).shape
        config = (fp32 / comp / "config.json").read_bytes()
        assert config == (sdxl_dir / comp / "config.json").read_bytes()
    assert (bf16 / "tokenizer_2" / "tokenizer.json").is_file()
    assert (bf16 / "scheduler" / "scheduler_config.json").is_file()
    torch_pipe = StableDiffusionXLPipeline.from_pretrained(bf16, dtype=torch.bfloat16)
    assert torch_pipe.unet.dtype == torch.bfloat16  # still a folder diffusers loads

    # float32: the same pixels as the original checkpoint (line 0 of text_run: same seeds)
    out, _, _ = text_run
    res = run(env, "generate", "a photo of a dog", "--model", fp32, *COMMON, "--num-images", "2",
              "--seed", "7", "--out", tmp_path / "out", "--quiet")
    assert res.returncode == 0, res.stderr
    ours = images(tmp_path / "out")
    theirs = [n for n in images(out) if n.startswith("00000-")]
    assert len(ours) == len(theirs) == 2
    for a, b in zip(ours, theirs):
        assert np.array_equal(np.asarray(Image.open(tmp_path / "out" / a)),
                              np.asarray(Image.open(out / b)))

    res = run(env, "info", "--model", bf16)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    for comp in ("unet", "vae", "text_encoder", "text_encoder_2", "total"):
        assert comp in text
    src = open_weights(sdxl_dir / "unet")
    n_unet = sum(int(np.prod(src.get(k).shape)) for k in src.keys())
    unet_row = next(line for line in text.splitlines() if line.startswith("unet "))
    assert f"{n_unet:,}" in unet_row and "float32" in unet_row and "bfloat16" in unet_row
    assert "UNet2DConditionModel" in unet_row and "cpu" in text


# ---------------------------------------------------------------------------------- in-process
def test_help_has_examples(capsys):
    assert cli.main(["generate", "--help"]) == 0
    text = capsys.readouterr().out
    assert "examples:" in text and "--prompts" in text and "metadata.jsonl" in text
    assert cli.main([]) == 2


def test_scheduler_help_names_every_sampler(capsys):
    """--scheduler's help (a fixed text: the parser imports no JAX) lists every sampler's short
    name maxdiff.schedulers.names knows."""
    from maxdiff.schedulers import SAMPLERS

    assert cli.main(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    help_text = text[text.index("--scheduler NAME"):]
    help_text = help_text[:help_text.index(" --dtype")]
    assert set(SAMPLERS) <= set(help_text.replace(",", " ").split())
    assert "'DPM++ 2M Karras'" in help_text and "lightning-1step" in help_text


def test_seeds_do_not_shift_when_lines_are_added():
    s = RunSettings(model="m", scheduler="s", dtype="float32", steps=1, guidance=5.0,
                          width=32, height=32, run_seed=9, num_images=2)
    few = plan_jobs(read_prompts(["a", "b"]), s)
    more = plan_jobs(read_prompts(["a", "b", "c"]), s)
    assert [(j.seed, j.file) for j in few] == [(j.seed, j.file) for j in more[:4]]
    assert len({j.seed for j in more}) == 6


def test_batches_group_by_shape_and_pad_to_one_bucket():
    s = RunSettings(model="m", scheduler="s", dtype="float32", steps=1, guidance=5.0,
                          width=32, height=32, run_seed=0)
    lines = read_prompts(file="p.jsonl", file_text="\n".join(json.dumps(d) for d in [
        {"prompt": "a", "n": 3}, {"prompt": "b", "guidance": 0}, {"prompt": "c"}]))
    got = [(shape, [j.line.index for j in jobs], bucket)
           for shape, jobs, bucket in requests.plan_batches(plan_jobs(lines, s),
                                                            lambda j: j.shape, 2)]
    assert got == [(requests.ShapeKey(32, 32, 1, True), [0, 0], 2),
                   (requests.ShapeKey(32, 32, 1, True), [0, 2], 2),
                   (requests.ShapeKey(32, 32, 1, False), [1], 1)]


def test_convert_refuses_an_existing_destination_unless_forced(sdxl_dir, tmp_path, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old-file").write_text("")
    assert cli.main(["convert", str(sdxl_dir), str(dst), "--dtype", "fp16"]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert cli.main(["convert", str(sdxl_dir), str(dst), "--dtype", "fp16", "--force"]) == 0
    assert not (dst / "old-file").exists() and (dst / "model_index.json").is_file()
    assert str(open_weights(dst / "vae").get("decoder.conv_in.weight").dtype) == "float16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # no temp folders left
    assert cli.main(["convert", str(tmp_path / "nope"), str(tmp_path / "x")]) == 2


def test_a_regular_install_works_from_another_folder(tmp_path):
    """The wheel (not the source tree) carries the named configs and the embedded model:
    installed with ``pip install --target`` and run from an unrelated folder,
    ``maxdiff generate --config demo`` writes an image."""
    root = Path(__file__).resolve().parent.parent
    wheels, target, work = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    work.mkdir()
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                            str(wheels), str(root)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel, = wheels.glob("maxdiff-*.whl")
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=600)
    assert inst.returncode == 0, inst.stderr[-3000:]
    assert (target / "maxdiff" / "configs" / "demo.yaml").is_file()
    assert (target / "maxdiff" / "assets" / "demo-model" / "maxdiff.json").is_file()
    shipped = target / "maxdiff" / "assets" / "configs" / "sdxl-base"  # single files' configs
    assert all((shipped / c / "config.json").is_file()
               for c in ("unet", "vae", "text_encoder", "text_encoder_2"))
    assert (shipped / "scheduler" / "scheduler_config.json").is_file()
    assert "<title>maxdiff playground</title>" in (target / "serving" / "playground.html"
                                                   ).read_text()  # the service's page at /
    from conftest import shipped_env

    env = shipped_env(target, MAXDIFF_COMPILE_CACHE=str(tmp_path / "jax"))  # as shipped
    env.pop("MAXDIFF_DEFAULT_MODEL", None)
    where = subprocess.run(
        [sys.executable, "-c", "import maxdiff.config, pipelines.default_model as d; "
         "print(maxdiff.config.shipped_configs()); print(d.EMBEDDED)"],
        cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(target)) for line in where.stdout.split()), where.stdout
    out = work / "out"
    res = subprocess.run([sys.executable, "-m", "pipelines.cli", "generate", "a red circle",
                          "--config", "demo", "--seed", "1", "--quiet", "--out", str(out)],
                         cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    pngs = list(out.glob("*.png"))
    assert len(pngs) == 1 and Image.open(pngs[0]).size == (64, 64)  # the model's own size
    rec = json.loads((out / "metadata.jsonl").read_text().splitlines()[0])
    measured = json.loads((REPO / "maxdiff" / "assets" / "demo-model" / "maxdiff.json").read_text())
    assert (rec["steps"], rec["guidance"]) == (measured["steps"], measured["guidance"])
