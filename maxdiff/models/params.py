"""Parameters read from a loaded tree without re-tracing their initializers.

Flax's ``param`` checks an existing parameter's shape by tracing its initializer
(``jax.eval_shape`` once per parameter, every time a model is traced): about a quarter of the
time it takes to trace a tiny pipeline, and one trace per parameter array of SDXL's (1,680 in
its UNet alone) on every new shape a server compiles. :class:`FromTree` compares the shape the
initializer is given with the loaded array's instead; a module still being initialized (no
parameter yet) goes through flax unchanged, except inside :func:`zero_init`
(``checkpoint.init_shapes``), where a parameter's initializer is replaced by zeros of its
shape: only the shapes are kept, and tracing a random initializer per parameter was half the
time of finding them. The layers below are flax's under the same names (so auto-named
submodules keep their names) with that check.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax.core import meta

_ZERO_INIT = contextvars.ContextVar("maxdiff_zero_init", default=False)


@contextlib.contextmanager
def zero_init():
    """Within: a :class:`FromTree` module's new parameters start as zeros (for ``eval_shape``
    of ``init``, where only their shapes and dtypes are kept)."""
    token = _ZERO_INIT.set(True)
    try:
        yield
    finally:
        _ZERO_INIT.reset(token)


def _zeros(key, shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


class FromTree:
    """Mixin for a flax Module: a parameter already in the tree is returned after a direct
    shape check; a missing one is created by flax as usual (``init``)."""

    def param(self, name: str, init_fn, *init_args, unbox: bool = True, **init_kwargs) -> Any:
        shape = init_args[0] if init_args else init_kwargs.get("shape")
        sized = isinstance(shape, tuple | list)
        if not self.has_variable("params", name):
            if sized and _ZERO_INIT.get():
                init_fn = _zeros
            return super().param(name, init_fn, *init_args, unbox=unbox, **init_kwargs)
        value = self.get_variable("params", name)
        array = meta.unbox(value)
        if sized and tuple(np.shape(array)) != tuple(shape):
            where = "/".join(self.scope.path) if self.scope is not None else ""
            raise ValueError(f"parameter {where}/{name} has shape {tuple(np.shape(array))}; "
                             f"this module expects {tuple(shape)}")
        return array if unbox else value


class Dense(FromTree, nn.Dense):
    pass


class Embed(FromTree, nn.Embed):
    pass


class LayerNorm(FromTree, nn.LayerNorm):
    pass


class Conv(FromTree, nn.Conv):
    pass
