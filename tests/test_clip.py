"""CLIP text encoders and tokenizers against transformers / diffusers (the PyTorch oracle).

Tiny random checkpoints are written by transformers' own ``save_pretrained`` (tests/tiny.py).
"""

from __future__ import annotations

import json
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tiny
import torch

from maxdiff import checkpoint
from maxdiff.models.clip import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, load_text_encoder
from maxdiff.tokenizers import load_tokenizer, load_tokenizers, tokenize

PROMPTS = [
    "a photo of a red cat",
    "A small WHITE dog on a green background!!",
    "! a ! blue!square !",
    "",
    "a large black triangle on the white background, " * 12,  # far more than 77 tokens
    "astronaut riding a horse, 4k, ¿qué? ü",
]


def _diffusers_ids(tokenizer, prompts):
    """The ids StableDiffusionXLPipeline.encode_prompt feeds a text encoder (same call)."""
    return tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                     truncation=True, return_tensors="pt").input_ids


def _assert_close(ours, ref, what, tol=1e-4):
    ours = np.asarray(jnp.asarray(ours, jnp.float32))
    ref = ref.detach().float().numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} != {ref.shape}"
    err = float(np.abs(ours - ref).max())
    scale = max(1.0, float(np.abs(ref).max()))
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} (output scale {scale:.3g})"
    return err / scale


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """Two tokenizer folders (eos padding, "!" padding) and a cache of tiny text encoders."""
    root = tmp_path_factory.mktemp("clip")
    tiny.write_clip_tokenizer(root / "tok1")
    tiny.write_clip_tokenizer(root / "tok2", pad_token="!")
    return root


@pytest.fixture(scope="module")
def token_ids(clip_dir):
    """PROMPTS through both tokenizers, then two rows without an end-of-text token, on which
    the two pooling rules disagree: (2 * len(PROMPTS) + 2, 77) int32."""
    toks = [load_tokenizer(clip_dir / "tok1"), load_tokenizer(clip_dir / "tok2")]
    eos = toks[0].eos_token_id
    odd = np.random.default_rng(0).integers(0, eos, size=(2, 77)).astype(np.int32)
    odd[:, 3] = 2  # the legacy configs' eos_token_id: must not be taken for end-of-text
    odd[0, 40] = eos - 1  # the largest id in the row, where argmax pooling reads
    ids = np.concatenate([tokenize(t, PROMPTS) for t in toks] + [odd])
    legacy, first_eos = np.argmax(ids, axis=1), np.argmax(ids == eos, axis=1)
    assert (legacy[:-2] == first_eos[:-2]).all() and (legacy[-2:] != first_eos[-2:]).all()
    return ids


_encoders: dict = {}


def _encoder(root, projection, act, legacy):
    key = (str(root), projection, act, legacy)
    if key not in _encoders:
        folder = root / f"te-{int(projection)}-{act}-{int(legacy)}"
        model = tiny.make_text_encoder(folder, projection=projection, hidden_act=act,
                                       legacy_eos=legacy)
        _encoders[key] = folder, model
    return _encoders[key]


def _reference(model, ids, attention_mask=None):
    """transformers' outputs as a dict (pooled read from the inner CLIPTextModel)."""
    ids = torch.tensor(np.asarray(ids), dtype=torch.long)
    mask = None if attention_mask is None else torch.tensor(np.asarray(attention_mask))
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_hidden_states=True)
        text = getattr(model, "text_model", model)  # transformers 5: CLIPTextModel has none
        pooled = text(ids, attention_mask=mask).pooler_output
    ref = dict(hidden_states=out.hidden_states, last_hidden_state=out.last_hidden_state,
               pooler_output=pooled)
    if hasattr(out, "text_embeds"):
        ref["text_embeds"] = out.text_embeds
    return ref


def _compare(ours, ref):
    errs = {}
    assert len(ours.hidden_states) == len(ref["hidden_states"])
    for i, (a, b) in enumerate(zip(ours.hidden_states, ref["hidden_states"])):
        errs[f"hidden_states[{i}]"] = _assert_close(a, b, f"hidden_states[{i}]")
    for name in ("last_hidden_state", "pooler_output", "text_embeds"):
        if name in ref:
            errs[name] = _assert_close(getattr(ours, name), ref[name], name)
        else:
            assert getattr(ours, name) is None
    return errs


# ----------------------------------------------------------------------------- tokenizers


