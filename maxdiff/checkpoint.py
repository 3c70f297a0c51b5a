"""Read diffusers / transformers checkpoint folders into Flax parameter trees.

No torch: safetensors files are parsed here (an 8-byte little-endian header
length, a JSON header, then raw little-endian tensors) and each tensor is read,
cast and handed to JAX one at a time. Peak host memory
while loading stays near the size of the weights in the target dtype.

Naming convention shared by every maxdiff model: a Flax submodule is named
exactly as the PyTorch module path segment it mirrors (``"down_blocks.0"``,
``"to_out.0"``), so a Flax parameter path maps onto a PyTorch key by joining
with dots and renaming the leaf:

================  ==================  =====================================
Flax leaf         PyTorch leaf        layout change
================  ==================  =====================================
``kernel`` (4-d)  ``weight``          conv OIHW -> HWIO
``kernel`` (2-d)  ``weight``          linear (out, in) -> (in, out)
``scale``         ``weight``          (norms)
``embedding``     ``weight``          (embeddings)
``bias``          ``bias``
================  ==================  =====================================
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np

from maxdiff.models.params import zero_init

__all__ = [
    "CheckpointError",
    "SafetensorsFile",
    "WeightSource",
    "open_weights",
    "weight_candidates",
    "check_links",
    "refuse_pickle",
    "flax_to_torch_key",
    "load_params",
    "init_shapes",
    "read_config",
    "resolve_dtype",
    "save_safetensors",
    "LazyTensor",
    "shapes_only",
]


class CheckpointError(ValueError):
    """A checkpoint file or folder cannot be used; the message names the file and key."""


_ST_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "BOOL": np.dtype("?"),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}

_DTYPES = {
    "float32": np.dtype("float32"),
    "fp32": np.dtype("float32"),
    "float16": np.dtype("float16"),
    "fp16": np.dtype("float16"),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
}


def resolve_dtype(dtype: Any) -> np.dtype:
    """``"float32" | "bfloat16" | "float16"`` (or short forms, or a dtype) -> numpy dtype."""
    if isinstance(dtype, str):
        try:
            return _DTYPES[dtype.lower()]
        except KeyError:
            raise ValueError(
                f"dtype={dtype!r} is not supported; use one of float32, bfloat16, float16"
            ) from None
    dt = np.dtype(dtype)
    if dt not in set(_DTYPES.values()):
        raise ValueError(f"dtype={dt} is not supported; use one of float32, bfloat16, float16")
    return dt


class SafetensorsFile:
    """A ``.safetensors`` file, validated against its header; tensors are read one at a time.

    A truncated or corrupt file raises :class:`CheckpointError` naming the file
    (and the tensor, where one is at fault) when it is opened.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        if size < 8:
            raise CheckpointError(f"{self.path}: not a safetensors file (only {size} bytes)")
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8 or n > 100_000_000:
                raise CheckpointError(
                    f"{self.path}: corrupt or truncated safetensors file "
                    f"(header says {n} bytes, file has {size})"
                )
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self._base = 8 + n
        data_len = size - self._base
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for key, info in header.items():
            try:
                dtype = _ST_DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                start, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(
                    f"{self.path}: tensor {key!r} has an unreadable header entry {info!r}"
                ) from None
            if end > data_len:
                raise CheckpointError(
                    f"{self.path}: truncated file: tensor {key!r} needs bytes up to "
                    f"{end} of the data section, which has only {data_len}"
                )
            if end - start != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                raise CheckpointError(
                    f"{self.path}: tensor {key!r} size does not match its shape {shape} "
                    f"and dtype {info['dtype']}"
                )
            self._entries[key] = (dtype, shape, start, end)

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][1]

    def dtype(self, key: str) -> np.dtype:
        return self._entries[key][0]

    def get(self, key: str) -> np.ndarray:
        """The tensor, read from disk into a fresh array (no mapping left behind, so loading
        tensor by tensor keeps peak memory near the size of what is kept)."""
        dtype, shape, start, end = self._entries[key]
        arr = np.empty(shape, dtype)
        if end > start:
            with open(self.path, "rb") as f:
                f.seek(self._base + start)
                got = f.readinto(arr.reshape(-1).view(np.uint8))
            if got != end - start:
                raise CheckpointError(f"{self.path}: truncated file while reading tensor {key!r}")
        return arr


