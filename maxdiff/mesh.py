"""Device meshes for data-parallel generation.

One mesh axis, ``data``: the batch is split over it, parameters are replicated on every
device. (An ``fsdp`` axis that shards parameters can be added for models that do not fit
one chip.)
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

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


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """Shard the leading (batch) axis over ``data``."""
    return NamedSharding(mesh, P(DATA))


def put_replicated(mesh: Mesh):
    """A ``put`` for :func:`maxdiff.checkpoint.load_params`: each tensor on every device."""
    sharding = replicated(mesh)
    return lambda a: jax.device_put(a, sharding)
