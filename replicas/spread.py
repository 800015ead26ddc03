"""A model's spread across failure domains: pure decisions, no Django.

Placement spreads a model's replicas across fabrics, then nodes, when it
places them (``placement.py``); nothing kept them so afterwards: drains and
scale-downs (which stopped the newest replica) left both replicas of a
model with their leaders on one node, and that node's loss took the model
down. Two decisions keep the spread, as Kubernetes' descheduler does for
topology spread constraints:

- ``removal_order``: which replicas a scale-down stops, the one whose loss
  best keeps the rest spread first;
- ``respread``: which replica to move, and where, when two replicas of a
  model share a node while a placement that shares less fits now.

A replica's crowding is ``(nodes shared, fabric shared)``: how many other
replicas of its model share one of its nodes, and how many share its fabric
(an island node is its own fabric). Less is better, node first: a node is
the failure domain a crash, a frozen agent or a reboot takes out.
"""

from __future__ import annotations

from dataclasses import dataclass

from .snapshot import ClusterSnapshot, ExistingReplica, Placement, PlacementRequest, Unplaceable
from .placement import place


@dataclass(frozen=True, slots=True)
class SpreadReplica:
    """One placed replica of a model: its id, fabric (None: an island), nodes (leader first)."""

    id: int
    fabric: str | None
    nodes: tuple[str, ...]
    ready: bool = True

    @property
    def domain(self) -> str:
        return self.fabric if self.fabric is not None else f"island:{self.nodes[0]}"


@dataclass(frozen=True, slots=True)
class SpreadMove:
    replica: int
    destination: Placement
    reason: str


def crowding(fabric: str | None, nodes: tuple[str, ...], others: list[SpreadReplica]) -> tuple[int, int]:
    """(others sharing a node, others sharing the fabric or island)."""
    domain = fabric if fabric is not None else f"island:{nodes[0]}"
    mine = set(nodes)
    return (sum(1 for o in others if mine & set(o.nodes)), sum(1 for o in others if o.domain == domain))


def removal_order(replicas: list[SpreadReplica]) -> list[int]:
    """The ids in the order a scale-down stops them: each time the most
    crowded one of those left (node shares, then fabric shares), a replica
    not yet ready before a ready one, then the newest."""
    left = list(replicas)
    order = []
    while left:
        def key(r: SpreadReplica):
            return (*crowding(r.fabric, r.nodes, [o for o in left if o.id != r.id]), not r.ready, r.id)

        worst = max(left, key=key)
        order.append(worst.id)
        left.remove(worst)
    return order


def respread(model: str, request: PlacementRequest, replicas: list[SpreadReplica], nodes, existing) -> SpreadMove | None:
    """The move that spreads ``model`` better, or None.

    ``nodes`` are the cluster's NodeSnapshots (free GPUs as they are: the
    replacement starts before the original stops, so it must fit beside
    it) and ``existing`` every placed replica as ``(id, ExistingReplica)``.
    A replica that shares a node with another replica of its model moves
    when a placement made without it shares strictly less; the most crowded
    first, then the newest.
    """
    candidates = []
    for replica in replicas:
        others = [o for o in replicas if o.id != replica.id]
        before = crowding(replica.fabric, replica.nodes, others)
        if before[0] == 0:
            continue
        candidates.append((before, replica.id, replica, others))
    for before, _, replica, others in sorted(candidates, key=lambda c: (c[0], c[1]), reverse=True):
        snapshot = ClusterSnapshot(nodes, [e for rid, e in existing if rid != replica.id])
        placed = place(request, snapshot)
        if isinstance(placed, Unplaceable):
            continue
        after = crowding(placed.fabric, placed.nodes, others)
        if after < before:
            shared = sorted(set(replica.nodes) & {n for o in others for n in o.nodes})
            with_ = ", ".join(f"replica {o.id}" for o in others if set(o.nodes) & set(replica.nodes))
            return SpreadMove(
                replica.id, placed,
                f"it shares {', '.join(shared)} with {with_} of {model}, so one node's loss takes out both; "
                f"on {', '.join(placed.nodes)} ({placed.fabric or 'an island'}) it shares "
                f"{after[0]} node(s) and its fabric with {after[1]} other replica(s) (now {before[0]} and {before[1]})",
            )
    return None


def existing_replica(model: str, replica: SpreadReplica) -> ExistingReplica:
    return ExistingReplica(model, replica.fabric, replica.nodes)
