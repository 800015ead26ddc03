"""Autoscaling on the simulated cluster: a load trace through the gateway.

Four simulated nodes (real agents, real sim engines with a cold start, a
real agent API, Celery worker and beat, the web process with the gateway,
on PostgreSQL and Redis). One autoscaled model (1 GPU per replica), a load
of streamed chat requests (Poisson arrivals, each request a few seconds of
decode) following a trace:

  steady (base rate) -> step to 4x -> back to base -> idle until zero
  -> a burst from zero (more requests than the held-request bound)
  -> noisy: random +-30 % around twice the base rate, changed every 5 s

Reported per phase: requests, failed (anything but 200, and the burst's
429s counted apart), TTFT p50/p90, the control plane's CPU; for the step:
time from the step to the scale-up decision and to the new replicas being
ready; the first request after zero (goal: within cold start + 2 s, no
error); direction changes of the wanted count under the noisy load (goal:
at most one per 5 minutes). The default run is bounded (about 5-6 min);
--full runs the long trace (noisy for 10 min).

    make bench-autoscale            (or: python bench/autoscale.py [--full] [--cold-start 20])
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DB_NAME = "llmgw_bench_autoscale"
# The first SSE event carrying text (bench/_http_load.py's rule): not the role-only first event.
_FIRST_TOKEN = re.compile(rb'"(?:content|text)":\s*"[^"]')
MODEL = "auto"


@dataclass
class Result:
    phase: str
    started: float
    status: int
    latency: float
    ttft: float | None
    error: str = ""


@dataclass
class Timeline:
    """(time, wanted, ready) every quarter second, read from the database."""

    points: list[tuple[float, int, int]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        from django.db import close_old_connections

        from replicas.choices import ReplicaStatus
        from replicas.models import CatalogEntry, Replica

        while not self.stop.is_set():
            try:
                wanted = CatalogEntry.objects.get(name=MODEL).replicas
                ready = Replica.objects.filter(model__name=MODEL, status=ReplicaStatus.READY).count()
                self.points.append((time.time(), wanted, ready))
            except Exception:  # noqa: BLE001 - a monitor: the next reading will do
                close_old_connections()
            time.sleep(0.25)


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def _cpu(pids: list[int]) -> float:
    from bench._proc_cpu import _proc_cpu

    return sum(_proc_cpu(p) or 0.0 for root in pids for p in _descendants(root))


async def _one(session, url: str, phase: str, results: list[Result], max_tokens: int) -> None:
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "tell me about autoscaling " + str(random.random())}]}
    started = time.time()
    t0 = time.perf_counter()
    ttft = None
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                text = await response.text()
                results.append(Result(phase, started, response.status, time.perf_counter() - t0, None, text[:200]))
                return
            done = False
            async for chunk in response.content.iter_any():
                if ttft is None and _FIRST_TOKEN.search(chunk):
                    ttft = time.perf_counter() - t0
                if b"[DONE]" in chunk:
                    done = True
            results.append(Result(phase, started, 200 if done else 599, time.perf_counter() - t0, ttft,
                                  "" if done else "stream cut short"))
    except Exception as exc:  # noqa: BLE001 - every failure is a result
        results.append(Result(phase, started, 0, time.perf_counter() - t0, ttft, repr(exc)[:200]))


async def _poisson(session, url, phase, results, *, rate, seconds, max_tokens, tasks, noisy_every=0.0):
    end = time.monotonic() + seconds
    level, next_change = rate, 0.0
    while time.monotonic() < end:
        if noisy_every and time.monotonic() >= next_change:
            level = rate * random.uniform(0.7, 1.3)
            next_change = time.monotonic() + noisy_every
        tasks.append(asyncio.ensure_future(_one(session, url, phase, results, max_tokens)))
        await asyncio.sleep(random.expovariate(level))


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s" if value < 1 else f"{value:.2f}s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the long trace (longer phases, 10 min of noisy load)")
    parser.add_argument("--cold-start", type=float, default=20.0, help="sim engine start delay in seconds (default 20)")
    parser.add_argument("--base-rate", type=float, default=2.0, help="requests/s of the steady phase (default 2)")
    parser.add_argument("--max-tokens", type=int, default=20, help="tokens per answer (default 20)")
    parser.add_argument("--token-delay", type=float, default=0.1, help="sim seconds per token (default 0.1: 2 s per request)")
    parser.add_argument("--max-num-seqs", type=int, default=6,
                        help="sim engine batch limit: more requests wait in its queue (default 6)")
    parser.add_argument("--burst", type=int, default=10, help="requests sent at once to the model at zero (default 10)")
    parser.add_argument("--hold-max", type=int, default=6, help="the policy's held-request bound (default 6)")
    parser.add_argument("--pg", default="postgres://postgres@127.0.0.1:5432", help="PostgreSQL server URL")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/1")
    parser.add_argument("--db-name", default=DB_NAME)
    parser.add_argument("--json", help="write the figures to this file too")
    parser.add_argument("--quick", action="store_true",
                        help="every timed phase a quarter as long: a check that it runs end to end, not figures")
    args = parser.parse_args()
    scale = 2.0 if args.full else 1.0
    durations = {"steady": 40 * scale, "step": max(60.0, args.cold_start + 40) * scale, "down": 60 * scale,
                 "noisy": 600.0 if args.full else 90.0}
    policy = {"min": 0, "max": 6, "target": 4, "up_after": 4, "down_after": 30, "cooldown": 20, "max_step": 4,
              "zero_after": 30 * scale, "hold_max": args.hold_max, "hold_wait": args.cold_start + 30}
    if args.quick:
        durations = {name: seconds / 4 for name, seconds in durations.items()}

    base = Path(tempfile.mkdtemp(prefix="llmgw-autoscale-"))
    atexit.register(shutil.rmtree, base, ignore_errors=True)  # its files go with it
    env = {
        "DATABASE_URL": f"{args.pg}/{args.db_name}", "CELERY_BROKER_URL": args.redis, "LLMGW_REDIS_URL": args.redis,
        "LLMGW_DATA_DIR": str(base / "data"), "LLMGW_NODE_GRACE": "5", "LLMGW_SWEEP_INTERVAL": "1",
        "LLMGW_HEARTBEAT_INTERVAL": "1", "LLMGW_RECONCILE_INTERVAL": "1", "LLMGW_ROUTING_SETTLE": "0.5",
        "LLMGW_STOP_GRACE": "30", "LLMGW_AUTOSCALE_INTERVAL": "1", "LLMGW_GATEWAY_OPEN": "1", "PYTHONUNBUFFERED": "1",
        # The agents and their engines import this tree's code (not an installed copy's).
        "PYTHONPATH": str(REPO),
    }
    os.environ.update(env)
    from bench._cluster import BenchCluster, database_ready

    database_ready(pg=args.pg, db_name=args.db_name, redis_url=args.redis)
    import aiohttp
    from cli.simcluster import SEEDS_NODES, SimNode
    from cli.wait import wait_until
    from core.models import Event
    from replicas.catalog import catalog_apply

    cluster = BenchCluster.start(base, webs=1)
    web_port = cluster.web_ports[0]
    control = [cluster.processes.procs[name].pid for name in ("worker", "beat", "web")]
    url = f"http://127.0.0.1:{web_port}/v1/chat/completions"
    results: list[Result] = []
    timeline = Timeline()
    marks: dict[str, float] = {}
    cpu: dict[str, tuple[float, float]] = {}
    try:
        cluster.start_nodes([SimNode(n.name, n.addr, n.gpus, n.fabric, n.hcas) for n in SEEDS_NODES])
        catalog_apply(entries=[{"name": MODEL, "engine": "sim", "model": "/models/auto", "nodes": 1,
                                "gpus_per_node": 1, "replicas": 1, "autoscale": policy,
                                "args": ["--token-delay", str(args.token_delay), "--max-num-seqs",
                                         str(args.max_num_seqs)],
                                "env": {"LLMGW_SIM_COLD_START": str(args.cold_start)}}])
        from replicas.choices import ReplicaStatus
        from replicas.models import Replica

        wait_until(lambda: Replica.objects.filter(status=ReplicaStatus.READY).count() == 1,
                   timeout=args.cold_start + 60, message="the first replica ready")
        wait_until(lambda: _routes(web_port), timeout=30, message="the gateway routing the model")
        threading.Thread(target=timeline.run, daemon=True).start()

        async def trace() -> None:
            timeout = aiohttp.ClientTimeout(total=args.cold_start + 120)
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
                tasks: list[asyncio.Future] = []

                async def phase(name, coroutine):
                    before = _cpu(control)
                    marks[name] = time.time()
                    print(f"{time.strftime('%H:%M:%S')} phase {name}", flush=True)
                    await coroutine
                    cpu[name] = (_cpu(control) - before, time.time() - marks[name])

                common = dict(max_tokens=args.max_tokens, tasks=tasks)
                await phase("steady", _poisson(session, url, "steady", results, rate=args.base_rate,
                                               seconds=durations["steady"], **common))
                await phase("step", _poisson(session, url, "step", results, rate=4 * args.base_rate,
                                             seconds=durations["step"], **common))
                await phase("down", _poisson(session, url, "down", results, rate=args.base_rate,
                                             seconds=durations["down"], **common))
                await asyncio.gather(*tasks)

                async def idle() -> None:
                    while not (timeline.points and timeline.points[-1][1] == 0 and timeline.points[-1][2] == 0):
                        await asyncio.sleep(0.5)
                    # The stopped replicas' engines gone too.
                    await asyncio.sleep(2)

                await phase("idle", idle())

                async def burst() -> None:
                    burst_tasks = []
                    for _ in range(args.burst):
                        burst_tasks.append(asyncio.ensure_future(_one(session, url, "burst", results, args.max_tokens)))
                        await asyncio.sleep(0.01)
                    await asyncio.gather(*burst_tasks)

                await phase("burst", burst())
                await phase("noisy", _poisson(session, url, "noisy", results, rate=2 * args.base_rate,
                                              seconds=durations["noisy"], noisy_every=5.0, **common))
                await asyncio.gather(*tasks)

        asyncio.run(trace())
        timeline.stop.set()
        figures = _report(args, policy, results, timeline, marks, cpu, Event)
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2))
    finally:
        timeline.stop.set()
        cluster.stop()
    return 0


def _routes(web_port: int) -> bool:
    import httpx

    try:
        return bool(httpx.get(f"http://127.0.0.1:{web_port}/v1/models", timeout=2).json()["data"])
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def _report(args, policy, results, timeline, marks, cpu, Event) -> dict:
    import datetime as dt

    print()
    print(f"model: 1 GPU per replica, sim engine cold start {args.cold_start:g}s, batch limit {args.max_num_seqs}, "
          f"{args.max_tokens} tokens at {args.token_delay:g}s each per request; policy {json.dumps(policy)}")
    print("machine shared (2 cores, other engineers' runs): wall-clock figures are noisy; CPU is the control plane's "
          "(web + worker + beat, with their children)")
    figures: dict = {"policy": policy, "cold_start": args.cold_start, "phases": {}}
    print(f"{'phase':8}{'reqs':>6}{'failed':>8}{'429':>6}{'TTFT p50':>10}{'p90':>9}{'CPU s':>8}{'wall s':>8}")
    for name in ("steady", "step", "down", "idle", "burst", "noisy"):
        rows = [r for r in results if r.phase == name]
        ttfts = [r.ttft for r in rows if r.ttft is not None and r.status == 200]
        failed = [r for r in rows if r.status not in (200, 429)]
        limited = [r for r in rows if r.status == 429]
        used, wall = cpu.get(name, (0.0, 0.0))
        print(f"{name:8}{len(rows):>6}{len(failed):>8}{len(limited):>6}{_fmt(_p(ttfts, 0.5)):>10}"
              f"{_fmt(_p(ttfts, 0.9)):>9}{used:>8.1f}{wall:>8.0f}")
        figures["phases"][name] = {"requests": len(rows), "failed": len(failed), "429": len(limited),
                                   "ttft_p50": _p(ttfts, 0.5), "ttft_p90": _p(ttfts, 0.9), "cpu_s": used,
                                   "wall_s": wall, "errors": sorted({r.error for r in failed})[:5]}
    # The step: the first scale-up decision after it, and the new replicas ready.
    step = marks["step"]
    up = (Event.objects.filter(kind="autoscale", data__rule="up",
                               created_at__gte=dt.datetime.fromtimestamp(step, tz=dt.timezone.utc))
          .order_by("created_at").first())
    decision = up.created_at.timestamp() - step if up else None
    ready_at = None
    if up:
        target = up.data["to"]
        ready_at = next((t for t, wanted, ready in timeline.points if t >= up.created_at.timestamp() and
                         ready >= target), None)
    print(f"step to 4x: scale-up decision after {_fmt(decision)} (goal <= 10s)"
          + (f" ({up.data['from']} -> {up.data['to']})" if up else "")
          + f"; new replicas ready after {_fmt(ready_at - step if ready_at else None)}")
    # The burst from zero.
    burst = sorted((r for r in results if r.phase == "burst"), key=lambda r: r.started)
    served = [r for r in burst if r.status == 200]
    first = min(served, key=lambda r: r.started) if served else None
    print(f"burst of {len(burst)} from zero: {len(served)} served, {sum(r.status == 429 for r in burst)} got 429 "
          f"(hold bound {args.hold_max}), other failures {sum(r.status not in (200, 429) for r in burst)}; "
          f"first request: first token after {_fmt(first.ttft if first else None)} (goal <= cold start + 2 = "
          f"{args.cold_start + 2:g}s), whole answer after {_fmt(first.latency if first else None)} "
          f"({args.max_tokens} tokens at {args.token_delay:g}s)")
    # Direction changes under the noisy load.
    noisy = marks["noisy"]
    changes = [e.data for e in Event.objects.filter(
        kind="autoscale", created_at__gte=dt.datetime.fromtimestamp(noisy, tz=dt.timezone.utc)).order_by("created_at")]
    directions = [1 if c["to"] > c["from"] else -1 for c in changes]
    flips = sum(1 for a, b in zip(directions, directions[1:]) if a != b)
    minutes = cpu.get("noisy", (0, 0))[1] / 60
    # What the noise cost: the replicas kept (time-weighted from the quarter-second timeline) against
    # what the mean load needs (the mean of the samples' recommendations).
    during = [(wanted, ready) for t, wanted, ready in timeline.points if t >= noisy]
    mean_wanted = statistics.fmean(w for w, _ in during) if during else None
    from replicas.autoscaling.history import store as history_store

    recommended = [x["recommended"] for x in history_store().read(MODEL, since=noisy)]
    mean_recommended = statistics.fmean(recommended) if recommended else None
    print(f"noisy (+-30% around {2 * args.base_rate:g}/s, {minutes:.1f} min): {len(changes)} change(s) "
          f"{[(c['from'], c['to']) for c in changes]}, {flips} direction change(s) "
          f"({flips / (minutes / 5) if minutes else 0:.2f} per 5 min; goal <= 1 per 5 min); replicas wanted "
          f"{_num(mean_wanted)} on average, each look's recommendation {_num(mean_recommended)} on average "
          f"(from {min(recommended, default=0)} to {max(recommended, default=0)})")
    failed_total = sum(1 for r in results if r.status not in (200, 429))
    print(f"failed requests in the whole trace (429s of the burst apart): {failed_total} (goal 0)")
    figures.update(decision_s=decision, ready_s=(ready_at - step) if ready_at else None,
                   burst={"sent": len(burst), "served": len(served), "429": sum(r.status == 429 for r in burst),
                          "first_ttft_s": first.ttft if first else None,
                          "first_latency_s": first.latency if first else None},
                   noisy={"changes": len(changes), "direction_changes": flips, "minutes": minutes,
                          "steps": [(c["from"], c["to"]) for c in changes], "mean_wanted": mean_wanted,
                          "mean_recommended": mean_recommended},
                   failed=failed_total)
    return figures


if __name__ == "__main__":
    sys.exit(main())
