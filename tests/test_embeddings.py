"""Textual-inversion embeddings (maxdiff.embeddings, pipelines.embeddings): files in the layouts
people download, loaded as diffusers' ``load_textual_inversion`` loads them, images equal to
diffusers' on the same random weights (SDXL with both encoders, SD 1.x with a multi-vector
embedding), and the errors."""

from __future__ import annotations

import numpy as np
import pytest
import tiny
import torch
from safetensors.numpy import save_file

from pipelines import TextToImagePipeline

SIZE = 32
KW = dict(num_inference_steps=3, guidance_scale=5.0, height=SIZE, width=SIZE, output_type="np")


def _latents(seed):
    return np.random.default_rng(seed).standard_normal((1, 4, SIZE // 2, SIZE // 2)).astype(
        np.float32)


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-sd1-emb")
    tiny.make_sd_pipeline(folder)
    return folder


@pytest.mark.parity
def test_sdxl_embedding_equals_diffusers(sdxl_dir, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    rng = np.random.default_rng(0)
    table = {"clip_l": rng.standard_normal((2, 32)).astype(np.float32),
             "clip_g": rng.standard_normal((2, 32)).astype(np.float32)}
    path = tmp_path / "shiny-style.safetensors"
    save_file(table, path)
    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    assert pipe.load_textual_inversion(path) == "shiny-style"  # the file's name
    assert pipe.embedding_tokens == {"shiny-style": ["shiny-style", "shiny-style_1"]}
    ref = StableDiffusionXLPipeline.from_pretrained(sdxl_dir)
    for key, te, tok in (("clip_l", ref.text_encoder, ref.tokenizer),
                         ("clip_g", ref.text_encoder_2, ref.tokenizer_2)):
        ref.load_textual_inversion(torch.from_numpy(table[key]), token="shiny-style",
                                   text_encoder=te, tokenizer=tok)
    prompt = "a red cat, shiny-style"
    ours = pipe(prompt, negative_prompt="blurry", latents=_latents(1), prompt_syntax="none",
                **KW).images
    with torch.no_grad():
        theirs = ref(prompt, negative_prompt="blurry", latents=torch.from_numpy(_latents(1)),
                     **KW).images
    assert np.abs(ours - theirs).max() <= 2e-3
    plain = pipe("a red cat, ", negative_prompt="blurry", latents=_latents(1), **KW).images
    assert np.abs(ours - plain).max() > 1e-3  # the embedding is used
    # weighted, in the default syntax, it still reads as its vectors
    pipe("a red cat, (shiny-style:1.2)", latents=_latents(1), **KW)
    with pytest.raises(ValueError, match="token 'shiny-style' is already in text_encoder's "
                                         "tokenizer"):
        pipe.load_textual_inversion(path)


@pytest.mark.parity
def test_sd1_multi_vector_embedding_equals_diffusers(sd_dir, tmp_path):
    from diffusers import StableDiffusionPipeline

    vectors = np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)
    save_file({"emb_params": vectors}, tmp_path / "a1111.safetensors")
    pipe = TextToImagePipeline.from_pretrained(sd_dir, compile_cache_dir=None)
    assert pipe.load_textual_inversion(tmp_path / "a1111.safetensors", token="<toy>") == "<toy>"
    ref = StableDiffusionPipeline.from_pretrained(sd_dir, safety_checker=None)
    ref.load_textual_inversion(torch.from_numpy(vectors), token="<toy>")
    prompt = "a <toy> on a mat"
    ours = pipe(prompt, latents=_latents(2), **KW).images
    with torch.no_grad():
        theirs = ref(prompt, latents=torch.from_numpy(_latents(2)), **KW).images
    assert np.abs(ours - theirs).max() <= 2e-3


def test_embedding_errors(sd_dir, tmp_path):
    pipe = TextToImagePipeline.from_pretrained(sd_dir, compile_cache_dir=None)
    save_file({"emb_params": np.zeros((1, 48), np.float32)}, tmp_path / "wide.safetensors")
    with pytest.raises(ValueError, match=r"embedding 'wide' has width 48; it fits none of this "
                                         r"model's text encoders \(text_encoder: 32\)"):
        pipe.load_textual_inversion(tmp_path / "wide.safetensors")
    (tmp_path / "old.pt").write_bytes(b"\x80\x04")
    with pytest.raises(Exception, match=r"old.pt: a torch pickle; maxdiff reads embeddings as "
                                        "safetensors"):
        pipe.load_textual_inversion(tmp_path / "old.pt")
    save_file({"a": np.zeros((1, 32), np.float32), "b": np.zeros((1, 32), np.float32)},
              tmp_path / "two.safetensors")
    with pytest.raises(ValueError, match="holds 2 tensors"):
        pipe.load_textual_inversion(tmp_path / "two.safetensors")
    with pytest.raises(ValueError, match="token '<\\|startoftext\\|>' is already in "
                                         "text_encoder's tokenizer"):
        pipe.load_textual_inversion({"<|startoftext|>": np.zeros(32, np.float32)})


def test_run_configs_and_the_cli_load_embeddings(sd_dir, tmp_path):
    """The run-config key ``embeddings`` ("PATH[:TOKEN]", as --embedding writes it) loads each
    embedding with the pipeline; the CLI's flag sets that key and checks the path."""
    from pipelines.cli.common import _run_config
    from pipelines.cli.lines import InputError
    from pipelines.cli.parser import build_parser
    from pipelines.config import load_run_config

    save_file({"emb_params": np.ones((2, 32), np.float32)}, tmp_path / "toy.safetensors")
    emb = f"{tmp_path / 'toy.safetensors'}:<t>"
    cfg = load_run_config(None, [f"model={sd_dir}", f"embeddings={emb}"])
    pipe = TextToImagePipeline.from_config(cfg)
    assert pipe.embedding_tokens == {"<t>": ["<t>", "<t>_1"]}
    args = build_parser().parse_args(["generate", "x", "--model", str(sd_dir), "--embedding",
                                      str(tmp_path / "toy.safetensors")])
    assert [str(e) for e in _run_config(args).embeddings] == [
        str((tmp_path / "toy.safetensors").resolve())]
    args = build_parser().parse_args(["generate", "x", "--model", str(sd_dir), "--embedding",
                                      str(tmp_path / "none.safetensors")])
    with pytest.raises(InputError, match="embedding .*none.safetensors: no such file"):
        _run_config(args)
