"""int8 / fp8 inference through qwix (maxdiff.quantization) on the tiny SDXL checkpoint.

The quality thresholds below were written before the quantized pipelines were first run (issue
#29): int8 weights (alone or with int8 activations) at least 30 dB PSNR against the float32
image, fp8 (e4m3, 3 mantissa bits) at least 25 dB. A broken quantizer (wrong scales, wrong
axes) lands far below (about 10-15 dB: another image).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny

from maxdiff import quantization as q
from maxdiff.models.unet import load_unet
from pipelines import TextToImagePipeline
from pipelines.config import load_run_config

pytest.importorskip("qwix")

SIZE = 32  # pixels (16x16 latents with the tiny VAE)
STEPS = 4
PROMPTS = ["a red circle on a blue background", "a photo of a cat"]
MIN_PSNR = {"int8-weights": 30.0, "int8": 30.0, "fp8": 25.0}  # dB, fixed before measuring
# the UNet's transformer linear layers (by their leaf module names): what the rules quantize
LINEAR = ("proj_in", "proj_out", "to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2")


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 10 * np.log10(1.0 / max(mse, 1e-20))


def _images(pipe) -> np.ndarray:
    return pipe(PROMPTS, num_inference_steps=STEPS, height=SIZE, width=SIZE, seed=[1, 2],
                output_type="np").images


@pytest.fixture(scope="module")
def fp32_pipe(sdxl_dir):
    return TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)


@pytest.fixture(scope="module")
def fp32_images(fp32_pipe):
    return _images(fp32_pipe)


@pytest.fixture(scope="module")
def unet(sdxl_dir):
    return load_unet(Path(sdxl_dir) / "unet")


# ---------------------------------------------------------------------------------- the setting
@pytest.mark.parametrize("bad", ["int4", "INT8", "", None, 8])
def test_setting_is_validated(bad):
    with pytest.raises(ValueError, match=r"quantization=.*allowed: none, int8-weights, int8, fp8"):
        q.check_quantization(bad)


def test_run_config_and_from_pretrained_refuse_bad_values(sdxl_dir):
    with pytest.raises(ValueError, match=r"'quantization'.*'none', 'int8-weights', 'int8' or 'fp8'"):
        load_run_config(None, ["quantization=int4"])
    assert load_run_config(None, ["quantization=int8"]).pipeline_kwargs()["quantization"] == "int8"
    with pytest.raises(ValueError, match=r"quantization='int4'; allowed: none, int8-weights"):
        TextToImagePipeline.from_pretrained(sdxl_dir, quantization="int4", compile_cache_dir=None)


# ---------------------------------------------------------------------------------- the weights
@pytest.mark.parametrize("mode, qdtype", [("int8-weights", jnp.int8), ("int8", jnp.int8),
                                          ("fp8", jnp.float8_e4m3fn)])
def test_quantized_unet_weights(unet, mode, qdtype):
    """Every transformer linear kernel (and only those) is stored as int8 / float8 values with
    one float32 scale per output channel: a quarter of float32's bytes, plus the scales."""
    model, params = unet
    qmodel, qparams = q.quantize(model, params, mode)
    paths = q.quantized_layers(qparams)
    flat = {"/".join(k.key for k in path): leaf for path, leaf in
            jax.tree_util.tree_flatten_with_path(params)[0]}
    want = sorted(p for p in flat if p.endswith("/kernel") and "attentions." in p
                  and p.split("/")[-2] in LINEAR and flat[p].ndim == 2)
    assert want and sorted(paths) == want  # no conv, no time embedding, no time_emb_proj
    for path in paths:
        node = qparams
        for k in path.split("/"):
            node = node[k]
        qa = node.array
        assert qa.qvalue.dtype == qdtype and qa.qvalue.shape == flat[path].shape
        assert qa.scale.dtype == jnp.float32 and qa.scale.shape == (1, flat[path].shape[1])
        assert qa.qvalue.nbytes == flat[path].nbytes // 4
    assert q.nbytes(qparams) < q.nbytes(params)
    saved = sum(flat[p].nbytes * 3 // 4 - flat[p].shape[1] * 4 for p in paths)
    assert q.nbytes(params) - q.nbytes(qparams) == saved
    assert q.quantize(model, params, "none") == (model, params)
    assert q.quantized_layers(params) == []


def test_a_model_without_matching_layers_is_refused(unet):
    """A UNet without transformers would run unquantized: refused, not silently float."""
    import flax.linen as nn

    class Plain(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="conv_out")(x)

        def dummy_inputs(self):
            return {"x": jax.ShapeDtypeStruct((1, 8), jnp.float32)}

    model = Plain()
    params = model.init(jax.random.key(0), jnp.ones((1, 8)))["params"]
    with pytest.raises(ValueError, match=r"quantization='int8': no layer of this Plain matches"):
        q.quantize(model, params, "int8")


# ---------------------------------------------------------------------------------- the program
_DOT = re.compile(r"stablehlo.dot_general.*: \(tensor<[\dx]*x(\w+)>, tensor<[\dx]*x(\w+)>\) "
                  r"-> tensor<[\dx]*x(\w+)>")
_COMPILED_DOT = re.compile(r"= (\w+)\[[\d,]*\]\{[\d,]*\} dot\(")


def _programs(model, params) -> tuple[list[tuple[str, str, str]], list[str], str]:
    """(the lowered program's dots as (lhs, rhs, result) element types, the compiled program's
    dot result types, the lowered text) of one UNet forward."""
    b = 2
    args = dict(sample=jnp.ones((b, 16, 16, 4)), timesteps=jnp.full((b,), 10.0),
                encoder_hidden_states=jnp.ones((b, 77, 64)), text_embeds=jnp.ones((b, 32)),
                time_ids=jnp.ones((b, 6)))
    lowered = jax.jit(lambda p, a: model.apply({"params": p}, **a)).lower(params, args)
    text = lowered.as_text()
    return _DOT.findall(text), _COMPILED_DOT.findall(lowered.compile().as_text()), text


def test_compiled_programs_differ(unet):
    """Without quantization every dot is float32. With int8 each quantized layer is one
    int8 x int8 -> int32 dot, and XLA keeps it an integer dot; with int8-weights the int8
    weights are converted to float32 before float32 dots (dequantise, then the float matmul);
    with fp8 each quantized layer is one float8 x float8 dot, which the CPU runs emulated
    (XLA:CPU upcasts the operands: its compiled dots are all float32)."""
    model, params = unet
    dots, compiled, text = _programs(model, params)
    assert set(dots) == {("f32", "f32", "f32")} and set(compiled) == {"f32"}
    assert "xi8>" not in text and "f8E4M3FN" not in text

    n = len(q.quantized_layers(q.quantize(model, params, "int8")[1]))
    dots, compiled, _ = _programs(*q.quantize(model, params, "int8"))
    assert dots.count(("i8", "i8", "i32")) == n and "s32" in compiled

    dots, compiled, text = _programs(*q.quantize(model, params, "int8-weights"))
    assert set(dots) == {("f32", "f32", "f32")} and set(compiled) == {"f32"}
    assert len(re.findall(r"stablehlo.convert .*xi8>\) -> tensor<[\dx]*xf32>", text)) >= n

    dots, compiled, _ = _programs(*q.quantize(model, params, "fp8"))
    assert dots.count(("f8E4M3FN", "f8E4M3FN", "f32")) == n
    if jax.default_backend() == "cpu":
        assert set(compiled) == {"f32"}


# ---------------------------------------------------------------------------------- the pipeline
@pytest.mark.parametrize("mode", ["int8-weights", "int8", "fp8"])
def test_quantized_pipeline_image_close_to_fp32(sdxl_dir, fp32_images, mode):
    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, quantization=mode, compile_cache_dir=None)
    assert pipe.quantization == mode and q.quantized_layers(pipe.params["unet"])
    got = _images(pipe)
    psnr = _psnr(got, fp32_images)
    print(f"{mode} vs fp32: PSNR {psnr:.1f} dB, max abs {np.abs(got - fp32_images).max():.4f}")
    assert psnr >= MIN_PSNR[mode], psnr
    assert not np.array_equal(got, fp32_images)  # quantization did change the numbers


