"""IP-Adapter (maxdiff.ip_adapter, pipelines.ip_adapting) against diffusers on the same random
weights: the projections, one UNet call with the decoupled cross-attention, and whole
pipelines with an image prompt."""

from __future__ import annotations

import numpy as np
import pytest
import tiny
import torch

from maxdiff import ip_adapter as ipa
from maxdiff.checkpoint import CheckpointError
from pipelines import ImageRequest, TextToImagePipeline

SIZE = 32
KW = dict(num_inference_steps=3, guidance_scale=5.0, height=SIZE, width=SIZE, output_type="np")


def _latents(seed, n=1):
    return np.random.default_rng(seed).standard_normal((n, 4, SIZE // 2, SIZE // 2)).astype(
        np.float32)


def _picture(seed=3, size=(57, 40)):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3),
                                                                 dtype=np.uint8))


@pytest.fixture(scope="module")
def torch_unet(sdxl_dir):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(sdxl_dir / "unet").eval()


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return tiny.make_image_encoder(tmp_path_factory.mktemp("image_encoder"))


@pytest.fixture(scope="module", params=["basic", "plus"])
def adapter_file(request, torch_unet, tmp_path_factory):
    """(kind, file) in h94/IP-Adapter's layout: the image encoder in image_encoder/ beside."""
    folder = tmp_path_factory.mktemp(f"ip-{request.param}")
    tiny.make_image_encoder(folder / "image_encoder")
    return request.param, tiny.make_ip_adapter(
        torch_unet, folder / f"ip-adapter-{request.param}.safetensors", request.param)


@pytest.fixture(scope="module", params=["basic", "plus", "full"])
def any_adapter(request, torch_unet, tmp_path_factory):
    return request.param, tiny.make_ip_adapter(
        torch_unet, tmp_path_factory.mktemp(f"ip-any-{request.param}") / "ip.safetensors",
        request.param)


def _grouped(path):
    from safetensors.torch import load_file

    sd = load_file(str(path))
    return {g: {k[len(g) + 1:]: v for k, v in sd.items() if k.startswith(g + ".")}
            for g in ("image_proj", "ip_adapter")}


def test_cross_attention_order_is_diffusers(torch_unet, sdxl_dir):
    from maxdiff.models.unet import load_unet

    _, params = load_unet(sdxl_dir / "unet")
    ours = [".".join(p) for p in ipa.cross_attention_paths(params)]
    theirs = [n[: -len(".processor")] for n in torch_unet.attn_processors
              if n.endswith("attn2.processor")]
    assert ours == theirs and any(n.startswith("mid_block") for n in ours)


