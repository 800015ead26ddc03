"""Which replicas go when an autoscaled model scales down. Small and pure:
the cheapest to give up first: a replica not placed yet, then one still
starting (it serves nobody), then a ready one whose node another model's
pending replica is waiting for, then the ready one with the fewest
requests in flight; among equals, the newest."""

from __future__ import annotations

from dataclasses import dataclass

ORDER = {"pending": 0, "scheduled": 1, "starting": 1, "ready": 2}


@dataclass(frozen=True)
class Candidate:
    replica_id: int
    status: str
    inflight: int = 0
    # Freeing its GPUs would let a pending replica of another model fit on its node.
    wanted_for_pending: bool = False


def scale_down_pick(candidates: list[Candidate], count: int) -> list[Candidate]:
    ranked = sorted(candidates, key=lambda c: (ORDER.get(c.status, 3), not c.wanted_for_pending, c.inflight,
                                               -c.replica_id))
    return ranked[:max(count, 0)]
