"""Autoscaling on /metrics: each autoscaled model's latest signals (the
sample of the autoscaler's last look), its bounds, and the decisions made,
by rule. Read at scrape time from the autoscaler's history store (Redis)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from replicas.autoscaling import history
from replicas.autoscaling.selectors import autoscaled_policies

# A sample older than this is not "now" (beat stopped): not exported.
FRESH_FOR = 60.0


def autoscale_gauges() -> dict[str, Any]:
    store = history.store()
    now = time.time()
    models = {}
    for name, policy in autoscaled_policies().items():
        recent = store.read(name, since=now - FRESH_FOR, limit=1)
        models[name] = {"policy": policy, "sample": recent[-1] if recent else None}
    return {"models": models, "decisions": store.decisions()}


def autoscale_families(data: dict[str, Any] | None):
    if not data:
        return
    replicas = GaugeMetricFamily("llmgw_autoscale_replicas", "Autoscaled models: replicas wanted, ready and "
                                 "recommended at the autoscaler's last look; the policy's min and max.",
                                 labels=("model", "kind"))
    requests = GaugeMetricFamily("llmgw_autoscale_requests", "Requests in flight and held for the model at every "
                                 "gateway process, summed (the autoscaler's signal).", labels=("model", "state"))
    load = GaugeMetricFamily("llmgw_autoscale_load", "The policy's metric at the last look, and its target.",
                             labels=("model", "metric", "kind"))
    engines = GaugeMetricFamily("llmgw_autoscale_engine_waiting", "Requests waiting in the engines' queues "
                                "(read when the policy's metric needs it).", labels=("model",))
    kv = GaugeMetricFamily("llmgw_autoscale_kv_usage", "Mean KV-cache use of the ready replicas (read when the "
                           "policy's metric needs it).", labels=("model",))
    for name, entry in sorted(data["models"].items()):
        policy, sample = entry["policy"], entry["sample"]
        replicas.add_metric((name, "min"), policy.min)
        replicas.add_metric((name, "max"), policy.max)
        load.add_metric((name, policy.metric, "target"), policy.target)
        if sample is None:
            continue
        for kind in ("wanted", "ready", "recommended"):
            replicas.add_metric((name, kind), sample.get(kind, 0))
        requests.add_metric((name, "inflight"), sample.get("inflight", 0))
        requests.add_metric((name, "held"), sample.get("held", 0))
        load.add_metric((name, policy.metric, "value"), sample.get("load", 0))
        if sample.get("engine_waiting") is not None:
            engines.add_metric((name,), sample["engine_waiting"])
        if sample.get("kv_usage") is not None:
            kv.add_metric((name,), sample["kv_usage"])
    decisions = CounterMetricFamily("llmgw_autoscale_decisions", "Changes the autoscaler made, by model and rule "
                                    "(up, down, zero, wake, bounds).", labels=("model", "rule"))
    for (model, rule), count in sorted(data["decisions"].items()):
        decisions.add_metric((model, rule), count)
    yield from (replicas, requests, load, engines, kv, decisions)
