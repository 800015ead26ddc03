"""GPU telemetry on the embedded default (no Redis): readings a heartbeat
brings to the agent API process are rows that another process reads (the
cluster page, the node page, /metrics), and the history stays an hour of
bounded rows."""

from __future__ import annotations

import json
import time

import pytest

from gateway import metrics
from gateway.selectors import cluster_gauges
from nodes import liveness, telemetry, telemetry_rows
from nodes.models import GpuReadings, GpuSample, Node
from nodes.selectors import gpu_health_list
from tests.conftest import mtls_client
from tests.factories import NodeFactory
from tests.gateway.conftest import metric_samples, sample
from tests.nodes.test_gpu_health import beat
from ui.cluster import gpu_readings
from ui.gpu_charts import node_gpu_charts


@pytest.fixture
def database_store(settings):
    settings.LLMGW_REDIS_URL = ""
    liveness.store.cache_clear()
    telemetry.store.cache_clear()
    telemetry.forget_cache()
    store = telemetry.store()
    assert isinstance(store, telemetry_rows.DatabaseTelemetry)
    yield store
    liveness.store.cache_clear()
    telemetry.store.cache_clear()
    telemetry.forget_cache()


def _block(node: str, *, util: int, health: str = "healthy", at: float | None = None) -> str:
    gpu = [0, f"GPU-{node}-0", util] + [None] * 13 + [health, ""]
    return json.dumps({"at": time.time() if at is None else at, "source": "sim", "note": "", "gpus": [gpu]})


@pytest.mark.django_db(transaction=True)
def test_readings_written_by_the_agent_api_process_reach_the_pages(
        database_store, agent_api_factory, client_cert, admin_client):
    server = agent_api_factory(LLMGW_REDIS_URL="")
    cert, key, ca = client_cert("node01")
    body = beat("node01", gpus=2, per_gpu={
        0: {"util": 42, "temp_c": 50, "power_w": 300.0, "mem_used_mib": 1000, "mem_total_mib": 143771},
        1: {"util": 7, "temp_c": 91, "thermal_throttle": True},
    })
    with mtls_client(cert, key, ca, timeout=20) as agent:
        r = agent.post(f"{server.url}/agent/v1/nodes/node01/heartbeat", json=body)
    assert r.status_code == 200, r.text

    # This process never saw the heartbeat: what it reads came through the database.
    assert set(telemetry.store().latest()) == {"node01"}
    listed = {g["index"]: g for g in gpu_health_list(node_name="node01")}
    assert (listed[0]["util"], listed[0]["health"]) == (42, "healthy")
    assert (listed[1]["util"], listed[1]["health"]) == (7, "degraded")
    assert "thermal throttling" in listed[1]["reason"]

    cells = gpu_readings()
    assert cells[("node01", 0)][:2] == (42, "healthy") and cells[("node01", 1)][:2] == (7, "degraded")
    charts, strips = node_gpu_charts("node01")
    assert [c.title for c in charts] == ["Utilisation", "Memory used", "Temperature", "Power"]
    assert (0, "42%", "l0") in charts[0].latest and strips

    page = admin_client.get("/nodes/node01/").content.decode()
    assert "GPU 0: 42%" in page and "No readings in the last hour" not in page
    grid = admin_client.get("/").content.decode()
    assert "degraded" in grid and "thermal throttling" in grid

    samples = metric_samples(metrics.render(cluster_gauges()).decode())
    assert sample(samples, "DCGM_FI_DEV_GPU_UTIL", node="node01", index="0", uuid="GPU-node01-0") == 42
    assert sample(samples, "llmgw_gpu_health", node="node01", index="1", uuid="GPU-node01-1", health="degraded") == 1


@pytest.mark.django_db
def test_the_history_is_an_hour_of_bounded_rows(database_store, settings):
    settings.LLMGW_GPU_HISTORY_STEP = 60.0
    NodeFactory(name="node01")
    now = time.time()
    for minute in range(180, -1, -1):  # three hours of samples, a minute apart, oldest first
        at = round(now - minute * 60)
        database_store.put("node01", _block("node01", util=minute % 100, at=at),
                           json.dumps([at, [[0, minute % 100, 1000, 50, 300.0, 0]]]))
    assert GpuSample.objects.filter(node_id="node01").count() == 60
    history = database_store.history("node01")
    assert [at for at, _ in history] == sorted(at for at, _ in history)
    assert now - 3600 <= history[0][0] and history[-1][1][0][1] == 0  # the newest sample is the last written
    assert len(history) == 60
    assert GpuReadings.objects.count() == 1


@pytest.mark.django_db
def test_the_latest_block_is_written_at_a_bounded_rate_unless_health_changed(database_store):
    NodeFactory(name="node01")
    database_store.put("node01", _block("node01", util=10), None)
    database_store.put("node01", _block("node01", util=20), None)  # within LATEST_EVERY, nothing new
    assert database_store.latest("node01")["node01"]["gpus"][0][2] == 10
    database_store.put("node01", _block("node01", util=30, health="degraded"), None)
    assert database_store.latest("node01")["node01"]["gpus"][0][2] == 30
    database_store._written["node01"] = (time.monotonic() - telemetry_rows.LATEST_EVERY, ["degraded"])
    database_store.put("node01", _block("node01", util=40, health="degraded"), None)
    assert database_store.latest("node01")["node01"]["gpus"][0][2] == 40


@pytest.mark.django_db
def test_a_deleted_node_leaves_no_readings(database_store):
    NodeFactory(name="node01")
    at = round(time.time())
    database_store.put("node01", _block("node01", util=10, at=at), json.dumps([at, [[0, 10, 1, 1, 1.0, 0]]]))
    assert GpuReadings.objects.exists() and GpuSample.objects.exists()
    Node.objects.filter(name="node01").delete()
    assert not GpuReadings.objects.exists() and not GpuSample.objects.exists()
    assert database_store.latest() == {} and database_store.history("node01") == []


@pytest.mark.django_db(transaction=True)
def test_readings_of_a_node_the_database_does_not_know_are_dropped(database_store):
    database_store.put("ghost", _block("ghost", util=10), None)
    assert database_store.latest() == {}
