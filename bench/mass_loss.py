"""50 nodes lost at once on the 1,000-node cluster: how many reconcile passes
run, and how long until every replacement is placed.

The cluster of ``bench/scheduler.py`` (1,000 nodes x 8 GPUs in 16 fabrics plus
50 fabric-less nodes) holding half its mix of replicas (about 1,000 replicas
on 4,100 GPUs: room for every replacement), all ready. A real Celery worker
(threads pool, concurrency 8, as production runs it) on PostgreSQL and Redis,
no beat: every pass it runs was asked for by a change. Then 50 nodes holding
replicas fall silent and one lost-node sweep declares them lost (as beat's
tick would, mass-silence hold off); we time until no replica is pending and
every model has its count placed, and count the passes the worker ran (and
the reconcile task messages it received), until it has been idle for 3 s.

    python bench/mass_loss.py [--lost 50] [--nodes 1000] [--scale 0.5]

The worker runs under ``bench/_counting_worker.py``, which counts calls of
``replicas.reconcile.replicas_reconcile`` whatever calls it, so that the same
bench measures a tree from before coalescing and one after.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DB_NAME = "llmgw_bench_mass_loss"
IDLE = 3.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--lost", type=int, default=50, help="nodes lost at once (default 50)")
    parser.add_argument("--scale", type=float, default=0.5, help="share of bench/scheduler.py's replica mix")
    parser.add_argument("--concurrency", type=int, default=8, help="worker threads (default 8)")
    parser.add_argument("--pg", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/3")
    parser.add_argument("--db", default=DB_NAME)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()

    data_dir = tempfile.mkdtemp(prefix="llmgw-bench-mass-loss-")
    atexit.register(shutil.rmtree, data_dir, ignore_errors=True)
    os.environ.update(
        DATABASE_URL=f"{args.pg}/{args.db}",
        CELERY_BROKER_URL=args.redis,
        LLMGW_REDIS_URL=args.redis,
        LLMGW_DATA_DIR=data_dir,
        LLMGW_MASS_SILENCE_FRACTION="1",
        LLMGW_LOG_LEVEL="WARNING",
        DJANGO_SETTINGS_MODULE="llmgw_site.settings",
    )
    from bench import scheduler as cluster

    cluster._recreate_database(args.pg, args.db)
    import django

    django.setup()
    import redis
    from django.core.management import call_command
    from django.db.models import Count, F, Q, Sum
    from django.utils import timezone

    from nodes import liveness, sweep
    from nodes.models import ControlPlaneClock, Node
    from replicas import scheduling
    from replicas.models import CatalogEntry, Member, Replica

    client = redis.Redis.from_url(args.redis)
    client.flushdb()
    call_command("migrate", verbosity=0)
    cluster._build_cluster(args.nodes, 16, args.nodes // 20)
    total = cluster._pending_replicas(args.scale)
    placed = scheduling.replicas_schedule_pending()
    Replica.objects.filter(status="scheduled").update(status="ready", ready_at=timezone.now())
    Member.objects.update(state="running")
    # Whatever the placements asked for (no worker was running) is forgotten.
    client.flushdb()

    holders = sorted(set(Member.objects.values_list("node__name", flat=True)))
    step = max(1, len(holders) // args.lost)
    lost = holders[::step][: args.lost]
    hit = Replica.objects.filter(members__node__name__in=lost).distinct().count()
    now = time.time()
    store = liveness.store()
    client.hset(liveness.SEEN_KEY, mapping={
        name: repr(now - 600 if name in lost else now) for name in Node.objects.values_list("name", flat=True)})
    Node.objects.update(last_heartbeat_at=timezone.now())
    Node.objects.filter(name__in=lost).update(last_heartbeat_at=timezone.now() - timezone.timedelta(seconds=600),
                                              status_changed_at=timezone.now() - timezone.timedelta(seconds=600))
    store.mark_listener_alive(now)
    ControlPlaneClock.objects.update_or_create(pk=1, defaults={
        "heard_since": timezone.now() - timezone.timedelta(hours=1), "last_sweep_at": timezone.now(),
        "deaf_since": None})

    worker = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "_counting_worker.py"), "--concurrency", str(args.concurrency)],
        env=dict(os.environ), start_new_session=True, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not client.get("bench:ready"):
            if worker.poll() is not None or time.monotonic() > deadline:
                print("the worker did not start")
                return 1
            time.sleep(0.1)
        print(f"cluster: {args.nodes} nodes + {args.nodes // 20} fabric-less; {placed} of {total} replicas placed "
              f"and ready; worker: threads x {args.concurrency}")

        start = time.perf_counter()
        declared = sweep.nodes_sweep_lost()
        swept = time.perf_counter() - start
        wanted = CatalogEntry.objects.aggregate(n=Sum("replicas"))["n"]

        def settled() -> bool:
            if Replica.objects.filter(status="pending").exists():
                return False
            short = CatalogEntry.objects.annotate(
                have=Count("replica_set", filter=Q(replica_set__status__in=["scheduled", "starting", "ready"],
                                               replica_set__draining=False))).filter(have__lt=F("replicas"))
            return not short.exists()

        deadline = time.monotonic() + args.timeout
        while not settled():
            if time.monotonic() > deadline:
                print(f"NOT settled after {args.timeout:.0f}s")
                return 1
            time.sleep(0.05)
        placed_after = time.perf_counter() - start
        passes_at_placed = int(client.get("bench:passes") or 0)
        # Then until the worker is idle: what the burst cost in all.
        last, quiet_since = None, time.monotonic()
        while time.monotonic() - quiet_since < IDLE:
            seen = (client.get("bench:passes"), client.get("bench:tasks"), client.llen("celery"))
            if seen != last:
                last, quiet_since = seen, time.monotonic()
            time.sleep(0.1)
        passes = int(client.get("bench:passes") or 0)
        tasks = int(client.get("bench:tasks") or 0)
        pass_seconds = float(client.get("bench:pass_seconds") or 0)
        print(f"lost at once: {len(declared)} nodes (asked {args.lost}), holding {hit} replicas; sweep took {swept:.2f}s")
        print(f"every replacement placed {placed_after:.2f}s after the sweep started "
              f"({wanted} replicas wanted, none pending)")
        print(f"reconcile passes run: {passes_at_placed} by then, {passes} in all until idle "
              f"({pass_seconds:.1f}s of passes, {pass_seconds / max(1, passes) * 1000:.0f} ms each); "
              f"reconcile task messages: {tasks}")
        return 0
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


if __name__ == "__main__":
    sys.exit(main())
