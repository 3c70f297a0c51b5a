"""Shared fixtures: tiny random checkpoints written once per test session."""

from __future__ import annotations

import pytest

import tiny


@pytest.fixture(scope="session")
def sdxl_dir(tmp_path_factory):
    """A complete tiny SDXL checkpoint folder (model_index.json + components), torch seed 0."""
    path = tmp_path_factory.mktemp("tiny-sdxl")
    tiny.make_sdxl_pipeline(path)
    return path


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (Debian's package) driven by Playwright; skipped loudly without one."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="BROWSER TESTS SKIPPED: playwright is not installed")
    import browser as chromium

    with sync_api.sync_playwright() as pw:
        b = chromium.launch(pw)
        yield b
        b.close()