def test_tokenize_matches_diffusers(clip_dir):
    for folder, pad in (("tok1", "<|endoftext|>"), ("tok2", "!")):
        tok = load_tokenizer(clip_dir / folder)
        ids = tokenize(tok, PROMPTS)
        assert ids.dtype == np.int32 and ids.shape == (len(PROMPTS), 77)
        np.testing.assert_array_equal(ids, _diffusers_ids(tok, PROMPTS).numpy())
        assert tok.pad_token == pad
        long = ids[4]  # truncated: starts with bos, ends with eos, no padding
        assert long[0] == tok.bos_token_id and long[-1] == tok.eos_token_id
        assert (long[1:-1] != tok.eos_token_id).all()
        empty = ids[3]
        assert list(empty[:2]) == [tok.bos_token_id, tok.eos_token_id]
        assert (empty[2:] == tok.pad_token_id).all()
    tok2 = load_tokenizer(clip_dir / "tok2")
    assert tok2.pad_token_id == 0 and tok2.convert_ids_to_tokens(0) == "!"
    assert tokenize(tok2, []).shape == (0, 77)
    with pytest.raises(TypeError):
        tokenize(tok2, "a single string")


@pytest.mark.parametrize("keep", [("tokenizer.json", "tokenizer_config.json"),
                                  ("vocab.json", "merges.txt", "tokenizer_config.json")])
def test_tokenizer_file_layouts(clip_dir, tmp_path, keep):
    """tokenizer.json alone (what transformers 5 saves) and vocab.json + merges.txt both load."""
    for folder in ("tok1", "tok2"):
        dst = tmp_path / folder
        dst.mkdir()
        for name in keep:
            shutil.copy(clip_dir / folder / name, dst / name)
        full = load_tokenizer(clip_dir / folder)
        tok = load_tokenizer(dst)
        assert tok.pad_token == full.pad_token and tok.model_max_length == 77
        np.testing.assert_array_equal(tokenize(tok, PROMPTS), tokenize(full, PROMPTS))


def test_tokenizer_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such tokenizer folder"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "empty")


def test_sdxl_tokenizers(sdxl_dir):
    tok, tok2 = load_tokenizers(sdxl_dir)
    assert tok.pad_token == "<|endoftext|>" and tok2.pad_token == "!" and tok2.pad_token_id == 0
    for t in (tok, tok2):
        np.testing.assert_array_equal(tokenize(t, PROMPTS), _diffusers_ids(t, PROMPTS).numpy())


# ----------------------------------------------------------------------------- text encoders


@pytest.mark.parity
@pytest.mark.parametrize("projection", [False, True], ids=["CLIPTextModel", "WithProjection"])
@pytest.mark.parametrize("act", ["quick_gelu", "gelu"])
@pytest.mark.parametrize("legacy", [True, False], ids=["argmax-pool", "eos-pool"])
def test_text_encoder_parity(clip_dir, token_ids, projection, act, legacy):
    folder, model = _encoder(clip_dir, projection, act, legacy)
    module, params = load_text_encoder(folder)
    assert type(module) is (CLIPTextModelWithProjection if projection else CLIPTextModel)
    assert module.config.legacy_pooling is legacy and module.config.hidden_act == act
    # Eager apply: its per-op compilations are shared by every encoder of these shapes,
    # whereas jit would compile each model anew (jit is exercised below).
    ours = module.apply({"params": params}, jnp.asarray(token_ids))
    _compare(ours, _reference(model, token_ids))


@pytest.mark.parity
def test_gelu_new_and_attention_mask_parity(clip_dir, token_ids):
    """The tanh-gelu variant, and an optional key-padding mask on top of the causal one."""
    folder, model = _encoder(clip_dir, True, "gelu_new", False)
    module, params = load_text_encoder(folder)
    _compare(module.apply({"params": params}, jnp.asarray(token_ids)), _reference(model, token_ids))
    eos = model.config.eos_token_id
    first_eos = np.argmax(token_ids == eos, axis=1)
    mask = (np.arange(token_ids.shape[1])[None] <= first_eos[:, None]).astype(np.int32)
    ours = module.apply({"params": params}, jnp.asarray(token_ids), jnp.asarray(mask))
    _compare(ours, _reference(model, token_ids, mask))
    # Jitted, on a shorter sequence, without the hidden states (a static argument).
    fn = jax.jit(module.apply, static_argnames="output_hidden_states")
    short = fn({"params": params}, jnp.asarray(token_ids[:, :20]), output_hidden_states=False)
    _assert_close(short.last_hidden_state, _reference(model, token_ids[:, :20])["last_hidden_state"],
                  "last_hidden_state (20 tokens, jit)")
    assert short.hidden_states is None and short.last_hidden_state.shape == (14, 20, 32)


