"""The shared request model (pipelines.requests), without Ray or JAX."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from pipelines.image_files import encode_image, read_image_info
from pipelines.limits import MAX_SEED, cfg_on
from pipelines.requests import (
    GenerationRequest,
    ImageRequest,
    ShapeKey,
    bucket_size,
    derive_seed,
    image_seeds,
    pad_to,
    parse_size,
    plan_batches,
)


@pytest.mark.parametrize("text, want", [("1024x768", (1024, 768)), ("512", (512, 512)),
                                        (" 64 X 96 ", (64, 96)), ("8×16", (8, 16)), (256, (256, 256))])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("bad", ["", "auto", "1024x", "x768", "-5", "0x8", "1.5", True, None, 3.0])
def test_parse_size_refuses(bad):
    with pytest.raises(ValueError, match="WIDTHxHEIGHT|positive"):
        parse_size(bad)


def test_shape_key_and_cfg_rule():
    assert cfg_on(1.01) and not cfg_on(1.0) and not cfg_on(0)
    k = ShapeKey.of(64, 96, 4, 7.5)
    assert k == ShapeKey(64, 96, 4, True) and k.hires is None and str(k) == "96x64:4:cfg"
    r = GenerationRequest("a", None, 5, 2, width=96, height=64, steps=4, guidance_scale=0.0)
    assert r.key == ShapeKey(64, 96, 4, False)


def test_seeds_are_seed_plus_k_and_stay_in_range():
    assert image_seeds(7, 3) == [7, 8, 9]
    assert image_seeds(None, 2) == [None, None]
    assert image_seeds(MAX_SEED, 1) == [MAX_SEED]
    with pytest.raises(ValueError, match="seed \\+ n - 1 must stay in range"):
        image_seeds(MAX_SEED, 2)
    with pytest.raises(ValueError, match="out of range"):
        image_seeds(-1, 1)
    r = GenerationRequest("a", "b", 10, 3, 64, 64, 4, 7.0)
    assert [(i.prompt, i.negative_prompt, i.seed, i.guidance_scale) for i in r.images()] == [
        ("a", "b", 10, 7.0), ("a", "b", 11, 7.0), ("a", "b", 12, 7.0)]
    assert derive_seed(1, 3, 0) == derive_seed(1, 3, 0) != derive_seed(1, 3, 1)
    assert 0 <= derive_seed(123, 0, 0) <= MAX_SEED


def test_image_request_validation():
    ImageRequest("a", seed=0, guidance_scale=0).validate()
    for bad, match in [(dict(seed=MAX_SEED + 1), "out of range"), (dict(seed=True), "out of range"),
                       (dict(guidance_scale=float("nan")), "guidance_scale"),
                       (dict(guidance_rescale=2.0), "guidance_rescale"),
                       (dict(negative_prompt=3), "negative_prompt must be a string")]:
        with pytest.raises(ValueError, match=match):
            ImageRequest("a", **bad).validate(2)
    with pytest.raises(ValueError, match="n=0"):
        GenerationRequest("a", None, None, 0, 64, 64, 4, 1.0).validate()


def test_buckets_and_batch_plans():
    assert [bucket_size(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    assert [bucket_size(n, 4) for n in (1, 4, 5, 9)] == [4, 4, 8, 16]
    with pytest.raises(ValueError):
        bucket_size(0)
    entries = [("a", 1), ("b", 1), ("a", 2), ("a", 3), ("b", 2), ("a", 4), ("a", 5)]
    plan = list(plan_batches(entries, lambda e: e[0], 2))
    assert [(k, [e[1] for e in part], b) for k, part, b in plan] == [
        ("a", [1, 2], 2), ("a", [3, 4], 2), ("a", [5], 2), ("b", [1, 2], 2)]
    assert pad_to([1, 2, 3], 4) == [1, 2, 3, 3]
    with pytest.raises(ValueError):
        pad_to([1, 2, 3], 2)


def test_encode_image_carries_settings(tmp_path):
    pixels = np.random.default_rng(0).integers(0, 256, (8, 16, 3), np.uint8)
    for fmt in ("png", "jpeg", "webp"):
        data = encode_image(pixels, fmt, {"prompt": "a fox", "seed": "7"})
        assert data == encode_image(Image.fromarray(pixels), fmt, {"prompt": "a fox", "seed": "7"})
        path = tmp_path / f"x.{fmt}"
        path.write_bytes(data)
        info = read_image_info(path)
        assert info["prompt"] == "a fox" and info["seed"] == "7"
        assert Image.open(io.BytesIO(data)).size == (16, 8)
    plain = encode_image(pixels)  # no settings: a plain PNG, lossless
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(plain))), pixels)
    small = encode_image(pixels, "jpeg", quality=5)
    assert len(small) < len(encode_image(pixels, "jpeg"))
    with pytest.raises(ValueError, match="format 'gif'"):
        encode_image(pixels, "gif")


def test_decode_image_and_repaint_masks():
    from pipelines.conditioned_requests import EditRequest
    from pipelines.image_files import decode_image, repaint_mask

    pixels = np.random.default_rng(0).integers(0, 256, (8, 16, 3), np.uint8)
    rgb, alpha = decode_image(encode_image(pixels))
    assert np.array_equal(rgb, pixels) and alpha is None
    for bad in (b"", b"not an image", encode_image(pixels)[:40]):
        with pytest.raises(ValueError, match="mask"):
            decode_image(bad, "mask")
    gif = io.BytesIO()
    Image.fromarray(pixels).save(gif, "GIF")
    with pytest.raises(ValueError, match="GIF image; give PNG, JPEG or WebP"):
        decode_image(gif.getvalue())
    # white = repaint; transparent = repaint (OpenAI), automatic by the alpha channel
    white = np.zeros((8, 16), np.uint8)
    white[:, :5] = 255
    gray_rgb, a = decode_image(encode_image(np.dstack([white] * 3)))
    assert a is None and np.array_equal(repaint_mask(gray_rgb, a), white)
    rgba = io.BytesIO()
    Image.fromarray(np.dstack([np.zeros((8, 16, 3), np.uint8), 255 - white])).save(rgba, "PNG")
    rgb, a = decode_image(rgba.getvalue())
    assert np.array_equal(repaint_mask(rgb, a), white)
    assert np.array_equal(repaint_mask(rgb, a, transparent=True), white)
    assert not repaint_mask(rgb, a, transparent=False).any()  # black pixels: keep
    opaque = np.full((8, 16), 255, np.uint8)  # an opaque RGBA mask: white = repaint, or
    assert np.array_equal(repaint_mask(np.dstack([white] * 3), opaque), white)
    assert not repaint_mask(np.dstack([white] * 3), opaque, transparent=True).any()  # OpenAI
    job = EditRequest("x", None, 1, 1, 16, 8, 2, 0.0, strength=0.5, image=pixels, mask=white)
    job.validate()
    for s, msg in ((0, r"\(0, 1\]"), (1.5, r"\(0, 1\]"), (True, r"\(0, 1\]"),
                   (0.25, "leaves no denoising step")):
        with pytest.raises(ValueError, match=msg):
            EditRequest("x", None, 1, 1, 16, 8, 2, 0.0, strength=s, image=pixels).validate()
    assert str(job.key) == "inpaint:16x8:2:nocfg:s0.5" and job.key.program == (
        "inpaint", 8, 16, 2, False)
    with pytest.raises(ValueError, match="mask is 5x8 but image is 16x8"):
        EditRequest("x", None, 1, 1, 16, 8, 2, 0.0, image=pixels, mask=white[:, :5]).validate()


def test_prompt_items_fan_out_prompts_seeds_and_sizes():
    """pipelines.prompting.prompt_items: image k gets prompt k // num_images_per_prompt and
    seed + k; a single negative serves every prompt; SDXL's negative size conditioning applies
    when both sizes are given; guidance left out stays None (the pipeline's default)."""
    from pipelines.prompting import prompt_items

    items, picked = prompt_items(["a", "b"], None, "blurry", None, 2, 10,
                                 per_prompt={"image": ["x", "y"]}, guidance_scale=None,
                                 negative_original_size=(512, 512),
                                 negative_crops_coords_top_left=(4, 8),
                                 negative_target_size=(1024, 1024))
    assert [(it.prompt, it.prompt_2, it.negative_prompt, it.seed) for it in items] == [
        ("a", "a", "blurry", 10), ("a", "a", "blurry", 11), ("b", "b", "blurry", 12),
        ("b", "b", "blurry", 13)]
    assert picked == {"image": ["x", "x", "y", "y"]}
    assert all(it.negative_size == ((512, 512), (4, 8), (1024, 1024)) for it in items)
    assert all(it.guidance_scale is None for it in items)
    one, _ = prompt_items("a", None, None, None, 1, [7], guidance_scale=3.0,
                          negative_original_size=(512, 512))
    assert one[0].negative_size is None and one[0].seed == 7 and one[0].guidance_scale == 3.0
    with pytest.raises(ValueError, match="negative_prompt has 3 entries but prompt has 2"):
        prompt_items(["a", "b"], None, ["x", "y", "z"], None, 1, None, guidance_scale=None)


def test_batch_keys_describe_their_shape():
    """What the CLI's progress bar says of a batch, for every kind of key."""
    from pipelines.conditioned_requests import ControlKey, EditKey
    from pipelines.requests import HiresFix, ShapeKey

    assert ShapeKey.of(32, 48, 2, 5.0).describe() == "48x32, 2 step(s), guidance on"
    hires = HiresFix(2.0, 0.5)
    assert ShapeKey.of(32, 48, 2, 1.0, hires).describe() == \
        f"48x32, 2 step(s), guidance off, {hires}"
    assert EditKey("inpaint", 32, 48, 3, True, 0.5).describe() == \
        "inpaint (strength 0.5) 48x32, 3 step(s), guidance on"
    assert ControlKey(("canny", "depth"), 32, 48, 3, False).describe() == \
        "2 ControlNet(s), 48x32, 3 step(s), guidance off"


def test_each_request_kind_answers_for_what_it_adds():
    """The front doors ask a request, never its class, what its kind adds: the ControlNets, each
    image's device-batch extra (dispatch's), the settings its files record, the program key."""
    from pipelines.conditioned_requests import ControlImage, ControlRequest, EditRequest
    from pipelines.requests import GenerationRequest

    base = dict(prompt="a", negative_prompt=None, seed=1, n=2, width=48, height=32, steps=3,
                guidance_scale=5.0)
    text = GenerationRequest(**base)
    assert text.controlnets == () and text.batch_extra() is None and text.file_settings() == {}
    assert text.key.program == tuple(text.key)

    rgb = np.zeros((32, 48, 3), np.uint8)
    rgb[..., 1] = 200
    mask = np.zeros((32, 48), np.uint8)
    mask[4:9] = 255
    for m, kind in ((None, "img2img"), (mask, "inpaint")):
        edit = EditRequest(**base, strength=0.25, image=rgb, mask=m)
        image, pil_mask = edit.batch_extra()
        assert edit.controlnets == () and np.array_equal(np.asarray(image), rgb)
        assert (pil_mask is None) == (m is None)
        if m is not None:
            assert pil_mask.mode == "L" and np.array_equal(np.asarray(pil_mask), mask)
        assert edit.file_settings() == {"mode": kind, "strength": "0.25"}
        assert edit.key.program == (kind, 32, 48, 3, True)

    control = ControlRequest(**base, controls=(
        ("canny", ControlImage(rgb, 0.5, 0.0, 0.8)),
        ("depth", ControlImage(rgb, 1.0, 0.1, 1.0, guess_mode=True))))
    assert control.controlnets == ("canny", "depth")
    extra = control.batch_extra()
    assert [(c.scale, c.start, c.end, c.guess_mode) for c in extra] == \
        [(0.5, 0.0, 0.8, False), (1.0, 0.1, 1.0, True)]
    assert all(np.array_equal(np.asarray(c.image), rgb) for c in extra)
    assert control.file_settings() == {
        "mode": "controlnet", "controlnet": "canny:0.5[0-0.8]; depth:1[0.1-1] guess"}
    assert control.key.program == (("canny", "depth"), 32, 48, 3, True)
