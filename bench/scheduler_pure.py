"""Placements per second of the pure scheduler, without a database.

1,000 nodes x 8 GPUs in 16 fabrics plus 50 fabric-less nodes; 2,000 replicas
of mixed shapes (1x1, 1x8, 2x4, 2x8, 4x8) placed one after the other on one
in-memory snapshot. Prints the rate and per-call percentiles of ``place``
alone and of ``place`` + ``allocate``, then checks the invariants: no GPU
allocated twice, no replica across fabrics, no multi-node replica on a
fabric-less node.

    .venv/bin/python bench/scheduler_pure.py [--mix weighted|round-robin] [--replicas N]

``weighted`` (the default) is mostly small replicas and roughly fills the
cluster, so both the placing and the unplaceable paths are timed;
``round-robin`` asks for three times the cluster's GPUs, so most requests
end unplaceable.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replicas.placement import ClusterSnapshot, NodeSnapshot, Placement, PlacementRequest, place  # noqa: E402

SHAPES = {"1x1": (1, 1), "1x8": (1, 8), "2x4": (2, 4), "2x8": (2, 8), "4x8": (4, 8)}
WEIGHTS = {"1x1": 70, "1x8": 10, "2x4": 10, "2x8": 6, "4x8": 4}
MODELS_PER_SHAPE = 4


def build_nodes(fabric_nodes: int = 1000, fabrics: int = 16, islands: int = 50, gpus: int = 8) -> list[NodeSnapshot]:
    nodes = [
        NodeSnapshot(f"n{i:04}", fabric=f"ib-{i % fabrics:02}", free_gpus=tuple(range(gpus)), total_gpus=gpus)
        for i in range(fabric_nodes)
    ]
    nodes += [NodeSnapshot(f"island{i:02}", free_gpus=tuple(range(gpus)), total_gpus=gpus) for i in range(islands)]
    return nodes


def build_requests(count: int, mix: str, rng: random.Random) -> list[PlacementRequest]:
    names = list(SHAPES)
    if mix == "round-robin":
        shapes = [names[i % len(names)] for i in range(count)]
    else:
        shapes = rng.choices(names, weights=[WEIGHTS[n] for n in names], k=count)
    return [
        PlacementRequest(model=f"m{shape}-{rng.randrange(MODELS_PER_SHAPE)}", nodes=SHAPES[shape][0],
                         gpus_per_node=SHAPES[shape][1])
        for shape in shapes
    ]


def check_invariants(nodes: list[NodeSnapshot], placements: list[Placement], snapshot: ClusterSnapshot) -> None:
    by_name = {node.name: node for node in nodes}
    seen: set[tuple[str, int]] = set()
    for placement in placements:
        members = [by_name[member.node] for member in placement.members]
        if len(members) > 1:
            assert all(node.fabrics for node in members), f"multi-node replica on a fabric-less node: {placement}"
            assert all(placement.fabric in node.fabrics for node in members), f"replica across fabrics: {placement}"
        for member in placement.members:
            for gpu in member.gpus:
                assert (member.node, gpu) not in seen, f"GPU {member.node}:{gpu} allocated twice"
                seen.add((member.node, gpu))
    for name, node in snapshot.nodes.items():
        taken = {gpu for node_name, gpu in seen if node_name == name}
        assert set(node.free_gpus) == set(by_name[name].free_gpus) - taken, f"{name}: free GPUs drifted"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mix", choices=["weighted", "round-robin"], default="weighted")
    parser.add_argument("--replicas", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    nodes = build_nodes()
    requests = build_requests(args.replicas, args.mix, rng)

    started = time.perf_counter()
    snapshot = ClusterSnapshot(nodes)
    build_ms = (time.perf_counter() - started) * 1000

    place_times, total_times, placements, unplaceable, never = [], [], [], 0, 0
    clock = time.perf_counter
    for request in requests:
        t0 = clock()
        result = place(request, snapshot)
        t1 = clock()
        if isinstance(result, Placement):
            snapshot.allocate(result)
            placements.append(result)
        else:
            unplaceable += 1
            never += result.never
        t2 = clock()
        place_times.append(t1 - t0)
        total_times.append(t2 - t0)

    check_invariants(nodes, placements, snapshot)

    def pct(values: list[float], q: float) -> float:
        return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1e6

    used = sum(len(m.gpus) for p in placements for m in p.members)
    capacity = sum(node.total_gpus for node in nodes)
    print(f"cluster: {len(nodes)} nodes ({len(snapshot.fabrics)} fabrics + 50 fabric-less), {capacity} GPUs; "
          f"snapshot built in {build_ms:.1f} ms")
    print(f"requests: {len(requests)} ({args.mix}); placed {len(placements)}, unplaceable {unplaceable} "
          f"(never {never}); GPUs used {used}/{capacity}")
    for label, values in (("place", place_times), ("place+allocate", total_times)):
        print(f"{label:>15}: {len(values) / sum(values):,.0f} placements/s; "
              f"mean {statistics.fmean(values) * 1e6:.0f} us, p50 {pct(values, 0.5):.0f} us, "
              f"p99 {pct(values, 0.99):.0f} us, max {max(values) * 1e6:.0f} us")
    print("invariants: ok (no GPU twice, no replica across fabrics, no multi-node replica on a fabric-less node)")


if __name__ == "__main__":
    main()
