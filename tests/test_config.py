"""Configs: every shipped YAML loads through the one strict loader; unknown keys and bad values
are refused by name; a model folder's maxdiff.json; the layering (no back-edges, a JAX-free
ingress import)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from maxdiff.config import config_names, load_config
from pipelines.config import ModelDefaults, RunConfig, available_configs, load_run_config

ROOT = Path(__file__).resolve().parent.parent


def test_shipped_configs_load():
    names = available_configs()
    for want in ("sdxl-base", "sd15", "sd21", "demo",
                 *(f"sdxl-lightning-{n}step" for n in (1, 2, 4, 8))):
        assert want in names
    assert "serve" not in names and "train-demo" not in names
    for name in names:
        assert isinstance(load_run_config(name), RunConfig)
    c = load_run_config("sdxl-lightning-4step", ["model=/m/sdxl", "unet=/m/l4.safetensors"])
    assert (c.model, c.unet, c.scheduler, c.steps, c.guidance) == (
        "/m/sdxl", "/m/l4.safetensors", "lightning-4step", 4, 0.0)
    assert load_run_config("sdxl-lightning-1step").scheduler == "lightning-1step"
    # the shipped folder is the top-level configs/ (editable install) and holds every YAML
    assert set(config_names()) == {p.stem for p in (ROOT / "configs").glob("*.yaml")}


def test_the_training_and_service_configs_use_the_same_loader():
    from maxdiff.training.train import TrainConfig
    from serving.schemas import ServeSettings

    t = TrainConfig.load("train-demo", ["max_minutes=5"])
    assert t.max_minutes == 5.0 and t.unet_train.steps >= 1
    with pytest.raises(ValueError, match=r"key 'unet_train.lr': Input should be greater than 0"):
        TrainConfig.load("train-demo", ["unet_train={lr: 0}"])
    with pytest.raises(ValueError, match=r"unknown key 'epochs'"):
        TrainConfig.load("train-demo", ["epochs=3"])
    s = ServeSettings.from_args({"max_n": "3", "steps": "7", "config": "demo"})
    assert s.max_n == 3 and s.run_overrides == {"steps": 7}
    assert load_run_config(s.config, s.run_overrides).steps == 7


def test_overrides_are_typed():
    c = load_run_config(None, ["steps=7", "guidance=3", "devices=null", "model=12"])
    assert c.steps == 7 and c.guidance == 3.0 and isinstance(c.guidance, float)
    assert c.model == "12"  # a path that looks like a number stays a path
    assert c.call_kwargs() == {"num_inference_steps": 7, "guidance_scale": 3.0}
    assert c.replace(steps=9).steps == 9
    with pytest.raises(ValueError, match="key 'steps'"):
        c.replace(steps=0)


@pytest.mark.parametrize("overrides, match", [
    (["bogus=1"],
     r"unknown key 'bogus'; allowed keys: model, unet, vae, single_file_config, scheduler, steps"),
    (["steps=two"], r"key 'steps': Input should be a valid integer.*\(got 'two'\)"),
    (["steps=2.5"], r"key 'steps': .*fractional part"),
    (["steps=0"], r"key 'steps': Input should be greater than or equal to 1 \(got 0\)"),
    (["dtype=float64"], r"key 'dtype': Input should be 'float32', 'bfloat16'.*\(got 'float64'\)"),
    (["attention=flash"], r"key 'attention': Input should be 'auto', 'chunked', 'xla', "
                          r"'dot_product' or 'splash' \(got 'flash'\)"),
    (["guidance=-2"], r"key 'guidance': Input should be greater than or equal to 0 \(got -2\)"),
    (["guidance=.nan"], r"key 'guidance'"),
    (["steps"], r"must look like key=value"),
])
def test_bad_values(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_run_config(None, overrides)


def test_unknown_config_name(tmp_path):
    with pytest.raises(ValueError, match="not one of the named run configs: demo, sd15, sd21, sdxl-base"):
        load_run_config("nope")
    bad = tmp_path / "x.yaml"
    bad.write_text("model: /a\nsteps: 4\nsampler: euler\n")
    with pytest.raises(ValueError, match=r"x.yaml: unknown key 'sampler'"):
        load_run_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ValueError, match=r"x.yaml: a run config is a YAML mapping"):
        load_run_config(bad)
    bad.write_text("steps: [1\n")
    with pytest.raises(ValueError, match=r"x.yaml: not valid YAML"):
        load_run_config(bad)


def test_model_defaults_file(tmp_path):
    assert ModelDefaults.read(tmp_path) == ModelDefaults()  # none: all None
    (tmp_path / "maxdiff.json").write_text(json.dumps({"steps": 12, "guidance": 3, "width": 96,
                                                       "height": 64, "max_size": 512}))
    d = ModelDefaults.read(tmp_path)
    assert (d.steps, d.guidance, d.width, d.height, d.max_size) == (12, 3.0, 96, 64, 512)
    (tmp_path / "maxdiff.json").write_text(json.dumps({"steps": 12, "sampler": "euler"}))
    with pytest.raises(ValueError, match=r"maxdiff.json: unknown key 'sampler'"):
        ModelDefaults.read(tmp_path)
    (tmp_path / "maxdiff.json").write_text("{steps: 1")
    with pytest.raises(ValueError, match=r"maxdiff.json: not valid JSON"):
        ModelDefaults.read(tmp_path)


def test_load_config_takes_any_strict_config():
    from maxdiff.config import StrictConfig

    class Small(StrictConfig):
        a: int = 1
        b: str | None = None

    assert load_config(Small, {"a": 2}, ["b=x"]) == Small(a=2, b="x")
    with pytest.raises(ValueError, match=r"unknown key 'c'; allowed keys: a, b"):
        load_config(Small, None, ["c=1"])


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_dependencies_point_one_way():
    """serving -> pipelines -> maxdiff: nothing in maxdiff/ imports the layers above it, and
    pipelines/ never imports serving/."""
    for layer, above in (("maxdiff", {"pipelines", "serving"}), ("pipelines", {"serving"})):
        for path in sorted((ROOT / layer).rglob("*.py")):
            bad = _imports(path) & above
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_ingress_side_imports_no_jax():
    code = ("import sys, serving.schemas, pipelines.requests, pipelines.config, pipelines; "
            "print(sorted(m for m in ('jax', 'flax', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_sampler_name_becomes_the_models_scheduler_config(tmp_path):
    """``scheduler: dpmpp_2m_karras`` in a run config (the CLI's --scheduler, the service's
    scheduler=) goes to from_pretrained as it is, which loads the model's own scheduler config
    switched to that sampler (maxdiff.schedulers.resolve_scheduler, what pipelines.loading
    calls); presets, paths and None go through as they are; an unknown name lists the choices
    before any model is read."""
    from maxdiff.schedulers import SDXL_BASE_SCHEDULER_CONFIG, resolve_scheduler, sampler_config

    model = tmp_path / "model"
    (model / "scheduler").mkdir(parents=True)
    own = dict(SDXL_BASE_SCHEDULER_CONFIG, prediction_type="v_prediction")
    (model / "scheduler" / "scheduler_config.json").write_text(json.dumps(own))
    for name in ("dpmpp_2m_karras", "DPM++ 2M Karras", "unipc", "Euler a"):
        assert RunConfig(model=str(model), scheduler=name).pipeline_kwargs()["scheduler"] == name
        sched, preset = resolve_scheduler(name, model / "scheduler")
        want = sampler_config(name, own)  # the scheduler's config adds its defaults to these
        assert preset is None and {k: sched.config[k] for k in want} == want
        assert sched.config["prediction_type"] == "v_prediction"
    for source in (None, "lightning-4step", str(model / "scheduler")):
        assert RunConfig(model=str(model), scheduler=source).pipeline_kwargs()["scheduler"] == source
    cfg = load_run_config(None, [f"model={model}", "scheduler=dpmpp_2m_karas"])
    with pytest.raises(ValueError, match="no preset.*did you mean 'dpmpp_2m_karras'"):
        cfg.pipeline_kwargs()
