"""Tenancy: per-key limits, priorities and their cost, through two gateway processes.

    make bench-tenancy      (or: python bench/tenancy.py [--seconds 20] [--runs 3])

One machine: PostgreSQL and Redis, sim engines registered as ready replicas,
and two gateway web processes exactly as ``llmgw up`` starts them. The load
generator (bench/_http_load.py) spends a few tens of microseconds a request.

1. **Exactness** at concurrency 32, half of the connections on each gateway
   process: a key with an RPM limit sent three times its limit within one
   minute window (admitted vs limit); a key with a TPM limit, likewise, with
   the tokens the engine reported for the admitted requests against the limit.
2. **Priorities**: a sim engine with a batch limit (``--max-num-seqs``, 20 by
   default: ``--batch-limit``) in the catalog; the gateways' batch headroom as
   shipped (``LLMGW_GATEWAY_BATCH_HEADROOM``, 0.1, unless ``--headroom``); an
   ``interactive`` key at a steady load (2 streams in a closed loop); a
   ``batch`` key at 0, then at the batch share of the engine (18 streams at
   20 and 0.1), then at twice that; each stream's connections alternate
   between the two gateway processes. The interactive key's TTFT p90 in each
   phase against the unloaded one, and its failures; the engine's running and
   waiting (read every 0.1 s) and the requests that waited in the gateways'
   queue, which say where a slow interactive request waited.
3. **CPU per request**, limits on against off: the same non-streamed load
   through one gateway process with a key without limits and with a key with
   every limit set (far above the load), alternating, ``--runs`` times; the
   gateway's process CPU (from /proc) per request.

Prints its figures; the machine is shared (2 cores): compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _http_load import Connection, build_request, percentile, run_phase  # noqa: E402


def _bench_gateway():
    """bench/gateway.py's process helpers (loaded by path: 'gateway' is also the Django app's name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gateway", Path(__file__).resolve().parent / "gateway.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gateway"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_helpers = _bench_gateway()
Stack, free_port, session_cpu, wait_http = _helpers.Stack, _helpers.free_port, _helpers.session_cpu, _helpers.wait_http

DB_NAME = "llmgw_bench_tenancy"
HOST = "127.0.0.1"
FAST, SLOW = "sim-fast", "sim-batch"
_USAGE = re.compile(rb'"prompt_tokens":\s*(\d+).*?"completion_tokens":\s*(\d+)', re.DOTALL)

_SIM = """
import sys
from agent.engines import sim
sys.exit(sim.main(sys.argv[1:]))
"""

_SETUP = """
import json, sys, django
django.setup()
from django.utils import timezone
from nodes.models import Node
from replicas.models import CatalogEntry, Member, Replica
from gateway.services import key_create
spec = json.loads(sys.argv[1])
node = Node.objects.create(name="bench-node", status="ready", status_changed_at=timezone.now(), mgmt_addr="127.0.0.1")
for model in spec["models"]:
    entry = CatalogEntry.objects.create(name=model["name"], engine="sim", weights="/models/sim", args=model["args"])
    replica = Replica.objects.create(model=entry, status="ready", status_changed_at=timezone.now())
    Member.objects.create(replica=replica, node=node, rank=0, ports={"http": model["port"]}, serves_http=True,
                          state="running")
keys = {}
for key in spec["keys"]:
    keys[key["name"]] = key_create(**key).key
print(json.dumps(keys))
"""


def chat(model: str, max_tokens: int, stream: bool = False, words: int = 12) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": " ".join(["hello"] * words)}],
            "max_tokens": max_tokens}
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def aligned_to_minute(needed: float) -> None:
    """Fixed one-minute windows: start a phase where it ends within the same window."""
    left = 60 - time.time() % 60
    if left < needed:
        print(f"  (waiting {left:.0f}s for a fresh minute window)", flush=True)
        time.sleep(left + 0.3)


# --- 1: exactness --------------------------------------------------------------------------


async def burst(ports: list[int], key: str, body: bytes, count: int, concurrency: int) -> list[tuple[int, bytes]]:
    """``count`` requests at ``concurrency``, connections spread over the gateways: (status, body) of each."""
    remaining = count
    results: list[tuple[int, bytes]] = []

    async def worker(port: int) -> None:
        nonlocal remaining
        reader, writer = await asyncio.open_connection(HOST, port)
        raw = build_request(HOST, port, "/v1/chat/completions", body, {"Authorization": f"Bearer {key}"})
        try:
            while remaining > 0:
                remaining -= 1
                writer.write(raw)
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))
                results.append((int(head[9:12]), await reader.readexactly(length)))
        finally:
            writer.close()

    await asyncio.gather(*(worker(ports[i % len(ports)]) for i in range(concurrency)))
    return results


