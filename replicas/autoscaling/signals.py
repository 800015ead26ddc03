"""What the autoscaler decides from, gathered for one tick.

- The gateways' load: requests in flight and held at every gateway process,
  summed over the deployment (``replicas.hooks.gateway_load``; the gateway
  publishes each process's counts to Redis, ``gateway/load_report.py``).
- The engines' own load: their waiting queue, running requests and KV-cache
  use, by the vLLM metric names. ``engine_load`` asks a registered provider
  (``replicas.hooks.engine_load_providers``: a router that already scrapes
  the engines hands its readings over), else reads each ready replica's
  ``/metrics`` itself: bounded (a short timeout, a few at once), and only for
  models whose policy needs it.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

from agent.protocol import http_url

from .. import hooks
from ..choices import ReplicaStatus
from ..models import Member

logger = logging.getLogger(__name__)

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
SCRAPE_THREADS = 8


@dataclass(frozen=True)
class EngineLoad:
    waiting: int = 0
    running: int = 0
    kv_usage: float | None = None


def leader_urls(model_id: int) -> dict[int, str]:
    """The base URL of each ready replica's leader."""
    out = {}
    rows = Member.objects.filter(serves_http=True, replica__model_id=model_id, replica__status=ReplicaStatus.READY,
                                 replica__draining=False).values_list("replica_id", "node__mgmt_addr", "ports")
    for replica_id, addr, ports in rows:
        try:
            out[replica_id] = http_url(addr, int((ports or {}).get("http")))
        except (TypeError, ValueError):
            continue
    return out


def parse_engine_metrics(text: str) -> EngineLoad:
    """vLLM's metric names (summed over label sets, KV averaged)."""
    waiting = running = 0.0
    kv: list[float] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == WAITING:
                waiting += sample.value
            elif sample.name == RUNNING:
                running += sample.value
            elif sample.name in KV:
                kv.append(sample.value)
    return EngineLoad(waiting=int(waiting), running=int(running), kv_usage=sum(kv) / len(kv) if kv else None)


def _scrape(url: str) -> EngineLoad | None:
    try:
        response = httpx.get(url + "/metrics", timeout=settings.LLMGW_AUTOSCALE_ENGINE_TIMEOUT)
        response.raise_for_status()
        return parse_engine_metrics(response.text)
    except (httpx.HTTPError, ValueError) as exc:
        logger.debug("engine metrics unreadable url=%s: %s", url, exc)
        return None


def engine_load(replicas: dict[int, str]) -> dict[int, EngineLoad]:
    if not replicas:
        return {}
    if hooks.engine_load_providers:
        answer = hooks.engine_load_providers[0](replicas=replicas)
        return {rid: EngineLoad(int(v.get("waiting", 0)), int(v.get("running", 0)), v.get("kv_usage"))
                for rid, v in answer.items()}
    with ThreadPoolExecutor(max_workers=min(SCRAPE_THREADS, len(replicas))) as pool:
        results = dict(zip(replicas, pool.map(_scrape, replicas.values())))
    return {rid: load for rid, load in results.items() if load is not None}


def engine_totals(loads: dict[int, EngineLoad]) -> tuple[int | None, int | None, float | None]:
    """(waiting, running, mean KV use) over the replicas read; None where none was read."""
    if not loads:
        return None, None, None
    kv = [x.kv_usage for x in loads.values() if x.kv_usage is not None]
    return (sum(x.waiting for x in loads.values()), sum(x.running for x in loads.values()),
            sum(kv) / len(kv) if kv else None)