@dataclass
class WeightSource:
    """Where each tensor of one component lives (one file, or several shards)."""

    files: dict[str, SafetensorsFile]
    index: dict[str, str] = field(default_factory=dict)  # key -> file name

    @classmethod
    def from_files(cls, paths: Iterable[str | os.PathLike]) -> WeightSource:
        files, index = {}, {}
        for p in paths:
            f = SafetensorsFile(p)
            files[str(f.path)] = f
            for k in f.keys():
                index[k] = str(f.path)
        return cls(files, index)

    def keys(self) -> list[str]:
        return list(self.index)

    def file_of(self, key: str) -> str:
        return self.index[key]

    def get(self, key: str) -> np.ndarray:
        return self.files[self.index[key]].get(key)

    def lazy(self, key: str, dtype: Any = None) -> LazyTensor:
        """The tensor as a :class:`LazyTensor` (read on demand), floats cast to ``dtype``."""
        f = self.files[self.index[key]]
        src = f.dtype(key)
        dt = np.dtype(dtype) if dtype is not None and _is_float(src) else src
        return LazyTensor(f.shape(key), dt, lambda: f.get(key).astype(dt, copy=False))

    def describe(self) -> str:
        names = sorted(Path(p).name for p in self.files)
        parent = Path(next(iter(self.files))).parent if self.files else Path(".")
        return f"{parent}/{names[0]}" if len(names) == 1 else f"{parent}/{{{', '.join(names)}}}"


_WEIGHT_STEMS = ("diffusion_pytorch_model", "model")
PICKLE_SUFFIXES = (".bin", ".ckpt", ".pt", ".pth", ".pkl", ".pickle")
_CONVERT = (
    "maxdiff never unpickles weights (loading a pickle can run arbitrary code). Convert the "
    "folder once on a machine with diffusers: `python -c \"from diffusers import "
    "StableDiffusionXLPipeline as P; P.from_pretrained('IN', use_safetensors=False)"
    ".save_pretrained('OUT')\"` (writes safetensors), or a single file with "
    "`python -c \"import torch, safetensors.torch as st; sd = torch.load('IN', "
    "weights_only=True); st.save_file(sd.get('state_dict', sd), 'OUT.safetensors')\"`."
)


def refuse_pickle(path: str | os.PathLike) -> None:
    """A :class:`CheckpointError` for a pickle-based weight file (``.bin``, ``.ckpt``, ``.pt``,
    ...), saying how to convert it; nothing for other files."""
    p = Path(path)
    if p.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(f"{p}: a pickle-based weight file ({p.suffix}); {_CONVERT}")


def check_links(root: str | os.PathLike) -> None:
    """Refuse symbolic links under ``root`` that lead outside it (a model folder must not read
    files elsewhere on the machine), naming the link. A Hugging Face cache snapshot
    (``models--ORG--NAME/snapshots/REV``) may link into its own repository folder's ``blobs/``."""
    base = Path(root).resolve()
    allowed = [base]
    if base.parent.name == "snapshots" and base.parent.parent.name.startswith("models--"):
        allowed.append(base.parent.parent / "blobs")
    for folder, dirs, files in os.walk(Path(root), followlinks=False):
        for name in [*dirs, *files]:
            link = Path(folder) / name
            if not link.is_symlink():
                continue
            target = link.resolve()
            if not any(target == a or a in target.parents for a in allowed):
                raise CheckpointError(
                    f"{link}: a symbolic link to {target}, outside the model folder {base}; "
                    "copy the file into the folder instead")


class ShapesOnly:
    """The weights of a model loaded :func:`shapes_only`: no file, no tensor; :func:`load_params`
    gives each parameter as a ``jax.ShapeDtypeStruct`` of its shape and dtype."""

    index: dict = {}

    def keys(self) -> list[str]:
        return []

    def describe(self) -> str:
        return "(shapes only)"


_SHAPES_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("maxdiff_shapes_only",
                                                                    default=False)


