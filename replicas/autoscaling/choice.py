"""Which replicas go when an autoscaled model scales down. Small and pure:
the cheapest to give up first: a replica not placed yet, then one still
starting (it serves nobody), then the ready one with the fewest requests in
flight; among equals, the newest."""

from __future__ import annotations

from dataclasses import dataclass

ORDER = {"pending": 0, "scheduled": 1, "starting": 1, "ready": 2}


@dataclass(frozen=True)
class Candidate:
    replica_id: int
    status: str
    inflight: int = 0


def scale_down_pick(candidates: list[Candidate], count: int) -> list[Candidate]:
    ranked = sorted(candidates, key=lambda c: (ORDER.get(c.status, 3), c.inflight, -c.replica_id))
    return ranked[:max(count, 0)]
