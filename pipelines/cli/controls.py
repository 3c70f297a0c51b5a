"""ControlNet inputs of ``maxdiff generate``: ``--controlnet NAME=PATH``, ``--control-image
PATH[:MODEL[:SCALE]]`` and a JSONL line's ``control_images`` entries, resolved to
:class:`pipelines.cli.lines.ControlSpec` and checked before anything loads.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from maxdiff.hub import resolve
from pipelines.cli.lines import CONTROL_FIELDS, ControlSpec, edit_size
from pipelines.control_limits import chosen_controlnet, control_scale_problem, control_window_problems
from pipelines.image_files import decode_image
from pipelines.limits import describe, within


def parse_controlnets(specs: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """``--controlnet NAME=PATH`` (repeatable) -> ({name: absolute path}, problems). PATH may
    be a Hugging Face model name, ``org/name`` (:func:`maxdiff.hub.resolve`)."""
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
        else:
            try:  # a Hugging Face name (org/name): its snapshot in the local cache
                found = resolve(path.strip())
            except ValueError as e:
                errors.append(f"--controlnet {spec}: {e}")
                continue
            if not found.exists():
                errors.append(f"--controlnet {spec}: {path}: no such folder")
            else:
                names[name] = str(found.resolve())
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
        for what, fn in (("PATH", lambda path=path: _control_file(path, None)),
                         ("MODEL", lambda model=model: _controlnet(model, names, None))):
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
        for key, fn in (("image", lambda entry=entry: _control_file(entry["image"], base)),
                        ("controlnet", lambda entry=entry: _controlnet(entry.get("controlnet"),
                                                                       names, base))):
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
