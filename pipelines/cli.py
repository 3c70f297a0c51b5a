"""The ``maxdiff`` command line: ``generate`` images from prompts, ``info`` on a model,
``convert`` a checkpoint to a dtype.

``maxdiff generate`` validates every prompt line before it loads anything, groups images by
shape (size, steps, guidance on/off) so each compiled program is reused, fills device batches
across prompts with :meth:`TextToImagePipeline.generate`, and writes each image atomically with
a ``metadata.jsonl`` line; rerunning the same command resumes (see ``pipelines/batch.py``).

Exit codes: 0 done, 1 runtime failure, 2 bad usage or input, 128+N killed by signal N (143 for
SIGTERM, 130 for Ctrl-C); an interrupted run keeps every finished image.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from maxdiff.quantization import MODES as QUANTIZATION_MODES
from pipelines.batch import (MAX_IMAGES_PER_LINE, METADATA, TMP_MARK, InputError, OutputDir,
                             RunSettings, check_size, load_control_image, load_edit_inputs,
                             plan_jobs, read_prompts)
from pipelines.limits import (CONTROL_SCALE_MAX, MAX_SEED, STRENGTH, denoising_fraction_problem,
                              guidance_problem, n_problem, seed_problem, steps_problem)
from pipelines.requests import (FORMATS, ControlImage, ControlKey, EditKey, pad_to, parse_size,
                                plan_batches)

PROG = "maxdiff"

GENERATE_EXAMPLES = """\
examples:
  maxdiff generate "a red fox in the snow" "a lighthouse at dusk" --model /models/sdxl-base \\
      --steps 30 --seed 7 --out out/foxes
  maxdiff generate --prompts prompts.txt --num-images 4 --batch-size 8 --size 1024x768
  maxdiff generate --prompts jobs.jsonl --config sdxl-lightning-4step \\
      --set model=/models/sdxl-base --set unet=/models/sdxl_lightning_4step_unet.safetensors
  maxdiff generate "a watercolor fox" --image fox.png --strength 0.6
  maxdiff generate "a red hat" --image fox.png --mask hat-mask.png   # inpaint the white part
  maxdiff generate "a golden statue" --controlnet canny=/models/controlnet-canny-sdxl-1.0 \\
      --control-image edges.png:canny:0.5 --control-guidance-end 0.8
  maxdiff generate "a lighthouse at dusk" --model /models/sdxl-base \\
      --refiner /models/sdxl-refiner --high-noise-frac 0.8   # base 80 %, refiner the rest

prompt files: one prompt per line, or (.jsonl) one JSON object per line with "prompt" and any
of "negative_prompt", "seed", "steps", "guidance", "size" ("WxH"), "n" (images of that line),
"image", "mask", "strength" (an edit), "control_images" (ControlNet: a list of {"image",
"controlnet" (a --controlnet name or folder), "scale", "start", "end", "guess_mode"}); paths
relative to the JSONL file's folder:
  {"prompt": "a red fox", "seed": 7, "n": 2}
  {"prompt": "a lighthouse", "negative_prompt": "blurry", "size": "1024x768", "steps": 20}
  {"prompt": "a red hat", "image": "fox.png", "mask": "hat-mask.png", "strength": 0.9}
  {"prompt": "a statue", "control_images": [{"image": "edges.png", "controlnet": "canny"}]}
Blank lines and lines starting with # are skipped. Every line is checked before anything is
generated; a bad line stops the run with exit status 2 and its file:line and field.

