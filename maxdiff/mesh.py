"""Device meshes for data-parallel generation.

One mesh axis, ``data``: the batch is split over it, parameters are replicated on every
device. (An ``fsdp`` axis that shards parameters can be added for models that do not fit
one chip.)

A mesh may also be made of devices this process cannot run on: a TPU topology described by
``jax.experimental.topologies`` on a CPU host (:func:`topology_mesh`). Programs for it compile
but never run; :func:`place` then gives ``jax.ShapeDtypeStruct`` leaves with the sharding
instead of arrays (:mod:`pipelines.aot`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA = "data"


def make_mesh(devices: int | Sequence[Any] | None = None) -> Mesh:
    """A 1-D ``data`` mesh over ``devices``: None for all local devices, an int N for the
    first N local devices, or an explicit list of devices."""
    local = jax.local_devices()
    if devices is None:
        chosen = local
    elif isinstance(devices, int):
        if not 1 <= devices <= len(local):
            raise ValueError(f"devices={devices}: this host has {len(local)} local device(s); "
                             f"use 1..{len(local)}")
        chosen = local[:devices]
    else:
        chosen = list(devices)
        if not chosen:
            raise ValueError("devices=[]: give at least one device")
    return Mesh(np.array(chosen), (DATA,))


GPU_TARGETS = ("h100", "h200")  # maxdiff/assets/gpu/<name>.txtpb


def topology_mesh(name: str) -> Mesh:
    """A ``data`` mesh over every chip of a topology, compile-only on a machine without them:
    a TPU topology (``"v5e:2x2"``, ``"v6e:2x2"``, ``"v5p:2x2x1"``; needs libtpu,
    ``pip install 'maxdiff[tpu]'``) or N GPUs of one host (``"h100:8"``, ``"h200:1"``; needs
    JAX's CUDA plugin, ``pip install 'maxdiff[cuda]'``, and ``JAX_PLATFORMS=cpu`` on a machine
    without a GPU)."""
    from jax.experimental import topologies

    kind, _, count = name.partition(":")
    try:
        if kind.lower() in GPU_TARGETS:
            config = Path(__file__).parent / "assets" / "gpu" / f"{kind.lower()}.txtpb"
            topo = topologies.get_topology_desc(platform="cuda", target_config=config.read_text(),
                                                topology=f"1x1x{int(count or 1)}")
        else:
            topo = topologies.get_topology_desc(platform="tpu", topology_name=name)
    except Exception as e:  # libtpu / the CUDA plugin missing, or a name it does not know
        raise ValueError(f"topology {name!r}: {e}") from None
    return Mesh(np.array(topo.devices), (DATA,))


@functools.cache
def _runs_here(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


def compile_only(mesh: Mesh) -> bool:
    """Whether this process cannot run programs on ``mesh``'s devices (a described topology)."""
    return not _runs_here(mesh.devices.flat[0].platform)


def place(tree: Any, sharding: NamedSharding) -> Any:
    """``jax.device_put(tree, sharding)``, or, for a compile-only mesh, the same tree of
    ``jax.ShapeDtypeStruct`` leaves (shape, dtype, ``sharding``)."""
    if not compile_only(sharding.mesh):
        return jax.device_put(tree, sharding)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), _dtype(a), sharding=sharding),
                        tree)


def _dtype(a) -> np.dtype:
    dt = getattr(a, "dtype", None)
    return np.dtype(dt) if dt is not None else np.asarray(a).dtype


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """Shard the leading (batch) axis over ``data``."""
    return NamedSharding(mesh, P(DATA))


def put_replicated(mesh: Mesh):
    """A ``put`` for :func:`maxdiff.checkpoint.load_params`: each tensor on every device."""
    sharding = replicated(mesh)
    return lambda a: place(a, sharding)