def exactness(ports: list[int], keys: dict[str, str], rpm: int, tpm: int) -> dict:
    aligned_to_minute(25)
    answers = asyncio.run(burst(ports, keys["rpm"], chat(FAST, 4), 3 * rpm, 32))
    admitted = sum(1 for status, _ in answers if status == 200)
    refused = sum(1 for status, _ in answers if status == 429)
    aligned_to_minute(25)
    answers = asyncio.run(burst(ports, keys["tpm"], chat(FAST, 8), 3 * tpm // 20, 32))
    tokens = 0
    for status, body in answers:
        if status == 200:
            prompt, completion = _USAGE.search(body).groups()
            tokens += int(prompt) + int(completion)
    return {"rpm": rpm, "rpm_admitted": admitted, "rpm_refused": refused, "rpm_other": len(answers) - admitted - refused,
            "tpm": tpm, "tpm_tokens": tokens, "tpm_admitted": sum(1 for s, _ in answers if s == 200)}


# --- 2: priorities ---------------------------------------------------------------------------


async def get(port: int, path: str) -> str:
    """A plain GET's body (the engine's and the gateway's /metrics, from loopback)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nConnection: close\r\n\r\n".encode())
        answer = await reader.read()
    finally:
        writer.close()
    return answer.split(b"\r\n\r\n", 1)[1].decode(errors="replace")


def gauge(page: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)", page, re.M)
    return float(found.group(1)) if found else 0.0


def queued(page: str) -> dict[str, float]:
    """The gateway's requests that waited in its queue, by priority class (every process's: multiprocess)."""
    counts: dict[str, float] = {}
    for labels, value in re.findall(r"^llmgw_gateway_queued_total\{([^}]*)\} (\S+)", page, re.M):
        if f'model="{SLOW}"' in labels and 'outcome="served"' in labels:
            priority = re.search(r'priority="([^"]*)"', labels).group(1)
            counts[priority] = counts.get(priority, 0) + float(value)
    return counts


async def priority_phase(ports: list[int], keys: dict[str, str], batch_streams: int, seconds: float,
                         engine_port: int) -> dict:
    stop = time.perf_counter() + seconds
    before = queued(await get(ports[0], "/metrics"))
    engine = {"reads": 0, "running": 0, "waiting": 0, "queued_reads": 0}

    async def watch() -> None:
        """The engine's running and waiting every 0.1 s: whether the gateways kept it within its batch limit."""
        while time.perf_counter() < stop:
            page = await get(engine_port, "/metrics")
            running, waiting = gauge(page, "vllm:num_requests_running"), gauge(page, "vllm:num_requests_waiting")
            engine["reads"] += 1
            engine["running"] = max(engine["running"], int(running))
            engine["waiting"] = max(engine["waiting"], int(waiting))
            engine["queued_reads"] += waiting > 0
            await asyncio.sleep(0.1)

    def raw(port: int, key: str, tokens: int) -> bytes:
        return build_request(HOST, port, "/v1/chat/completions", chat(SLOW, tokens, stream=True),
                             {"Authorization": f"Bearer {keys[key]}"})

    interactive, batch = [], []

    async def loop(port: int, key: str, tokens: int, out: list, pause: float) -> None:
        request = raw(port, key, tokens)
        connection = Connection(HOST, port)
        try:
            while time.perf_counter() < stop:
                out.append(await connection.request(request, True))
                if pause:
                    await asyncio.sleep(pause)
        finally:
            connection.close()

    # Every other stream through the other gateway process.
    tasks = [loop(ports[i % len(ports)], "batch", 200, batch, 0) for i in range(batch_streams)]
    tasks += [loop(ports[i % len(ports)], "interactive", 16, interactive, 0.1) for i in range(2)]
    await asyncio.gather(watch(), *tasks)
    after = queued(await get(ports[0], "/metrics"))
    ttfts = [s.ttft for s in interactive if s.ok and s.ttft is not None]
    return {"batch_streams": batch_streams, "interactive": len(interactive),
            "interactive_failed": sum(1 for s in interactive if not s.ok),
            "ttft_p50": percentile(ttfts, 50), "ttft_p90": percentile(ttfts, 90),
            "batch_ok": sum(1 for s in batch if s.ok), "batch_refused": sum(1 for s in batch if not s.ok),
            "queued": {k: int(v - before.get(k, 0)) for k, v in after.items() if v > before.get(k, 0)},
            "engine": engine}


def _setting(name: str, env: dict) -> str:
    """A setting as the gateway processes started with ``env`` will see it."""
    code = f"import django; django.setup(); from django.conf import settings; print(settings.{name})"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]


