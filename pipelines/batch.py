"""Batch generation jobs: read prompt lines, validate them, plan one job per image, resume.

``maxdiff generate`` (``pipelines/cli.py``) is a thin loop over this module::

    lines = read_prompts(prompts, file, ...)   # every line checked; InputError lists all problems
    jobs = plan_jobs(lines, settings)          # one ImageJob per image: seed, identity, file name
    out = OutputDir("out"); out.prepare()      # create, check writable, drop stale temp files
    todo = [j for j in jobs if j.id not in out.done()]   # resume: metadata.jsonl + file exists
    for shape, batch, bucket in plan_batches(todo, lambda j: j.shape, batch_size, mesh_size):
        images = pipe.generate(pad_to([j.request() for j in batch], bucket), ...)
        out.write(job, image, ...)             # atomic image file, then one fsynced metadata line

A job's identity is everything that decides its pixels (line index, image index, prompt,
negative prompt, seed, steps, guidance, size, scheduler, model, dtype; for an edit the image's
and mask's contents (SHA-256) and the strength; with ControlNets each control image's contents,
its ControlNet's folder, scale and window) plus the file format.

ControlNet: ``--control-image PATH[:MODEL[:SCALE]]`` (MODEL: a ``--controlnet NAME=PATH`` name
or a ControlNet folder) or a JSONL line's ``control_images`` (``[{"image", "controlnet",
"scale", "start", "end"}]``) make a line ControlNet text-to-image; jobs are batched per
(ControlNets, size, steps, CFG on/off), :class:`pipelines.requests.ControlKey`, each with its
own control images, scales and windows in the batch.

Editing: a line with ``image`` (and ``mask``: white = repaint, or transparent = repaint in a mask
with an alpha channel; ``strength``) is image-to-image (inpainting with a mask); its size
defaults to the image's (rounded down to the VAE factor). Paths in a JSONL file are relative to
the file's folder. Images and masks are checked (readable, same size, strength in (0, 1]) before
anything loads.
Per-image seeds come from a hash of (run seed, line index, image index), so adding, removing or
reordering *later* lines never changes an earlier image, and a run seed makes the run reproducible.
Sizes, seeds, shape keys, batch planning and image encoding are the ones every way in shares
(:mod:`pipelines.requests`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

from pipelines.limits import (STRENGTH, Problem, cfg_on, chosen_controlnet, control_scale_problem,
                              control_window_problems, describe, guidance_problem, n_problem,
                              seed_problem, size_problems, steps_problem,
                              strength_problem, within)
from pipelines.requests import (ControlKey, EditKey, ImageRequest, ShapeKey, decode_image,
                                derive_seed, encode_image, image_info, image_seeds, parse_size,
                                repaint_mask)

LINE_FIELDS = ("prompt", "negative_prompt", "seed", "steps", "guidance", "size", "n", "image",
               "mask", "strength", "control_images")
CONTROL_FIELDS = ("image", "controlnet", "scale", "start", "end",  # of a control_images entry
                  "guess_mode")
METADATA = "metadata.jsonl"
TMP_MARK = ".maxdiff-tmp"
LOCK = ".maxdiff.lock"  # held (flock) by the run writing to the folder
# Settings written into each image (PNG text chunks; JSON in EXIF ImageDescription otherwise).
class InputError(ValueError):
    """Bad command-line or prompt-file input. ``errors``: every problem found, one per entry,
    each naming where it is (``prompts.jsonl:3: field 'steps': ...``)."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = list(errors)


# ---------------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class PromptLine:
    """One prompt and its per-line overrides (None: the run's setting)."""

    index: int  # 0-based position among all prompts of the run: names files, derives seeds
    where: str  # "prompts.jsonl:3" or "prompt argument 1", for messages and metadata
    prompt: str
    negative_prompt: str | None = None
    seed: int | None = None  # image k of the line gets seed + k
    steps: int | None = None
    guidance: float | None = None
    size: tuple[int, int] | None = None  # (width, height) in pixels
    n: int | None = None  # images of this prompt
    image: str | None = None  # absolute path of the image to edit (None: text-to-image)
    mask: str | None = None  # absolute path of its inpainting mask
    strength: float | None = None  # None: the edit pipeline's default
    controls: tuple["ControlSpec", ...] | None = None  # ControlNet text-to-image (None: none)


