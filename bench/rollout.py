"""A rollout under steady gateway load, on the simulated cluster.

Eight simulated nodes (real agents, real sim engines, a real agent API,
web process with the gateway, Celery worker and beat, on PostgreSQL and
Redis); a model of 8 single-node replicas of 4 GPUs on 8-GPU nodes (room to
surge). Streamed chat completions go through the gateway at a steady
concurrency; the model's args change (a launch change: revision 1 -> 2) and
every replica is replaced, max_surge at a time. Measured:

  total time        apply -> the rollout is done (every ready replica on revision 2)
  failed requests   during the whole run (goal: 0)
  TTFT p50/p99      of the requests before the change, and of those during the rollout
  CPU               of this load generator's process and of the control plane's
                    processes over the rollout (the machine may be shared: wall-clock
                    figures move with it, CPU much less)

    python bench/rollout.py                 (--surge 2, --replicas 8, --concurrency 8)
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _cluster import BenchCluster, database_ready  # noqa: E402
from _http_load import Connection, Sample, build_request, percentile  # noqa: E402

DB_NAME = "llmgw_bench_rollout"


def _cpu_of(pid: int) -> float:
    """User + system CPU seconds of a process and its reaped children (/proc/<pid>/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(v) for v in fields[11:15]) / ticks


