"""Strict configs: pydantic models that refuse unknown keys, and one loader for all of them.

Run configs (``pipelines.config.RunConfig``), the service's settings
(``serving.schemas.ServeSettings``) and the training config (``maxdiff.training.train``) are
each a :class:`StrictConfig`; :func:`load_config` reads one from a YAML file, a name in the
shipped ``configs/`` folder, a dict or nothing, then applies ``key=value`` overrides (values
parsed as YAML scalars, so ``steps=4`` is an int and ``model=null`` is None). Every problem is
reported with the key, what it must be and what was given.

The shipped YAML files live in the top-level ``configs/`` folder of the source tree; the wheel
carries them as the package ``maxdiff.configs`` (see ``pyproject.toml``), so named configs are
found through ``importlib.resources`` in an editable and a regular install alike.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

C = TypeVar("C", bound="StrictConfig")


class StrictConfig(BaseModel):
    """A config: typed fields, unknown keys refused, immutable once built."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False,
                              coerce_numbers_to_str=True, validate_default=True)

    def replace(self: C, **changes: Any) -> C:
        """A validated copy with ``changes`` applied (the dataclasses.replace of configs)."""
        return validate(type(self), {**self.model_dump(), **changes}, type(self).__name__)


def shipped_configs():
    """The folder (an importlib.resources Traversable) holding the shipped YAML configs."""
    return resources.files("maxdiff.configs")


def config_names(exclude: tuple[str, ...] = ()) -> list[str]:
    """Names (file stems) of the shipped YAML configs, without those starting with ``exclude``."""
    return sorted(p.name[:-5] for p in shipped_configs().iterdir()
                  if p.name.endswith(".yaml") and not p.name.startswith(exclude or ("\0",)))


def read_named_or_file(source: str | os.PathLike, kind: str = "config",
                       exclude: tuple[str, ...] = ()) -> tuple[dict, str]:
    """(mapping, where) from a YAML path, or else from a shipped config of that name."""
    path = Path(source)
    if path.is_file():
        text, where = path.read_text(encoding="utf-8"), str(path)
    else:
        named = shipped_configs() / f"{source}.yaml"
        if not named.is_file():
            raise ValueError(f"{kind} {str(source)!r}: no such file, and not one of the named "
                             f"{kind}s: {', '.join(config_names(exclude))}")
        text, where = named.read_text(encoding="utf-8"), f"{kind} {source!r}"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: not valid YAML ({e})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a {kind} is a YAML mapping of key: value")
    return data, where


def parse_overrides(overrides: Iterable[str] | Mapping[str, Any] | None) -> dict:
    """``["steps=4", "model=/m"]`` (values parsed as YAML scalars) or a mapping -> dict."""
    if overrides is None:
        return {}
    if isinstance(overrides, Mapping):
        return dict(overrides)
    out = {}
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value")
        k, v = item.split("=", 1)
        out[k.strip()] = yaml_scalar(v)
    return out


def yaml_scalar(text: str) -> Any:
    """``"4"`` -> 4, ``"null"``/``""`` -> None, ``"[1, 2]"`` -> [1, 2], ``"a b"`` -> "a b"."""
    if not text.strip():
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def describe_errors(err: ValidationError, cls: type[BaseModel], where: str) -> str:
    """One line per problem: ``where: key 'steps': Input should be ... (got 'two')``."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(config)"
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key {key!r}; allowed keys: "
                         f"{', '.join(cls.model_fields)}")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        got = e.get("input")
        shown = "" if isinstance(got, Mapping) or got is None else f" (got {got!r})"
        lines.append(f"{where}: key {key!r}: {msg}{shown}")
    return "\n".join(lines)


def validate(cls: type[C], data: Mapping[str, Any], where: str) -> C:
    """``cls(**data)``, with pydantic's errors turned into one readable ValueError."""
    try:
        return cls.model_validate(dict(data))
    except ValidationError as e:
        raise ValueError(describe_errors(e, cls, where)) from None


def load_config(cls: type[C], source: str | os.PathLike | Mapping | None = None,
                overrides: Iterable[str] | Mapping[str, Any] | None = None, *,
                kind: str = "config", exclude: tuple[str, ...] = ()) -> C:
    """A ``cls`` from a YAML path, a shipped config's name, a mapping or None (all defaults),
    then ``key=value`` overrides."""
    if source is None:
        data, where = {}, kind
    elif isinstance(source, Mapping):
        data, where = dict(source), kind
    else:
        data, where = read_named_or_file(source, kind, exclude)
    data.update(parse_overrides(overrides))
    return validate(cls, data, where)
