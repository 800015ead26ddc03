"""Weights on the nodes: what a spare that holds them saves a rebuild, and
how often placement picks a node that holds them.

1. Loss to replacement ready, on the simulated cluster (real agents with
   weights caches, real sim engines, a real agent API, Celery worker and beat
   on PostgreSQL and Redis). The weights come from a loopback file server
   whose link has a fixed bandwidth (--link bytes/s per download; each agent
   fetches one file at a time). Three 8-GPU nodes in one fabric, a 1x8 model
   with one replica. The node serving it is killed; we time

     kill -> node declared lost -> replacement ready

   with ``spares: 1`` (the fabric keeps the weights on one more node: the
   replacement goes there and starts at once) and with ``spares: 0`` (the
   replacement is placed where the weights are not, and stages them first).

2. Placement: on random clusters (pure ``place_weights``, no database), how
   often the replica lands on nodes that hold its weights when such a place
   fits it whole (goal: every time), and the CPU time per placement.

    python bench/weights.py [--runs 2] [--size 200000000] [--link 50000000]

The machine is shared with other work: wall-clock figures are noisy; the
placement figure is process CPU time (time.process_time).
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
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

from _cluster import AGENT_TIMINGS, BenchCluster, database_ready  # noqa: E402 - bench/ sibling

DB_NAME = "llmgw_bench_weights"


def placement_hits(trials: int, seed: int = 7) -> tuple[int, int, float]:
    """(cases where holders fit, of those placed on holders only, CPU s per placement)."""
    from replicas.placement import ClusterSnapshot, NodeSnapshot, Placement, PlacementRequest
    from replicas.weights_placement import WeightsNeed, WeightsView, place_weights

    rng = random.Random(seed)
    need = WeightsNeed("m@r1", 140 * 10**9)
    fits = hits = 0
    cpu = 0.0
    for _ in range(trials):
        count = rng.randint(4, 64)
        fabrics = [f"ib-{i}" for i in range(rng.randint(1, 4))]
        names = [f"n{i:03d}" for i in range(count)]
        nodes = [NodeSnapshot(n, fabrics=(rng.choice(fabrics),), free_gpus=tuple(range(rng.choice([0, 2, 4, 8]))),
                              total_gpus=8) for n in names]
        snapshot = ClusterSnapshot(nodes)
        holders = {n for n in names if rng.random() < 0.3}
        view = WeightsView(caches=set(names), holders={need.key: holders},
                           room={n: rng.choice([0, 100, 200, 500]) * 10**9 for n in names})
        request = PlacementRequest("m", rng.choice([1, 1, 2, 4]), rng.choice([2, 4, 8]))
        # Does a whole place exist on holders alone (one fabric for a multi-node replica)?
        by_fabric: dict[str, int] = {}
        for node in nodes:
            if node.name in holders and len(node.free_gpus) >= request.gpus_per_node:
                by_fabric[node.fabric] = by_fabric.get(node.fabric, 0) + 1
        holder_fit = any(n >= request.nodes for n in by_fabric.values())
        started = time.process_time()
        result = place_weights(request, snapshot, view, need)
        cpu += time.process_time() - started
        if holder_fit:
            fits += 1
            hits += isinstance(result, Placement) and set(result.nodes) <= holders
    return fits, hits, cpu / trials


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="kills per scenario (default 2)")
    parser.add_argument("--size", type=int, default=200_000_000, help="bytes of weights per model (default 200 MB)")
    parser.add_argument("--link", type=int, default=50_000_000, help="bytes per second of the link (default 50 MB/s)")
    parser.add_argument("--grace", type=float, default=3.0, help="LLMGW_NODE_GRACE in seconds (default 3)")
    parser.add_argument("--trials", type=int, default=5000, help="random placements (default 5000)")
    parser.add_argument("--pg", default="postgres://postgres@127.0.0.1:5432", help="PostgreSQL server URL")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/2")
    parser.add_argument("--db-name", default=DB_NAME)
    parser.add_argument("--skip-cluster", action="store_true", help="only the placement figures")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="llmgw-weights-"))
    atexit.register(shutil.rmtree, base, ignore_errors=True)  # its files go with it
    env = {
        "DATABASE_URL": f"{args.pg}/{args.db_name}", "CELERY_BROKER_URL": args.redis, "LLMGW_REDIS_URL": args.redis,
        "LLMGW_DATA_DIR": str(base / "data"), "LLMGW_NODE_GRACE": str(args.grace), "LLMGW_SWEEP_INTERVAL": "0.5",
        "LLMGW_HEARTBEAT_INTERVAL": "1", "LLMGW_RECONCILE_INTERVAL": "1", "LLMGW_DEAF_AFTER": "5",
        "PYTHONUNBUFFERED": "1",
    }
    os.environ.update(env)
    results: dict[str, list[tuple[float, float, bool]]] = {"spare": [], "none": []}
    if not args.skip_cluster:
        database_ready(pg=args.pg, db_name=args.db_name, redis_url=args.redis)
        results = _cluster(args, base)
    else:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
        import django

        django.setup()
    fits, hits, cpu = placement_hits(args.trials)
    print()
    print("machine shared with other work: wall-clock figures are noisy")
    if not args.skip_cluster:
        print(f"weights {args.size / 1e6:.0f} MB per model in 4 files, link {args.link / 1e6:.0f} MB/s per download "
              f"(one at a time per node): a full fetch takes {args.size / args.link:.1f}s; grace {args.grace:.1f}s")
        print(f"{'':44}{'median':>9}{'max':>9}")
        for scenario, label in (("spare", "spares: 1 (a spare in the fabric holds them)"),
                                ("none", "spares: 0 (no other node holds them)")):
            rows = results[scenario]
            print(f"{label} ({len(rows)} runs)")
            for name, index in (("  kill -> replacement ready", 0), ("  node declared lost -> replacement ready", 1)):
                values = [r[index] for r in rows]
                print(f"{name:44}{statistics.median(values):>8.2f}s{max(values):>8.2f}s")
            print(f"  replacement staged weights: {sum(r[2] for r in rows)} of {len(rows)}")
    print(f"placement: {args.trials} random clusters, {fits} where the replica fits whole on nodes holding its "
          f"weights; placed there {hits} of {fits} times (goal: every time: "
          f"{'met' if hits == fits else 'NOT met'}); {cpu * 1e3:.3f} ms CPU per placement")
    return 0


def _cluster(args, base: Path) -> dict[str, list[tuple[float, float, bool]]]:
    from cli.simcluster import SimNode
    from cli.wait import wait_until
    from core.models import Event
    from nodes.choices import NodeStatus
    from nodes.models import Node
    from replicas.catalog import catalog_apply, model_scale
    from replicas.choices import ReplicaStatus
    from replicas.models import CachedWeights, Replica
    from tests.weightservers import WeightsServer

    cluster = BenchCluster.start(base, agent_timings={
        **AGENT_TIMINGS, "weights": {"cache_dir": "weights", "budget": "20G", "downloads": 1}})
    server = WeightsServer().start()
    server.rate = args.link
    results: dict[str, list[tuple[float, float, bool]]] = {"spare": [], "none": []}
    try:
        cluster.start_nodes([SimNode(f"wx{i}", f"127.0.8.{i}", gpus=8, fabric="fab-w") for i in (1, 2, 3)])
        for run in range(args.runs):
            for scenario in ("spare", "none"):
                name = f"{scenario}-{run}"
                piece = args.size // 4
                files = {f"model-{i}.safetensors": hashlib.sha256(f"{name}/{i}".encode()).digest() * (piece // 32)
                         for i in range(4)}
                url = server.add_files(name, files, revision="v1")
                catalog_apply(entries=[{"name": name, "engine": "sim", "model": f"/models/{name}", "nodes": 1,
                                        "gpus_per_node": 8, "replicas": 1, "spares": 1 if scenario == "spare" else 0,
                                        "source": {"kind": "http", "url": url}}])
                wait_until(lambda: Replica.objects.filter(model__name=name, status=ReplicaStatus.READY).exists(),
                           timeout=120, message=f"{name} ready")
                if scenario == "spare":
                    wait_until(lambda: CachedWeights.objects.filter(model=name, complete=True).count() == 2,
                               timeout=120, message=f"{name}: the spare holds the weights")
                replica = Replica.objects.get(model__name=name, status=ReplicaStatus.READY)
                victim = replica.members.get().node.name
                t_kill = time.time()
                cluster.kill_node(victim)
                lost = wait_until(lambda: Event.objects.filter(subject=f"node/{victim}", data__to="lost",
                                                               created_at__gte=_dt(t_kill)).first(),
                                  timeout=args.grace + 30, interval=0.02, message=f"{victim} lost")
                ready = wait_until(
                    lambda: Replica.objects.filter(model__name=name, status=ReplicaStatus.READY)
                    .exclude(pk=replica.pk).first(), timeout=300, interval=0.02, message="replacement ready")
                t_ready = ready.ready_at.timestamp()
                staged = Event.objects.filter(subject=f"replica/{ready.pk}", data__to="staging").exists()
                results[scenario].append((t_ready - t_kill, t_ready - lost.created_at.timestamp(), staged))
                print(f"{scenario} {run + 1}: {victim} killed; replacement ready after {t_ready - t_kill:.2f}s "
                      f"({t_ready - lost.created_at.timestamp():+.2f}s from lost), staged: {staged}", flush=True)
                model_scale(name=name, replicas=0)
                cluster.start_agent(victim)
                wait_until(lambda: Node.objects.get(name=victim).status == NodeStatus.READY, timeout=30,
                           message=f"{victim} back")
                wait_until(lambda: not Replica.objects.filter(model__name=name).exclude(
                    status=ReplicaStatus.STOPPED).exists(), timeout=60, message=f"{name} stopped")
    finally:
        server.stop()
        cluster.stop()
    return results


def _dt(ts: float):
    import datetime as dt

    return dt.datetime.fromtimestamp(ts - 0.5, tz=dt.timezone.utc)


if __name__ == "__main__":
    sys.exit(main())
