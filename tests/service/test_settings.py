"""Serve args: ``ServeSettings`` parsed from ``build_app``'s args (no Ray cluster)."""

from __future__ import annotations

import pytest


def test_settings_from_cli_strings():
    from serving.schemas import ServeSettings, WarmupShape

    s = ServeSettings.from_args({
        "max_batch_size": "8", "batch_wait_timeout_s": "0.1", "resource": "TPU",
        "resource_amount": "4", "max_replicas_per_node": "1", "steps": "4", "model": "/m/1234",
        "warmup_shapes": "1024x1024:4:0,512x768:30:cfg", "warmup_batch_sizes": "1,2"})
    assert (s.max_batch_size, s.batch_wait_timeout_s, s.resource, s.resource_amount) == (
        8, 0.1, "TPU", 4.0)
    assert s.run_overrides == {"steps": 4, "model": "/m/1234"}
    assert s.warmup_shapes == (WarmupShape(width=1024, height=1024, steps=4, guidance=0.0),
                               WarmupShape(width=512, height=768, steps=30, guidance=5.0))
    assert s.warmup_batch_sizes == (1, 2) and s.generator_max_ongoing == 16
    assert s.engine == "batch" and s.slots == 8  # default: whole requests batched per shape key
    step = ServeSettings.from_args({"engine": "step", "engine_slots": "16", "step_policy": "srs"})
    assert (step.engine, step.engine_slots, step.generator_max_ongoing) == ("step", 16, 64)
    assert step.step_policy == "srs" and s.step_policy == "fifo"
    yaml_style = ServeSettings.from_args({"warmup_shapes": [{"size": "64x32", "cfg": "off"},
                                                            "default"], "max_queued_requests": -1})
    assert yaml_style.warmup_shapes == (WarmupShape(width=64, height=32, guidance=0.0),
                                        WarmupShape())


def test_warmup_shapes_with_controlnets():
    """A warm-up shape may name the default model's ControlNets (``WxH:steps:guidance:names``
    or a mapping); one it does not load is refused before anything deploys, naming it."""
    from serving.schemas import ServeSettings, WarmupShape

    s = ServeSettings.from_args({
        "controlnets": "canny=/cn/canny,depth=/cn/depth",
        "warmup_shapes": ["1024x1024:30:cfg:canny", "1024x1024:30::canny+depth",
                          {"size": "512x512", "controlnets": ["depth"]}]})
    assert s.warmup_shapes == (
        WarmupShape(width=1024, height=1024, steps=30, guidance=5.0, controlnets=("canny",)),
        WarmupShape(width=1024, height=1024, steps=30, controlnets=("canny", "depth")),
        WarmupShape(width=512, height=512, controlnets=("depth",)))
    with pytest.raises(ValueError, match=r"warmup shape 64x64:4:default:pose: ControlNet 'pose' "
                                         r"is not loaded by the default model; its ControlNets: "
                                         r"canny"):
        ServeSettings.from_args({"controlnets": "canny=/cn/canny",
                                 "warmup_shapes": "64x64:4::pose"})
    with pytest.raises(ValueError, match=r"controlnets 'canny\+': give ControlNet names"):
        ServeSettings.from_args({"controlnets": "canny=/cn/canny",
                                 "warmup_shapes": "64x64:4:0:canny+"})


def test_settings_adapters():
    from serving.schemas import AdapterSpec, ServeSettings

    want = (AdapterSpec(name="pixel", path="/l/pixel.safetensors", scale=0.7),
            AdapterSpec(name="ink", path="/l/ink", scale=1.0))
    for spec in ("pixel=/l/pixel.safetensors:0.7, ink=/l/ink",
                 '{"pixel": {"path": "/l/pixel.safetensors", "scale": 0.7}, "ink": "/l/ink"}',
                 "{pixel: {path: /l/pixel.safetensors, scale: 0.7}, ink: /l/ink}",
                 {"pixel": {"path": "/l/pixel.safetensors", "scale": 0.7}, "ink": "/l/ink"}):
        assert ServeSettings.from_args({"adapters": spec}).adapters == want, spec
    assert ServeSettings.from_args({}).adapters == ()
    for bad, message in (("pixel", "name=path"), ("a=/x,a=/y", "'a' is given twice"),
                         ("a:b=/x", "should match pattern"), ({"a": {"path": "/x", "rank": 2}},
                                                                "unknown key .rank.")):
        with pytest.raises(ValueError, match=message):
            ServeSettings.from_args({"adapters": bad})


