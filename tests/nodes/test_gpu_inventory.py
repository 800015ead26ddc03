"""A node's GPUs as its heartbeats report them: what one node's claims can do
to another (nothing), and a GPU that vanishes while a replica holds it.

Heartbeats go through the agent API's view (tests/agent_view.py), so the
answers checked are the ones an agent gets.
"""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from agent.protocol import example_heartbeat
from core.models import Event
from nodes import liveness
from nodes.choices import NodeEventKind, NodeStatus
from nodes.models import Gpu, GpuConflict, Node
from replicas import reconcile
from replicas.choices import ReplicaEventKind, ReplicaStatus
from replicas.models import GpuAllocation, Replica
from tests.agent_view import peer_for, send_heartbeat
from tests.factories import CatalogEntryFactory

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_reconcile_enqueue", "pki_dir")]

SHARED = "GPU-shared-0000"


def beat(node_id: str, *, uuids: list[str], **changes) -> dict:
    data = example_heartbeat(gpus=len(uuids), fabric=None).to_dict()
    for gpu, uuid in zip(data["gpus"], uuids):
        gpu["uuid"] = uuid
    data.update(changes)
    return data


def own(node_id: str, n: int = 2) -> list[str]:
    return [f"GPU-{node_id}-{i}" for i in range(n)]


def api_node(name: str) -> dict:
    from django.contrib.auth import get_user_model

    from accounts.services import token_create

    user = get_user_model().objects.filter(username="operator").first() or get_user_model().objects.create_superuser(
        "operator", "", "operator-password-for-tests"
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_create(user=user).token}")
    response = client.get(f"/api/v1/nodes/{name}/")
    assert response.status_code == 200, response.content
    return response.json()


def assert_conflict_shown(claimant: str, holder: str) -> None:
    for name in (claimant, holder):
        shown = api_node(name)["gpu_conflicts"]
        assert [(c["gpu"], c["holder"], c["claimant"]) for c in shown] == [(SHARED, holder, claimant)], (name, shown)
        event = Event.objects.filter(node__name=name, kind=NodeEventKind.GPU_CONFLICT).get()
        assert SHARED in event.message and f"{holder} keeps it" in event.message


def test_a_claim_after_the_owner_briefly_stopped_reporting_does_not_lock_the_owner_out():
    node01, node02 = peer_for("node01"), peer_for("node02")
    assert send_heartbeat(node01, "node01", beat("node01", uuids=[SHARED, *own("node01")]))[0] == 200
    # node01's agent misses the GPU for one heartbeat...
    assert send_heartbeat(node01, "node01", beat("node01", uuids=own("node01")))[0] == 200
    assert Gpu.objects.get(uuid=SHARED).missing_since is not None
    # ...and node02 reports the same uuid meanwhile.
    status, reply = send_heartbeat(node02, "node02", beat("node02", uuids=[SHARED, *own("node02")], mgmt_addr="127.0.1.2"))
    assert status == 200, reply
    # The owner's heartbeats keep succeeding, and it keeps its GPU.
    for _ in range(3):
        status, reply = send_heartbeat(node01, "node01", beat("node01", uuids=[SHARED, *own("node01")]))
        assert status == 200, reply
    gpu = Gpu.objects.select_related("node").get(uuid=SHARED)
    assert gpu.node.name == "node01" and gpu.missing_since is None
    assert sorted(Node.objects.get(name="node02").gpus.values_list("uuid", flat=True)) == own("node02")
    assert_conflict_shown("node02", "node01")
    assert liveness.store().seen("node01") is not None and liveness.store().seen("node02") is not None


def test_a_claim_on_a_gpu_another_node_reports_registers_the_claimant_without_it():
    node01, node02 = peer_for("node01"), peer_for("node02")
    assert send_heartbeat(node01, "node01", beat("node01", uuids=[SHARED, *own("node01")]))[0] == 200
    status, reply = send_heartbeat(node02, "node02", beat("node02", uuids=[SHARED, *own("node02")], mgmt_addr="127.0.1.2"))
    assert status == 200, reply
    assert reply["status"] == NodeStatus.READY
    status, reply = send_heartbeat(node01, "node01", beat("node01", uuids=[SHARED, *own("node01")], mgmt_addr="127.0.1.9"))
    assert status == 200, reply
    assert Gpu.objects.get(uuid=SHARED).node.name == "node01"
    assert_conflict_shown("node02", "node01")
    # The claimant stops claiming it: the conflict is gone from both nodes.
    assert send_heartbeat(node02, "node02", beat("node02", uuids=own("node02")))[0] == 200
    assert not GpuConflict.objects.exists()
    assert api_node("node01")["gpu_conflicts"] == [] and api_node("node02")["gpu_conflicts"] == []