@pytest.mark.parity
def test_one_unet_call_equals_diffusers(any_adapter, torch_unet, sdxl_dir, encoder_dir):
    """Projection + every cross-attention with image tokens at two per-image scales (0.6, and
    0 for the second image: exactly the UNet without the adapter)."""
    import copy

    import jax.numpy as jnp

    from maxdiff.models.clip_vision import load_image_encoder
    from maxdiff.models.unet import load_unet

    kind, path = any_adapter
    module, params = load_unet(sdxl_dir / "unet")
    enc = load_image_encoder(encoder_dir)
    w = ipa.load_ip_adapter(path, params, module.config.cross_attention_dim, enc)
    assert w.kind == kind and w.tokens == {"full": 17}.get(kind, 4)  # 17: 4x4 patches + class
    rng = np.random.default_rng(0)
    b = 2
    x = rng.standard_normal((b, 8, 8, 4)).astype(np.float32)
    ctx = rng.standard_normal((b, 7, 64)).astype(np.float32)
    pooled = rng.standard_normal((b, 32)).astype(np.float32)
    tids = np.tile(np.array([[64, 64, 0, 0, 64, 64]], np.float32), (b, 1))
    px = rng.standard_normal((b, 32, 32, 3)).astype(np.float32)
    out = enc[0].apply({"params": enc[1]}, jnp.asarray(px))
    embeds = np.array(out.image_embeds if kind == "basic" else out.hidden_states[-2])
    tokens = w.projection.apply({"params": w.params["image_proj"]}, jnp.asarray(embeds))
    scale = np.array([0.6, 0.0], np.float32)
    ours = module.apply({"params": ipa.with_layers(params, w.params["layers"])}, x, 500.0, ctx,
                        pooled, tids, image_context=ipa.ImageContext(ctx, tokens, scale))
    plain = module.apply({"params": params}, x, 500.0, ctx, pooled, tids)

    ref_unet = copy.deepcopy(torch_unet)
    ref_unet._load_ip_adapter_weights([_grouped(path)])
    with torch.no_grad():
        ref_tokens = ref_unet.encoder_hid_proj([torch.from_numpy(embeds)[:, None]])[0]
    ref_tokens = ref_tokens.reshape(b, -1, ref_tokens.shape[-1])  # (B, images, T, D) there
    assert np.abs(np.asarray(tokens) - ref_tokens.numpy()).max() < 1e-5
    refs = []
    for s in scale:
        for p in ref_unet.attn_processors.values():
            if hasattr(p, "scale"):
                p.scale = [float(s)]
        with torch.no_grad():
            refs.append(ref_unet(
                torch.from_numpy(x.transpose(0, 3, 1, 2)), 500.0, torch.from_numpy(ctx),
                added_cond_kwargs={"text_embeds": torch.from_numpy(pooled),
                                   "time_ids": torch.from_numpy(tids),
                                   "image_embeds": [torch.from_numpy(embeds)[:, None]]},
            ).sample.numpy().transpose(0, 2, 3, 1))
    ours, plain = np.asarray(ours), np.asarray(plain)
    assert np.abs(ours[0] - refs[0][0]).max() < 1e-4
    np.testing.assert_array_equal(ours[1], plain[1])  # scale 0: the adapter adds nothing
    assert np.abs(ours[0] - plain[0]).max() > 1e-2  # ... and scale 0.6 something


def test_files_that_do_not_fit_are_refused(torch_unet, sdxl_dir, encoder_dir, tmp_path):
    from maxdiff.models.clip_vision import load_image_encoder
    from maxdiff.models.unet import load_unet

    module, params = load_unet(sdxl_dir / "unet")
    enc = load_image_encoder(encoder_dir)
    path = tiny.make_ip_adapter(torch_unet, tmp_path / "a.safetensors")
    wide = load_image_encoder(tiny.make_image_encoder(tmp_path / "wide", projection_dim=40))
    with pytest.raises(CheckpointError, match="gives 40"):
        ipa.load_ip_adapter(path, params, 64, wide)
    sd = _grouped(path)
    del sd["ip_adapter"]["3.to_k_ip.weight"], sd["ip_adapter"]["3.to_v_ip.weight"]
    with pytest.raises(CheckpointError, match="cross-attention layers"):
        ipa.load_ip_adapter({g: {k: v.numpy() for k, v in d.items()} for g, d in sd.items()},
                            params, 64, enc)
    pickle = tmp_path / "ip-adapter_sdxl.bin"
    pickle.write_bytes(b"\x80\x02")
    with pytest.raises(CheckpointError, match="torch pickle"):
        ipa.read_ip_adapter(pickle)
    face = {"image_proj.norm.weight": np.ones(4), "image_proj.proj.0.weight": np.ones((4, 4)),
            "ip_adapter.1.to_k_ip.weight": np.ones((4, 4))}
    with pytest.raises(CheckpointError, match="FaceID"):
        ipa.load_ip_adapter(face, params, 64, enc)


@pytest.mark.parity
def test_sdxl_pipeline_with_an_image_prompt_equals_diffusers(adapter_file, sdxl_dir):
    """The whole text-to-image pipeline with CFG, an image prompt at scale 0.7 (the image
    encoder found beside the file, as h94/IP-Adapter lays it out), against diffusers'
    StableDiffusionXLPipeline.load_ip_adapter on the same files."""
    from diffusers import StableDiffusionXLPipeline

    kind, path = adapter_file
    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    pipe.load_ip_adapter(path, scale=0.7)
    ref = StableDiffusionXLPipeline.from_pretrained(sdxl_dir)
    ref.load_ip_adapter(str(path.parent), subfolder="", weight_name=path.name)
    ref.set_ip_adapter_scale(0.7)
    ours = pipe("a red circle", negative_prompt="blurry", ip_adapter_image=_picture(),
                latents=_latents(1), **KW).images
    with torch.no_grad():
        theirs = ref("a red circle", negative_prompt="blurry", ip_adapter_image=_picture(),
                     latents=torch.from_numpy(_latents(1)), **KW).images
    assert np.abs(ours - theirs).max() <= 2e-3
    plain = pipe("a red circle", negative_prompt="blurry", latents=_latents(1), **KW).images
    assert np.abs(ours - plain).max() > 1e-2  # the image prompt is used


