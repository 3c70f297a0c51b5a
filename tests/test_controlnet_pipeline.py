"""The ControlNet pipeline against diffusers' StableDiffusionXLControlNetPipeline on the tiny
SDXL checkpoint and tiny random ControlNets: one and two ControlNets, scales, guidance windows,
CFG on and off, guess mode, per-row settings in one batch; no recompiles when the traced
settings change; errors that name the argument."""

from __future__ import annotations

import textwrap

import jax
import numpy as np
import pytest
import tiny
import torch
from PIL import Image

from pipelines import ControlImage, ControlNetPipeline, ImageRequest, TextToImagePipeline

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SIZE = 32  # pixels; the tiny VAE's scale factor is 2: 16x16 latents
STEPS = 5
CN = dict(conditioning_embedding_out_channels=(8, 16))  # control image 2x the latents, as the VAE


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    """Two tiny random ControlNets for the tiny SDXL UNet (written by diffusers)."""
    root = tmp_path_factory.mktemp("controlnets")
    return [(root / f"cn{k}", tiny.make_controlnet(root / f"cn{k}", tiny.SDXL_UNET, seed=5 + k,
                                                   **CN)) for k in range(2)]


@pytest.fixture(scope="module")
def base(sdxl_dir):
    return TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)


@pytest.fixture(scope="module")
def one(base, nets):
    return ControlNetPipeline.from_pipe(base, controlnet=nets[0][0])


@pytest.fixture(scope="module")
def multi(base, nets):
    return ControlNetPipeline.from_pipe(base, controlnet=[p for p, _ in nets])


@pytest.fixture(scope="module")
def torch_base(sdxl_dir):
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(sdxl_dir).to("cpu")


def _theirs(torch_base, controlnet, latents, **kw):
    from diffusers import StableDiffusionXLControlNetPipeline

    pipe = StableDiffusionXLControlNetPipeline.from_pipe(torch_base, controlnet=controlnet)
    with torch.no_grad():
        return pipe(height=SIZE, width=SIZE, output_type="np", num_inference_steps=STEPS,
                    latents=torch.from_numpy(latents), **kw).images


def _latents(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 4, SIZE // 2, SIZE // 2)).astype(
        np.float32)


def _control(seed, size=(SIZE, SIZE)):
    """A random RGB control image (PIL; a size other than the output's is resized)."""
    a = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(a)


PROMPTS = ["a red circle on a blue background", "the cat!"]


def test_a_single_file_controlnet_takes_the_models_unet_config(one, base, nets, tmp_path):
    """A ControlNet downloaded as one file, without its config.json, loads with the config
    made from the model's UNet: the same module and weights as its diffusers folder."""
    import shutil

    file = tmp_path / "cn0.safetensors"
    shutil.copy(nets[0][0] / "diffusion_pytorch_model.safetensors", file)
    alone = ControlNetPipeline.from_pipe(base, controlnet=file)
    assert alone.controlnets[0].config == one.controlnets[0].config
    got, want = jax.tree_util.tree_leaves(alone._cn_params), jax.tree_util.tree_leaves(one._cn_params)
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))


@pytest.mark.parity
@pytest.mark.parametrize("case", [
    dict(controlnet_conditioning_scale=1.0, guidance_scale=5.0),
    dict(controlnet_conditioning_scale=0.5, guidance_scale=5.0, control_guidance_start=0.2,
         control_guidance_end=0.8),
    dict(controlnet_conditioning_scale=0.5, guidance_scale=0.0, control_guidance_end=0.6),
    dict(controlnet_conditioning_scale=1.0, guidance_scale=4.0, guess_mode=True,
         negative_prompt="blurry"),
], ids=["scale1-cfg", "scale0.5-window-cfg", "scale0.5-nocfg", "guess-cfg"])
def test_one_controlnet_matches_diffusers(one, nets, torch_base, case):
    """One ControlNet, two prompts with their own control images (one of another size, resized
    with Lanczos as diffusers does): every pixel within 2e-3 of diffusers'."""
    images = [_control(1, (40, 48)), _control(2)]
    lat = _latents(2, seed=3)
    ours = one(PROMPTS, image=images, num_inference_steps=STEPS, height=SIZE, width=SIZE,
               latents=lat, output_type="np", **case).images
    theirs = _theirs(torch_base, nets[0][1], lat, prompt=PROMPTS, image=images, **case)
    assert ours.shape == theirs.shape == (2, SIZE, SIZE, 3)
    assert np.abs(ours - theirs).max() <= 2e-3


