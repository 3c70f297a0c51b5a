"""Hugging Face model names (``org/name``) through the local Hugging Face cache
(:mod:`maxdiff.hub`), offline: a cache laid out as ``huggingface_hub`` writes it
(``models--org--name/{blobs,refs,snapshots}``, snapshot files linked to blobs) around the tiny
SDXL checkpoint, with ``HF_HUB_CACHE`` pointing at it and ``HF_HUB_OFFLINE=1``; the one online
branch (a name not cached is downloaded) runs against a faked Hub. Nothing here touches the
network."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
import tiny

from maxdiff import hub
from maxdiff.checkpoint import CheckpointError, open_weights
from maxdiff.tokenizers import tokenize
from pipelines import TextToImagePipeline, cli
from pipelines.config import load_run_config

NAME = "tiny-org/tiny-sdxl"
MAIN = hashlib.sha1(b"main").hexdigest()  # the commits' 40-hex hashes
OTHER = hashlib.sha1(b"other").hexdigest()
UNET_KERNEL = ("unet", "conv_in", "kernel")
UNET_FILE = "unet/diffusion_pytorch_model.safetensors"
UNET_FP16 = "unet/diffusion_pytorch_model.fp16.safetensors"


def _snapshot(repo: Path, commit: str, files: dict[str, Path]) -> Path:
    """``files`` (path in the repository -> a file) as the snapshot ``commit`` of ``repo``:
    each file a blob, linked from the snapshot as huggingface_hub links them (relative)."""
    snap = repo / "snapshots" / commit
    for rel, src in files.items():
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snap


def _unet(folder: Path, sdxl_dir: Path, seed: int) -> Path:
    """Another tiny UNet of the checkpoint's config (other weights); its weight file."""
    config = json.loads((sdxl_dir / "unet" / "config.json").read_text())
    tiny.make_unet(folder, {k: v for k, v in config.items() if not k.startswith("_")}, seed=seed)
    return folder / "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def cache(sdxl_dir, tmp_path_factory) -> Path:
    """A Hugging Face cache holding NAME: ``main`` (commit MAIN) is the tiny checkpoint plus an
    fp16 variant of its UNet with other weights; ``refs/other`` (commit OTHER) the same model
    with a third UNet."""
    root = tmp_path_factory.mktemp("hf-cache")
    repo = root / f"models--{NAME.replace('/', '--')}"
    files = {p.relative_to(sdxl_dir).as_posix(): p for p in sorted(sdxl_dir.rglob("*"))
             if p.is_file() and "_tok" not in p.parts}
    work = tmp_path_factory.mktemp("unets")
    _snapshot(repo, MAIN, {**files, UNET_FP16: _unet(work / "fp16", sdxl_dir, seed=7)})
    _snapshot(repo, OTHER, {**files, UNET_FILE: _unet(work / "other", sdxl_dir, seed=8)})
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)  # as huggingface_hub writes it: no newline
    (repo / "refs" / "other").write_text(OTHER)
    return root


@pytest.fixture
def offline(cache, monkeypatch) -> Path:
    """HF_HUB_CACHE at the test cache and HF_HUB_OFFLINE=1; the cache's model folder."""
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache / f"models--{NAME.replace('/', '--')}"


def _kernel(pipe) -> np.ndarray:
    tree = pipe.params
    for k in UNET_KERNEL:
        tree = tree[k]
    return np.asarray(jax.device_get(tree))


def _file_kernel(path: Path) -> np.ndarray:
    """conv_in's kernel as Flax holds it, from a diffusers file (out, in, kh, kw)."""
    return open_weights(path).get("conv_in.weight").transpose(2, 3, 1, 0)


def _load(path, **kw):
    return TextToImagePipeline.from_pretrained(path, compile_cache_dir=None, **kw)


def test_a_name_loads_the_cached_snapshot_as_its_folder_does(offline, sdxl_dir):
    """from_pretrained("org/name") and a run config's model: NAME read the snapshot of
    refs/main: the same weights, tokens, scheduler and defaults as the checkpoint's own folder
    (the pixels then follow; generating twice would cost two compilations)."""
    by_name = _load(NAME)
    by_folder = _load(sdxl_dir)
    assert by_name.name == NAME
    a, b = (jax.tree_util.tree_leaves(p.params) for p in (by_name, by_folder))
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    prompts = ["a red circle", "a lighthouse at dusk!"]
    for tok in ("tokenizer", "tokenizer_2"):
        np.testing.assert_array_equal(tokenize(getattr(by_name, tok), prompts),
                                      tokenize(getattr(by_folder, tok), prompts))
    assert dict(by_name.scheduler.config) == dict(by_folder.scheduler.config)
    for attr in ("default_steps", "default_guidance", "default_height", "default_width",
                 "force_zeros_for_empty_prompt", "family"):
        assert getattr(by_name, attr) == getattr(by_folder, attr), attr
    from_config = TextToImagePipeline.from_config(load_run_config(
        {"model": NAME, "compile_cache_dir": ""}))
    np.testing.assert_array_equal(_kernel(from_config), _kernel(by_folder))


