"""The routing policies over the sim engine's model in virtual time: no
processes, no sleeping, the same arithmetic (agent/engines/sim_model.py)
and the gateway's own routing table (gateway/routing.py, gateway/scoring.py).

    python bench/routing_sim.py                  # the guard's knobs on the shared and hot workloads
    python bench/routing_sim.py --gateways 2     # two routing tables, with and without the shared memory

What bench/routing.py measures with real processes takes minutes a phase on
a shared machine; here a phase takes seconds of CPU, so knobs can be swept.
What it leaves out: the gateway's and the HTTP layer's own time, the
machine's noise, and the engines' readings' transport (each table reads
each engine every ``--scrape`` seconds of virtual time, exactly). The
workloads, engine flags and the capacity ramp are bench/routing.py's.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import os  # noqa: E402

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
import django  # noqa: E402

django.setup()  # gateway.routing's modules read settings at import (no database is touched)
import importlib.util  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_routing", REPO / "bench" / "routing.py")
real = importlib.util.module_from_spec(_spec)  # bench/routing.py's workloads (bench/ holds a gateway.py)
sys.modules["bench_routing"] = real
_spec.loader.exec_module(real)
from agent.engines.sim_model import SimEngine, SimParams  # noqa: E402
from gateway import scoring  # noqa: E402
from gateway.engineload import EngineReading  # noqa: E402
from gateway.prefix import prompt_blocks, session_hash  # noqa: E402
from gateway.routing import CACHE_AWARE, Hints, RoutingTable  # noqa: E402
from gateway.selectors import RouteRow, RoutingSnapshot  # noqa: E402

PARAMS = SimParams(max_num_seqs=16, num_gpu_blocks=real.BLOCKS, block_size=real.BLOCK_SIZE, max_model_len=16000,
                   prefill_time_per_token=real.PREFILL_PER_TOKEN)
MODEL = "m"


@dataclass
class Outcome:
    ttfts: list[float] = field(default_factory=list)  # inf: failed
    tokens: int = 0
    elapsed: float = 0.0
    hits: int = 0
    queries: int = 0
    queue_samples: dict[int, list[int]] = field(default_factory=dict)

    def p(self, q: float) -> float:
        values = sorted(self.ttfts)
        return values[min(len(values) - 1, int(len(values) * q / 100))] if values else float("nan")

    @property
    def failed(self) -> int:
        return sum(1 for t in self.ttfts if t == float("inf"))

    def queue_ratio(self) -> float:
        means = [statistics.fmean(v) for v in self.queue_samples.values() if v]
        avg = statistics.fmean(means) if means else 0.0
        return max(means) / avg if avg >= 0.05 else 0.0


def simulate(requests: list[real.Request], warm: list[real.Request], policy: str, knobs: scoring.Knobs, *,
             gateways: int = 1, share: bool = True, timeout: float = 15.0, scrape: float = 1.0,
             share_every: float = 0.25) -> Outcome:
    engines = {r: SimEngine(PARAMS) for r in range(1, real.REPLICAS + 1)}
    tables = []
    for _ in range(gateways):
        table = RoutingTable(knobs, block_chars=512, chars_per_token=6, cache_tokens=real.BLOCKS * real.BLOCK_SIZE)
        table.apply(RoutingSnapshot(catalog={MODEL: 0}, keys=[], policies={MODEL: policy},
                                    routes=[RouteRow(r, MODEL, f"http://127.0.0.1:{9000 + r}") for r in engines]))
        tables.append(table)
    outbox: list[tuple[int, int, tuple[int, ...], float]] = []  # (from table, replica, blocks, at)
    seq = itertools.count()
    events: list = []  # (time, seq, kind, payload)

    def push(at: float, kind: str, payload) -> None:
        heapq.heappush(events, (at, next(seq), kind, payload))

    outcome = Outcome()
    live: dict[int, dict] = {}

    def started(req: dict) -> None:
        ticket = req["ticket"]
        push(ticket.first_token_at, "first", req["id"])

    def admit_check(replica: int) -> None:
        for req in list(live.values()):
            if req["replica"] == replica and not req["scheduled"] and req["ticket"].admitted_at is not None:
                req["scheduled"] = True
                started(req)

    def send(at: float, request: real.Request, measured: bool, n: int) -> None:
        table = tables[n % gateways]
        text = ("system\n" + request.prefix + "\nuser\n" if request.prefix else "user\n") + request.question
        hints = (Hints(blocks=prompt_blocks(text), chars=len(text)) if policy == CACHE_AWARE
                 else Hints(session=session_hash(request.user)) if policy == "session" else Hints())
        route = table.pick(MODEL, hints=hints)
        if policy == CACHE_AWARE and share and gateways > 1:
            outbox.append((n % gateways, route.replica_id, hints.blocks, at))
        route.inflight += 1
        tokens = ((request.prefix + " ") if request.prefix else "").split() + request.question.split()
        ticket = engines[route.replica_id].submit(tokens, real.MAX_TOKENS, at)
        req = {"id": n, "ticket": ticket, "replica": route.replica_id, "route": route, "arrival": at,
               "measured": measured, "scheduled": False, "pending": table.last_sent}
        live[n] = req
        if ticket.admitted_at is not None:
            req["scheduled"] = True
            started(req)
        push(at + timeout, "timeout", n)

    def prefilled(req: dict) -> None:
        """As gateway.proxy counts it: the prompt no longer waits for prefill once answered or given up."""
        req["route"].prefilled_tokens += req["pending"]
        req["pending"] = 0

    def end(req: dict, now: float, ok: bool) -> None:
        prefilled(req)
        engine = engines[req["replica"]]
        engine.finish(req["ticket"], now, ok=ok)
        req["route"].inflight -= 1
        del live[req["id"]]
        if req["measured"]:
            if ok:
                outcome.tokens += real.MAX_TOKENS
            else:
                outcome.ttfts.append(float("inf"))
        admit_check(req["replica"])

    # Warm-up: one request per group, in turn, unmeasured; then the engines idle.
    clock = 0.0
    for i, request in enumerate(warm):
        send(clock, request, False, -1 - i)
        while events:
            at, _, kind, payload = heapq.heappop(events)
            clock = at
            req = live.get(payload)
            if req is None:
                continue
            if kind == "first":
                engines[req["replica"]].computed(req["ticket"])
                push(at + (real.MAX_TOKENS - 1) * engines[req["replica"]].decode_step(), "done", payload)
            elif kind == "done":
                end(req, at, True)
        outbox.clear()
    for table in tables:
        for r, route in table.routes.items():
            route.engine = None
    start = clock + 1.0
    counters0 = {r: (e.prefix_hits, e.prefix_queries) for r, e in engines.items()}
    for n, request in enumerate(requests):
        push(start + request.at, "arrive", n)
    t = start
    while t < start + requests[-1].at + timeout + 1 if requests else False:
        push(t, "scrape", None)
        t += scrape
    t = start
    while gateways > 1 and share and policy == CACHE_AWARE and t < start + (requests[-1].at if requests else 0) + 1:
        push(t, "share", None)
        t += share_every
    t = start
    while t < start + (requests[-1].at if requests else 0):
        push(t, "sample", None)
        t += 0.5
    last = start
    while events:
        at, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            send(at, requests[payload], True, payload)
            continue
        if kind == "scrape":
            for table in tables:
                for r, route in table.routes.items():
                    state = engines[r].snapshot(at)
                    route.engine = EngineReading(
                        running=state["running"], waiting=state["waiting"], kv_use=state["kv_cache_usage"],
                        backlog=state["prefill_backlog"], cache_tokens=real.BLOCKS * real.BLOCK_SIZE,
                        own_at_read=route.inflight, sent_at_read=route.sent_tokens,
                        prefilled_at_read=route.prefilled_tokens, stale_at=float("inf"))
            continue
        if kind == "share":
            for origin, replica, blocks, _ in outbox:
                for i, table in enumerate(tables):
                    if i != origin:
                        table.memories[MODEL].record(replica, blocks, table._capacity(table.routes[replica]))
            outbox.clear()
            continue
        if kind == "sample":
            for r, e in engines.items():
                outcome.queue_samples.setdefault(r, []).append(len(e.waiting))
            continue
        req = live.get(payload)
        if req is None:
            continue
        if kind == "first":
            prefilled(req)
            engines[req["replica"]].computed(req["ticket"])
            if req["measured"]:
                outcome.ttfts.append(at - req["arrival"])
            req["first"] = True
            push(at + (real.MAX_TOKENS - 1) * engines[req["replica"]].decode_step(), "done", payload)
        elif kind == "done":
            end(req, at, True)
            last = max(last, at)
        elif kind == "timeout" and not req.get("first"):
            end(req, at, False)
    outcome.elapsed = max(last, start + (requests[-1].at if requests else 0)) - start
    for r, e in engines.items():
        outcome.hits += e.prefix_hits - counters0[r][0]
        outcome.queries += e.prefix_queries - counters0[r][1]
    return outcome


def keeps_up(o: Outcome, slo: float) -> bool:
    return o.failed == 0 and o.p(90) <= slo


def capacity(kind: str, policy: str, knobs: scoring.Knobs, *, seconds: float, slo: float, seed: int) -> float:
    """bench/routing.py's ramp, in virtual time: x1.5 while it keeps up, then bisection to 10 %."""
    good, bad, rate = None, None, 0.6 * real.miss_capacity(kind)
    for step in range(12):
        warm, measured = real.workload(kind, rate=rate, seconds=seconds, arrivals_seed=seed + step, text_seed=seed)
        ok = keeps_up(simulate(measured, warm, policy, knobs), slo)
        if ok:
            good = rate if good is None else max(good, rate)
        else:
            bad = rate if bad is None else min(bad, rate)
        if good is not None and bad is not None:
            if bad / good <= 1.1:
                break
            rate = (good * bad) ** 0.5
        else:
            rate = rate * 1.5 if ok else rate / 1.5
    return good or 0.0