@pytest.mark.parity
@pytest.mark.parametrize("case", [
    dict(controlnet_conditioning_scale=[0.5, 1.0], guidance_scale=5.0,
         control_guidance_start=[0.0, 0.4], control_guidance_end=[0.6, 1.0]),
    dict(controlnet_conditioning_scale=1.0, guidance_scale=0.0, guess_mode=True),
], ids=["scales-windows-cfg", "guess-nocfg"])
def test_two_controlnets_match_diffusers(multi, nets, torch_base, case):
    """Two ControlNets (diffusers' MultiControlNetModel: each its own image, scale and window;
    residuals summed), one control image each for every prompt: within 2e-3 of diffusers'."""
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    images = [_control(4), np.random.default_rng(5).random((SIZE, SIZE, 3)).astype(np.float32)]
    lat = _latents(2, seed=6)
    ours = multi(PROMPTS, image=images, num_inference_steps=STEPS, latents=lat,
                 output_type="np", **case).images
    # diffusers reads an array as a batch (N, H, W, C)
    batched = [images[0], images[1][None]]
    theirs = _theirs(torch_base, MultiControlNetModel([cn for _, cn in nets]), lat,
                     prompt=PROMPTS, image=batched, **case)
    assert np.abs(ours - theirs).max() <= 2e-3
    # both ControlNets matter: the first alone gives other pixels
    first = _theirs(torch_base, nets[0][1], lat, prompt=PROMPTS, image=batched[0],
                    **{k: v[0] if isinstance(v, list) else v for k, v in case.items()})
    assert np.abs(first - theirs).max() > 1e-2


@pytest.mark.parity
def test_per_row_settings_in_one_batch(multi, nets, torch_base):
    """Rows of one batch with their own control images, scales, windows and guess modes: each
    equals diffusers' run of that row alone."""
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    lat = _latents(2, seed=7)
    rows = [
        dict(image=[_control(10), _control(11)], controlnet_conditioning_scale=[1.0, 0.5],
             control_guidance_start=[0.0, 0.2], control_guidance_end=[1.0, 0.8], guess_mode=False),
        dict(image=[_control(12), _control(13)], controlnet_conditioning_scale=[0.25, 1.5],
             control_guidance_start=[0.4, 0.0], control_guidance_end=[1.0, 0.6], guess_mode=True),
    ]
    items = [ImageRequest(p, seed=k, guidance_scale=5.0)
             for k, p in enumerate(["a red circle", "a blue square"])]
    controls = [[ControlImage(r["image"][j], r["controlnet_conditioning_scale"][j],
                              r["control_guidance_start"][j], r["control_guidance_end"][j],
                              r["guess_mode"]) for j in range(2)] for r in rows]
    ours = multi.generate(items, controls, num_inference_steps=STEPS, height=SIZE, width=SIZE,
                          latents=lat, output_type="np").images
    cn = MultiControlNetModel([cn for _, cn in nets])
    for k, (it, r) in enumerate(zip(items, rows)):
        theirs = _theirs(torch_base, cn, lat[k:k + 1], prompt=it.prompt, guidance_scale=5.0, **r)
        assert np.abs(ours[k] - theirs[0]).max() <= 2e-3, k