@dataclass(frozen=True)
class ControlSpec:
    """One control image of a line and the ControlNet that reads it (``--control-image`` or
    a JSONL line's ``control_images`` entry), resolved: absolute paths."""

    image: str  # the control image
    controlnet: str  # the ControlNet's folder
    scale: float = 1.0
    start: float = 0.0  # the fraction of the denoising steps it acts on: start to end
    end: float = 1.0
    guess_mode: bool = False

    def record(self) -> dict:
        """The metadata (and settings-hash) record; ``guess_mode`` only when on, so runs
        without it keep the file names they had."""
        return dict(image=self.image, controlnet=self.controlnet, scale=self.scale,
                    start=self.start, end=self.end, **({"guess_mode": True}
                                                        if self.guess_mode else {}))


def check_size(size: tuple[int, int], factor: int | None) -> None:
    """ValueError when a (width, height) breaks :func:`pipelines.limits.size_problems` for a
    model whose sides are multiples of ``factor`` (None: not known yet, not checked)."""
    if factor:
        found = size_problems(*size, factor)
        if found:
            raise ValueError("; ".join(dict.fromkeys(p.message for p in found)))


def _rule(check: Callable[[Any], Problem | None], convert: Callable[[Any], Any] = int):
    """A JSONL field's check from a :mod:`pipelines.limits` rule: the value converted, or a
    ValueError with the rule's message and the value given."""
    def run(value: Any) -> Any:
        problem = check(value)
        if problem is not None:
            raise ValueError(f"{problem.message}, got {value!r}")
        return convert(value)
    return run


def _text(value: Any, *, empty_ok: bool) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {type(value).__name__} {value!r}")
    if not empty_ok and not value.strip():
        raise ValueError("must be a non-empty string")
    return value


_CHECKS = {
    "prompt": lambda v: _text(v, empty_ok=False),
    "negative_prompt": lambda v: None if v is None else _text(v, empty_ok=True),
    "seed": _rule(lambda v: seed_problem(v, optional=False)),  # null: omit the field
    "steps": _rule(steps_problem),
    "guidance": _rule(guidance_problem, float),
    "size": parse_size,
    "n": _rule(lambda v: n_problem(v, MAX_IMAGES_PER_LINE)),
    "image": lambda v: _text(v, empty_ok=False),
    "mask": lambda v: None if v is None else _text(v, empty_ok=False),
    "strength": lambda v: None if v is None else _rule(strength_problem, float)(v),
}
MAX_IMAGES_PER_LINE = 10_000  # a line's n (the CLI's --num-images)


def edit_size(path: str, factor: int | None) -> tuple[int, int]:
    """An edit's default size: the image's, rounded down to a multiple of ``factor``."""
    from PIL import Image

    with Image.open(path) as im:
        w, h = im.size
    f = factor or 1
    return w - w % f, h - h % f


def load_edit_inputs(image: str, mask: str | None):
    """(RGB PIL image, mask as a grayscale PIL image with 255 = repaint, or None)."""
    from PIL import Image

    rgb, _ = decode_image(Path(image).read_bytes(), "image")
    if mask is None:
        return Image.fromarray(rgb), None
    return Image.fromarray(rgb), Image.fromarray(repaint_mask(*decode_image(
        Path(mask).read_bytes(), "mask")), mode="L")


def check_edit_files(image: str | None, mask: str | None, strength: float | None,
                     base: Path | None = None, names: tuple[str, str] = ("image", "mask")
                     ) -> tuple[str | None, str | None, list[str]]:
    """Resolve ``image``/``mask`` against ``base`` and check them: readable images, the mask of
    the image's size, a mask only with an image. Returns (image path, mask path, problems)."""
    errors: list[str] = []
    paths = []
    sizes = []
    for value, name in zip((image, mask), names):
        if value is None:
            paths.append(None)
            sizes.append(None)
            continue
        p = Path(value).expanduser()
        if base is not None and not p.is_absolute():
            p = base / p
        paths.append(str(p.resolve()))
        try:
            rgb, _ = decode_image(p.read_bytes(), name)
            sizes.append(rgb.shape[1::-1])
        except OSError as e:
            errors.append(f"{name} {value}: cannot read it ({e.strerror or e})")
            sizes.append(None)
        except ValueError as e:
            errors.append(f"{name} {value}: {e}")
            sizes.append(None)
    if mask is not None and image is None:
        errors.append(f"{names[1]} {mask}: a mask needs an image to edit ({names[0]})")
    if strength is not None and image is None:
        errors.append(f"strength {strength}: only used with an image to edit ({names[0]})")
    if sizes[0] and sizes[1] and sizes[0] != sizes[1]:
        errors.append(f"{names[1]} {mask} is {sizes[1][0]}x{sizes[1][1]} but {names[0]} "
                      f"{image} is {sizes[0][0]}x{sizes[0][1]}; give a mask of the image's size")
    return paths[0], paths[1], errors