output: OUT/00000-00-a-red-fox-<id>.png (line, image of the line, prompt, settings hash) and
OUT/metadata.jsonl (prompt, seed, settings, file, time); PNGs also carry the settings as text
chunks. Rerunning the same command skips every image already written. Without --seed a run
seed is drawn (and reused from OUT/metadata.jsonl when resuming); per-image seeds are a hash
of (run seed, line, image), so adding lines never changes existing images. A line's "seed"
gives its images seed, seed+1, ... like the Python API.
"""


# ---------------------------------------------------------------------------------- arguments
def _int_at_least(lo: int, hi: int | None = None):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < lo or (hi is not None and v > hi):
            rng = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be an integer {rng}, got {text!r}")
        return v
    return parse


def _rule(check, convert=int):
    """An argument type from a :mod:`pipelines.limits` rule: argparse reports its message."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = text
        problem = check(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(f"{problem.message}, got {text!r}")
        return value
    return parse


def _size(text: str) -> tuple[int, int]:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=fmt,
        description="Text-to-image with SDXL-family models in JAX.",
        epilog="run `maxdiff COMMAND --help` for a command's options and examples")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    model = argparse.ArgumentParser(add_help=False)
    g = model.add_argument_group("model and run config")
    g.add_argument("--config", metavar="NAME|FILE",
                   help="run config: a YAML file or a name in configs/ (sdxl-base, "
                        "sdxl-lightning-4step, ...); flags below override it")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key (repeatable), e.g. --set attention=chunked")
    g.add_argument("--model", metavar="DIR|FILE",
                   help="diffusers SDXL folder, or a single-file SDXL checkpoint (.safetensors "
                        "as A1111/ComfyUI use) (default: the embedded model, or "
                        "$MAXDIFF_DEFAULT_MODEL)")
    g.add_argument("--single-file-config", metavar="DIR",
                   help="diffusers folder whose config.json files describe a single-file "
                        "--model (default: the SDXL base configs maxdiff ships)")
    g.add_argument("--unet", metavar="FILE", help="single-file UNet replacing the model's "
                   "(SDXL-Lightning)")
    g.add_argument("--vae", metavar="FILE|DIR", help="VAE replacing the model's: a file "
                   "(sdxl_vae.safetensors) or a diffusers VAE folder")
    g.add_argument("--scheduler", metavar="NAME",
                   help="preset (lightning-1step/2step/4step/8step) or a scheduler config "
                        "file/folder")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"])
    g.add_argument("--quantization", choices=QUANTIZATION_MODES,
                   help="the UNet's transformer linear layers in int8 (weights only, or weights "
                        "and activations) or fp8, through qwix (default none; no --lora with it)")
    g.add_argument("--lora", action="append", metavar="PATH[:SCALE]",
                   help="LoRA adapter fused into the weights (diffusers/PEFT or kohya "
                        ".safetensors; scale default 1); repeatable, applied in order")
    g.add_argument("--refiner", metavar="DIR",
                   help="SDXL refiner folder that finishes every text-to-image image "
                        "(diffusers' base + refiner, one program; edits run the base alone)")
    g.add_argument("--high-noise-frac", type=_rule(denoising_fraction_problem, float),
                   metavar="F", help="where the refiner takes over, a fraction of the noise "
                                     "schedule in (0, 1) (default 0.8: the base runs 80 %%)")
    g.add_argument("--devices", type=_int_at_least(1), metavar="N",
                   help="use the first N local devices (default: all)")

    gen = sub.add_parser("generate", parents=[model], formatter_class=fmt,
                         help="generate images from prompts (resumable)",
                         description="Generate images from prompts given as arguments or in a "
                                     "file; rerun the same command to resume.",
                         epilog=GENERATE_EXAMPLES)
    gen.add_argument("prompt", nargs="*", help="prompts (each makes --num-images images)")
    gen.add_argument("--prompts", metavar="FILE",
                     help="text file (one prompt a line) or .jsonl with per-line settings; "
                          "- for stdin")
    gen.add_argument("--steps", type=_rule(steps_problem), metavar="N", help="denoising steps")
    gen.add_argument("--guidance", type=_rule(guidance_problem, float), metavar="G",
                     help="classifier-free guidance scale (<= 1: off, one UNet pass per step)")
    gen.add_argument("--negative", metavar="TEXT", help="negative prompt for every line")
    gen.add_argument("--size", type=_size, metavar="WxH", help="image size, e.g. 1024x768")
    gen.add_argument("--seed", type=_rule(lambda v: seed_problem(v, optional=False)), metavar="S",
                     help="run seed: makes the whole run reproducible")
    gen.add_argument("--num-images", type=_rule(lambda v: n_problem(v, MAX_IMAGES_PER_LINE)),
                     default=1, metavar="N",
                     help="images per prompt (default 1)")
    gen.add_argument("--batch-size", type=_int_at_least(1), default=4, metavar="B",
                     help="images per device batch (default 4; padded up to a power of two "
                          "times the device count)")
    gen.add_argument("--image", metavar="FILE",
                     help="edit this image (PNG/JPEG/WebP) instead of starting from noise: "
                          "image-to-image, or inpainting with --mask; the size defaults to "
                          "the image's")
    gen.add_argument("--mask", metavar="FILE",
                     help="inpainting mask of the image's size: white = repaint, black = keep "
                          "(a mask with transparent pixels: transparent = repaint)")
    gen.add_argument("--strength", type=float, metavar="S",
                     help="edit strength in (0, 1]: int(steps * S) denoising steps run "
                          f"(default {STRENGTH['img2img']}, {STRENGTH['inpaint']} with --mask)")
    gen.add_argument("--control-image", action="append", default=[],
                     metavar="PATH[:MODEL[:SCALE]]",
                     help="ControlNet text-to-image: a control image (edges, depth, pose, ...) "
                          "read by the ControlNet MODEL (a --controlnet name, a diffusers "
                          "ControlNet folder or a .safetensors file; may be left out with one "
                          "--controlnet) at "
                          f"conditioning scale SCALE in [0, {CONTROL_SCALE_MAX:g}] (default 1); "
                          "repeatable: several ControlNets, residuals summed. The size "
                          "defaults to the first control image's")
    gen.add_argument("--controlnet", action="append", default=[], metavar="NAME=PATH",
                     help="name a ControlNet (a diffusers folder, or a .safetensors file: "
                          "without its config.json it takes the model UNet's) for "
                          "--control-image and JSONL lines' control_images (repeatable)")
    gen.add_argument("--control-guidance-start", type=float, metavar="A",
                     help="the ControlNets act from this fraction of the steps (default 0)")
    gen.add_argument("--control-guidance-end", type=float, metavar="B",
                     help="... to this one (default 1; 0 <= A < B <= 1)")
    gen.add_argument("--control-guess-mode", action="store_true",
                     help="diffusers' guess mode for the control images (A1111's \"ControlNet "
                          "is more important\"; a JSONL entry's guess_mode overrides it)")
    gen.add_argument("--out", default="out", metavar="DIR", help="output folder (default out/)")
    gen.add_argument("--format", choices=sorted(FORMATS), default="png")
    gen.add_argument("--quiet", action="store_true", help="no progress bar, plain log lines only")

    info = sub.add_parser("info", parents=[model], formatter_class=fmt,
                          help="show a model's components, parameter counts, dtypes, devices",
                          epilog="example:\n  maxdiff info --model /models/sdxl-base")
    info.add_argument("--json", action="store_true", help="print one JSON object")

    conv = sub.add_parser(
        "convert", formatter_class=fmt,
        help="rewrite a checkpoint: another dtype, or single file <-> diffusers folder",
        description="Rewrite a checkpoint, tensor by tensor, into a temporary path renamed to "
                    "DST at the end:\n"
                    "  folder -> folder: every component's weights as one safetensors file "
                    "cast to --dtype (default bfloat16; diffusers keys and layouts kept)\n"
                    "  folder -> FILE.safetensors: one file in the original Stability layout "
                    "(what A1111, ComfyUI and diffusers' from_single_file read)\n"
                    "  FILE.safetensors -> folder: a diffusers folder (configs from "
                    "--single-file-config or the shipped SDXL base ones)\n"
                    "  folder -> folder with --quantize: the UNet's weights quantized as "
                    "from_pretrained(quantization=) does, stored quantized (maxdiff loads the "
                    "folder with that quantization; diffusers cannot read its UNet)",
        epilog="examples:\n"
               "  maxdiff convert /models/sdxl-base /models/sdxl-base-bf16 --dtype bf16\n"
               "  maxdiff convert /models/sdxl-base /models/sdxl-base-int8 --quantize int8\n"
               "  maxdiff convert /models/sdxl-base /models/sdxl-base.safetensors --dtype fp16\n"
               "  maxdiff convert /models/juggernaut-xl.safetensors /models/juggernaut-xl")
    conv.add_argument("src", metavar="SRC", help="diffusers SDXL folder or single file")
    conv.add_argument("dst", metavar="DST",
                      help="new folder, or a .safetensors file (must not exist unless --force)")
    conv.add_argument("--dtype", default=None,
                      choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"],
                      help="weight dtype (default: bfloat16 folder to folder, else as stored)")
    conv.add_argument("--single-file-config", metavar="DIR",
                      help="diffusers folder whose configs describe a single-file SRC")
    conv.add_argument("--vae", metavar="FILE",
                      help="VAE file for a single-file SRC that holds none")
    conv.add_argument("--quantize", choices=[m for m in QUANTIZATION_MODES if m != "none"],
                      help="folder to folder: store the UNet's transformer linear layers "
                           "quantized (int8 / float8 values and float32 scales, computed from "
                           "its float32 weights); its other weights in --dtype")
    conv.add_argument("--force", action="store_true", help="replace DST if it exists")
    return parser


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
                 refiner=getattr(args, "refiner", None),
                 high_noise_frac=getattr(args, "high_noise_frac", None), **extra)
    flags = {k: v for k, v in flags.items() if v is not None}
    if flags:
        cfg = cfg.replace(**flags)
    model = _model_path(cfg.model)
    unet = _existing(cfg.unet, "unet", "--unet", file=True)
    vae = _existing(cfg.vae, "vae", "--vae")
    single_file_config = _existing(cfg.single_file_config, "single_file_config",
                                  "--single-file-config", folder=True)
    refiner = _existing(cfg.refiner, "refiner", "--refiner", folder=True)
    loras = []
    for spec in cfg.loras:
        path = Path(spec.path).expanduser()
        if not path.exists():
            raise InputError([f"lora {spec.path}: no such file or folder (--lora PATH[:SCALE] / "
                              "config key 'loras')"])
        loras.append(spec.replace(path=str(path.resolve())))
    return cfg.replace(model=str(model), unet=unet, vae=vae,
                       single_file_config=single_file_config, loras=tuple(loras),
                       refiner=refiner)