def test_scale_window_guess_and_images_never_recompile(one):
    """Scale, window, guess mode, control images and prompts are traced: one program."""
    kw = dict(num_inference_steps=2, guidance_scale=3.0, output_type="np", seed=1)
    first = one("a red circle", image=_control(20), controlnet_conditioning_scale=0.3, **kw)
    count = one.num_compiled
    assert count >= 1
    second = one("a red circle", image=_control(21), controlnet_conditioning_scale=0.9,
                 control_guidance_start=0.5, control_guidance_end=1.0, guess_mode=True, **kw)
    third = one("the cat!", image=_control(20), controlnet_conditioning_scale=0.3,
                control_guidance_end=0.5, **kw)
    assert one.num_compiled == count
    assert np.abs(first.images - second.images).max() > 1e-3  # the settings reach the program
    assert np.abs(first.images - third.images).max() > 1e-3


def test_zero_scale_skips_the_controlnet_and_is_the_text_to_image_image(one, base):
    """Scale 0 at every step: the ControlNet is not run at all (lax.cond; a ControlNet whose
    weights are NaN leaves the image finite, while at scale 1 it makes it NaN) and the image is
    the text-to-image pipeline's for the same seed."""
    broken = ControlNetPipeline.from_pipe(base, controlnet=(
        one.controlnets[0], jax.tree.map(lambda a: a * np.nan, one.controlnet_params[0])))
    kw = dict(image=_control(22), num_inference_steps=2, guidance_scale=3.0, output_type="np",
              seed=9, height=SIZE, width=SIZE)
    ours = broken("a red circle", controlnet_conditioning_scale=0.0, **kw).images
    kw.pop("image")
    plain = base("a red circle", **kw).images
    np.testing.assert_allclose(ours, plain, atol=1e-5)
    # the same program with the window over the first step only: the NaN weights run
    ran = broken("a red circle", image=_control(22), control_guidance_end=0.5, **kw).images
    assert np.isnan(ran).any() and broken.num_compiled == 1


def test_errors_name_the_argument(one, multi, base, tmp_path):
    img = _control(30)
    compiled = one.num_compiled + multi.num_compiled
    with pytest.raises(ValueError, match=r"image: this pipeline has 2 ControlNets; give a list "
                                         r"of 2 control images.*got 3 entries"):
        multi("x", image=[img, img, img])
    with pytest.raises(ValueError, match=r"image: this pipeline has 2 ControlNets.*got one Image"):
        multi("x", image=img)
    with pytest.raises(ValueError, match=r"controlnet_conditioning_scale has 3 values but this "
                                         r"pipeline has 2 ControlNet"):
        multi("x", image=[img, img], controlnet_conditioning_scale=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"controlnet_conditioning_scale=-0.5: must be a number "
                                         r"in \[0, 10\]"):
        one("x", image=img, controlnet_conditioning_scale=-0.5)
    with pytest.raises(ValueError, match=r"controlnet_conditioning_scale=nan: must be a number "
                                         r"in \[0, 10\] \(ControlNet 1\)"):
        multi("x", image=[img, img], controlnet_conditioning_scale=[1.0, float("nan")])
    with pytest.raises(ValueError, match=r"control_guidance_end=1.5: must be a number in "
                                         r"\[0, 1\]"):
        one("x", image=img, control_guidance_end=1.5)
    with pytest.raises(ValueError, match=r"control_guidance_start=0.7: must be below the "
                                         r"window's end \(0.5\)"):
        one("x", image=img, control_guidance_start=0.7, control_guidance_end=0.5)
    with pytest.raises(ValueError, match=r"image has 3 entries but prompt has 2"):
        one(["a", "b"], image=[img, img, img])
    with pytest.raises(ValueError, match=r"item 1: give one ControlImage per ControlNet \(2\)"):
        multi.generate([ImageRequest("a"), ImageRequest("b")],
                       [[ControlImage(img), ControlImage(img)], [ControlImage(img)]])
    # a ControlNet for another model: its conditioning image is 8x the latents, the model's 2x
    other = tmp_path / "cn-f8"
    tiny.make_controlnet(other, tiny.SDXL_UNET)
    with pytest.raises(ValueError, match=r"cn-f8: its conditioning image is 8x the latents.*"
                                         r"this model's images are 2x"):
        ControlNetPipeline.from_pipe(base, controlnet=other)
    with pytest.raises(TypeError, match="controlnet= is required"):
        ControlNetPipeline.from_pipe(base)
    assert one.num_compiled + multi.num_compiled == compiled  # refused before any program


