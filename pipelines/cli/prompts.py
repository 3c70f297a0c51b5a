"""Batch generation jobs: read prompt lines, validate them, plan one job per image, resume.

``maxdiff generate`` is a thin loop over :mod:`pipelines.cli.prompts` (reading),
:mod:`pipelines.cli.jobs` (planning) and :mod:`pipelines.cli.output` (writing)::

    lines = read_prompts(prompts, file, ...)   # every line checked; InputError lists all problems
    jobs = plan_jobs(lines, settings)          # one ImageJob per image: seed, identity, file name
    out = OutputDir("out"); out.prepare()      # create, check writable, drop stale temp files
    todo = [j for j in jobs if j.id not in out.done()]   # resume: metadata.jsonl + file exists
    for shape, batch, bucket in plan_batches(todo, lambda j: j.shape, batch_size, mesh_size):
        images = pipe.generate(pad_to([j.request() for j in batch], bucket), ...)
        out.write(job, image, ...)             # atomic image file, then one fsynced metadata line

Editing: a line with ``image`` (and ``mask``: white = repaint, or transparent = repaint in a
mask with an alpha channel; ``strength``) is image-to-image (inpainting with a mask); its size
defaults to the image's (rounded down to the VAE factor). Paths in a JSONL file are relative to
the file's folder. Images and masks are checked (readable, same size, strength in (0, 1])
before anything loads.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipelines.cli.controls import cli_controls, control_size, jsonl_controls, parse_controlnets
from pipelines.cli.lines import (
    _CHECKS,
    LINE_FIELDS,
    InputError,
    PromptLine,
    _rule,
    check_size,
    edit_size,
)
from pipelines.control_limits import control_window_problems
from pipelines.image_files import decode_image, repaint_mask
from pipelines.limits import STRENGTH, describe, steps_problem, strength_problem


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
    if values.get("ip_adapter_image") is not None:
        path, _, problems = check_edit_files(values["ip_adapter_image"], None, None, base,
                                             ("field 'ip_adapter_image'", ""))
        errors += [f"{where}: {p}" for p in problems]
        if problems:
            return None
        values["ip_adapter_image"] = path
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
                 control_guess_mode: bool = False,
                 ip_adapter_image: str | None = None) -> list[PromptLine]:
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
    (limit, scheduler name). ``ip_adapter_image`` (--ip-adapter-image): the image prompt of
    every line without its own ``ip_adapter_image``. Raises :class:`InputError` listing every
    bad line.
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
    if ip_adapter_image is not None:
        ip_adapter_image, _, problems = check_edit_files(ip_adapter_image, None, None, None,
                                                         ("--ip-adapter-image", ""))
        errors += problems
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
    if ip_adapter_image is not None:
        lines = [line if line.ip_adapter_image is not None else
                 PromptLine(**{**line.__dict__, "ip_adapter_image": ip_adapter_image})
                 for line in lines]
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