@contextlib.contextmanager
def shapes_only():
    """Loaders called inside read configs only: :func:`open_weights` opens no file and the
    parameters come back as ``jax.ShapeDtypeStruct`` leaves (through ``put``), so a model's
    programs can be compiled, for devices this machine may not have, without its weights
    (:mod:`pipelines.aot`)."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def weight_candidates(variant: str | None = None) -> Iterator[tuple[str, str | None, bool]]:
    """The weight files :func:`open_weights` looks for in a component folder, in its order of
    preference: (file name, its variant or None, whether it is a shard index). ``variant``
    given: that variant's files, then the plain ones (as diffusers' pipelines load a component
    that has no such variant); None: the plain files, then an fp16 variant. A variant's shard
    index has three names: diffusers' and transformers' ``{stem}.safetensors.index.{v}.json``,
    their older ``{stem}.safetensors.{v}.index.json``, and ``{stem}.{v}.safetensors.index.json``."""
    for v in ([variant, None] if variant else [None, "fp16"]):
        for stem in _WEIGHT_STEMS:
            if v is None:
                yield f"{stem}.safetensors", None, False
                yield f"{stem}.safetensors.index.json", None, True
            else:
                yield f"{stem}.{v}.safetensors", v, False
                yield f"{stem}.{v}.safetensors.index.json", v, True
                yield f"{stem}.safetensors.index.{v}.json", v, True
                yield f"{stem}.safetensors.{v}.index.json", v, True


def open_weights(path: str | os.PathLike, variant: str | None = None) -> WeightSource:
    """Find and open the safetensors weights of one component (inside :func:`shapes_only`:
    a :class:`ShapesOnly` source, whatever the folder holds).

    ``path`` is a single ``.safetensors`` file or a component folder holding
    ``diffusion_pytorch_model[.{variant}].safetensors`` / ``model[.{variant}].safetensors``
    or a sharded set described by a ``*.safetensors.index*.json`` shard index
    (:func:`weight_candidates` gives the names and their order). With ``variant`` the
    variant's files are preferred and the plain ones read where the folder has none; with
    ``variant=None`` the plain files are preferred and an fp16 variant is used when it is the
    only one present. Pickle-based files (``.bin``) are never read.
    """
    if _SHAPES_ONLY.get():
        return ShapesOnly()
    p = Path(path)
    if p.is_file():
        refuse_pickle(p)
        return WeightSource.from_files([p])
    if not p.is_dir():
        raise CheckpointError(f"{p}: no such file or folder")
    for name, _, index in weight_candidates(variant):
        if not (p / name).is_file():
            continue
        if not index:
            return WeightSource.from_files([p / name])
        idx = p / name
        try:
            weight_map = json.loads(idx.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{idx}: unreadable shard index ({e})") from None
        missing = sorted({f for f in weight_map.values() if not (p / f).is_file()})
        if missing:
            raise CheckpointError(f"{idx}: shard file(s) missing: {', '.join(missing)}")
        src = WeightSource.from_files(p / f for f in sorted(set(weight_map.values())))
        stray = sorted(set(weight_map) - set(src.index))
        if stray:
            raise CheckpointError(f"{idx}: index names keys no shard holds, e.g. {stray[0]!r}")
        return src
    found = sorted(x.name for x in p.iterdir())
    pickles = [x for x in found if Path(x).suffix.lower() in PICKLE_SUFFIXES]
    if pickles:
        raise CheckpointError(f"{p / pickles[0]}: only pickle-based weights here "
                              f"({', '.join(pickles)}), no safetensors; {_CONVERT}")
    want = f", variant {variant!r} first" if variant else ""
    raise CheckpointError(
        f"{p}: no safetensors weights found (looked for diffusion_pytorch_model*.safetensors "
        f"and model*.safetensors, single or sharded{want}); the folder holds: "
        f"{found or 'nothing'}. maxdiff reads safetensors only."
    )


def read_config(folder: str | os.PathLike, name: str = "config.json") -> dict:
    """A component's ``config.json`` as a dict, with a clear error if absent or broken."""
    p = Path(folder) / name
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{p}: missing config file") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{p}: not valid JSON ({e})") from None