def test_per_image_adapters_equal_the_fused_lora(sdxl_dir, nets, tmp_path):
    """A per-image LoRA adapter (add_adapter on the parent) in a ControlNet batch gives the
    image of the same LoRA fused into the weights; the ControlNet itself is not adapted."""
    lora = tiny.make_sdxl_lora(sdxl_dir, tmp_path / "lora.safetensors", seed=3)
    parent = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    parent.add_adapter("px", lora)
    cn = ControlNetPipeline.from_pipe(parent, controlnet=nets[0][0])
    items = [ImageRequest("a red circle", seed=4, guidance_scale=3.0),
             ImageRequest("a red circle", seed=4, guidance_scale=3.0, adapter="px")]
    controls = [[ControlImage(_control(40), scale=0.8)]] * 2
    kw = dict(num_inference_steps=2, height=SIZE, width=SIZE, output_type="np")
    mixed = cn.generate(items, controls, **kw).images
    assert np.abs(mixed[0] - mixed[1]).max() > 1e-2  # the adapter changes the image
    parent.load_lora_weights(lora)  # fused; the adapter tables stay (one program)
    fused = cn.generate(items[:1] * 2, controls, **kw).images
    np.testing.assert_allclose(mixed[1], fused[0], atol=1e-5)
    assert cn.num_compiled == 1


@pytest.mark.parity
def test_sd15_model_matches_diffusers(tmp_path_factory):
    """An SD 1.x model (one text encoder, no added conditioning) with a BGR ControlNet:
    diffusers' StableDiffusionControlNetPipeline, full window and guess mode with a window,
    within 2e-3 (one program for both)."""
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionPipeline

    root = tmp_path_factory.mktemp("controlnet-sd15")
    tiny.make_sd_pipeline(root / "sd1", seed=3)
    tiny.make_controlnet(root / "cn", tiny.SD15_UNET, seed=5, controlnet_conditioning_channel_order="bgr",
                         **CN)
    ours = ControlNetPipeline.from_pretrained(root / "sd1", controlnet=root / "cn",
                                              compile_cache_dir=None)
    theirs = StableDiffusionControlNetPipeline.from_pipe(
        StableDiffusionPipeline.from_pretrained(root / "sd1"),
        controlnet=ControlNetModel.from_pretrained(root / "cn"))
    theirs.set_progress_bar_config(disable=True)
    lat = _latents(1, seed=8)
    kw = dict(image=_control(50), num_inference_steps=4, guidance_scale=6.0, height=SIZE,
              width=SIZE, output_type="np")
    for case in (dict(controlnet_conditioning_scale=1.0),
                 dict(controlnet_conditioning_scale=0.5, guess_mode=True, control_guidance_end=0.7)):
        mine = ours("a red circle", latents=lat, **kw, **case).images
        with torch.no_grad():
            ref = theirs("a red circle", latents=torch.from_numpy(lat), **kw, **case).images
        assert np.abs(mine - ref).max() <= 2e-3, case
    assert ours.num_compiled == 1


