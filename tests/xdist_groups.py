"""How ``make test`` (pytest-xdist, ``-n 2 --dist loadgroup``) splits the suite between its two
workers: a group runs whole on one worker, so its module-scoped fixtures (a compiled pipeline, a
PyTorch reference) are built once. Every module is its own group; ``tests/service`` is two
groups, each sharing the package's fixtures (one Ray cluster per worker, the applications its
modules use): :data:`SERVICE_STEP`'s modules use the engine=step and multi-model applications,
the others the main, guarded and ControlNet ones. :data:`HEAVY` goes first, so the long groups
start at once and the short ones fill the other worker (the groups over 150 worker-seconds,
slow tests included as ``make test-all`` runs them, longest first). ``tests/conftest.py``
registers these hooks."""

from __future__ import annotations

from pathlib import Path

import pytest

SERVICE_STEP = ("test_step_serving", "test_multi_model", "test_cost", "test_metrics",
                "test_step_priority")
HEAVY = ("service", "service-step", "test_readme", "test_tpu", "test_step_engine", "test_pipeline",
         "test_feature_cache", "test_cli", "test_controlnet_pipeline", "test_quantization",
         "test_demo_model", "test_edit", "test_sd_pipeline", "test_ip_adapter", "test_benchmarks",
         "test_refiner", "test_hires")


def group(nodeid: str) -> str:
    """The xdist group of a test, from its node id."""
    path = Path(nodeid.split("::", 1)[0])
    if path.parent.name == "service":
        return "service-step" if path.stem in SERVICE_STEP else "service"
    return path.stem


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With --dist loadgroup, a scheduler that groups by :func:`group`. xdist's own loadgroup
    reads ``xdist_group`` markers by appending the group to ``item._nodeid``, which pytest 9.2's
    node ids no longer read: with the markers alone no test had a group, and every module's
    fixtures were built on both workers."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group(nodeid)

    return ByGroup(config, log)


def pytest_collection_modifyitems(config, items):
    rank = {g: i for i, g in enumerate(HEAVY)}
    # a stable sort: the heavy groups first in HEAVY's order, then the rest as collected (the
    # scheduler hands groups out in this order with --no-loadscope-reorder)
    items.sort(key=lambda it: rank.get(group(it.nodeid), len(HEAVY)))
