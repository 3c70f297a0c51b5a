"""Where the embedded default model lives, for every place a model may be omitted."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

ENV = "MAXDIFF_DEFAULT_MODEL"
# package data of `maxdiff` (a real folder in an editable and a regular install alike)
EMBEDDED = Path(str(resources.files("maxdiff") / "assets" / "demo-model"))


def default_model_path() -> Path:
    """The model used when none is given: ``$MAXDIFF_DEFAULT_MODEL`` if set, else the model
    embedded in the package."""
    env = os.environ.get(ENV)
    path = Path(env) if env else EMBEDDED
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(
            f"no model given and no default model at {path}: pass a diffusers SDXL folder "
            f"(for example --model DIR / from_pretrained(DIR)), or set {ENV} to one. "
            f"The embedded demo model belongs at {EMBEDDED}; rebuild it there with "
            "`make train-demo`.")
    return path
