"""/metrics exports the autoscaler's signals and decisions."""

from __future__ import annotations

import time

import pytest

from gateway import metrics, selectors
from replicas.autoscaling import history
from replicas.catalog import catalog_apply

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_reconcile_enqueue")]


@pytest.fixture
def store():
    store = history.store()
    store.client.delete(history.KEY.format("qwen"), history.DECISIONS_KEY)
    yield store
    store.client.delete(history.KEY.format("qwen"), history.DECISIONS_KEY)


def test_signals_and_decisions_on_metrics(store):
    catalog_apply(entries=[{"name": "qwen", "engine": "sim", "model": "/m", "replicas": 2,
                            "autoscale": {"min": 1, "max": 5, "target": 4}}])
    store.append("qwen", {"at": time.time(), "load": 11.0, "recommended": 3, "busy": 11, "wanted": 2, "ready": 2,
                          "inflight": 9, "held": 2, "engine_waiting": None, "kv_usage": None, "rule": "up-pending",
                          "to": None})
    store.count_decision("qwen", "up")
    store.count_decision("qwen", "up")
    text = metrics.render(selectors.cluster_gauges()).decode()
    assert 'llmgw_autoscale_replicas{kind="recommended",model="qwen"} 3.0' in text
    assert 'llmgw_autoscale_replicas{kind="max",model="qwen"} 5.0' in text
    assert 'llmgw_autoscale_requests{model="qwen",state="held"} 2.0' in text
    assert 'llmgw_autoscale_load{kind="value",metric="requests",model="qwen"} 11.0' in text
    assert 'llmgw_autoscale_decisions_total{model="qwen",rule="up"} 2.0' in text
