"""Model families (maxdiff.family): which family a folder is, what each one's text encoding
and time ids are, and that its description agrees with the configs maxdiff ships."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import tiny

from maxdiff import single_file
from maxdiff.checkpoint import CheckpointError
from maxdiff.family import FAMILIES, Cond, folder_family
from maxdiff.models.clip import load_text_encoder
from pipelines.requests import ImageRequest


@pytest.fixture(scope="module")
def sd_dirs(tmp_path_factory):
    out = {}
    for name, v2 in (("sd1", False), ("sd2", True)):
        out[name] = tmp_path_factory.mktemp(f"tiny-{name}")
        tiny.make_sd_pipeline(out[name], v2=v2)
    return out


def test_folder_family(sdxl_dir, refiner_dir, sd_dirs, tmp_path):
    assert folder_family(sdxl_dir) is FAMILIES["sdxl-base"]
    refiner = folder_family(refiner_dir)
    assert (refiner.name, refiner.encoders, refiner.n_time_ids) == (
        "sdxl-refiner", ("text_encoder_2",), 5)
    assert [folder_family(sd_dirs[n]).name for n in ("sd1", "sd2")] == ["sd1", "sd2"]
    index = json.loads((sdxl_dir / "model_index.json").read_text())
    # the base saved as an image-to-image folder is the base; the time ids follow the flag
    as_img2img = folder_family(sdxl_dir, dict(index, _class_name="StableDiffusionXLImg2ImgPipeline"))
    assert (as_img2img.name, as_img2img.n_time_ids) == ("sdxl-base", 6)
    assert folder_family(sdxl_dir, dict(index, requires_aesthetics_score=True)).n_time_ids == 5
    with pytest.raises(CheckpointError, match="names a FluxPipeline; maxdiff loads"):
        folder_family(tmp_path, {"_class_name": "FluxPipeline"})


def test_families_agree_with_the_shipped_configs():
    """Each single-file family's components and tokenizers are what its shipped config folder
    holds, and its pipeline class is the one that folder names."""
    for family in FAMILIES.values():
        if not family.single_file:
            continue
        root = single_file.shipped_config(family.name)
        index = json.loads((root / "model_index.json").read_text())
        assert index["_class_name"] == family.pipeline
        present = {c for c, v in index.items() if isinstance(v, list) and v[0] is not None}
        assert present >= set(family.components)
        assert folder_family(root).name == family.name


def test_encode_is_each_familys_text_conditioning(sdxl_dir, refiner_dir, sd_dirs):
    """SDXL: both encoders' penultimate states side by side and encoder 2's pooled
    projection; the refiner: encoder 2's alone; SD: the last state, no pooled."""
    ids = np.arange(2 * 3 * 77, dtype=np.int32).reshape(2, 3, 77) % 50
    cases = [(sdxl_dir, FAMILIES["sdxl-base"]), (refiner_dir, folder_family(refiner_dir)),
             (sd_dirs["sd1"], FAMILIES["sd1"]), (sd_dirs["sd2"], FAMILIES["sd2"])]
    for folder, family in cases:
        loaded = {name: load_text_encoder(folder / name) for name in family.encoders}
        modules = {name: m for name, (m, _) in loaded.items()}
        params = {name: p for name, (_, p) in loaded.items()}
        cond = family.encode(modules, params, jnp.asarray(ids))
        context, pooled = cond.context, cond.pooled
        assert cond.time_ids is None and cond.image_tokens is None
        outs = [modules[n].apply({"params": params[n]}, jnp.asarray(ids[k if len(loaded) > 1
                                                                      else int(n[-1] == "2")]))
                for k, n in enumerate(family.encoders)]
        if family.pooled:
            want = np.concatenate([o.hidden_states[-2] for o in outs], axis=-1)
            np.testing.assert_array_equal(pooled, outs[-1].text_embeds)
        else:
            want = outs[0].last_hidden_state
            assert pooled.shape == (3, 0)
        np.testing.assert_array_equal(context, want)


def test_time_ids_per_family():
    item = ImageRequest(prompt="p", original_size=(640, 512), crops_coords_top_left=(8, 4),
                        aesthetic_score=7.0, negative_aesthetic_score=2.0)
    assert FAMILIES["sdxl-base"].time_ids(item, 256, 128) == (
        [640, 512, 8, 4, 256, 128], [640, 512, 8, 4, 256, 128])
    assert FAMILIES["sdxl-refiner"].time_ids(item, 256, 128) == (
        [640, 512, 8, 4, 7.0], [640, 512, 0, 0, 2.0])
    assert FAMILIES["sd1"].time_ids(item, 256, 128) == ([], [])
    cond = Cond(np.zeros((2, 3)), np.ones((2, 1)), np.zeros((2, 0)))
    assert cond.rows(lambda a: a[:1]).pooled.shape == (1, 1)