def row(label: str, o: Outcome) -> str:
    hit = o.hits / o.queries * 100 if o.queries else 0.0
    return (f"{label:<44} {len(o.ttfts):>5} {o.p(50) * 1000:>8.0f} {o.p(90) * 1000:>8.0f} "
            f"{o.tokens / o.elapsed if o.elapsed else 0:>7.0f} {hit:>6.0f} % {o.failed:>5} {o.queue_ratio():>6.2f}")


HEADER = f"{'':<44} {'reqs':>5} {'p50 ms':>8} {'p90 ms':>8} {'tok/s':>7} {'hit':>8} {'fail':>5} {'q max/avg':>6}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="virtual seconds of arrivals per phase")
    parser.add_argument("--slo", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=20)
    parser.add_argument("--gateways", type=int, default=1)
    parser.add_argument("--loads", default="0.8,1.6", help="arrival rates as fractions of least-outstanding's capacity")
    args = parser.parse_args()
    default = scoring.DEFAULT_KNOBS
    guards = [(8, 1.5), (4, 1.5), (2, 1.25), (8, 2.0), (16, 2.0), (1000, 1000.0)]  # the default first
    print(f"virtual time; {real.REPLICAS} sims ({PARAMS.max_num_seqs} seqs, {PARAMS.num_gpu_blocks} blocks of "
          f"{PARAMS.block_size}, {PARAMS.prefill_time_per_token * 1000:g} ms a prefill token); "
          f"{args.seconds:g} s of arrivals a phase; keeping up = no failure and TTFT p90 <= {args.slo:g} s")
    for kind in ("shared", "hot", "unique"):
        lo_cap = capacity(kind, "least-outstanding", default, seconds=20, slo=args.slo, seed=args.seed)
        ca_cap = capacity(kind, CACHE_AWARE, default, seconds=20, slo=args.slo, seed=args.seed)
        print(f"\n{kind}: capacity least-outstanding {lo_cap:.2f}/s, cache-aware {ca_cap:.2f}/s "
              f"({ca_cap / lo_cap if lo_cap else float('nan'):.2f}x)")
        print(HEADER)
        for load in (float(x) for x in args.loads.split(",")):
            rate = load * lo_cap
            warm, measured = real.workload(kind, rate=rate, seconds=args.seconds, arrivals_seed=args.seed + 1,
                                           text_seed=args.seed + 2)
            print(row(f"{load:g} x LO = {rate:.2f}/s least-outstanding",
                      simulate(measured, warm, "least-outstanding", default, gateways=args.gateways)))
            if args.gateways > 1:
                print(row("  cache-aware, memories not shared",
                          simulate(measured, warm, CACHE_AWARE, default, gateways=args.gateways, share=False)))
            for abs_, rel in guards if kind != "unique" else guards[:1]:
                for prefill_weight in (1.0, 0.0):  # the cost of step 3, llm-d's sum
                    knobs = scoring.Knobs(balance_abs=abs_, balance_rel=rel, prefill_weight=prefill_weight)
                    label = (f"  cache-aware guard {abs_}/{rel:g}"
                             + (" llm-d sum" if prefill_weight == 0 else " backlog cost"))
                    print(row(label, simulate(measured, warm, CACHE_AWARE, knobs, gateways=args.gateways)),
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
