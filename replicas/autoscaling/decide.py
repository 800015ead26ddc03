"""The autoscaling decision: a pure function of the signals, the policy and
the recent history of the model's samples. No I/O, no clock: ``at`` is given.

Rules, in order (the first that applies decides):

1. ``bounds``: a count outside [min, max] (bounds just changed) moves inside.
2. ``wake``: a model at zero with requests held or in flight gets replicas at
   once, cooldown or not (its clients are waiting).
3. ``cooldown``: nothing changes within ``cooldown`` seconds of the last change.
4. ``capacity``: while a replica of the model waits for GPUs, no more are asked
   for (pending replicas never pile up).
5. ``up``: the recommended count has been above the current one for
   ``up_after`` seconds: up to the lowest count recommended over that window.
6. ``zero``: min 0, no request for ``zero_after`` seconds: to zero.
7. ``down``: the count recommended with ``DOWN_SPARE`` to spare has been
   below the current one for ``down_after`` seconds: down to the highest such
   count over that window (Kubernetes' HPA: scale down to the highest
   recommendation of the stabilization window).

Every step is at most ``max_step`` replicas (bounds excepted). The
recommendation is ceil(load / target), within [max(min, 1), max] (while the
model has replicas); zero is reached only by the ``zero`` rule.

Scaling up and scaling down do not meet at one threshold: a count goes up
as soon as the load holds above count x target, and comes down only to a
count that carries the load with ``DOWN_SPARE`` of the target to spare.
Without that band a load that sits on the boundary between two counts,
with noise around it, goes up on a few seconds above and down on a quiet
half-minute, again and again (replayed in the decide tests: bench/autoscale.py's
noisy load under 4 s / 30 s windows flapped up to 7 times in 30 minutes;
with the band, not once).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .policy import METRICS, Policy

# The share of the target a count must leave free before the model scales down to it.
DOWN_SPARE = 0.2


@dataclass(frozen=True)
class Signals:
    at: float  # unix seconds
    wanted: int  # the model's replica count now
    ready: int
    inflight: int = 0  # requests in flight at every gateway process, summed
    held: int = 0  # requests held at the gateways (a model at zero, or starting)
    engine_waiting: int | None = None  # the engines' waiting queues, summed over ready replicas
    engine_running: int | None = None
    kv_usage: float | None = None  # mean KV-cache use of the ready replicas (0-1)
    stuck: int = 0  # replicas of the model that wait for GPUs (placement failed)
    last_request_at: float | None = None  # the latest request any gateway saw for the model

    @property
    def busy(self) -> int:
        return self.inflight + self.held


@dataclass(frozen=True)
class Sample:
    """One tick's reading, kept in the history (and drawn on the model's page)."""

    at: float
    load: float  # the metric's value (a total: requests, queue; a fraction: KV)
    recommended: int
    busy: int = 0
    wanted: int = 0
    ready: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Decision:
    rule: str
    reason: str
    sample: Sample
    to: int | None = None  # None: no change

    @property
    def changes(self) -> bool:
        return self.to is not None


def metric_load(policy: Policy, s: Signals) -> float:
    if policy.metric == "requests":
        return float(s.busy)
    if policy.metric == "engine_queue":
        # Held requests wait too: a model at zero has no engine to queue them.
        return float((s.engine_waiting or 0) + s.held)
    return float(s.kv_usage or 0.0)


def recommend(policy: Policy, s: Signals, load: float) -> int:
    if policy.metric == "kv_usage":
        raw = math.ceil(s.ready * load / policy.target - 1e-9) if s.ready else (1 if s.busy else 0)
    else:
        raw = math.ceil(load / policy.target - 1e-9)
    # At least one while the model has any (zero is the ``zero`` rule's), none at zero.
    return min(max(raw, policy.min, 1 if s.wanted > 0 else 0), policy.max)


def recommend_down(policy: Policy, sample: Sample) -> int:
    """The count a scale-down may go to for one sample: its load over the target less ``DOWN_SPARE``
    (never below the sample's own recommendation)."""
    target = policy.target * (1 - DOWN_SPARE)
    if policy.metric == "kv_usage":
        raw = math.ceil(sample.ready * sample.load / target - 1e-9) if sample.ready else (1 if sample.busy else 0)
    else:
        raw = math.ceil(sample.load / target - 1e-9)
    floor = 1 if sample.wanted > 0 else 0
    return max(sample.recommended, min(max(raw, policy.min, floor), policy.max))


def _describe_load(policy: Policy, s: Signals, load: float) -> str:
    if policy.metric == "requests":
        return f"{s.inflight} request(s) in flight and {s.held} held over {s.ready} ready replica(s)"
    if policy.metric == "engine_queue":
        return (f"{load:g} request(s) waiting in the engines' queues (and the gateways') over {s.ready} ready "
                f"replica(s)")
    return f"KV-cache use {load:.0%} over {s.ready} ready replica(s)"


def _target(policy: Policy) -> str:
    return f"target {policy.target:g} " + ("KV use" if policy.metric == "kv_usage" else "per replica")


def _held_since(history: list[Sample], now: Sample, above: bool, current: int,
                policy: Policy) -> tuple[float, list[Sample]]:
    """How long the recommendation has been on one side of ``current`` (below: the
    scale-down's, with ``DOWN_SPARE``), without a break, and the samples of that run (newest first)."""
    run = [now]
    for sample in reversed(history):
        if sample.at > now.at:
            continue
        if (sample.recommended > current) if above else (recommend_down(policy, sample) < current):
            run.append(sample)
        else:
            break
    return run[-1].at, run


def decide(*, policy: Policy, signals: Signals, history: list[Sample], last_change_at: float | None) -> Decision:
    s, p = signals, policy
    current = s.wanted
    load = metric_load(p, s)
    rec = recommend(p, s, load)
    sample = Sample(at=s.at, load=round(load, 4), recommended=rec, busy=s.busy, wanted=current, ready=s.ready)
    said = _describe_load(p, s, load)

    def change(to: int, rule: str, why: str) -> Decision:
        return Decision(rule=rule, to=to, sample=sample, reason=f"{current} -> {to} replicas: {why}")

    def keep(rule: str, why: str) -> Decision:
        return Decision(rule=rule, sample=sample, reason=why)

    if current < p.min or current > p.max:
        to = min(max(current, p.min), p.max)
        return change(to, "bounds", f"the policy's bounds are {p.min}-{p.max}")
    if current == 0 and s.busy > 0:
        to = min(max(rec, 1), p.max, p.max_step)
        return change(to, "wake", f"{s.held} request(s) held and {s.inflight} in flight for a model at zero")
    if last_change_at is not None and s.at - last_change_at < p.cooldown:
        return keep("cooldown", f"{said}; within the {p.cooldown:g}s cooldown of the last change "
                    f"({s.at - last_change_at:.0f}s ago)")
    if rec > current and s.stuck:
        return keep("capacity", f"{said}, {_target(p)}, would want {rec}; but {s.stuck} replica(s) already "
                    "wait for GPUs, so no more are asked for")
    if rec > current:
        since, run = _held_since(history, sample, True, current, p)
        held = s.at - since
        if held >= p.up_after:
            floor = min(x.recommended for x in run if x.at >= s.at - p.up_after)
            to = min(floor, current + p.max_step, p.max)
            return change(to, "up", f"{said} for {held:.0f}s, {_target(p)}")
        return keep("up-pending", f"{said}, {_target(p)}: {rec} wanted for {held:.0f}s of {p.up_after:g}s")
    if p.min == 0 and current > 0 and s.busy == 0:
        quiet = s.at - s.last_request_at if s.last_request_at is not None else None
        covered = [x for x in history if x.at >= s.at - p.zero_after]
        spans = bool(history) and min(x.at for x in history) <= s.at - p.zero_after
        if spans and all(x.busy == 0 for x in covered) and (quiet is None or quiet >= p.zero_after):
            to = max(0, current - p.max_step)
            return change(to, "zero", f"no request for {p.zero_after:g}s (min 0)")
    down = recommend_down(p, sample)
    if down < current:
        since, run = _held_since(history, sample, False, current, p)
        held = s.at - since
        if held >= p.down_after:
            ceiling = max(recommend_down(p, x) for x in run if x.at >= s.at - p.down_after)
            to = max(ceiling, current - p.max_step, p.min)
            return change(to, "down", f"{said} for {held:.0f}s, {_target(p)} with {DOWN_SPARE:.0%} to spare")
        return keep("down-pending", f"{said}, {_target(p)}: {down} enough for {held:.0f}s of {p.down_after:g}s")
    if rec < current:
        return keep("steady", f"{said}, {_target(p)}: {rec} would do, but without {DOWN_SPARE:.0%} of the target "
                    "to spare (no scale-down)")
    return keep("steady", f"{said}, {_target(p)}")


def unit(policy: Policy) -> str:
    return METRICS[policy.metric][1]