def test_revision_picks_a_branch_or_a_commit(offline):
    snap = offline / "snapshots"
    want = _file_kernel(snap / OTHER / UNET_FILE)
    for revision in ("other", OTHER):
        np.testing.assert_array_equal(_kernel(_load(NAME, revision=revision)), want)
    assert hub.resolve(NAME) == snap / MAIN
    assert hub.resolve(NAME, revision="main") == snap / MAIN
    assert hub.resolve(NAME, revision=OTHER) == snap / OTHER


def test_variant_reads_the_fp16_files_and_plain_ones_otherwise(offline):
    """variant="fp16" reads unet/*.fp16.safetensors (other weights here) and, where a component
    has no fp16 file, its plain weights, as diffusers' pipelines do; no variant reads the
    plain files although an fp16 one is beside them."""
    main = offline / "snapshots" / MAIN
    fp16 = _load(NAME, variant="fp16")
    plain = _load(NAME)
    np.testing.assert_array_equal(_kernel(fp16), _file_kernel(main / UNET_FP16))
    np.testing.assert_array_equal(_kernel(plain), _file_kernel(main / UNET_FILE))
    assert not np.array_equal(_kernel(fp16), _kernel(plain))
    vae = [np.asarray(jax.device_get(p.params["vae"]["decoder"]["conv_in"]["kernel"]))
           for p in (fp16, plain)]
    np.testing.assert_array_equal(*vae)  # no fp16 VAE in the snapshot: the plain one
    assert [Path(f).name for f in open_weights(main / "unet", "fp16").files] == [
        "diffusion_pytorch_model.fp16.safetensors"]
    assert [Path(f).name for f in open_weights(main / "vae", "fp16").files] == [
        "diffusion_pytorch_model.safetensors"]


def test_a_name_not_cached_says_where_it_looked_and_how_to_download(offline, cache):
    with pytest.raises(hub.NotCachedError) as e:
        _load("tiny-org/absent")
    msg = str(e.value)
    assert str(cache / "models--tiny-org--absent") in msg
    assert "hf download tiny-org/absent" in msg and "huggingface-cli download" in msg
    assert "HF_HUB_OFFLINE" in msg
    with pytest.raises(hub.NotCachedError, match="--revision nope"):
        hub.resolve(NAME, revision="nope")
    # neither a path nor a name: the loader's own error, as before
    with pytest.raises(CheckpointError, match="not a diffusers pipeline folder"):
        _load("no-such-folder")


def test_a_local_path_wins_over_a_name(offline, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / NAME).mkdir(parents=True)
    assert hub.resolve(NAME) == Path(NAME)
    assert hub.resolve(Path("tiny-org/elsewhere")) == Path("tiny-org/elsewhere")  # a Path


def test_what_reads_as_a_name():
    for name in (NAME, "stabilityai/stable-diffusion-xl-base-1.0", "a/b", "org_1/x.y-z"):
        assert hub.is_repo_id(name), name
    for name in ("/models/sdxl", "./a/b", "~/a/b", "sdxl", "a/b/c", "a--b/c", "a/b..c",
                 "org/model.safetensors", "out/run.yaml", "a/b.git", "-a/b", "a/b.", "", "a/"):
        assert not hub.is_repo_id(name), name


