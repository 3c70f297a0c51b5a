"""Models named as on the Hugging Face Hub (``"stabilityai/stable-diffusion-xl-base-1.0"``):
:func:`resolve` turns a name into the local folder of its snapshot in the Hugging Face cache
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), the folder every
loader then reads as it reads any other. A local path always wins over a name.

The cache comes first, and a cached name is used as it is, without asking the Hub (``hf
download NAME`` updates it). Only when a name is not cached, and ``HF_HUB_OFFLINE`` is not set,
are the files maxdiff reads downloaded (:func:`_download`: configs, tokenizers and one set of
safetensors weights per component, never ``.bin`` files nor a repository's extra single files).

Light: never imports JAX, and imports ``huggingface_hub`` only when a name is looked up, so
the CLI can resolve ``--model`` before it starts JAX."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["NotCachedError", "cache_dir", "is_repo_id", "needed_files", "offline", "resolve"]

_NAME = re.compile(r"\w(?:[\w.-]*\w)?", re.ASCII)
# a path to a weight file is a file name, never a repository's
_FILE_SUFFIXES = (".safetensors", ".ckpt", ".bin", ".pt", ".pth", ".json", ".yaml", ".yml")
_TRUE = {"1", "ON", "YES", "TRUE"}
# the files of a component folder that are not weights: configs, tokenizers' vocabularies
_CONFIG_SUFFIXES = (".json", ".txt", ".model")


class NotCachedError(ValueError):
    """A Hub model name that is not in the Hugging Face cache and could not be downloaded
    (``HF_HUB_OFFLINE`` set, or the download failed); the message says where maxdiff looked
    and how to download it."""


def is_repo_id(name: str) -> bool:
    """Whether ``name`` reads as a Hub model id, ``org/name`` (the Hub's rules: letters, digits,
    ``-``, ``_``, ``.``; no ``--`` or ``..``; at most 96 characters), and not as a path to a
    weight or config file."""
    org, sep, repo = str(name).partition("/")
    return (bool(sep) and len(name) <= 96 and bool(_NAME.fullmatch(org))
            and bool(_NAME.fullmatch(repo)) and "--" not in name and ".." not in name
            and not name.endswith(".git") and not name.lower().endswith(_FILE_SUFFIXES))


def cache_dir() -> Path:
    """The Hugging Face cache as ``huggingface_hub`` finds it, read from the environment now:
    ``$HF_HUB_CACHE`` (or the older ``$HUGGINGFACE_HUB_CACHE``), else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub`` or ``~/.cache/huggingface/hub``."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    hub = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(hub)))


