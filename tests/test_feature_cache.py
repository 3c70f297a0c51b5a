"""Feature caching (``cfg_cutoff``, ``deepcache_interval``) against diffusers on the same weights.

CFG cutoff's reference is diffusers' documented dynamic-CFG callback (guidance set to 0 and the
conditioning cut to its conditional half after a step). DeepCache's is diffusers' own UNet with
a forward pre-hook on the last up block's layer where the shallow branch re-enters: on a full
step it records the deep features arriving there, on the steps between it replaces them with
the recorded ones, so every output pixel comes from the cached features and the skip
connections of this step, which is what the shallow branch computes.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import tiny
import torch

from maxdiff.models.unet import load_unet
from pipelines import ImageToImagePipeline, TextToImagePipeline
from pipelines.limits import guided_steps
from pipelines.requests import ImageRequest

SIZE = 32


@pytest.fixture(scope="module")
def torch_pipe(sdxl_dir):
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(sdxl_dir).to("cpu")


@pytest.fixture(scope="module")
def pipe(sdxl_dir):
    return TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)


def _latents(n, seed=0):
    return np.random.default_rng(seed).standard_normal(
        (n, 4, SIZE // 2, SIZE // 2)).astype(np.float32)


def _cfg_cutoff_callback(cut: int):
    """diffusers' dynamic CFG: guidance off from step ``cut`` on (called after step cut - 1)."""
    def callback(p, step_index, timestep, kw):
        if step_index == cut - 1:
            for name in ("prompt_embeds", "add_text_embeds", "add_time_ids"):
                kw[name] = kw[name].chunk(2)[-1]
            p._guidance_scale = 0.0
        return kw
    return callback


class _DeepCacheHook:
    """DeepCache on diffusers' UNet: a pre-hook on ``up_blocks[-1].resnets[j]`` (the layer
    taking the skip connection of the first down block's layer ``branch``) records the deep
    features on every ``interval``-th UNet call and substitutes them on the others."""

    def __init__(self, unet, interval: int, branch: int = 0):
        block = unet.up_blocks[-1]
        self.j = len(block.resnets) - (branch + 2)
        self.channels = (unet.config.block_out_channels[0] if self.j
                         else unet.config.block_out_channels[1])
        self.interval, self.calls, self.cached = interval, 0, None
        self.handles = [unet.register_forward_pre_hook(self._count),
                        block.resnets[self.j].register_forward_pre_hook(self._swap)]

    def _count(self, module, args):
        self.calls += 1

    def _swap(self, module, args):
        h, temb = args
        c = self.channels
        if (self.calls - 1) % self.interval == 0:
            self.cached = h[:, :c].clone()
            return None
        cached = self.cached
        if cached.shape[0] != h.shape[0]:  # guidance was cut: the conditional half goes on
            cached = cached.chunk(2)[-1]
            self.cached = cached
        return torch.cat([cached, h[:, c:]], dim=1), temb

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _theirs(torch_pipe, *, deepcache: int = 1, cut: int | None = None, **kw):
    from diffusers import EulerDiscreteScheduler

    torch_pipe.scheduler = EulerDiscreteScheduler.from_config(torch_pipe.scheduler.config)
    hook = _DeepCacheHook(torch_pipe.unet, deepcache) if deepcache > 1 else None
    extra = {}
    if cut is not None:
        extra = dict(callback_on_step_end=_cfg_cutoff_callback(cut),
                     callback_on_step_end_tensor_inputs=["prompt_embeds", "add_text_embeds",
                                                         "add_time_ids"])
    kw["latents"] = torch.from_numpy(kw["latents"])
    try:
        with torch.no_grad():
            return torch_pipe(height=SIZE, width=SIZE, output_type="np", **kw, **extra).images
    finally:
        if hook is not None:
            hook.remove()


KW = dict(prompt=["a red circle on a blue background", "the cat!"], negative_prompt=["blurry", ""],
          num_inference_steps=7, guidance_scale=6.0)


@pytest.mark.parity
@pytest.mark.parametrize("cutoff", [0.5, 0.3])
def test_cfg_cutoff_matches_diffusers_dynamic_cfg(pipe, torch_pipe, cutoff):
    lat = _latents(2, seed=4)
    cut = guided_steps(7, cutoff)
    assert 0 < cut < 7
    ours = pipe(**KW, latents=lat, output_type="np", cfg_cutoff=cutoff).images
    theirs = _theirs(torch_pipe, latents=lat, cut=cut, **KW)
    full = pipe(**KW, latents=lat, output_type="np").images
    assert np.abs(ours - theirs).max() <= 2e-3
    assert np.abs(ours - full).max() > 1e-2  # the cutoff changed the images


