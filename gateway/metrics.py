"""Prometheus metrics of one gateway process, and the text exposition of
/metrics (format 0.0.4, written by hand: a few counters and histograms do
not need a client library on the request path)."""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    __slots__ = ("buckets", "series")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.series: dict[tuple[str, ...], list] = {}  # labels -> [bucket counts..., sum, count]

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        row = self.series.get(labels)
        if row is None:
            row = self.series[labels] = [0] * (len(self.buckets) + 1) + [0.0, 0]
        row[bisect_left(self.buckets, value)] += 1
        row[-2] += value
        row[-1] += 1


class GatewayMetrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str, str], int] = {}  # (model, replica, endpoint, code)
        self.errors: dict[tuple[str, str], int] = {}  # (model, kind)
        self.latency = Histogram(LATENCY_BUCKETS)  # (model, replica)
        self.ttft = Histogram(TTFT_BUCKETS)  # (model, replica)
        self.retries: dict[str, int] = {}  # model

    def request(self, model: str, replica: str, endpoint: str, code: int) -> None:
        labels = (model, replica, endpoint, str(code))
        self.requests[labels] = self.requests.get(labels, 0) + 1

    def error(self, model: str, kind: str) -> None:
        labels = (model, kind)
        self.errors[labels] = self.errors.get(labels, 0) + 1

    def retry(self, model: str) -> None:
        self.retries[model] = self.retries.get(model, 0) + 1


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple, extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


class Exposition:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, names: tuple[str, ...], values: tuple, value: float, extra: str = "") -> None:
        self.lines.append(f"{name}{_labels(names, values, extra)} {_number(value)}")

    def histogram(self, name: str, help_text: str, names: tuple[str, ...], histogram: Histogram) -> None:
        self.family(name, "histogram", help_text)
        for values, row in sorted(histogram.series.items()):
            cumulative = 0
            for bound, count in zip(histogram.buckets, row):
                cumulative += count
                self.sample(f"{name}_bucket", names, values, cumulative, f'le="{bound:g}"')
            self.sample(f"{name}_bucket", names, values, row[-1], 'le="+Inf"')
            self.sample(f"{name}_sum", names, values, row[-2])
            self.sample(f"{name}_count", names, values, row[-1])

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(metrics: GatewayMetrics, inflight: dict[int, tuple[str, int]], cluster: dict[str, Any] | None) -> str:
    """The whole /metrics page: this process's gateway figures, then the cluster's."""
    out = Exposition()
    out.family("llmgw_gateway_requests_total", "counter", "Requests answered by this gateway process.")
    for values, count in sorted(metrics.requests.items()):
        out.sample("llmgw_gateway_requests_total", ("model", "replica", "endpoint", "code"), values, count)
    out.family("llmgw_gateway_errors_total", "counter", "Requests that failed, by reason.")
    for values, count in sorted(metrics.errors.items()):
        out.sample("llmgw_gateway_errors_total", ("model", "kind"), values, count)
    out.family("llmgw_gateway_retries_total", "counter", "Requests retried on another replica after a failed connection.")
    for model, count in sorted(metrics.retries.items()):
        out.sample("llmgw_gateway_retries_total", ("model",), (model,), count)
    out.histogram("llmgw_gateway_request_duration_seconds", "Time from request to last byte, by model and replica.",
                  ("model", "replica"), metrics.latency)
    out.histogram("llmgw_gateway_time_to_first_token_seconds", "Time from request to first streamed chunk.",
                  ("model", "replica"), metrics.ttft)
    out.family("llmgw_gateway_inflight_requests", "gauge", "Requests in flight from this process, by replica.")
    for replica_id, (model, count) in sorted(inflight.items()):
        out.sample("llmgw_gateway_inflight_requests", ("model", "replica"), (model, replica_id), count)
    if cluster is None:
        return out.text()
    out.family("llmgw_replicas", "gauge", "Replicas by model and status.")
    models = sorted({m for m, _ in cluster["replicas"]})
    for model in models:
        for status in cluster["replica_statuses"]:
            out.sample("llmgw_replicas", ("model", "status"), (model, status), cluster["replicas"].get((model, status), 0))
    out.family("llmgw_nodes", "gauge", "Nodes by status.")
    for status, count in sorted(cluster["nodes"].items()):
        out.sample("llmgw_nodes", ("status",), (status,), count)
    out.family("llmgw_node_heartbeat_age_seconds", "gauge", "Seconds since each node's last heartbeat.")
    for node, age in sorted(cluster["node_heartbeat_age"].items()):
        if age is not None:
            out.sample("llmgw_node_heartbeat_age_seconds", ("node",), (node,), round(age, 3))
    out.family("llmgw_gpus", "gauge", "GPUs by node, allocated to replicas or free.")
    for node, (allocated, free) in sorted(cluster["gpus"].items()):
        out.sample("llmgw_gpus", ("node", "state"), (node, "allocated"), allocated)
        out.sample("llmgw_gpus", ("node", "state"), (node, "free"), free)
    total_allocated = sum(a for a, _ in cluster["gpus"].values())
    total_free = sum(f for _, f in cluster["gpus"].values())
    out.family("llmgw_gpus_allocated", "gauge", "GPUs allocated to replicas, cluster-wide.")
    out.sample("llmgw_gpus_allocated", (), (), total_allocated)
    out.family("llmgw_gpus_free", "gauge", "GPUs not allocated, cluster-wide.")
    out.sample("llmgw_gpus_free", (), (), total_free)
    return out.text()
