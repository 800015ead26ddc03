"""Fabric-aware replica placement: a pure function over a snapshot of the cluster.

No Django here. The service that persists a placement under row locks builds a
``ClusterSnapshot`` and calls ``place``; a benchmark or a simulation can place
many replicas in sequence with ``ClusterSnapshot.allocate``.

The order of preference, most important first:

1. a multi-node replica takes all its nodes from ONE fabric (across two it
   starts, passes health checks, then hangs on its first all-reduce); a node
   with no fabric is an island and takes single-node replicas only;
2. only schedulable nodes (ready, not cordoned) with enough free GPUs qualify;
3. replicas of one model spread across fabrics, then across nodes, so that one
   failure takes out as few of them as possible (each island is its own
   failure domain);
4. best fit: the nodes whose free GPUs are closest to the need, so that the
   fewest GPUs are left stranded; at equal fit a single-node replica prefers
   an island, keeping fabric nodes for multi-node replicas;
5. ties are broken by name, so the same input always gives the same answer.

GPUs within a node come from the smallest contiguous run of free indices that
holds them, lowest first (the lowest indices when no run is long enough).

The snapshot keeps, per fabric, schedulable nodes bucketed by free-GPU count
(each bucket sorted by name), and per model how many of its replicas each
fabric and node holds, so one placement touches a few buckets rather than
every node.
"""

from __future__ import annotations

from collections import Counter

# The placement API: what callers pass and get back lives with the snapshot.
from .snapshot import (  # noqa: F401
    ISLAND,
    ClusterSnapshot,
    ExistingReplica,
    Member,
    NodeSnapshot,
    Placement,
    PlacementRequest,
    Unplaceable,
    apply,
)

NAMED = 3  # a reason names nodes when there are at most this many


def place(request: PlacementRequest, snapshot: ClusterSnapshot) -> Placement | Unplaceable:
    """Where one replica of ``request.model`` goes, or why it cannot go anywhere now."""
    fabric_count = snapshot._fabric_count.get(request.model) or Counter()
    node_count = snapshot._node_count.get(request.model) or Counter()
    if request.nodes == 1:
        best = _best_single(request.gpus_per_node, snapshot, fabric_count, node_count)
    else:
        best = _best_multi(request.nodes, request.gpus_per_node, snapshot, fabric_count, node_count)
    if best is None:
        never = never_fits(request, snapshot)
        if never:
            return Unplaceable(request.model, never, never=True)
        return Unplaceable(request.model, _reason_now(request, snapshot))
    fabric, names = best
    members = tuple(
        Member(name, _pick_gpus(snapshot.nodes[name].free_gpus, request.gpus_per_node)) for name in sorted(names)
    )
    return Placement(request.model, fabric, members)


def _select(buckets: list[list[str]], k: int, need: int, node_count: Counter) -> list[tuple[int, int, str]] | None:
    """The k nodes with the smallest (replicas of the model, free GPUs, name), or None."""
    chosen: list[tuple[int, int, str]] = []
    held: list[tuple[int, int, str]] = []
    for free in range(need, len(buckets)):
        for name in buckets[free]:
            count = node_count[name] if node_count else 0
            if count:
                held.append((count, free, name))
                continue
            chosen.append((0, free, name))
            if len(chosen) == k:
                return chosen
    if len(chosen) + len(held) < k:
        return None
    held.sort()
    return chosen + held[: k - len(chosen)]


def _fit_bound(buckets: list[list[str]], k: int, need: int) -> int | None:
    """Fewest GPUs that k eligible nodes of the group could strand, or None if it has fewer."""
    left, stranded = k, 0
    for free in range(need, len(buckets)):
        size = len(buckets[free])
        if size:
            take = size if size < left else left
            stranded += take * (free - need)
            left -= take
            if not left:
                return stranded
    return None


def _best_multi(k, need, snapshot, fabric_count, node_count):
    # Candidates ordered by a lower bound of their key; the real key of a
    # fabric needs its node selection, made only while it can still win.
    candidates = []
    for fabric in snapshot._fabrics:
        bound = _fit_bound(snapshot._groups[fabric].buckets, k, need)
        if bound is not None:
            candidates.append(((fabric_count[fabric], 0, bound), fabric))
    candidates.sort()
    best_key, best = None, None
    for bound, fabric in candidates:
        if best_key is not None and bound > best_key[:3]:
            break
        chosen = _select(snapshot._groups[fabric].buckets, k, need, node_count)
        key = (
            fabric_count[fabric],
            sum(count for count, _, _ in chosen),
            sum(free - need for _, free, _ in chosen),
            fabric,
        )
        if best_key is None or key < best_key:
            best_key, best = key, (fabric, [name for _, _, name in chosen])
    return best


