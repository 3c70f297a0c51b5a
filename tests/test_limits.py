"""pipelines.limits: every request rule once, and every front door saying it the same way.

The rules are unit-tested here; then one table of bad values goes through the Python API, the
CLI's arguments and a JSONL line (here) and both HTTP dialects (tests/service/test_edits.py,
which imports BAD_VALUES), and each door must name the field in its own words and state the same
range."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from PIL import Image

from pipelines import cli
from pipelines.cli.controls import _controlnet
from pipelines.cli.lines import InputError, PromptLine
from pipelines.cli.prompts import edit_strength, read_prompts
from pipelines.control_limits import chosen_controlnet, control_scale_problem, control_window_problems
from pipelines.field_names import FIELDS
from pipelines.limits import (
    MAX_SEED,
    STRENGTH,
    Limits,
    Problem,
    check,
    cost_problem,
    describe,
    guidance_problem,
    n_problem,
    problems,
    seed_problem,
    size_problems,
    steps_problem,
    strength_problem,
)

# (canonical field, a bad value, what every front door's message must say). The tiny
# checkpoints' VAE scale factor is 2, so 33 pixels is not a valid side anywhere.
BAD_VALUES = [
    ("steps", 0, r"must be an integer (>= 1|in 1\.\.\d+)"),
    ("guidance", -1.0, r"must be a number (>= 0|in \[0, \d+\])"),
    ("strength", 1.5, r"must be a number in \(0, 1\]"),
    ("n", 0, r"must be an integer (>= 1|in 1\.\.\d+)"),
    ("seed", -1, rf"seeds are integers in 0\.\.{MAX_SEED}"),
    ("width", 33, r"33 is not a multiple of 2"),
]


# ---------------------------------------------------------------------------------- the rules
def test_each_rule_accepts_its_range_and_states_it():
    assert steps_problem(1) is None and steps_problem(50, 50) is None
    for bad in (0, -3, 2.0, True, "4", None):
        assert steps_problem(bad).message == "must be an integer >= 1"
    p = steps_problem(51, 50, "what EulerDiscreteScheduler allows")
    assert p == Problem("steps", "must be an integer in 1..50 (what EulerDiscreteScheduler "
                        "allows)", 51)

    assert guidance_problem(0) is None and guidance_problem(1.0) is None
    assert guidance_problem(30, 30) is None
    for bad in (-0.1, float("nan"), float("inf"), True, "5"):
        assert "must be a number >= 0" in guidance_problem(bad).message
    assert "in [0, 30] (the serve arg max_guidance)" in guidance_problem(
        31, 30, "the serve arg max_guidance").message

    assert seed_problem(None) is None and seed_problem(0) is None
    assert seed_problem(MAX_SEED) is None and seed_problem(np.int64(5)) is None
    for bad in (-1, MAX_SEED + 1, 1.0, True):
        assert f"integers in 0..{MAX_SEED}" in seed_problem(bad).message
    assert "seed + n - 1 must stay in range" in seed_problem(MAX_SEED, 2).message

    assert n_problem(1) is None and n_problem(4, 4) is None
    assert n_problem(0).message == "must be an integer >= 1"
    assert "in 1..4 (at most 4 images per request" in n_problem(5, 4).message

    assert strength_problem(1) is None and strength_problem(0.5, 2) is None
    for bad in (0, 1.5, -0.2, True, float("nan"), None):
        assert "in (0, 1]" in strength_problem(bad).message
    p = strength_problem(0.25, 2)
    assert "with 2 step(s) leaves no denoising step (int(2 * 0.25) = 0)" in p.message


def test_controlnet_rules_accept_their_range_and_state_it():
    for ok in (0, 0.5, 1, 10.0, np.float32(2.5)):
        assert control_scale_problem(ok) is None
    for bad in (-0.1, 10.5, float("nan"), True, "1", None):
        p = control_scale_problem(bad, "ControlNet 1")
        assert p.field == "control_scale" and "in [0, 10] (ControlNet 1)" in p.message
    assert describe(control_scale_problem(-1)).startswith("controlnet_conditioning_scale=-1: ")
    for start, end in ((0, 1), (0.0, 0.5), (0.99, 1.0)):
        assert control_window_problems(start, end) == []
    assert [p.field for p in control_window_problems(-0.1, 1.5)] == ["control_start",
                                                                    "control_end"]
    assert "in [0, 1]" in control_window_problems(0, None)[0].message
    for start, end in ((0.5, 0.5), (0.8, 0.2)):
        (p,) = control_window_problems(start, end)
        assert p.field == "control_start" and f"below the window's end ({end})" in p.message
    assert describe(control_window_problems(0, 2)[0]).startswith("control_guidance_end=2: ")


def test_an_unnamed_control_image_goes_to_the_only_controlnet_at_every_door():
    assert chosen_controlnet(None, ["canny"]) == "canny"
    assert chosen_controlnet(None, {"canny": "/nets/canny"}) == "canny"  # the CLI's name -> folder
    assert chosen_controlnet(None, []) is None and chosen_controlnet(None, ["a", "b"]) is None
    assert chosen_controlnet("depth", ["canny"]) == "depth"  # a named one stays (checked later)
    with pytest.raises(ValueError, match=r"which ControlNet reads it\? .*names are a, b"):
        _controlnet(None, {"a": "/x", "b": "/y"}, None)
    assert _controlnet(None, {"a": "/x"}, None) == "/x"


def test_size_problems_name_the_side_and_the_range():
    assert size_problems(64, 96, 8, None, 256) == []
    (p,) = size_problems(1024, 64, 8, None, 256, "max_size")
    assert (p.field, p.value) == ("width", 1024) and "between 8 and 256 (max_size)" in p.message
    (p,) = size_problems(64, 60, 8, 16, 256)
    assert p.field == "height" and "multiple of 8" in p.message
    assert [p.field for p in size_problems(None, 4.0, 8)] == ["width", "height"]


def test_problems_runs_every_rule_and_the_cost_only_when_the_rest_hold():
    lim = Limits(multiple=8, max_size=256, max_steps=50, max_guidance=30, max_n=4, max_cost=1.0)
    ok = dict(steps=4, guidance=5.0, seed=1, n=1, width=64, height=64)
    assert problems(lim, **ok) == []
    bad = problems(lim, steps=0, guidance=-1, seed=-1, n=9, width=60, height=512, strength=2)
    assert [p.field for p in bad] == ["steps", "guidance", "n", "seed", "strength", "width",
                                      "height"]
    assert problems(lim, **{**ok, "n": 4, "width": 256, "height": 256}) == []  # 4x4x1/16: 1.0
    (p,) = problems(lim, **{**ok, "steps": 5, "n": 4, "width": 256, "height": 256})
    assert p == cost_problem(4, 5, 256, 256, 1.0) and p.field == "n"
    assert "above this server's max_cost of 1; at most 3 image(s)" in p.message
    (p,) = problems(lim, **{**ok, "steps": 50, "width": 256, "height": 256})
    assert p.field == "steps" and "at most 16 step(s) for one image" in p.message
    # the strength rule sees the steps, unless the steps are themselves wrong
    assert [p.field for p in problems(lim, steps=2, strength=0.25, width=64, height=64)] == [
        "strength"]
    assert [p.field for p in problems(lim, steps=0, strength=0.25, width=64, height=64)] == [
        "steps"]


def test_describe_speaks_each_doors_words():
    p = steps_problem(0)
    assert describe(p, "python") == "num_inference_steps=0: must be an integer >= 1"
    assert describe(p, "cli") == "--steps: must be an integer >= 1"
    assert describe(p, "jsonl") == "field 'steps': must be an integer >= 1, got 0"
    assert describe(n_problem(0), "native").startswith("num_images: ")
    assert describe(n_problem(0), "openai").startswith("n: ")
    assert {FIELDS["width"][d] for d in ("cli", "jsonl", "openai")} == {"--size", "size"}
    with pytest.raises(ValueError, match=r"seed=-1: .*; guidance_scale=-1: "):
        check([None, seed_problem(-1), guidance_problem(-1)])
    check([None, steps_problem(3)])


def test_one_strength_default_per_mode(capsys):
    """The same omitted strength everywhere: the Python API's edit pipelines, the CLI's edit
    lines (and its --help) and the service's requests all take limits.STRENGTH."""
    import inspect

    from pipelines.conditioned_requests import EditRequest
    from pipelines.edit import ImageToImagePipeline, InpaintPipeline

    assert STRENGTH == {"img2img": 0.75, "inpaint": 0.9999}
    for cls in (ImageToImagePipeline, InpaintPipeline):
        assert inspect.signature(cls.__call__).parameters["strength"].default is None
    assert EditRequest.__dataclass_fields__["strength"].default == STRENGTH["img2img"]
    line = PromptLine(0, "x", "x", image="a.png")
    assert edit_strength(line) == STRENGTH["img2img"]
    assert edit_strength(PromptLine(0, "x", "x", image="a.png", mask="m.png")) == \
        STRENGTH["inpaint"]
    assert cli.main(["generate", "--help"]) == 0
    assert "(default 0.75, 0.9999 with --mask)" in " ".join(capsys.readouterr().out.split())


