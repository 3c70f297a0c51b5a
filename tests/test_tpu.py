"""Every served program compiles for a TPU v5e topology on this CPU machine (libtpu, no chip),
data-parallel without collectives, with the accelerator's kernels: the tiny checkpoint's
text-to-image (CFG on and off), image-to-image, inpainting, ControlNet, base + refiner and the
step engine's programs. A tiny program takes 25-50 s to compile for a TPU here (never cached:
a compile-only executable cannot be loaded back), so the default suite compiles text-to-image
with CFG and the other tasks run in the slow suite. Full-size SDXL compiles take many minutes:
benchmarks/tpu_report.py."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

pytest.importorskip("libtpu", reason="the test extra installs libtpu (jax[tpu])")

import tiny  # noqa: E402

from maxdiff import checkpoint, target  # noqa: E402
from maxdiff import mesh as meshlib
from maxdiff.models import conv  # noqa: E402
from maxdiff.models.attention import resolve_kernel  # noqa: E402
from pipelines import aot  # noqa: E402

TOPOLOGY = "v5e:2x2"
SIZE = 64  # tiny VAE (factor 2): 32² latents, 16² = 256 tokens where the UNet attends
SPLASH = "tpu_custom_call"  # a Pallas TPU kernel in the compiled HLO


@pytest.fixture(scope="module")
def tpu_mesh():
    return meshlib.topology_mesh(TOPOLOGY)


@pytest.fixture(scope="module")
def pipe(sdxl_dir):
    return aot.load(sdxl_dir, TOPOLOGY)


def _only(recorded) -> str:
    assert len(recorded) == 1
    return recorded[0]["compiled"].as_text()


def test_the_target_devices_choose_the_kernels(tpu_mesh, monkeypatch):
    """Inside a trace the mesh's devices decide, not the compiling machine's backend."""
    monkeypatch.delenv("MAXDIFF_CONV", raising=False)
    cpu_mesh = meshlib.make_mesh(1)
    assert target.platform() == "cpu" and conv.fast_cpu_convs()
    with jax.sharding.use_abstract_mesh(tpu_mesh.abstract_mesh):
        assert target.platform() == "tpu" and target.data_shards() == 4
        assert resolve_kernel("auto", 4096, 4096) == "splash"
        assert resolve_kernel("auto", 4096, 77) == "xla"  # the text tokens: a small score matrix
        assert resolve_kernel("auto", 576, 576) == "xla"  # not in whole 128-row blocks
        assert not conv.fast_cpu_convs()
    with jax.sharding.use_abstract_mesh(cpu_mesh.abstract_mesh):
        assert target.platform() == "cpu"
        assert resolve_kernel("auto", 4096, 4096) == "chunked"
    assert target.default_dtype("tpu") == target.default_dtype("gpu") == "bfloat16"
    assert target.default_dtype("cpu") == "float32"


def test_a_compile_only_mesh_loads_shapes_in_bfloat16(pipe, tpu_mesh):
    assert meshlib.compile_only(tpu_mesh) and not meshlib.compile_only(meshlib.make_mesh(1))
    leaves = jax.tree.leaves(pipe.params)
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in leaves)
    assert {str(a.dtype) for a in leaves} == {"bfloat16"}  # dtype="auto" on a TPU, VAE too
    assert all(a.sharding.is_fully_replicated for a in leaves)


@pytest.mark.parametrize("guidance", [pytest.param(0.0, marks=pytest.mark.slow), 5.0])
def test_text_to_image_is_data_parallel_with_splash(pipe, guidance):
    """DPM++ 2M: its state holds a history per image, which is split over the chips as the
    latents are (no chip holds the whole batch's)."""
    with aot.recording() as rec:
        out = pipe(["a red circle"] * 4, num_inference_steps=2, guidance_scale=guidance,
                   height=SIZE, width=SIZE, seed=1, scheduler="dpmpp_2m")
    assert len(out.images) == 4 and out.images[0].size == (SIZE, SIZE)
    hlo = _only(rec)
    assert aot.collectives(hlo) == {}
    latents = rf"f32\[(\d+),{SIZE // 2},{SIZE // 2},4\]\S* parameter\(\d+\), sharding=(\S+)"
    params = re.findall(latents, hlo)
    assert params and all(rows == "1" and "devices=[4" in how for rows, how in params), params
    assert SPLASH in hlo
    assert rec[0]["kernel_flops"] > 0
    a = aot.analyse(rec[0], aot.chip_of(pipe.mesh), 1)
    assert a["fits"] and a["tflop"] > 0 and a["collective_ops"] == 0


def test_feature_caching_stays_data_parallel(pipe):
    """DeepCache's full/shallow conditional and the cutoff's unguided tail (the conditioning's
    halves) compile for the chips with no collective and the splash kernel."""
    with aot.recording() as rec:
        pipe(["a red circle"] * 4, num_inference_steps=4, guidance_scale=5.0, height=SIZE,
             width=SIZE, seed=1, cfg_cutoff=0.5, deepcache_interval=2)
    hlo = _only(rec)
    assert aot.collectives(hlo) == {} and SPLASH in hlo


def test_the_hires_fix_stays_data_parallel(pipe):
    """The hires task's two passes (the first at 32², its latents upscaled to 64²) compile
    for the chips in one program with no collective and the splash kernel."""
    with aot.recording() as rec:
        pipe(["a red circle"] * 4, num_inference_steps=2, guidance_scale=5.0, height=SIZE,
             width=SIZE, seed=1, hires_scale=2.0)
    hlo = _only(rec)
    assert aot.collectives(hlo) == {} and SPLASH in hlo


@pytest.mark.slow
def test_image_to_image_and_inpainting_compile(pipe):
    from pipelines import ImageToImagePipeline, InpaintPipeline

    image = np.zeros((SIZE, SIZE, 3), np.float32)
    mask = np.zeros((SIZE, SIZE), np.float32)
    with aot.recording() as rec:
        ImageToImagePipeline.from_pipe(pipe)(["a cat"] * 4, image=image, strength=0.5,
                                             num_inference_steps=2, guidance_scale=5.0)
        InpaintPipeline.from_pipe(pipe)(["a cat"] * 4, image=image, mask_image=mask,
                                        num_inference_steps=2, guidance_scale=0.0)
    assert len(rec) == 2
    for entry in rec:
        hlo = entry["compiled"].as_text()
        assert aot.collectives(hlo) == {} and SPLASH in hlo


@pytest.mark.slow
def test_controlnet_compiles(pipe, tmp_path):
    from pipelines import ControlNetPipeline

    # a control image 2x the latents, as the tiny VAE's
    tiny.make_controlnet(tmp_path / "cn", tiny.SDXL_UNET, seed=5,
                         conditioning_embedding_out_channels=(8, 16))
    with checkpoint.shapes_only():
        cn = ControlNetPipeline.from_pipe(pipe, controlnet=tmp_path / "cn")
    with aot.recording() as rec:
        cn(["a cat"] * 4, image=np.zeros((SIZE, SIZE, 3), np.float32), num_inference_steps=2,
           guidance_scale=5.0, height=SIZE, width=SIZE)
    hlo = _only(rec)
    # one scalar all-reduce a step: whether any image's scale is non-zero (a ControlNet whose
    # scales are all 0 at a step is skipped, lax.cond), four bytes
    assert aot.collectives(hlo) == {"all-reduce": 1} and SPLASH in hlo
    assert "all-reduce(" in hlo and "u32[]" in next(
        line for line in hlo.splitlines() if "all-reduce(" in line)


@pytest.mark.slow
def test_base_and_refiner_compile_as_one_program(sdxl_dir, tmp_path):
    tiny.make_sdxl_refiner(tmp_path / "refiner")
    both = aot.load(sdxl_dir, TOPOLOGY, refiner=tmp_path / "refiner")
    with aot.recording() as rec:
        both(["a cat"] * 4, num_inference_steps=4, guidance_scale=5.0, height=SIZE, width=SIZE)
    hlo = _only(rec)
    assert aot.collectives(hlo) == {} and SPLASH in hlo


@pytest.mark.slow
def test_the_step_engine_compiles_every_program(pipe):
    """The step engine's programs (admit, step, decode per batch size) compile; its step
    program gathers a tick's slots across the mesh, so it may move rows (counted, not zero)."""
    from pipelines.step_engine import StepEngine

    engine = StepEngine(pipe, SIZE, SIZE, slots=4, cfg=True, max_steps=4)
    with aot.recording() as rec:
        n = engine.warmup()
    assert n == len({id(e["compiled"]) for e in rec}) > 0
    assert any(SPLASH in e["compiled"].as_text() for e in rec)


def test_a_topology_this_machine_cannot_describe_is_a_clear_error():
    """A GPU target needs JAX's CUDA plugin (the cuda extra, not in the test extra); an unknown
    TPU topology name is libtpu's error; both name the topology."""
    import importlib.util

    if importlib.util.find_spec("jax_cuda13_plugin") is None:
        with pytest.raises(ValueError, match="topology 'h200:1'"):
            meshlib.topology_mesh("h200:1")
    with pytest.raises(ValueError, match="topology 'v5e:9x9'"):
        meshlib.topology_mesh("v5e:9x9")


@pytest.mark.slow
def test_one_images_decode_compiles_alone(pipe):
    """pipelines.aot.vae_call: the programs' decode loop on two images a chip, whose cost XLA
    counts once (one image's): compiles with no collectives, and counts splash's work."""
    with aot.recording() as rec:
        aot.vae_call(pipe, SIZE, SIZE)
    hlo = _only(rec)
    assert aot.collectives(hlo) == {}
    a = aot.analyse(rec[0], aot.chip_of(pipe.mesh), 1)
    assert a["tflop"] > 0 and 0 < a["hbm_gbytes"] <= a["gbytes"] * 1.5
    # the mid block's attention (one head over (SIZE/2)² tokens) runs in splash inside the
    # per-chip loop: its analytic work is one image's a chip, not a quarter of it
    tokens, d = (SIZE // 2) ** 2, pipe.vae.config.block_out_channels[-1]
    assert rec[0]["kernel_flops"] / rec[0]["shards"] == 4 * tokens * tokens * d
