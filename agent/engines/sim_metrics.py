"""The simulated engine's ``GET /metrics``: what it models, under vLLM's names.

One ``CollectorRegistry`` per engine (never the process-wide default), with
one collector: the gauges and counters are read from the engine's state at
each scrape, the histograms are kept here as requests go. (Not
``prometheus_client.Histogram``: its values follow
``PROMETHEUS_MULTIPROC_DIR``, which an engine may inherit from whoever
started it, and would then be written to files meant for other processes.) Labels as vLLM's V1 engine sets
them: ``model_name`` (the served model name) and ``engine`` (the engine
core's index, always ``"0"`` here).

- ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (gauges)
- ``vllm:kv_cache_usage_perc`` (gauge, 0..1: blocks held by requests / all blocks)
- ``llmgw:prefill_backlog_tokens`` (gauge, not a vLLM series: the prompt
  tokens still to prefill, of admitted requests the prefill lane has not
  finished and of waiting ones less what the cache holds for them; what
  Dynamo's KV router calls a worker's prefill blocks, in tokens)
- ``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``
  (counters, in prompt tokens: queried, and found cached)
- ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
  ``vllm:request_success_total`` (counters)
- ``vllm:time_to_first_token_seconds``, ``vllm:request_queue_time_seconds``,
  ``vllm:e2e_request_latency_seconds`` (histograms, vLLM's buckets)
- ``vllm:cache_config_info`` (gauge 1, the cache's shape in labels:
  ``block_size``, ``num_gpu_blocks``, ``enable_prefix_caching``), as vLLM
  publishes its CacheConfig
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

if TYPE_CHECKING:
    from .sim_model import SimEngine, Ticket

__all__ = ["CONTENT_TYPE_LATEST", "SimMetrics"]

LABELS = ("model_name", "engine")
# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.buckets = name, doc, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self.sum = 0.0
        self.lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self.lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value

    def family(self, labels: list[str]) -> HistogramMetricFamily:
        with self.lock:
            counts, total = list(self.counts), self.sum
        cumulative, running = [], 0
        for bound, count in zip([*map(str, self.buckets), "+Inf"], counts):
            running += count
            cumulative.append((bound, running))
        family = HistogramMetricFamily(self.name, self.doc, labels=LABELS)
        family.add_metric(labels, cumulative, sum_value=total)
        return family


class _EngineState:
    """Gauges and counters read from the engine at each scrape."""

    def __init__(self, model: str, engine: "SimEngine", histograms: list[Histogram]) -> None:
        self.labels = [model, "0"]
        self.engine = engine
        self.histograms = histograms

    def collect(self):
        state = self.engine.snapshot(time.monotonic())  # the clock the HTTP layer drives the engine with
        params = self.engine.params

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self.labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self.labels, value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", state["running"])
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", state["waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", state["kv_cache_usage"])
        yield gauge("llmgw:prefill_backlog_tokens",
                    "Prompt tokens waiting for prefill (admitted and queued requests, less what the cache holds).",
                    state["prefill_backlog"])
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      state["prefix_queries"])
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      state["prefix_hits"])
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", state["prompt_tokens"])
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", state["generation_tokens"])
        yield counter("vllm:request_success", "Count of successfully processed requests.", state["finished"])
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=("block_size", "enable_prefix_caching", "num_gpu_blocks"))
        info.add_metric([str(params.block_size), str(params.enable_prefix_caching), str(params.num_gpu_blocks)], 1)
        yield info
        for histogram in self.histograms:
            yield histogram.family(self.labels)


class SimMetrics:
    def __init__(self, model: str, engine: "SimEngine") -> None:
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineState(model, engine, [self.ttft, self.queue_time, self.e2e]))

    def admitted(self, ticket: "Ticket") -> None:
        self.ttft.observe(ticket.ttft)
        self.queue_time.observe(ticket.queue_time)

    def finished(self, seconds: float) -> None:
        self.e2e.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
