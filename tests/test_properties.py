"""Property tests (Hypothesis): every bad value given to the Python API or in a CLI JSONL line is
refused with a ValueError / an input error that names the field, before any work starts; no
value makes either crash deep inside."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelines.cli.lines import InputError
from pipelines.cli.prompts import read_prompts

# ---------------------------------------------------------------------------------- values
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)

FIELDS = ("prompt", "negative_prompt", "seed", "steps", "guidance", "size", "n")


def _is_good(field: str, v) -> bool:
    """What the JSONL reader should accept for a field (the documented ranges)."""
    is_int = isinstance(v, int) and not isinstance(v, bool)
    if field == "prompt":
        return isinstance(v, str) and bool(v.strip())
    if field == "negative_prompt":
        return v is None or isinstance(v, str)
    if field == "seed":
        return is_int and 0 <= v <= 2**32 - 1
    if field == "steps":
        return is_int and 1 <= v <= 1000
    if field == "guidance":
        return (is_int or isinstance(v, float)) and math.isfinite(v) and v >= 0
    if field == "n":
        return is_int and 1 <= v <= 10_000
    return None  # size: many spellings; only "never crashes" is asserted


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(FIELDS), value=JSON_VALUES)
def test_jsonl_line_values_are_accepted_or_refused_naming_the_field(field, value):
    line = {"prompt": "a red circle", field: value}
    text = json.dumps(line)
    try:
        lines = read_prompts(file="p.jsonl", file_text=text + "\n", factor=8,
                             steps_limit=(1000, "EulerDiscreteScheduler"))
    except InputError as e:
        assert _is_good(field, value) is not True, (field, value, e.errors)
        assert len(e.errors) == 1 and e.errors[0].startswith(f"p.jsonl:1: field {field!r}: "), \
            e.errors
        return
    assert _is_good(field, value) is not False, (field, value)
    assert len(lines) == 1


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=40), JSON_VALUES.map(json.dumps)))
def test_any_jsonl_line_is_a_line_or_an_input_error(text):
    """Arbitrary text in a .jsonl file: parsed or refused with the line's place, never a crash."""
    if not text.strip() or text.lstrip().startswith("#"):
        return
    try:
        read_prompts(file="p.jsonl", file_text=text.replace("\n", " ") + "\n", factor=8)
    except InputError as e:
        assert e.errors and all(err.startswith("p.jsonl:1: ") for err in e.errors), e.errors


# ---------------------------------------------------------------------------------- Python API
BAD = {
    "num_inference_steps": st.one_of(st.integers(max_value=0), st.integers(1001, 10**9),
                                     st.floats(), st.text(max_size=3), st.booleans()),
    "height": st.one_of(st.integers(max_value=0), st.integers(1, 400).filter(lambda v: v % 2),
                        st.floats(), st.text(max_size=3)),
    "width": st.one_of(st.integers(max_value=0), st.integers(1, 400).filter(lambda v: v % 2),
                       st.floats(), st.text(max_size=3)),
    "guidance_scale": st.one_of(st.floats(max_value=-1e-9), st.just(math.nan),
                                st.just(math.inf), st.text(max_size=3), st.booleans()),
    "guidance_rescale": st.one_of(st.floats(min_value=1.0001), st.floats(max_value=-1e-9),
                                  st.text(max_size=3)),
    "seed": st.one_of(st.integers(max_value=-1), st.integers(2**32, 2**70), st.text(max_size=3),
                      st.floats()),
    "num_images_per_prompt": st.one_of(st.integers(max_value=0), st.text(max_size=3),
                                       st.floats()),
    "prompt": st.one_of(st.just([]), st.integers(), st.lists(st.integers(),
                                                                          min_size=1)),
    "negative_prompt": st.one_of(st.integers(), st.lists(st.integers(), min_size=1)),
    "output_type": st.text(max_size=5).filter(lambda v: v not in ("pil", "np")),
}
NAMES = {"num_images_per_prompt": "num_images_per_prompt"}


@pytest.fixture(scope="module")
def pipe(sdxl_dir):
    from pipelines import TextToImagePipeline

    return TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)


@st.composite
def bad_argument(draw):
    name = draw(st.sampled_from(sorted(BAD)))
    return name, draw(BAD[name])


def test_bad_pipeline_arguments_raise_value_errors_naming_them(pipe):
    compiled = pipe.num_compiled

    @settings(max_examples=250, deadline=None)
    @given(bad_argument())
    def check(arg):
        name, value = arg
        kwargs = {"prompt": "a red circle", "num_inference_steps": 2, "height": 32, "width": 32,
                  name: value}
        with pytest.raises(ValueError) as err:
            pipe(**kwargs)
        word = "prompt" if name == "prompt" else name
        assert word in str(err.value), (name, value, str(err.value))

    check()
    assert pipe.num_compiled == compiled  # nothing ran: every value was refused up front