def _model_path(model: str | None) -> Path:
    if model is None:
        from pipelines.default_model import default_model_path

        return default_model_path().resolve()  # FileNotFoundError names the path: exit 2
    path = Path(model).expanduser()
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

    try:
        sched = load_scheduler(cfg.scheduler or Path(cfg.model) / "scheduler")
    except Exception:
        return None
    return max_inference_steps(sched), type(sched).__name__


def _vae_factor(model: Path) -> int | None:
    blocks = _json_file(model / "vae" / "config.json").get("block_out_channels")
    return 2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else None


def _pipelines(pipe, jobs):
    """The pipelines the jobs need (:class:`pipelines.dispatch.Pipelines`), with every
    ControlNet the ControlNet jobs use loaded once (its arrays shared by the sets); a
    ControlNet that cannot be loaded, or is made for another model, is exit status 2."""
    from pipelines.dispatch import Pipelines

    paths = dict.fromkeys(p for j in jobs if isinstance(j.shape, ControlKey)
                          for p in j.shape.controlnets)
    loaded = {}
    if paths:
        from pipelines.controlnet import ControlNetPipeline

        for path in paths:
            try:
                one = ControlNetPipeline.from_pipe(pipe, controlnet=path)  # checks it fits
            except (ValueError, OSError) as e:
                raise InputError([f"ControlNet {path}: {e} (--control-image / --controlnet / "
                                  "control_images)"]) from None
            loaded[path] = (one.controlnets[0], one.controlnet_params[0])
    return Pipelines(pipe, loaded)


