"""ControlNet through the CLI: ``--control-image PATH[:MODEL[:SCALE]]``, ``--controlnet
NAME=PATH``, ``--control-guidance-start/--control-guidance-end`` and JSONL lines'
``control_images``. The images equal the Python API's ``ControlNetPipeline`` for the same
request; bad values are refused before anything loads, naming the flag or the line's field.
``cli.main`` runs in this process (no second JAX start-up) on the tiny SDXL checkpoint."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import tiny
from PIL import Image

from pipelines import cli
from pipelines.cli.lines import ControlSpec, InputError
from pipelines.cli.prompts import read_prompts

SIZE, STEPS = 32, 2
CN = dict(conditioning_embedding_out_channels=(8, 16))  # control image 2x the latents


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny random ControlNet (``canny``), a folder standing for a second one (``depth``:
    never loaded), two control images (32x32 and 40x48) and a ControlNet for another model."""
    d = tmp_path_factory.mktemp("cn-cli")
    tiny.make_controlnet(d / "canny", tiny.SDXL_UNET, seed=5, **CN)
    (d / "depth").mkdir()
    rng = np.random.default_rng(0)
    for name, (w, h) in (("a.png", (SIZE, SIZE)), ("b.png", (40, 48))):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(d / name)
    return types.SimpleNamespace(dir=d, canny=d / "canny", depth=d / "depth", a=d / "a.png",
                                 b=d / "b.png")


def test_cli_and_jsonl_images_equal_the_python_api(sdxl_dir, files, tmp_path, capsys):
    """A prompt with ``--control-image a.png:canny:0.5`` and a JSONL line with its own control
    image (resized from 40x48), scale and window: one device batch (same ControlNet and
    shape), each image within one level of the Python API's for the same request (its
    ``generate`` with the same rows); the metadata and the PNG record the ControlNet settings;
    a rerun has nothing to do."""
    from pipelines import ControlImage, ControlNetPipeline, ImageRequest, TextToImagePipeline
    from pipelines.image_files import read_image_info

    jobs = files.dir / "jobs.jsonl"
    jobs.write_text(json.dumps({"prompt": "a blue square", "seed": 11, "size": "32x32",
                                "control_images": [{"image": "b.png", "controlnet": "canny",
                                                    "scale": 1.5, "start": 0.5,
                                                    "guess_mode": True}]}) + "\n")
    out = tmp_path / "out"
    args = ["generate", "a red circle", "--prompts", str(jobs), "--model", str(sdxl_dir),
            "--controlnet", f"canny={files.canny}", "--control-image", f"{files.a}:canny:0.5",
            "--steps", str(STEPS), "--guidance", "0", "--batch-size", "2", "--seed", "7",
            "--out", str(out), "--quiet"]
    assert cli.main(args) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "1 ControlNet(s), 32x32, 2 step(s), guidance off: 2 image(s), device batch 2" in err
    meta = {m["prompt"]: m for m in map(json.loads, (out / "metadata.jsonl").read_text()
                                        .splitlines())}
    assert len(meta) == 2 and {m["mode"] for m in meta.values()} == {"controlnet"}
    canny = str(files.canny.resolve())
    assert meta["a red circle"]["control_images"] == [dict(
        image=str(files.a.resolve()), controlnet=canny, scale=0.5, start=0.0, end=1.0)]
    assert meta["a blue square"]["control_images"] == [dict(
        image=str(files.b.resolve()), controlnet=canny, scale=1.5, start=0.5, end=1.0,
        guess_mode=True)]
    assert meta["a blue square"]["seed"] == 11
    info = read_image_info(out / meta["a red circle"]["file"])
    assert (info["mode"], info["controlnet"]) == ("controlnet", f"{canny}:0.5[0-1]")

    # the same two images through the Python API: one batch of two, so the CLI's program (from
    # the compile cache) and no second compile
    one = ControlNetPipeline.from_pipe(
        TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None),
        controlnet=str(files.canny))
    rows = [("a red circle", files.a, 0.5, 0.0, False), ("a blue square", files.b, 1.5, 0.5, True)]
    ours = one.generate(
        [ImageRequest(p, seed=meta[p]["seed"], guidance_scale=0.0) for p, *_ in rows],
        [[ControlImage(Image.open(image).convert("RGB"), scale, start, guess_mode=guess)]
         for _, image, scale, start, guess in rows],
        height=SIZE, width=SIZE, num_inference_steps=STEPS).images
    for (prompt, *_), mine in zip(rows, ours):
        got = np.asarray(Image.open(out / meta[prompt]["file"]).convert("RGB"), int)
        assert got.shape == (SIZE, SIZE, 3)
        assert np.abs(got - np.asarray(mine, int)).max() <= 1, prompt

    assert cli.main(args) == 0  # resume: nothing to do, no ControlNet loaded
    assert "0 to generate" in capsys.readouterr().err