# ---------------------------------------------------------------------------------- LoRA
@pytest.fixture(scope="module")
def int8_pipe(sdxl_dir):
    return TextToImagePipeline.from_pretrained(sdxl_dir, quantization="int8",
                                               compile_cache_dir=None)


def test_lora_is_refused_on_a_quantized_pipeline(sdxl_dir, int8_pipe, tmp_path):
    lora = tiny.make_sdxl_lora(sdxl_dir, tmp_path / "lora.safetensors")
    with pytest.raises(ValueError, match=r"LoRA adapters are not supported with "
                                         r"quantization='int8'.*quantization='none'"):
        int8_pipe.load_lora_weights(lora)
    with pytest.raises(ValueError, match=r"per-image adapters are not supported with "
                                         r"quantization='int8'"):
        int8_pipe.add_adapter("style", lora)
    assert int8_pipe.lora_adapters == [] and int8_pipe.adapters == []
    with pytest.raises(ValueError, match=r"loras are not supported with quantization='fp8'"):
        load_run_config(None, {"quantization": "fp8", "loras": [str(lora)]})


def test_serve_args_refuse_adapters_and_loras_with_quantization(sdxl_dir, tmp_path):
    """The service's front door: a bad value, fused loras or per-request adapters with a
    quantized model fail when the application is built (before any replica starts)."""
    from serving.models import Catalog
    from serving.settings import ServeSettings

    lora = tiny.make_sdxl_lora(sdxl_dir, tmp_path / "lora.safetensors")
    with pytest.raises(ValueError, match=r"'quantization'.*'none', 'int8-weights', 'int8' or 'fp8'"):
        ServeSettings.from_args({"model": str(sdxl_dir), "quantization": "int4"})
    with pytest.raises(ValueError, match=r"loras are not supported with quantization='int8'"):
        ServeSettings.from_args({"model": str(sdxl_dir), "quantization": "int8", "lora": str(lora)})
    s = ServeSettings.from_args({"model": str(sdxl_dir), "quantization": "int8",
                                 "adapters": f"style={lora}"})
    with pytest.raises(ValueError, match=r"serve arg adapters are not supported with "
                                         r"quantization='int8'"):
        Catalog.from_settings(s)
    s = ServeSettings.from_args({"models": [
        {"name": "plain", "model": str(sdxl_dir), "adapters": {"style": str(lora)}},
        {"name": "small", "model": str(sdxl_dir), "quantization": "int8-weights",
         "adapters": {"style": str(lora)}}]})
    with pytest.raises(ValueError, match=r"models\[1\] \(small\): adapters are not supported "
                                         r"with quantization='int8-weights'"):
        Catalog.from_settings(s)
    s = ServeSettings.from_args({"model": str(sdxl_dir), "quantization": "fp8"})
    assert Catalog.from_settings(s).default.run_config.quantization == "fp8"


