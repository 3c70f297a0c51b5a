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
    step = ServeSettings.from_args({"engine": "step", "engine_slots": "16"})
    assert (step.engine, step.engine_slots, step.generator_max_ongoing) == ("step", 16, 64)
    yaml_style = ServeSettings.from_args({"warmup_shapes": [{"size": "64x32", "cfg": "off"},
                                                            "default"], "max_queued_requests": -1})
    assert yaml_style.warmup_shapes == (WarmupShape(width=64, height=32, guidance=0.0),
                                        WarmupShape())


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