def test_images_with_and_without_image_prompts_share_a_batch(basic_adapter, sdxl_dir):
    """A batch mixing an image prompt (at its own scale) and none: the second image is the
    one a batch without image prompts makes; a scale of 0 makes the image without it; the
    per-call scale overrides the pipeline's."""
    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    pipe.load_ip_adapter(basic_adapter)
    kw = dict(num_inference_steps=2, height=SIZE, width=SIZE, output_type="np")
    cat = dict(prompt="a cat", seed=1, guidance_scale=5.0)
    dog = ImageRequest("a dog", seed=2, guidance_scale=5.0)
    plain = pipe.generate([ImageRequest(**cat), dog], **kw).images
    mixed = pipe.generate([ImageRequest(**cat, ip_adapter_image=_picture(),
                                        ip_adapter_scale=0.5), dog], **kw).images
    assert np.abs(mixed[1] - plain[1]).max() < 1e-5
    assert np.abs(mixed[0] - plain[0]).max() > 1e-2
    zero = pipe.generate([ImageRequest(**cat, ip_adapter_image=_picture(),
                                       ip_adapter_scale=0.0), dog], **kw).images
    assert np.abs(zero - plain).max() < 1e-5
    pipe.set_ip_adapter_scale(0.5)
    default = pipe.generate([ImageRequest(**cat, ip_adapter_image=_picture()), dog],
                            **kw).images
    assert np.abs(default - mixed).max() < 1e-5
    with pytest.raises(ValueError, match=r"ip_adapter_scale=9: must be a number in \[-1, 5\]"):
        pipe("a cat", ip_adapter_image=_picture(), ip_adapter_scale=9, **kw)
    pipe.unload_ip_adapter()
    with pytest.raises(ValueError, match="ip_adapter_image: this pipeline has no IP-Adapter"):
        pipe("a cat", ip_adapter_image=_picture(), **kw)


@pytest.fixture(scope="module")
def basic_adapter(torch_unet, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ip-cli")
    tiny.make_image_encoder(folder / "image_encoder")
    return tiny.make_ip_adapter(torch_unet, folder / "ip-adapter_sdxl.safetensors", seed=4)


def test_cli_lines_with_image_prompts(basic_adapter, sdxl_dir, tmp_path, capsys):
    """``maxdiff generate --ip-adapter FILE`` with JSONL lines that carry ``ip_adapter_image``
    (relative to the file) and ``ip_adapter_scale``: the images are the Python API's, the
    metadata names the image prompt, and an image prompt without an adapter stops the run
    before loading (exit 2, naming the line)."""
    import json

    from PIL import Image

    from pipelines import cli

    _picture().save(tmp_path / "style.png")
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"prompt": "a cat", "seed": 3, "ip_adapter_image": "style.png",
                                "ip_adapter_scale": 0.5}) + "\n"
                    + json.dumps({"prompt": "a dog", "seed": 4}) + "\n")
    out = tmp_path / "out"
    common = ["--model", str(sdxl_dir), "--steps", "2", "--size", "32x32", "--guidance", "5",
              "--quiet", "--set", "compile_cache_dir="]
    assert cli.main(["generate", "--prompts", str(jobs), "--ip-adapter", str(basic_adapter),
                     *common, "--out", str(out)]) == 0
    recs = [json.loads(x) for x in (out / "metadata.jsonl").read_text().splitlines()]
    assert recs[0]["ip_adapter_image"] == str((tmp_path / "style.png").resolve())
    assert recs[0]["ip_adapter_scale"] == 0.5 and "ip_adapter_image" not in recs[1]
    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    pipe.load_ip_adapter(basic_adapter)
    want = pipe.generate([ImageRequest("a cat", seed=3, guidance_scale=5.0,
                                       ip_adapter_image=_picture(), ip_adapter_scale=0.5),
                          ImageRequest("a dog", seed=4, guidance_scale=5.0)],
                         num_inference_steps=2, height=SIZE, width=SIZE, output_type="np").images
    for rec, img in zip(recs, want):
        got = np.asarray(Image.open(out / rec["file"]), np.float32) / 255
        assert np.abs(got - img).max() <= 1.5 / 255
    capsys.readouterr()
    assert cli.main(["generate", "a cat", "--ip-adapter-image", str(tmp_path / "style.png"),
                     *common, "--out", str(tmp_path / "none")]) == 2
    assert "prompt argument 1: an image prompt" in capsys.readouterr().err


