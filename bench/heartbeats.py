#!/usr/bin/env python
"""Heartbeat benchmark: N simulated nodes over mTLS against the real agent API.

    make bench-heartbeats                      # 2,000 nodes, PostgreSQL + Redis
    .venv/bin/python bench/heartbeats.py --nodes 5000 --rounds 3

Each node has its own client certificate from a throwaway authority and its
own kept-alive TLS connection. The agent API runs as it does in production
(``gunicorn_argv``: 2 workers, on 127.0.0.1) against a benchmark database
(``llmgw_bench``, dropped and migrated here, next to the one ``DATABASE_URL``
names) and its own Redis database (4 unless ``--redis-db``), so a test suite
running at the same time is not disturbed.

Phases: open every connection (a reconnect storm), register every node (its
first heartbeat writes its inventory), then the steady state: heartbeats and
the no-op ``/agent/v1/ping`` (the floor of any request on this listener),
each paced at ``--rate`` across all nodes (2,000 nodes at 1,000/s is a 2 s
interval, the load of 5,000 nodes at 5 s) and then closed-loop at
``--concurrency`` to find the ceiling; last, paced heartbeats again while
64 TCP connections that never start TLS are held open against the listener,
and while 64 mTLS connections with one node's certificate send a request a
byte a second (``--slow``; that node sits the phase out).

With ``--cold-start``, only every agent at once (``bench/_cold_start.py``):
all nodes register together, the agent API restarts and all reconnect, and a
lost-node sweep must declare none lost; the goal is every node registered in
under 30 s (``--nodes 5000 --cold-start``).

CPU per request is read from /proc (utime + stime) for the server's workers,
this process (the load generator), Redis and the benchmark database's
PostgreSQL backends. The machine is shared: "others" is the CPU the rest of
the machine used meanwhile, and the summary keeps the best of ``--rounds``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cold_start import cold_start, sweep_and_count  # noqa: E402
from _proc_cpu import CpuMeter, CpuUse  # noqa: E402
from _tls_load import (  # noqa: E402
    LoadGenerator,
    PhaseResult,
    SimNode,
    client_context,
    get,
    hold_idle_connections,
    hold_slow_connections,
    post,
)


# --- set-up -------------------------------------------------------------------


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2000, help="simulated nodes, one certificate each (default 2000)")
    p.add_argument("--rate", type=float, default=1000.0, help="paced heartbeats per second across all nodes (1000)")
    p.add_argument("--seconds", type=float, default=15.0, help="length of each paced phase (15)")
    p.add_argument("--closed-seconds", type=float, default=8.0, help="length of each closed-loop phase (8)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight in closed-loop phases (64)")
    p.add_argument("--rounds", type=int, default=2, help="steady-state rounds; the summary keeps the best (2)")
    p.add_argument("--idle", type=int, default=64, help="idle TCP connections in the last phase; 0 skips it (64)")
    p.add_argument("--slow", type=int, default=64,
                   help="slow-loris mTLS connections with one node's certificate in a last phase; 0 skips it (64)")
    p.add_argument("--server", choices=["gunicorn", "uvicorn-wsgi", "uvicorn-asgi"], default="gunicorn",
                   help="the agent API as llmgw runs it (gunicorn), or a candidate measured against it "
                   "(bench/_uvicorn_candidate.py: no hostile-client guards, no long-poll parking)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="threads per worker (gunicorn_argv's default)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs in each node's inventory (8)")
    p.add_argument("--host", default="127.0.0.1", help="loopback address to serve and load on")
    p.add_argument("--db-name", default="llmgw_bench", help="benchmark database, dropped and created (llmgw_bench)")
    p.add_argument("--redis-db", type=int, default=4, help="Redis database for liveness (4)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory and the database")
    p.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    p.add_argument("--timeline", action="store_true",
                   help="print p99/max per second of each paced phase, and the server's kernel time")
    p.add_argument("--check", action="store_true", help="exit 1 when the goal is not met (it always does on errors)")
    p.add_argument("--cold-start", action="store_true",
                   help="only every agent at once: a cold start (all nodes register), a restart of the agent API "
                   "(all reconnect), a lost-node sweep that must blame none; goal: registered in under 30 s")
    p.add_argument("--cold-concurrency", type=int, default=64, help="requests in flight in --cold-start (64)")
    args = p.parse_args(argv)
    if not ipaddress.ip_address(args.host).is_loopback:
        p.error("--host must be a loopback address: this benchmark never sends traffic off the machine")
    return args


def _database_urls(db_name: str) -> tuple[str, str]:
    """(maintenance URL, benchmark URL) from DATABASE_URL."""
    base = os.environ.get("DATABASE_URL", "")
    parts = urlsplit(base)
    if parts.scheme not in ("postgres", "postgresql", "pgsql"):
        sys.exit(
            "DATABASE_URL must name a PostgreSQL server (run 'make bench-heartbeats', which sets it): "
            "the heartbeat goal is for PostgreSQL + Redis"
        )
    if parts.hostname and not ipaddress.ip_address(socket.gethostbyname(parts.hostname)).is_loopback:
        sys.exit(f"DATABASE_URL points at {parts.hostname}: the benchmark only runs against loopback services")
    # The server's own maintenance database: the one DATABASE_URL names may not exist yet.
    return urlunsplit(parts._replace(path="/postgres")), urlunsplit(parts._replace(path=f"/{db_name}"))


def _redis_url(db: int) -> str:
    base = os.environ.get("LLMGW_REDIS_URL") or "redis://127.0.0.1:6379/0"
    parts = urlsplit(base)
    if parts.scheme not in ("redis", "rediss"):
        sys.exit(f"LLMGW_REDIS_URL must be a redis:// URL, not {base!r}")
    return urlunsplit(parts._replace(path=f"/{db}"))


def _recreate_database(maintenance_url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(maintenance_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def _drop_database(maintenance_url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(maintenance_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _node_name(i: int) -> str:
    return f"bench-{i:05d}"


def _heartbeat_body(i: int, gpus: int) -> bytes:
    from agent.protocol import example_heartbeat

    fabric = ("ib-a", "ib-b", None)[i % 3]
    hb = example_heartbeat(gpus=gpus, fabric=fabric)
    hb.mgmt_addr = f"127.1.{i // 250}.{i % 250 + 1}"
    for gpu in hb.gpus:  # a GPU belongs to one node: uuids must differ across nodes
        gpu.uuid = f"GPU-{i:08x}-2a1e-5c4b-9e7d-0f1a2b3c4d{gpu.index:02x}"
    for k, hca in enumerate(hb.hcas):
        hca.guid = f"0c42:a103:{i >> 8 & 0xffff:04x}:{(i & 0xff) << 8 | k:04x}"
    return json.dumps(hb.to_dict(), separators=(",", ":")).encode()


def _issue_certificates(count: int, out_dir: Path) -> tuple[str, list[tuple[str, str]]]:
    """A throwaway authority, the listener's certificate, one client certificate per node."""
    from django.db import transaction

    from pki import services

    services.ca_init(common_name="llmgw bench CA")
    services.cert_issue_server(hosts=["localhost"], ips=["127.0.0.1"], install=True)
    out_dir.mkdir(parents=True)
    paths = []
    with transaction.atomic():
        for i in range(count):
            issued = services.cert_issue_client(node_id=_node_name(i))
            cert, key = out_dir / f"{_node_name(i)}.pem", out_dir / f"{_node_name(i)}-key.pem"
            cert.write_bytes(issued.cert_pem)
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(issued.key_pem)
            paths.append((str(cert), str(key)))
    return (services.pki_dir() / services.CA_CERT).read_text(), paths


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _wait_for_port(host: str, port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the agent API exited with {proc.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


# --- the run ------------------------------------------------------------------


@dataclass
class Row:
    phase: str
    result: PhaseResult
    cpu: CpuUse
    kind: str = ""  # "heartbeat paced", "ping closed", ...
    extra: dict = field(default_factory=dict)

    def figures(self) -> dict:
        r, c, n = self.result, self.cpu, max(1, self.result.ok)
        return {
            "phase": self.phase,
            "requests": r.ok,
            "per_second": round(r.rate, 1),
            "p50_ms": round(r.percentile(50) * 1000, 2),
            "p99_ms": round(r.percentile(99) * 1000, 2),
            "max_ms": round(max(r.latencies, default=float("nan")) * 1000, 2),
            "errors": dict(r.errors),
            "late_sends": r.late,
            "server_cpu_ms_per_req": round(c.server / n * 1000, 3),
            "server_kernel_ms_per_req": round(c.server_kernel / n * 1000, 3),
            "loadgen_cpu_ms_per_req": round(c.loadgen / n * 1000, 3),
            "redis_pg_cpu_ms_per_req": round((c.redis + c.postgres) / n * 1000, 3),
            "server_cores": round(c.server / c.seconds, 2),
            "others_cores": round(c.others / c.seconds, 2),
            **self.extra,
        }


HEADER = (
    f"{'phase':<34} {'reqs':>7} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'errors':>6} "
    f"{'server':>7} {'loadgen':>7} {'rd+pg':>6} {'srv':>5} {'other':>5}"
)
UNITS = (
    f"{'':<34} {'':>7} {'':>7} {'':>7} {'':>7} {'':>7} {'':>6} "
    f"{'ms CPU per request':>22} {'cores':>11}"
)


def _line(row: Row) -> str:
    f = row.figures()
    errors = row.result.failures
    return (
        f"{row.phase:<34} {f['requests']:>7} {f['per_second']:>7.0f} {f['p50_ms']:>7.1f} {f['p99_ms']:>7.1f} "
        f"{f['max_ms']:>7.1f} {errors:>6} {f['server_cpu_ms_per_req']:>7.2f} {f['loadgen_cpu_ms_per_req']:>7.2f} "
        f"{f['redis_pg_cpu_ms_per_req']:>6.2f} {f['server_cores']:>5.2f} {f['others_cores']:>5.2f}"
    )


def _check_registered(node: SimNode, body: bytes, result: PhaseResult) -> None:
    if json.loads(body).get("status") != "ready":
        result.error("not ready")


async def _run_phases(args, gen: LoadGenerator, nodes: list[SimNode], meter: CpuMeter, report) -> dict:
    rows: dict[str, list[Row]] = {}

    async def measure(phase: str, kind: str, coro, **extra) -> Row:
        before = meter.snapshot()
        result = await coro
        row = Row(phase, result, meter.since(before), kind, extra)
        rows.setdefault(kind, []).append(row)
        report(row)
        return row

    await measure("connect (TLS handshakes, c=64)", "connect", gen.connect_all(nodes, concurrency=64))
    await measure(
        "register (1st heartbeat, c=8)",
        "register",
        gen.closed_loop(nodes, kind="heartbeat", concurrency=8, once=True, check=_check_registered, name="register"),
    )
    # The second heartbeat reads the generation the registration bumped; from
    # the third on, a heartbeat that brings no news is the steady state.
    await measure("warm (2nd heartbeat)", "warm", gen.closed_loop(nodes, kind="heartbeat", concurrency=64, once=True))
    steady_from = time.time()

    for r in range(1, args.rounds + 1):
        for kind in ("heartbeat", "ping"):
            await measure(
                f"r{r} {kind} @ {args.rate:g}/s (paced)",
                f"{kind} paced",
                gen.paced(nodes, kind=kind, rate=args.rate, seconds=args.seconds),
            )
        for kind in ("heartbeat", "ping"):
            await measure(
                f"r{r} {kind} max (c={args.concurrency})",
                f"{kind} closed",
                gen.closed_loop(nodes, kind=kind, concurrency=args.concurrency, seconds=args.closed_seconds),
            )

    if args.idle:
        stop = asyncio.Event()
        holder = asyncio.ensure_future(hold_idle_connections(args.host, gen.port, args.idle, stop))
        await asyncio.sleep(1.0)
        row = await measure(
            f"heartbeat @ {args.rate:g}/s + {args.idle} idle",
            "heartbeat idle",
            gen.paced(nodes, kind="heartbeat", rate=args.rate, seconds=args.seconds),
        )
        stop.set()
        row.extra.update(await holder)
    if args.slow and len(nodes) > 1:
        stop = asyncio.Event()
        attacker, others = nodes[-1], nodes[:-1]
        holder = asyncio.ensure_future(hold_slow_connections(
            args.host, gen.port, attacker.context, attacker.heartbeat, args.slow, 1.0, stop
        ))
        await asyncio.sleep(1.0)
        row = await measure(
            f"heartbeat @ {args.rate:g}/s + {args.slow} slow",
            "heartbeat slow",
            gen.paced(others, kind="heartbeat", rate=args.rate, seconds=args.seconds),
        )
        stop.set()
        row.extra.update(await holder)
    return {"rows": rows, "steady_from": steady_from}


async def _run_cold(args, gen: LoadGenerator, nodes: list[SimNode], meter: CpuMeter, report, restart) -> dict:
    rows: dict[str, Row] = {}

    async def measure(phase: str, kind: str, coro) -> Row:
        before = meter.snapshot()
        result = await coro
        rows[kind] = row = Row(phase, result, meter.since(before), kind)
        report(row)
        return row

    timings = await cold_start(gen, nodes, concurrency=args.cold_concurrency, restart=restart, measure=measure)
    return {"rows": rows, **timings}


def _cold_summary(args, outcome: dict, nodes: list[SimNode]) -> int:
    rows = outcome["rows"]
    counted = sweep_and_count(nodes)
    register = rows["cold register"]
    failed = sum(r.result.failures for r in rows.values())
    ready = counted["by_status"].get("ready", 0)
    met = outcome["registered_in"] < 30 and ready == args.nodes and failed == 0 and not counted["declared_lost_by_sweep"]
    print()
    print(f"  cold start: {register.result.ok} of {args.nodes} nodes registered in {outcome['registered_in']:.1f} s "
          f"(connect + first heartbeat), {register.figures()['server_cpu_ms_per_req']:.2f} ms server CPU and "
          f"{register.figures()['redis_pg_cpu_ms_per_req']:.2f} ms Redis + PostgreSQL CPU per registration")
    print(f"  restart: agent API back in {outcome['restarted_in']:.1f} s; every agent reconnected and heard again in "
          f"{outcome['heard_again_in']:.1f} s ({rows['restart heartbeat'].result.ok} heartbeats answered)")
    print(f"  then a lost-node sweep: {counted['declared_lost_by_sweep']} declared lost; nodes by status "
          f"{counted['by_status']}")
    print(f"  goal (all {args.nodes} registered in under 30 s, all heard after the restart, none lost): "
          f"{'MET' if met else 'NOT MET'}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "nodes": args.nodes, "goal_met": met, **{k: v for k, v in outcome.items() if k != "rows"},
            "rows": {kind: r.figures() for kind, r in rows.items()}, **counted,
        }, indent=2))
    return 1 if failed or (args.check and not met) else 0


