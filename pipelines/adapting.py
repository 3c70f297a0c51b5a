"""LoRA adapters on a loaded model: fused into its weights (``load_lora_weights``, as diffusers'
``load_lora_weights`` + ``fuse_lora``), or kept unfused for the images that ask for them by
name (``add_adapter``: per-image adapters, :mod:`maxdiff.adapters`). A mixin of
:class:`pipelines.TextToImagePipeline`, whose ``params``, ``_base_params``, ``_loras``,
``_adapters`` and ``_adapter_tables`` it keeps."""

from __future__ import annotations

import os

import jax
import numpy as np

from maxdiff import adapters as adapterlib
from maxdiff import mesh as meshlib
from maxdiff import quantization as quantlib

__all__ = ["LoraAdapters"]


def _scale_problem(scale) -> str | None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) \
            or not np.isfinite(scale):
        return f"scale={scale!r}; it must be a finite number"
    return None


class LoraAdapters:
    """Fused LoRAs and per-image adapters (see the module's docstring)."""

    def load_lora_weights(self, path: str | os.PathLike, adapter_name: str | None = None,
                          scale: float = 1.0) -> str:
        """Fuse a LoRA adapter (a ``.safetensors`` file, or a folder holding
        ``pytorch_lora_weights.safetensors``) into the UNet and text encoder weights: each
        adapted weight becomes ``w + scale * alpha / r * up @ down``, computed in float32 and
        cast back to the pipeline's dtype, as diffusers' ``load_lora_weights`` +
        ``fuse_lora(lora_scale=scale)`` gives it. diffusers/PEFT and kohya files are read
        (:mod:`maxdiff.lora`). Several calls stack. The compiled programs are kept (the weights
        are an input of the program, and their shapes and dtypes do not change). The original
        arrays are kept while an adapter is loaded, so the adapted weights take twice their
        memory. Returns the adapter's name (``adapter_name``, or ``default_N``)."""
        from maxdiff import lora

        if (problem := quantlib.lora_problem(self.quantization)) is not None:
            raise ValueError(problem)
        if (problem := _scale_problem(scale)) is not None:
            raise ValueError(problem)
        names = [n for n, *_ in self._loras]
        if adapter_name is None:
            k = len(names)
            while f"default_{k}" in names:
                k += 1
            adapter_name = f"default_{k}"
        elif adapter_name in names:
            raise ValueError(f"adapter_name={adapter_name!r} is already loaded; unload it first "
                             "or choose another name")
        base = self._base_params if self._base_params is not None else self.params
        layers = lora.read_lora(path, base, unet_config=self.unet.config)
        loras = self._loras + [(adapter_name, str(lora.lora_file(path)), float(scale), layers)]
        self.params = lora.fuse_loras(base, [(ls, s) for _, _, s, ls in loras])
        self._base_params, self._loras = base, loras
        return adapter_name

    def unload_lora_weights(self, adapter_name: str | None = None) -> None:
        """Remove every LoRA adapter (``adapter_name=None``: the original weights come back,
        the very arrays loaded), or only the named one (the others are fused again onto the
        original weights)."""
        from maxdiff import lora

        if adapter_name is not None and adapter_name not in [n for n, *_ in self._loras]:
            raise ValueError(f"no LoRA adapter named {adapter_name!r} is loaded (loaded: "
                             f"{[n for n, *_ in self._loras] or 'none'})")
        if self._base_params is None:
            return
        keep = [x for x in self._loras if adapter_name is not None and x[0] != adapter_name]
        if keep:
            self.params = lora.fuse_loras(self._base_params, [(ls, s) for _, _, s, ls in keep])
            self._loras = keep
        else:
            self.params, self._base_params, self._loras = self._base_params, None, []

    def add_adapter(self, name: str, path: str | os.PathLike, scale: float = 1.0) -> int:
        """Preload a LoRA adapter *unfused*, for images that ask for it by ``name``
        (``ImageRequest(adapter=name)``); the weights stay as they are. Only its low-rank factors
        are kept (memory about the file's size, never a copy of the model), stacked with the
        other adapters' into zero-padded per-layer tables (:mod:`maxdiff.adapters`). In the
        compiled program each adapted projection (UNet linear and conv layers, both text
        encoders' linear layers) adds each image's own ``scale * alpha / r * up @ down`` update
        (index 0 = no adapter); the index is a traced input, so images with different adapters
        and none share one device batch and one program. Adding an adapter changes the tables'
        shapes: programs compiled before are compiled again on their next use (add adapters
        before warming up). Returns the adapter's index (1, 2, ...)."""
        from maxdiff import lora

        if (problem := quantlib.lora_problem(self.quantization, "per-image adapters")) is not None:
            raise ValueError(problem)
        if not isinstance(name, str) or not name:
            raise ValueError(f"adapter name {name!r}; give a non-empty string")
        if name in [n for n, *_ in self._adapters]:
            raise ValueError(f"an adapter named {name!r} is already added (added: "
                             f"{', '.join(n for n, *_ in self._adapters)})")
        if (problem := _scale_problem(scale)) is not None:
            raise ValueError(problem)
        base = self._base_params if self._base_params is not None else self.params
        layers = lora.read_lora(path, base, unet_config=self.unet.config)
        entries = self._adapters + [(name, str(lora.lora_file(path)), float(scale), layers)]
        dtype = jax.tree_util.tree_leaves(base["unet"])[0].dtype
        tables = adapterlib.build_tables([(n, ls, s) for n, _, s, ls in entries], dtype=dtype,
                                         put=lambda a: jax.device_put(
                                             a, meshlib.replicated(self.mesh)))
        self._adapters, self._adapter_tables = entries, tables
        return len(entries)

    def remove_adapters(self) -> None:
        """Drop every adapter added with :meth:`add_adapter` (the no-adapter programs run
        again)."""
        self._adapters, self._adapter_tables = [], None

    @property
    def adapters(self) -> list[dict]:
        """The adapters added with :meth:`add_adapter`, in index order (1, 2, ...): name,
        file, scale, layers adapted and largest rank."""
        return [{"name": n, "path": p, "scale": s, "layers": len(ls),
                 "rank": max(x.rank for x in ls)} for n, p, s, ls in self._adapters]

    @property
    def adapter_tables(self):
        """The per-image adapters' stacked low-rank tables (:class:`maxdiff.adapters.AdapterTables`,
        a program input: ``adapter_tables.as_tree()``), or None when none is added."""
        return self._adapter_tables

    def adapter_index(self, items) -> np.ndarray | None:
        """Each item's adapter index (int32 (N,), 0: none; the program input that picks each
        image's rows of :attr:`adapter_tables`), or None when no adapter is added. ValueError
        naming the item and the added adapters when an item names one that is not added."""
        names = {n: k for k, (n, *_) in enumerate(self._adapters, start=1)}
        out = []
        for k, it in enumerate(items):
            a = getattr(it, "adapter", None)
            if a is not None and a not in names:
                where = f"item {k}: " if k else ""
                raise ValueError(f"{where}adapter={a!r} is not added; added adapters: "
                                 f"{', '.join(names) or 'none (see add_adapter)'}")
            out.append(0 if a is None else names[a])
        return None if self._adapter_tables is None else np.asarray(out, np.int32)

    @property
    def lora_adapters(self) -> list[dict]:
        """The fused LoRA adapters, in loading order: name, file, scale and layer count."""
        return [{"name": n, "path": p, "scale": s, "layers": len(ls)}
                for n, p, s, ls in self._loras]
