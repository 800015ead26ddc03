"""Routing policies side by side on simulated engines that model a KV cache.

    make bench-routing      (or: python bench/routing.py [--quick] [--seconds 12] [--policies ...] [--gateways 2])

One machine: a real control plane (PostgreSQL, Redis, agent API, Celery),
one simulated node with 8 GPUs whose real agent runs 8 sim engines of one
model (the performance model of agent/engines/sim_model.py: a batch limit
and queue, a prefix KV cache with LRU eviction, one prefill lane per
engine), and the gateway's web process(es) as ``llmgw up`` starts them.

The engines' time is slowed about tenfold against a real GPU (prefill 0.5 ms
a token, a 1,500-block cache) so that 8 replicas at 80 % load stay within
what a shared 2-core machine can drive. Workloads, modelled on llm-d's:

- ``shared``: groups of users sharing a long system prompt (2,000-6,000
  words), whose total prefix demand is ~6x one replica's cache, each request
  the group's prefix and a question of its own (200-600 words);
- ``unique``: the same arrival process, prompts of 200-600 words shared by nobody;
- ``hot``: as ``shared``, but one group's prefix takes half of all requests.

First, per workload, a capacity ramp: steps of ``--ramp-seconds`` of Poisson
arrivals under least-outstanding, x1.5 while it keeps up (no failed request,
TTFT p90 <= ``--slo``), then one step between the last rate it kept up with
and the first it did not; its capacity is the highest rate it kept up with.
Then each policy in turn at 80 % of that rate (``--load``): every policy
gets the same arrival times (a seed) and its own prefix texts (so no policy
inherits another's cache). The group workloads start with one request per group
(unmeasured: the cold prefill every policy pays once). Each request streams
16 tokens; it fails on an error or after ``--timeout`` seconds.

Printed per workload and policy: TTFT p50/p90 of the answered requests,
output tokens/s over the phase, the engines' prefix-cache hit rate (their
own counters), failed requests, the gateway processes' CPU per request,
and each engine's time-averaged queue (requests waiting) and load (running +
waiting), sampled every 0.5 s. With ``--gateways 2`` cache-aware runs once
more with requests alternating between two web processes (which share their
prefix memory through Redis). Every process it starts, it stops.
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
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DB_NAME = "llmgw_bench_routing"
MODEL = "sim-8b"
REPLICAS = 8
BLOCKS = 1500  # per replica: 24,000 tokens of cache
BLOCK_SIZE = 16
PREFILL_PER_TOKEN = 0.0005
MAX_TOKENS = 16
PREFIX_WORDS = (2000, 6000)
QUESTION_WORDS = (200, 600)
DEMAND_X_CACHE = 6
USERS_PER_GROUP = 4
LOAD = 0.8
ENGINE_ARGS = ["--max-num-seqs", "16", "--num-gpu-blocks-override", str(BLOCKS), "--max-model-len", "16000",
               "--prefill-time-per-token", str(PREFILL_PER_TOKEN)]
POLICIES = ("least-outstanding", "session", "cache-aware")
_COMPLETION = re.compile(rb'"completion_tokens":\s*(\d+)')


# --- workload ------------------------------------------------------------------------------


def _vocabulary() -> list[str]:
    rng = random.Random(1)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(5)) for _ in range(5000)]


VOCABULARY = _vocabulary()


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choices(VOCABULARY, k=count))


@dataclass
class Request:
    at: float
    user: str
    prefix: str
    question: str


def workload(kind: str, *, rate: float, seconds: float, arrivals_seed: int, text_seed: int) -> tuple[list[Request], list[Request]]:
    """(warm-up requests, measured requests). The groups' prefixes follow
    ``text_seed`` alone (a ramp's steps share them), the questions both seeds
    (no step or policy meets another's question in a cache)."""
    arrivals = random.Random(arrivals_seed)
    rng = random.Random(text_seed)
    questions = random.Random(f"{text_seed}/{arrivals_seed}")
    cache_words = BLOCKS * BLOCK_SIZE
    groups: list[str] = []
    if kind != "unique":
        total = 0
        while total < DEMAND_X_CACHE * cache_words:
            groups.append(words(rng, rng.randint(*PREFIX_WORDS)))
            total += len(groups[-1].split())
    times, t = [], 0.0
    while True:
        t += arrivals.expovariate(rate)
        if t >= seconds:
            break
        times.append(t)
    measured = []
    for at in times:
        question = words(questions, arrivals.randint(*QUESTION_WORDS))
        pick = arrivals.random()
        if kind == "unique":
            measured.append(Request(at, f"u{arrivals.randrange(10**9)}", "", question))
            continue
        if kind == "hot" and pick < 0.5:
            group = 0
        else:
            group = arrivals.randrange(len(groups))
        measured.append(Request(at, f"g{group}-u{arrivals.randrange(USERS_PER_GROUP)}", groups[group], question))
    warm = [Request(0.0, f"g{g}-u0", prefix, words(questions, 20)) for g, prefix in enumerate(groups)]
    return warm, measured


def miss_capacity(kind: str) -> float:
    """Requests/s the cluster would serve if every prompt were prefilled whole
    (one prefill lane per engine): where the capacity ramp starts looking."""
    words_per_request = sum(QUESTION_WORDS) / 2 + (0 if kind == "unique" else sum(PREFIX_WORDS) / 2)
    return REPLICAS / (words_per_request * PREFILL_PER_TOKEN)


# --- the run ------------------------------------------------------------------------------


@dataclass
class Result:
    ok: bool
    ttft: float | None = None
    tokens: int = 0
    error: str = ""


@dataclass
class Phase:
    workload: str
    policy: str
    results: list[Result] = field(default_factory=list)
    elapsed: float = 0.0
    hits: float = 0.0
    queries: float = 0.0
    gateway_cpu: float = 0.0
    queue: dict[int, list[int]] = field(default_factory=dict)  # replica -> waiting samples
    load: dict[int, list[int]] = field(default_factory=dict)  # replica -> running + waiting samples

    def ttft(self, q: float) -> float | None:
        """The q-th percentile of every request's TTFT, a failed one counting as infinite
        (None when that percentile falls among the failed: '>= timeout')."""
        values = sorted(r.ttft if r.ok and r.ttft is not None else float("inf") for r in self.results)
        if not values:
            return None
        value = values[min(len(values) - 1, int(len(values) * q / 100))]
        return None if value == float("inf") else value

    @property
    def failed(self) -> int:
        return sum(1 for r in self.results if not r.ok)

    @property
    def tokens_per_second(self) -> float:
        return sum(r.tokens for r in self.results if r.ok) / self.elapsed if self.elapsed else 0.0


def body(request: Request) -> bytes:
    messages = ([{"role": "system", "content": request.prefix}] if request.prefix else []) + [
        {"role": "user", "content": request.question}]
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "stream": True,
                       "stream_options": {"include_usage": True}, "user": request.user}).encode()