def test_autoscaling_settings():
    """num_replicas: auto takes the image-generation defaults; an autoscaling block alone turns
    autoscaling on; the target defaults to a full batch (engine=step: the engine's slots); a
    generator that may scale to zero starts with one replica."""
    from serving.schemas import ServeSettings

    assert ServeSettings.from_args({"num_replicas": "3"}).autoscaling_config is None
    auto = ServeSettings.from_args({"num_replicas": "auto", "max_batch_size": "4"})
    assert auto.autoscaling_config == {
        "min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 4,
        "upscale_delay_s": 30.0, "downscale_delay_s": 600.0, "metrics_interval_s": 10.0,
        "look_back_period_s": 30.0}
    assert not auto.scales_to_zero
    zero = ServeSettings.from_args({"autoscaling": "{min_replicas: 0, max_replicas: 8}",
                                    "engine": "step", "engine_slots": "16"})
    assert zero.num_replicas == 1 and zero.scales_to_zero
    assert {k: zero.autoscaling_config[k] for k in (
        "min_replicas", "max_replicas", "initial_replicas", "target_ongoing_requests")} == {
        "min_replicas": 0, "max_replicas": 8, "initial_replicas": 1, "target_ongoing_requests": 16}
    # what Ray Serve itself accepts
    from ray.serve.config import AutoscalingConfig

    AutoscalingConfig(**zero.autoscaling_config)


@pytest.mark.parametrize("args,message", [
    ({"max_batchsize": 4}, "unknown serve arg 'max_batchsize'"),
    ({"max_batch_size": "many"}, "key 'max_batch_size': Input should be a valid integer"),
    ({"steps": "many"}, "key 'steps': Input should be a valid integer"),
    ({"max_batch_size": 0}, "key 'max_batch_size': Input should be greater than or equal to 1"),
    ({"warmup_shapes": "1024y4:4"}, "WIDTHxHEIGHT"),
    ({"warmup_shapes": "64x64:0"}, "key 'steps': Input should be greater than or equal to 1"),
    ({"warmup_batch_sizes": "1,0"}, "warmup_batch_sizes"),
    ({"engine": "steps"}, "key 'engine'"),
    ({"step_policy": "sjf"}, "key 'step_policy': Input should be 'fifo' or 'srs'"),
    ({"max_batch_size": 8, "max_ongoing_requests": 4}, "batches could never fill"),
    ({"num_replicas": 0}, "key 'num_replicas': num_replicas must be a count >= 1 or auto"),
    ({"num_replicas": "many"}, "num_replicas must be a count >= 1 or auto"),
    ({"num_replicas": 2, "autoscaling": {}}, "give num_replicas: auto with autoscaling"),
    ({"autoscaling": {"max_replica": 2}}, "unknown key 'max_replica'; allowed keys: min_replicas"),
    ({"autoscaling": {"min_replicas": -1}}, "key 'min_replicas': Input should be greater than or "
                                            "equal to 0"),
    ({"autoscaling": "{min_replicas: 3, max_replicas: 2}"},
     r"autoscaling.min_replicas=3 is above autoscaling.max_replicas=2"),
    ({"autoscaling": {"initial_replicas": 9}}, r"must lie in \[min_replicas, max_replicas\] = "
                                               r"\[1, 4\]"),
    ({"autoscaling": {"target_ongoing_requests": 0}}, "key 'target_ongoing_requests': Input "
                                                      "should be greater than 0"),
    ({"autoscaling": {"look_back_period_s": 5, "metrics_interval_s": 5}},
     "look_back_period_s=5.0 must be above autoscaling.metrics_interval_s=5.0"),
    ({"autoscaling": 3}, "key 'autoscaling': give a mapping"),
    ({"price_per_hour": -1}, "key 'price_per_hour': Input should be greater than or equal to 0"),
])
def test_settings_refuse_bad_args(args, message):
    from serving.schemas import ServeSettings

    with pytest.raises(ValueError, match=message):
        ServeSettings.from_args(args)


def test_build_app_without_a_model_says_what_to_do(monkeypatch, tmp_path):
    pytest.importorskip("ray.serve")
    from serving.app import build_app

    monkeypatch.setenv("MAXDIFF_DEFAULT_MODEL", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="MAXDIFF_DEFAULT_MODEL"):
        build_app({})
    with pytest.raises(ValueError, match="no such file, and not one of the named run configs"):
        build_app({"config": "no-such-config", "model": str(tmp_path)})


def test_settings_models_list():
    """Serve arg ``models``: each entry's name, run config, run-config keys and adapters, from
    YAML (serve.yaml) or a command-line string alike."""
    from serving.schemas import AdapterSpec, ServeSettings

    for models in ([{"name": "base", "model": "/m/sdxl", "steps": "30", "lora": "/l/a:0.5"},
                    {"name": "fast", "config": "sdxl-lightning-4step", "vae": "/v",
                     "adapters": "ink=/l/ink"}],
                   "[{name: base, model: /m/sdxl, steps: 30, lora: '/l/a:0.5'}, {name: fast, "
                   "config: sdxl-lightning-4step, vae: /v, adapters: {ink: /l/ink}}]"):
        s = ServeSettings.from_args({"models": models, "max_models_per_replica": "1"})
        base, fast = s.models
        assert (base.name, base.config, base.run_overrides) == (
            "base", None, {"model": "/m/sdxl", "steps": 30, "loras": ["/l/a:0.5"]})
        assert (fast.name, fast.config, fast.run_overrides) == (
            "fast", "sdxl-lightning-4step", {"vae": "/v"})
        assert fast.adapters == (AdapterSpec(name="ink", path="/l/ink"),)
        assert s.max_models_per_replica == 1
    assert ServeSettings.from_args({}).models == ()