def test_composes_on_the_parent_like_the_edit_pipelines(one, base):
    """The parent's weights and settings, live; its own ControlNets and programs; edit
    pipelines made from it run on the same parent."""
    from pipelines import ImageToImagePipeline

    again = ControlNetPipeline.from_pipe(one)  # the same ControlNets, not loaded again
    assert again.pipe is base and again.controlnets == one.controlnets
    assert all(a is b for a, b in zip(jax.tree.leaves(again.controlnet_params),
                                      jax.tree.leaves(one.controlnet_params)))
    assert again.params is base.params and again.num_compiled == 0
    assert ImageToImagePipeline.from_pipe(one).pipe is base
    again.scheduler = base.scheduler  # its own setting (OWN_SETTINGS) ...
    assert "scheduler" in vars(again) and "scheduler" not in vars(one)
    with pytest.raises(AttributeError, match=r"default_steps is its text-to-image pipeline's"):
        again.default_steps = 3  # ... the rest is the parent's


@pytest.mark.slow  # a fresh 4-device process, two loads and two compiles
def test_data_parallel_equals_single_device(sdxl_dir, nets):
    """4 host devices: the batch (its control images, per-row scales and windows) is sharded
    over the mesh, rows on one device may all be outside their windows while others are not,
    and the images equal one device's."""
    script = textwrap.dedent(f"""
        import json, numpy as np
        from PIL import Image
        from pipelines import ControlImage, ControlNetPipeline, ImageRequest
        rng = np.random.default_rng(0)
        images = [Image.fromarray(rng.integers(0, 256, ({SIZE}, {SIZE}, 3), dtype=np.uint8))
                  for _ in range(3)]
        items = [ImageRequest(p, seed=11 + k, guidance_scale=3.0)
                 for k, p in enumerate(["a red circle", "a blue square", "the dog"])]
        controls = [[ControlImage(images[0], 1.0, 0.0, 0.5)], [ControlImage(images[1], 0.5, 0.5, 1.0)],
                    [ControlImage(images[2], 1.0, 0.0, 1.0, guess_mode=True)]]
        out = {{}}
        for d in (4, 1):
            p = ControlNetPipeline.from_pretrained({str(sdxl_dir)!r}, controlnet={str(nets[0][0])!r},
                                                   devices=d)
            assert p.mesh.size == d
            out[d] = p.generate(items, controls, num_inference_steps=2, output_type="np").images
        print(json.dumps(float(np.abs(out[4] - out[1]).max())))
    """)
    assert tiny.run_on_host_devices(script, 4) <= 5e-6  # as text-to-image's (test_pipeline.py)


def test_runs_on_a_quantized_model(sdxl_dir, one, nets):
    """On an int8-quantized parent (qwix) the UNet runs quantized and the ControlNet in the
    pipeline's dtype: other pixels than float32's, within the int8 threshold of
    tests/test_quantization.py (30 dB PSNR)."""
    pytest.importorskip("qwix")
    int8 = ControlNetPipeline.from_pretrained(sdxl_dir, controlnet=nets[0][0], quantization="int8",
                                              compile_cache_dir=None)
    assert int8.controlnets[0].dtype == one.controlnets[0].dtype == np.float32
    kw = dict(image=_control(60), num_inference_steps=4, guidance_scale=3.0, seed=5,
              output_type="np", height=SIZE, width=SIZE)
    ours, ref = int8("a red circle", **kw).images, one("a red circle", **kw).images
    assert not np.array_equal(ours, ref)
    mse = float(np.mean((ours.astype(np.float64) - ref) ** 2))
    assert 10 * np.log10(1.0 / max(mse, 1e-20)) >= 30.0