async def send(session, url: str, request: Request, timeout: float) -> Result:
    import aiohttp

    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url, data=body(request), headers={"Content-Type": "application/json"}) as response:
                if response.status != 200:
                    return Result(False, error=f"HTTP {response.status}: {(await response.read())[:120]!r}")
                ttft = None
                tail = b""
                async for chunk in response.content.iter_any():
                    if ttft is None and b'"content"' in chunk:
                        ttft = time.perf_counter() - started
                    tail = (tail + chunk)[-4096:]
                if b"[DONE]" not in tail:
                    return Result(False, error="stream cut short")
                match = _COMPLETION.search(tail)
                return Result(True, ttft=ttft, tokens=int(match.group(1)) if match else 0)
    except TimeoutError:
        return Result(False, error="timeout")
    except aiohttp.ClientError as exc:
        return Result(False, error=type(exc).__name__)


async def engine_reading(session, url: str) -> dict[str, float]:
    async with session.get(url, timeout=2) as response:
        text = await response.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            try:
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return values


async def counters(session, engines: dict[int, str]) -> tuple[float, float]:
    readings = await asyncio.gather(*(engine_reading(session, u) for u in engines.values()))
    return (sum(r.get("vllm:prefix_cache_hits_total", 0) for r in readings),
            sum(r.get("vllm:prefix_cache_queries_total", 0) for r in readings))


async def sample_queues(session, engines: dict[int, str], phase: Phase, stop: asyncio.Event) -> None:
    while not stop.is_set():
        readings = await asyncio.gather(*(engine_reading(session, u) for u in engines.values()),
                                        return_exceptions=True)
        for replica, reading in zip(engines, readings):
            if isinstance(reading, dict):
                waiting = int(reading.get("vllm:num_requests_waiting", 0))
                phase.queue.setdefault(replica, []).append(waiting)
                phase.load.setdefault(replica, []).append(waiting + int(reading.get("vllm:num_requests_running", 0)))
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


