"""The web UI's cluster page at cluster scale, on PostgreSQL.

1,000 nodes x 8 GPUs in 16 fabrics plus 50 fabric-less nodes, filled with the
scheduler benchmark's replica mix by the real scheduler, with fresh GPU
readings for every GPU (kept through the heartbeat's own path,
``nodes.telemetry.telemetry_keep``: utilisation spread over 0-100 %, GPU 3 of
one node in 50 thermal throttling, so degraded), so that every cell is shaded
and the utilisation column is paid for; then the cluster page
and its live update are rendered through Django's test client (server time:
queries, Python and templates, no network) and the figures printed, with the
number of queries per request, the process CPU per request (the machine is
shared) and the bytes of each answer. Goals: under 300 ms for the whole page;
under 100 KiB per live refresh (``/cluster/grid.json``, what every open
browser fetches every 3 s; the HTML partial is what a filter change fetches).

    python bench/ui.py [--nodes 1000] [--runs 20]
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import scheduler as scheduler_bench  # noqa: E402 - bench/ is on the path when run as a script

DB_NAME = "llmgw_bench_ui"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000, help="fabric nodes (default 1000)")
    parser.add_argument("--fabrics", type=int, default=16)
    parser.add_argument("--islands", type=int, default=50)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--pg", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/2")
    args = parser.parse_args()

    data_dir = tempfile.mkdtemp(prefix="llmgw-bench-ui-")
    atexit.register(shutil.rmtree, data_dir, ignore_errors=True)
    os.environ.update(
        DATABASE_URL=f"{args.pg}/{DB_NAME}",
        CELERY_BROKER_URL=args.redis,
        LLMGW_REDIS_URL=args.redis,
        LLMGW_DATA_DIR=data_dir,
        DJANGO_SETTINGS_MODULE="llmgw_site.settings",
    )
    scheduler_bench._recreate_database(args.pg, DB_NAME)
    import django

    django.setup()
    import redis
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from replicas import enqueue, scheduling

    logging.disable(logging.INFO)  # the scheduler's Events, one log line each
    redis.Redis.from_url(args.redis).flushdb()
    call_command("migrate", verbosity=0)
    enqueue.reconcile_request = lambda **kw: None
    scheduler_bench._build_cluster(args.nodes, args.fabrics, args.islands)
    scheduler_bench._pending_replicas(1.0)
    placed = scheduling.replicas_schedule_pending()
    degraded = _readings_for_every_gpu()

    settings.ALLOWED_HOSTS = ["*"]
    get_user_model().objects.create_superuser("bench", "", "bench-password")
    client = Client()
    client.login(username="bench", password="bench-password")
    from nodes.models import Gpu, Node
    from replicas.models import GpuAllocation

    print(f"cluster: {Node.objects.count()} nodes, {Gpu.objects.count()} GPUs, "
          f"{GpuAllocation.objects.count()} held by {placed} placed replicas; fresh readings for every GPU, "
          f"{degraded} degraded")
    results = {}
    sizes = {}
    for label, url in (("cluster page", "/"), ("live refresh", "/cluster/grid.json"),
                       ("HTML partial (filters)", "/cluster/grid/"),
                       ("live, one fabric", "/cluster/grid.json?fabric=ib-03"),
                       ("partial, one fabric", "/cluster/grid/?fabric=ib-03"),
                       ("partial, name filter", "/cluster/grid/?name=node00")):
        client.get(url)  # warm: templates compiled, connection open
        times, cpu = [], []
        for _ in range(args.runs):
            with CaptureQueriesContext(connection) as queries:
                start, start_cpu = time.perf_counter(), time.process_time()
                response = client.get(url)
                cpu.append((time.process_time() - start_cpu) * 1000)
                times.append((time.perf_counter() - start) * 1000)
            assert response.status_code == 200, response.status_code
        times.sort()
        sizes[url] = len(response.content)
        print(f"{label:23} {url:32} p50 {statistics.median(times):6.1f} ms  max {times[-1]:6.1f} ms  "
              f"CPU p50 {statistics.median(cpu):6.1f} ms  {len(queries.captured_queries)} queries  "
              f"{sizes[url] / 1024:.0f} KiB ({sizes[url]:,} bytes)")
        results[url] = statistics.median(times)
    print(f"bytes per live refresh: {sizes['/cluster/grid.json']:,} "
          f"({sizes['/cluster/grid/'] / sizes['/cluster/grid.json']:.1f}x less than the HTML partial's "
          f"{sizes['/cluster/grid/']:,})")
    print(f"goal (whole cluster page under 300 ms): {'met' if results['/'] < 300 else 'NOT met'}")
    print(f"goal (live refresh under 100 KiB): {'met' if sizes['/cluster/grid.json'] < 100 * 1024 else 'NOT met'}")
    return 0


def _readings_for_every_gpu() -> int:
    """A heartbeat's telemetry block for every node, kept as the agent API keeps it."""
    from nodes import telemetry
    from nodes.gpus import gpus_judged
    from nodes.models import Gpu

    by_node: dict[str, list[tuple[int, str]]] = {}
    for name, index, uuid in Gpu.objects.order_by("node__name", "index").values_list("node__name", "index", "uuid"):
        by_node.setdefault(name, []).append((index, uuid))
    degraded = 0
    for n, (name, gpus) in enumerate(by_node.items()):
        readings = [{"index": i, "uuid": uuid, "util": (n * 37 + i * 23) % 101, "mem_used_mib": 120_000,
                     "mem_total_mib": 143771, "temp_c": 60 + i, "power_w": 400.0} for i, uuid in gpus]
        if n % 50 == 0 and len(readings) > 3:
            readings[3].update(temp_c=91, thermal_throttle=True)
            degraded += 1
        telemetry.telemetry_keep(node_name=name, block=telemetry.telemetry_parse({"source": "sim", "gpus": readings}),
                                 persist=gpus_judged)
    telemetry.store().flush()
    return degraded


if __name__ == "__main__":
    sys.exit(main())