# --- 3: CPU ----------------------------------------------------------------------------------


async def cpu_phase(port: int, key: str, gateway_pid: int, requests: int) -> tuple[float, float, int]:
    raw = build_request(HOST, port, "/v1/chat/completions", chat(FAST, 4), {"Authorization": f"Bearer {key}"})
    await run_phase(HOST, port, raw, stream=False, concurrency=16, max_requests=200, max_seconds=10)  # warm
    before = session_cpu(gateway_pid)
    phase = await run_phase(HOST, port, raw, stream=False, concurrency=16, max_requests=requests, max_seconds=60)
    used = session_cpu(gateway_pid) - before
    good = len(phase.good)
    return used / max(1, good) * 1000, good / phase.elapsed, len(phase.errors)


# --- main ------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="each priority phase (default 20 s)")
    parser.add_argument("--runs", type=int, default=3, help="CPU comparisons, alternating (default 3)")
    parser.add_argument("--cpu-requests", type=int, default=3000)
    parser.add_argument("--rpm", type=int, default=600)
    parser.add_argument("--tpm", type=int, default=12000)
    parser.add_argument("--pg", default="postgres://postgres@127.0.0.1:5432", help="PostgreSQL server URL")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/5")
    parser.add_argument("--db-name", default=DB_NAME)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: exactness,priorities,cpu")
    parser.add_argument("--batch-limit", type=int, default=20, help="the slow engine's --max-num-seqs (default 20)")
    parser.add_argument("--headroom", type=float, default=None,
                        help="LLMGW_GATEWAY_BATCH_HEADROOM for the gateways (default: the setting's default)")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    from _cluster import recreate_database  # noqa: PLC0415 - bench/ sibling

    base = Path(tempfile.mkdtemp(prefix="llmgw-tenancy-"))
    atexit.register(shutil.rmtree, base, ignore_errors=True)  # its files go with it
    env = dict(os.environ, DATABASE_URL=f"{args.pg}/{args.db_name}", CELERY_BROKER_URL=args.redis,
               LLMGW_REDIS_URL=args.redis, LLMGW_DATA_DIR=str(base / "data"), LLMGW_GATEWAY_OPEN="0",
               LLMGW_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1", DJANGO_SETTINGS_MODULE="llmgw_site.settings")
    env.pop("LLMGW_GATEWAY_BATCH_HEADROOM", None)
    if args.headroom is not None:
        env["LLMGW_GATEWAY_BATCH_HEADROOM"] = str(args.headroom)
    headroom = float(_setting("LLMGW_GATEWAY_BATCH_HEADROOM", env))
    batch_share = int(args.batch_limit * (1 - headroom))
    recreate_database(args.pg, args.db_name)
    import redis

    redis.Redis.from_url(args.redis).flushdb()
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env, check=True)
    stack = Stack(base)
    try:
        fast_port, slow_port = free_port(), free_port()
        fast = stack.start("sim-fast", [sys.executable, "-c", _SIM, "--rank", "0", "--nnodes", "1", "--host", HOST,
                                        "--port", str(fast_port), "--model", FAST, "--token-delay", "0"])
        slow = stack.start("sim-slow", [sys.executable, "-c", _SIM, "--rank", "0", "--nnodes", "1", "--host", HOST,
                                        "--port", str(slow_port), "--model", SLOW, "--max-num-seqs",
                                        str(args.batch_limit)])
        wait_http(fast_port, "/health", 30, fast)
        wait_http(slow_port, "/health", 30, slow)
        big = 10 ** 9
        spec = {
            "models": [{"name": FAST, "port": fast_port, "args": []},
                       {"name": SLOW, "port": slow_port, "args": ["--max-num-seqs", str(args.batch_limit)]}],
            "keys": [{"name": "rpm", "rpm": args.rpm}, {"name": "tpm", "tpm": args.tpm},
                     {"name": "interactive", "priority": "interactive"}, {"name": "batch", "priority": "batch"},
                     {"name": "plain"},
                     {"name": "limited", "rpm": big, "tpm": big, "max_concurrent": 10_000, "daily_tokens": big,
                      "monthly_tokens": big}],
        }
        setup = subprocess.run([sys.executable, "-c", _SETUP, json.dumps(spec)], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=300)
        if setup.returncode != 0:
            raise RuntimeError(f"set-up failed:\n{setup.stdout}{setup.stderr}")
        keys = json.loads(setup.stdout.strip().splitlines()[-1])
        from cli.commands import web_argv

        ports = [free_port(), free_port()]
        webs = [stack.start(f"web{i}", web_argv(host=HOST, port=p), env=env) for i, p in enumerate(ports)]
        for port, web in zip(ports, webs):
            wait_http(port, "/v1/models", 60, web, {"Authorization": f"Bearer {keys['plain']}"})
        print("tenancy benchmark: two gateway processes, PostgreSQL, Redis, sim engines; a shared 2-core machine",
              flush=True)

        if "exactness" not in skip:
            result = exactness(ports, keys, args.rpm, args.tpm)
            print(f"\n1. limits at concurrency 32 through two gateway processes")
            print(f"   RPM {result['rpm']}: admitted {result['rpm_admitted']} of {3 * result['rpm']} "
                  f"({(result['rpm_admitted'] - result['rpm']) / result['rpm'] * 100:+.2f} % of the limit), "
                  f"429: {result['rpm_refused']}, other: {result['rpm_other']}")
            print(f"   TPM {result['tpm']}: {result['tpm_admitted']} requests admitted, "
                  f"{result['tpm_tokens']} tokens as the engine reported "
                  f"({(result['tpm_tokens'] - result['tpm']) / result['tpm'] * 100:+.2f} % of the limit)")
            print(f"   goal: within 1 %, never above: RPM "
                  f"{'MET' if result['rpm'] * 0.99 <= result['rpm_admitted'] <= result['rpm'] else 'MISSED'}, TPM "
                  f"{'MET' if result['tpm'] * 0.99 <= result['tpm_tokens'] <= result['tpm'] else 'MISSED'}", flush=True)

        if "priorities" not in skip:
            print(f"\n2. interactive (2 streams, 16 tokens) while batch streams (200 tokens) load {SLOW} "
                  f"(batch limit {args.batch_limit}; batch share {batch_share} with headroom {headroom:g}), "
                  "each stream through one of the two gateway processes in turn")
            phases = [asyncio.run(priority_phase(ports, keys, n, args.seconds, slow_port))
                      for n in (0, batch_share, 2 * batch_share)]
            unloaded = phases[0]["ttft_p90"]
            for phase in phases:
                ratio = phase["ttft_p90"] / unloaded if unloaded and phase["ttft_p90"] else float("nan")
                print(f"   batch streams {phase['batch_streams']:2d}: interactive TTFT p50 "
                      f"{phase['ttft_p50'] * 1000:.1f} ms p90 {phase['ttft_p90'] * 1000:.1f} ms "
                      f"({ratio:.2f}x unloaded), {phase['interactive']} requests, {phase['interactive_failed']} failed;"
                      f" batch answered {phase['batch_ok']}, refused {phase['batch_refused']}", flush=True)
                engine = phase["engine"]
                print(f"      engine (read every 0.1 s, {engine['reads']} reads): running at most {engine['running']}, "
                      f"waiting at most {engine['waiting']} (waiting in {engine['queued_reads']} reads); "
                      f"waited in the gateways' queue: {phase['queued'] or 'none'}", flush=True)
            worst = max(p["ttft_p90"] for p in phases[1:]) / unloaded
            failed = sum(p["interactive_failed"] for p in phases)
            print(f"   goal: p90 within 10 % of unloaded, no interactive failure: "
                  f"{'MET' if worst <= 1.1 and not failed else 'MISSED'} ({worst:.2f}x, {failed} failed)", flush=True)

        if "cpu" not in skip:
            print(f"\n3. gateway CPU per request (one process, c=16, non-streamed, {args.cpu_requests} requests a run)")
            off, on = [], []
            for run in range(args.runs):
                for name, out in (("plain", off), ("limited", on)):
                    ms, rps, errors = asyncio.run(cpu_phase(ports[0], keys[name], webs[0].pid, args.cpu_requests))
                    out.append(ms)
                    print(f"   run {run + 1} limits {'on ' if name == 'limited' else 'off'}: {ms:.3f} ms CPU/request, "
                          f"{rps:.0f} req/s, {errors} errors", flush=True)
            delta = statistics.median(on) - statistics.median(off)
            print(f"   median: off {statistics.median(off):.3f} ms, on {statistics.median(on):.3f} ms: "
                  f"{delta:+.3f} ms per request (goal at most +0.1 ms: {'MET' if delta <= 0.1 else 'MISSED'})",
                  flush=True)
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