async def idle(session, engines: dict[int, str], limit: float = 90) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        readings = await asyncio.gather(*(engine_reading(session, u) for u in engines.values()))
        if all(r.get("vllm:num_requests_running", 0) + r.get("vllm:num_requests_waiting", 0) == 0 for r in readings):
            return
        await asyncio.sleep(0.5)


async def run_phase(gateways: list[str], cpu, engines: dict[int, str], kind: str, policy: str,
                    warm: list[Request], measured: list[Request], timeout: float) -> Phase:
    import aiohttp

    phase = Phase(kind, policy)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        urls = [f"{g}/v1/chat/completions" for g in gateways]
        if warm:
            limit = asyncio.Semaphore(REPLICAS)

            async def one(i: int, request: Request) -> None:
                async with limit:
                    await send(session, urls[i % len(urls)], request, 120)

            await asyncio.gather(*(one(i, r) for i, r in enumerate(warm)))
            await idle(session, engines)
        hits0, queries0 = await counters(session, engines)
        cpu0 = cpu()
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_queues(session, engines, phase, stop))
        started = time.perf_counter()

        async def timed(i: int, request: Request) -> Result:
            await asyncio.sleep(max(0.0, started + request.at - time.perf_counter()))
            return await send(session, urls[i % len(urls)], request, timeout)

        phase.results = await asyncio.gather(*(timed(i, r) for i, r in enumerate(measured)))
        phase.elapsed = time.perf_counter() - started
        stop.set()
        await sampler
        phase.gateway_cpu = cpu() - cpu0
        hits1, queries1 = await counters(session, engines)
        phase.hits, phase.queries = hits1 - hits0, queries1 - queries0
        await idle(session, engines)
    return phase


@dataclass
class Step:
    rate: float
    phase: Phase
    ok: bool


def ramp(gateways: list[str], cpu, engines: dict[int, str], kind: str, policy: str, *, start: float,
         seconds: float, timeout: float, slo: float, text_seed: int, arrivals_seed: int,
         max_steps: int) -> tuple[float | None, list[Step]]:
    """The highest arrival rate at which ``policy`` keeps up on ``kind``: no
    request fails and the TTFT p90 stays under ``slo``. Steps of ``seconds``
    of Poisson arrivals, x1.5 from ``start`` while it keeps up (/1.5 while it
    does not), then one step halfway (geometrically) between the last rate it
    kept up with and the first it did not. The groups' prefixes are the same
    in every step (warmed once, before the first): the cache carries over."""
    steps: list[Step] = []
    good: float | None = None
    bad: float | None = None
    rate = start
    while len(steps) < max_steps:
        warm, measured = workload(kind, rate=rate, seconds=seconds, arrivals_seed=arrivals_seed + len(steps),
                                  text_seed=text_seed)
        phase = asyncio.run(run_phase(gateways, cpu, engines, kind, policy, [] if steps else warm, measured,
                                      timeout))
        p90 = phase.ttft(90)
        ok = phase.failed == 0 and p90 is not None and p90 <= slo
        steps.append(Step(rate, phase, ok))
        print(f"  ramp {kind} / {policy}: {rate:6.2f}/s {len(measured):4d} reqs TTFT p90 {_ms(p90):>7} ms "
              f"failed {phase.failed:3d} -> {'keeps up' if ok else 'does not'}", flush=True)
        if ok:
            good = rate if good is None else max(good, rate)
        else:
            bad = rate if bad is None else min(bad, rate)
        if good is not None and bad is not None:
            if bad / good <= 1.25:
                break
            rate = (good * bad) ** 0.5
        else:
            rate = rate * 1.5 if ok else rate / 1.5
    return good, steps


def _ms(value: float | None) -> str:
    return "failed" if value is None else f"{value * 1000:.0f}"


