"""Where a plain gateway request's CPU goes: cProfile inside the web process.

    python bench/gateway_profile.py [--requests 3000] [--concurrency 16] [--top 35] [--stream]

Starts a sim engine and the gateway's web process as ``make bench-gateway``
does (uvicorn with llmgw's HTTP protocol, lifespan on, the embedded SQLite
default), but with the web process running under cProfile, switched on only
for the measured requests (SIGUSR1 on, SIGUSR2 off and dump). Prints the
process CPU per request (from /proc, with the profiler's overhead, and
without it in a second run) and the functions that cost most, by their own
time and cumulatively. Loopback only; every process it starts, it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import pstats
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import importlib.util  # noqa: E402

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(1, str(BENCH.parent))

from _http_load import build_request, run_phase  # noqa: E402

# bench/gateway.py, under a name that is not the gateway app's.
_spec = importlib.util.spec_from_file_location("bench_gateway", BENCH / "gateway.py")
bench_gateway = importlib.util.module_from_spec(_spec)
sys.modules["bench_gateway"] = bench_gateway
_spec.loader.exec_module(bench_gateway)
HOST, Stack, Target, body = bench_gateway.HOST, bench_gateway.Stack, bench_gateway.Target, bench_gateway.body
free_port, start_gateway, start_sim, wait_http = (bench_gateway.free_port, bench_gateway.start_gateway,
                                                  bench_gateway.start_sim, bench_gateway.wait_http)

_PROFILED = """
import cProfile, os, signal, sys
import uvicorn
port, out = int(sys.argv[1]), sys.argv[2]
profile = cProfile.Profile()
signal.signal(signal.SIGUSR1, lambda *_: profile.enable())
def dump(*_):
    profile.disable()
    profile.dump_stats(out)
signal.signal(signal.SIGUSR2, dump)
config = uvicorn.Config("llmgw_site.asgi:application", host="127.0.0.1", port=port, access_log=False,
                        lifespan="on", http="web.protocol:HttpProtocol")
uvicorn.Server(config).run()
"""


async def load(target: Target, stream: bool, concurrency: int, requests: int):
    raw = build_request(HOST, target.port, "/v1/chat/completions", body(stream), target.headers)
    return await run_phase(HOST, target.port, raw, stream=stream, concurrency=concurrency,
                           max_requests=requests, max_seconds=120)


def cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as handle:
        fields = handle.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="llmgw-gwprofile-"))
    atexit.register(shutil.rmtree, workdir, ignore_errors=True)  # its files go with it
    stack = Stack(workdir)
    try:
        sim = start_sim(stack)
        gateway = start_gateway(stack, sim.port)  # the plain web process: CPU without the profiler
        asyncio.run(load(gateway, args.stream, args.concurrency, 300))
        before = cpu_of(gateway.procs[0].pid)
        phase = asyncio.run(load(gateway, args.stream, args.concurrency, args.requests))
        plain_cpu = (cpu_of(gateway.procs[0].pid) - before) / len(phase.samples)
        print(f"without the profiler: {plain_cpu * 1e3:.3f} ms CPU per request "
              f"({len(phase.samples)} requests, concurrency {args.concurrency}, {len(phase.errors)} errors)")
        # The same web process, profiled (its database and key are the first one's).
        port = free_port()
        stats = workdir / "gateway.prof"
        env = dict(os.environ, **{k: v for k, v in _env_of(gateway.procs[0].pid).items()
                                  if k.startswith(("LLMGW_", "DATABASE_URL", "CELERY_", "DJANGO_"))})
        proc = stack.start("gateway-profiled", [sys.executable, "-c", _PROFILED, str(port), str(stats)], env=env)
        profiled = Target("profiled", port, headers=gateway.headers, procs=[proc])
        wait_http(port, "/v1/models", 60, proc, gateway.headers)
        asyncio.run(load(profiled, args.stream, args.concurrency, 300))
        os.kill(proc.pid, signal.SIGUSR1)
        before = cpu_of(proc.pid)
        phase = asyncio.run(load(profiled, args.stream, args.concurrency, args.requests))
        used = cpu_of(proc.pid) - before
        os.kill(proc.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while not stats.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        print(f"with the profiler: {used / len(phase.samples) * 1e3:.3f} ms CPU per request")
        for order in ("tottime", "cumulative"):
            print(f"\n--- by {order} (per {len(phase.samples)} requests) ---")
            pstats.Stats(str(stats)).strip_dirs().sort_stats(order).print_stats(args.top)
    finally:
        stack.stop()
    return 0


def _env_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


if __name__ == "__main__":
    sys.exit(main())