def _best(rows: list[Row], *, paced: bool) -> Row:
    if paced:  # a paced round is as good as its tail
        return min(rows, key=lambda r: (r.result.failures, r.result.percentile(99)))
    return max(rows, key=lambda r: r.result.rate)


def _server_start(argv: list[str], args, port: int, log_path: Path) -> tuple[subprocess.Popen, list[int]]:
    with open(log_path, "ab") as log:
        server = subprocess.Popen(argv, env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=REPO,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _wait_for_port(args.host, port, server)
    deadline = time.monotonic() + 30
    while len(workers := _children(server.pid)) < args.workers and time.monotonic() < deadline:
        time.sleep(0.1)
    return server, workers


def _server_stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait()


def _lock(db_name: str):
    """One run per benchmark database at a time: a second run would drop the first one's database."""
    import fcntl

    handle = open(Path(tempfile.gettempdir()) / f"llmgw-bench-{db_name}.lock", "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"another benchmark is running against database {db_name}; wait for it or pass --db-name")
    return handle


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    lock = _lock(args.db_name)  # noqa: F841 - held until exit
    maintenance_url, bench_url = _database_urls(args.db_name)
    redis_url = _redis_url(args.redis_db)
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    env = {
        "DATABASE_URL": bench_url,
        "LLMGW_REDIS_URL": redis_url,
        "CELERY_BROKER_URL": redis_url,
        "LLMGW_DATA_DIR": str(tmp / "data"),
        "LLMGW_PKI_DIR": str(tmp / "pki"),
        "DJANGO_SETTINGS_MODULE": "llmgw_site.settings",
        "LLMGW_AGENT_LOG_LEVEL": os.environ.get("LLMGW_AGENT_LOG_LEVEL", "warning"),
        # 2,000 "certificate issued" and "node registered" lines say nothing here.
        "LLMGW_LOG_LEVEL": os.environ.get("LLMGW_LOG_LEVEL", "WARNING"),
    }
    os.environ.update(env)
    server = None
    log_path = tmp / "agent-api.log"
    print(f"llmgw heartbeat benchmark: {args.nodes} nodes, {os.cpu_count()} CPUs, database {args.db_name}, "
          f"redis db {args.redis_db}, scratch {tmp}")
    try:
        t0 = time.perf_counter()
        _recreate_database(maintenance_url, args.db_name)
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        import redis

        rds = redis.Redis.from_url(redis_url)
        stale = list(rds.scan_iter("llmgw:*"))
        if stale:
            rds.delete(*stale)
        redis_pid = int(rds.info("server")["process_id"])
        print(f"  database created and migrated in {time.perf_counter() - t0:.1f}s")

        t0 = time.perf_counter()
        ca_pem, paths = _issue_certificates(args.nodes, tmp / "certs")
        print(f"  {args.nodes} client certificates issued in {time.perf_counter() - t0:.1f}s")

        t0 = time.perf_counter()
        nodes = []
        for i, (cert, key) in enumerate(paths):
            name = _node_name(i)
            nodes.append(
                SimNode(
                    name=name,
                    context=client_context(cert=cert, key=key, ca_pem=ca_pem),
                    heartbeat=post(f"/agent/v1/nodes/{name}/heartbeat", _heartbeat_body(i, args.gpus)),
                    ping=get("/agent/v1/ping"),
                )
            )
        print(f"  {args.nodes} client SSL contexts built in {time.perf_counter() - t0:.1f}s; "
              f"heartbeat body {len(nodes[0].heartbeat)} bytes with headers")

        from django.db import connections

        connections.close_all()  # the server gets the database to itself
        from agentapi.command import gunicorn_argv
        from pki.services import CA_CERT, SERVER_CERT, SERVER_KEY

        pki = tmp / "pki"
        port = _free_port(args.host)
        extra = {"threads": args.threads} if args.threads else {}
        argv = gunicorn_argv(host=args.host, port=port, certfile=str(pki / SERVER_CERT),
                             keyfile=str(pki / SERVER_KEY), cafile=str(pki / CA_CERT), workers=args.workers, **extra)
        if args.server != "gunicorn":
            argv = [sys.executable, "-m", "uvicorn", f"_uvicorn_candidate:app_{args.server.split('-')[1]}",
                    "--app-dir", str(Path(__file__).resolve().parent), "--host", args.host, "--port", str(port),
                    "--workers", str(args.workers), "--ssl-certfile", str(pki / SERVER_CERT),
                    "--ssl-keyfile", str(pki / SERVER_KEY), "--ssl-ca-certs", str(pki / CA_CERT),
                    "--ssl-cert-reqs", str(int(ssl.CERT_REQUIRED)), "--http", "_uvicorn_candidate:PeerProtocol",
                    "--loop", "uvloop", "--timeout-keep-alive", "75", "--no-access-log", "--log-level", "warning",
                    "--lifespan", "off"]
        server, workers = _server_start(argv, args, port, log_path)
        print(f"  agent API on {args.host}:{port} ({args.server}): master {server.pid}, workers {workers}; "
              f"log {log_path}")

        import psycopg

        pg = psycopg.connect(maintenance_url, autocommit=True)
        meter = CpuMeter(server_pids=workers, redis_pid=redis_pid, pg_conn=pg, db_name=args.db_name)

        print()
        print(HEADER)
        print(UNITS)

        def report(row: Row) -> None:
            print(_line(row), flush=True)
            if row.result.errors:
                print(f"{'':<34} errors: {row.result.errors}", flush=True)
            if args.timeline:
                print(f"    of which server kernel time {row.figures()['server_kernel_ms_per_req']:.2f} ms per request")
            if args.timeline and "paced" in row.phase:
                print("    " + "  ".join(f"{int(t)}s:{p99 * 1000:.0f}/{mx * 1000:.0f}" for t, _, p99, mx in
                                         row.result.timeline()), flush=True)

        try:
            import uvloop

            loop = uvloop.new_event_loop()
            loop_name = "uvloop"
        except ImportError:
            loop = asyncio.new_event_loop()
            loop_name = "asyncio"
        asyncio.set_event_loop(loop)
        gc.collect()
        gc.freeze()  # the certificates and contexts live for the whole run
        gen = LoadGenerator(host=args.host, port=port)
        if args.cold_start:
            def restart() -> None:
                nonlocal server, workers
                _server_stop(server)
                server, workers = _server_start(argv, args, port, log_path)
                meter.server_pids = workers

            return _cold_summary(args, loop.run_until_complete(_run_cold(args, gen, nodes, meter, report, restart)),
                                 nodes)
        outcome = loop.run_until_complete(_run_phases(args, gen, nodes, meter, report))
        rows = outcome["rows"]
        if server.poll() is not None or sorted(_children(server.pid)) != sorted(workers):
            print("\n  WARNING: a server worker exited during the run; CPU figures are incomplete")

        from core.models import Event
        from nodes.models import Node

        steady = _aware(outcome["steady_from"])
        written = Node.objects.filter(last_heartbeat_at__gte=steady).count()
        events = Event.objects.filter(created_at__gte=steady).count()
        registered = Node.objects.filter(status="ready").count()

        best = {kind: _best(rs, paced=kind.endswith(("paced", "idle", "slow"))) for kind, rs in rows.items()}
        print()
        print(f"Summary (best of {args.rounds} round{'s' if args.rounds > 1 else ''}; load generator: one process, "
              f"{loop_name}; server: {args.workers} {args.server} workers)")
        print(HEADER)
        print(UNITS)
        for kind in ("connect", "register", "heartbeat paced", "ping paced", "heartbeat closed", "ping closed",
                     "heartbeat idle", "heartbeat slow"):
            if kind in best:
                print(_line(best[kind]))
        print()
        print(f"  nodes ready in the database: {registered} of {args.nodes}; node rows written during the "
              f"steady state: {written}; events written: {events}")
        hb, ping = best["heartbeat paced"], best["ping paced"]
        hb_p99 = hb.result.percentile(99) * 1000
        hb_errors = hb.result.failures
        met = hb.result.rate >= 0.98 * args.rate and hb_p99 < 250 and hb_errors == 0 and args.rate >= 1000
        print(
            f"  goal (>= 1000 heartbeats/s, p99 < 250 ms): {'MET' if met else 'NOT MET'} — paced "
            f"{hb.result.rate:.0f}/s with p99 {hb_p99:.1f} ms; ceiling {best['heartbeat closed'].result.rate:.0f}/s "
            f"closed-loop; floor (ping) {best['ping closed'].result.rate:.0f}/s, "
            f"{ping.figures()['server_cpu_ms_per_req']:.2f} ms server CPU per request against "
            f"{hb.figures()['server_cpu_ms_per_req']:.2f} for a heartbeat"
        )
        if "heartbeat idle" in best:
            idle = best["heartbeat idle"]
            print(f"  with {args.idle} idle TCP connections held open: p99 {idle.result.percentile(99) * 1000:.1f} ms "
                  f"(idle connections opened {idle.extra.get('opened')}, dropped by the server "
                  f"{idle.extra.get('dropped_by_server')})")
        if "heartbeat slow" in best:
            slow = best["heartbeat slow"]
            print(f"  with {args.slow} slow-loris mTLS connections (one certificate, a byte a second): p99 "
                  f"{slow.result.percentile(99) * 1000:.1f} ms, errors {slow.result.failures} (slow connections "
                  f"opened {slow.extra.get('opened')}, closed by the server {slow.extra.get('closed_by_server')}, "
                  f"of which answered 408 {slow.extra.get('answered_408')})")
        if args.json:
            Path(args.json).write_text(json.dumps({
                "nodes": args.nodes, "rate": args.rate, "rounds": args.rounds, "goal_met": met,
                "rows": {kind: [r.figures() for r in rs] for kind, rs in rows.items()},
                "best": {kind: r.figures() for kind, r in best.items()},
                "steady_state_node_writes": written, "steady_state_events": events,
            }, indent=2))
        failed = sum(r.result.failures for rs in rows.values() for r in rs)
        if failed:
            print(f"  {failed} requests failed: see the rows above and {log_path}")
        return 1 if failed or (args.check and not met) else 0
    except BaseException:
        if server is not None and log_path.exists():
            print(f"--- last lines of the agent API's log ({log_path}) ---", file=sys.stderr)
            print("\n".join(log_path.read_text(errors="replace").splitlines()[-30:]), file=sys.stderr)
        raise
    finally:
        if server is not None:
            _server_stop(server)
        if not args.keep:
            try:
                import redis

                rds = redis.Redis.from_url(redis_url)
                stale = list(rds.scan_iter("llmgw:*"))
                if stale:
                    rds.delete(*stale)
            except Exception:  # noqa: BLE001 - leaving a few keys behind is harmless
                pass
            try:
                from django.db import connections

                connections.close_all()
            except Exception:  # noqa: BLE001 - Django may not be set up if we failed early
                pass
            _drop_database(maintenance_url, args.db_name)
            shutil.rmtree(tmp, ignore_errors=True)


def _aware(ts: float):
    import datetime as dt

    return dt.datetime.fromtimestamp(ts, tz=dt.timezone.utc)


if __name__ == "__main__":
    sys.exit(main())