def report(phases: list[Phase], timeout: float, capacities: dict | None = None) -> None:
    header = (f"{'workload':<8} {'policy':<18} {'reqs':>5} {'TTFT p50 ms':>11} {'TTFT p90 ms':>11} {'out tok/s':>9} "
              f"{'hit rate':>8} {'failed':>6} {'gw CPU ms/req':>13} {'queue max/avg':>13}")
    print(header + "   (TTFT: 'failed' when that percentile falls among failed requests)")
    print("-" * len(header))
    for p in phases:
        means = [statistics.fmean(v) for v in p.queue.values() if v]
        avg = statistics.fmean(means) if means else 0.0
        ratio = "-" if avg < 0.05 else f"{max(means) / avg:.2f}"
        hit = f"{p.hits / p.queries * 100:.0f} %" if p.queries else "-"
        cpu = p.gateway_cpu / len(p.results) * 1000 if p.results else 0.0
        print(f"{p.workload:<8} {p.policy:<18} {len(p.results):>5} {_ms(p.ttft(50)):>11} {_ms(p.ttft(90)):>11} "
              f"{p.tokens_per_second:>9.0f} {hit:>8} {p.failed:>6} {cpu:>13.3f} {ratio:>13}")
        errors = sorted({r.error for r in p.results if not r.ok})
        if errors:
            print(f"{'':<28}errors: {', '.join(errors)[:160]}")
    print()
    print("time-averaged engine queue (waiting) / load (running + waiting) per replica:")
    for p in phases:
        cells = " ".join(f"{statistics.fmean(p.queue[r]):.1f}/{statistics.fmean(p.load[r]):.1f}"
                         for r in sorted(p.queue) if p.queue[r])
        print(f"  {p.workload:<8} {p.policy:<18} {cells}")
    print()
    goals(phases, timeout, capacities or {})


def goals(phases: list[Phase], b_timeout: float = 15.0, capacities: dict | None = None) -> None:
    by = {(p.workload, p.policy): p for p in phases}
    lo, ca = "least-outstanding", "cache-aware"
    if ("shared", lo) in by and ("shared", ca) in by:
        a, b = by[("shared", lo)], by[("shared", ca)]
        if b.ttft(90):
            worse = a.ttft(90) or float("inf")
            ratio = worse / b.ttft(90)
            print(f"goal shared: cache-aware TTFT p90 >= 5x lower than least-outstanding: "
                  f"{'more than ' + str(round(b_timeout / b.ttft(90), 1)) if a.ttft(90) is None else round(ratio, 1)}x "
                  f"({'met' if ratio >= 5 else 'NOT met'}; a failed request counts as an infinite TTFT, "
                  f"{a.failed} of least-outstanding's failed)")
        else:
            print(f"goal shared: NOT met: cache-aware's TTFT p90 falls among its {b.failed} failed requests")
        if a.tokens_per_second:
            ratio = b.tokens_per_second / a.tokens_per_second
            print(f"goal shared: cache-aware throughput >= 1.5x: {ratio:.2f}x at the same arrivals "
                  f"({'met' if ratio >= 1.5 else 'NOT met'}; where least-outstanding keeps up, both serve what "
                  f"arrives: the capacities below compare what each can serve)")
    capacities = capacities or {}
    for kind in ("shared", "hot", "unique"):
        a, b = capacities.get((kind, lo)), capacities.get((kind, ca))
        if a and b:
            print(f"capacity {kind}: cache-aware keeps up with {b:.2f}/s, least-outstanding {a:.2f}/s: {b / a:.2f}x"
                  f"{' (goal >= 1.5x: ' + ('met' if b / a >= 1.5 else 'NOT met') + ')' if kind == 'shared' else ''}")
    if ("unique", lo) in by and ("unique", ca) in by:
        a, b = by[("unique", lo)], by[("unique", ca)]
        tput = b.tokens_per_second / a.tokens_per_second if a.tokens_per_second else 0
        if a.ttft(90) and b.ttft(90):
            p90 = f"{b.ttft(90) / a.ttft(90):.3f}x"
            met = tput >= 0.95 and b.ttft(90) <= 1.05 * a.ttft(90)
        else:  # a p90 among failed requests: no ratio to compare
            p90 = f"{_ms(b.ttft(90))} ms against {_ms(a.ttft(90))} ms"
            met = tput >= 0.95 and b.ttft(90) is not None
        print(f"goal unique: cache-aware within 5 % of least-outstanding: throughput {tput:.3f}x, TTFT p90 {p90} "
              f"({'met' if met else 'NOT met'})")
    for kind in ("shared", "hot"):
        one, two = by.get((kind, ca)), next((p for (k, name), p in by.items() if k == kind and name.startswith(ca + " x")),
                                            None)
        if one and two and one.queries and two.queries:
            print(f"two gateway processes, {kind}: cache-aware hit rate {two.hits / two.queries * 100:.0f} % against "
                  f"{one.hits / one.queries * 100:.0f} % through one; TTFT p90 {_ms(two.ttft(90))} against "
                  f"{_ms(one.ttft(90))} ms")
    if ("hot", ca) in by:
        p = by[("hot", ca)]
        means = [statistics.fmean(v) for v in p.queue.values() if v]
        avg = statistics.fmean(means) if means else 0.0
        worst = max(means) if means else 0.0
        print(f"goal hot: cache-aware: {p.failed} failed, largest time-averaged queue {worst:.2f} against an average "
              f"of {avg:.2f} ({'met' if p.failed == 0 and (worst <= 2 * avg or worst < 0.5) else 'NOT met'})")