@pytest.mark.parity
def test_encode_prompt_matches_diffusers(sdxl_dir):
    """The SDXL conditioning diffusers builds: penultimate hidden states of both encoders
    concatenated, and text_encoder_2's projected pooled output (14 prompts: the batch size
    of the other tests, so eager op compilations are reused)."""
    prompts = PROMPTS * 2 + ["a cat", "the dog!"]
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl_dir)
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False)
    toks = load_tokenizers(sdxl_dir)
    states = []
    for tok, name in zip(toks, ("text_encoder", "text_encoder_2")):
        module, params = load_text_encoder(sdxl_dir / name)
        out = module.apply({"params": params}, jnp.asarray(tokenize(tok, prompts)))
        states.append(out.hidden_states[-2])
    _assert_close(jnp.concatenate(states, axis=-1), embeds, "prompt_embeds")
    _assert_close(out.text_embeds, pooled, "pooled_prompt_embeds")


def test_prefixed_checkpoint_layout(clip_dir, tmp_path, token_ids):
    """Hub SDXL / transformers 4 checkpoints key CLIPTextModel as ``text_model.*`` and keep
    the ``position_ids`` buffer; transformers 5 saves it bare. Both load the same."""
    folder, _ = _encoder(clip_dir, False, "quick_gelu", True)
    src = checkpoint.open_weights(folder)
    tensors = {f"text_model.{k}": np.array(src.get(k)) for k in src.keys()}
    tensors["text_model.embeddings.position_ids"] = np.arange(77, dtype=np.int64)[None]
    dst = tmp_path / "prefixed"
    dst.mkdir()
    shutil.copy(folder / "config.json", dst / "config.json")
    checkpoint.save_safetensors(tensors, dst / "model.safetensors")
    _, bare = load_text_encoder(folder)
    _, prefixed = load_text_encoder(dst)
    assert jax.tree.structure(bare) == jax.tree.structure(prefixed)
    for a, b in zip(jax.tree.leaves(bare), jax.tree.leaves(prefixed)):
        np.testing.assert_array_equal(a, b)


def test_bf16_load(clip_dir, token_ids):
    folder, _ = _encoder(clip_dir, True, "gelu", False)
    module, params = load_text_encoder(folder)
    module16, params16 = load_text_encoder(folder, "bfloat16")
    assert {x.dtype for x in jax.tree.leaves(params16)} == {jnp.dtype(ml_dtypes.bfloat16)}
    ref = module.apply({"params": params}, jnp.asarray(token_ids))
    out = module16.apply({"params": params16}, jnp.asarray(token_ids))
    assert out.last_hidden_state.dtype == jnp.bfloat16
    for name in ("last_hidden_state", "pooler_output", "text_embeds"):
        got = np.asarray(getattr(out, name), np.float32)
        assert np.isfinite(got).all(), name
        _assert_close(got, np.asarray(getattr(ref, name)), f"bf16 {name}", tol=5e-2)


def test_hidden_size_mismatch_names_key(clip_dir, tmp_path):
    folder, _ = _encoder(clip_dir, True, "gelu", False)
    dst = tmp_path / "wrong"
    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["hidden_size"] = 48
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(checkpoint.CheckpointError, match="shape") as e:
        load_text_encoder(dst)
    key = re.search(r"key '([^']+)'", str(e.value)).group(1)
    assert key in checkpoint.open_weights(folder).keys()


def test_config_validation():
    base = dict(tiny.clip_text_config(projection=True, legacy_eos=False).to_dict())
    cfg = CLIPTextConfig.from_dict(base)
    assert cfg.hidden_size == 32 and cfg.head_dim == 8 and not cfg.legacy_pooling
    assert CLIPTextConfig.from_dict({}) == CLIPTextConfig()  # transformers' defaults
    for bad, field in [({"hidden_act": "relu"}, "hidden_act"),
                       ({"num_attention_heads": 5}, "hidden_size"),
                       ({"eos_token_id": [2, 3]}, "eos_token_id"),
                       ({"rope_theta": 1e4}, "rope_theta"),
                       ({"model_type": "clip"}, "model_type")]:
        with pytest.raises(ValueError, match=field):
            CLIPTextConfig.from_dict({**base, **bad})
