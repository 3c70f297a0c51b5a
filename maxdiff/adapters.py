"""Per-image LoRA adapters, unfused: many adapters (and none) in one device batch.

``fuse_loras`` (:mod:`maxdiff.lora`) bakes one set of adapters into the weights; every image of
the model then has them. Here each adapted projection instead adds, per image, the low-rank
update of that image's adapter to its output::

    y = x @ W + b + (x @ D[i]) @ U[i]        D[i] = down^T (in, r),  U[i] = scale * alpha / r * up^T

(convolutions: ``D[i]`` is the down matrix as a (kh, kw, in, r) kernel run with the layer's
strides and padding, ``U[i]`` a 1x1 convolution). ``i`` is the image's adapter index, a traced
input: 0 means no adapter. The factors of all adapters are stacked per layer into zero-padded
tables ``D`` (A + 1, in, R) and ``U`` (A + 1, R, out), R the largest rank of any adapter on
that layer; row 0 and the rows of adapters that do not touch the layer are zeros. So the images
of one batch may use different adapters and still run one compiled program.

The model code stays as it is: :func:`applied` installs a Flax method interceptor around
``nn.Dense.__call__`` and :class:`maxdiff.models.conv.Conv`'s ``__call__`` that looks the
module's path up in the component's tables.

Cost per adapted layer and image: two extra matmuls of rank R (a rank-R convolution and a 1x1
convolution for conv layers), i.e. about ``R * (in + out) / (in * out)`` of the layer's own
work, paid whether or not the image uses an adapter once any adapter is registered. Memory: the
tables, about the adapters' files (float32) plus zero padding where ranks or layers differ.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from maxdiff.lora import LoraLayer
from maxdiff.models.conv import Conv, xla_conv

__all__ = ["AdapterTables", "build_tables", "applied"]


@dataclass(frozen=True)
class AdapterTables:
    """Per component: module path (a tuple of names) -> (D, U) stacked tables (see module doc).

    ``names``: the adapters in table order (row k + 1 of every table is ``names[k]``)."""

    names: tuple[str, ...]
    tables: Mapping[str, Mapping[tuple[str, ...], tuple[Any, Any]]]

    def as_tree(self) -> dict:
        """The arrays as a pytree (a program input): component -> "a/b/c" -> (D, U)."""
        return {c: {"/".join(path): du for path, du in t.items()} for c, t in self.tables.items()}

    @property
    def nbytes(self) -> int:
        return int(sum(np.asarray(x).nbytes if not hasattr(x, "nbytes") else x.nbytes
                       for t in self.tables.values() for du in t.values() for x in du))


def _factors(layer: LoraLayer, coef: float) -> tuple[np.ndarray, np.ndarray]:
    """(D, U) of one layer in the Flax layout: linear (in, r), (r, out); conv
    (kh, kw, in, r), (r, out). ``coef`` (scale * alpha / r) is folded into U."""
    r = layer.rank
    up = np.float32(coef) * layer.up.reshape(layer.up.shape[0], r)  # (out, r)
    if layer.down.ndim == 2:
        return np.ascontiguousarray(layer.down.T), np.ascontiguousarray(up.T)
    return np.ascontiguousarray(layer.down.transpose(2, 3, 1, 0)), np.ascontiguousarray(up.T)


def build_tables(adapters: Sequence[tuple[str, Iterable[LoraLayer], float]], dtype=jnp.float32,
                 put=None) -> AdapterTables:
    """Stack ``adapters`` ((name, layers, scale), in index order 1..A) into zero-padded tables
    of ``dtype``, placed with ``put`` (default: ``jax.device_put``)."""
    per_layer: dict[tuple[str, tuple[str, ...]], dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for k, (_, layers, scale) in enumerate(adapters, start=1):
        for layer in layers:
            key = (layer.component, tuple(layer.path[:-1]))
            per_layer.setdefault(key, {})[k] = _factors(layer, scale * layer.factor)
    put = put or jax.device_put
    n = len(adapters) + 1
    tables: dict[str, dict[tuple[str, ...], tuple[Any, Any]]] = {}
    for (comp, path), rows in per_layer.items():
        d0, u0 = next(iter(rows.values()))
        rmax = max(d.shape[-1] for d, _ in rows.values())
        D = np.zeros((n, *d0.shape[:-1], rmax), np.float32)
        U = np.zeros((n, rmax, u0.shape[-1]), np.float32)
        for k, (d, u) in rows.items():
            D[k, ..., : d.shape[-1]] = d
            U[k, : u.shape[0]] = u
        tables.setdefault(comp, {})[path] = (put(jnp.asarray(D, dtype)), put(jnp.asarray(U, dtype)))
    return AdapterTables(tuple(name for name, _, _ in adapters), tables)


def _lora_linear(x, D, U, idx):
    d, u = D[idx], U[idx]  # (B, in, R), (B, R, out)
    xf = x.astype(d.dtype)
    h = jnp.einsum("b...i,bir->b...r", xf, d)
    return jnp.einsum("b...r,bro->b...o", h, u)


def _lora_conv(mod: Conv, x, upsample: bool, D, U, idx):
    d, u = D[idx], U[idx]  # (B, kh, kw, in, R), (B, R, out)
    xf = x.astype(d.dtype)
    if upsample:
        xf = jnp.repeat(jnp.repeat(xf, 2, axis=1), 2, axis=2)
    strides, padding = tuple(mod.strides), tuple(map(tuple, mod.padding))
    h = jax.vmap(lambda xi, ki: xla_conv(xi[None], ki, strides, padding)[0])(xf, d)
    return jnp.einsum("bhwr,bro->bhwo", h, u)


@contextlib.contextmanager
def applied(tables: Mapping[str, tuple[Any, Any]] | None, index):
    """Within this context, every ``nn.Dense`` / ``Conv`` whose module path (``"a/b/c"``) is in
    ``tables`` adds each image's low-rank update; ``index`` (B,) int32 is each image's row in
    the tables (the batch axis of the layer's input). ``tables`` None or empty: nothing changes.
    Every table must be used by a layer (checked when the context ends, at trace time): a table
    no layer picked up would be an adapter silently ignored."""
    if not tables:
        yield
        return

    def interceptor(next_fun, args, kwargs, context):
        mod = context.module
        if context.method_name != "__call__" or not isinstance(mod, (nn.Dense, Conv)):
            return next_fun(*args, **kwargs)
        path = "/".join(mod.path)
        entry = tables.get(path)
        if entry is None:
            return next_fun(*args, **kwargs)
        used.add(path)
        y = next_fun(*args, **kwargs)
        x = args[0] if args else next(iter(kwargs.values()))
        if x.shape[0] != index.shape[0]:
            raise ValueError(f"adapter index has {index.shape[0]} entries but layer "
                             f"{'/'.join(mod.path)} gets a batch of {x.shape[0]}")
        D, U = entry
        if isinstance(mod, Conv):
            upsample = bool(args[1] if len(args) > 1 else kwargs.get("upsample", False))
            delta = _lora_conv(mod, x, upsample, D, U, index)
        else:
            delta = _lora_linear(x, D, U, index)
        return (y.astype(jnp.float32) + delta.astype(jnp.float32)).astype(y.dtype)

    used: set[str] = set()
    with nn.intercept_methods(interceptor):
        yield
    missed = sorted(set(tables) - used)
    if missed:
        raise RuntimeError(f"adapter tables for {len(missed)} layer(s) matched no module "
                           f"(first: {missed[0]!r}); module paths and parameter paths differ")