def test_the_step_engine_runs_controlnets_like_the_pipeline(multi):
    """A step engine over the ControlNet pipeline (engine=step's ControlNet requests): images
    with their own control images, scales, windows, guess modes, step counts and guidance join
    at different ticks and each equals ControlNetPipeline's image alone; a preview is decoded
    mid-way; an engine refuses images without controls, and a plain engine images with them."""
    from pipelines.step_engine import StepEngine

    eng = StepEngine(multi, SIZE, SIZE, slots=2, output_type="np")
    jobs = [  # (request, steps, per-ControlNet (image seed, scale, start, end, guess))
        (ImageRequest("a red circle", seed=1, guidance_scale=4.0), 3,
         [(40, 1.0, 0.0, 1.0, False), (41, 0.5, 0.3, 1.0, False)]),
        (ImageRequest("a blue square", seed=2, guidance_scale=0.0), 2,
         [(42, 1.5, 0.0, 0.5, False), (43, 0.0, 0.0, 1.0, False)]),
        (ImageRequest("the cat!", seed=3, guidance_scale=5.0), 3,
         [(44, 0.8, 0.0, 1.0, True), (45, 1.0, 0.5, 1.0, True)]),
    ]
    controls = [[ControlImage(_control(s), sc, a, b, gm) for s, sc, a, b, gm in c]
                for _, _, c in jobs]
    handles = [eng.submit(jobs[0][0], jobs[0][1], controls=controls[0], previews=[1])]
    eng.tick()
    handles += [eng.submit(r, n, controls=c) for (r, n, _), c in zip(jobs[1:], controls[1:])]
    eng.run_until_idle()
    assert all(h.status == "done" for h in handles)
    assert handles[0].preview_step == 1 and handles[0].preview.shape == (SIZE, SIZE, 3)
    for (req, steps, _), c, h in zip(jobs, controls, handles):
        alone = multi.generate([req], [c], num_inference_steps=steps, height=SIZE, width=SIZE,
                               output_type="np").images[0]
        np.testing.assert_allclose(h.image, alone, atol=1e-5, err_msg=req.prompt)
    assert np.abs(handles[0].image - handles[2].image).max() > 1e-2
    assert eng.num_compiled == len(eng.runner.programs)
    with pytest.raises(ValueError, match=r"controls is required: this engine runs ControlNets"):
        eng.submit(jobs[0][0], 2)
    with pytest.raises(ValueError, match=r"give one ControlImage per ControlNet \(2\)"):
        eng.submit(jobs[0][0], 2, controls=controls[0][:1])
    with pytest.raises(ValueError, match=r"controls: this engine has no ControlNets"):
        StepEngine(multi.pipe, SIZE, SIZE, slots=2).submit(jobs[0][0], 2, controls=controls[0])


def test_the_controlnet_tasks_slot_rows_are_each_images_own(multi):
    """The ControlNet task's step-engine rows, on the host: control images resized to the
    engine's size, each image's scale table its own steps' (scale x ``control_keep``) padded at
    the front to the engine's ``max_steps`` (row i of a k-step image reads its own step), guess
    mode per ControlNet; without images, one zero row (the warm-up's)."""
    controls = [[ControlImage(_control(1), 0.5, 0.0, 0.5),
                 ControlImage(_control(2), 2.0, guess_mode=True)],
                [ControlImage(_control(3, (16, 24)), 1.5, 0.5, 1.0), ControlImage(_control(4), 0.0)]]
    rows = multi.task.slot_rows(multi, controls, SIZE, SIZE, [2, 4], 6)
    assert [im.shape for im in rows["cimg"]] == [(2, SIZE, SIZE, 3)] * 2
    np.testing.assert_array_equal(rows["cscale"], [[[0, 0, 0, 0, 0.5, 0], [0, 0, 0, 0, 2, 2]],
                                                   [[0, 0, 0, 0, 1.5, 1.5], [0] * 6]])
    np.testing.assert_array_equal(rows["cguess"], [[False, True], [False, False]])
    idle = multi.task.slot_rows(multi, [], SIZE, SIZE, [], 6)
    assert idle["cscale"].shape == (1, 2, 6) and not idle["cscale"].any()
    assert jax.tree.map(np.shape, idle) == jax.tree.map(
        lambda a: (1, *a.shape[1:]), multi.task.slot_state(multi, 3, SIZE, SIZE, 6))
