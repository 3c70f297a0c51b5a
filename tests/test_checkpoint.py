"""The safetensors reader and the name/layout mapping: every failure names the file and key."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import tiny

from maxdiff.checkpoint import CheckpointError, SafetensorsFile, load_params, open_weights, save_safetensors
from maxdiff.models.unet import load_unet


@pytest.fixture(scope="module")
def unet_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("unet")
    tiny.make_unet(path, tiny.SD15_UNET)
    return path


def _copy_with(src, dst, edit):
    """Copy a UNet folder, rewriting its weights with ``edit(dict) -> dict``."""
    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    f = SafetensorsFile(src / "diffusion_pytorch_model.safetensors")
    tensors = edit({k: np.array(f.get(k)) for k in f.keys()})
    save_safetensors(tensors, dst / "diffusion_pytorch_model.safetensors")
    return dst


def test_reader_matches_safetensors_library(unet_dir):
    from safetensors.numpy import load_file

    path = unet_dir / "diffusion_pytorch_model.safetensors"
    ref = load_file(str(path))
    ours = SafetensorsFile(path)
    assert sorted(ours.keys()) == sorted(ref)
    for k in ref:
        np.testing.assert_array_equal(ours.get(k), ref[k])


def test_roundtrip_bf16_and_fp16(tmp_path):
    from safetensors.numpy import load_file

    t = {"a": np.arange(6, dtype=np.float16).reshape(2, 3),
         "b": np.linspace(-1, 1, 5).astype(ml_dtypes.bfloat16)}
    save_safetensors(t, tmp_path / "x.safetensors")
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.get("b").dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(f.get("a"), t["a"])
    np.testing.assert_array_equal(load_file(str(tmp_path / "x.safetensors"))["a"], t["a"])


def test_missing_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny.SD15_UNET))
    with pytest.raises(CheckpointError, match="no safetensors weights found"):
        load_unet(tmp_path)
    with pytest.raises(CheckpointError, match="missing config file"):
        load_unet(tmp_path / "nope")


def test_missing_key(unet_dir, tmp_path):
    bad = _copy_with(unet_dir, tmp_path / "u",
                     lambda t: {k: v for k, v in t.items() if k != "conv_out.bias"})
    with pytest.raises(CheckpointError, match=r"missing key 'conv_out.bias'"):
        load_unet(bad)


def test_unexpected_key(unet_dir, tmp_path):
    bad = _copy_with(unet_dir, tmp_path / "u", lambda t: {**t, "extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match=r"unexpected key 'extra.weight'"):
        load_unet(bad)


def test_wrong_shape(unet_dir, tmp_path):
    def edit(t):
        t["conv_in.weight"] = np.zeros((32, 4, 1, 1), np.float32)
        return t

    bad = _copy_with(unet_dir, tmp_path / "u", edit)
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model.safetensors: key 'conv_in.weight' "
                                              r"has shape \(32, 4, 1, 1\), expected \(32, 4, 3, 3\)"):
        load_unet(bad)


def test_truncated_file(unet_dir, tmp_path):
    bad = _copy_with(unet_dir, tmp_path / "u", lambda t: t)
    w = bad / "diffusion_pytorch_model.safetensors"
    w.write_bytes(w.read_bytes()[:-1000])
    with pytest.raises(CheckpointError,
                       match=r"diffusion_pytorch_model.safetensors: truncated file: tensor '.*'"):
        load_unet(bad)
    w.write_bytes(b"\xff" * 4)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load_unet(bad)
    w.write_bytes((10).to_bytes(8, "little") + b"{not json}")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load_unet(bad)


def test_sharded_and_fp16_variant(unet_dir, tmp_path):
    """A sharded fp16 variant (``*.fp16.safetensors.index.json``) loads to the same values."""
    f = SafetensorsFile(unet_dir / "diffusion_pytorch_model.safetensors")
    keys = sorted(f.keys())
    out = tmp_path / "u"
    out.mkdir()
    (out / "config.json").write_text((unet_dir / "config.json").read_text())
    half = len(keys) // 2
    weight_map = {}
    for i, part in enumerate((keys[:half], keys[half:])):
        name = f"diffusion_pytorch_model-0000{i + 1}-of-00002.fp16.safetensors"
        save_safetensors({k: np.array(f.get(k)).astype(np.float16) for k in part}, out / name)
        weight_map.update({k: name for k in part})
    (out / "diffusion_pytorch_model.safetensors.index.fp16.json").write_text("{}")  # decoy
    (out / "diffusion_pytorch_model.fp16.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    src = open_weights(out)
    assert len(src.files) == 2
    _, p16 = load_unet(out)
    _, p32 = load_unet(unet_dir)
    for a, b in zip(jax.tree_util.tree_leaves(p16), jax.tree_util.tree_leaves(p32)):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(np.float16).astype(np.float32))
    # a shard listed in the index but absent is named
    (out / "diffusion_pytorch_model-00002-of-00002.fp16.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard file.*00002-of-00002"):
        load_unet(out)


@pytest.mark.parametrize("shard, index", [
    ("diffusion_pytorch_model.fp16-0000{}-of-00002.safetensors",  # diffusers' and
     "diffusion_pytorch_model.safetensors.index.fp16.json"),      # transformers' names
    ("diffusion_pytorch_model-0000{}-of-00002.fp16.safetensors",  # their earlier ones
     "diffusion_pytorch_model.safetensors.fp16.index.json")])
def test_sharded_variant_names_and_the_plain_fallback(unet_dir, tmp_path, shard, index):
    """A variant's shard index under the names diffusers and transformers write loads with
    variant="fp16" and, as the only weights, without one; variant="fp16" on a folder without
    that variant reads the plain weights (as diffusers' pipelines load such a component)."""
    f = SafetensorsFile(unet_dir / "diffusion_pytorch_model.safetensors")
    keys = sorted(f.keys())
    out = tmp_path / "u"
    out.mkdir()
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        save_safetensors({k: np.asarray(f.get(k)) for k in part}, out / shard.format(i + 1))
        weight_map.update(dict.fromkeys(part, shard.format(i + 1)))
    (out / index).write_text(json.dumps({"weight_map": weight_map}))
    for variant in ("fp16", None):
        src = open_weights(out, variant)
        assert len(src.files) == 2 and sorted(src.keys()) == keys
    assert [Path(p).name for p in open_weights(unet_dir, "fp16").files] == [
        "diffusion_pytorch_model.safetensors"]


def test_load_params_casts_each_tensor(unet_dir):
    src = open_weights(unet_dir)
    shapes = {"conv_in": {"kernel": jax.ShapeDtypeStruct((3, 3, 4, 32), np.float32),
                          "bias": jax.ShapeDtypeStruct((32,), np.float32)}}
    p = load_params(shapes, src, "bfloat16", ignore_unexpected=tuple(k for k in src.keys()
                                                                      if not k.startswith("conv_in.")))
    assert p["conv_in"]["kernel"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(
        np.asarray(p["conv_in"]["kernel"]),
        np.transpose(src.get("conv_in.weight"), (2, 3, 1, 0)).astype(ml_dtypes.bfloat16))


def test_peak_memory_while_loading(tmp_path):
    """Loading reads, casts and places one tensor at a time: the process's peak memory grows by
    less than 1.5x the weights' size (here ~150 MB of float32)."""
    import subprocess
    import sys
    import textwrap

    from maxdiff.checkpoint import save_safetensors

    rng = np.random.default_rng(0)
    tensors = {f"layers.{i}.weight": rng.standard_normal((1024, 1024), dtype=np.float32) for i in range(36)}
    nbytes = sum(t.nbytes for t in tensors.values())
    save_safetensors(tensors, tmp_path / "model.safetensors")
    del tensors
    script = textwrap.dedent(f"""
        import jax, numpy as np
        from maxdiff.checkpoint import load_params, open_weights
        def rss(field):
            for line in open("/proc/self/status"):
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        shapes = {{"layers.%d" % i: {{"kernel": jax.ShapeDtypeStruct((1024, 1024), np.float32)}}
                  for i in range(36)}}
        jax.device_put(np.zeros(4)).block_until_ready()
        before = rss("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current RSS
        params = load_params(shapes, open_weights({str(tmp_path)!r}), "float32")
        jax.block_until_ready(params)
        print(rss("VmHWM") - before)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    grew = int(res.stdout.split()[-1])
    print(f"peak growth {grew / nbytes:.2f}x the weights")
    assert grew < 1.5 * nbytes, (grew / nbytes)


def test_pickle_weights_are_refused_with_a_way_to_convert(unet_dir, tmp_path):
    """maxdiff never unpickles: a .bin/.ckpt/.pt file is refused, naming it and saying how to
    convert it (torch is not needed to say so)."""
    folder = tmp_path / "unet"
    folder.mkdir()
    (folder / "config.json").write_text((unet_dir / "config.json").read_text())
    (folder / "diffusion_pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model.bin: only pickle-based "
                                              r"weights here .*never unpickles.*save_pretrained"):
        load_unet(folder)
    for name in ("lightning.ckpt", "model.pt", "model.pth"):
        single = tmp_path / name
        single.write_bytes(b"\x80\x04")
        with pytest.raises(CheckpointError, match=rf"{name}: a pickle-based weight file.*"
                                                  r"safetensors"):
            open_weights(single)


def test_links_out_of_the_model_folder_are_refused(tmp_path):
    from maxdiff.checkpoint import check_links
    from pipelines import TextToImagePipeline

    model = tmp_path / "model"
    tiny.make_sdxl_pipeline(model)
    check_links(model)  # no links: fine
    inside = model / "unet" / "alias.json"
    inside.symlink_to(model / "unet" / "config.json")
    check_links(model)  # a link within the folder: fine
    secret = tmp_path / "secret.txt"
    secret.write_text("not a model file")
    (model / "vae" / "extra.json").symlink_to(secret)
    with pytest.raises(CheckpointError, match=r"vae/extra.json: a symbolic link to .*secret.txt, "
                                              r"outside the model folder"):
        TextToImagePipeline.from_pretrained(model, compile_cache_dir=None)
    # a Hugging Face cache snapshot links into its repository's blobs/: allowed
    repo = tmp_path / "hub" / "models--org--name"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "blobs" / "f00d").write_text("{}")
    (snap / "model_index.json").symlink_to(repo / "blobs" / "f00d")
    check_links(snap)
    (snap / "escape.json").symlink_to(secret)
    with pytest.raises(CheckpointError, match="escape.json"):
        check_links(snap)