@pytest.mark.parametrize("args,message", [
    ({"models": [{"name": "a"}, {"name": "a"}]}, "model name 'a' is given twice"),
    ({"models": [{"name": "a:b"}]}, r"models\[0\]: key 'name': String should match pattern"),
    ({"models": [{"model": "/m"}]}, r"models\[0\]: key 'name': Field required"),
    ({"models": [{"name": "a", "steps": "x"}]}, r"models\[0\] \(run-config keys\): key 'steps'"),
    ({"models": [{"name": "a", "max_n": 2}]}, r"models\[0\]: unknown key 'max_n'; allowed: name"),
    ({"models": [{"name": "a", "adapters": "p"}]}, "name=path"),
    ({"models": {"a": {"model": "/m"}}}, "give a list of models"),
    ({"models": [{"name": "a"}], "dtype": "bf16"}, "serve arg 'dtype' belongs to one model"),
    ({"models": [{"name": "a"}], "model_name": "x"}, "serve arg 'model_name' belongs to one"),
    ({"max_models_per_replica": 0}, "key 'max_models_per_replica': Input should be greater"),
])
def test_settings_refuse_bad_models(args, message):
    from serving.schemas import ServeSettings

    with pytest.raises(ValueError, match=message):
        ServeSettings.from_args(args)


def test_catalog_of_the_serve_args(tmp_path):
    """One model from the single-model args, named as before; a ``models`` list in its order
    (the first is the default) with each entry's run config; a bad run config names its
    entry; unknown names are 404s naming the choices, except on the OpenAI route of a
    single-model server."""
    pytest.importorskip("ray.serve")
    from serving.errors import ApiError
    from serving.models import Catalog
    from serving.schemas import ServeSettings

    (tmp_path / "m1").mkdir()
    one = Catalog.from_settings(ServeSettings.from_args({"model": str(tmp_path / "m1")}))
    assert (one.names, one.listed, one.max_per_replica) == (["m1"], False, 1)
    assert one.pick("dall-e-3", lenient=True) == "m1"
    with pytest.raises(ApiError, match="'dall-e-3' is not served here; choose one of: m1"):
        one.pick("dall-e-3")
    s = ServeSettings.from_args({"models": [
        {"name": "x", "model": str(tmp_path / "m1"), "steps": 3},
        {"name": "y", "config": "sdxl-lightning-4step", "model": str(tmp_path / "m1")}]})
    two = Catalog.from_settings(s)
    assert (two.names, two.default.name, two.max_per_replica) == (["x", "y"], "x", 2)
    assert two.get("x").run_config.steps == 3 and two.get("y").run_config.steps == 4
    assert two.pick(None) == "x" and two.pick("y") == "y"
    with pytest.raises(ApiError, match="choose one of: x, y") as e:
        two.pick("dall-e-3", lenient=True)
    assert (e.value.status, e.value.code, e.value.param) == (404, "model_not_found", "model")
    assert two.key("x") != two.key("y")
    with pytest.raises(ValueError, match=r"models\[0\] \(bad\): run config 'nope'"):
        Catalog.from_settings(ServeSettings.from_args({"models": [{"name": "bad",
                                                                   "config": "nope"}]}))
    # ControlNets: a diffusers folder or one .safetensors file; anything else names the entry
    (tmp_path / "cn.safetensors").write_bytes(b"")
    ok = {"model": str(tmp_path / "m1"), "controlnets": {"a": str(tmp_path / "m1"),
                                                          "b": str(tmp_path / "cn.safetensors")}}
    assert len(Catalog.from_settings(ServeSettings.from_args(ok)).default.controlnets) == 2
    (tmp_path / "cn.ckpt").write_bytes(b"")
    for bad in (tmp_path / "missing", tmp_path / "cn.ckpt"):  # nothing there; not safetensors
        with pytest.raises(ValueError, match=rf"serve arg controlnets: c: {bad}: no such folder "
                                             r"or \.safetensors file"):
            Catalog.from_settings(ServeSettings.from_args({**ok, "controlnets": {"c": str(bad)}}))


def test_the_shipped_multi_model_config_parses():
    """configs/serve-multi-model.yaml: Ray Serve's schema accepts it and its args make a
    catalog of two models of the embedded demo model, the first the default."""
    pytest.importorskip("ray.serve")
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from serving.models import Catalog
    from serving.schemas import ServeSettings

    path = Path(__file__).parents[2] / "configs" / "serve-multi-model.yaml"
    (app,) = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text())).applications
    catalog = Catalog.from_settings(ServeSettings.from_args(app.args))
    assert catalog.names == ["demo", "demo-draft"] and catalog.max_per_replica == 2
    assert catalog.default.run_config.steps is None and catalog.get("demo-draft").run_config.steps == 8