# ---------------------------------------------------------------------------------- generate
def cmd_generate(args) -> int:
    from tqdm import tqdm

    from maxdiff.checkpoint import resolve_dtype
    from pipelines.text_to_image import TextToImagePipeline

    with _usage_errors():
        errors, cfg = [], None  # gather config, model and prompt problems into one report
        size = dict(width=args.size[0], height=args.size[1]) if args.size else {}
        try:
            with _usage_errors():
                cfg = _run_config(args, steps=args.steps, guidance=args.guidance, **size)
        except InputError as e:
            errors += e.errors
        factor = _vae_factor(Path(cfg.model)) if cfg else None
        if cfg and cfg.width is not None and cfg.height is not None:
            try:
                check_size((cfg.width, cfg.height), factor)
            except ValueError as e:
                errors.append(f"{'--size' if args.size else 'config size'}: {e}")
        steps_limit = _step_limit(cfg) if cfg else None
        if steps_limit and cfg.steps is not None and (p := steps_problem(
                cfg.steps, steps_limit[0], f"what {steps_limit[1]} allows")) is not None:
            errors.append(f"{'--steps' if args.steps else 'config steps'}: {p.message}, got "
                          f"{cfg.steps}")
        try:
            lines = read_prompts(args.prompt, args.prompts, factor=factor,
                                 steps_limit=steps_limit, image=args.image, mask=args.mask,
                                 strength=args.strength, size=args.size,
                                 steps=cfg.steps if cfg else None,
                                 control_images=args.control_image, controlnets=args.controlnet,
                                 control_start=args.control_guidance_start,
                                 control_end=args.control_guidance_end,
                                 control_guess_mode=args.control_guess_mode)
        except InputError as e:
            errors += e.errors
        if errors:
            raise InputError(errors)
        out = OutputDir(args.out)
        out.prepare()
        records = out.records()
        if args.seed is not None:
            run_seed = args.seed
        elif records and isinstance(records[-1].get("run_seed"), int):
            run_seed = records[-1]["run_seed"]
            _log(f"resuming with run seed {run_seed} from {out.metadata} (--seed picks another)")
        else:
            run_seed = secrets.randbelow(MAX_SEED + 1)
            _log(f"run seed {run_seed} (pass --seed {run_seed} to reproduce this run)")
        t0 = time.perf_counter()
        pipe = TextToImagePipeline.from_config(cfg)
        scheduler = type(pipe.scheduler).__name__ + (f" ({cfg.scheduler})" if cfg.scheduler else "")
        settings = RunSettings(
            model=cfg.model, unet=cfg.unet, scheduler=scheduler,
            dtype=str(resolve_dtype(cfg.dtype)), steps=pipe.default_steps,
            quantization=None if cfg.quantization == "none" else cfg.quantization,
            guidance=float(pipe.default_guidance), width=pipe.default_width,
            height=pipe.default_height, run_seed=run_seed, negative_prompt=args.negative,
            num_images=args.num_images, format=args.format,
            lora=", ".join(f"{x.path}:{x.scale:g}" for x in cfg.loras) or None,
            refiner=f"{cfg.refiner}:{cfg.high_noise_frac:g}" if cfg.refiner else None)
        jobs = plan_jobs(lines, settings)
    done = out.done(records)
    todo = [j for j in jobs if j.id not in done]
    pipes = _pipelines(pipe, todo)
    _log(f"loaded {cfg.model} in {time.perf_counter() - t0:.1f}s on {pipe.mesh.size} device(s); "
         f"{len(lines)} prompt(s), {len(jobs)} image(s), {len(jobs) - len(todo)} already in "
         f"{out.path}, {len(todo)} to generate")

    bar = tqdm(total=len(todo), unit="img", file=sys.stderr, disable=args.quiet,
               dynamic_ncols=True, smoothing=0.1)
    t_start, shape, written = time.perf_counter(), None, 0
    try:
        for batch_shape, group, bucket in plan_batches(todo, lambda j: j.shape, args.batch_size,
                                                       pipe.mesh.size):
            edit = isinstance(batch_shape, EditKey)
            control = isinstance(batch_shape, ControlKey)
            h, w, steps, cfg_on = batch_shape[1:5] if edit or control else batch_shape
            if batch_shape != shape:
                shape = batch_shape
                desc = f"{w}x{h}, {steps} step(s), guidance {'on' if cfg_on else 'off'}"
                if edit:
                    desc = f"{batch_shape.kind} (strength {batch_shape.strength:g}) {desc}"
                if control:
                    desc = f"{len(batch_shape.controlnets)} ControlNet(s), {desc}"
                bar.set_postfix_str(desc)
                if args.quiet:
                    n = sum(j.shape == shape for j in todo)
                    _log(f"{desc}: {n} image(s), device batch {bucket} (first batch compiles)")
            items = pad_to([j.request() for j in group], bucket)  # one program per group
            if edit:
                extras = [load_edit_inputs(j.line.image, j.line.mask)
                          for j in pad_to(group, bucket)]
            elif control:
                files: dict[str, object] = {}  # each control image file read once a batch
                for j in group:
                    for c in j.line.controls:
                        if c.image not in files:
                            files[c.image] = load_control_image(c.image)
                extras = [[ControlImage(files[c.image], c.scale, c.start, c.end, c.guess_mode)
                           for c in j.line.controls] for j in pad_to(group, bucket)]
            else:
                extras = [None] * len(items)
            result = pipes.generate(batch_shape, items, extras)
            batch_s = result.timings["prepare_s"] + result.timings["generate_s"]
            seconds = round(batch_s / len(group), 4)
            for job, image in zip(group, result.images):
                out.write(job, image, seconds=seconds)
                written += 1
                bar.update(1)
    except BaseException:
        out.remove_temp_files()
        bar.close()
        _log(f"stopped after {written} new image(s); {len(jobs) - len(todo) + written} of "
             f"{len(jobs)} are in {out.path}. Rerun the same command to resume.")
        raise
    bar.close()
    took = time.perf_counter() - t_start
    rate = f", {len(todo) / took:.2f} img/s" if todo and took > 0 else ""
    _log(f"done: {len(todo)} new image(s) in {took:.1f}s{rate}; {len(jobs)} in {out.path} "
         f"(see {out.path / METADATA})")
    return 0