def flax_to_torch_key(path: tuple[str, ...], ndim: int) -> tuple[str, Callable[[np.ndarray], np.ndarray]]:
    """Map a Flax parameter path to its PyTorch key and the layout change it needs."""
    *mods, leaf = path
    prefix = ".".join(mods)
    if leaf == "kernel":
        if ndim == 4:
            fn = lambda a: np.transpose(a, (2, 3, 1, 0))  # OIHW -> HWIO
        elif ndim == 2:
            fn = lambda a: np.transpose(a)
        else:
            fn = lambda a: a
        return f"{prefix}.weight", fn
    if leaf in ("scale", "embedding"):
        return f"{prefix}.weight", lambda a: a
    return (f"{prefix}.{leaf}" if prefix else leaf), lambda a: a


def flax_to_torch_layout(path: tuple[str, ...], arr: np.ndarray) -> np.ndarray:
    """The inverse layout change: a Flax array back to the PyTorch layout."""
    if path[-1] == "kernel":
        if arr.ndim == 4:
            return np.transpose(arr, (3, 2, 0, 1))
        if arr.ndim == 2:
            return np.transpose(arr)
    return arr


def _flatten(tree: Mapping, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def _unflatten(flat: dict[tuple[str, ...], Any]) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return tree


# init_shapes' memo: (module, inputs) -> the tree; a handful of entries (one per architecture
# and dtype a process loads), oldest dropped first past _SHAPES_KEPT
_SHAPES: dict = {}
_SHAPES_KEPT = 32


def init_shapes(module, *inputs, **named) -> dict:
    """``module.init``'s parameter tree with ``jax.ShapeDtypeStruct`` leaves (nothing computed):
    the target :func:`load_params` fills. Tracing ``init`` costs about a second on CPU for an
    SDXL-sized model, so the tree is kept per (module, input shapes): a Flax module is a frozen
    dataclass of its configuration, so an equal module has the same tree (a second model of
    the same architecture, a reloaded one). Unhashable arguments are traced every time."""
    try:
        key = (module, inputs, tuple(sorted(named.items())))
        hash(key)
    except TypeError:
        key = None
    tree = _SHAPES.get(key) if key is not None else None
    if tree is None:
        with zero_init():
            tree = jax.eval_shape(module.init, jax.random.key(0), *inputs, **named)["params"]
        if key is not None:
            while len(_SHAPES) >= _SHAPES_KEPT:
                _SHAPES.pop(next(iter(_SHAPES)))
            _SHAPES[key] = tree
    return jax.tree.map(lambda leaf: leaf, tree)  # the caller's own containers


def load_params(
    shapes: Mapping,
    source: WeightSource,
    dtype: Any = "float32",
    *,
    key_prefix: str = "",
    ignore_unexpected: Iterable[str] = (),
    put: Callable[[np.ndarray], Any] | None = None,
    keep_float32: Callable[[tuple[str, ...]], bool] | None = None,
) -> dict:
    """Fill a Flax parameter tree of known shapes from a checkpoint.

    ``shapes`` is the tree ``jax.eval_shape(model.init, ...)["params"]`` gives
    (leaves with ``.shape``). Every leaf must be found, every tensor in the file
    must be used (except keys matching ``ignore_unexpected`` suffixes, such as
    non-persistent buffers), and shapes must agree; otherwise
    :class:`CheckpointError` names the file and key. Each tensor is cast to
    ``dtype`` and passed to ``put`` (default ``jax.device_put``) one at a time.
    """
    target = resolve_dtype(dtype)
    if isinstance(source, ShapesOnly):
        put = put or (lambda a: a)
        return _unflatten({
            path: put(jax.ShapeDtypeStruct(tuple(leaf.shape), np.dtype("float32") if (
                keep_float32 is not None and keep_float32(path)) else target))
            for path, leaf in _flatten(shapes).items()})
    put = put or jax.device_put
    # a single file's model (maxdiff.single_file.MappedSource) says where each key lives
    rename = getattr(source, "rename", None)
    scope = getattr(source, "scope", key_prefix)
    ignore = tuple(ignore_unexpected) + tuple(getattr(source, "ignore", ()))
    hint = getattr(source, "hint", "") or "does config.json match these weights?"
    flat = _flatten(shapes)
    used: set[str] = set()
    out = {}
    where = source.describe()
    for path, leaf in flat.items():
        want = tuple(leaf.shape)
        key, fn = flax_to_torch_key(path, len(want))
        key = key_prefix + key
        stored, op = rename(key) if rename is not None else (key, None)
        if stored not in source.index:
            named = f"{stored!r} (diffusers {key!r})" if stored != key else repr(key)
            raise CheckpointError(
                f"{where}: missing key {named} (needed for parameter {'/'.join(path)} of "
                f"shape {want})"
            )
        raw = source.get(stored)
        if rename is not None:
            arr = as_linear_if_1x1(op.read(raw), len(want))
        else:
            arr = raw
        arr = fn(arr)
        if tuple(arr.shape) != want:
            raise CheckpointError(
                f"{source.file_of(stored)}: key {stored!r} has shape {tuple(raw.shape)}, "
                f"expected {_torch_shape(path, want)} ({hint})"
            )
        dt = np.dtype("float32") if keep_float32 is not None and keep_float32(path) else target
        if np.issubdtype(arr.dtype, np.floating) or arr.dtype == ml_dtypes.bfloat16:
            arr = arr.astype(dt, copy=False)
        out[path] = put(np.ascontiguousarray(arr))
        del arr, raw
        used.add(stored)
    unused = getattr(source, "unused", None) or (lambda k: False)
    unexpected = [
        k for k in source.keys()
        if k.startswith(scope) and k not in used and not k.endswith(ignore or ("\0",))
        and not unused(k)
    ]
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise CheckpointError(
            f"{source.file_of(unexpected[0])}: unexpected key {unexpected[0]!r}{more}: the "
            f"weights do not belong to a model of this config.json"
            f"{' (' + hint + ')' if getattr(source, 'hint', '') else ''}"
        )
    return _unflatten(out)


def as_linear_if_1x1(arr: np.ndarray, ndim: int) -> np.ndarray:
    """A 1x1 convolution's weight (out, in, 1, 1) as the linear weight (out, in) a model of
    ``ndim``-dimensional weight reads (single files store some projections as 1x1 convs)."""
    if arr.ndim == 4 and ndim == 2 and arr.shape[2:] == (1, 1):
        return arr.reshape(arr.shape[:2])
    return arr


def _torch_shape(path: tuple[str, ...], flax_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The PyTorch shape of a Flax parameter (a zero-size view: nothing is allocated)."""
    return flax_to_torch_layout(path, np.broadcast_to(np.empty((), np.uint8), flax_shape)).shape


def _is_float(dt: np.dtype) -> bool:
    return np.issubdtype(dt, np.floating) or dt == ml_dtypes.bfloat16


class LazyTensor(NamedTuple):
    """A tensor known by shape and dtype, produced by ``load()`` only when it is written."""

    shape: tuple[int, ...]
    dtype: np.dtype
    load: Callable[[], np.ndarray]


def save_safetensors(tensors: Mapping[str, np.ndarray | LazyTensor], path: str | os.PathLike,
                     metadata: Mapping[str, str] | None = None) -> int:
    """Write tensors as a safetensors file, atomically (temp file, fsync, rename).

    Values may be arrays or :class:`LazyTensor` s; lazy ones are loaded one at a time while
    writing, so converting a checkpoint never holds more than one tensor. Returns the size.
    """
    path = Path(path)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    keys = sorted(tensors)
    for k in keys:
        t = tensors[k]
        dt = np.dtype(t.dtype)
        dt = dt.newbyteorder("<") if dt.byteorder == ">" else dt
        name = _ST_NAMES.get(dt)
        if name is None:
            raise ValueError(f"cannot store tensor {k!r} of dtype {dt} in safetensors")
        n = int(np.prod(t.shape, dtype=np.int64)) * dt.itemsize
        header[k] = {"dtype": name, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(hb)))
            f.write(hb)
            for k in keys:
                t = tensors[k]
                a = t.load() if isinstance(t, LazyTensor) else t
                # (reshaped: ascontiguousarray makes a 0-d array, e.g. a LoRA alpha, 1-d)
                a = np.ascontiguousarray(a, dtype=t.dtype).reshape(np.shape(a))
                if tuple(a.shape) != tuple(t.shape):
                    raise ValueError(f"tensor {k!r} loaded with shape {a.shape}, declared {t.shape}")
                f.write(a.reshape(-1).view(np.uint8))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return 8 + len(hb) + offset
