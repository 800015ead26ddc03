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
  model share a node, or a fabric, while a placement that shares less fits
  now.

A replica's crowding is ``(nodes shared, fabric shared)``: how many other
replicas of its model share one of its nodes, and how many share its fabric
(an island node is its own fabric). Less is better, node first: a node is
the failure domain a crash, a frozen agent or a reboot takes out; a fabric
is a larger one (its switch), rarer to lose, so a move for the fabric comes
only after every move for a node (``node_moves_first``).

Each move makes the moved replica strictly less crowded and leaves the
model's other replicas where they are, so the pairs of its replicas that
share a node, then those that share a fabric, only ever decrease: moves
end, whatever the order they are made in.
"""

from __future__ import annotations

from collections import Counter
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
    before: tuple[int, int] = (0, 0)  # the replica's crowding where it is

    @property
    def for_node(self) -> bool:
        """It moves off a node it shares (else only off a shared fabric)."""
        return self.before[0] > 0


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
    A replica that shares a node, or else its fabric, with another replica
    of its model moves when a placement made without it shares strictly
    less; the most crowded first (any node shared before a fabric only),
    then the newest. The placement is ``place``'s, so a multi-node replica
    moves whole, into one fabric, as it was placed.
    """
    # A fabric move needs a domain holding at least two fewer of the model's
    # replicas than the replica's own: a model spread as evenly as it can be
    # (three replicas over two fabrics) tries no placement at all, on every
    # reconcile of a large cluster.
    held = Counter(r.domain for r in replicas)
    domains = {f for n in nodes for f in n.fabrics}
    if request.nodes == 1:
        domains |= {f"island:{n.name}" for n in nodes if not n.fabrics}
    emptiest = min((held[d] for d in domains), default=0)
    candidates = []
    for replica in replicas:
        others = [o for o in replicas if o.id != replica.id]
        before = crowding(replica.fabric, replica.nodes, others)
        if before[0] == 0 and before[1] < emptiest + 1:
            continue
        candidates.append((before, replica.id, replica, others))
    for before, _, replica, others in sorted(candidates, key=lambda c: (c[0], c[1]), reverse=True):
        snapshot = ClusterSnapshot(nodes, [e for rid, e in existing if rid != replica.id])
        placed = place(request, snapshot)
        if isinstance(placed, Unplaceable):
            continue
        after = crowding(placed.fabric, placed.nodes, others)
        if after < before:
            return SpreadMove(replica.id, placed, _why(model, replica, others, placed, before, after), before)
    return None


def _why(model: str, replica: SpreadReplica, others: list[SpreadReplica], placed: Placement,
         before: tuple[int, int], after: tuple[int, int]) -> str:
    if before[0]:
        shared = sorted(set(replica.nodes) & {n for o in others for n in o.nodes})
        with_ = ", ".join(f"replica {o.id}" for o in others if set(o.nodes) & set(replica.nodes))
        what = f"it shares {', '.join(shared)} with {with_} of {model}, so one node's loss takes out both"
    else:
        with_ = ", ".join(f"replica {o.id}" for o in others if o.domain == replica.domain)
        what = (f"it shares fabric {replica.fabric} (on other nodes) with {with_} of {model}, "
                f"so one fabric's loss (its switch) takes out both")
    return (f"{what}; on {', '.join(placed.nodes)} ({placed.fabric or 'an island'}) it shares "
            f"{after[0]} node(s) and its fabric with {after[1]} other replica(s) (now {before[0]} and {before[1]})")


def node_moves_first(moves: list[tuple[str, SpreadMove]]) -> list[tuple[str, SpreadMove]]:
    """The order to try one move per model in, ``(model, move)``: every move
    off a shared node before any move off a shared fabric only, then by model
    name (the same input, the same move)."""
    return sorted(moves, key=lambda m: (not m[1].for_node, m[0]))


def existing_replica(model: str, replica: SpreadReplica) -> ExistingReplica:
    return ExistingReplica(model, replica.fabric, replica.nodes)
