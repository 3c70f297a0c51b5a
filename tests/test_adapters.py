"""Per-image LoRA adapters, unfused (``TextToImagePipeline.add_adapter``): a batch mixing the
base model and two adapters equals, image by image, pipelines with each adapter fused
(``load_lora_weights``). The LoRA files are made as in tests/test_lora.py (peft on the tiny
checkpoint's torch models: UNet linear and conv layers, both text encoders)."""

from __future__ import annotations

import numpy as np
import pytest
from test_lora import TE1_A, TE2_A, TE2_B, UNET_A, UNET_B, _save_peft

from pipelines import ImageRequest, TextToImagePipeline

SIZE, STEPS = 32, 2
SCALE_A, SCALE_B = 0.7, 1.3


def make_lora_files(sdxl_dir, root) -> dict:
    """Two PEFT LoRA files for the tiny checkpoint: ``a`` (UNet linear + 3x3 conv layers, both
    text encoders, rank 4/4/2) and ``b`` (UNet linear + 1x1 conv, text_encoder_2, rank 2/8)."""
    from diffusers import StableDiffusionXLPipeline

    torch_pipe = StableDiffusionXLPipeline.from_pretrained(sdxl_dir).to("cpu")
    a = _save_peft(root / "a", torch_pipe, {"unet": UNET_A, "text_encoder": TE1_A,
                                           "text_encoder_2": TE2_A}, seed=100)
    b = _save_peft(root / "b", torch_pipe, {"unet": UNET_B, "text_encoder_2": TE2_B}, seed=200)
    return {"a": a, "b": b}


@pytest.fixture(scope="module")
def lora_files(sdxl_dir, tmp_path_factory):
    return make_lora_files(sdxl_dir, tmp_path_factory.mktemp("adapters"))


def _items(adapters):
    prompts = ["a red circle", "a blue square", "the cat!", "a tree at night"]
    return [ImageRequest(prompts[k % 4], negative_prompt="blurry" if k % 2 else None,
                         seed=10 + k, guidance_scale=4.0, adapter=a)
            for k, a in enumerate(adapters)]


def _run(pipe, adapters):
    return pipe.generate(_items(adapters), height=SIZE, width=SIZE, num_inference_steps=STEPS,
                         output_type="np").images


@pytest.fixture(scope="module")
def plain(sdxl_dir):
    return TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)


@pytest.mark.slow  # default-suite time (22-26 s): make test-slow runs it
def test_mixed_batch_equals_fused_pipelines(sdxl_dir, plain, lora_files):
    mix = [None, "a", "b", "a", None, "b"]  # 6 images: padded to a batch of 8
    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    assert pipe.add_adapter("a", lora_files["a"], scale=SCALE_A) == 1
    assert pipe.add_adapter("b", lora_files["b"], scale=SCALE_B) == 2
    assert [(x["name"], x["scale"], x["layers"], x["rank"]) for x in pipe.adapters] == [
        ("a", SCALE_A, 126 + 25 + 15, 4), ("b", SCALE_B, 53 + 6, 8)]  # b: unet r=2, te2 r=8
    assert pipe.params is plain.params or all(  # the weights are untouched
        np.array_equal(x, y) for x, y in zip(*(jax_leaves(p) for p in (pipe.params, plain.params))))
    ours = _run(pipe, mix)
    assert pipe.num_compiled == 1
    again = _run(pipe, ["b", None, None, "a", "a", "b"])  # another mix: same program
    assert pipe.num_compiled == 1

    # references: the plain pipeline, and the same weights with each adapter fused
    none = [None] * len(mix)  # the same prompts and seeds, no per-image adapter
    ref = {None: _run(plain, none)}
    for name, scale in (("a", SCALE_A), ("b", SCALE_B)):
        plain.load_lora_weights(lora_files[name], scale=scale)
        try:
            ref[name] = _run(plain, none)
        finally:
            plain.unload_lora_weights()
    errs = {}
    for k, a in enumerate(mix):
        errs.setdefault(a, []).append(float(np.abs(ours[k] - ref[a][k]).max()))
    print("max |unfused per-image - fused|:", {str(a): max(e) for a, e in errs.items()})
    assert max(max(e) for e in errs.values()) <= 2e-3, errs
    # the adapters really change the images, each differently
    for name in ("a", "b"):
        k = mix.index(name)
        assert np.abs(ours[k] - ref[None][k]).max() > 0.05
    assert np.abs(ref["a"][1] - ref["b"][1]).max() > 0.05
    # the second mix: image k's prompt and seed with another adapter, equal to its reference
    for k, a in enumerate(["b", None, None, "a", "a", "b"]):
        assert np.abs(again[k] - ref[a][k]).max() <= 2e-3, (k, a)


def jax_leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


@pytest.mark.slow  # default-suite time: make test-slow runs it
def test_without_adapters_the_program_is_unchanged(sdxl_dir, plain, lora_files):
    """No adapter added: the same program as before (no tables, no index); adapters added but
    unused: the base images, to float rounding."""
    base = _run(plain, [None, None])
    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    np.testing.assert_array_equal(_run(pipe, [None, None]), base)
    pipe.add_adapter("b", lora_files["b"])
    unused = _run(pipe, [None, None])
    print("adapters added but unused: max |diff| =", np.abs(unused - base).max())
    assert np.abs(unused - base).max() <= 1e-5
    pipe.remove_adapters()
    np.testing.assert_array_equal(_run(pipe, [None, None]), base)


def test_unknown_adapter_and_bad_names(sdxl_dir, lora_files):
    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    with pytest.raises(ValueError, match=r"adapter='a' is not added; added adapters: none"):
        _run(pipe, ["a"])
    pipe.add_adapter("b", lora_files["b"])
    with pytest.raises(ValueError, match=r"item 1: adapter='a' is not added; added adapters: b"):
        _run(pipe, [None, "a"])
    with pytest.raises(ValueError, match="already added"):
        pipe.add_adapter("b", lora_files["a"])
    with pytest.raises(ValueError, match="finite number"):
        pipe.add_adapter("c", lora_files["a"], scale=float("nan"))
