"""Shared fixtures: tiny random checkpoints written once per test session, one persistent JAX
compilation cache for the whole run, XLA's CPU backend at -O0; the groups that
``pytest -n 2 --dist loadgroup`` (``make test``) hands to its workers whole are
``xdist_groups``'."""

from __future__ import annotations

import os
from pathlib import Path

# XLA's CPU backend at -O0 for this process and every process it starts (CLI runs, Ray Serve
# replicas, the notebook's kernel inherit XLA_FLAGS): on the tiny checkpoints a cold compile is
# most of a test's time, and -O0 halves it (docs/development.md). The parity tests compare against PyTorch
# with tolerances, the bit-equality tests compare runs of one run's processes with each other;
# the shipped default is what tests/test_cli.py's installed-copy run and
# tests/test_pipeline.py::test_the_shipped_xla_optimisation_level_agrees exercise.
# MAXDIFF_TEST_XLA_FLAGS replaces the addition ("" runs the whole suite at XLA's defaults).
SHIPPED_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
_ADDED = os.environ.get("MAXDIFF_TEST_XLA_FLAGS", "--xla_backend_optimization_level=0")
os.environ["XLA_FLAGS"] = f"{SHIPPED_XLA_FLAGS} {_ADDED}".strip()
# Every program goes to the run's compilation cache (below), however fast it compiled: at -O0
# many of the tiny models' programs compile in under the second the pipelines' default asks
# for (pipelines.text_to_image.enable_compile_cache), so they compiled again in every process
# and every run. JAX reads this variable when it is imported, here and in every process the
# tests start, and enable_compile_cache leaves it alone.
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# The suite runs on the CPU. libtpu (the test extra, for compiling TPU programs without a chip:
# tests/test_tpu.py) would otherwise be tried as a backend by every process, which prints
# warnings; TPU topologies still compile with this set.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu takes a lock file that lets one process at a time load it; the suite's two workers (and
# a benchmark compiling beside it) only compile with it, never touch a chip.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Nothing in the suite downloads: a Hugging Face model name that is not in a test's own cache
# is an error (maxdiff.hub), never a request to the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def shipped_env(pythonpath, **extra: str) -> dict:
    """The environment of a process the tests start as a user would run it: XLA's shipped
    flags (not the suite's -O0), ``pythonpath`` the code it imports, ``extra`` variables."""
    return dict(os.environ, XLA_FLAGS=SHIPPED_XLA_FLAGS, PYTHONPATH=str(pythonpath), **extra)


import jax  # noqa: E402  (after XLA_FLAGS: the backend reads them when it starts)
import pytest  # noqa: E402
import tiny  # noqa: E402
from xdist_groups import (  # noqa: E402, F401  (pytest hooks: the workers' groups)
    pytest_collection_modifyitems,
    pytest_xdist_make_scheduler,
)

# One persistent compilation cache for the run, shared by this process and every process the
# tests start (CLI runs, Ray Serve replicas, the notebook's kernel: they read
# MAXDIFF_COMPILE_CACHE): a program the tiny checkpoints need compiles once per run instead of
# once per module and process. It lives outside the clone (MAXDIFF_TEST_CACHE, default
# ~/.cache/maxdiff/test-jax), so a later run on the same machine starts warm; modules that test
# the cache itself set their own. Entries are keyed by the program, jax version and device, so
# a changed model or jax never reads a stale one.
TEST_CACHE = Path(os.environ.get("MAXDIFF_TEST_CACHE",
                                 Path.home() / ".cache" / "maxdiff" / "test-jax"))
TEST_CACHE.mkdir(parents=True, exist_ok=True)
os.environ.setdefault("MAXDIFF_COMPILE_CACHE", str(TEST_CACHE))
jax.config.update("jax_compilation_cache_dir", os.environ["MAXDIFF_COMPILE_CACHE"])
assert jax.config.jax_persistent_cache_min_compile_time_secs == 0


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


@pytest.fixture(scope="session")
def refiner_dir(tmp_path_factory):
    """A tiny SDXL refiner folder (text_encoder_2 only, five time ids), torch seed 5."""
    path = tmp_path_factory.mktemp("tiny-sdxl-refiner")
    tiny.make_sdxl_refiner(path)
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