def test_an_allocated_gpu_that_vanishes_fails_its_replica_not_the_node():
    node01 = peer_for("node01")
    uuids = own("node01", 4)
    assert send_heartbeat(node01, "node01", beat("node01", uuids=uuids))[0] == 200
    CatalogEntryFactory(name="m", nodes=1, gpus_per_node=1, replicas=1)
    reconcile.replicas_reconcile()
    replica = Replica.objects.get(model__name="m")
    assert replica.status == ReplicaStatus.SCHEDULED
    held = GpuAllocation.objects.select_related("gpu").get(member__replica=replica).gpu
    before = Event.objects.filter(kind=NodeEventKind.NODE_STATUS, node__name="node01").count()

    liveness.store.cache_clear()
    for _ in range(2):
        status, reply = send_heartbeat(node01, "node01", beat("node01", uuids=[u for u in uuids if u != held.uuid]))
        assert status == 200, reply
    assert liveness.store().seen("node01") is not None
    failed = Event.objects.get(kind=ReplicaEventKind.REPLICA_STATUS, subject=f"replica/{replica.pk}", data__to="failed")
    assert held.uuid in failed.message and "vanished from node node01" in failed.message
    replica.refresh_from_db()
    # No engine was reported running: the failed replica's members are reaped at once.
    assert replica.status == ReplicaStatus.STOPPED
    gpu = Gpu.objects.get(pk=held.pk)
    assert gpu.missing_since is not None
    missing = Event.objects.get(kind=NodeEventKind.GPU_MISSING, node__name="node01")
    assert held.uuid in missing.message and "missing" in missing.message
    node = Node.objects.get(name="node01")
    assert node.status == NodeStatus.READY
    assert Event.objects.filter(kind=NodeEventKind.NODE_STATUS, node__name="node01").count() == before
    shown = {g["uuid"]: g["missing_since"] for g in api_node("node01")["gpus"]}
    assert shown[held.uuid] is not None and all(shown[u] is None for u in uuids if u != held.uuid)

    # The replacement is placed on a GPU that is there.
    reconcile.replicas_reconcile()
    replacement = Replica.objects.filter(model__name="m").exclude(pk=replica.pk).get()
    assert replacement.status == ReplicaStatus.SCHEDULED
    assert GpuAllocation.objects.get(member__replica=replacement).gpu.missing_since is None

    # The GPU comes back: no longer missing, the node's heartbeats still fine.
    status, _ = send_heartbeat(node01, "node01", beat("node01", uuids=uuids))
    assert status == 200
    assert Gpu.objects.get(pk=held.pk).missing_since is None


def test_a_gpu_replaced_at_the_same_index_takes_its_place_and_the_old_one_shows_missing():
    node01 = peer_for("node01")
    assert send_heartbeat(node01, "node01", beat("node01", uuids=["GPU-old", "GPU-b"]))[0] == 200
    assert send_heartbeat(node01, "node01", beat("node01", uuids=["GPU-new", "GPU-b"]))[0] == 200
    rows = sorted(Gpu.objects.values_list("index", "uuid", "missing_since"), key=lambda r: r[1])
    assert [(i, u, m is None) for i, u, m in rows] == [(1, "GPU-b", True), (0, "GPU-new", True), (0, "GPU-old", False)]
    # Back again, at another index: the indices of the GPUs that are there stay unique.
    assert send_heartbeat(node01, "node01", beat("node01", uuids=["GPU-new", "GPU-old", "GPU-b"]))[0] == 200
    assert sorted(Gpu.objects.values_list("uuid", "index")) == [("GPU-b", 2), ("GPU-new", 0), ("GPU-old", 1)]
    assert not Gpu.objects.exclude(missing_since=None).exists()


@pytest.mark.parametrize("first, second", [("node01", "node02"), ("node02", "node01")])
def test_whichever_node_reported_a_gpu_first_keeps_it_and_both_keep_heartbeating(first, second):
    peers = {name: peer_for(name) for name in (first, second)}
    for name in (first, second, first, second):
        status, reply = send_heartbeat(peers[name], name, beat(name, uuids=[SHARED, *own(name)],
                                                                mgmt_addr=f"127.0.1.{name[-1]}"))
        assert status == 200, (name, reply)
    assert Gpu.objects.get(uuid=SHARED).node.name == first
    assert_conflict_shown(second, first)
    assert {liveness.store().seen(n) is not None for n in (first, second)} == {True}
