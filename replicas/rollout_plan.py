"""A rollout's next move: a pure function over plain values.

``rollout_next`` looks at a model's replicas (which run the new revision,
which are ready, which are being replaced) and its rollout's settings, and
says which old replicas to start replacing now, which originals to stop now
and where the rollout stands, with the reason. ``replicas.rollout`` gathers
the inputs and persists what it says under the usual locks.

How a replica is replaced is how a drain moves one: it is marked
(``draining``: the model is one short, so the reconcile makes a replacement
of the new revision, and the original keeps serving); once enough replicas
are ready without it, it stops, after its in-flight requests.

- **Surge** (room for the replacements): at most ``max_surge`` replacements
  under way; an original stops only while the ready replicas that remain are
  at least the wanted count: never below it.
- **No room** (``stuck``: a replacement of the new revision fits nowhere and
  nothing is giving GPUs back): up to ``max_unavailable`` originals stop
  before their replacements are ready, to make room; with
  ``max_unavailable`` 0 the rollout waits for room.
- **Broken** (``failures`` of the new revision's replicas, never ready,
  reached ``max_failures``): the rollout fails; the originals being replaced
  stop being replaced and keep serving.
"""

from __future__ import annotations

from dataclasses import dataclass

PLACED = frozenset({"scheduled", "starting", "ready"})
WANTED = frozenset({"pending", *PLACED})


@dataclass(frozen=True, slots=True)
class Rep:
    id: int
    status: str
    current: bool  # runs the rollout's revision
    draining: bool = False
    rolling: bool = False  # being replaced by this rollout


@dataclass(frozen=True, slots=True)
class RolloutView:
    status: str  # "running", "paused" or "failed"
    wanted: int
    max_surge: int
    max_unavailable: int
    failures: int
    max_failures: int
    replicas: tuple[Rep, ...]
    stuck: str = ""  # why a replacement fits nowhere now ('' when room may come)


@dataclass(frozen=True, slots=True)
class Step:
    status: str  # "running", "paused", "failed" or "done"
    mark: tuple[int, ...] = ()  # old replicas whose replacement starts now
    stop: tuple[int, ...] = ()  # originals that stop now
    release: tuple[int, ...] = ()  # originals no longer replaced (a failed rollout)
    stop_new: tuple[int, ...] = ()  # replicas of the new revision not ready, given up (a failed rollout)
    waiting_for: str = ""
    reason: str = ""  # why the status changed, when it did
    updated: int = 0  # ready replicas on the new revision
    unavailable: int = 0  # originals stopped before their replacement was ready (no room)


def rollout_next(view: RolloutView) -> Step:
    reps = view.replicas
    updated = sum(1 for r in reps if r.current and r.status == "ready" and not r.draining)
    old = [r for r in reps if not r.current and r.status in PLACED]
    rolling = [r for r in old if r.rolling]
    if view.status == "failed":
        # Stays failed until an operator resumes, undoes or applies again.
        return Step("failed", release=tuple(r.id for r in rolling), updated=updated,
                    waiting_for="failed: the old revision serves; resume to try again, or undo")
    if view.failures >= view.max_failures > 0:
        given_up = tuple(r.id for r in reps if r.current and r.status in ("pending", "scheduled", "starting"))
        return Step("failed", release=tuple(r.id for r in rolling), stop_new=given_up, updated=updated,
                    reason=f"{view.failures} replica(s) of the new revision failed before becoming ready "
                    f"(the bound is {view.max_failures}); the old replicas keep serving")
    if not old:
        return Step("done", updated=updated, reason=f"{updated} of {view.wanted} replica(s) on the new revision")

    ready_kept = sum(1 for r in reps if r.status == "ready" and not r.draining)
    ready_rolling = sorted((r for r in rolling if r.status == "ready"), key=lambda r: r.id)
    idle_rolling = [r.id for r in rolling if r.status != "ready"]  # serving nothing: stop at once
    floor = view.wanted
    no_room = bool(view.stuck) and view.max_unavailable > 0
    if no_room:
        floor = max(0, view.wanted - view.max_unavailable)
    can_stop = max(0, min(len(ready_rolling), ready_kept + len(ready_rolling) - floor))
    stop = tuple(idle_rolling + [r.id for r in ready_rolling[:can_stop]])
    unavailable = max(0, min(can_stop, view.wanted - ready_kept)) if no_room else 0

    mark: tuple[int, ...] = ()
    if view.status == "running":
        allowance = max(view.max_surge, view.max_unavailable) if no_room else view.max_surge
        kept = sum(1 for r in reps if r.status in WANTED and not r.draining)
        in_flight = sum(1 for r in reps if r.draining and r.status in PLACED) - len(stop)
        expected_total = max(kept, view.wanted) + in_flight
        room = view.wanted + allowance - expected_total
        candidates = sorted((r for r in old if not r.draining), key=lambda r: (r.status == "ready", r.id))
        mark = tuple(r.id for r in candidates[: max(0, room)])

    remaining = len(old) - len(stop)
    if view.status == "paused":
        waiting = f"paused: {remaining} old replica(s) left; replacements under way finish"
    elif view.stuck and view.max_unavailable == 0:
        waiting = f"no room for a replacement ({view.stuck}) and max_unavailable is 0: waiting for room"
    elif view.stuck:
        waiting = (f"no room for a replacement ({view.stuck}): replacing up to {view.max_unavailable} "
                   f"at a time with the original stopped first")
    else:
        waiting = (f"{updated} of {view.wanted} ready on the new revision, {remaining} old replica(s) left: "
                   "waiting for replacements to become ready")
    return Step(view.status, mark=mark, stop=stop, waiting_for=waiting, updated=updated, unavailable=unavailable)