def test_only_the_files_maxdiff_reads_are_downloaded():
    """needed_files on a listing like stabilityai/stable-diffusion-xl-base-1.0's: the
    components' configs, tokenizers and one set of safetensors weights each (the fp16 variant
    where asked and present), never .bin / ONNX / Flax files, the top-level single files or
    folders model_index.json does not list."""
    files = [
        "model_index.json", "README.md", "sd_xl_base_1.0.safetensors", "sd_xl_offset.safetensors",
        "scheduler/scheduler_config.json",
        "text_encoder/config.json", "text_encoder/model.safetensors",
        "text_encoder/model.fp16.safetensors", "text_encoder/pytorch_model.bin",
        "text_encoder/flax_model.msgpack", "text_encoder/model.onnx",
        "text_encoder_2/config.json", "text_encoder_2/model.safetensors.index.json",
        "text_encoder_2/model-00001-of-00002.safetensors",
        "text_encoder_2/model-00002-of-00002.safetensors",
        "text_encoder_2/model.safetensors.index.fp16.json",
        "text_encoder_2/model.fp16-00001-of-00002.safetensors",
        "text_encoder_2/model.fp16-00002-of-00002.safetensors",
        "tokenizer/merges.txt", "tokenizer/special_tokens_map.json",
        "tokenizer/tokenizer_config.json", "tokenizer/vocab.json",
        "tokenizer_2/merges.txt", "tokenizer_2/vocab.json",
        "unet/config.json", "unet/diffusion_pytorch_model.safetensors",
        "unet/diffusion_pytorch_model.fp16.safetensors", "unet/diffusion_pytorch_model.bin",
        "vae/config.json", "vae/diffusion_pytorch_model.safetensors",
        "vae_1_0/config.json", "vae_1_0/diffusion_pytorch_model.safetensors",
        "vae_decoder/model.onnx", "vae_decoder/config.json",
    ]
    components = ["scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2",
                  "unet", "vae"]
    common = ["model_index.json", "scheduler/scheduler_config.json", "text_encoder/config.json",
              "text_encoder_2/config.json", "tokenizer/merges.txt",
              "tokenizer/special_tokens_map.json", "tokenizer/tokenizer_config.json",
              "tokenizer/vocab.json", "tokenizer_2/merges.txt", "tokenizer_2/vocab.json",
              "unet/config.json", "vae/config.json"]
    fp16 = hub.needed_files(files, "fp16", components=components)
    assert sorted(fp16) == sorted(common + [
        "text_encoder/model.fp16.safetensors", "text_encoder_2/model.safetensors.index.fp16.json",
        "text_encoder_2/model.fp16-00001-of-00002.safetensors",
        "text_encoder_2/model.fp16-00002-of-00002.safetensors",
        "unet/diffusion_pytorch_model.fp16.safetensors",
        "vae/diffusion_pytorch_model.safetensors"])  # no fp16 VAE: the plain one
    plain = hub.needed_files(files, components=components)
    assert sorted(plain) == sorted(common + [
        "text_encoder/model.safetensors", "text_encoder_2/model.safetensors.index.json",
        "text_encoder_2/model-00001-of-00002.safetensors",
        "text_encoder_2/model-00002-of-00002.safetensors",
        "unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors"])
    assert hub.needed_files(files, components=components, weights=False) == common
    # a component repository (a VAE, a ControlNet): its files at the root
    vae = ["config.json", "diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin",
           "sdxl_vae.safetensors", "README.md"]
    assert hub.needed_files(vae) == ["config.json", "diffusion_pytorch_model.safetensors"]


def test_a_name_not_cached_is_downloaded_when_online(cache, sdxl_dir, monkeypatch, tmp_path):
    """Online, a name not in the cache is fetched with snapshot_download(allow_patterns=...) of
    only the files maxdiff reads (the Hub faked here: nothing touches the network), and a
    failed download says how to download by hand."""
    import huggingface_hub
    from huggingface_hub.utils import LocalEntryNotFoundError

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    listing = [p.relative_to(sdxl_dir).as_posix() for p in sdxl_dir.rglob("*")
               if p.is_file() and "_tok" not in p.parts] + ["unet/diffusion_pytorch_model.bin"]
    calls = []

    class Api:
        def list_repo_files(self, repo_id, revision=None):
            calls.append(("list", repo_id, revision))
            return listing

    def hf_hub_download(repo_id, filename, revision=None, cache_dir=None):
        return str(sdxl_dir / filename)

    def snapshot_download(repo_id, revision=None, cache_dir=None, local_files_only=False,
                          allow_patterns=None):
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        calls.append(("download", repo_id, revision, Path(cache_dir), sorted(allow_patterns)))
        return str(sdxl_dir)

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert hub.resolve("tiny-org/remote", revision="v1") == sdxl_dir
    (_, _, rev), (_, name, rev2, where, patterns) = calls
    assert rev == rev2 == "v1" and name == "tiny-org/remote" and where == tmp_path / "empty-cache"
    assert "unet/diffusion_pytorch_model.safetensors" in patterns
    assert "model_index.json" in patterns and "tokenizer_2/tokenizer.json" in patterns
    assert not any(p.endswith(".bin") for p in patterns)

    def no_network(self, repo_id, revision=None):
        raise OSError("no route to host")

    monkeypatch.setattr(Api, "list_repo_files", no_network)
    with pytest.raises(hub.NotCachedError, match="downloading it failed .*no route to host"
                       ".*hf download tiny-org/remote"):
        hub.resolve("tiny-org/remote")