# --- the cluster --------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=12.0, help="arrivals per phase (default 12 s)")
    parser.add_argument("--timeout", type=float, default=15.0, help="a request fails after this (default 15 s)")
    parser.add_argument("--load", type=float, default=LOAD,
                        help="arrival rate / the capacity the ramp measured (default 0.8)")
    parser.add_argument("--ramp-seconds", type=float, default=8.0, help="arrivals per ramp step (default 8 s)")
    parser.add_argument("--ramp-steps", type=int, default=5, help="most steps per ramp (default 5)")
    parser.add_argument("--slo", type=float, default=4.0,
                        help="a ramp step keeps up when nothing fails and TTFT p90 <= this (default 4 s)")
    parser.add_argument("--ramp-policies", default="least-outstanding",
                        help="policies whose capacity is ramped; the first sets the measured rate "
                             "(default least-outstanding; add cache-aware to compare capacities)")
    parser.add_argument("--rate", default="",
                        help="skip the ramp: workload=rate/s pairs, e.g. shared=3,unique=20,hot=3")
    parser.add_argument("--quick", action="store_true",
                        help="shorter phases and ramps (8 s / 5 s of arrivals, 10 s timeout, 4 steps): ~5 min")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--workloads", default="shared,unique,hot")
    parser.add_argument("--gateways", type=int, default=1,
                        help="gateway web processes (default 1); with more, every phase goes through the first, and "
                             "cache-aware is run again with requests alternating over all of them")
    parser.add_argument("--pg", default="postgres://postgres@127.0.0.1:5432", help="PostgreSQL server URL")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/2")
    parser.add_argument("--db-name", default=DB_NAME)
    parser.add_argument("--node-addr", default="127.0.1.180", help="the simulated node's address")
    parser.add_argument("--seed", type=int, default=20)
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.timeout, args.ramp_seconds, args.ramp_steps = 8.0, 10.0, 5.0, 4

    base = Path(tempfile.mkdtemp(prefix="llmgw-routing-"))
    atexit.register(shutil.rmtree, base, ignore_errors=True)  # its files go with it
    os.environ.update({
        "DATABASE_URL": f"{args.pg}/{args.db_name}", "CELERY_BROKER_URL": args.redis, "LLMGW_REDIS_URL": args.redis,
        "LLMGW_DATA_DIR": str(base / "data"), "LLMGW_NODE_GRACE": "5", "LLMGW_SWEEP_INTERVAL": "0.5",
        "LLMGW_HEARTBEAT_INTERVAL": "1", "LLMGW_RECONCILE_INTERVAL": "1", "LLMGW_GATEWAY_OPEN": "1",
        "LLMGW_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
        # The sim's tokens are words: 5 letters and a space.
        "LLMGW_ROUTING_CHARS_PER_TOKEN": os.environ.get("LLMGW_ROUTING_CHARS_PER_TOKEN", "6"),
    })
    from _cluster import BenchCluster, database_ready  # noqa: PLC0415 - bench/ siblings

    database_ready(pg=args.pg, db_name=args.db_name, redis_url=args.redis)
    from cli.simcluster import SimNode
    from cli.wait import wait_until
    from replicas.catalog import catalog_apply
    from replicas.choices import ReplicaStatus
    from replicas.models import Member

    cluster = BenchCluster.start(base, webs=args.gateways,
                                 agent_timings={"heartbeat_interval": "1s", "supervisor.health_interval": "500ms"})
    webs, gateways = cluster.webs, cluster.gateways
    phases: list[Phase] = []
    entry = {"name": MODEL, "engine": "sim", "model": "/models/sim-8b", "nodes": 1, "gpus_per_node": 1,
             "replicas": REPLICAS, "args": ENGINE_ARGS}
    try:
        cluster.start_nodes([SimNode("bench-routing", args.node_addr, gpus=REPLICAS)])
        catalog_apply(entries=[entry])
        wait_until(lambda: Member.objects.filter(replica__status=ReplicaStatus.READY).count() == REPLICAS,
                   timeout=120, message=f"{REPLICAS} ready replicas")
        engines = {m.replica_id: f"http://{m.node.mgmt_addr}:{m.ports['http']}/metrics"
                   for m in Member.objects.filter(replica__status=ReplicaStatus.READY).select_related("node")}
        import urllib.request

        for url in gateways:
            wait_until(lambda: json.load(urllib.request.urlopen(f"{url}/v1/models", timeout=5))["data"], timeout=30,
                       message="the gateway to route the model")

        def cpu() -> float:
            total = 0.0
            for proc in webs:
                with open(f"/proc/{proc.pid}/stat", "rb") as handle:
                    fields = handle.read().rsplit(b")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            return total

        policies = args.policies.split(",")
        kinds = args.workloads.split(",")
        fixed = {k: float(v) for k, v in (pair.split("=") for pair in args.rate.split(",") if pair)}
        print(f"{REPLICAS} sim replicas of {MODEL} ({' '.join(ENGINE_ARGS)}), {args.gateways} gateway process(es); "
              f"{args.seconds:g} s of arrivals per phase, timeout {args.timeout:g} s; ramp steps of "
              f"{args.ramp_seconds:g} s, keeping up = no failure and TTFT p90 <= {args.slo:g} s", flush=True)
        capacities: dict[tuple[str, str], float | None] = {}
        run_started = time.monotonic()
        for n, kind in enumerate(kinds):
            if kind in fixed:
                rate = fixed[kind]
                print(f"{kind}: {rate:.2f}/s as given (no ramp)", flush=True)
            else:
                for r, policy in enumerate(args.ramp_policies.split(",")):
                    catalog_apply(entries=[{**entry, "routing": policy}])
                    time.sleep(1.0)  # every gateway process reloads its table (0.2 s)
                    capacities[(kind, policy)], _ = ramp(
                        gateways[:1], cpu, engines, kind, policy, start=0.6 * miss_capacity(kind),
                        seconds=args.ramp_seconds, timeout=args.timeout, slo=args.slo,
                        text_seed=args.seed * 1000 + 500 + n * 10 + r, arrivals_seed=args.seed * 100 + n * 10,
                        max_steps=args.ramp_steps)
                first = capacities[(kind, args.ramp_policies.split(",")[0])]
                if first is None:
                    print(f"{kind}: the ramp found no rate that {args.ramp_policies.split(',')[0]} keeps up with; "
                          f"skipped", flush=True)
                    continue
                rate = args.load * first
            runs = [(policy, gateways[:1]) for policy in policies]
            if len(gateways) > 1 and "cache-aware" in policies:
                runs.append(("cache-aware", gateways))
            for m, (policy, through) in enumerate(runs):
                catalog_apply(entries=[{**entry, "routing": policy}])
                time.sleep(1.0)  # every gateway process reloads its table (0.2 s)
                warm, measured = workload(kind, rate=rate, seconds=args.seconds, arrivals_seed=args.seed + n,
                                          text_seed=args.seed * 1000 + n * 10 + m)
                label = policy if len(through) == 1 else f"{policy} x{len(through)}"
                print(f"{kind} / {label}: {len(warm)} prefix groups, {len(measured)} requests at {rate:.2f}/s",
                      flush=True)
                phases.append(asyncio.run(run_phase(through, cpu, engines, kind, label, warm, measured,
                                                    args.timeout)))
        print()
        print(f"Run took {time.monotonic() - run_started:.0f} s. The machine is shared with other work: figures are "
              f"indicative; CPU is the gateway processes' own.")
        if capacities:
            print("capacity (highest rate kept up with, from the ramp): " + ", ".join(
                f"{k} / {p}: {'none' if c is None else f'{c:.2f}/s'}" for (k, p), c in capacities.items()))
        report(phases, args.timeout, capacities)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
