"""The tiny autoencoder's decoder (maxdiff.models.taesd) against diffusers' AutoencoderTiny on
the same random weights, saved as madebyollin/taesdxl lays its folder out; previews on a
pipeline (pipelines.previews) and a step engine drawn with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from maxdiff.models.taesd import load_tiny_decoder

CONFIG = dict(encoder_block_out_channels=(8, 8, 8), decoder_block_out_channels=(8, 8, 8),
              num_encoder_blocks=(1, 2, 1), num_decoder_blocks=(2, 1, 1), latent_channels=4)


def _tiny_autoencoder(folder, **config):
    from diffusers import AutoencoderTiny

    torch.manual_seed(0)
    model = AutoencoderTiny(**config).eval()
    with torch.no_grad():  # every weight nonzero and order-one, so each layer shows
        for p in model.parameters():
            p.copy_(torch.randn_like(p) / max(p[0].numel(), 1) ** 0.5)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def taesd_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("taesd")
    return folder, _tiny_autoencoder(folder, **CONFIG)


@pytest.mark.parity
def test_decoder_equals_diffusers(taesd_dir):
    import jax.numpy as jnp

    folder, model = taesd_dir
    module, params = load_tiny_decoder(folder)
    assert module.config.scale_factor == 4
    z = np.random.default_rng(0).standard_normal((2, 6, 5, 4)).astype(np.float32) * 2
    ours = np.asarray(module.apply({"params": params}, jnp.asarray(z)))
    with torch.no_grad():
        ref = model.decode(torch.from_numpy(z.transpose(0, 3, 1, 2))).sample.numpy()
    assert ours.shape == (2, 24, 20, 3)
    assert np.abs(ours - ref.transpose(0, 2, 3, 1)).max() < 1e-4


def test_bad_configs(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    with pytest.raises(ValueError, match="not an AutoencoderTiny"):
        load_tiny_decoder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "AutoencoderTiny",
                                                      "upsample_fn": "bilinear"}))
    with pytest.raises(ValueError, match="nearest 2x"):
        load_tiny_decoder(tmp_path)


def test_previews_on_a_pipeline_and_a_step_engine(sdxl_dir, tmp_path):
    """pipe.preview(latents) is diffusers' AutoencoderTiny decode of them; a step engine's
    preview after its last (Euler, sigma 0) step is the preview of the final latents; a tiny
    decoder of another scale factor is refused."""
    from pipelines import TextToImagePipeline
    from pipelines.requests import ImageRequest
    from pipelines.step_engine import StepEngine

    f2 = dict(encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
              num_encoder_blocks=(1, 1), num_decoder_blocks=(2, 1), latent_channels=4)
    model = _tiny_autoencoder(tmp_path / "taesd-f2", **f2)
    _tiny_autoencoder(tmp_path / "taesd-f4", **CONFIG)
    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    with pytest.raises(ValueError, match="at 4x; this model's VAE has 4 channels at 2x"):
        pipe.load_preview_decoder(tmp_path / "taesd-f4")
    with pytest.raises(ValueError, match="no preview decoder"):
        pipe.preview(np.zeros((1, 4, 8, 8), np.float32))
    pipe.load_preview_decoder(tmp_path / "taesd-f2")
    latents = pipe("a red circle", seed=3, num_inference_steps=2, guidance_scale=0.0,
                   height=32, width=32, output_type="latent").images
    ours = pipe.preview(latents, "np")
    with torch.no_grad():
        ref = model.decode(torch.from_numpy(np.asarray(latents))).sample.numpy()
    ref = np.clip(ref.transpose(0, 2, 3, 1) / 2 + 0.5, 0, 1)
    assert ours.shape == (1, 32, 32, 3) and np.abs(ours - ref).max() < 1e-4
    eng = StepEngine(pipe, 32, 32, slots=1, output_type="np")
    h = eng.submit(ImageRequest("a red circle", seed=3, guidance_scale=0.0), 2, previews=[1, 2])
    eng.run_until_idle()
    assert h.preview_step == 2 and np.abs(h.preview - ours[0]).max() < 1e-4


@pytest.mark.parity
def test_autoencoder_encodes_and_decodes_as_diffusers(taesd_dir):
    """The whole tiny autoencoder (the VAE methods a pipeline calls): its encoder's latents
    times scaling_factor, and its decode of latents / scaling_factor, are diffusers'."""
    import jax.numpy as jnp

    from maxdiff.loaders import load_vae

    folder, model = taesd_dir
    module, params = load_vae(folder)
    assert module.config.vae_scale_factor == 4 and not module.config.tileable
    x = np.random.default_rng(1).uniform(-1, 1, (2, 24, 20, 3)).astype(np.float32)
    z = np.asarray(module.apply({"params": params}, jnp.asarray(x), None, None,
                                method=module.image_to_latents))
    image = np.asarray(module.apply({"params": params}, jnp.asarray(z),
                                    method=module.latents_to_image))
    with torch.no_grad():
        ref_z = model.encode(torch.from_numpy(x.transpose(0, 3, 1, 2))).latents
        ref_image = model.decode(ref_z).sample.numpy().transpose(0, 2, 3, 1)
    assert z.shape == (2, 6, 5, 4) and np.abs(z - ref_z.numpy().transpose(0, 2, 3, 1)).max() < 1e-4
    assert np.abs(image - ref_image).max() < 1e-4