def test_bad_flags_exit_2_naming_the_flag_before_loading(sdxl_dir, files, tmp_path, capsys):
    a = files.a
    cases = [
        (["--control-image", f"{a}:canny:11"], "--control-image: must be a number in [0, 10] "
         f"(0: no effect, 1: the ControlNet's full strength), got SCALE '11' in '{a}:canny:11'"),
        (["--control-image", f"{a}:canny:x"], "--control-image: must be a number in [0, 10]"),
        (["--control-image", f"{a}:pose"], f"--control-image {a}:pose: MODEL: 'pose' is no "
         "ControlNet name and no such folder (names given with --controlnet: canny, depth)"),
        (["--control-image", f"{tmp_path / 'nope.png'}:canny"], "PATH: "),
        (["--control-image", str(a)], f"--control-image {a}: MODEL: which ControlNet reads it? "
         "give its name or folder (the --controlnet names are canny, depth)"),
        (["--control-image", f"{a}:canny", "--control-guidance-start", "0.8",
          "--control-guidance-end", "0.2"],
         "--control-guidance-start: must be below the window's end (0.2)"),
        (["--control-image", f"{a}:canny", "--control-guidance-end", "1.5"],
         "--control-guidance-end: must be a number in [0, 1]"),
        (["--control-guidance-start", "0.5"],
         "--control-guidance-start: only used with control images"),
        (["--control-guess-mode"], "--control-guess-mode: only used with control images"),
        (["--control-image", f"{a}:canny", "--image", str(a)],
         "--control-image with --image: ControlNet image-to-image is not supported"),
        (["--controlnet", "canny"], "--controlnet canny: give NAME=PATH"),
        (["--controlnet", f"pose={tmp_path / 'missing'}"], "no such folder"),
    ]
    out = tmp_path / "out"
    for extra, message in cases:
        code = cli.main(["generate", "x", "--model", str(sdxl_dir), "--out", str(out),
                         "--controlnet", f"canny={files.canny}", "--controlnet",
                         f"depth={files.depth}", *extra])
        err = capsys.readouterr().err
        assert code == 2 and message in err, (extra, err)
        assert "loaded" not in err and not out.exists()


def test_bad_jsonl_entries_name_the_line_and_field(files):
    lines = [
        {"control_images": [{"image": "a.png", "controlnet": "canny", "scale": 11}]},
        {"control_images": [{"image": "a.png", "controlnet": "pose"}]},
        {"control_images": [{"image": "a.png", "start": 0.9, "end": 0.1}]},
        {"control_images": [{"controlnet": "canny"}]},
        {"control_images": [{"image": "a.png", "weight": 1}]},
        {"control_images": "a.png"},
        {"control_images": [{"image": "a.png"}], "image": "a.png"},
        {"control_images": [{"image": "missing.png"}]},
        {"control_images": [{"image": "a.png", "guess_mode": "yes"}]},
    ]
    text = "\n".join(json.dumps({"prompt": "x", **line}) for line in lines)
    with pytest.raises(InputError) as e:
        read_prompts(file=str(files.dir / "jobs.jsonl"), file_text=text, factor=2,
                           controlnets=[f"canny={files.canny}"])
    got = "\n".join(e.value.errors)
    jobs = files.dir / "jobs.jsonl"
    for no, says in enumerate([
            "field 'control_images[0].scale': must be a number in [0, 10] (0: no effect, 1: "
            "the ControlNet's full strength), got 11",
            "field 'control_images[0].controlnet': 'pose' is no ControlNet name and no such "
            "folder (names given with --controlnet: canny)",
            "field 'control_images[0].start': must be below the window's end (0.1)",
            "field 'control_images[0].image': is missing",
            "field 'control_images[0].weight': unknown; an entry has image, controlnet, "
            "scale, start, end, guess_mode",
            "field 'control_images': must be a non-empty list",
            "field 'control_images' with an image to edit: ControlNet image-to-image is not "
            "supported",
            "field 'control_images[0].image': missing.png: cannot read it",
            "field 'control_images[0].guess_mode': must be true or false, got 'yes'"], 1):
        assert f"{jobs}:{no}: {says}" in got, (no, got)
    # a line without a ControlNet name uses the only --controlnet; its size is the image's
    (line,) = read_prompts(file=str(jobs), file_text=json.dumps(
        {"prompt": "x", "control_images": [{"image": "b.png"}]}), factor=8,
        controlnets=[f"canny={files.canny}"], control_end=0.5, control_guess_mode=True)
    assert line.controls == (ControlSpec(str(files.b.resolve()),
                                               str(files.canny.resolve()), 1.0, 0.0, 0.5, True),)
    assert line.size == (40, 48)


def test_a_controlnet_for_another_model_exits_2(sdxl_dir, files, tmp_path, capsys):
    """A ControlNet whose control images are 8x the latents (SDXL's) on the tiny model (2x):
    refused when it loads, naming it, with exit status 2."""
    other = tmp_path / "other"
    tiny.make_controlnet(other, tiny.SDXL_UNET)
    code = cli.main(["generate", "x", "--model", str(sdxl_dir), "--out", str(tmp_path / "out"),
                     "--control-image", f"{files.a}:{other}", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"ControlNet {other.resolve()}: " in err and "a ControlNet for another model" in err
