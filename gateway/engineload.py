"""Engine load from the engines' own Prometheus /metrics, as vLLM names it.

Each web process reads the leader of every replica in its routing table at a
bounded rate (``LLMGW_GATEWAY_ENGINE_SCRAPES_PER_SECOND``): with few replicas
every ``LLMGW_GATEWAY_ENGINE_SCRAPE_INTERVAL``, with many as often as the rate
allows, spread over time rather than in bursts. A reading is what the
routing policies weigh (requests running and waiting, KV-cache use) and what
the UI's replica page shows (with the prefix-cache hit rate); a replica whose
metrics cannot be read is routed on this process's own counts, never dropped.

The parse picks only the few series it needs with one regular expression
(the full Prometheus text parser costs far more on a vLLM page).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from dataclasses import asdict, dataclass

import aiohttp

logger = logging.getLogger(__name__)

REDIS_KEY = "llmgw:gateway:engines"
# Tick of the spread-out scraping (seconds): each tick reads rate x tick replicas.
TICK = 0.1

# This process's last readings, by replica id (what the UI shows when there is no Redis).
LATEST: dict[int, "EngineReading"] = {}

_CONFIG = b"vllm:cache_config_info"


@dataclass(slots=True)
class EngineReading:
    """One replica's engine, as its last /metrics read said (None: not there or unread)."""

    running: int | None = None
    waiting: int | None = None
    kv_use: float | None = None  # 0..1
    prefix_queries: float | None = None  # tokens, since the engine started
    prefix_hits: float | None = None
    cache_tokens: int | None = None  # num_gpu_blocks x block_size
    # Prompt tokens waiting for prefill (llmgw:prefill_backlog_tokens; the sim publishes it, vLLM does not).
    backlog: int | None = None
    own_at_read: int = 0  # the reading gateway's requests in flight there when it answered
    sent_at_read: int = 0  # the reading gateway's prompt tokens sent there (Route.sent_tokens) when it answered
    prefilled_at_read: int = 0  # and of those, answered since they were sent (Route.prefilled_tokens)
    at: float = 0.0  # wall clock
    stale_at: float = 0.0  # monotonic: routed on until then
    error: str = ""

    @property
    def fresh(self) -> bool:
        return not self.error and time.monotonic() < self.stale_at

    @property
    def hit_rate(self) -> float | None:
        if not self.prefix_queries or self.prefix_hits is None:
            return None
        return self.prefix_hits / self.prefix_queries

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("stale_at")
        return json.dumps(data)


def _label(labels: bytes, name: bytes) -> bytes | None:
    start = labels.find(name + b'="')
    if start < 0:
        return None
    start += len(name) + 2
    return labels[start:labels.find(b'"', start)]


_SERIES = re.compile(
    rb"\n(vllm:(?:num_requests_running|num_requests_waiting|kv_cache_usage_perc|gpu_cache_usage_perc"
    rb"|(?:gpu_)?prefix_cache_queries_total|(?:gpu_)?prefix_cache_hits_total|cache_config_info)"
    rb"|llmgw:prefill_backlog_tokens)"
    rb"(\{[^}\n]*\})? (\S+)")
_KIND = {b"vllm:num_requests_running": "running", b"vllm:num_requests_waiting": "waiting",
         b"vllm:kv_cache_usage_perc": "kv", b"vllm:gpu_cache_usage_perc": "kv",
         b"vllm:prefix_cache_queries_total": "queries", b"vllm:gpu_prefix_cache_queries_total": "queries",
         b"vllm:prefix_cache_hits_total": "hits", b"vllm:gpu_prefix_cache_hits_total": "hits",
         b"llmgw:prefill_backlog_tokens": "backlog"}


def parse(text: bytes) -> EngineReading:
    """The reading from a /metrics page; series summed over their labels
    (one engine may report per model name). Raises ValueError on a page with
    none of vLLM's load series (not a vLLM-compatible engine)."""
    sums: dict[str, float] = {}
    cache_tokens = None
    for name, labels, value in _SERIES.findall(b"\n" + text):
        if name == _CONFIG:
            blocks, size = _label(labels, b"num_gpu_blocks"), _label(labels, b"block_size")
            try:
                cache_tokens = int(blocks) * int(size) if blocks and size else None
            except ValueError:
                cache_tokens = None
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        if not math.isnan(number):
            kind = _KIND[name]
            sums[kind] = sums.get(kind, 0.0) + number
    if not sums:
        raise ValueError("no vllm:num_requests_* or cache series on the page")
    running, waiting, kv, backlog = sums.get("running"), sums.get("waiting"), sums.get("kv"), sums.get("backlog")
    return EngineReading(
        running=int(running) if running is not None else None,
        waiting=int(waiting) if waiting is not None else None,
        kv_use=min(1.0, max(0.0, kv)) if kv is not None else None,
        prefix_queries=sums.get("queries"), prefix_hits=sums.get("hits"), cache_tokens=cache_tokens,
        backlog=max(0, int(backlog)) if backlog is not None else None,
    )


class EngineScraper:
    """Reads every routed replica's /metrics, ``per_second`` at most, each
    replica at most once per ``interval``."""

    def __init__(self, *, interval: float, per_second: float, timeout: float, publish=None) -> None:
        self.interval = interval
        self.per_second = per_second
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.publish = publish  # callable(dict replica id -> EngineReading), run off the loop
        self.cycles = 0
        self.reads = 0
        self.failures = 0

    def period(self, replicas: int) -> float:
        """Seconds between two readings of one replica."""
        return max(self.interval, replicas / self.per_second if self.per_second > 0 else self.interval)

    async def cycle(self, session: aiohttp.ClientSession, routes: list) -> dict[int, EngineReading]:
        """One reading of each route, spread over ``period``; the readings set on the routes."""
        started = time.monotonic()
        period = self.period(len(routes))
        # Routed on for three periods: one missed reading does not fall back to the gateway's counts.
        stale_after = 3 * period
        per_tick = max(1, math.ceil(self.per_second * TICK)) if self.per_second > 0 else len(routes) or 1
        readings: dict[int, EngineReading] = {}
        for offset in range(0, len(routes), per_tick):
            batch = routes[offset:offset + per_tick]
            results = await asyncio.gather(*(self._read(session, r) for r in batch))
            for route, reading in zip(batch, results):
                reading.stale_at = time.monotonic() + stale_after
                reading.own_at_read = route.inflight
                reading.sent_at_read = route.sent_tokens
                reading.prefilled_at_read = route.prefilled_tokens
                route.engine = reading
                readings[route.replica_id] = reading
                LATEST[route.replica_id] = reading
            if offset + per_tick < len(routes):
                await asyncio.sleep(max(0.0, started + (offset + per_tick) / self.per_second - time.monotonic()))
        self.cycles += 1
        for gone in set(LATEST) - {r.replica_id for r in routes}:
            del LATEST[gone]
        return readings

    async def _read(self, session: aiohttp.ClientSession, route) -> EngineReading:
        self.reads += 1
        try:
            async with session.get(route.url("/metrics"), timeout=self.timeout) as response:
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                reading = parse(await response.read())
        except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as exc:
            self.failures += 1
            return EngineReading(at=time.time(), error=f"{type(exc).__name__}: {exc}"[:200])
        reading.at = time.time()
        return reading