# ---------------------------------------------------------------------------------- front doors
@pytest.fixture(scope="module")
def pipe(sdxl_dir):
    from pipelines import TextToImagePipeline

    return TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)


def _python_call(pipe, field, value):
    """The Python API with one bad setting; everything else valid (32x32, 1 step)."""
    from pipelines import ImageToImagePipeline

    kw = dict(num_inference_steps=1, height=32, width=32)
    if field == "strength":
        image = Image.fromarray(np.zeros((32, 32, 3), np.uint8))
        return ImageToImagePipeline.from_pipe(pipe)("x", image=image, strength=value, **kw)
    name = FIELDS[field]["python"]
    return pipe("x", **{**kw, name: value})


@pytest.mark.parametrize("field,value,says", BAD_VALUES, ids=[f for f, _, _ in BAD_VALUES])
def test_the_python_api_names_the_field_and_the_range(pipe, field, value, says):
    with pytest.raises(ValueError) as e:
        _python_call(pipe, field, value)
    assert f"{FIELDS[field]['python']}=" in str(e.value) and re.search(says, str(e.value)), e.value
    assert pipe.num_compiled == 0  # refused before anything ran


CLI_ARGS = {"steps": ["--steps", "0"], "guidance": ["--guidance", "-1"],
            "strength": ["--strength", "1.5"], "n": ["--num-images", "0"],
            "seed": ["--seed", "-1"], "width": ["--size", "33x32"]}