def _cli(*args, timeout=300) -> subprocess.CompletedProcess:
    """The console script in a subprocess (``python -m pipelines.cli``)."""
    repo = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *map(str, args)],
                          env=dict(os.environ, PYTHONPATH=str(repo)), capture_output=True,
                          text=True, timeout=timeout)


def test_cli_refuses_lora_with_quantization(sdxl_dir, tmp_path):
    """``--quantization int8 --lora FILE``: refused before the model loads (exit 2, named)."""
    lora = tiny.make_sdxl_lora(sdxl_dir, tmp_path / "lora.safetensors")
    res = _cli("generate", "a red circle", "--model", sdxl_dir, "--quantization", "int8",
               "--lora", lora, "--out", tmp_path / "out")
    assert res.returncode == 2, res.stderr
    assert "loras are not supported with quantization='int8'" in res.stderr
    assert not (tmp_path / "out" / "metadata.jsonl").exists()


@pytest.mark.slow  # a CLI run that compiles; the Python API's int8 images are tested above
def test_cli_generate_quantized(sdxl_dir, int8_pipe, tmp_path):
    """``maxdiff generate --quantization int8``: the record and the PNG say int8, and the pixels
    are the Python API's with the same setting (one image: the same padded batch of 1)."""
    from PIL import Image

    from pipelines import image_files

    res = _cli("generate", "a red circle", "--model", sdxl_dir, "--steps", "1", "--seed", "3",
               "--quantization", "int8", "--out", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    rec = json.loads((tmp_path / "out" / "metadata.jsonl").read_text().splitlines()[0])
    assert rec["quantization"] == "int8"
    file = tmp_path / "out" / rec["file"]
    assert image_files.read_image_info(file)["quantization"] == "int8"
    got = np.asarray(Image.open(file), np.int16)
    want = np.asarray(int8_pipe("a red circle", num_inference_steps=1, seed=rec["seed"],
                                guidance_scale=rec["guidance"]).images[0], np.int16)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1  # XLA threads: last bit


@pytest.mark.parametrize("mode", [pytest.param("int8-weights", marks=pytest.mark.slow), "int8"])
def test_step_engine_runs_the_quantized_unet(sdxl_dir, int8_pipe, mode):
    """The step engine (engine=step serving) builds its own programs from the pipeline's UNet
    and weights. With int8 weights only, its images equal the pipeline's (to float rounding).
    With int8 activations they are equal only up to quantization noise: the engine's program
    (2 slots) and the pipeline's (a batch of 1) differ in the last bits of their float work,
    and rounding activations to int8 turns such a difference into a whole int8 step now and
    then (the tiny random UNet moves by ~0.05 for a 1e-6 change of its input). Within one
    program an image never depends on its batch (per-token scales): the same request twice in
    one tick gives the same image."""
    from pipelines.requests import ImageRequest
    from pipelines.step_engine import StepEngine

    pipe = int8_pipe if mode == "int8" else TextToImagePipeline.from_pretrained(
        sdxl_dir, quantization=mode, compile_cache_dir=None)
    items = [ImageRequest("a red circle", seed=1, guidance_scale=4.0),
             ImageRequest("a red circle", seed=1, guidance_scale=4.0),
             ImageRequest("a photo of a cat", seed=2, guidance_scale=1.0)]
    eng = StepEngine(pipe, SIZE, SIZE, slots=2, output_type="np")
    handles = [eng.submit(items[0], 2), eng.submit(items[1], 2)]
    eng.run_until_idle()
    handles.append(eng.submit(items[2], 2))
    eng.run_until_idle()
    np.testing.assert_array_equal(handles[0].image, handles[1].image)
    for h, it in zip(handles, items):
        alone = pipe.generate([it], height=SIZE, width=SIZE, num_inference_steps=2,
                              output_type="np").images[0]
        if mode == "int8-weights":
            np.testing.assert_allclose(h.image, alone, atol=1e-5)
        else:
            assert _psnr(h.image, alone) >= MIN_PSNR[mode]


def test_cli_info_counts_a_quantized_unet(sdxl_dir, capsys):
    """``maxdiff info --quantization int8-weights``: the UNet has as many parameters as the
    float one, now loaded as float32 and int8; a bad value is a usage error naming the choices."""
    from pipelines import cli

    counts = {}
    for mode in ("none", "int8-weights"):
        assert cli.main(["info", "--model", str(sdxl_dir), "--quantization", mode, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["quantization"] == mode
        counts[mode] = report["components"]["unet"]
    assert counts["none"]["parameters"] == counts["int8-weights"]["parameters"]
    assert counts["none"]["dtype"] == ["float32"]
    assert counts["int8-weights"]["dtype"] == ["float32", "int8"]
    assert cli.main(["info", "--model", str(sdxl_dir), "--quantization", "int4"]) == 2
    assert re.search(r"--quantization: invalid choice: 'int4' \(choose from '?none'?, "
                     r"'?int8-weights'?, '?int8'?, '?fp8'?\)", capsys.readouterr().err)


def test_image_to_image_runs_the_quantized_unet(fp32_pipe, int8_pipe):
    """The edit pipelines wrap a text-to-image pipeline and build their own programs from its
    UNet: image-to-image on the int8 pipeline differs from float32's, within the int8 threshold."""
    from pipelines.edit import ImageToImagePipeline

    image = np.random.default_rng(0).uniform(0, 1, (SIZE, SIZE, 3)).astype(np.float32)
    out = [ImageToImagePipeline(p)("a red circle", image=image, strength=0.5,
                                   num_inference_steps=4, seed=5, output_type="np").images[0]
           for p in (fp32_pipe, int8_pipe)]
    assert not np.array_equal(out[0], out[1])
    assert _psnr(out[1], out[0]) >= MIN_PSNR["int8"]


def test_without_qwix_the_error_says_what_to_install(unet, monkeypatch):
    """qwix is needed only when quantization is asked for; without it the error names the extra
    to install, and "none" still works."""
    monkeypatch.setitem(sys.modules, "qwix", None)  # `import qwix` raises ImportError
    model, params = unet
    with pytest.raises(ImportError, match=r"quantization='int8' needs qwix: pip install "
                                          r"'maxdiff\[quant\]'"):
        q.quantize(model, params, "int8")
    assert q.quantize(model, params, "none") == (model, params)


@pytest.mark.slow  # a subprocess with 4 host devices compiling 4 pipelines
def test_data_parallel_quantized(sdxl_dir):
    """4 host devices: the quantized weights are replicated and the batch sharded; with int8
    weights only the images equal one device's (float rounding); with int8 activations they
    agree within the int8 threshold (two programs: see the step engine test)."""
    import textwrap

    script = textwrap.dedent(f"""
        import json, numpy as np, jax
        from maxdiff import quantization as q
        from pipelines import TextToImagePipeline
        assert jax.local_device_count() == 4, jax.devices()
        res = {{}}
        for mode in ("int8-weights", "int8"):
            out = {{}}
            for d in (4, 1):
                p = TextToImagePipeline.from_pretrained({str(sdxl_dir)!r}, devices=d,
                                                        quantization=mode)
                kernel = p.params["unet"]
                for k in q.quantized_layers(kernel)[0].split("/"):
                    kernel = kernel[k]
                assert len(kernel.array.qvalue.sharding.device_set) == d
                out[d] = p(["a red circle", "a blue square", "the dog"], seed=11,
                           num_inference_steps=2, guidance_scale=3.0, output_type="np").images
            mse = float(np.mean((out[4].astype(np.float64) - out[1]) ** 2))
            res[mode] = [float(np.abs(out[4] - out[1]).max()), 10 * np.log10(1 / max(mse, 1e-20))]
        print(json.dumps(res))
    """)
    res = tiny.run_on_host_devices(script, 4)
    assert res["int8-weights"][0] <= 5e-6, res  # test_pipeline's bound for float32
    assert res["int8"][1] >= MIN_PSNR["int8"], res


# ---------------------------------------------------------------------------------- checkpoints
def test_convert_quantize_round_trip(sdxl_dir, int8_pipe, tmp_path):
    """``maxdiff convert SRC DST --quantize int8``: DST's UNet holds the int8 values and float32
    scales quantizing at load makes (and no float UNet file), its config names the mode; loaded
    with quantization="int8" it has the same arrays and gives the same pixels, to the bit. Loading
    it with another mode, or a file with a wrong dtype, a missing or an extra tensor, is a
    CheckpointError naming the mode or the tensor; --quantize to a single file is refused."""
    from maxdiff.checkpoint import CheckpointError, SafetensorsFile, save_safetensors
    from pipelines import cli

    dst = tmp_path / "int8"
    assert cli.main(["convert", str(sdxl_dir), str(dst), "--quantize", "int8",
                     "--dtype", "float32"]) == 0
    unet = dst / "unet"
    assert json.loads((unet / "config.json").read_text())[q.CONFIG_KEY] == "int8"
    assert [p.name for p in unet.glob("*.safetensors")] == [q.WEIGHTS_FILE]
    f = SafetensorsFile(unet / q.WEIGHTS_FILE)
    qkeys = sorted(k for k in f.keys() if k.endswith("/array/qvalue"))
    want = int8_pipe.params["unet"]
    assert [k.removesuffix("/array/qvalue") for k in qkeys] == sorted(q.quantized_layers(want))
    assert {f.dtype(k) for k in qkeys} == {np.dtype(np.int8)}
    assert {f.dtype(k.replace("/qvalue", "/scale")) for k in qkeys} == {np.dtype(np.float32)}

    pipe = TextToImagePipeline.from_pretrained(dst, quantization="int8", compile_cache_dir=None)
    got = pipe.params["unet"]
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert all(a.dtype == b.dtype and np.array_equal(a, b)
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    kw = dict(num_inference_steps=2, height=SIZE, width=SIZE, seed=4, output_type="np")
    np.testing.assert_array_equal(pipe("a red circle", **kw).images,
                                  int8_pipe("a red circle", **kw).images)

    for mode in ("none", "fp8"):
        with pytest.raises(CheckpointError, match=rf"holds UNet weights quantized to 'int8'.*"
                                                  rf"quantization='int8', not '{mode}'"):
            TextToImagePipeline.from_pretrained(dst, quantization=mode, compile_cache_dir=None)
    tensors = {k: f.get(k) for k in f.keys()}
    k0 = qkeys[0]
    name = re.escape(repr(k0))
    for change, message in (
            (lambda t: t.update({k0: t[k0].astype(np.float32)}),
             rf"tensor {name} is float32, expected int8"),
            (lambda t: t.pop(k0), rf"missing tensor {name}"),
            (lambda t: t.update({"extra": np.zeros(2, np.float32)}), "unexpected tensor 'extra'")):
        bad = dict(tensors)
        change(bad)
        save_safetensors(bad, unet / q.WEIGHTS_FILE, f.metadata)
        with pytest.raises(CheckpointError, match=rf"{q.WEIGHTS_FILE}: {message}"):
            TextToImagePipeline.from_pretrained(dst, quantization="int8", compile_cache_dir=None)
    assert cli.main(["convert", str(sdxl_dir), str(tmp_path / "q.safetensors"),
                     "--quantize", "int8"]) == 2
