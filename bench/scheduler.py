"""Placement through the real service on PostgreSQL, at cluster scale.

1,000 nodes x 8 GPUs in 16 fabrics plus 50 fabric-less nodes; 2,000 replicas
of mixed shapes (1x1, 1x8, 2x4, 2x8, 4x8) placed by
``replicas.scheduling.replicas_schedule_pending`` (snapshot, pure placement,
persistence under row locks with the unique GPU constraint). Prints
placements/s and p50/p99 per placement, then checks the invariants in the
database: no GPU twice, no replica across fabrics, no multi-node replica on a
fabric-less node. Goal: at least 1,500 placements/s (issue 18; it was 200).

Then the cost of making room (``replicas.defrag``, ``replicas.moves``) on
that nearly full cluster: the pure planner for each pending shape, and one
whole planning pass of the service (snapshot read, planning, the moves
started), with the invariants checked again.

    make bench-scheduler      (or: python bench/scheduler.py)
"""

from __future__ import annotations

import argparse
import atexit
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DB_NAME = "llmgw_bench_scheduler"
# Shapes (nodes, GPUs per node) and how many of each: 8,200 GPUs of the 8,400.
MIX = {(1, 1): 1400, (1, 8): 200, (2, 4): 250, (2, 8): 100, (4, 8): 50}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000, help="fabric nodes (default 1000)")
    parser.add_argument("--fabrics", type=int, default=16)
    parser.add_argument("--islands", type=int, default=50, help="fabric-less nodes (default 50)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the replica mix (default 1.0 = 2,000)")
    parser.add_argument("--pg", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/2")
    parser.add_argument("--db", default=DB_NAME, help=f"database to (re)create (default {DB_NAME})")
    args = parser.parse_args()

    data_dir = tempfile.mkdtemp(prefix="llmgw-bench-scheduler-")
    atexit.register(shutil.rmtree, data_dir, ignore_errors=True)
    os.environ.update(
        DATABASE_URL=f"{args.pg}/{args.db}",
        CELERY_BROKER_URL=args.redis,
        LLMGW_REDIS_URL=args.redis,
        LLMGW_DATA_DIR=data_dir,
        DJANGO_SETTINGS_MODULE="llmgw_site.settings",
    )
    _recreate_database(args.pg, args.db)
    import django

    django.setup()
    import redis
    from django.core.management import call_command

    redis.Redis.from_url(args.redis).flushdb()
    call_command("migrate", verbosity=0)
    _build_cluster(args.nodes, args.fabrics, args.islands)
    replicas = _pending_replicas(args.scale)

    from replicas import scheduling
    from replicas import enqueue

    # No worker in this benchmark: what is measured is placement itself.
    enqueue.reconcile_request = lambda **kw: None
    timings: list[float] = []
    persist = scheduling.placements_persist

    def timed_persist(items):
        start = time.perf_counter()
        try:
            return persist(items)
        finally:
            # Placements are written in batches; each one's share of its batch.
            timings.extend([(time.perf_counter() - start) / max(1, len(items))] * len(items))

    scheduling.placements_persist = timed_persist
    decisions: list[float] = []
    place = scheduling.placement.place

    def timed_place(request, snapshot):
        start = time.perf_counter()
        try:
            return place(request, snapshot)
        finally:
            decisions.append(time.perf_counter() - start)

    scheduling.placement.place = timed_place
    start = time.perf_counter()
    placed = scheduling.replicas_schedule_pending()
    elapsed = time.perf_counter() - start

    from replicas.models import Replica

    pending = Replica.objects.filter(status="pending").count()
    print(f"cluster: {args.nodes} nodes x 8 GPUs in {args.fabrics} fabrics + {args.islands} fabric-less nodes")
    print(f"replicas: {replicas} of shapes " + ", ".join(f"{n}x{g}" for n, g in MIX))
    print(f"placed {placed}, left pending {pending} (nothing free that fits), in {elapsed:.2f}s")
    print(f"placements/s (whole batch, snapshot and refusals included): {placed / elapsed:.0f}")
    ms = sorted(t * 1000 for t in decisions)
    print(f"placement decision (pure place): p50 {statistics.median(ms):.3f} ms, p99 {ms[int(len(ms) * 0.99) - 1]:.3f} ms")
    ms = sorted(t * 1000 for t in timings)
    print(f"per placement (its share of a batched write): p50 {statistics.median(ms):.2f} ms, p99 {ms[int(len(ms) * 0.99) - 1]:.2f} ms, "
          f"max {ms[-1]:.2f} ms")
    problems = _check_invariants()
    for problem in problems:
        print(f"INVARIANT BROKEN: {problem}")
    print("invariants: " + ("OK (no GPU twice, no replica across fabrics, no multi-node on a fabric-less node)"
                            if not problems else f"{len(problems)} broken"))
    print(f"goal (>= 1,500 placements/s): {'met' if placed / elapsed >= 1500 else 'NOT met'}")
    problems += _bench_moves()
    return 1 if problems else 0


def _bench_moves() -> list[str]:
    """Planning moves for what is left pending, pure and through the service."""
    from replicas import defrag, moves, placement, scheduling
    from replicas.models import CatalogEntry, Member, Replica

    # The placed replicas run: ready, so that they may be moved.
    Replica.objects.filter(status="scheduled").update(status="ready")
    snapshot = scheduling.cluster_snapshot()
    movable = [defrag.Movable(r, m, n, tuple(g)) for r, m, n, g in Member.objects.filter(
        replica__status="ready", replica__model__nodes=1).values_list("replica_id", "replica__model__name",
                                                                      "node__name", "gpus")]
    print(f"moves: {len(movable)} single-node replicas may move; free GPUs left: "
          f"{sum(len(n.free_gpus) for n in snapshot.nodes.values())}")
    for model in CatalogEntry.objects.order_by("nodes", "gpus_per_node"):
        request = placement.PlacementRequest(model.name, model.nodes, model.gpus_per_node)
        if not isinstance(placement.place(request, snapshot), placement.Unplaceable):
            continue
        ms, plan = [], None
        for _ in range(20):
            start = time.perf_counter()
            plan = defrag.plan_room(request, snapshot, movable)
            ms.append((time.perf_counter() - start) * 1000)
        ms.sort()
        found = (f"{len(plan.moves)} move(s) of {sum(m.gpus for m in plan.moves)} GPU(s) on {plan.fabric}"
                 if isinstance(plan, defrag.RoomPlan) else f"no room: {plan.reason[:90]}")
        print(f"plan room for {model.nodes}x{model.gpus_per_node} (pure plan_room, 20 runs): "
              f"p50 {statistics.median(ms):.2f} ms, max {ms[-1]:.2f} ms: {found}")
    start = time.perf_counter()
    started = moves.moves_plan()
    elapsed = time.perf_counter() - start
    print(f"one planning pass of the service (snapshot, plans for up to {moves.PLANNED_PER_PASS} pending replicas, "
          f"moves started under row locks): {elapsed * 1000:.0f} ms, {started} move(s) started")
    problems = _check_invariants()
    print("invariants after the moves started: " + ("OK" if not problems else f"{len(problems)} broken"))
    return problems


def _build_cluster(nodes: int, fabrics: int, islands: int) -> None:
    from django.utils import timezone

    from nodes.models import Fabric, Gpu, Hca, Node

    now = timezone.now()
    fabric_rows = Fabric.objects.bulk_create([Fabric(name=f"ib-{i:02d}") for i in range(fabrics)])
    rows = [Node(name=f"node{i:04d}", status="ready", status_changed_at=now, last_heartbeat_at=now,
                 mgmt_addr=f"127.1.{i // 250}.{i % 250 + 1}", mgmt_interface="eth0") for i in range(nodes)]
    rows += [Node(name=f"island{i:03d}", status="ready", status_changed_at=now, last_heartbeat_at=now,
                  mgmt_addr=f"127.2.0.{i + 1}", mgmt_interface="eth0") for i in range(islands)]
    Node.objects.bulk_create(rows, batch_size=1000)
    by_name = {n.name: n for n in Node.objects.all()}
    through = Node.fabrics.through
    memberships, hcas, gpus = [], [], []
    for i in range(nodes):
        node = by_name[f"node{i:04d}"]
        fabric = fabric_rows[i % fabrics]
        memberships.append(through(node_id=node.pk, fabric_id=fabric.pk))
        hcas += [Hca(node=node, name=f"mlx5_{k}", fabric=fabric, state="ACTIVE", link_layer="InfiniBand") for k in (0, 1)]
    for node in by_name.values():
        gpus += [Gpu(node=node, index=k, uuid=f"GPU-{node.name}-{k}", name="NVIDIA H200", memory_mib=143771,
                     pci_bus_id=f"00000000:{k:02X}:00.0") for k in range(8)]
    through.objects.bulk_create(memberships, batch_size=2000)
    Hca.objects.bulk_create(hcas, batch_size=2000)
    Gpu.objects.bulk_create(gpus, batch_size=2000)


def _pending_replicas(scale: float) -> int:
    from django.utils import timezone

    from replicas.models import CatalogEntry, Replica
    from replicas.revisions import revision_current

    shapes = []
    for (n, g), count in MIX.items():
        model = CatalogEntry.objects.create(name=f"m-{n}x{g}", engine="sim", weights="/models/sim", nodes=n,
                                     gpus_per_node=g, replicas=int(count * scale))
        # Launched as their revision says, as the reconcile creates them.
        shapes += [(model, revision_current(model))] * int(count * scale)
    random.Random(7).shuffle(shapes)
    now = timezone.now()
    Replica.objects.bulk_create([Replica(model=m, revision=r, status="pending", status_changed_at=now)
                                 for m, r in shapes], batch_size=2000)
    return len(shapes)


def _check_invariants() -> list[str]:
    from django.db.models import Count

    from nodes.models import Node
    from replicas.models import GpuAllocation, Member, Replica

    problems = []
    twice = GpuAllocation.objects.values("gpu").annotate(n=Count("id")).filter(n__gt=1)
    if twice.exists():
        problems.append(f"{twice.count()} GPUs allocated more than once")
    fabric_of = {}
    for node_id, fabric in Node.fabrics.through.objects.values_list("node_id", "fabric__name"):
        fabric_of.setdefault(node_id, set()).add(fabric)
    for replica in Replica.objects.filter(status__in=["scheduled", "ready"]).prefetch_related("members"):
        members = list(replica.members.all())
        if len(members) > 1:
            common = set.intersection(*(fabric_of.get(m.node_id, set()) for m in members))
            if not common:
                problems.append(f"replica {replica.pk} spans fabrics or uses a fabric-less node")
            elif replica.fabric is None or replica.fabric.name not in common:
                problems.append(f"replica {replica.pk} records fabric {replica.fabric} but its nodes share {common}")
        if len(members) != replica.model.nodes:
            problems.append(f"replica {replica.pk} has {len(members)} members for {replica.model.nodes} nodes")
    allocated = GpuAllocation.objects.count()
    expected = sum(len(m.gpus) for m in Member.objects.all())
    if allocated != expected:
        problems.append(f"{allocated} GPU allocations but members hold {expected} GPUs")
    return problems


def _recreate_database(server: str, name: str) -> None:
    import psycopg

    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")


if __name__ == "__main__":
    sys.exit(main())