def test_convert_takes_a_name(offline, sdxl_dir, tmp_path, capsys):
    """`maxdiff convert NAME DST` reads the cached snapshot; a name not cached exits 2."""
    dst = tmp_path / "bf16"
    assert cli.main(["convert", NAME, str(dst), "--dtype", "bf16"]) == 0
    assert (dst / "model_index.json").is_file()
    got = open_weights(dst / "unet").get("conv_in.weight")
    want = open_weights(sdxl_dir / "unet").get("conv_in.weight")
    assert str(got.dtype) == "bfloat16"
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  want.astype(got.dtype).astype(np.float32))
    assert not any(p.is_symlink() for p in dst.rglob("*"))  # the files, not the cache's links
    assert cli.main(["convert", "tiny-org/absent", str(tmp_path / "x")]) == 2
    assert "hf download tiny-org/absent" in capsys.readouterr().err


def test_controlnet_names_in_python_the_cli_and_the_service(offline, sdxl_dir, tmp_path):
    """A ControlNet repository (its config and weights at the root) named org/name: the Python
    API, the CLI's --controlnet NAME=PATH and the service's controlnets read its snapshot."""
    from pipelines.cli.controls import parse_controlnets
    from pipelines.controlnet import ControlNetPipeline
    from serving.models import _check_controlnets
    from serving.specs import ControlNetSpec

    config = json.loads((sdxl_dir / "unet" / "config.json").read_text())
    made = tmp_path / "cn"
    tiny.make_controlnet(made, {k: v for k, v in config.items() if not k.startswith("_")},
                         conditioning_embedding_out_channels=(8, 16))  # image 2x the latents
    repo = offline.parent / "models--tiny-org--tiny-controlnet"
    snap = _snapshot(repo, MAIN, {p.name: p for p in made.iterdir()})
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)

    pipe = _load(NAME)
    by_name = ControlNetPipeline.from_pipe(pipe, controlnet="tiny-org/tiny-controlnet")
    by_folder = ControlNetPipeline.from_pipe(pipe, controlnet=made)
    a, b = (jax.tree_util.tree_leaves(p.controlnet_params) for p in (by_name, by_folder))
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))

    names, errors = parse_controlnets(["canny=tiny-org/tiny-controlnet",
                                       "depth=tiny-org/absent"])
    assert names == {"canny": str(snap.resolve())}
    assert len(errors) == 1 and "hf download tiny-org/absent" in errors[0]
    _check_controlnets([ControlNetSpec(name="canny", path="tiny-org/tiny-controlnet")], "x")
    with pytest.raises(ValueError, match="x: depth: .*hf download tiny-org/absent"):
        _check_controlnets([ControlNetSpec(name="depth", path="tiny-org/absent")], "x")


def test_run_configs_and_the_cli_take_a_revision_and_a_variant(offline):
    """The run-config keys revision / variant (the CLI's --revision / --variant) reach the
    loader: the revision picks the snapshot, the variant the fp16 files."""
    from pipelines.cli.common import _run_config
    from pipelines.cli.parser import build_parser

    snap = offline / "snapshots"
    cfg = load_run_config({"model": NAME, "revision": "other", "compile_cache_dir": ""})
    np.testing.assert_array_equal(_kernel(TextToImagePipeline.from_config(cfg)),
                                  _file_kernel(snap / OTHER / UNET_FILE))
    args = build_parser().parse_args(["generate", "x", "--model", NAME, "--revision", "other",
                                      "--variant", "fp16"])
    cfg = _run_config(args)
    assert (cfg.revision, cfg.variant, cfg.model) == ("other", "fp16", str(snap / OTHER))
    assert cfg.pipeline_kwargs()["variant"] == "fp16"


def test_the_cli_takes_a_name(offline, capsys):
    assert cli.main(["info", "--model", NAME, "--json"]) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "diffusers folder" and report["total_parameters"] > 0


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    assert hub.cache_dir() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub.cache_dir() == tmp_path / "hub"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert not hub.offline()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.offline()


def test_resolving_a_path_never_imports_jax_or_the_hub_client(tmp_path):
    """The CLI resolves --model before it starts JAX: maxdiff.hub imports neither JAX nor,
    for a path, huggingface_hub."""
    import subprocess
    import sys

    code = ("import sys; from maxdiff import hub; hub.resolve(sys.argv[1]); "
            "assert 'jax' not in sys.modules and 'huggingface_hub' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith(('jax', 'huggingface')))")
    root = Path(__file__).resolve().parent.parent
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=root,
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(root)))
    assert res.returncode == 0, res.stderr


def test_the_snapshot_links_lead_into_the_repository_blobs(offline):
    """Snapshot files are relative links into the repository's blobs/, which the loader's
    link check allows (and nothing else outside the snapshot)."""
    from maxdiff.checkpoint import check_links

    snap = offline / "snapshots" / MAIN
    check_links(snap)
    assert os.readlink(snap / UNET_FILE).startswith("../../../blobs/")
