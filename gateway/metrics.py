"""The gateway's Prometheus metrics, summed over the web processes of a machine.

Each web process counts into files under ``settings.LLMGW_METRICS_DIR``
(prometheus_client's multiprocess mode; settings point
``PROMETHEUS_MULTIPROC_DIR`` there), so a scrape of any one process sees the
requests of all of them. The cluster's figures (replicas, nodes, GPUs) are
read from the database at scrape time and added by ``ClusterCollector``.

The files of a process that is gone: its in-flight gauge leaves the sum at the
next scrape; its counters stay until a web process starts (then they go, as
they would when the whole server restarts: Prometheus reads a counter reset).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from prometheus_client import CollectorRegistry, values, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from .autoscale_metrics import autoscale_families

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _pid_of(path: Path) -> int | None:
    try:
        return int(path.stem.rsplit("_", 1)[1])
    except (IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_directory(directory: Path) -> None:
    """Before this process counts anything: drop the files of processes that
    are gone, and any left under this process's pid by an earlier one."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    me = os.getpid()
    for path in directory.glob("*.db"):
        pid = _pid_of(path)
        if pid is not None and (pid == me or not _alive(pid)):
            path.unlink(missing_ok=True)


METRICS_DIR = Path(settings.LLMGW_METRICS_DIR)
if os.environ.get("PROMETHEUS_MULTIPROC_DIR") != str(METRICS_DIR) or values.ValueClass is values.MutexValue:
    # Values would stay in this process: a scrape would see one web process of several.
    raise ImproperlyConfigured("prometheus_client was imported before llmgw's settings set PROMETHEUS_MULTIPROC_DIR")
_clean_directory(METRICS_DIR)

_ROUTE = ("model", "replica")
REQUESTS = Counter("llmgw_gateway_requests_total", "Requests answered by the gateway.",
                   ("model", "replica", "endpoint", "code"))
ERRORS = Counter("llmgw_gateway_errors_total", "Requests that failed, by reason.", ("model", "kind"))
RETRIES = Counter("llmgw_gateway_retries_total",
                  "Requests retried on another replica after a failed connection.", ("model",))
LATENCY = Histogram("llmgw_gateway_request_duration_seconds", "Time from request to last byte, by model and replica.",
                    _ROUTE, buckets=LATENCY_BUCKETS)
TTFT = Histogram("llmgw_gateway_time_to_first_token_seconds", "Time from request to first streamed chunk.",
                 _ROUTE, buckets=TTFT_BUCKETS)
DECISIONS = Counter(
    "llmgw_gateway_routing_decisions_total",
    "Routing decisions of the cache-aware and session policies, by reason: prefix (sent where the longest "
    "prefix is cached), load (no prefix cached anywhere, or it lost on load), guard (the prefix's holder was "
    "overloaded: a fallback to load), session (a session on its replica), rehome (a session moved).",
    ("model", "policy", "reason"))
ENGINE_READS = Counter("llmgw_gateway_engine_metrics_reads_total",
                       "Reads of engines' /metrics by the gateway, by outcome (ok, failed).", ("outcome",))
INFLIGHT = Gauge("llmgw_gateway_inflight_requests", "Requests in flight through the gateway, by replica.",
                 _ROUTE, multiprocess_mode="livesum")


class GatewayMetrics:
    """What the request path records. Each metric's child per label values is looked up once and kept:
    prometheus_client's ``labels()`` (a lock, the labels' checks) cost more than the write itself, on every
    request. The label values are bounded (models, replicas, endpoints, status codes), and the library keeps
    every child it made anyway."""

    def __init__(self) -> None:
        self._requests: dict[tuple, Any] = {}
        self._latency: dict[tuple, Any] = {}

    def request(self, model: str, replica: str, endpoint: str, code: int) -> None:
        labels = (model, replica, endpoint, code)
        child = self._requests.get(labels)
        if child is None:
            child = self._requests[labels] = REQUESTS.labels(model, replica, endpoint, str(code))
        child.inc()

    def error(self, model: str, kind: str) -> None:
        ERRORS.labels(model, kind).inc()

    def retry(self, model: str) -> None:
        RETRIES.labels(model).inc()

    def latency(self, model: str, replica: str, seconds: float) -> None:
        labels = (model, replica)
        child = self._latency.get(labels)
        if child is None:
            child = self._latency[labels] = LATENCY.labels(model, replica)
        child.observe(seconds)

    def ttft(self, model: str, replica: str, seconds: float) -> None:
        TTFT.labels(model, replica).observe(seconds)

    def decisions(self, counts: dict[tuple[str, str], int], policies: dict[str, str]) -> None:
        for (model, reason), count in counts.items():
            DECISIONS.labels(model, policies.get(model, ""), reason).inc(count)

    def engine_reads(self, ok: int, failed: int) -> None:
        if ok:
            ENGINE_READS.labels("ok").inc(ok)
        if failed:
            ENGINE_READS.labels("failed").inc(failed)


