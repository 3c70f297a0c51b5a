"""notebooks/quickstart.ipynb runs top to bottom (on the tiny checkpoint), so it never rots."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_runs(sdxl_dir, monkeypatch):
    monkeypatch.setenv("MAXDIFF_MODEL", str(sdxl_dir))
    monkeypatch.setenv("MAXDIFF_STEPS", "2")  # MAXDIFF_COMPILE_CACHE: the run's (conftest.py)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    diffs = [int(line.split(":")[1]) for line in text.splitlines()
             if line.startswith("max pixel difference:")]
    assert len(diffs) == 1 and diffs[0] <= 1  # the notebook's own tolerance: one level
    assert any("image/png" in o.get("data", {}) for o in outputs)
