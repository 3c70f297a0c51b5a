"""Shared fixtures: tiny random checkpoints written once per test session, and one persistent
JAX compilation cache for the whole run."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import pytest

import tiny

# One persistent compilation cache for the run, shared by this process and every process the
# tests start (CLI runs, Ray Serve replicas, the notebook's kernel: they read
# MAXDIFF_COMPILE_CACHE): a program the tiny checkpoints need compiles once per run instead of
# once per module and process. It lives outside the clone (MAXDIFF_TEST_CACHE, default
# ~/.cache/maxdiff/test-jax), so a later run on the same machine starts warm; modules that test
# the cache itself set their own. Entries are keyed by the program, jax version and device, so
# a changed model or jax never reads a stale one (a fresh run adds about 20 MB).
TEST_CACHE = Path(os.environ.get("MAXDIFF_TEST_CACHE",
                                 Path.home() / ".cache" / "maxdiff" / "test-jax"))
TEST_CACHE.mkdir(parents=True, exist_ok=True)
os.environ.setdefault("MAXDIFF_COMPILE_CACHE", str(TEST_CACHE))
jax.config.update("jax_compilation_cache_dir", os.environ["MAXDIFF_COMPILE_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@pytest.fixture(scope="session")
def compile_cache() -> Path:
    """The run's persistent compilation cache (for processes a test starts with its own env)."""
    return Path(os.environ["MAXDIFF_COMPILE_CACHE"])


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny diffusers runs take 0.1 s on one torch thread but up to 20 s on two busy
    cores; a module that compares against them asks for this."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
