"""A real headless Chromium for end-to-end tests of the playground, driven by Playwright.

Playwright's own browser download cannot run here (no network to its CDN), so the tests use
Debian's ``chromium`` package through ``executable_path``: found on the PATH (or
``MAXDIFF_CHROMIUM``), else installed with apt-get when the tests run as root. Where neither
works the tests are skipped with the reason, loudly (a warning as well as the skip), except
where ``CI`` is set (``.ci/run`` sets it): there they fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Chromium as root, headless, on a machine with a closed network: no sandbox (root), no
# background connections (each would be refused and retried)
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage"]


def _find() -> str | None:
    path = os.environ.get("MAXDIFF_CHROMIUM")
    if path:
        return path if os.access(path, os.X_OK) else None
    return next((p for p in map(shutil.which, NAMES) if p), None)


def chromium() -> tuple[str | None, str]:
    """(path to a Chromium, how it was found) or (None, why there is none)."""
    path = _find()
    if path:
        return path, "found"
    if not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get")):
        return None, ("no Chromium on this machine and no way to install it (needs root and "
                      "apt-get); install Debian's 'chromium' package or set MAXDIFF_CHROMIUM")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log = []
    for cmd in (["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"],
                ["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"]):
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.append(f"{' '.join(cmd)}: {e}")
            continue
        log.append(f"{' '.join(cmd)}: exit {r.returncode} {r.stderr.strip()[-300:]}")
        if cmd[1] == "install" and r.returncode == 0 and _find():
            return _find(), "installed with apt-get"
    return None, "Chromium could not be installed: " + " | ".join(log)


def launch(playwright):
    """A headless Chromium browser, or pytest.skip with the reason (also as a warning)."""
    import pytest

    path, how = chromium()
    if path is None:
        if os.environ.get("CI"):  # CI must run them: a missing browser is a failure there
            pytest.fail(f"BROWSER TESTS CANNOT RUN (CI is set): {how}")
        warnings.warn(f"BROWSER TESTS SKIPPED: {how}", stacklevel=2)
        pytest.skip(f"BROWSER TESTS SKIPPED: {how}")
    return playwright.chromium.launch(executable_path=path, headless=True, args=ARGS)