@pytest.mark.parity
@pytest.mark.parametrize("interval,guidance,cutoff", [(3, 6.0, None), (2, 0.0, None),
                                                      (3, 6.0, 0.5)])
def test_deepcache_matches_diffusers_with_cached_features(pipe, torch_pipe, interval, guidance,
                                                          cutoff):
    lat = _latents(2, seed=5)
    kw = dict(KW, guidance_scale=guidance)
    ours = pipe(**kw, latents=lat, output_type="np", deepcache_interval=interval,
                cfg_cutoff=cutoff).images
    cut = None if cutoff is None else guided_steps(7, cutoff)
    theirs = _theirs(torch_pipe, latents=lat, deepcache=interval, cut=cut, **kw)
    full = pipe(**kw, latents=lat, output_type="np", cfg_cutoff=cutoff).images
    assert np.abs(ours - theirs).max() <= 2e-3
    assert np.abs(ours - full).max() > 1e-3  # the cached steps changed the images


def test_off_settings_run_the_uncached_program(pipe):
    """cfg_cutoff=1 and deepcache_interval=1 give the default's pixels from its very program."""
    kw = dict(KW, num_inference_steps=3)
    lat = _latents(2, seed=6)
    base = pipe(**kw, latents=lat, output_type="np").images
    compiled = pipe.programs.num_compiled
    same = pipe(**kw, latents=lat, output_type="np", cfg_cutoff=1.0, deepcache_interval=1).images
    np.testing.assert_array_equal(base, same)
    assert pipe.programs.num_compiled == compiled


def test_mixed_settings_in_one_batch_equal_each_alone(pipe):
    """Images with different caching settings in one call run as separate device batches:
    each equals its own call."""
    items = [ImageRequest("a red circle", seed=1, guidance_scale=5.0),
             ImageRequest("a blue square", seed=2, guidance_scale=5.0, deepcache_interval=2),
             ImageRequest("the cat", seed=3, guidance_scale=5.0, cfg_cutoff=0.5)]
    out = pipe.generate(items, num_inference_steps=4, height=SIZE, width=SIZE, output_type="np")
    assert out.timings["device_batches"] == 3
    for k, it in enumerate(items):
        alone = pipe.generate([it], num_inference_steps=4, height=SIZE, width=SIZE,
                              output_type="np").images
        np.testing.assert_allclose(out.images[k], alone[0], atol=1e-5)


def test_one_program_serves_every_cutoff_and_interval(pipe):
    """The cutoff and the interval are traced inputs: new values never compile again."""
    kw = dict(KW, num_inference_steps=6)
    lat = _latents(2, seed=7)
    pipe(**kw, latents=lat, output_type="np", cfg_cutoff=0.5, deepcache_interval=2)
    compiled = pipe.programs.num_compiled
    a = pipe(**kw, latents=lat, output_type="np", cfg_cutoff=0.3, deepcache_interval=3).images
    b = pipe(**kw, latents=lat, output_type="np", cfg_cutoff=0.8, deepcache_interval=4).images
    assert pipe.programs.num_compiled == compiled
    assert np.abs(a - b).max() > 1e-3


@pytest.mark.parametrize("kw,match", [
    (dict(cfg_cutoff=0.0), r"cfg_cutoff=0.0: must be a number in \(0, 1\]"),
    (dict(cfg_cutoff=1.5), "cfg_cutoff=1.5"),
    (dict(cfg_cutoff="half"), "cfg_cutoff='half'"),
    (dict(deepcache_interval=0), r"deepcache_interval=0: must be an integer in 1\.\.100"),
    (dict(deepcache_interval=2.5), "deepcache_interval=2.5"),
])
def test_bad_settings_are_named(pipe, kw, match):
    with pytest.raises(ValueError, match=match):
        pipe("x", num_inference_steps=2, **kw)