@pytest.mark.parity
def test_sd15_pipeline_with_an_image_prompt_equals_diffusers(tmp_path_factory, basic_adapter):
    """SD 1.5 (one text encoder, no pooled embedding) with a plain adapter, against diffusers'
    StableDiffusionPipeline; an SDXL adapter on it is refused as one for another model."""
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    folder = tmp_path_factory.mktemp("tiny-sd15-ip")
    tiny.make_sd_pipeline(folder / "model")
    tiny.make_image_encoder(folder / "ip" / "image_encoder")
    path = tiny.make_ip_adapter(UNet2DConditionModel.from_pretrained(folder / "model" / "unet"),
                                folder / "ip" / "ip-adapter_sd15.safetensors", seed=2)
    pipe = TextToImagePipeline.from_pretrained(folder / "model", compile_cache_dir=None)
    with pytest.raises(CheckpointError, match="the adapter is for another model"):
        pipe.load_ip_adapter(basic_adapter)
    pipe.load_ip_adapter(path, scale=0.8)
    ref = StableDiffusionPipeline.from_pretrained(folder / "model", safety_checker=None)
    ref.load_ip_adapter(str(path.parent), subfolder="", weight_name=path.name)
    ref.set_ip_adapter_scale(0.8)
    ours = pipe("a red circle", ip_adapter_image=_picture(5), latents=_latents(2), **KW).images
    with torch.no_grad():
        theirs = ref("a red circle", ip_adapter_image=_picture(5),
                     latents=torch.from_numpy(_latents(2)), **KW).images
    assert np.abs(ours - theirs).max() <= 2e-3


def test_the_step_engine_runs_image_prompts(basic_adapter, sdxl_dir):
    """A step engine made after load_ip_adapter: images with and without image prompts (and
    with CFG) joining at different ticks equal the batch pipeline's; an engine made without
    an adapter refuses them."""
    from pipelines.step_engine import StepEngine

    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    plain_engine = StepEngine(pipe, SIZE, SIZE, slots=2, output_type="np")
    with pytest.raises(ValueError, match="ip_adapter_image: this engine has no IP-Adapter"):
        plain_engine.submit(ImageRequest("a cat", ip_adapter_image=_picture()), 2)
    pipe.load_ip_adapter(basic_adapter, scale=0.7)
    eng = StepEngine(pipe, SIZE, SIZE, slots=2, output_type="np")
    reqs = [ImageRequest("a cat", seed=1, guidance_scale=4.0, ip_adapter_image=_picture()),
            ImageRequest("a dog", seed=2, guidance_scale=4.0),
            ImageRequest("a fox", seed=3, guidance_scale=4.0, ip_adapter_image=_picture(6),
                         ip_adapter_scale=0.3)]
    handles = [eng.submit(reqs[0], 3)]
    eng.tick()
    handles += [eng.submit(r, 3) for r in reqs[1:]]
    eng.run_until_idle()
    for h, r in zip(handles, reqs):
        want = pipe.generate([r], num_inference_steps=3, height=SIZE, width=SIZE,
                             output_type="np").images[0]
        np.testing.assert_allclose(h.image, want, atol=1e-5, err_msg=r.prompt)
