"""Whether a drain's replacement that does not fit now is waiting or stuck.

A drain is called blocked only when nothing under way can free what its
replacement needs. What is under way: the drain's own moves and the moves
that make room (their originals stop once their replacements are ready),
and replicas already stopping or failed (their GPUs are freed as their
agents confirm). Each is a ``Release``: the GPUs it will give back. The
decision is pure: the replacement is placed, by the placement's own rules,
on the cluster as it is now with those GPUs given back; if it fits, it waits
for the releases that make it fit, and the log says which (``waiting for
llama-70b replica 5's move off node03 to release 4 GPUs on node04``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from .placement import place
from .snapshot import ClusterSnapshot, NodeSnapshot, PlacementRequest, Unplaceable

# A node that is only still stopping engines it should no longer run is
# schedulable again once they stop (replicas.scheduling labels it so).
FENCING = "fencing old engines"
# Releases tried one by one (each a placement over the whole cluster); past
# these, only all of them together.
SINGLES = 32


@dataclass(frozen=True)
class Release:
    """What a replica under way gives back: ``gpus`` as (node, GPU indices) pairs."""

    what: str  # "llama-70b replica 5's move off node03", "qwen replica 3, stopping,"
    gpus: tuple[tuple[str, tuple[int, ...]], ...]


def _fits(request: PlacementRequest, nodes: dict[str, NodeSnapshot], releases: Iterable[Release]) -> bool:
    freed = dict(nodes)
    for release in releases:
        for name, gpus in release.gpus:
            node = freed.get(name)
            if node is None:
                continue
            free = tuple(sorted(set(node.free_gpus) | set(gpus)))
            freed[name] = replace(node, free_gpus=free,
                                  schedulable=node.schedulable or node.state == FENCING)
    return not isinstance(place(request, ClusterSnapshot(freed.values())), Unplaceable)


def _gpus(release: Release, nodes: dict[str, NodeSnapshot]) -> str:
    """'4 GPUs on node04' (schedulable nodes only: the drained node's do not count)."""
    parts = []
    for name, gpus in release.gpus:
        node = nodes.get(name)
        if node is not None and (node.schedulable or node.state == FENCING) and gpus:
            parts.append(f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''} on {name}")
    return ", ".join(parts) or "its GPUs"


def replacement_wait(request: PlacementRequest, nodes: Iterable[NodeSnapshot],
                     releases: Sequence[Release]) -> str | None:
    """What a replacement that is not placed waits for, in words; None when
    nothing under way would make it fit (it is stuck: the drain may block).
    Releases are tried one by one in the order given, then all together."""
    by_name = {node.name: node for node in nodes}
    if _fits(request, by_name, ()):
        return "its replacement fits now and is being placed"
    for release in releases[:SINGLES]:
        if _fits(request, by_name, (release,)):
            return f"waiting for {release.what} to release {_gpus(release, by_name)}"
    if len(releases) > 1 and _fits(request, by_name, releases):
        return "waiting for " + "; ".join(f"{r.what} to release {_gpus(r, by_name)}" for r in releases)
    return None
