"""Memory and event-loop stalls of the web process under hostile bodies.

    python bench/gateway_memory.py [--clients 20] [--declared-mib 32] [--send-mib 30]

The gateway's web process (uvicorn, as 'llmgw up' starts it, on the embedded
default) in front of a sim engine, then:

1. unauthenticated: N connections each declare a body of 32 MiB, try to send
   30 MiB of it and wait; RSS of the web process before, while they hold
   their connections, and after they close;
2. authenticated: one body of ~30 MiB of small JSON objects (the parser's
   worst case), then three at once, while /metrics is scraped every 50 ms:
   peak RSS of the web process and of its parsing processes, and the longest
   wait for a /metrics answer;
3. the same with LLMGW_GATEWAY_INLINE_PARSE_BYTES above the body size (parsing
   on the event loop, as before the parsing processes), for comparison.

Loopback only; every process it starts, it stops.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("bench_gateway", HERE / "gateway.py")
bench_gateway = importlib.util.module_from_spec(_spec)
sys.modules["bench_gateway"] = bench_gateway  # its dataclasses look their module up
_spec.loader.exec_module(bench_gateway)

MIB = 1024 * 1024


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            if ppid == pid:
                found.append(int(entry.name))
    return found


class Sampler:
    """Peak RSS of a process and, separately, of its children, every 50 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = self.children_peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mib(self.pid))
            self.children_peak = max(self.children_peak, sum(rss_mib(c) for c in children(self.pid)))
            time.sleep(0.05)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def unauthenticated(port: int, pid: int, *, clients: int, declared: int, send: int) -> None:
    before = rss_mib(pid)
    sent = [0] * clients
    answered = [b""] * clients
    socks: list[socket.socket] = []

    def one(i: int) -> None:
        sock = socket.create_connection((bench_gateway.HOST, port), timeout=10)
        socks.append(sock)
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {declared}\r\n\r\n".encode())
        chunk = b"x" * MIB
        sock.settimeout(2)
        try:
            while sent[i] < send:
                sent[i] += sock.send(chunk[: min(MIB, send - sent[i])])
        except OSError:
            pass  # the server closed (or stopped reading): what it holds is the point
        try:
            answered[i] = sock.recv(200)
        except OSError:
            pass

    with Sampler(pid) as sampler:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(2)  # the connections stay open (those the server did not close)
        during = rss_mib(pid)
        for sock in socks:
            sock.close()
    time.sleep(1)
    after = rss_mib(pid)
    statuses = sorted({a.split(b"\r\n", 1)[0].decode(errors="replace") for a in answered})
    print(f"  {clients} unauthenticated connections, {declared // MIB} MiB declared, up to {send // MIB} MiB sent each")
    print(f"    bytes the clients got out before the server stopped reading: "
          f"median {sorted(sent)[len(sent) // 2] / MIB:.1f} MiB, max {max(sent) / MIB:.1f} MiB")
    print(f"    answers: {statuses}")
    print(f"    web RSS: before {before:.0f} MiB, peak {sampler.peak:.0f} MiB, holding {during:.0f} MiB, "
          f"after {after:.0f} MiB")


def authenticated(port: int, pid: int, key: str, *, bodies: int, body: bytes) -> None:
    stalls: list[float] = []
    done = threading.Event()

    def scrape() -> None:
        with httpx.Client(timeout=60) as client:
            while not done.is_set():
                started = time.monotonic()
                client.get(f"http://{bench_gateway.HOST}:{port}/metrics")
                stalls.append(time.monotonic() - started)
                time.sleep(0.05)

    codes: list[int] = []

    def post() -> None:
        response = httpx.post(f"http://{bench_gateway.HOST}:{port}/v1/chat/completions", content=body, timeout=300,
                              headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        codes.append(response.status_code)

    before = rss_mib(pid)
    scraper = threading.Thread(target=scrape)
    with Sampler(pid) as sampler:
        scraper.start()
        started = time.monotonic()
        posts = [threading.Thread(target=post) for _ in range(bodies)]
        for t in posts:
            t.start()
        for t in posts:
            t.join()
        elapsed = time.monotonic() - started
        done.set()
        scraper.join()
    time.sleep(1)
    print(f"  {bodies} authenticated body(ies) of {len(body) / MIB:.1f} MiB (small objects), answers {sorted(codes)}, "
          f"{elapsed:.1f} s")
    print(f"    web RSS: before {before:.0f} MiB, peak {sampler.peak:.0f} MiB, after {rss_mib(pid):.0f} MiB; "
          f"parsing processes peak {sampler.children_peak:.0f} MiB")
    print(f"    /metrics: {len(stalls)} scrapes, longest wait {max(stalls) * 1000:.0f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--declared-mib", type=int, default=32)
    parser.add_argument("--send-mib", type=int, default=30)
    args = parser.parse_args()
    body = json.dumps({"model": "not-served", "messages": [{"role": "user", "content": "x"}] * 900_000}).encode()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-mem-") as workdir:
        for label, extra in [("parsing processes (default)", {}),
                             ("parsing on the event loop (for comparison)",
                              {"LLMGW_GATEWAY_INLINE_PARSE_BYTES": str(64 * MIB)})]:
            stack = bench_gateway.Stack(Path(workdir) / label.split()[0] / label.split()[2])
            stack.workdir.mkdir(parents=True)
            os.environ.update(extra)
            try:
                sim = bench_gateway.start_sim(stack)
                gateway = bench_gateway.start_gateway(stack, sim.port)
                pid = gateway.procs[0].pid
                key = gateway.headers["Authorization"].split()[1]
                print(f"{label}: web process {pid}, {rss_mib(pid):.0f} MiB at rest")
                if not extra:
                    unauthenticated(gateway.port, pid, clients=args.clients, declared=args.declared_mib * MIB,
                                    send=args.send_mib * MIB)
                authenticated(gateway.port, pid, key, bodies=1, body=body)
                authenticated(gateway.port, pid, key, bodies=3, body=body)
            finally:
                stack.stop()
                for name in extra:
                    os.environ.pop(name, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
