"""Placement that knows where the weights are: a pure function over the
cluster snapshot and a view of every node's weights cache.

Among the places a replica fits whole (``replicas.placement.place``), the
nodes that already hold its weights come first: the replica is placed among
them alone when it fits there, else among them and the nodes with room to
fetch the weights. A node without room for them (free space plus what it may
evict: revisions no replica there uses) is not a candidate, and the reason a
replica stays pending says so; nor is a node that lately could not stage
them for a replica (``WeightsView.failed``: no space, or no progress). Weights
that cannot be fetched (a source of kind ``none``, or a shared path) go only
to nodes that report them.

No Django here: ``replicas.scheduling`` builds the view with the snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .placement import NAMED, place
from .snapshot import ClusterSnapshot, Placement, PlacementRequest, Unplaceable


@dataclass(frozen=True, slots=True)
class WeightsNeed:
    """What a replica's weights ask of a node."""

    key: str  # model@revision
    total: int  # bytes of the whole revision (0: read in place)
    fetchable: bool = True  # False: only nodes that report them


@dataclass
class WeightsView:
    """Every node's weights cache, as its agent last reported it."""

    caches: set[str] = field(default_factory=set)  # nodes that keep a weights cache
    holders: dict[str, set[str]] = field(default_factory=dict)  # key -> nodes holding it complete
    partial: dict[tuple[str, str], int] = field(default_factory=dict)  # (node, key) -> bytes so far
    room: dict[str, int] = field(default_factory=dict)  # node -> free bytes plus what it may evict
    # (node, key) -> why it could not stage them for a replica lately
    # (replicas.weights_cache.staging_failures): placement passes it by for
    # them meanwhile; spares and staging by hand do not (an operator may know better).
    failed: dict[tuple[str, str], str] = field(default_factory=dict)

    def holds(self, node: str, key: str) -> bool:
        return node in self.holders.get(key, ())

    def need_on(self, node: str, need: WeightsNeed) -> int:
        """Bytes the node still has to fetch (0 when it holds them)."""
        if self.holds(node, need.key):
            return 0
        return max(0, need.total - self.partial.get((node, need.key), 0))

    def fits(self, node: str, need: WeightsNeed) -> bool:
        if self.holds(node, need.key):
            return True
        if not need.fetchable or node not in self.caches:
            return False
        return self.need_on(node, need) <= self.room.get(node, 0)

    def may_take(self, node: str, need: WeightsNeed) -> bool:
        """Whether placement may choose the node for these weights: it holds
        them, or has room to fetch them and has not failed to lately."""
        return self.holds(node, need.key) or (self.fits(node, need) and (node, need.key) not in self.failed)

    def copy(self) -> WeightsView:
        return WeightsView(caches=set(self.caches), holders={k: set(v) for k, v in self.holders.items()},
                           partial=dict(self.partial), room=dict(self.room), failed=dict(self.failed))

    def reserve(self, placement: Placement, need: WeightsNeed) -> None:
        """The placement's nodes will fetch the weights: their room shrinks
        now, so that the next placement of the batch sees it."""
        for member in placement.members:
            self.room[member.node] = self.room.get(member.node, 0) - self.need_on(member.node, need)
            self.partial[(member.node, need.key)] = need.total


def _restricted(snapshot: ClusterSnapshot, allowed: set[str]) -> ClusterSnapshot:
    view = snapshot.copy()
    for name in snapshot.nodes:
        if name not in allowed:
            view.withhold(name)
    return view


def place_weights(request: PlacementRequest, snapshot: ClusterSnapshot, view: WeightsView,
                  need: WeightsNeed) -> Placement | Unplaceable:
    """Where one replica goes, holders of its weights first, or why nowhere."""
    everywhere = place(request, snapshot)
    if isinstance(everywhere, Unplaceable):
        return everywhere  # no room in GPUs already: that is the reason
    holders = {n for n in view.holders.get(need.key, ()) if n in snapshot.nodes}
    if holders:
        among = place(request, _restricted(snapshot, holders))
        if isinstance(among, Placement):
            return among
    candidates = {n for n in snapshot.nodes if view.may_take(n, need)}
    if holders and candidates == holders:
        candidates = set()  # holders alone were tried
    if candidates:
        result = place(request, _restricted(snapshot, candidates))
        if isinstance(result, Placement):
            return result
    return Unplaceable(request.model, _reason(request, snapshot, view, need, everywhere))


def _reason(request: PlacementRequest, snapshot: ClusterSnapshot, view: WeightsView, need: WeightsNeed,
            everywhere: Placement) -> str:
    fits_gpus = sorted(n for n, node in snapshot.nodes.items()
                       if node.schedulable and len(node.free_gpus) >= request.gpus_per_node)
    if not need.fetchable:
        where = ", ".join(sorted(view.holders.get(need.key, ()))[:NAMED]) or "no node"
        return (f"needs nodes that hold {need.key} (weights placed by hand, no source to fetch them from): "
                f"{where} reports them, without the free GPUs; place them on more nodes or free GPUs there")
    no_cache = [n for n in fits_gpus if n not in view.caches]
    failed = [n for n in fits_gpus if (n, need.key) in view.failed and view.fits(n, need) and not view.holds(n, need.key)]
    short = [n for n in fits_gpus if n in view.caches and not view.fits(n, need)]
    parts = [f"needs {size_text(need.total)} of weights space ({need.key}) on each node"]
    if short:
        shown = ", ".join(f"{n}: {size_text(view.room.get(n, 0))} free" for n in short[:NAMED])
        more = f" and {len(short) - NAMED} more" if len(short) > NAMED else ""
        parts.append(f"nodes with free GPUs but too little free space for the weights: {shown}{more}")
    if failed:
        shown = ", ".join(f"{n} ({view.failed[(n, need.key)]})" for n in failed[:NAMED])
        more = f" and {len(failed) - NAMED} more" if len(failed) > NAMED else ""
        parts.append(f"nodes with free GPUs that could not stage them lately (tried again after "
                     f"LLMGW_STAGING_TIMEOUT): {shown}{more}")
    if no_cache:
        shown = ", ".join(no_cache[:NAMED]) + (f" and {len(no_cache) - NAMED} more" if len(no_cache) > NAMED else "")
        parts.append(f"nodes with free GPUs that keep no weights cache (agent.yaml 'weights'): {shown}")
    parts.append("free space in the nodes' caches (weights no replica uses are evicted), raise their budget, "
                 "or add nodes")
    return "; ".join(parts)


def size_text(n: int) -> str:
    """Bytes in words: 140.0 GB."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
