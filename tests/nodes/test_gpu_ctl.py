"""``llmgw ctl gpus`` against a real web process: health, the last Xid, readings; ``clear``."""

from __future__ import annotations

import json

import pytest

from core.models import Event
from nodes import liveness, telemetry
from nodes.choices import GpuFault, NodeEventKind
from nodes.gpus import gpus_judged
from nodes.models import Gpu
from tests.conftest import server_env
from tests.factories import GpuFactory, NodeFactory
from tests.test_ctl_rest import run

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(params=["redis", "database"])
def ctl_env(request, settings, web_factory, admin_token, tmp_path):
    """The web process reads the readings from Redis, or (the embedded default) from the database."""
    web_env = {}
    if request.param == "database":
        settings.LLMGW_REDIS_URL = web_env["LLMGW_REDIS_URL"] = ""
    liveness.store.cache_clear()
    telemetry.store.cache_clear()
    telemetry.forget_cache()
    yield server_env(LLMGW_URL=web_factory(**web_env).url, LLMGW_TOKEN=admin_token,
                     LLMGW_DATA_DIR=str(tmp_path / "nowhere"))
    liveness.store.cache_clear()
    telemetry.store.cache_clear()


def test_ctl_gpus_lists_health_and_clears_a_quarantine(ctl_env):
    node = NodeFactory(name="node01")
    for i in range(2):
        GpuFactory(node=node, index=i, uuid=f"GPU-ctl-{i}")
    NodeFactory(name="node02")
    block = telemetry.telemetry_parse({"source": "sim", "gpus": [
        {"index": 0, "uuid": "GPU-ctl-0", "util": 42, "temp_c": 50, "power_w": 300.0,
         "mem_used_mib": 10, "mem_total_mib": 143771},
        {"index": 1, "uuid": "GPU-ctl-1", "xids": [79], "last_xid": 79, "lost": True},
    ]})
    telemetry.telemetry_keep(node_name="node01", block=block, persist=gpus_judged)
    assert Gpu.objects.get(uuid="GPU-ctl-1").quarantine_kind == GpuFault.XID

    table = run("gpus", env=ctl_env).stdout
    lines = {tuple(line.split()[:4]) for line in table.splitlines()[1:]}
    assert ("node01", "0", "healthy", "-") in lines and ("node01", "1", "quarantined", "79") in lines
    assert "GPU has fallen off the bus" in table and "42%" in table
    listed = json.loads(run("gpus", "--node", "node01", "-o", "json", env=ctl_env).stdout)
    assert [g["health"] for g in listed] == ["healthy", "quarantined"] and listed[0]["util"] == 42
    missing = run("gpus", "--node", "node02", env=ctl_env, rc=1)
    assert "no GPUs listed for node 'node02'" in missing.stderr

    assert "back in service" in run("gpus", "clear", "node01", "1", env=ctl_env).stdout
    assert Gpu.objects.get(uuid="GPU-ctl-1").quarantined_at is None
    assert "admin" in Event.objects.get(kind=NodeEventKind.GPU_CLEARED).message
    again = run("gpus", "clear", "node01", "1", env=ctl_env, rc=1)
    assert "is not quarantined" in again.stderr
    gone = run("gpus", "clear", "node09", "0", env=ctl_env, rc=1)
    assert "no node named 'node09'" in gone.stderr