@pytest.mark.parity
def test_tiny_autoencoder_as_a_pipelines_vae(sdxl_dir, tmp_path):
    """vae= a diffusers AutoencoderTiny folder: text-to-image and image-to-image decode (and
    encode) with it, as diffusers' SDXL pipelines given vae=AutoencoderTiny do; images differ
    from the model's own VAE's; the tiny autoencoder never tiles."""
    from diffusers import AutoencoderTiny, StableDiffusionXLImg2ImgPipeline, StableDiffusionXLPipeline

    from pipelines import ImageToImagePipeline, TextToImagePipeline

    folder = tmp_path / "taesd-f2"
    _tiny_autoencoder(folder, encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                      num_encoder_blocks=(1, 1), num_decoder_blocks=(2, 1), latent_channels=4)
    theirs_vae = AutoencoderTiny.from_pretrained(folder)
    lat = np.random.default_rng(2).standard_normal((1, 4, 16, 16)).astype(np.float32)
    kw = dict(prompt="a red circle", num_inference_steps=3, guidance_scale=4.0, height=32,
              width=32)
    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, vae=folder, compile_cache_dir=None,
                                               vae_tiling=True)
    assert not pipe.uses_vae_tiling(4096, 4096)
    ours = pipe(**kw, latents=lat, output_type="np").images
    own = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)(
        **kw, latents=lat, output_type="np").images
    t2i = StableDiffusionXLPipeline.from_pretrained(sdxl_dir, vae=theirs_vae)
    with torch.no_grad():
        theirs = t2i(**kw, latents=torch.from_numpy(lat), output_type="np").images
    assert ours.shape == theirs.shape == (1, 32, 32, 3)
    assert np.abs(ours - theirs).max() <= 2e-3
    assert np.abs(ours - own).max() > 5e-2

    image = theirs[0]
    noise = torch.randn((1, 4, 16, 16), generator=torch.Generator().manual_seed(5)).numpy()
    edit = ImageToImagePipeline.from_pretrained(sdxl_dir, vae=folder, compile_cache_dir=None)
    ours = edit(**kw, image=image, strength=0.6, noise=noise, output_type="np").images
    i2i = StableDiffusionXLImg2ImgPipeline.from_pretrained(sdxl_dir, vae=theirs_vae)
    with torch.no_grad():
        theirs = i2i(**kw, image=image, strength=0.6, generator=torch.Generator().manual_seed(5),
                     output_type="np").images
    assert np.abs(ours - theirs).max() <= 2e-3


@pytest.mark.parity
def test_a_decoder_file_in_the_original_layout(taesd_dir, tmp_path):
    """taesdxl_decoder.safetensors as madebyollin/taesd ships it (one nn.Sequential, a clamp
    at index 0): its shape read off its keys, its decode diffusers'; an encoder file, a
    pickle and a VAE are refused naming the file."""
    from safetensors.numpy import save_file

    from maxdiff.checkpoint import CheckpointError

    folder, model = taesd_dir
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    original = {f"{int(k.split('.')[2]) + 1}.{k.split('.', 3)[3]}": v for k, v in sd.items()
                if k.startswith("decoder.layers.")}
    save_file(original, tmp_path / "taesdxl_decoder.safetensors")
    module, params = load_tiny_decoder(tmp_path / "taesdxl_decoder.safetensors")
    assert (module.config.num_decoder_blocks, module.config.decoder_block_out_channels) == (
        CONFIG["num_decoder_blocks"], CONFIG["decoder_block_out_channels"])
    z = np.random.default_rng(3).standard_normal((1, 5, 6, 4)).astype(np.float32)
    ours = np.asarray(module.apply({"params": params}, z))
    with torch.no_grad():
        ref = model.decode(torch.from_numpy(z.transpose(0, 3, 1, 2))).sample.numpy()
    assert np.abs(ours - ref.transpose(0, 2, 3, 1)).max() < 1e-4
    save_file({k.removeprefix("encoder.layers."): v for k, v in sd.items()
               if k.startswith("encoder.layers.")}, tmp_path / "taesdxl_encoder.safetensors")
    with pytest.raises(ValueError, match="taesdxl_encoder.safetensors: not a TAESD decoder"):
        load_tiny_decoder(tmp_path / "taesdxl_encoder.safetensors")
    (tmp_path / "taesd_decoder.pth").write_bytes(b"\x80")
    with pytest.raises(CheckpointError, match="pickle"):
        load_tiny_decoder(tmp_path / "taesd_decoder.pth")
