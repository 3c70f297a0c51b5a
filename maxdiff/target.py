"""Which chip a program is compiled for, read from the mesh it is traced under.

Kernel and algorithm choices (attention, the CPU convolutions, the default dtype) follow the
devices a program will run on, not the machine that compiles it: a program compiled on a CPU
host for a TPU topology (``jax.experimental.topologies``) must get the TPU's kernels. Inside a
trace that mesh is JAX's abstract mesh: the pipelines trace every program under theirs
(:func:`traced_under`), and code compiled by hand gets the same choices inside
``jax.sharding.use_abstract_mesh(mesh.abstract_mesh)`` (or ``jax.set_mesh(mesh)`` around the
``jit``). Without a mesh, the choice is JAX's default backend's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from maxdiff.mesh import DATA

GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def normalize(platform: str) -> str:
    """``"cpu"``, ``"tpu"`` or ``"gpu"`` (CUDA and ROCm devices are ``"gpu"``)."""
    platform = platform.lower()
    return "gpu" if platform in GPU_PLATFORMS else platform


def platform() -> str:
    """The platform of the mesh being traced under, else JAX's default backend's:
    ``"cpu"``, ``"tpu"`` or ``"gpu"``."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return normalize(device.platform if device is not None else jax.default_backend())


def mesh_platform(mesh) -> str:
    """The platform of a concrete mesh's devices (``"cpu"``, ``"tpu"``, ``"gpu"``)."""
    return normalize(mesh.devices.flat[0].platform)


def is_accelerator(name: str | None = None) -> bool:
    """Whether ``name`` (default: :func:`platform`) is a TPU or GPU."""
    return normalize(name or platform()) != "cpu"


def data_shards() -> int:
    """How many ways the traced mesh splits the batch (its ``data`` axis; 1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or DATA not in mesh.axis_names:
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes))[DATA]


def per_device() -> bool:
    """Whether the code being traced sees one device's rows (inside a ``shard_map`` over the
    ``data`` axis) rather than the whole batch."""
    mesh = jax.sharding.get_abstract_mesh()
    return DATA in (getattr(mesh, "manual_axes", ()) or ())


def traced_under(mesh, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` traced with ``mesh`` as JAX's abstract mesh, so the kernels chosen inside are the
    mesh's devices' (wrap a program before ``jax.jit``)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return wrapped


def default_dtype(platform_name: str) -> str:
    """``dtype="auto"``: bfloat16 on TPUs and GPUs, float32 on CPUs (XLA:CPU has run bf16 no
    faster than float32 on the CPUs measured, and float32 keeps parity with diffusers)."""
    return "bfloat16" if is_accelerator(platform_name) else "float32"