def _best_single(need, snapshot, fabric_count, node_count):
    # Key: (replicas of the model in the failure domain, on the node, free GPUs,
    # island first, name, fabric). An island is its own failure domain.
    candidates = []
    for key, group in snapshot._groups.items():
        bound = _fit_bound(group.buckets, 1, need)
        if bound is None:
            continue
        if key is ISLAND:
            candidates.append(((0, 0, bound + need, 0), ""))
        else:
            candidates.append(((fabric_count[key], 0, bound + need, 1), key))
    candidates.sort()
    best_key, best = None, None
    for bound, fabric in candidates:
        if best_key is not None and bound > best_key[:4]:
            break
        group = snapshot._groups[fabric or ISLAND]
        count, free, name = _select(group.buckets, 1, need, node_count)[0]
        domain = fabric_count[fabric] if fabric else count
        key = (domain, count, free, 1 if fabric else 0, name, fabric)
        if best_key is None or key < best_key:
            best_key, best = key, (fabric or None, [name])
    return best


def _pick_gpus(free: tuple[int, ...], need: int) -> tuple[int, ...]:
    """The smallest contiguous run of free indices that holds ``need``, lowest first."""
    if len(free) == need:
        return free
    best: tuple[int, int] | None = None  # (length, start position)
    start = 0
    for i in range(1, len(free) + 1):
        if i == len(free) or free[i] != free[i - 1] + 1:
            length = i - start
            if length >= need and (best is None or length < best[0]):
                best = (length, start)
            start = i
    if best is None:
        return free[:need]
    return free[best[1] : best[1] + need]


def never_fits(request: PlacementRequest, snapshot: ClusterSnapshot) -> str | None:
    """Why this shape can never fit the cluster, counting every node whatever its state; else None."""
    k, need = request.nodes, request.gpus_per_node
    if not snapshot.nodes:
        return "no nodes are registered"
    largest = max(total for group in snapshot._groups.values() for total in group.totals)
    if need > largest:
        return f"needs {need} GPUs per node, but the largest node has {largest}"
    if k == 1:
        return None
    if not snapshot._fabrics:
        return (
            f"needs {k} nodes in one fabric, but no node is in a fabric "
            "(a fabric-less node takes single-node replicas only)"
        )
    sizes = {
        fabric: sum(n for total, n in snapshot._groups[fabric].totals.items() if total >= need)
        for fabric in snapshot._fabrics
    }
    if max(sizes.values()) >= k:
        return None
    largest_first = sorted(sizes.items(), key=lambda item: (-item[1], item[0]))
    detail = ", ".join(f"{fabric}: {n}" for fabric, n in largest_first[:8])
    more = f", and {len(sizes) - 8} more" if len(sizes) > 8 else ""
    return f"needs {k} nodes x {need} GPUs in one fabric, but no fabric has {k} nodes of {need}+ GPUs ({detail}{more})"


def _reason_now(request: PlacementRequest, snapshot: ClusterSnapshot) -> str:
    k, need = request.nodes, request.gpus_per_node
    parts = [f"needs {k} nodes x {need} GPUs in one fabric" if k > 1 else f"needs 1 node x {need} GPUs"]
    empty = []
    for fabric in snapshot._fabrics:
        names = [name for bucket in snapshot._groups[fabric].buckets[need:] for name in bucket]
        if not names:
            empty.append(fabric)
            continue
        names.sort()
        # The free count of each named node, not only the need it meets: "4+
        # free (node01: 7)" rather than a "4 free" that reads as exact.
        nodes = snapshot.nodes
        named = f" ({', '.join(f'{n}: {len(nodes[n].free_gpus)}' for n in names)})" if len(names) <= NAMED else ""
        verb = "node has" if len(names) == 1 else "nodes have"
        parts.append(f"{fabric}: {len(names)} {verb} {need}+ free{named}")
    if empty:
        parts.append(f"{', '.join(empty)}: none")
    islands = snapshot._groups.get(ISLAND)
    if islands is not None:
        plural = "node" if islands.size == 1 else "nodes"
        if k > 1:
            parts.append(f"{islands.size} fabric-less {plural} take single-node replicas only")
        else:
            parts.append(f"fabric-less ({islands.size} {plural}): none")
    if k == 1:
        parts.append(_most_free(snapshot))
    if snapshot._excluded:
        shown = ", ".join(f"{name} ({label})" for name, label in snapshot._excluded[:NAMED])
        more = f" and {len(snapshot._excluded) - NAMED} more" if len(snapshot._excluded) > NAMED else ""
        parts.append(f"excluded as not schedulable: {shown}{more}")
    return "; ".join(parts)


def _most_free(snapshot: ClusterSnapshot) -> str:
    for free in range(len(next(iter(snapshot._groups.values())).buckets) - 1, 0, -1):
        names = sorted({name for group in snapshot._groups.values() for name in group.buckets[free]})
        if names:
            shown = ", ".join(names[:NAMED]) + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")
            return f"most free on a schedulable node: {free} ({shown})"
    return "no schedulable node has a free GPU"
