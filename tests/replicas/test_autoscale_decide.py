"""The autoscaling decision (replicas.autoscaling.decide), a pure function:
its properties under hypothesis, and its rules one by one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from replicas.autoscaling.decide import Sample, Signals, decide
from replicas.autoscaling.policy import Policy


@st.composite
def policies(draw):
    low = draw(st.integers(0, 6))
    high = draw(st.integers(max(low, 1), 12))
    return Policy(min=low, max=high, metric=draw(st.sampled_from(["requests", "engine_queue", "kv_usage"])),
                  target=draw(st.sampled_from([0.5, 0.8, 1.0, 2.0, 4.0, 5.0])),
                  up_after=draw(st.sampled_from([0.0, 2.0, 6.0, 30.0])),
                  down_after=draw(st.sampled_from([0.0, 10.0, 60.0])),
                  cooldown=draw(st.sampled_from([0.0, 5.0, 20.0, 300.0])),
                  max_step=draw(st.integers(1, 5)), zero_after=draw(st.sampled_from([10.0, 60.0, 300.0])))


@st.composite
def situations(draw, in_bounds=True):
    policy = draw(policies())
    at = 1_000_000.0
    wanted = draw(st.integers(policy.min, policy.max) if in_bounds else st.integers(0, 20))
    signals = Signals(
        at=at, wanted=wanted, ready=draw(st.integers(0, wanted)), inflight=draw(st.integers(0, 200)),
        held=draw(st.integers(0, 50) if wanted == 0 else st.just(0)),
        engine_waiting=draw(st.none() | st.integers(0, 100)), kv_usage=draw(st.none() | st.floats(0, 1)),
        stuck=draw(st.integers(0, 2)),
        last_request_at=draw(st.none() | st.floats(at - 1000, at)),
    )
    times = sorted(draw(st.lists(st.floats(at - 1000, at - 0.1), max_size=30)))
    history = [Sample(at=t, load=0, recommended=draw(st.integers(0, 15)), busy=draw(st.integers(0, 3)))
               for t in times]
    last = draw(st.none() | st.floats(at - 1000, at))
    return policy, signals, history, last


@settings(max_examples=400, deadline=None)
@given(situations())
def test_bounds_never_crossed(case):
    policy, signals, history, last = case
    decision = decide(policy=policy, signals=signals, history=history, last_change_at=last)
    if decision.changes:
        assert policy.min <= decision.to <= policy.max


@settings(max_examples=300, deadline=None)
@given(situations(in_bounds=False))
def test_a_count_outside_the_bounds_is_brought_inside(case):
    policy, signals, history, last = case
    decision = decide(policy=policy, signals=signals, history=history, last_change_at=last)
    if not policy.min <= signals.wanted <= policy.max:
        assert decision.rule == "bounds" and policy.min <= decision.to <= policy.max
    elif decision.changes:
        assert policy.min <= decision.to <= policy.max


@settings(max_examples=400, deadline=None)
@given(situations(), st.floats(0, 1))
def test_no_decision_inside_a_cooldown(case, fraction):
    policy, signals, history, _ = case
    last = signals.at - fraction * policy.cooldown * 0.999
    decision = decide(policy=policy, signals=signals, history=history, last_change_at=last)
    waking = signals.wanted == 0 and signals.busy > 0
    if policy.cooldown > 0 and not waking:
        assert not decision.changes, decision


@settings(max_examples=400, deadline=None)
@given(situations())
def test_step_is_bounded(case):
    policy, signals, history, last = case
    decision = decide(policy=policy, signals=signals, history=history, last_change_at=last)
    if decision.changes:
        assert decision.to != signals.wanted
        assert abs(decision.to - signals.wanted) <= policy.max_step


@settings(max_examples=300, deadline=None)
@given(situations())
def test_no_replicas_asked_for_while_some_wait_for_gpus(case):
    policy, signals, history, last = case
    decision = decide(policy=policy, signals=signals, history=history, last_change_at=last)
    if signals.stuck and signals.wanted > 0 and decision.changes:
        assert decision.to < signals.wanted or decision.rule == "bounds"


POLICY = Policy(min=1, max=8, target=4, up_after=6, down_after=60, cooldown=20, max_step=4, zero_after=300)


def _steady(policy, *, at, rec, busy=1, span=120.0, every=2.0):
    n = int(span / every)
    return [Sample(at=at - span + i * every, load=0, recommended=rec, busy=busy) for i in range(n)]


def test_a_step_scales_up_once_it_has_held_for_up_after():
    at = 10_000.0
    history = _steady(POLICY, at=at - 6, rec=1)
    quick = decide(policy=POLICY, signals=Signals(at=at, wanted=1, ready=1, inflight=16), history=history,
                   last_change_at=None)
    assert (quick.to, quick.rule) == (None, "up-pending")
    history += [Sample(at=at + t, load=16, recommended=4, busy=16) for t in (0, 2, 4)]
    held = decide(policy=POLICY, signals=Signals(at=at + 6, wanted=1, ready=1, inflight=16), history=history,
                  last_change_at=None)
    assert (held.to, held.rule) == (4, "up")
    assert "16 request(s) in flight and 0 held over 1 ready replica(s) for 6s, target 4 per replica" in held.reason


def test_a_spike_shorter_than_up_after_changes_nothing():
    at = 10_000.0
    history = _steady(POLICY, at=at, rec=1) + [Sample(at=at + 2, load=40, recommended=8, busy=40)]
    calm = decide(policy=POLICY, signals=Signals(at=at + 4, wanted=1, ready=1, inflight=2), history=history,
                  last_change_at=None)
    assert not calm.changes


def test_down_goes_to_the_highest_recommendation_of_the_window():
    at = 10_000.0
    history = _steady(POLICY, at=at, rec=2, span=70)
    history[-5] = Sample(at=history[-5].at, load=0, recommended=3, busy=9)
    d = decide(policy=POLICY, signals=Signals(at=at, wanted=4, ready=4, inflight=4), history=history,
               last_change_at=None)
    assert (d.to, d.rule) == (3, "down")


def test_zero_after_idle_and_wake_at_once():
    policy = Policy(min=0, max=4, target=4, zero_after=60, cooldown=30)
    at = 10_000.0
    idle = _steady(policy, at=at, rec=1, busy=0, span=90)
    gone = decide(policy=policy, signals=Signals(at=at, wanted=1, ready=1, last_request_at=at - 80), history=idle,
                  last_change_at=at - 500)
    assert (gone.to, gone.rule) == (0, "zero")
    recent = decide(policy=policy, signals=Signals(at=at, wanted=1, ready=1, last_request_at=at - 10), history=idle,
                    last_change_at=at - 500)
    assert not recent.changes
    woken = decide(policy=policy, signals=Signals(at=at + 1, wanted=0, ready=0, held=3), history=idle,
                   last_change_at=at)
    assert (woken.to, woken.rule) == (1, "wake")
    asleep = decide(policy=policy, signals=Signals(at=at + 100, wanted=0, ready=0), history=idle, last_change_at=at)
    assert not asleep.changes


def test_capacity_stops_the_pile_up():
    at = 10_000.0
    history = [Sample(at=at - t, load=40, recommended=8, busy=40) for t in range(0, 30, 2)]
    d = decide(policy=POLICY, signals=Signals(at=at, wanted=2, ready=1, inflight=40, stuck=1), history=history,
               last_change_at=None)
    assert (d.to, d.rule) == (None, "capacity")
    assert "1 replica(s) already wait for GPUs" in d.reason


def test_scale_down_choice_order():
    from replicas.autoscaling.choice import Candidate, scale_down_pick

    candidates = [Candidate(1, "ready", 0), Candidate(2, "ready", 3, wanted_for_pending=True),
                  Candidate(3, "starting"), Candidate(4, "pending"), Candidate(5, "ready", 0)]
    assert [c.replica_id for c in scale_down_pick(candidates, 5)] == [4, 3, 2, 5, 1]
    assert scale_down_pick(candidates, 0) == []


def _noisy_trace_direction_changes(policy: Policy, *, seed: int, level: float, minutes: float,
                                   service: float = 2.0) -> tuple[int, list[int]]:
    """bench/autoscale.py's noisy load, replayed through the decision alone: Poisson arrivals whose rate
    is redrawn every 5 s within +-30 % of ``level``, each request in flight ``service`` seconds, a look
    every second. Returns the direction changes and the counts the decision went through."""
    import random

    rng = random.Random(seed)
    end = minutes * 60
    starts, t, rate, next_change = [], 0.0, level, 0.0
    while t < end:
        if t >= next_change:
            rate, next_change = level * rng.uniform(0.7, 1.3), next_change + 5
        starts.append(t)
        t += rng.expovariate(rate)
    wanted, last_change, history, counts, first = 2, None, [], [2], 0
    for look in range(int(end)):
        while first < len(starts) and starts[first] + service <= look:
            first += 1
        inflight = sum(1 for s in starts[first:] if s <= look)
        decision = decide(policy=policy, signals=Signals(at=float(look), wanted=wanted, ready=wanted,
                                                          inflight=inflight, last_request_at=float(look)),
                          history=history, last_change_at=last_change)
        history = [*history[-600:], decision.sample]
        if decision.changes:
            wanted, last_change = decision.to, float(look)
            counts.append(wanted)
    steps = [b - a for a, b in zip(counts, counts[1:])]
    flips = sum(1 for a, b in zip(steps, steps[1:]) if (a > 0) != (b > 0))
    return flips, counts


@pytest.mark.parametrize("windows", [{}, {"up_after": 4, "down_after": 30}], ids=["default", "bench"])
@pytest.mark.parametrize("level", [3.0, 4.0, 5.0, 6.0])
def test_a_noisy_load_does_not_flap(level, windows):
    """The benchmark's noisy load (+-30 % around a level, redrawn every 5 s) for 30 minutes, six seeds per
    level, under the default windows (up_after 6 s, down_after 60 s) and under bench/autoscale.py's shorter
    ones (4 s, 30 s): at most one direction change per 5 minutes. (Without the scale-down's spare
    (decide.DOWN_SPARE), the shorter windows flapped up to 7 times in 30 minutes at 6/s.)"""
    policy = Policy(min=0, max=6, target=4, **windows)
    for seed in range(6):
        flips, counts = _noisy_trace_direction_changes(policy, seed=seed, level=level, minutes=30)
        assert flips <= 30 / 5, (seed, counts)