@pytest.mark.parametrize("field,value,says", BAD_VALUES, ids=[f for f, _, _ in BAD_VALUES])
def test_the_cli_names_the_flag_and_the_range(sdxl_dir, tmp_path, capsys, field, value, says):
    image = tmp_path / "photo.png"
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(image)
    extra = ["--image", str(image)] if field == "strength" else []
    code = cli.main(["generate", "x", "--model", str(sdxl_dir), "--out", str(tmp_path / "out"),
                     *extra, *CLI_ARGS[field]])
    err = capsys.readouterr().err
    assert code == 2 and FIELDS[field]["cli"] in err and re.search(says, err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field,value,says", BAD_VALUES, ids=[f for f, _, _ in BAD_VALUES])
def test_a_jsonl_line_names_the_field_and_the_range(tmp_path, field, value, says):
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / "photo.png")
    line = {"prompt": "x", FIELDS[field]["jsonl"]: value}
    if field == "strength":
        line["image"] = "photo.png"
    if field == "width":
        line["size"] = f"{value}x32"
    with pytest.raises(InputError) as e:
        read_prompts(file=str(tmp_path / "jobs.jsonl"), file_text=json.dumps(line),
                           factor=2, steps=4)
    (err,) = e.value.errors
    assert f"field '{FIELDS[field]['jsonl']}'" in err and re.search(says, err), err