@pytest.mark.parametrize("config", ["sdxl", "sd15", "sd2"])
def test_unet_shallow_branch_equals_full_at_the_same_inputs(tmp_path, config):
    """The shallow branch on features cached from the same inputs is the full prediction, for
    every branch layer, on SDXL, SD 1.x and SD 2.x block layouts (with ControlNet-style
    residuals on the SDXL one)."""
    cfg = {"sdxl": tiny.SDXL_UNET, "sd15": tiny.SD15_UNET,
           "sd2": dict(tiny.SD15_UNET, block_out_channels=(16, 32, 32), layers_per_block=1,
                       down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                         "DownBlock2D"),
                       up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                       attention_head_dim=(2, 4, 4), use_linear_projection=True)}[config]
    tiny.make_unet(tmp_path, cfg, seed=2)
    model, params = load_unet(tmp_path)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 12, 4)).astype(np.float32)
    t = np.array([900.0, 20.0], np.float32)
    ctx_dim = cfg["cross_attention_dim"]
    kw = dict(encoder_hidden_states=rng.standard_normal((2, 7, ctx_dim)).astype(np.float32))
    if config == "sdxl":
        kw.update(text_embeds=rng.standard_normal((2, 32)).astype(np.float32),
                  time_ids=np.full((2, 6), 256.0, np.float32))
        kw["down_block_additional_residuals"] = tuple(
            rng.standard_normal(s).astype(np.float32) * 0.1 for s in _skip_shapes(cfg, 2, 8, 12))
        kw["mid_block_additional_residual"] = rng.standard_normal((2, 4, 6, 64)).astype(
            np.float32) * 0.1
    apply = jax.jit(model.apply, static_argnames=("return_deep_cache", "cache_branch"))
    full = np.asarray(apply({"params": params}, x, t, **kw))
    layers = cfg["layers_per_block"]
    for branch in range(layers):
        out, feats = apply({"params": params}, x, t, **kw, return_deep_cache=True,
                           cache_branch=branch)
        np.testing.assert_array_equal(np.asarray(out), full)
        shallow, _ = apply({"params": params}, x, t, **kw, deep_cache=feats,
                           return_deep_cache=True, cache_branch=branch)
        np.testing.assert_allclose(np.asarray(shallow), full, atol=1e-5)
    with pytest.raises(ValueError, match=f"cache_branch={layers}: .* 0..{layers - 1}"):
        model.apply({"params": params}, x, t, **kw, return_deep_cache=True, cache_branch=layers)


def _skip_shapes(cfg: dict, batch: int, h: int, w: int) -> list[tuple]:
    """The UNet's skip-connection shapes, NHWC (one ControlNet residual each)."""
    chans, layers = cfg["block_out_channels"], cfg["layers_per_block"]
    shapes = [(batch, h, w, chans[0])]
    for i, c in enumerate(chans):
        shapes += [(batch, h, w, c)] * layers
        if i < len(chans) - 1:
            h, w = (h + 1) // 2, (w + 1) // 2
            shapes.append((batch, h, w, c))
    return shapes


def test_image_to_image_with_caching_runs_and_differs(sdxl_dir):
    """The edit task (traced start step) takes both settings: runs, stays close to, and
    differs from, the uncached edit."""
    edit = ImageToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    image = np.random.default_rng(0).random((SIZE, SIZE, 3)).astype(np.float32)
    kw = dict(image=image, strength=0.8, num_inference_steps=8, guidance_scale=5.0, seed=3,
              output_type="np")
    base = edit("a red circle", **kw).images
    cached = edit("a red circle", **kw, deepcache_interval=2, cfg_cutoff=0.5).images
    assert 1e-4 < np.abs(base - cached).max() < 0.5


def test_base_and_refiner_in_one_program_equal_two_calls_with_caching(pipe, refiner_dir):
    """Caching applies to each stage's own steps: the base + refiner program with both settings
    gives the pixels of the base stopped at the cut and the refiner started there, each called
    with the same settings, and differs from the uncached run."""
    refiner = ImageToImagePipeline.from_pretrained(refiner_dir, compile_cache_dir=None)
    noise = _latents(2, seed=8)
    kw = dict(prompt=["a photo of a cat", "green square"], num_inference_steps=8,
              guidance_scale=5.0, cfg_cutoff=0.6, deepcache_interval=2)
    lat = pipe(**kw, latents=noise, denoising_end=0.75, output_type="latent").images
    two = refiner(**kw, image=lat, denoising_start=0.75, output_type="np").images
    pipe.set_refiner(refiner)
    try:
        one = pipe(**kw, latents=noise, denoising_end=0.75, output_type="np").images
        plain = pipe(**{**kw, "cfg_cutoff": None, "deepcache_interval": 1}, latents=noise,
                     denoising_end=0.75, output_type="np").images
    finally:
        pipe.set_refiner(None)
    assert np.abs(one - two).max() <= 1e-5
    assert np.abs(one - plain).max() > 1e-3
