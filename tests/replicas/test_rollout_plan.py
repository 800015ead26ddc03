"""The rollout's step function (replicas.rollout_plan), alone: plain values in,
a decision out."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.rollout_plan import Rep, RolloutView, rollout_next


def view(reps, *, wanted=4, surge=1, unavailable=1, status="running", failures=0, max_failures=3, stuck=""):
    return RolloutView(status=status, wanted=wanted, max_surge=surge, max_unavailable=unavailable,
                       failures=failures, max_failures=max_failures, replicas=tuple(reps), stuck=stuck)


def old(n, start=1, **kw):
    return [Rep(i, "ready", False, **kw) for i in range(start, start + n)]


def test_first_step_marks_max_surge_originals_and_stops_none():
    step = rollout_next(view(old(4), surge=2))
    assert step.status == "running"
    assert step.mark == (1, 2)
    assert step.stop == ()


def test_an_original_stops_only_once_its_replacement_is_ready():
    reps = [Rep(1, "ready", False, True, True), *old(3, start=2), Rep(10, "starting", True)]
    step = rollout_next(view(reps))
    assert step.stop == () and step.mark == ()  # one in flight already (max_surge 1)
    reps[-1] = Rep(10, "ready", True)
    step = rollout_next(view(reps))
    assert step.stop == (1,)
    assert step.mark == (2,)  # the next one starts in the same step
    assert step.updated == 1


def test_not_ready_originals_are_replaced_first_and_stopped_at_once():
    reps = [*old(3), Rep(4, "starting", False)]
    assert rollout_next(view(reps)).mark == (4,)
    reps[-1] = Rep(4, "starting", False, True, True)
    assert rollout_next(view(reps)).stop == (4,)


def test_no_room_stops_up_to_max_unavailable_before_the_replacement():
    reps = [Rep(1, "ready", False, True, True), Rep(2, "ready", False, True, True), *old(2, start=3),
            Rep(10, "pending", True), Rep(11, "pending", True)]
    step = rollout_next(view(reps, surge=1, unavailable=2, stuck="no node has 8 free GPUs"))
    assert set(step.stop) == {1, 2}
    assert step.unavailable == 2
    assert "no room" in step.waiting_for
    step = rollout_next(view(reps, surge=1, unavailable=1, stuck="no node has 8 free GPUs"))
    assert len(step.stop) == 1


def test_no_room_and_max_unavailable_zero_waits():
    reps = [Rep(1, "ready", False, True, True), *old(3, start=2), Rep(10, "pending", True)]
    step = rollout_next(view(reps, unavailable=0, stuck="no node has 8 free GPUs"))
    assert step.stop == () and step.mark == ()
    assert "max_unavailable is 0" in step.waiting_for


def test_failures_at_the_bound_fail_it_and_release_the_originals():
    reps = [Rep(1, "ready", False, True, True), *old(3, start=2), Rep(10, "starting", True)]
    step = rollout_next(view(reps, failures=3, max_failures=3))
    assert step.status == "failed"
    assert step.release == (1,)
    assert step.stop_new == (10,)
    assert step.stop == () and step.mark == ()
    assert "3 replica(s)" in step.reason


def test_paused_marks_nothing_new_but_finishes_what_is_under_way():
    reps = [Rep(1, "ready", False, True, True), *old(3, start=2), Rep(10, "ready", True)]
    step = rollout_next(view(reps, status="paused"))
    assert step.status == "paused"
    assert step.stop == (1,)
    assert step.mark == ()


def test_done_when_no_old_replica_is_placed():
    reps = [Rep(i, "ready", True) for i in range(4)] + [Rep(9, "stopping", False)]
    step = rollout_next(view(reps))
    assert step.status == "done"
    assert step.updated == 4


@settings(max_examples=300, deadline=None)
@given(
    wanted=st.integers(1, 6), surge=st.integers(1, 3), unavailable=st.integers(0, 3), stuck=st.booleans(),
    states=st.lists(st.tuples(st.sampled_from(["pending", "scheduled", "starting", "ready"]), st.booleans(),
                              st.booleans()), min_size=1, max_size=10),
)
def test_ready_never_drops_below_the_floor(wanted, surge, unavailable, stuck, states):
    """Whatever the replicas, the ready ones left after the step's stops are
    at least the wanted count (surge), or the wanted count less
    max_unavailable (no room), or were already fewer and lose none."""
    reps = [Rep(i, s, current, draining=(rolling and not current), rolling=(rolling and not current))
            for i, (s, current, rolling) in enumerate(states)]
    step = rollout_next(view(reps, wanted=wanted, surge=surge, unavailable=unavailable,
                             stuck="full" if stuck else ""))
    ready_before = sum(1 for r in reps if r.status == "ready")
    stopped_ready = sum(1 for r in reps if r.id in step.stop and r.status == "ready")
    floor = wanted - (unavailable if stuck else 0)
    assert ready_before - stopped_ready >= min(floor, ready_before)
    # Only originals being replaced are stopped, only old unmarked ones are marked.
    assert all(r.rolling for r in reps if r.id in step.stop)
    assert all(not r.current and not r.draining for r in reps if r.id in step.mark)
    in_flight = sum(1 for r in reps if r.draining and r.id not in step.stop) + len(step.mark)
    assert len(step.mark) == 0 or in_flight <= max(surge, unavailable if stuck else 0) + max(
        0, sum(1 for r in reps if r.draining) - len(step.stop))