def offline() -> bool:
    """Whether the Hub must not be contacted: ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``)
    is set to 1 / true / yes / on now, or ``huggingface_hub`` was imported with it set."""
    if any((os.environ.get(k) or "").upper() in _TRUE
           for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    constants = sys.modules.get("huggingface_hub.constants")
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def resolve(model: str | os.PathLike, *, revision: str | None = None,
            variant: str | None = None, weights: bool = True) -> Path:
    """The local path of ``model``: ``model`` itself when it exists (a folder or a file) or is
    no ``org/name`` model id (the loader then says what is wrong with it); else the snapshot
    folder of that Hub model in the Hugging Face cache at ``revision`` (a branch or tag, read
    from the cache's ``refs/``, or a commit hash; None: ``main``).

    A name not in the cache is downloaded (only the files maxdiff reads: :func:`needed_files`;
    ``variant`` picks ``*.{variant}.safetensors`` weights where a component has them, and
    ``weights=False`` fetches configs and tokenizers alone) unless ``HF_HUB_OFFLINE`` is set;
    then, or when the download fails, :class:`NotCachedError` (a ValueError) says where it
    looked and how to download the model. A ``Path`` is always a path, never a name."""
    path = Path(model).expanduser()
    if not isinstance(model, str) or path.exists() or not is_repo_id(model):
        return path
    name = model
    found = _cached(name, revision)
    if found is not None:
        return found
    if offline():
        raise NotCachedError(_not_cached(name, revision, "HF_HUB_OFFLINE is set, so nothing "
                                          "is downloaded"))
    return _download(name, revision, variant, weights)


def _cached(name: str, revision: str | None) -> Path | None:
    """The cached snapshot folder of ``name`` at ``revision``, or None: never the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    try:
        # allow_patterns: a snapshot with the top-level configs counts as cached even where only
        # some of its files were downloaded (hf download --include ...); the loaders name what
        # a component lacks
        folder = snapshot_download(name, revision=revision, cache_dir=cache_dir(),
                                   local_files_only=True,
                                   allow_patterns=["model_index.json", "config.json"])
    except LocalEntryNotFoundError:
        return None
    return Path(folder)


def _not_cached(name: str, revision: str | None, why: str) -> str:
    rev = f" --revision {revision}" if revision else ""
    folder = cache_dir() / f"models--{name.replace('/', '--')}"
    return (f"model {name}: no such local folder or file, and not in the Hugging Face cache "
            f"(looked in {folder}, revision {revision or 'main'}; the cache is $HF_HUB_CACHE, "
            f"else $HF_HOME/hub); {why}. Download it with `hf download {name}{rev}` "
            f"(`huggingface-cli download {name}{rev}` with huggingface_hub before 1.0)"
            + (", or unset HF_HUB_OFFLINE to let maxdiff download what it reads"
               if offline() else "") + ", or give a local folder")


def needed_files(files: Iterable[str], variant: str | None = None, *,
                 components: Iterable[str] | None = None, weights: bool = True) -> list[str]:
    """Which of a Hub repository's ``files`` (paths relative to its root) maxdiff reads:
    ``model_index.json`` and ``maxdiff.json``; in each folder of ``components`` (a pipeline's:
    the lists of its ``model_index.json``; None: a component repository, its files at the
    root) its configs and tokenizer files and, with ``weights``, the one set of safetensors
    weights :func:`maxdiff.checkpoint.open_weights` would read there (``variant``'s where the
    folder has them; a sharded set's index and shards). Never ``.bin`` or other weights, nor a
    pipeline repository's top-level single files."""
    by_folder: dict[str, list[str]] = {}
    for f in files:
        folder, _, base = f.rpartition("/")
        by_folder.setdefault(folder, []).append(base)
    wanted = [f for f in ("model_index.json", "maxdiff.json") if f in by_folder.get("", [])]
    folders = [""] if components is None else sorted(set(components))
    for folder in folders:
        names = by_folder.get(folder, [])
        prefix = f"{folder}/" if folder else ""
        picked = [n for n in names if n.endswith(_CONFIG_SUFFIXES) and ".index." not in n
                  and n not in wanted]
        if weights:
            picked += _weight_files(names, variant)
        wanted += [prefix + n for n in sorted(set(picked))]
    return wanted


def _weight_files(names: list[str], variant: str | None) -> list[str]:
    """The weight file, or the shard index and its shards, that ``open_weights`` reads among a
    folder's file ``names``."""
    from maxdiff.checkpoint import weight_candidates

    present = set(names)
    for name, v, index in weight_candidates(variant):
        if name not in present:
            continue
        if not index:
            return [name]
        stem = name.split(".")[0]
        shards = ([f"{stem}.{v}-?????-of-?????.safetensors",
                   f"{stem}-?????-of-?????.{v}.safetensors"] if v
                  else [f"{stem}-?????-of-?????.safetensors"])
        return [name, *(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in shards))]
    return []


def _download(name: str, revision: str | None, variant: str | None, weights: bool) -> Path:
    """Download the files maxdiff reads of Hub model ``name`` into the cache; its snapshot
    folder. The one branch that touches the network (tests/test_hub.py runs it against a
    faked Hub: no test downloads)."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    try:
        files = HfApi().list_repo_files(name, revision=revision)
        components = None
        if "model_index.json" in files:
            index = hf_hub_download(name, "model_index.json", revision=revision,
                                    cache_dir=cache_dir())
            components = [k for k, v in json.loads(Path(index).read_text()).items()
                          if isinstance(v, list)]
        folder = snapshot_download(name, revision=revision, cache_dir=cache_dir(),
                                   allow_patterns=needed_files(files, variant,
                                                               components=components,
                                                               weights=weights))
    except Exception as e:  # no network, no such repository or revision, gated, ...
        raise NotCachedError(_not_cached(name, revision, f"downloading it failed ({e})")) from e
    return Path(folder)
