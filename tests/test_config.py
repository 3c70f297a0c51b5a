"""Run configs: every shipped YAML loads; unknown keys and bad values are refused by name."""

from __future__ import annotations

import pytest

from pipelines.config import RunConfig, available_configs, load_run_config


def test_shipped_configs_load():
    names = available_configs()
    for want in ("sdxl-base", "demo", *(f"sdxl-lightning-{n}step" for n in (1, 2, 4, 8))):
        assert want in names
    for name in names:
        assert isinstance(load_run_config(name), RunConfig)
    c = load_run_config("sdxl-lightning-4step", ["model=/m/sdxl", "unet=/m/l4.safetensors"])
    assert (c.model, c.unet, c.scheduler, c.steps, c.guidance) == (
        "/m/sdxl", "/m/l4.safetensors", "lightning-4step", 4, 0.0)
    assert load_run_config("sdxl-lightning-1step").scheduler == "lightning-1step"


def test_overrides_are_typed():
    c = load_run_config(None, ["steps=7", "guidance=3", "devices=null"])
    assert c.steps == 7 and c.guidance == 3.0 and isinstance(c.guidance, float)
    assert c.call_kwargs() == {"num_inference_steps": 7, "guidance_scale": 3.0}


@pytest.mark.parametrize("overrides, match", [
    (["bogus=1"], r"unknown config key 'bogus'; allowed keys: model, unet"),
    (["steps=two"], r"config key 'steps' must be int or null, got 'two'"),
    (["steps=0"], r"steps=0; it must be >= 1"),
    (["dtype=float64"], r"dtype='float64' is not supported"),
    (["attention=flash"], r"attention=.flash.; use one of auto, chunked, xla, dot_product"),
    (["guidance=-2"], r"guidance=-2.0; it must be >= 0"),
    (["steps"], r"must look like key=value"),
])
def test_bad_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_run_config(None, overrides)


def test_unknown_config_name(tmp_path):
    with pytest.raises(ValueError, match="not one of the named configs: demo, sdxl-base"):
        load_run_config("nope")
    bad = tmp_path / "x.yaml"
    bad.write_text("model: /a\nsteps: 4\nsampler: euler\n")
    with pytest.raises(ValueError, match=r"x.yaml: unknown config key 'sampler'"):
        load_run_config(bad)
