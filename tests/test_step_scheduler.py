"""The step engine's host-only scheduler (pipelines/step_scheduler.py): queue, slots, (b, g)
shapes, queue positions, cancels, aborts and the admission policies, without JAX or a model."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pipelines.requests import ImageRequest
from pipelines.step_scheduler import (
    Fifo,
    Handle,
    ShortestRemainingSteps,
    SlotScheduler,
    batch_sizes,
    make_policy,
    step_shapes,
)

ROOT = Path(__file__).resolve().parent.parent


def _h(steps: int, guidance: float = 0.0, name: str = "") -> Handle:
    return Handle(request=ImageRequest(name or f"{steps} steps", guidance_scale=guidance, seed=0),
                  steps=steps)


def _tick(s: SlotScheduler) -> tuple[list[Handle], list[Handle]]:
    """What StepEngine.tick asks of its scheduler (no device): (admitted, finished)."""
    s.reap_cancelled()
    admitted, _, _ = s.admit()
    s.report_queue_positions()
    plan = s.plan_step()
    finishing = s.stepped(plan)[0] if plan is not None else []
    s.finished(finishing, [None] * len(finishing))
    return admitted, finishing


def _admission_order(policy, jobs: list[tuple[int, int]], slots: int = 1) -> list[str]:
    """Submit ``(tick, steps)`` jobs at their ticks; the order images took slots in."""
    s = SlotScheduler(slots, 1, 50, policy=policy)
    order, t = [], 0
    pending = sorted(enumerate(jobs), key=lambda kj: kj[1][0])
    while pending or s.queued or s.active:
        while pending and pending[0][1][0] <= t:
            k, (_, steps) = pending.pop(0)
            s.submit(_h(steps, name=f"j{k}"))
        admitted, _ = _tick(s)
        order += [h.request.prompt for h in admitted]
        t += 1
    return order


def test_importing_and_running_the_scheduler_loads_no_jax():
    script = textwrap.dedent("""
        import sys
        from pipelines.requests import ImageRequest
        from pipelines.step_scheduler import Handle, SlotScheduler
        for policy in ("fifo", "srs"):
            s = SlotScheduler(2, 1, 10, policy=policy)
            hs = [s.submit(Handle(ImageRequest("x", seed=k, guidance_scale=k), steps=2 + k))
                  for k in range(4)]
            s.cancel(hs[3])
            while s.queued or s.active:
                s.reap_cancelled(); s.admit(); s.report_queue_positions()
                plan = s.plan_step()
                if plan is not None:
                    done, _ = s.stepped(plan); s.finished(done, [None] * len(done))
            assert [h.status for h in hs] == ["done"] * 3 + ["cancelled"], hs
        print("jax" in sys.modules, "jaxlib" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_shapes():
    assert batch_sizes(8, 1) == [1, 2, 4, 8] and batch_sizes(6, 2) == [2, 4, 6]
    assert step_shapes([1, 2], cfg=True) == [(1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    assert step_shapes([1, 2, 4, 8], cfg=False) == [(1, 0), (2, 0), (4, 0), (8, 0)]
    assert len(step_shapes([1, 2, 4, 8], cfg=True)) == 4 * 7 // 2  # |B| (|B| + 3) / 2


def test_plan_gathers_guided_slots_first_into_the_smallest_shape():
    s = SlotScheduler(8, 1, 20, variant_of=lambda steps: int(steps > 3))
    hs = [s.submit(_h(steps, g)) for steps, g in [(4, 0.0), (6, 3.0), (2, 0.0), (3, 5.0),
                                                  (5, 0.0)]]
    take, free, b = s.admit()
    assert take == hs and free == [0, 1, 2, 3, 4] and b == 8
    plan = s.plan_step()
    assert (plan.b, plan.g, plan.guided) == (8, 2, 2)
    assert list(plan.rows[:5]) == [1, 3, 0, 2, 4] and set(plan.rows[5:]) == {5, 6, 7}
    assert list(plan.active) == [True] * 5 + [False] * 3
    # a k-step image starts at table index max_steps - k
    assert list(plan.index[:5]) == [14, 17, 16, 18, 15] and not plan.local.any()
    assert list(plan.variant[:5]) == [1, 0, 1, 0, 1]  # each row's own length: 6, 3, 4, 2, 5
    finishing, previewed = s.stepped(plan)
    assert finishing == [] and previewed == [] and [h.dispatched for h in hs] == [1] * 5
    assert s.stats["guided_slot_steps"] == 2 and s.stats["tick_images"] == {"5": 1}
    plan = s.plan_step()
    assert list(plan.local[:5]) == [1] * 5 and list(plan.index[:2]) == [15, 18]
    finishing, _ = s.stepped(plan)
    assert finishing == [hs[2]] and hs[2].slot == 2 and s.active == 4  # its slot is free
    assert s.plan_step().b == 4  # four images left: the 4-row program


def test_an_image_is_guided_until_its_cfg_cutoff():
    """``cfg_cutoff``: an image's steps are guided (negative rows) for its first
    ``floor(cutoff * steps)`` steps only; past them it leaves the guided rows, and the next
    guided image goes first."""
    s = SlotScheduler(4, 1, 20)
    cut = s.submit(Handle(request=ImageRequest("cut", guidance_scale=5.0, seed=0,
                                                cfg_cutoff=0.5), steps=5))
    full = s.submit(_h(5, 5.0, "full"))
    s.admit()
    guided = []
    for _ in range(5):
        plan = s.plan_step()
        guided.append((plan.g, plan.guided, [h.request.prompt for h in plan.handles]))
        s.stepped(plan)
    # floor(0.5 * 5) = 2 guided steps, then the conditional pass alone
    assert guided[:2] == [(2, 2, ["cut", "full"])] * 2
    assert guided[2:] == [(1, 1, ["full", "cut"])] * 3
    assert s.stats["guided_slot_steps"] == 2 + 5 and cut.dispatched == full.dispatched == 5


def test_fifo_positions_cancel_and_abort():
    s = SlotScheduler(2, 1, 10)
    a, b, c, d = (s.submit(_h(3)) for _ in range(4))
    assert [h.id for h in (a, b, c, d)] == [1, 2, 3, 4]
    _tick(s)
    assert (a.status, b.status, c.queue_position, d.queue_position) == ("running", "running", 1, 2)
    assert s.queue_position(d) == 2 and s.queue_position(a) == 0
    s.cancel(c)
    s.cancel(a)
    assert [h.id for h in s.reap_cancelled()] == [3, 1] and c.status == a.status == "cancelled"
    assert s.report_queue_positions() == [d] and d.queue_position == 1
    lost = s.abort()
    assert {h.id for h in lost} == {2, 4} and s.queued == s.active == 0
    assert s.stats["cancelled"] == 4 and s.stats["submitted"] == 4
    s.cancel(b)  # done: nothing happens
    assert not b.cancel_requested


def test_fifo_admits_in_submission_order():
    # a 10-step image, then short ones arriving while it runs, in one slot
    jobs = [(0, 10), (1, 8), (2, 2), (3, 1)]
    assert _admission_order("fifo", jobs) == ["j0", "j1", "j2", "j3"]


def test_srs_admits_the_fewest_steps_first():
    jobs = [(0, 10), (1, 8), (2, 2), (3, 1)]
    # j0 holds the slot; when it leaves j1 (8) has waited 9 ticks, j2 (2) 8, j3 (1) 7:
    # priorities 8 - 9 = -1, 2 - 8 = -6, 1 - 7 = -6 (tie: submission order)
    assert _admission_order("srs", jobs) == ["j0", "j2", "j3", "j1"]
    s = SlotScheduler(1, 1, 20, policy="srs")
    hs = [s.submit(_h(k)) for k in (9, 3, 5, 1)]
    assert [s.queue_position(h) for h in hs] == [4, 2, 3, 1]


def test_srs_aging_bounds_the_wait_of_a_long_image():
    """A steady stream of 1-step images passes a 6-step one until it has waited
    aging_ticks * (6 - 1) ticks; from then on no image submitted later passes it: it takes the
    slot after the one short image queued before that."""
    for aging in (1, 2):
        s = SlotScheduler(1, 1, 20, policy=ShortestRemainingSteps(aging_ticks=aging))
        s.submit(_h(1, name="first"))
        long = s.submit(_h(6, name="long"))
        t = 0
        while long.status == "queued":
            s.submit(_h(1, name=f"short{t}"))  # one new short image per tick
            _tick(s)
            t += 1
        assert long.waited_ticks == aging * 5 + 1, aging
        # FIFO would have admitted it at once after "first"; no aging would starve it forever
    fifo = SlotScheduler(1, 1, 20, policy="fifo")
    fifo.submit(_h(1))
    long = fifo.submit(_h(6))
    _tick(fifo)
    fifo.submit(_h(1))
    _tick(fifo)
    assert long.status == "running" and long.waited_ticks == 1


def test_policy_names_and_errors():
    assert isinstance(make_policy("fifo"), Fifo) and make_policy("srs").aging_ticks == 1.0
    p = ShortestRemainingSteps(3)
    assert make_policy(p) is p
    with pytest.raises(ValueError, match=r"policy='lifo'; use one of 'fifo', 'srs'"):
        make_policy("lifo")
    with pytest.raises(ValueError, match=r"aging_ticks=0; it must be a number > 0"):
        ShortestRemainingSteps(0)
    with pytest.raises(ValueError, match="multiple of the mesh size 2"):
        SlotScheduler(3, 2, 10)
    assert np.array_equal(SlotScheduler(4, 2, 10).batch_sizes, [2, 4])


@pytest.mark.parametrize("policy", ["fifo", "srs"])
def test_classes_go_first_and_age(policy):
    """A higher class is admitted before every lower one queued before it, under either
    policy; a low-class image that waited CLASS_AGING_TICKS ticks per class goes first."""
    from pipelines.step_scheduler import CLASS_AGING_TICKS

    s = SlotScheduler(1, 1, 50, policy=policy)
    s.submit(_h(3, name="running"))
    _tick(s)  # it holds the only slot for three ticks
    for name in ("low-1", "low-2"):
        s.submit(_h(3, name=name))
    high = _h(3, name="high")
    high.priority = 5
    s.submit(high)
    assert s.queue_position(high) == 1
    order = []
    while s.queued or s.active:
        order += [h.request.prompt for h in _tick(s)[0]]
    assert order == ["high", "low-1", "low-2"]
    aged = SlotScheduler(1, 1, 50, policy=policy)
    aged.submit(_h(1, name="running"))
    _tick(aged)
    old = aged.submit(_h(1, name="old"))
    old.waited_ticks = 3 * CLASS_AGING_TICKS  # as if it had waited that long
    new = _h(1, name="new")
    new.priority = 2
    aged.submit(new)
    assert [h.request.prompt for h in _tick(aged)[0]] == ["old"]
