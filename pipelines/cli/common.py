"""What the CLI's commands share: usage errors and logging, signals, the run config a
command's flags make, and checks of paths and files."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from pathlib import Path
from typing import Any

from pipelines.cli.lines import InputError
from pipelines.cli.parser import PROG


# ---------------------------------------------------------------------------------- helpers
class Interrupted(BaseException):
    """A termination signal arrived (a BaseException, so no `except Exception` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _on_signal(signum, frame):
    signal.signal(signum, signal.SIG_DFL)  # a second signal ends the process at once
    raise Interrupted(signum)


@contextlib.contextmanager
def _usage_errors():
    """Errors while reading arguments, configs and models are the user's to fix: exit 2."""
    try:
        yield
    except InputError:
        raise
    except (ValueError, FileNotFoundError) as e:
        raise InputError([str(e)]) from e


def _log(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(f"{PROG}: {msg}", file=sys.stderr)


def _run_config(args, **extra: Any):
    """The run config: --config, then --set overrides, then explicit flags."""
    from pipelines.config import load_run_config

    cfg = load_run_config(args.config, args.set)
    flags = dict(model=args.model, unet=args.unet, vae=args.vae,
                 single_file_config=args.single_file_config, scheduler=args.scheduler,
                 dtype=args.dtype, quantization=args.quantization, devices=args.devices,
                 loras=getattr(args, "lora", None) or None,
                 embeddings=getattr(args, "embedding", None) or None,
                 revision=getattr(args, "revision", None), variant=getattr(args, "variant", None),
                 refiner=getattr(args, "refiner", None),
                 ip_adapter=getattr(args, "ip_adapter", None),
                 ip_adapter_image_encoder=getattr(args, "ip_adapter_encoder", None),
                 ip_adapter_scale=getattr(args, "ip_adapter_scale", None),
                 high_noise_frac=getattr(args, "high_noise_frac", None), **extra)
    flags = {k: v for k, v in flags.items() if v is not None}
    if flags:
        cfg = cfg.replace(**flags)
    model = _model_path(cfg.model, cfg.revision, cfg.variant)
    unet = _existing(cfg.unet, "unet", "--unet", file=True)
    vae = _existing(cfg.vae, "vae", "--vae")
    single_file_config = _existing(cfg.single_file_config, "single_file_config",
                                  "--single-file-config", folder=True)
    refiner = _existing(cfg.refiner, "refiner", "--refiner")  # a folder or a single file
    ip_adapter = _existing(cfg.ip_adapter, "ip_adapter", "--ip-adapter", file=True)
    ip_encoder = _existing(cfg.ip_adapter_image_encoder, "ip_adapter_image_encoder",
                           "--ip-adapter-encoder", folder=True)
    loras = _existing_specs(cfg.loras, "lora", "--lora PATH[:SCALE]", "loras")
    embeddings = _existing_specs(cfg.embeddings, "embedding", "--embedding PATH[:TOKEN]",
                                 "embeddings")
    return cfg.replace(model=str(model), unet=unet, vae=vae,
                       single_file_config=single_file_config, loras=loras,
                       embeddings=embeddings, refiner=refiner, ip_adapter=ip_adapter,
                       ip_adapter_image_encoder=ip_encoder)


def _existing_specs(specs, what: str, flag: str, key: str) -> tuple:
    """``specs`` (LoRAs, embeddings) with absolute paths, or an error naming the one whose file
    or folder is missing, its flag and its config key."""
    out = []
    for spec in specs:
        path = Path(spec.path).expanduser()
        if not path.exists():
            raise InputError([f"{what} {spec.path}: no such file or folder ({flag} / config "
                              f"key '{key}')"])
        out.append(spec.replace(path=str(path.resolve())))
    return tuple(out)


def _model_path(model: str | None, revision: str | None = None,
                variant: str | None = None) -> Path:
    if model is None:
        from pipelines.default_model import default_model_path

        return default_model_path().resolve()  # FileNotFoundError names the path: exit 2
    from maxdiff.hub import resolve

    try:  # a Hugging Face name (org/name): its snapshot in the local cache, or downloaded
        path = resolve(model, revision=revision, variant=variant)
    except ValueError as e:
        raise InputError([f"{e} (--model / config key 'model')"]) from None
    if path.is_file():
        return path.resolve()  # a single file: the loader recognises it or says what it is
    if not path.is_dir():
        raise InputError([f"model {model}: no such folder or file (--model / config key "
                          "'model')"])
    if not (path / "model_index.json").is_file():
        raise InputError([f"model {model}: not a diffusers SDXL pipeline folder "
                          "(no model_index.json)"])
    return path.resolve()


def _existing(value: str | None, key: str, flag: str, *, file: bool = False,
              folder: bool = False) -> str | None:
    """``value`` as an absolute path, or an error naming the flag and config key."""
    if not value:
        return None
    path = Path(value).expanduser()
    if not file:  # a folder may be a Hugging Face name (org/name): its cached snapshot
        from maxdiff.hub import resolve

        try:
            path = resolve(value, weights=key != "single_file_config")
        except ValueError as e:
            raise InputError([f"{e} ({flag} / config key '{key}')"]) from None
    ok = path.is_file() if file else path.is_dir() if folder else path.exists()
    if not ok:
        kind = "file" if file else "folder" if folder else "file or folder"
        raise InputError([f"{key} {value}: no such {kind} ({flag} / config key '{key}')"])
    return str(path.resolve())


def _json_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _step_limit(cfg) -> tuple[int, str] | None:
    """(most steps, scheduler name) of the run's scheduler, from its config alone (no weights);
    None where it cannot be read here (then loading reports the problem)."""
    from maxdiff.schedulers import load_scheduler, max_inference_steps

    model = Path(cfg.model) / "scheduler"
    try:  # a sampler name (dpmpp_2m_karras) changes the model's own scheduler config
        sched = load_scheduler(cfg.scheduler or model, base=model)
    except Exception:
        return None
    return max_inference_steps(sched), type(sched).__name__


def _vae_factor(model: Path) -> int | None:
    blocks = _json_file(model / "vae" / "config.json").get("block_out_channels")
    return 2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else None
