"""How fast a lost node's replica is rebuilt, on the simulated cluster.

Four simulated nodes in two fabrics (real agents, real sim engines, a real
agent API, Celery worker and beat on PostgreSQL and Redis), a 2x4 model with
two replicas. node02 is killed (its agent and its engines); we time

  kill -> node02 declared lost -> its replica failed -> replacement ready

The goal: the replacement ready within 2 s of the node being declared lost
(the seeds' run took 20 s; GPUStack's defaults take minutes). The grace
period is a setting (--grace); what is measured here is what llmgw adds to it.

--topology fabric3: three 6-GPU nodes in one fabric and one 2x4 replica, so
no spare pair exists: the replacement needs the GPUs its failed original
held on the surviving node. When the node dies with its engines, the group
breaks, the leader's node reports its engine exited, those GPUs are free at
once, and the replacement need not wait for the dead node to be declared
lost: "node declared lost -> replacement ready" is negative.

    make bench-failover        (or: python bench/failover.py --runs 3)
    python bench/failover.py --topology fabric3 --mode kill --grace 10
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _cluster import BenchCluster, database_ready  # noqa: E402 - bench/ sibling

DB_NAME = "llmgw_bench_failover"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="kills to time (default 3)")
    parser.add_argument("--grace", type=float, default=3.0, help="LLMGW_NODE_GRACE in seconds (default 3)")
    parser.add_argument("--pg", default="postgres://postgres@127.0.0.1:5432", help="PostgreSQL server URL")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/4")
    parser.add_argument("--topology", choices=["seeds", "fabric3"], default="seeds",
                        help="seeds: 4 nodes in two fabrics, two 2x4 replicas; fabric3: three 6-GPU nodes "
                        "in one fabric, one 2x4 replica (no spare pair: the survivors' GPUs are needed)")
    parser.add_argument("--db-name", default=DB_NAME, help=f"database to (re)create on --pg (default {DB_NAME})")
    parser.add_argument("--mode", choices=["kill", "freeze", "both"], default="both",
                        help="kill: the node dies with its engines (the replica's group breaks at once); "
                        "freeze: only its agent stops (SIGSTOP), so only the lost-node sweep can tell")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="llmgw-failover-"))
    atexit.register(shutil.rmtree, base, ignore_errors=True)  # its files go with it
    env = {
        "DATABASE_URL": f"{args.pg}/{args.db_name}",
        "CELERY_BROKER_URL": args.redis,
        "LLMGW_REDIS_URL": args.redis,
        "LLMGW_DATA_DIR": str(base / "data"),
        "LLMGW_NODE_GRACE": str(args.grace),
        "LLMGW_SWEEP_INTERVAL": "0.5",
        "LLMGW_HEARTBEAT_INTERVAL": "1",
        "LLMGW_RECONCILE_INTERVAL": "1",
        "LLMGW_DEAF_AFTER": "5",
        "PYTHONUNBUFFERED": "1",
    }
    os.environ.update(env)
    database_ready(pg=args.pg, db_name=args.db_name, redis_url=args.redis)
    from cli.simcluster import SEEDS_NODES, SimNode
    from cli.wait import wait_until
    from core.models import Event
    from nodes.choices import NodeStatus
    from nodes.models import Node
    from replicas.catalog import catalog_apply
    from replicas.choices import ReplicaStatus
    from replicas.models import Replica

    cluster = BenchCluster.start(base)
    results = []
    try:
        if args.topology == "fabric3":
            nodes = [SimNode(f"hx{i}", f"127.0.7.{i}", gpus=6, fabric="fab-x") for i in (1, 2, 3)]
            wanted = 1
        else:
            nodes = [SimNode(n.name, n.addr, n.gpus, n.fabric, n.hcas) for n in SEEDS_NODES]
            wanted = 2
        cluster.start_nodes(nodes)
        catalog_apply(entries=[{"name": "llama-70b", "engine": "sim", "model": "/models/llama-70b",
                                "nodes": 2, "gpus_per_node": 4, "replicas": wanted}])
        modes = ["kill", "freeze"] if args.mode == "both" else [args.mode]
        for run, mode in [(r, m) for m in modes for r in range(args.runs)]:
            wait_until(lambda: Replica.objects.filter(status=ReplicaStatus.READY).count() == wanted, timeout=90,
                       message=f"{wanted} ready replica(s)")
            victim_replica = Replica.objects.filter(status=ReplicaStatus.READY).order_by("id").first()
            victim = victim_replica.members.order_by("-rank").first().node.name
            before = set(Replica.objects.values_list("pk", flat=True))
            t_kill = time.time()
            if mode == "kill":
                cluster.kill_node(victim)
            else:
                cluster.freeze_agent(victim)
            lost = wait_until(
                lambda: Event.objects.filter(subject=f"node/{victim}", data__to="lost",
                                             created_at__gte=_dt(t_kill)).first(),
                timeout=args.grace + 30, interval=0.02, message=f"{victim} lost")
            failed = wait_until(
                lambda: Event.objects.filter(subject=f"replica/{victim_replica.pk}", data__to="failed").first(),
                timeout=30, interval=0.02, message="replica failed")
            ready = wait_until(
                lambda: Event.objects.filter(kind="replica.status", data__to="ready", created_at__gte=_dt(t_kill))
                .exclude(data__replica__in=list(before)).first(),
                timeout=60, interval=0.02, message="replacement ready")
            t_lost, t_failed, t_ready = (e.created_at.timestamp() for e in (lost, failed, ready))
            results.append((mode, t_lost - t_kill, t_failed - t_kill, t_ready - t_kill, t_ready - t_lost))
            print(f"{mode} {run + 1}: {victim}: replica failed after {t_failed - t_kill:.2f}s, node lost after "
                  f"{t_lost - t_kill:.2f}s, replacement ready after {t_ready - t_kill:.2f}s "
                  f"({t_ready - t_lost:+.2f}s from lost)", flush=True)
            # Bring the node back for the next run: it rejoins empty (a frozen
            # agent, thawed, stops the engines of its failed replica at once).
            if mode == "kill":
                cluster.start_agent(victim)
            else:
                cluster.thaw_agent(victim)
            wait_until(lambda: Node.objects.get(name=victim).status == NodeStatus.READY, timeout=30,
                       message=f"{victim} back")
    finally:
        cluster.stop()
    print()
    print(f"topology {args.topology}: " + ("three 6-GPU nodes in one fabric, one 2x4 replica" if args.topology == "fabric3"
                                          else "four 8-GPU nodes in two fabrics, two 2x4 replicas"))
    print(f"grace period {args.grace:.1f}s, heartbeat 1s, sweep every 0.5s")
    print(f"{'':40}{'median':>9}{'max':>9}")
    for mode in modes:
        rows = [r for r in results if r[0] == mode]
        print(f"{mode} ({len(rows)} runs): " + ("the node and its engines die" if mode == "kill"
                                               else "only the agent stops; engines run on"))
        for label, index in (("  -> replica failed", 2), ("  -> node declared lost", 1),
                             ("  -> replacement ready", 3), ("  node declared lost -> replacement ready", 4)):
            values = [r[index] for r in rows]
            print(f"{label:40}{statistics.median(values):>8.2f}s{max(values):>8.2f}s")
    worst = max(r[4] for r in results)
    print(f"goal (replacement ready within 2 s of the node being declared lost): "
          f"{'met' if worst <= 2.0 else 'NOT met'} (worst {worst:+.2f}s)")
    return 0


def _dt(ts: float):
    import datetime as dt

    return dt.datetime.fromtimestamp(ts - 0.5, tz=dt.timezone.utc)


if __name__ == "__main__":
    sys.exit(main())
