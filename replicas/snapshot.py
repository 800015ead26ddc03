"""The cluster as placement sees it: nodes with their free GPUs, bucketed by
fabric and free count, and how many replicas of each model each fabric and
node holds; what a placement asks for and what it answers.

Pure data, no Django: ``replicas.scheduling`` builds a ``ClusterSnapshot``
from the database, ``replicas.placement.place`` reads it, and a benchmark or
a simulation allocates many placements in sequence on one snapshot.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import KW_ONLY, dataclass, replace
from typing import Iterable

ISLAND = None  # group key of the fabric-less nodes


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """One node as the scheduler sees it.

    ``fabrics`` is authoritative; ``fabric`` is accepted for a node in one
    fabric and afterwards reads as the first of ``fabrics`` (or None). A node in
    several fabrics can host a replica in any of them, but all of a replica's
    nodes share one. ``state`` only labels an unschedulable node in reasons.
    """

    name: str
    _: KW_ONLY
    fabrics: tuple[str, ...] = ()
    fabric: str | None = None
    free_gpus: tuple[int, ...] = ()
    total_gpus: int = 0
    schedulable: bool = True
    state: str = "ready"

    def __post_init__(self) -> None:
        fabrics = set(self.fabrics)
        if self.fabric:
            fabrics.add(self.fabric)
        ordered = tuple(sorted(fabrics))
        free = tuple(sorted(set(self.free_gpus)))
        total = self.total_gpus or len(free)
        if len(free) > total:
            raise ValueError(f"{self.name}: {len(free)} free GPUs but total_gpus={self.total_gpus}")
        object.__setattr__(self, "fabrics", ordered)
        object.__setattr__(self, "fabric", ordered[0] if ordered else None)
        object.__setattr__(self, "free_gpus", free)
        object.__setattr__(self, "total_gpus", total)


@dataclass(frozen=True, slots=True)
class ExistingReplica:
    """A replica already placed (scheduled, starting or ready): used for spreading."""

    model: str
    fabric: str | None
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    model: str
    nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: must not be empty")
        if self.nodes < 1:
            raise ValueError(f"nodes: must be at least 1, got {self.nodes}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node: must be at least 1, got {self.gpus_per_node}")


@dataclass(frozen=True, slots=True)
class Member:
    node: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a replica goes: members ordered by rank (rank 0, the leader, first).

    ``fabric`` is the fabric all members share, or None for a single-node
    replica on an island.
    """

    model: str
    fabric: str | None
    members: tuple[Member, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(member.node for member in self.members)


@dataclass(frozen=True, slots=True)
class Unplaceable:
    """Nothing fits now; ``never`` when the shape can never fit this cluster."""

    model: str
    reason: str
    never: bool = False


class _Group:
    """The nodes of one fabric (or all islands): schedulable ones bucketed by free count."""

    __slots__ = ("buckets", "totals", "size")

    def __init__(self, width: int) -> None:
        self.buckets: list[list[str]] = [[] for _ in range(width)]
        self.totals: Counter[int] = Counter()
        self.size = 0

    def copy(self) -> _Group:
        other = _Group(0)
        other.buckets = [list(bucket) for bucket in self.buckets]
        other.totals = Counter(self.totals)
        other.size = self.size
        return other


class ClusterSnapshot:
    """The nodes, their free GPUs and the replicas already placed, indexed for ``place``.

    ``allocate`` and ``release`` update it in place in time proportional to the
    replica's size; ``apply`` returns an updated copy instead.
    """

    def __init__(self, nodes: Iterable[NodeSnapshot], replicas: Iterable[ExistingReplica] = ()) -> None:
        self.nodes: dict[str, NodeSnapshot] = {}
        for node in sorted(nodes, key=lambda n: n.name):
            if node.name in self.nodes:
                raise ValueError(f"node {node.name} appears twice in the snapshot")
            self.nodes[node.name] = node
        width = max((node.total_gpus for node in self.nodes.values()), default=0) + 1
        self._groups: dict[str | None, _Group] = {}
        self._excluded: list[tuple[str, str]] = []
        for node in self.nodes.values():
            for key in node.fabrics or (ISLAND,):
                group = self._groups.get(key) or self._groups.setdefault(key, _Group(width))
                group.size += 1
                group.totals[node.total_gpus] += 1
                if node.schedulable:
                    group.buckets[len(node.free_gpus)].append(node.name)  # names arrive sorted
            if not node.schedulable:
                label = node.state if node.state != "ready" else "not schedulable"
                self._excluded.append((node.name, label))
        self._fabrics = sorted(key for key in self._groups if key is not ISLAND)
        self._fabric_count: dict[str, Counter] = {}
        self._node_count: dict[str, Counter] = {}
        for existing in replicas:
            self._count(existing.model, existing.fabric, existing.nodes, +1)

    @property
    def fabrics(self) -> list[str]:
        return list(self._fabrics)

    def copy(self) -> ClusterSnapshot:
        other = ClusterSnapshot.__new__(ClusterSnapshot)
        other.nodes = dict(self.nodes)
        other._groups = {key: group.copy() for key, group in self._groups.items()}
        other._excluded = list(self._excluded)
        other._fabrics = list(self._fabrics)
        other._fabric_count = {model: Counter(c) for model, c in self._fabric_count.items()}
        other._node_count = {model: Counter(c) for model, c in self._node_count.items()}
        return other

    def allocate(self, placement: Placement) -> None:
        """Take the placement's GPUs and count its replica; refuses a GPU that is not free."""
        for member in placement.members:
            node = self.nodes.get(member.node)
            if node is None:
                raise ValueError(f"{placement.model}: node {member.node} is not in the snapshot")
            taken = set(member.gpus) - set(node.free_gpus)
            if taken:
                raise ValueError(f"{placement.model}: GPUs {sorted(taken)} of {member.node} are not free")
        for member in placement.members:
            free = set(self.nodes[member.node].free_gpus) - set(member.gpus)
            self._set_free(member.node, tuple(sorted(free)))
        self._count(placement.model, placement.fabric, placement.nodes, +1)

    def release(self, placement: Placement) -> None:
        """Give the placement's GPUs back and forget its replica (a replica reaped)."""
        for member in placement.members:
            node = self.nodes[member.node]
            self._set_free(member.node, tuple(sorted(set(node.free_gpus) | set(member.gpus))))
        self._count(placement.model, placement.fabric, placement.nodes, -1)

    def withhold(self, name: str) -> None:
        """Nothing new may take this node's GPUs (they are being cleared for
        another replica): it leaves its buckets, as a full node would."""
        self._set_free(name, ())

    def _set_free(self, name: str, free: tuple[int, ...]) -> None:
        node = self.nodes[name]
        before, after = len(node.free_gpus), len(free)
        self.nodes[name] = replace(node, free_gpus=free)
        if node.schedulable and before != after:
            for key in node.fabrics or (ISLAND,):
                buckets = self._groups[key].buckets
                old = buckets[before]
                del old[bisect.bisect_left(old, name)]
                bisect.insort(buckets[after], name)

    def _count(self, model: str, fabric: str | None, nodes: Iterable[str], sign: int) -> None:
        fabric_count = self._fabric_count.setdefault(model, Counter())
        node_count = self._node_count.setdefault(model, Counter())
        fabric_count[fabric] += sign
        for name in nodes:
            node_count[name] += sign


def apply(snapshot: ClusterSnapshot, placement: Placement) -> ClusterSnapshot:
    """A copy of ``snapshot`` with ``placement`` allocated (the snapshot is untouched)."""
    updated = snapshot.copy()
    updated.allocate(placement)
    return updated
