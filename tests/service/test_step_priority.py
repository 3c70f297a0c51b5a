"""Priority classes on engine=step: with a low-class key keeping the queue full, a high-class
request takes the next free slot (the ingress's gate and the step engine's queue both order by
class)."""

from __future__ import annotations

import pytest

from .helpers import KEY_HIGH, KEY_LOW, SIZE, STEP_ARGS, high_among_low

pytest.importorskip("ray.serve")


@pytest.fixture(scope="module")
def step_keys(cluster, sdxl_dir, tmp_path_factory):
    """An engine=step application (two slots) whose keys have classes."""
    from ray import serve

    from serving.app import build_app

    state = tmp_path_factory.mktemp("step-keys")
    keys = state / "keys.txt"
    keys.write_text(f"{KEY_HIGH} priority=10\n{KEY_LOW}\n")
    serve.run(build_app({**STEP_ARGS, "model": str(sdxl_dir), "steps": 4, "guidance": 0.0,
                         "warmup_shapes": [f"{SIZE}x{SIZE}"], "max_queued_requests": -1,
                         "api_keys": str(keys), "jobs_db": str(state / "db.sqlite"),
                         "output_store": str(state / "outputs")}),
              name="stepkeys", route_prefix="/stepkeys")
    yield f"{cluster.url}/stepkeys"
    serve.delete("stepkeys")


def _waited(r) -> float:
    """Seconds a request waited before its image started: at the ingress's priority gate, then
    in the step engine's queue (the server's clocks)."""
    t = r.json()["timings"]
    return t["priority_wait_s"] + t["queue_s"]


def test_a_high_class_request_takes_the_next_free_slot(step_keys):
    """40 clients of the low key keep sending; one request of the high key then finishes
    ahead of the low requests queued before it, and waits for about one free slot where they
    wait for the ~30 ahead of them (first come, first served it would wait behind some 30).
    Waits are read from the server's clocks (``priority_wait_s`` + ``queue_s``), not from when
    this busy client saw answers come back."""
    high, sent, answered, low = high_among_low(step_keys, KEY_LOW, KEY_HIGH, per_client=6)
    overtaken = [r for start, end, r in low if start < sent and end > answered]
    assert len(overtaken) >= 8, (len(overtaken), len(low))
    waits = sorted(_waited(r) for r in overtaken)
    assert _waited(high) <= waits[len(waits) // 2] / 3, (_waited(high), waits)