def _tree_cpu(roots: list[int]) -> float:
    """CPU seconds of processes and all their live descendants."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    tree, frontier = set(roots), list(roots)
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(_cpu_of(pid) for pid in tree)


class Load:
    """Streamed completions at a steady concurrency, each sample timestamped."""

    def __init__(self, host: str, port: int, model: str, concurrency: int) -> None:
        body = json.dumps({"model": model, "stream": True, "max_tokens": 8,
                           "messages": [{"role": "user", "content": "hello there"}]}).encode()
        self.raw = build_request(host, port, "/v1/chat/completions", body, {})
        self.host, self.port, self.concurrency = host, port, concurrency
        self.samples: list[tuple[float, Sample]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()))

    async def _run(self) -> None:
        async def worker() -> None:
            connection = Connection(self.host, self.port)
            try:
                while not self.stop.is_set():
                    try:
                        sample = await connection.request(self.raw, True)
                    except (OSError, asyncio.IncompleteReadError) as exc:
                        sample = Sample(False, 0.0, error=repr(exc))
                        connection.close()
                        connection = Connection(self.host, self.port)
                    self.samples.append((time.monotonic(), sample))
            finally:
                connection.close()

        await asyncio.gather(*(worker() for _ in range(self.concurrency)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--surge", type=int, default=2, help="the model's max_surge (default 2)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--before", type=float, default=10.0, help="seconds of load before the change")
    parser.add_argument("--pg", default="postgres://postgres@127.0.0.1:5432", help="PostgreSQL server URL")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/4")
    parser.add_argument("--db-name", default=DB_NAME, help=f"database to (re)create on --pg (default {DB_NAME})")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="llmgw-rollout-"))
    atexit.register(shutil.rmtree, base, ignore_errors=True)  # its files go with it
    env = {
        "DATABASE_URL": f"{args.pg}/{args.db_name}",
        "CELERY_BROKER_URL": args.redis,
        "LLMGW_REDIS_URL": args.redis,
        "LLMGW_DATA_DIR": str(base / "data"),
        "LLMGW_NODE_GRACE": "5",
        "LLMGW_SWEEP_INTERVAL": "0.5",
        "LLMGW_HEARTBEAT_INTERVAL": "1",
        "LLMGW_RECONCILE_INTERVAL": "1",
        "LLMGW_ROUTING_SETTLE": "0.5",
        "LLMGW_STOP_GRACE": "10",
        "LLMGW_DEAF_AFTER": "5",
        "LLMGW_GATEWAY_OPEN": "1",
        "PYTHONUNBUFFERED": "1",
    }
    os.environ.update(env)
    database_ready(pg=args.pg, db_name=args.db_name, redis_url=args.redis)
    import httpx
    from cli.simcluster import SimNode
    from cli.wait import wait_until
    from replicas.catalog import catalog_apply
    from replicas.choices import ReplicaStatus, RolloutStatus
    from replicas.models import Replica, Rollout

    cluster = BenchCluster.start(base, webs=1)
    web_port = cluster.web_ports[0]
    model = "llama-8b"
    entry = {"name": model, "engine": "sim", "model": "/models/llama-8b", "nodes": 1, "gpus_per_node": 4,
             "replicas": args.replicas, "max_surge": args.surge}
    load = None
    try:
        cluster.start_nodes([SimNode(f"node{i:02d}", f"127.0.1.{i}", gpus=8, fabric=None) for i in range(1, 9)])
        catalog_apply(entries=[entry])
        wait_until(lambda: Replica.objects.filter(status=ReplicaStatus.READY).count() == args.replicas, timeout=120,
                   message=f"{args.replicas} ready replicas")
        wait_until(lambda: _routes(httpx, web_port, model), timeout=30, message="the gateway to route the model")
        load = Load("127.0.0.1", web_port, model, args.concurrency)
        load.thread.start()
        time.sleep(args.before)
        pids = [p.pid for p in cluster.processes.procs.values()]
        cpu_plane = _tree_cpu(pids)
        cpu_self = time.process_time()
        t_apply = time.monotonic()
        catalog_apply(entries=[{**entry, "args": ["--token-delay", "0.01"]}])
        ready_min = args.replicas
        while True:
            rollout = Rollout.objects.first()
            ready_min = min(ready_min, Replica.objects.filter(status=ReplicaStatus.READY).count())
            if rollout is not None and rollout.status in (RolloutStatus.DONE, RolloutStatus.FAILED):
                break
            if time.monotonic() - t_apply > 600:
                raise SystemExit("the rollout did not end within 600 s")
            time.sleep(0.1)
        t_done = time.monotonic()
        cpu_self = time.process_time() - cpu_self
        cpu_plane = _tree_cpu(pids) - cpu_plane
        time.sleep(3)
    finally:
        if load is not None:
            load.stop.set()
            load.thread.join(timeout=30)
        cluster.stop()
    before = [s for at, s in load.samples if at < t_apply]
    during = [s for at, s in load.samples if t_apply <= at <= t_done]
    failed = [s for _, s in load.samples if not s.ok]
    on_new = Replica.objects.filter(status=ReplicaStatus.READY, revision__number=2).count()

    def ttft(samples, q):
        value = percentile([s.ttft for s in samples if s.ok and s.ttft is not None], q)
        return f"{value * 1000:.0f} ms" if value is not None else "-"

    print(f"rollout of {args.replicas} replicas (1x4 GPUs on 8-GPU nodes, max_surge {args.surge}) "
          f"under {args.concurrency} concurrent streamed requests through the gateway")
    print(f"  status                {rollout.status} ({rollout.status_reason})")
    print(f"  total time            {t_done - t_apply:.1f} s ({(t_done - t_apply) / args.replicas:.2f} s per replica)")
    print(f"  ready replicas        never below {ready_min} (wanted {args.replicas}); {on_new} on revision 2 at the end")
    print(f"  requests              {len(load.samples)} in all, {len(before)} before, {len(during)} during")
    print(f"  failed requests       {len(failed)} (goal 0)" + (f": {failed[0].error}" if failed else ""))
    print(f"  TTFT p50 before       {ttft(before, 50)}    during {ttft(during, 50)}")
    print(f"  TTFT p99 before       {ttft(before, 99)}    during {ttft(during, 99)}")
    print(f"  CPU over the rollout  control plane (web, agent API, worker, beat) {cpu_plane:.1f} s, "
          f"load generator {cpu_self:.1f} s (wall {t_done - t_apply:.1f} s; the machine may be shared)")
    return 0 if not failed and rollout.status == RolloutStatus.DONE else 1


def _routes(httpx, port: int, model: str) -> bool:
    try:
        return any(m["id"] == model for m in httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"])
    except (httpx.HTTPError, ValueError, KeyError):
        return False


if __name__ == "__main__":
    sys.exit(main())