# ---------------------------------------------------------------------------------- ControlNet
def parse_controlnets(specs: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """``--controlnet NAME=PATH`` (repeatable) -> ({name: absolute path}, problems)."""
    names: dict[str, str] = {}
    errors = []
    for spec in specs:
        name, eq, path = spec.partition("=")
        name = name.strip()
        if not eq or not name or not path.strip():
            errors.append(f"--controlnet {spec}: give NAME=PATH (a diffusers ControlNet folder "
                          "or .safetensors file)")
        elif name in names:
            errors.append(f"--controlnet {spec}: the name {name!r} is given twice")
        elif not Path(path).expanduser().exists():
            errors.append(f"--controlnet {spec}: {path}: no such folder")
        else:
            names[name] = str(Path(path).expanduser().resolve())
    return names, errors


def parse_control_image(text: str) -> tuple[str, str | None, str | None]:
    """``--control-image PATH[:MODEL[:SCALE]]`` -> (path, model or None, scale text or None).
    A PATH that names an existing file is taken whole (a file name with a ``:``)."""
    if Path(text).expanduser().is_file():
        return text, None, None
    parts = text.split(":")
    if len(parts) >= 3:
        return ":".join(parts[:-2]), parts[-2] or None, parts[-1]
    if len(parts) == 2:
        return parts[0], parts[1] or None, None
    return text, None, None


def _float(text: Any) -> Any:
    try:
        return float(text)
    except (TypeError, ValueError):
        return text


def _controlnet(ref: Any, names: dict[str, str], base: Path | None) -> str:
    """The folder of the ControlNet ``ref`` names: a ``--controlnet`` name, else a folder
    (relative to ``base``); ValueError saying which names there are."""
    ref = chosen_controlnet(ref, names)
    if ref is None:
        have = (f"the --controlnet names are {', '.join(names)}" if names else
                "or name one with --controlnet NAME=PATH")
        raise ValueError(f"which ControlNet reads it? give its name or folder ({have})")
    if not isinstance(ref, str) or not ref.strip():
        raise ValueError(f"must be a ControlNet name or folder, got {ref!r}")
    if ref in names:
        return names[ref]
    path = Path(ref).expanduser()
    if base is not None and not path.is_absolute():
        path = base / path
    if not path.exists():
        have = (f"names given with --controlnet: {', '.join(names)}" if names else
                "--controlnet NAME=PATH names one")
        raise ValueError(f"{ref!r} is no ControlNet name and no such folder ({have})")
    return str(path.resolve())


def _control_file(value: Any, base: Path | None) -> str:
    """A control image's absolute path; ValueError unless it is a readable image."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be the path of a control image, got {value!r}")
    path = Path(value).expanduser()
    if base is not None and not path.is_absolute():
        path = base / path
    try:
        decode_image(path.read_bytes(), value)
    except OSError as e:
        raise ValueError(f"{value}: cannot read it ({e.strerror or e})") from None
    return str(path.resolve())


def cli_controls(specs: Iterable[str], names: dict[str, str], start: float | None,
                 end: float | None, guess: bool = False
                 ) -> tuple[tuple[ControlSpec, ...], list[str]]:
    """The command line's ``--control-image PATH[:MODEL[:SCALE]]`` entries (each read by
    ``--controlnet`` name ``MODEL`` or the ControlNet folder ``MODEL``; MODEL may be left out
    when one ``--controlnet`` is given) with the window ``--control-guidance-start`` /
    ``--control-guidance-end`` and ``--control-guess-mode``: (specs, problems naming the
    flag)."""
    errors: list[str] = []
    start = 0.0 if start is None else start
    end = 1.0 if end is None else end
    window = control_window_problems(start, end)
    errors += [describe(p, "cli") for p in window]
    out = []
    for text in specs:
        path, model, scale_text = parse_control_image(text)
        scale = 1.0 if scale_text is None else _float(scale_text)
        bad = False
        if (p := control_scale_problem(scale)) is not None:
            errors.append(f"{describe(p, 'cli')}, got SCALE {scale_text!r} in {text!r}")
            bad = True
        for what, fn in (("PATH", lambda: _control_file(path, None)),
                         ("MODEL", lambda: _controlnet(model, names, None))):
            try:
                fn()
            except ValueError as e:
                errors.append(f"--control-image {text}: {what}: {e}")
                bad = True
        if not bad and not window:
            out.append(ControlSpec(_control_file(path, None), _controlnet(model, names, None),
                                   float(scale), float(start), float(end), bool(guess)))
    return tuple(out), errors


def jsonl_controls(value: Any, names: dict[str, str], base: Path | None,
                   start: float | None, end: float | None, guess: bool = False
                   ) -> tuple[ControlSpec, ...]:
    """A JSONL line's ``control_images``: a list of objects with ``image`` (a path relative to
    the file's folder) and any of ``controlnet`` (a ``--controlnet`` name or a folder),
    ``scale``, ``start``, ``end`` (default: the command line's window) and ``guess_mode``
    (default: ``--control-guess-mode``). ValueError naming every problem
    (``control_images[1].scale: ...``)."""
    if not isinstance(value, list) or not value:
        raise ValueError("field 'control_images': must be a non-empty list of objects such as "
                         '{"image": "edges.png", "controlnet": "canny", "scale": 0.5}')
    errors = []
    out = []
    for k, entry in enumerate(value):
        where = f"control_images[{k}]"
        if not isinstance(entry, dict):
            errors.append(f"field {where!r}: must be an object with an 'image', got "
                          f"{type(entry).__name__}")
            continue
        unknown = [key for key in entry if key not in CONTROL_FIELDS]
        if unknown:
            errors.append(f"field '{where}.{unknown[0]}': unknown; an entry has "
                          f"{', '.join(CONTROL_FIELDS)}")
        if "image" not in entry:
            errors.append(f"field '{where}.image': is missing (the control image's path)")
        c = dict(scale=entry.get("scale", 1.0),
                 start=entry.get("start", 0.0 if start is None else start),
                 end=entry.get("end", 1.0 if end is None else end))
        found = [p for p in [control_scale_problem(c["scale"]),
                             *control_window_problems(c["start"], c["end"])] if p]
        errors += [describe(within(p, "jsonl", where), "jsonl") for p in found]
        c["guess_mode"] = entry.get("guess_mode", bool(guess))
        if not isinstance(c["guess_mode"], bool):
            errors.append(f"field '{where}.guess_mode': must be true or false, got "
                          f"{c['guess_mode']!r}")
            found.append(c["guess_mode"])
        paths = {}
        for key, fn in (("image", lambda: _control_file(entry["image"], base)),
                        ("controlnet", lambda: _controlnet(entry.get("controlnet"), names,
                                                           base))):
            if key == "image" and "image" not in entry:
                continue
            try:
                paths[key] = fn()
            except ValueError as e:
                errors.append(f"field '{where}.{key}': {e}")
        if not unknown and not found and len(paths) == 2:
            out.append(ControlSpec(paths["image"], paths["controlnet"], float(c["scale"]),
                                   float(c["start"]), float(c["end"]), c["guess_mode"]))
    if errors:
        raise ValueError("\n".join(errors))
    return tuple(out)


def control_size(controls: tuple[ControlSpec, ...], factor: int | None) -> tuple[int, int]:
    """A ControlNet line's default size: its first control image's, rounded down to a
    multiple of ``factor`` (as the Python API's)."""
    return edit_size(controls[0].image, factor)


def load_control_image(path: str):
    """A control image file as an RGB PIL image (resized to the output size by the
    pipeline, Lanczos, as the Python API does for PIL images)."""
    from PIL import Image

    return Image.fromarray(decode_image(Path(path).read_bytes(), "control image")[0])


def _jsonl_line(text: str, where: str, index: int, factor: int | None,
                errors: list[str], steps_limit: tuple[int, str] | None = None,
                base: Path | None = None, control: dict | None = None) -> PromptLine | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        errors.append(f"{where}: not valid JSON ({e.msg} at column {e.colno}); a JSONL line is one "
                      'object such as {"prompt": "a red fox", "seed": 7}')
        return None
    if not isinstance(obj, dict):
        errors.append(f"{where}: a JSONL line must be a JSON object with a 'prompt', "
                      f"got {type(obj).__name__}")
        return None
    before = len(errors)
    values: dict[str, Any] = {}
    for key in obj:
        if key not in _CHECKS and key != "control_images":
            errors.append(f"{where}: unknown field {key!r}; allowed fields: "
                          f"{', '.join(LINE_FIELDS)}")
    if "prompt" not in obj:
        errors.append(f"{where}: field 'prompt' is missing (every line needs one)")
    for key, check in _CHECKS.items():
        if key in obj:
            try:
                values[key] = check(obj[key])
                if key == "size":
                    check_size(values[key], factor)
                if key == "steps" and steps_limit:
                    _rule(lambda v: steps_problem(v, steps_limit[0],
                                                  f"what {steps_limit[1]} allows"))(values[key])
            except ValueError as e:
                errors.append(f"{where}: field {key!r}: {e}")
    if "control_images" in obj:
        try:
            values["controls"] = jsonl_controls(obj["control_images"], **(control or dict(
                names={}, start=None, end=None, guess=False)), base=base)
        except ValueError as e:
            errors += [f"{where}: {msg}" for msg in str(e).split("\n")]
        if "image" in obj or "mask" in obj or "strength" in obj:
            errors.append(f"{where}: field 'control_images' with an image to edit: ControlNet "
                          "image-to-image is not supported; give control_images or image")
    if len(errors) > before:
        return None
    if values.get("controls") and "size" not in values:
        values["size"] = control_size(values["controls"], factor)
    if "image" in values or "mask" in values or "strength" in values:
        image, mask, problems = check_edit_files(
            values.get("image"), values.get("mask"), values.get("strength"), base,
            ("field 'image'", "field 'mask'"))
        errors += [f"{where}: {p}" for p in problems]
        if problems:
            return None
        values["image"], values["mask"] = image, mask
        if image is not None and "size" not in values:
            values["size"] = edit_size(image, factor)
    return PromptLine(index=index, where=where, **values)


def read_prompts(prompts: Iterable[str] = (), file: str | os.PathLike | None = None, *,
                 factor: int | None = None, file_text: str | None = None,
                 steps_limit: tuple[int, str] | None = None, image: str | None = None,
                 mask: str | None = None, strength: float | None = None,
                 size: tuple[int, int] | None = None, steps: int | None = None,
                 control_images: Iterable[str] = (), controlnets: Iterable[str] = (),
                 control_start: float | None = None, control_end: float | None = None,
                 control_guess_mode: bool = False) -> list[PromptLine]:
    """All prompts of a run: the command-line ones first, then the file's.

    A ``.jsonl``/``.ndjson`` file (or one whose first entry starts with ``{``) holds one JSON
    object per line: ``prompt`` and any of ``negative_prompt``, ``seed``, ``steps``,
    ``guidance``, ``size``, ``n``, ``image``, ``mask``, ``strength``, ``control_images``
    (paths relative to the file's folder). Any other file is one prompt per line.
    ``image``/``mask``/``strength`` (the CLI's --image, --mask, --strength) apply to every line
    that has no ``image`` (nor ``control_images``) of its own;
    ``size`` (--size) is an edit line's size when it has none (else the image's). ``steps``:
    the run's step count where known before loading, to check each edit's strength against.
    ControlNet: ``control_images`` (the CLI's ``--control-image PATH[:MODEL[:SCALE]]``, each
    read by a ControlNet named in ``controlnets``, the CLI's ``--controlnet NAME=PATH``, or
    given by its folder) apply to every line that has no ``control_images`` and no ``image``
    of its own, with the window ``control_start`` to ``control_end`` and guess mode
    ``control_guess_mode`` (also the defaults of a line's entries); a ControlNet line's size
    defaults to its first control image's.
    Both skip blank lines and lines starting with ``#``. ``file="-"`` reads stdin (or
    ``file_text``). Sizes must be multiples of ``factor``; steps at most ``steps_limit`` =
    (limit, scheduler name). Raises :class:`InputError` listing every bad line.
    """
    errors: list[str] = []
    lines: list[PromptLine] = []
    edit: dict[str, Any] = {}
    if image is not None or mask is not None or strength is not None:
        image, mask, problems = check_edit_files(image, mask, strength, None,
                                                 ("--image", "--mask"))
        errors += problems
        if strength is not None and (p := strength_problem(strength)) is not None:
            errors.append(describe(p, "cli"))
        if image is not None and not problems:
            edit = dict(image=image, mask=mask, strength=strength,
                        size=size or edit_size(image, factor))
    names, problems = parse_controlnets(controlnets)
    errors += problems
    control_images = list(control_images)
    control: dict[str, Any] = {}
    if control_images:
        specs, problems = cli_controls(control_images, names, control_start, control_end,
                                       control_guess_mode)
        errors += problems
        if image is not None:
            errors.append("--control-image with --image: ControlNet image-to-image is not "
                          "supported; give one or the other")
        elif specs and not problems:
            control = dict(controls=specs, size=size or control_size(specs, factor))
    else:
        errors += [describe(p, "cli") for p in control_window_problems(
            0.0 if control_start is None else control_start,
            1.0 if control_end is None else control_end)]
    jsonl_control = dict(names=names, start=control_start, end=control_end,
                         guess=control_guess_mode)
    for i, p in enumerate(prompts, 1):
        if not p.strip():
            errors.append(f"prompt argument {i}: the prompt is empty")
        else:
            lines.append(PromptLine(index=len(lines), where=f"prompt argument {i}", prompt=p,
                                    **edit, **control))
    if file is not None:
        name = str(file)
        if file_text is None:
            try:
                file_text = (sys.stdin.read() if name == "-"
                             else Path(file).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as e:
                raise InputError(errors + [f"--prompts {name}: cannot read it ({e})"]) from None
        name = "<stdin>" if name == "-" else name
        entries = [(no, t.strip()) for no, t in enumerate(file_text.split("\n"), 1)
                   if t.strip() and not t.lstrip().startswith("#")]
        jsonl = name.endswith((".jsonl", ".ndjson")) or bool(
            entries and entries[0][1].startswith("{"))
        for no, text in entries:
            where = f"{name}:{no}"
            if jsonl:
                base = Path.cwd() if name == "<stdin>" else Path(file).parent
                line = _jsonl_line(text, where, len(lines), factor, errors, steps_limit, base,
                                   jsonl_control)
                own = line is not None and (line.image is not None or line.controls)
                if line is not None and not own and (edit or control):
                    line = PromptLine(**{**line.__dict__, **edit, **control,
                                         **({"size": line.size} if line.size else {})})
                if line is not None:
                    lines.append(line)
            else:
                lines.append(PromptLine(index=len(lines), where=where, prompt=text, **edit,
                                        **control))
        if not entries:
            errors.append(f"--prompts {name}: no prompts in it (blank lines and # comments only)")
    for line in lines:
        if line.image is not None and (line.steps or steps):
            p = strength_problem(edit_strength(line), line.steps or steps)
            if p is not None:
                errors.append(f"{line.where}: {describe(p)}")
    if (control_start is not None or control_end is not None or control_guess_mode) and lines \
            and not any(line.controls for line in lines) and not errors:
        flag = ("--control-guidance-start" if control_start is not None else
                "--control-guidance-end" if control_end is not None else "--control-guess-mode")
        errors.append(f"{flag}: only used with control images (--control-image, or a JSONL "
                      "line's control_images)")
    if errors:
        raise InputError(errors)
    if not lines:
        raise InputError(["no prompts: give PROMPT arguments or --prompts FILE"])
    return lines


def edit_strength(line: PromptLine) -> float:
    """An edit line's strength: its own, else every front door's default for its kind."""
    if line.strength is not None:
        return line.strength
    return STRENGTH["inpaint" if line.mask else "img2img"]


# ---------------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class RunSettings:
    """Run-wide settings; a line's own fields override steps, guidance, size, negative, n."""

    model: str
    scheduler: str
    dtype: str
    steps: int
    guidance: float
    width: int | None
    height: int | None
    run_seed: int
    unet: str | None = None
    negative_prompt: str | None = None
    num_images: int = 1
    format: str = "png"
    lora: str | None = None  # the fused LoRA adapters, "PATH:SCALE, ..." (None: none)
    quantization: str | None = None  # int8-weights, int8, fp8 (None: none)
    refiner: str | None = None  # "DIR:FRAC": the SDXL refiner and where it takes over


@dataclass(frozen=True)
class ImageJob:
    """One image of a CLI run: what to make and where it goes."""

    line: PromptLine
    image: int  # index of the image within its line
    prompt: str
    negative_prompt: str | None
    seed: int
    steps: int
    guidance: float
    width: int
    height: int
    settings: RunSettings
    id: str  # hash of everything that decides the file's content
    file: str
    strength: float | None = None  # an edit's strength (None: text-to-image)

    @property
    def shape(self) -> ShapeKey | EditKey | ControlKey:
        """What selects the compiled program (and, for an edit, the strength; with
        ControlNets, which ones)."""
        if self.line.controls:
            return ControlKey(tuple(c.controlnet for c in self.line.controls), self.height,
                              self.width, self.steps, cfg_on(self.guidance))
        if self.line.image is not None:
            return EditKey("inpaint" if self.line.mask else "img2img", self.height, self.width,
                           self.steps, cfg_on(self.guidance), self.strength)
        return ShapeKey.of(self.height, self.width, self.steps, self.guidance)

    def request(self) -> ImageRequest:
        return ImageRequest(prompt=self.prompt, negative_prompt=self.negative_prompt,
                            seed=self.seed, guidance_scale=self.guidance)

    def identity(self) -> dict[str, Any]:
        return identity(self.line.index, self.image, self.prompt, self.negative_prompt, self.seed,
                        self.steps, self.guidance, self.width, self.height, self.settings)

    def image_info(self) -> dict[str, str]:
        """The settings stored inside the image file (no time or path, so files reproduce)."""
        controlnet = None
        if self.line.controls:  # "FOLDER:SCALE[START-END]; ..."
            controlnet = "; ".join(f"{c.controlnet}:{c.scale:g}[{c.start:g}-{c.end:g}]"
                                   f"{' guess' if c.guess_mode else ''}"
                                   for c in self.line.controls)
        return image_info(**self.record(), controlnet=controlnet)

    def record(self, **extra: Any) -> dict[str, Any]:
        """This job's ``metadata.jsonl`` entry."""
        s = self.settings
        edit = {}
        if self.line.image is not None:
            edit = dict(mode=self.shape.kind, input_image=self.line.image,
                        mask=self.line.mask, strength=self.strength)
        if self.line.controls:
            edit = dict(mode="controlnet",
                        control_images=[c.record() for c in self.line.controls])
        return dict(line=self.line.index, image=self.image, source=self.line.where,
                    prompt=self.prompt, negative_prompt=self.negative_prompt, seed=self.seed,
                    run_seed=s.run_seed, steps=self.steps, guidance=self.guidance,
                    size=f"{self.width}x{self.height}", width=self.width, height=self.height,
                    scheduler=s.scheduler, model=s.model, unet=s.unet, lora=s.lora,
                    dtype=s.dtype, quantization=s.quantization, format=s.format,
                    **({"refiner": s.refiner} if s.refiner else {}), **edit,
                    file=self.file, id=self.id, **extra)


def identity(line: int, image: int, prompt: str, negative_prompt: str | None, seed: int,
             steps: int, guidance: float, width: int, height: int, s: RunSettings) -> dict:
    return dict(line=line, image=image, prompt=prompt, negative_prompt=negative_prompt, seed=seed,
                steps=steps, guidance=float(guidance), width=width, height=height,
                scheduler=s.scheduler, model=s.model, unet=s.unet, dtype=s.dtype, format=s.format,
                **({"lora": s.lora} if s.lora else {}),  # (ids of runs without LoRA unchanged)
                **({"quantization": s.quantization} if s.quantization else {}),
                **({"refiner": s.refiner} if s.refiner else {}))


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def job_id(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def slug(text: str, limit: int = 40) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return s[:limit].rstrip("-") or "image"


def plan_jobs(lines: list[PromptLine], s: RunSettings) -> list[ImageJob]:
    """One :class:`ImageJob` per image, in input order. File names
    ``{line:05d}-{image:02d}-{slug}-{id8}.{ext}`` sort in input order and never collide (a job
    with other settings gets another id, so it never overwrites a different image)."""
    counts = [line.n or s.num_images for line in lines]
    wl = max(5, len(str(len(lines) - 1)))
    wi = max(2, len(str(max(counts) - 1)))
    jobs = []
    for line, n in zip(lines, counts):
        w, h = line.size or (s.width, s.height)
        if w is None or h is None:
            raise InputError([f"{line.where}: no size: this model has no default size; "
                              "pass --size WIDTHxHEIGHT"])
        steps = line.steps if line.steps is not None else s.steps
        guidance = line.guidance if line.guidance is not None else s.guidance
        neg = line.negative_prompt if line.negative_prompt is not None else s.negative_prompt
        if (p := seed_problem(line.seed, n)) is not None:
            raise InputError([f"{line.where}: {describe(p, 'jsonl')}"])
        seeds = image_seeds(line.seed, n)
        strength, edit = None, {}
        if line.image is not None:
            strength = edit_strength(line)
            if (p := strength_problem(strength, steps)) is not None:
                raise InputError([f"{line.where}: {describe(p)}"])
            edit = dict(strength=strength, image_sha256=_sha256(line.image),
                        mask_sha256=line.mask and _sha256(line.mask))
        if line.controls:
            edit = dict(control_images=[{**c.record(), "image": _sha256(c.image)}
                                        for c in line.controls])
        for k, seed in enumerate(seeds):
            if seed is None:
                seed = derive_seed(s.run_seed, line.index, k)
            jid = job_id({**identity(line.index, k, line.prompt, neg, seed, steps, guidance, w,
                                     h, s), **edit})
            name = f"{line.index:0{wl}d}-{k:0{wi}d}-{slug(line.prompt)}-{jid[:8]}.{s.format}"
            jobs.append(ImageJob(line, k, line.prompt, neg, seed, steps, float(guidance), w, h, s,
                            jid, name, strength))
    return jobs


# ---------------------------------------------------------------------------------- output
class OutputDir:
    """The output folder: image files plus ``metadata.jsonl`` (one JSON object per image, in the
    order written). Files appear atomically (temp file, fsync, rename) and a metadata line is
    appended and fsynced only after its image is in place, so a killed run loses at most the
    batch in flight and a rerun trusts every complete metadata line whose file exists."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.metadata = self.path / METADATA
        self.temp_files: set[Path] = set()

    def prepare(self) -> None:
        """Create the folder, prove it is writable, lock it against a second run (the lock goes
        with the process), and remove temp files a killed run left."""
        where = f"output folder {self.path}"
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise InputError([f"{where}: a file of that name exists; choose another --out"]
                             ) from None
        except NotADirectoryError:
            raise InputError([f"{where}: a part of that path is a file, not a folder; "
                              "choose another --out"]) from None
        except OSError as e:
            raise InputError([f"{where}: cannot create it ({e.strerror or e}); "
                              "choose another --out"]) from None
        probe = self.path / f"{TMP_MARK}-probe-{os.getpid()}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise InputError([f"{where}: not writable ({e.strerror or e}); choose another --out"]
                             ) from None
        import fcntl

        self._lock = open(self.path / LOCK, "a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise InputError([f"{where}: another maxdiff run is writing there; wait for it or "
                              "choose another --out"]) from None
        for stale in self.path.glob(f"*{TMP_MARK}*"):  # ours alone now: left by a killed run
            stale.unlink(missing_ok=True)

    def records(self) -> list[dict]:
        """The complete metadata lines. A last line cut short by a kill is dropped from the file
        (so the next append starts on a fresh line); a damaged line elsewhere is skipped."""
        try:
            data = self.metadata.read_bytes()
        except FileNotFoundError:
            return []
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            print(f"maxdiff: {self.metadata}: dropping an incomplete last line (a run was killed "
                  "while writing it)", file=sys.stderr)
            os.truncate(self.metadata, keep)
            data = data[:keep]
        out = []
        for no, raw in enumerate(data.splitlines(), 1):
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                rec = None
            if isinstance(rec, dict) and isinstance(rec.get("id"), str) and isinstance(
                    rec.get("file"), str):
                out.append(rec)
            elif raw.strip():
                print(f"maxdiff: {self.metadata}:{no}: skipping an unreadable line",
                      file=sys.stderr)
        return out

    def done(self, records: list[dict] | None = None) -> set[str]:
        """Ids of the jobs already finished: a metadata record whose file exists."""
        records = self.records() if records is None else records
        return {r["id"] for r in records if (self.path / Path(r["file"]).name).is_file()}

    def write(self, job: ImageJob, image, **extra: Any) -> dict:
        """Write one image atomically, then append and fsync its metadata line."""
        data = encode_image(image, job.settings.format, job.image_info())
        final = self.path / job.file
        tmp = self.path / f".{job.file}{TMP_MARK}-{os.getpid()}"
        self.temp_files.add(tmp)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
            self.temp_files.discard(tmp)
        _fsync_dir(self.path)
        rec = job.record(time=datetime.now(timezone.utc).isoformat(timespec="seconds"), **extra)
        with open(self.metadata, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return rec

    def remove_temp_files(self) -> None:
        for tmp in list(self.temp_files):
            tmp.unlink(missing_ok=True)
        self.temp_files.clear()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
