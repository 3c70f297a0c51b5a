"""Programs for devices this process cannot run on (a TPU topology or a GPU target described on
a CPU host, :func:`maxdiff.mesh.topology_mesh`): :func:`pipelines.program.jit` makes each
pipeline program a :class:`CompileOnly` on such a mesh, which compiles where it would run, and
:func:`recording` collects what was compiled for :mod:`pipelines.aot`'s reports."""

from __future__ import annotations

import contextlib
import contextvars

import jax
import numpy as np

_COMPILED: contextvars.ContextVar[list | None] = contextvars.ContextVar("maxdiff_compiled",
                                                                       default=None)


@contextlib.contextmanager
def recording():
    """Collects every program a :class:`CompileOnly` compiles inside: a list of dicts with the
    ``compiled`` program (``cost_analysis()``, ``memory_analysis()``, ``as_text()``) and
    ``kernel_flops`` / ``kernel_bytes``, the Pallas kernels' work XLA does not count."""
    compiled: list = []
    token = _COMPILED.set(compiled)
    try:
        yield compiled
    finally:
        _COMPILED.reset(token)


class CompileOnly:
    """A pipeline program for devices this process cannot run on. Called with placed
    arguments (``jax.ShapeDtypeStruct`` leaves from :func:`maxdiff.mesh.place`), it lowers and
    compiles the program for those shapes and shardings (once per signature), records it
    (:func:`recording`) and returns its outputs as ``jax.ShapeDtypeStruct`` leaves, so the
    pipeline's host code runs to its end and the caller sees what the program would cost."""

    def __init__(self, jitted, shards: int):
        self.jitted = jitted
        self.shards = shards  # devices the batch is split over (kernel costs are global)
        self._compiled: dict = {}

    def __call__(self, *args):
        from maxdiff.models.attention import counting_kernel_costs

        leaves, tree = jax.tree.flatten(args)
        key = (tree, tuple((np.shape(a), str(getattr(a, "dtype", "")),
                            getattr(a, "sharding", None)) for a in leaves))
        entry = self._compiled.get(key)
        if entry is None:
            with counting_kernel_costs() as costs:
                lowered = self.jitted.lower(*args)
            # a compile-only executable cannot be loaded back: keep it out of the disk cache
            cache_on = jax.config.jax_enable_compilation_cache
            jax.config.update("jax_enable_compilation_cache", False)
            try:
                compiled = lowered.compile()
            finally:
                jax.config.update("jax_enable_compilation_cache", cache_on)
            out = jax.tree.map(
                lambda info, sharding: jax.ShapeDtypeStruct(info.shape, info.dtype,
                                                            sharding=sharding),
                lowered.out_info, compiled.output_shardings)
            entry = self._compiled[key] = {
                "compiled": compiled, "out": out, "shards": self.shards,
                "kernel_flops": float(sum(c["flops"] for c in costs)),
                "kernel_bytes": float(sum(c["bytes"] for c in costs))}
        record = _COMPILED.get()
        if record is not None:
            record.append(entry)
        return entry["out"]
