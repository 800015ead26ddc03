"""What a simulated request costs the machine: the sim engine's CPU per request.

    python bench/sim_engine.py [--requests N]

The sim engine is meant to cost nothing but its sleep, so that eight or more
replicas of it on one shared machine measure the gateway's routing, not the
simulator. This starts one sim engine leader on 127.0.0.1 (its default
performance model: an 8B model on one GPU) and sends it, one kind after the
other: short prompts, 8,000-token prompts that share a prefix (cache hits),
8,000-token prompts that share nothing (misses), and long streamed answers.
It prints, per kind, the engine's CPU time per request (from /proc: every
thread of the process), per output token, the requests' p50 latency and time
to first token, and the engine's own counters from its /metrics. Then the
model alone, in this process: CPU per admission of an 8,000-token prompt
(tokens hashed into blocks). Loopback only; the engine is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

from _http_load import Connection, Phase, build_request, percentile  # noqa: E402
from _proc_cpu import _proc_cpu  # noqa: E402

HOST = "127.0.0.1"
MODEL = "sim-bench"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=5) as response:
        return response.read().decode()


async def run(port: int, bodies: list[bytes], *, stream: bool, concurrency: int) -> Phase:
    phase = Phase()
    queue = list(reversed(bodies))

    async def worker() -> None:
        connection = Connection(HOST, port)
        try:
            while queue:
                raw = build_request(HOST, port, "/v1/completions", queue.pop(), {})
                phase.samples.append(await connection.request(raw, stream))
        finally:
            connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    phase.elapsed = time.perf_counter() - started
    return phase


def body(prompt: str, max_tokens: int, stream: bool) -> bytes:
    value = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    return json.dumps(value).encode()


def counters(port: int) -> dict[str, float]:
    values = {}
    for line in get(port, "/metrics").splitlines():
        if line.startswith("vllm:") and "_bucket" not in line and "_created" not in line:
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0]] = float(value)
    return values


def model_alone(n: int) -> float:
    """CPU seconds per submit + computed + finish of an 8,000-token prompt, in this process."""
    from agent.engines.sim_model import SimEngine, SimParams

    engine = SimEngine(SimParams())
    prompts = [[f"p{i}w{j}" for j in range(8000)] for i in range(8)]
    started = time.process_time()
    for i in range(n):
        ticket = engine.submit(prompts[i % 8], 16, now=float(i))
        engine.computed(ticket)
        engine.finish(ticket, now=float(i) + 0.5)
    return (time.process_time() - started) / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per kind")
    args = parser.parse_args(argv)
    n = args.requests
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "agent.engines.sim", "--rank", "0", "--nnodes", "1",
                             "--host", HOST, "--port", str(port), "--model", MODEL],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                get(port, "/health")
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the sim engine did not start") from None
                time.sleep(0.1)
        shared = " ".join(f"doc{j}" for j in range(8000))
        kinds = [
            ("short prompt, 16 tokens, c=16", [body(f"hello {i}", 16, False) for i in range(n)], False, 16),
            ("8k shared prefix, 16 tokens, c=16", [body(f"{shared} q{i}", 16, False) for i in range(n)], False, 16),
            ("8k unique prompts, 16 tokens, c=16",
             [body(" ".join(f"u{i}w{j}" for j in range(8000)), 16, False) for i in range(n)], False, 16),
            ("streamed, 200 tokens, c=64", [body(f"story {i}", 200, True) for i in range(n)], True, 64),
        ]
        print(f"sim engine CPU per request ({n} requests per kind; shared 2-core machine, others may be busy)")
        print(f"{'kind':38} {'req/s':>7} {'p50 s':>7} {'ttft p50':>9} {'CPU ms/req':>11} {'CPU us/token':>13} errors")
        for name, bodies, stream, concurrency in kinds:
            before = _proc_cpu(proc.pid)
            phase = asyncio.run(run(port, bodies, stream=stream, concurrency=concurrency))
            cpu = _proc_cpu(proc.pid) - before
            tokens = 200 if stream else 16
            good = phase.good
            ttft = percentile([s.ttft for s in good if s.ttft is not None], 50)
            print(f"{name:38} {len(good) / phase.elapsed:7.1f} {percentile([s.latency for s in good], 50):7.3f} "
                  f"{(f'{ttft:.3f}' if ttft is not None else '-'):>9} {cpu / len(bodies) * 1000:11.2f} "
                  f"{cpu / (len(bodies) * tokens) * 1e6:13.1f} {len(phase.errors)}")
        seen = counters(port)
        print("engine counters: " + ", ".join(f"{k.removeprefix('vllm:')}={v:g}" for k, v in sorted(seen.items())
                                               if "prefix" in k or "success" in k))
        print(f"the model alone: {model_alone(400) * 1000:.3f} ms CPU per 8,000-token admission (hashing included)")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