# ---------------------------------------------------------------------------------- info
COMPONENTS = ("unet", "vae", "text_encoder", "text_encoder_2")
CONFIG_KEYS = {
    "unet": ("sample_size", "in_channels", "block_out_channels", "transformer_layers_per_block",
             "cross_attention_dim", "addition_time_embed_dim"),
    "vae": ("block_out_channels", "latent_channels", "scaling_factor"),
    "text_encoder": ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
    "text_encoder_2": ("hidden_size", "num_hidden_layers", "projection_dim", "vocab_size"),
}


def cmd_info(args) -> int:
    import jax
    import numpy as np

    from maxdiff import quantization as quantlib, single_file
    from maxdiff.checkpoint import open_weights
    from pipelines.text_to_image import TextToImagePipeline, model_root

    with _usage_errors():
        cfg = _run_config(args)
        t0 = time.perf_counter()
        pipe = TextToImagePipeline.from_config(cfg)
        root, layout, _ = model_root(Path(cfg.model), cfg.single_file_config)
    load_s = time.perf_counter() - t0
    comps = {}
    for name in [c for c in COMPONENTS if c in pipe.params]:  # SD 1.x / 2.x: one encoder
        leaves = quantlib.weights(pipe.params[name])  # a quantized weight: its int8 values
        conf = _json_file(root / name / "config.json")
        replaced = {"unet": cfg.unet, "vae": cfg.vae}.get(name)
        if replaced:
            src = open_weights(replaced)
        elif layout is not None:
            src = single_file.component_source(layout, name, conf)
        else:
            src = open_weights(root / name)
        scope = getattr(src, "scope", "")
        stored = sorted({str(src.files[src.file_of(k)].dtype(k)) for k in src.keys()
                         if k.startswith(scope)})
        comps[name] = dict(
            parameters=int(sum(int(np.prod(x.shape)) for x in leaves)),
            dtype=sorted({str(x.dtype) for x in leaves}), stored_dtype=stored,
            weights=src.describe(), **{"class": conf.get("_class_name") or
                                       (conf.get("architectures") or ["?"])[0]},
            config={k: conf[k] for k in CONFIG_KEYS[name] if k in conf})
    devices = list(pipe.mesh.devices.flat)
    report = dict(
        model=cfg.model, format=(f"single file ({layout.family.title})" if layout
                                 else "diffusers folder"),
        configs=str(root) if layout else None, unet=cfg.unet, vae=cfg.vae,
        quantization=cfg.quantization,
        scheduler=type(pipe.scheduler).__name__,
        scheduler_preset=cfg.scheduler, default_steps=pipe.default_steps,
        default_guidance=pipe.default_guidance,
        default_size=f"{pipe.default_width}x{pipe.default_height}" if pipe.default_width else None,
        vae_scale_factor=pipe.vae_scale_factor, components=comps,
        total_parameters=sum(c["parameters"] for c in comps.values()),
        devices=[f"{d.platform}:{d.id} ({d.device_kind})" for d in devices],
        local_devices=len(jax.local_devices()), load_seconds=round(load_s, 2))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"model      {report['model']} ({report['format']})"
          + (f"\nconfigs    {root}" if layout else "")
          + (f"\nunet file  {cfg.unet}" if cfg.unet else "")
          + (f"\nvae        {cfg.vae}" if cfg.vae else "")
          + (f"\nquantized  {cfg.quantization} (the UNet's transformer linear layers)"
             if cfg.quantization != "none" else ""))
    print(f"scheduler  {report['scheduler']}" + (f" ({cfg.scheduler})" if cfg.scheduler else "")
          + f"; defaults: {pipe.default_steps} steps, guidance {pipe.default_guidance:g}, "
          f"size {report['default_size'] or 'none (pass --size)'}")
    print(f"devices    {len(devices)} of {report['local_devices']} local: "
          f"{', '.join(report['devices'])}")
    print(f"loaded in  {load_s:.1f}s\n")
    print(f"{'component':<16}{'class':<30}{'parameters':>14}  {'loaded as':<10}{'stored as':<12}")
    for name, c in comps.items():
        print(f"{name:<16}{c['class']:<30}{c['parameters']:>14,}  {','.join(c['dtype']):<10}"
              f"{','.join(c['stored_dtype']):<12}")
    print(f"{'total':<46}{report['total_parameters']:>14,}\n")
    for name, c in comps.items():
        conf = ", ".join(f"{k}={v}" for k, v in c["config"].items())
        print(f"{name:<16}{conf}\n{'':<16}weights: {c['weights']}")
    return 0


# ---------------------------------------------------------------------------------- convert
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json",
                    ".ckpt", ".pt", ".pth", ".msgpack", ".h5", ".onnx")


def cmd_convert(args) -> int:
    from maxdiff.checkpoint import SafetensorsFile, open_weights, resolve_dtype, save_safetensors

    src, dst = Path(args.src), Path(args.dst)
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


# ---------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    command = {"generate": cmd_generate, "info": cmd_info, "convert": cmd_convert}[args.command]
    previous = None
    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        previous = signal.signal(signal.SIGTERM, _on_signal)
    try:
        return command(args)
    except InputError as e:
        for msg in e.errors:
            print(f"{PROG} {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"{PROG} {args.command}: interrupted by {signal.Signals(e.signum).name}",
              file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("MAXDIFF_DEBUG"):
            traceback.print_exc()
        print(f"{PROG} {args.command}: error: {type(e).__name__}: {e} "
              "(set MAXDIFF_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
