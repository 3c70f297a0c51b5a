"""CLIP's vision encoder (maxdiff.models.clip_vision) against transformers'
CLIPVisionModelWithProjection / CLIPVisionModel on the same random weights, and the image
preprocessing against CLIPImageProcessor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from maxdiff.models.clip_vision import load_image_encoder, preprocess

CONFIG = dict(hidden_size=32, intermediate_size=64, projection_dim=16, num_hidden_layers=3,
              num_attention_heads=4, image_size=32, patch_size=8, hidden_act="gelu")


@pytest.fixture(scope="module", params=["CLIPVisionModelWithProjection", "CLIPVisionModel"])
def encoder_dir(request, tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, request.param)(transformers.CLIPVisionConfig(**CONFIG)).eval()
    with torch.no_grad():  # bigger than init's 0.02 so every block changes the result
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return folder, model


@pytest.mark.parity
def test_outputs_equal_transformers(encoder_dir):
    import jax.numpy as jnp

    folder, model = encoder_dir
    module, params = load_image_encoder(folder)
    pixels = np.random.default_rng(1).standard_normal((2, 32, 32, 3)).astype(np.float32)
    ours = module.apply({"params": params}, jnp.asarray(pixels))
    with torch.no_grad():
        ref = model(torch.from_numpy(pixels.transpose(0, 3, 1, 2)), output_hidden_states=True)
    pairs = [(ours.last_hidden_state, ref.last_hidden_state),
             (ours.hidden_states[-2], ref.hidden_states[-2])]
    if hasattr(ref, "image_embeds"):
        pairs.append((ours.image_embeds, ref.image_embeds))
    else:
        pairs.append((ours.pooler_output, ref.pooler_output))
    for a, b in pairs:
        assert np.asarray(a).shape == tuple(b.shape)
        assert np.abs(np.asarray(a) - b.numpy()).max() < 1e-5


def test_preprocess_equals_clip_image_processor():
    from transformers import CLIPImageProcessor

    proc = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    rng = np.random.default_rng(2)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((40, 57), (64, 33))]
    ref = proc(images=images, return_tensors="np").pixel_values.transpose(0, 2, 3, 1)
    ours = preprocess(images, size=32)
    assert ours.shape == ref.shape == (2, 32, 32, 3)
    assert np.abs(ours - ref).max() < 1e-5


def test_bad_inputs(encoder_dir, tmp_path):
    import json

    import jax.numpy as jnp

    folder, _ = encoder_dir
    module, params = load_image_encoder(folder)
    with pytest.raises(ValueError, match=r"pixels must be \(batch, 32, 32, 3\)"):
        module.apply({"params": params}, jnp.zeros((1, 3, 32, 32)))
    cfg = json.loads((folder / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "clip_text_model"}))
    with pytest.raises(ValueError, match="is not a CLIP vision encoder"):
        load_image_encoder(bad)
