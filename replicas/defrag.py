"""Making room: which smaller replicas to move so that a pending one fits.
A pure function over the placement snapshot, next to ``replicas.placement``.

A replica can stay pending while the GPUs it needs are free in total but
scattered: in the demo, two 2-node x 4-GPU replicas and two 1-GPU replicas on
four 8-GPU nodes; node02 lost, its replica's replacement needs two nodes of
ib-b with 4 free, and a 1-GPU replica on node03 leaves it 3. Moving that
replica to node01 (ib-a, 7 free) makes room.

``plan_room`` looks, in every group the pending replica may use (a fabric for
a multi-node replica; any fabric or the islands for a single-node one), for
the nodes it would take once some single-node replicas smaller than it are
moved off them, and checks with ``place`` that each moved replica fits
elsewhere first (its replacement is started before the original stops, so
it must fit on GPUs free now, and never on the nodes being cleared). Only
single-node replicas move: they cross no fabric boundary, and ``place`` keeps
every placement inside one fabric anyway.

Managed weights (``replicas.weights_placement``) bind a plan as they bind
placement: a moved replica goes where ``place_weights`` would put it (holders
of its weights first, never a node without room for them), and the pending
replica is given only nodes that may take its own weights. Given no weights
view, every node may take any weights (a cluster where no node keeps a cache
manages none).

Cheapest first: the fewest moves, then the fewest GPUs moved, then the most
nodes that already hold the pending replica's weights, then the fewest GPUs
left stranded, then names. When no set of moves makes room, the answer says
why, group by group.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Iterable

from .placement import (
    ISLAND,
    ClusterSnapshot,
    Placement,
    PlacementRequest,
    Unplaceable,
    place,
)
from .weights_placement import WeightsNeed, WeightsView, place_weights

# How a pending replica's reason says that room is being made for it, after
# the placement's own reason (the scheduler keeps it; a drain does not call
# such a replica stuck).
MAKING_ROOM = "; making room: "
# How a pending reason says that no moves can make room (a drain is then stuck).
NO_ROOM = "no set of moves makes room"

# Replicas of one node considered for eviction, largest first: enough for any
# real node (8 or 16 GPUs), and a bound on the subset search.
PER_NODE = 12
SHOWN = 3  # groups named in a "no room" reason


@dataclass(frozen=True, slots=True)
class Movable:
    """A ready single-node replica that may be moved to make room."""

    replica: int
    model: str
    node: str
    gpus: tuple[int, ...]
    weights: WeightsNeed | None = None  # its revision's managed weights, if any


@dataclass(frozen=True, slots=True)
class Move:
    replica: int
    model: str
    source: str
    destination: Placement

    @property
    def gpus(self) -> int:
        return len(self.destination.members[0].gpus)


@dataclass(frozen=True, slots=True)
class RoomPlan:
    """Move these, then the pending replica fits on ``nodes`` of ``fabric``
    (None: a fabric-less node)."""

    fabric: str | None
    nodes: tuple[str, ...]
    moves: tuple[Move, ...]


@dataclass(frozen=True, slots=True)
class NoRoom:
    reason: str


def _evictions(candidates: list[Movable], deficit: int) -> tuple[Movable, ...] | None:
    """The fewest replicas freeing at least ``deficit`` GPUs, then the fewest GPUs."""
    ranked = sorted(candidates, key=lambda m: (-len(m.gpus), m.replica))[:PER_NODE]
    freed, count = 0, 0
    for movable in ranked:
        freed += len(movable.gpus)
        count += 1
        if freed >= deficit:
            break
    else:
        return None
    best = None
    for subset in combinations(ranked, count):
        size = sum(len(m.gpus) for m in subset)
        if size >= deficit and (best is None or size < best[0]):
            best = (size, subset)
    return best[1]


def _group_nodes(snapshot: ClusterSnapshot, key: str | None) -> list[str]:
    return [name for bucket in snapshot._groups[key].buckets for name in bucket]


def _clear_group(request, snapshot, key, by_node, view, need):
    """The k cheapest nodes of a group to clear, with their evictions, or a reason."""
    gpus, k = request.gpus_per_node, request.nodes
    options = []
    eligible = no_weights = 0
    for name in _group_nodes(snapshot, key):
        node = snapshot.nodes[name]
        if node.total_gpus < gpus:
            continue
        if view is not None and need is not None and not view.may_take(name, need):
            no_weights += 1
            continue
        eligible += 1
        # Holders of the pending replica's weights first, at equal moves: it starts without a download.
        fetch = int(view is not None and need is not None and not view.holds(name, need.key))
        free = len(node.free_gpus)
        if free >= gpus:
            options.append(((0, 0, fetch, free - gpus, name), name, ()))
            continue
        evicted = _evictions(by_node.get(name, []), gpus - free)
        if evicted is not None:
            moved = sum(len(m.gpus) for m in evicted)
            options.append(((len(evicted), moved, fetch, free + moved - gpus, name), name, evicted))
    label = key or "fabric-less nodes"
    without = f" (and {no_weights} without room for {need.key})" if no_weights else ""
    if eligible < k:
        return None, f"{label}: {eligible} schedulable node(s) of {gpus}+ GPUs{without}"
    if len(options) < k:
        return None, f"{label}: only {len(options)} node(s) could be cleared to {gpus} free{without}"
    options.sort()
    chosen = options[:k]
    cost = tuple(sum(o[0][i] for o in chosen) for i in range(4))
    return (cost, tuple(sorted(o[1] for o in chosen)), [m for o in chosen for m in o[2]]), ""


def _destinations(snapshot, nodes, evicted, view) -> list[Move] | str:
    """Where each evicted replica goes, on GPUs free now and off ``nodes``;
    one with managed weights where ``place_weights`` would put it."""
    trial = snapshot.copy()
    for name in nodes:
        trial.withhold(name)
    room = view.copy() if view is not None else None  # reserved as the plan goes, the caller's left alone
    moves = []
    for movable in sorted(evicted, key=lambda m: (-len(m.gpus), m.replica)):
        request = PlacementRequest(movable.model, 1, len(movable.gpus))
        if movable.weights is not None and room is not None:
            result = place_weights(request, trial, room, movable.weights)
            if isinstance(result, Placement):
                room.reserve(result, movable.weights)
            elif isinstance(place(request, trial), Placement):
                return (f"{movable.model} replica {movable.replica} ({len(movable.gpus)} GPUs) would fit nowhere "
                        f"else that holds or has room for its weights ({movable.weights.key})")
        else:
            result = place(request, trial)
        if isinstance(result, Unplaceable):
            return f"{movable.model} replica {movable.replica} ({len(movable.gpus)} GPUs) would fit nowhere else"
        trial.allocate(result)
        moves.append(Move(movable.replica, movable.model, movable.node, result))
    return moves


def plan_room(request: PlacementRequest, snapshot: ClusterSnapshot, movable: Iterable[Movable], *,
              view: WeightsView | None = None, need: WeightsNeed | None = None) -> RoomPlan | NoRoom:
    """The cheapest set of moves after which ``request`` fits, or why none does.

    ``movable`` lists the replicas that may move; those of the request's own
    model, of more than one node, or not smaller than the request are left
    alone. Call it only for a request that ``place`` cannot place now.
    ``view`` is the nodes' weights caches and ``need`` the request's own
    weights (None: not managed): neither is changed.
    """
    total = request.nodes * request.gpus_per_node
    by_node: dict[str, list[Movable]] = {}
    for m in movable:
        if m.model != request.model and len(m.gpus) < total and m.node in snapshot.nodes:
            by_node.setdefault(m.node, []).append(m)
    if request.nodes > 1:
        keys = list(snapshot.fabrics)
        if not keys:
            return NoRoom("no node is in a fabric")
    else:
        keys = sorted(snapshot._groups, key=lambda key: (key is not ISLAND, key or ""))
    candidates, reasons = [], []
    for key in keys:
        cleared, why = _clear_group(request, snapshot, key, by_node, view, need)
        if cleared is None:
            reasons.append(why)
            continue
        cost, nodes, evicted = cleared
        candidates.append((cost, key or "", key, nodes, evicted))
    candidates.sort(key=lambda c: (c[0], c[1]))
    for _, _, key, nodes, evicted in candidates:
        moves = _destinations(snapshot, nodes, evicted, view)
        if isinstance(moves, str):
            reasons.append(f"{key or 'fabric-less nodes'}: {moves}")
            continue
        return RoomPlan(key, nodes, tuple(moves))
    shown = "; ".join(reasons[:SHOWN]) + (f"; and {len(reasons) - SHOWN} more" if len(reasons) > SHOWN else "")
    return NoRoom(f"{NO_ROOM} ({shown})" if shown else NO_ROOM)
