"""What every compiled program shares (text-to-image, image editing, the step engine), one copy
each: how an image's seed becomes its noise, how a batch is padded and placed on the mesh, and
how the device's pixels become the caller's images. A change here changes all three alike, so
an image keeps its pixels whichever way it was made.

Noise: image ``i``'s seed makes one PRNG key, split into ``n`` keys (two for text-to-image and
the step engine: initial noise, step noise; four for editing: add-noise noise, the image's
posterior draw, the masked image's, step noise). Step ``k``'s noise (ancestral samplers, LCM)
is drawn from ``fold_in(step_key, k)``, so it depends on neither the batch nor the step the
image joined at.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxdiff import mesh as meshlib

__all__ = ["image_keys", "normal", "step_noise", "pad_rows", "BatchPut", "host_images"]


def image_keys(seeds: jax.Array, n: int = 2) -> tuple[jax.Array, ...]:
    """``n`` per-image key arrays (B,) from per-image uint32 seeds (B,)."""
    keys = jax.vmap(jax.random.key)(seeds)
    return jax.vmap(lambda k: tuple(jax.random.split(k, n)))(keys)


def normal(keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """One standard normal array of ``shape`` per key: (B, *shape)."""
    return jax.vmap(lambda k: jax.random.normal(k, shape))(keys)


def step_noise(keys: jax.Array, step: Any, shape: tuple[int, ...]) -> jax.Array:
    """Step noise (B, *shape): image ``b`` draws from ``fold_in(keys[b], step[b])``; ``step``
    is one step index for all or one per image."""
    step = jnp.broadcast_to(jnp.asarray(step), keys.shape[:1])
    return jax.vmap(lambda k, i: jax.random.normal(jax.random.fold_in(k, i), shape))(keys, step)


def pad_rows(a: np.ndarray | None, size: int, axis: int = 0) -> np.ndarray | None:
    """``a`` with its last row along ``axis`` repeated up to ``size`` rows (padding rows are
    computed and dropped, so they repeat a real image rather than add a new shape)."""
    if a is None or a.shape[axis] == size:
        return a
    last = np.take(a, [-1], axis=axis)
    return np.concatenate([a, np.repeat(last, size - a.shape[axis], axis=axis)], axis=axis)


class BatchPut:
    """Places per-image host arrays on the mesh, padded to ``size`` rows and split over its data
    axis (``ids=True``: token ids, (encoders, N, tokens), whose images are axis 1)."""

    def __init__(self, mesh, size: int):
        self.size = size
        self.rows = meshlib.batch_sharded(mesh)
        self.ids_rows = jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(None, meshlib.DATA))

    def __call__(self, a, ids: bool = False):
        if a is None:
            return None
        sharding = self.ids_rows if ids else self.rows
        return jax.device_put(pad_rows(np.asarray(a), self.size, 1 if ids else 0), sharding)

    def tree(self, tree):
        """A pytree of per-image arrays (a batch of scheduler states), each placed as a row."""
        return jax.device_put(jax.tree.map(lambda a: pad_rows(np.asarray(a), self.size), tree),
                              self.rows)


def host_images(out, n: int, output_type: str) -> Sequence:
    """The first ``n`` images of a program's pixels on the host: PIL images for ``"pil"``, else
    the array (uint8 or float32 [0, 1]) as the program made it. Waits for the device."""
    images = np.asarray(jax.device_get(out))[:n]
    if output_type == "pil":
        from PIL import Image

        return [Image.fromarray(im) for im in images]
    return images
