"""``maxdiff convert``: a checkpoint to another dtype, a diffusers folder to a single file
and back, or its UNet quantized."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from pipelines.cli.common import _json_file, _log, _usage_errors
from pipelines.cli.lines import InputError
from pipelines.cli.output import TMP_MARK

# ---------------------------------------------------------------------------------- convert
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json",
                    ".ckpt", ".pt", ".pth", ".msgpack", ".h5", ".onnx")


def cmd_convert(args) -> int:
    from maxdiff.checkpoint import SafetensorsFile, open_weights, resolve_dtype, save_safetensors
    from maxdiff.hub import resolve

    with _usage_errors():  # a Hugging Face model name: its snapshot in the local cache
        src = resolve(args.src)
    dst = Path(args.dst)
    if dst.exists() and not args.force:
        raise InputError([f"DST {dst} exists; pass --force to replace it"])
    if src.is_file() or dst.suffix == ".safetensors":
        if args.quantize:
            raise InputError([f"--quantize writes a folder from a folder; {src} -> {dst} is "
                              "not one (convert to a diffusers folder first)"])
        return _convert_single_file(args, src, dst)
    with _usage_errors():
        dtype = resolve_dtype(args.dtype or "bfloat16")
        if not (src / "model_index.json").is_file():
            raise InputError([f"SRC {src}: not a diffusers pipeline folder (no model_index.json)"])
        if dst.resolve() == src.resolve():
            raise InputError(["SRC and DST are the same folder"])
        components = {k for k, v in _json_file(src / "model_index.json").items()
                      if isinstance(v, list) and (src / k).is_dir()}
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}{TMP_MARK}-{os.getpid()}"
    t0, total = time.perf_counter(), 0
    try:
        for folder, _, files in os.walk(src):
            rel = Path(folder).relative_to(src)
            (tmp / rel).mkdir(parents=True, exist_ok=True)
            weights = sorted(f for f in files if f.endswith(_WEIGHT_SUFFIXES))
            for f in sorted(set(files) - set(weights)):
                shutil.copy2(Path(folder) / f, tmp / rel / f)
            if not weights:
                continue
            if len(rel.parts) != 1 or rel.parts[0] not in components:
                _log(f"skipping {', '.join(str(rel / w) for w in weights)}: "
                     "not a component's weights")
                continue
            if args.quantize and rel.parts[0] == "unet":
                total += _quantize_unet(src / "unet", tmp / "unet", args.quantize, dtype)
                continue
            with _usage_errors():
                source = open_weights(folder)  # safetensors only; single, fp16 variant or shards
            names = [Path(p).name for p in source.files]
            stem = ("diffusion_pytorch_model"
                    if any(n.startswith("diffusion_pytorch_model") for n in names) else "model")
            out = tmp / rel / f"{stem}.safetensors"
            meta = {"format": "pt", "maxdiff_dtype": str(dtype)}
            nbytes = save_safetensors({k: source.lazy(k, dtype) for k in source.keys()}, out, meta)
            SafetensorsFile(out)  # re-read the header: a bad file fails here, not at load time
            total += nbytes
            _log(f"{rel}: {len(source.keys())} tensors from {source.describe()} -> "
                 f"{out.name} ({nbytes / 2**20:.1f} MiB {dtype})")
        if dst.exists():
            old = dst.parent / f".{dst.name}{TMP_MARK}-old-{os.getpid()}"
            os.replace(dst, old)
            os.replace(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log(f"wrote {dst} ({total / 2**20:.1f} MiB of weights, {dtype}) in "
         f"{time.perf_counter() - t0:.1f}s")
    return 0


def _quantize_unet(src: Path, out: Path, mode: str, dtype) -> int:
    """``src`` (a diffusers unet/ folder) quantized to ``mode`` into ``out`` (its config
    already copied there): the weights file and the config key naming the mode."""
    from maxdiff import quantization as quantlib
    from maxdiff.loaders import load_unet

    with _usage_errors():
        config = _json_file(out / "config.json")
        if quantlib.CONFIG_KEY in config:
            raise InputError([f"{src}: its UNet is quantized already "
                              f"({config[quantlib.CONFIG_KEY]})"])
        model, params = load_unet(src, "float32", config=config)
        model, params = quantlib.quantize(model, params, mode)
    nbytes = quantlib.save_quantized(params, out / quantlib.WEIGHTS_FILE, mode, float_dtype=dtype)
    del params
    (out / "config.json").write_text(json.dumps({**config, quantlib.CONFIG_KEY: mode}, indent=2)
                                     + "\n")
    _log(f"unet: quantized to {mode} -> {quantlib.WEIGHTS_FILE} ({nbytes / 2**20:.1f} MiB; "
         f"its other weights {dtype})")
    return nbytes


def _convert_single_file(args, src: Path, dst: Path) -> int:
    """folder -> single file, or single file -> folder (:mod:`maxdiff.single_file`)."""
    from maxdiff import single_file

    t0 = time.perf_counter()
    with _usage_errors():
        if dst.resolve() == src.resolve():
            raise InputError(["SRC and DST are the same"])
        if src.is_file():
            if dst.suffix == ".safetensors":
                raise InputError([f"SRC {src} is already a single file; DST must be a folder"])
            single_file.to_folder(src, dst, config=args.single_file_config, dtype=args.dtype,
                                  vae=args.vae)
            _log(f"wrote {dst} (diffusers folder) in {time.perf_counter() - t0:.1f}s")
            return 0
        if not (src / "model_index.json").is_file():
            raise InputError([f"SRC {src}: not a diffusers pipeline folder (no model_index.json) "
                              "nor a single file"])
        dst.parent.mkdir(parents=True, exist_ok=True)
        size = single_file.export(src, dst, dtype=args.dtype)
    _log(f"wrote {dst} ({size / 2**20:.1f} MiB, original single-file layout) in "
         f"{time.perf_counter() - t0:.1f}s")
    return 0