class ClusterCollector:
    """The cluster's figures, from ``gateway.selectors.cluster_gauges`` read for this scrape."""

    def __init__(self, cluster: dict[str, Any]) -> None:
        self.cluster = cluster

    def collect(self):
        cluster = self.cluster
        replicas = GaugeMetricFamily("llmgw_replicas", "Replicas by model and status.", labels=("model", "status"))
        for model in sorted({m for m, _ in cluster["replicas"]}):
            for status in cluster["replica_statuses"]:
                replicas.add_metric((model, status), cluster["replicas"].get((model, status), 0))
        yield replicas
        nodes = GaugeMetricFamily("llmgw_nodes", "Nodes by status.", labels=("status",))
        for status, count in sorted(cluster["nodes"].items()):
            nodes.add_metric((status,), count)
        yield nodes
        ages = GaugeMetricFamily("llmgw_node_heartbeat_age_seconds", "Seconds since each node's last heartbeat.",
                                 labels=("node",))
        for node, age in sorted(cluster["node_heartbeat_age"].items()):
            if age is not None:
                ages.add_metric((node,), round(age, 3))
        yield ages
        gpus = GaugeMetricFamily("llmgw_gpus", "GPUs by node: allocated to replicas, free, or unavailable "
                                 "(on a lost node).", labels=("node", "state"))
        for node, (allocated, free, unavailable) in sorted(cluster["gpus"].items()):
            gpus.add_metric((node, "allocated"), allocated)
            gpus.add_metric((node, "free"), free)
            gpus.add_metric((node, "unavailable"), unavailable)
        yield gpus
        yield GaugeMetricFamily("llmgw_gpus_allocated", "GPUs allocated to replicas, cluster-wide.",
                                value=sum(a for a, _, _ in cluster["gpus"].values()))
        yield GaugeMetricFamily("llmgw_gpus_free", "GPUs not allocated, on nodes that are not lost, cluster-wide.",
                                value=sum(f for _, f, _ in cluster["gpus"].values()))
        yield from autoscale_families(cluster.get("autoscale"))
        yield from gpu_families(cluster.get("gpu_health", []))
        yield from _weights_families(cluster)


# Per-GPU gauges under DCGM exporter's names (so existing boards adapt), each
# labelled node, index, uuid; a value a GPU did not report is left out, never 0.
DCGM_GAUGES = (
    ("DCGM_FI_DEV_GPU_UTIL", "util", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "mem_util", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_FB_USED", "mem_used_mib", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_FB_FREE", "fb_free", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_GPU_TEMP", "temp_c", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "power_w", "Power draw (in W)."),
    ("DCGM_FI_DEV_POWER_MGMT_LIMIT", "power_limit_w", "Power management limit (in W)."),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "ecc_corrected", "Corrected (single-bit) ECC errors since the driver loaded."),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "ecc_uncorrected",
     "Uncorrectable (double-bit) ECC errors since the driver loaded."),
    ("DCGM_FI_DEV_ROW_REMAP_PENDING", "pending_retirement", "Retired pages or remapped rows pending a reset (1)."),
    ("DCGM_FI_DEV_XID_ERRORS", "last_xid", "Value of the last Xid error the GPU reported."),
)
HEALTH_STATES = ("healthy", "degraded", "quarantined", "unknown")


def gpu_families(rows: list[dict[str, Any]]):
    """The per-GPU families, from ``nodes.selectors.gpu_health_list``'s rows."""
    families = {name: GaugeMetricFamily(name, text, labels=("node", "index", "uuid")) for name, _, text in DCGM_GAUGES}
    health = GaugeMetricFamily("llmgw_gpu_health", "Each GPU's health (1 for its state): quarantined GPUs take "
                               "no work until an operator clears them.", labels=("node", "index", "uuid", "health"))
    for row in rows:
        labels = (row["node"], str(row["index"]), row["uuid"])
        values = dict(row)
        if row.get("mem_total_mib") is not None and row.get("mem_used_mib") is not None:
            values["fb_free"] = row["mem_total_mib"] - row["mem_used_mib"]
        for name, key, _ in DCGM_GAUGES:
            value = values.get(key)
            if value is not None:
                families[name].add_metric(labels, float(value))
        for state in HEALTH_STATES:
            health.add_metric((*labels, state), 1.0 if row["health"] == state else 0.0)
    yield from families.values()
    yield health


def _weights_families(cluster: dict[str, Any]):
    """The nodes' weights caches (docs/weights.md), for nodes that keep one."""
    free = cluster.get("weights_free", {})
    for name, key, doc in (
        ("llmgw_weights_cached_bytes", "weights_cached", "Bytes of verified model weights each node's cache holds."),
        ("llmgw_weights_downloads", "weights_fetching", "Model revisions each node is fetching now."),
        ("llmgw_weights_cache_free_bytes", "weights_free", "Free space of each node's weights cache."),
    ):
        family = GaugeMetricFamily(name, doc, labels=("node",))
        for node in sorted(set(free) | set(cluster.get(key, {}))):
            family.add_metric((node,), cluster.get(key, {}).get(node, 0))
        yield family


def _forget_dead_gauges() -> None:
    for pid in {_pid_of(p) for p in METRICS_DIR.glob("gauge_live*.db")}:
        if pid is not None and not _alive(pid):
            mark_process_dead(pid, str(METRICS_DIR))


def render(cluster: dict[str, Any] | None) -> bytes:
    """The whole /metrics page: the gateway's figures from every web process, then the cluster's."""
    _forget_dead_gauges()
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(METRICS_DIR))
    if cluster is not None:
        registry.register(ClusterCollector(cluster))
    return generate_latest(registry)
