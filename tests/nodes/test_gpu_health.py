"""GPU health: heartbeats with telemetry blocks quarantine GPUs, fail their
replicas over, and keep them out of placement until an operator clears them.

Heartbeats go through the agent API's view (tests/agent_view.py); the
telemetry store is the test's Redis.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rest_framework.test import APIClient

from agent.protocol import example_heartbeat, example_telemetry
from core.models import Event
from nodes import telemetry
from nodes.choices import GpuFault, GpuHealth, NodeEventKind
from nodes.gpu_health import APPLICATION_XIDS, Policy, gpu_verdict, reset_shown
from nodes.models import Gpu
from nodes.selectors import gpu_health_list
from replicas import reconcile
from replicas.choices import ReplicaEventKind, ReplicaStatus
from replicas.models import GpuAllocation, Replica
from tests.agent_view import peer_for, send_heartbeat
from tests.factories import CatalogEntryFactory

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_reconcile_enqueue", "pki_dir")]

CRITICAL_XIDS = [48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120]


@pytest.fixture(autouse=True)
def _fresh_telemetry():
    telemetry.store.cache_clear()
    telemetry.forget_cache()
    yield
    telemetry.store.cache_clear()


def beat(node_id: str, *, gpus: int = 2, per_gpu: dict[int, dict] | None = None) -> dict:
    """A heartbeat of ``node_id`` with a telemetry block; ``per_gpu={index: {field: value}}``."""
    per_gpu = per_gpu or {}
    data = example_heartbeat(gpus=gpus, fabric=None).to_dict()
    for gpu in data["gpus"]:
        gpu["uuid"] = f"GPU-{node_id}-{gpu['index']}"
    block = dataclasses.asdict(example_telemetry(gpus=gpus))
    for reading in block["gpus"]:
        reading["uuid"] = f"GPU-{node_id}-{reading['index']}"
        reading.update(per_gpu.get(reading["index"], {}))
    data["telemetry"] = block
    return data


def ok(peer, node_id: str, body: dict) -> dict:
    status, reply = send_heartbeat(peer, node_id, body)
    assert status == 200, reply
    return reply


def placed_on(replica: Replica) -> set[tuple[str, int]]:
    return {(a.node.name, a.gpu.index) for a in GpuAllocation.objects.select_related("node", "gpu")
            .filter(member__replica=replica)}


def one_replica_on(node_id: str, peer) -> tuple[Replica, Gpu]:
    ok(peer, node_id, beat(node_id))
    CatalogEntryFactory(name="m", nodes=1, gpus_per_node=1, replicas=1)
    reconcile.replicas_reconcile()
    replica = Replica.objects.get(model__name="m")
    assert replica.status == ReplicaStatus.SCHEDULED
    return replica, GpuAllocation.objects.select_related("gpu").get(member__replica=replica).gpu


def operator_client(role: str = "operator") -> APIClient:
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    from accounts.services import token_create

    user = get_user_model().objects.create_user(f"{role}-1", password="a-password-for-tests-only")
    user.groups.add(Group.objects.get_or_create(name=role)[0])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_create(user=user).token}")
    return client


# --- the pure decision ---------------------------------------------------------------------------

@pytest.mark.parametrize("xid", CRITICAL_XIDS)
def test_every_critical_xid_quarantines(xid):
    verdict = gpu_verdict({"xids": [xid]})
    assert verdict.health == GpuHealth.QUARANTINED and verdict.fault == GpuFault.XID and verdict.xid == xid
    assert f"Xid {xid} (" in verdict.reason


@given(st.lists(st.sampled_from(sorted(APPLICATION_XIDS)), min_size=1, max_size=5))
def test_application_xids_never_quarantine(xids):
    verdict = gpu_verdict({"xids": xids})
    assert verdict.health == GpuHealth.HEALTHY and verdict.application_xids == tuple(xids)


@given(st.integers(0, 10**6), st.integers(0, 10**6))
def test_uncorrectable_ecc_quarantines_only_above_its_baseline(count, baseline):
    verdict = gpu_verdict({"ecc_uncorrected": count}, baseline=baseline)
    assert (verdict.health == GpuHealth.QUARANTINED) == (count > baseline)


def test_degraded_is_shown_not_quarantined():
    assert gpu_verdict({"thermal_throttle": True}).health == GpuHealth.DEGRADED
    assert gpu_verdict({"temp_c": 90}).health == GpuHealth.DEGRADED
    assert gpu_verdict({"ecc_corrected": 500}, previous_corrected=10).health == GpuHealth.DEGRADED
    assert gpu_verdict({"ecc_corrected": 500}, previous_corrected=450).health == GpuHealth.HEALTHY
    assert gpu_verdict({"pending_retirement": True}).health == GpuHealth.DEGRADED
    assert gpu_verdict({}).health == GpuHealth.HEALTHY


def test_the_reset_rule_is_opt_in_and_needs_evidence_of_a_reset():
    healthy = {"ecc_uncorrected": 0, "pending_retirement": False}
    assert not reset_shown(fault=GpuFault.LOST, xid=None, reading=healthy, policy=Policy())
    on = Policy(auto_clear=True)
    assert reset_shown(fault=GpuFault.LOST, xid=None, reading=healthy, policy=on)
    assert reset_shown(fault=GpuFault.XID, xid=79, reading=healthy, policy=on)
    assert not reset_shown(fault=GpuFault.XID, xid=48, reading=healthy, policy=on)
    assert reset_shown(fault=GpuFault.ECC, xid=None, reading=healthy, policy=on)
    assert not reset_shown(fault=GpuFault.ECC, xid=None, reading={"ecc_uncorrected": 2}, policy=on)
    assert not reset_shown(fault=GpuFault.LOST, xid=None, reading={"lost": True}, policy=on)


# --- through heartbeats ------------------------------------------------------------------------------

@pytest.mark.parametrize("xid", [48, 79, 94, 119])
def test_a_critical_xid_quarantines_the_gpu_and_fails_its_replica_over(xid):
    node01, node02 = peer_for("node01"), peer_for("node02")
    replica, held = one_replica_on("node01", node01)
    ok(node02, "node02", beat("node02"))

    ok(node01, "node01", beat("node01", per_gpu={held.index: {"xids": [xid], "last_xid": xid, "lost": xid == 79}}))

    gpu = Gpu.objects.get(pk=held.pk)
    assert gpu.quarantined_at is not None and gpu.quarantine_kind == GpuFault.XID and gpu.last_xid == xid
    failed = Event.objects.get(kind=ReplicaEventKind.REPLICA_STATUS, subject=f"replica/{replica.pk}",
                               data__to="failed")
    assert f"Xid {xid} (" in failed.message and held.uuid in failed.message
    event = Event.objects.get(kind=NodeEventKind.GPU_QUARANTINED, node__name="node01")
    assert f"Xid {xid}" in event.message and event.severity == "error"
    # Rebuilt on a GPU in service; the quarantined one is never offered.
    reconcile.replicas_reconcile()
    replacement = Replica.objects.filter(model__name="m").exclude(pk=replica.pk).get()
    assert replacement.status == ReplicaStatus.SCHEDULED
    assert ("node01", held.index) not in placed_on(replacement)
    other = Gpu.objects.get(node__name="node01", index=1 - held.index)
    assert other.quarantined_at is None


def test_application_xids_quarantine_nothing_and_are_recorded():
    node01 = peer_for("node01")
    replica, held = one_replica_on("node01", node01)
    for xid in sorted(APPLICATION_XIDS):
        ok(node01, "node01", beat("node01", per_gpu={held.index: {"xids": [xid], "last_xid": xid}}))
    assert Gpu.objects.filter(quarantined_at__isnull=False).count() == 0
    replica.refresh_from_db()
    assert replica.status == ReplicaStatus.SCHEDULED
    recorded = Event.objects.filter(kind=NodeEventKind.GPU_XID, node__name="node01")
    assert recorded.count() == len(APPLICATION_XIDS) and "(application)" in recorded.first().message


def test_an_nvml_error_for_one_gpu_quarantines_that_gpu_only():
    node01 = peer_for("node01")
    ok(node01, "node01", beat("node01", gpus=4, per_gpu={2: {"error": "nvmlDeviceGetUtilizationRates: Unknown Error"}}))
    assert list(Gpu.objects.filter(quarantined_at__isnull=False).values_list("index", "quarantine_kind")) == [
        (2, GpuFault.NVML)]
    rows = {r["index"]: r for r in gpu_health_list(node_name="node01")}
    assert rows[2]["health"] == "quarantined" and "Unknown Error" in rows[2]["reason"]
    assert {rows[i]["health"] for i in (0, 1, 3)} == {"healthy"}


def test_a_gpu_nvml_does_not_list_is_quarantined_but_not_when_nvidia_smi_reads():
    node01 = peer_for("node01")
    body = beat("node01", gpus=3)
    body["telemetry"]["gpus"] = body["telemetry"]["gpus"][:2]
    body["telemetry"]["source"] = "nvidia-smi"
    ok(node01, "node01", body)
    assert not Gpu.objects.filter(quarantined_at__isnull=False).exists()
    body["telemetry"]["source"] = "nvml"
    ok(node01, "node01", body)
    gpu = Gpu.objects.get(quarantined_at__isnull=False)
    assert gpu.index == 2 and gpu.quarantine_reason == "NVML does not list this GPU"


def test_a_quarantine_survives_an_agent_restart_until_an_operator_clears_it():
    node01 = peer_for("node01")
    ok(node01, "node01", beat("node01", per_gpu={0: {"ecc_uncorrected": 3}}))
    assert Gpu.objects.get(node__name="node01", index=0).quarantine_kind == GpuFault.ECC
    # The agent restarts: healthy-looking readings, no Xid; still quarantined, never placed on.
    telemetry.forget_cache()
    for _ in range(3):
        ok(node01, "node01", beat("node01", per_gpu={0: {"ecc_uncorrected": 3}}))
    CatalogEntryFactory(name="m", nodes=1, gpus_per_node=2, replicas=1)
    reconcile.replicas_reconcile()
    replica = Replica.objects.get(model__name="m")
    assert replica.status == ReplicaStatus.PENDING and replica.pending_reason

    client = operator_client()
    response = client.post("/api/v1/nodes/node01/gpus/0/clear/")
    assert response.status_code == 200, response.content
    assert response.json()["quarantined_at"] is None
    cleared = Event.objects.get(kind=NodeEventKind.GPU_CLEARED, node__name="node01")
    assert "operator-1" in cleared.message
    # The latest readings were judged while it was quarantined: not shown as its health any more.
    assert gpu_health_list(node_name="node01")[0]["health"] == "unknown"
    # The errors already judged do not quarantine it again; a new one does.
    ok(node01, "node01", beat("node01", per_gpu={0: {"ecc_uncorrected": 3}}))
    assert Gpu.objects.get(node__name="node01", index=0).quarantined_at is None
    assert gpu_health_list(node_name="node01")[0]["health"] == "healthy"
    reconcile.replicas_reconcile()
    replica.refresh_from_db()
    assert replica.status == ReplicaStatus.SCHEDULED
    ok(node01, "node01", beat("node01", per_gpu={0: {"ecc_uncorrected": 4}}))
    assert Gpu.objects.get(node__name="node01", index=0).quarantined_at is not None


def test_clearing_needs_the_operator_role_and_a_quarantined_gpu():
    node01 = peer_for("node01")
    ok(node01, "node01", beat("node01", per_gpu={1: {"lost": True}}))
    viewer = operator_client("viewer")
    assert viewer.post("/api/v1/nodes/node01/gpus/1/clear/").status_code == 403
    assert Gpu.objects.get(node__name="node01", index=1).quarantined_at is not None
    assert viewer.get("/api/v1/gpus/?node=node01").status_code == 200
    operator = operator_client()
    assert operator.post("/api/v1/nodes/node01/gpus/0/clear/").status_code == 409
    missing = operator.post("/api/v1/nodes/node01/gpus/7/clear/")
    assert missing.status_code == 404 and "has no GPU 7" in missing.json()["detail"]
    assert operator.post("/api/v1/nodes/node01/gpus/1/clear/").status_code == 200


def test_the_reset_rule_clears_a_gpu_back_on_the_bus(settings):
    settings.LLMGW_GPU_AUTO_CLEAR = True
    node01 = peer_for("node01")
    ok(node01, "node01", beat("node01", per_gpu={0: {"xids": [79], "lost": True}}))
    assert Gpu.objects.get(node__name="node01", index=0).quarantined_at is not None
    ok(node01, "node01", beat("node01", per_gpu={0: {"lost": True}}))
    assert Gpu.objects.get(node__name="node01", index=0).quarantined_at is not None
    ok(node01, "node01", beat("node01"))
    assert Gpu.objects.get(node__name="node01", index=0).quarantined_at is None
    assert "reset rule" in Event.objects.get(kind=NodeEventKind.GPU_CLEARED).message


def test_readings_are_kept_in_redis_with_an_hour_of_history_not_in_the_database():
    node01 = peer_for("node01")
    ok(node01, "node01", beat("node01", per_gpu={1: {"util": 12, "temp_c": 90}}))
    latest = telemetry.store().latest("node01")["node01"]
    rows = telemetry.readings_of(latest)
    assert rows[1]["util"] == 12 and rows[1]["health"] == "degraded" and "90 °C" in rows[1]["reason"]
    history = telemetry.store().history("node01")
    assert len(history) == 1 and history[0][1][1][:4] == [1, 12, 120_001, 90]
    key = telemetry.HISTORY_KEY + "node01"
    assert 0 < telemetry.store().client.ttl(key) <= telemetry.HISTORY_SECONDS + 600


@pytest.mark.parametrize("change, field", [
    ({"util": 101}, "util"),
    ({"util": "high"}, "util"),
    ({"xids": [-1]}, "xids"),
    ({"error": "x" * 300}, "error"),
    ({"lost": "yes"}, "lost"),
    ({"index": None}, "index"),
])
def test_a_malformed_block_is_refused_naming_the_field_and_stores_nothing(change, field):
    node01 = peer_for("node01")
    status, reply = send_heartbeat(node01, "node01", beat("node01", per_gpu={0: change}))
    assert status == 400, reply
    assert f"telemetry.gpus[0].{field}" in str(reply)
    assert telemetry.store().latest("node01") == {}
    assert not Gpu.objects.exists()
