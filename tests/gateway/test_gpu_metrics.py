"""Per-GPU gauges on /metrics under DCGM exporter's names, and each GPU's health."""

from __future__ import annotations

import pytest

from gateway import metrics
from gateway.selectors import cluster_gauges
from nodes import telemetry
from tests.agent_view import peer_for, send_heartbeat
from tests.nodes.test_gpu_health import beat

from .conftest import metric_samples, sample

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_reconcile_enqueue", "pki_dir")]


@pytest.fixture(autouse=True)
def _fresh_telemetry():
    telemetry.store.cache_clear()
    telemetry.forget_cache()
    yield
    telemetry.store.cache_clear()


def test_gpu_gauges_follow_the_readings_and_leave_out_what_was_not_read():
    node = peer_for("node01")
    status, reply = send_heartbeat(node, "node01", beat("node01", gpus=3, per_gpu={
        0: {"util": 55, "temp_c": 66, "power_w": 321.5, "mem_used_mib": 1000, "mem_total_mib": 143771},
        1: {"xids": [95], "last_xid": 95, "ecc_uncorrected": 1},
        2: {"temp_c": None, "power_w": None, "thermal_throttle": True},
    }))
    assert status == 200, reply
    samples = metric_samples(metrics.render(cluster_gauges()).decode())
    gpu0 = {"node": "node01", "index": "0", "uuid": "GPU-node01-0"}
    assert sample(samples, "DCGM_FI_DEV_GPU_UTIL", **gpu0) == 55
    assert sample(samples, "DCGM_FI_DEV_GPU_TEMP", **gpu0) == 66
    assert sample(samples, "DCGM_FI_DEV_POWER_USAGE", **gpu0) == 321.5
    assert sample(samples, "DCGM_FI_DEV_FB_USED", **gpu0) == 1000
    assert sample(samples, "DCGM_FI_DEV_FB_FREE", **gpu0) == 143771 - 1000
    assert sample(samples, "llmgw_gpu_health", **gpu0, health="healthy") == 1
    gpu1 = {"node": "node01", "index": "1", "uuid": "GPU-node01-1"}
    assert sample(samples, "DCGM_FI_DEV_XID_ERRORS", **gpu1) == 95
    assert sample(samples, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", **gpu1) == 1
    assert sample(samples, "llmgw_gpu_health", **gpu1, health="quarantined") == 1
    assert sample(samples, "llmgw_gpu_health", **gpu1, health="healthy") == 0
    gpu2 = {"node": "node01", "index": "2", "uuid": "GPU-node01-2"}
    assert sample(samples, "llmgw_gpu_health", **gpu2, health="degraded") == 1
    # Not read is not zero: the gauge is absent.
    assert ("DCGM_FI_DEV_GPU_TEMP", frozenset(gpu2.items())) not in samples
    assert ("DCGM_FI_DEV_POWER_USAGE", frozenset(gpu2.items())) not in samples
