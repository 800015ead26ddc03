"""GPU faults on the simulated cluster, through each node's fake NVML: real
agents read it (its event API for Xids), real heartbeats carry the blocks,
the agent API quarantines, the worker rebuilds.

A critical Xid quarantines its GPU and fails its replica over to a healthy
place within one telemetry interval plus the usual rebuild; an application
Xid quarantines nothing; NVML failing for one GPU quarantines that GPU only;
a quarantine survives an agent restart and keeps the GPU out of placement
until an operator clears it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from agent.nvml_fake import inject_fault
from cli.simcluster import SimNode
from cli.wait import wait_until
from core.models import Event
from nodes.choices import NodeEventKind
from nodes.gpus import gpu_clear
from nodes.models import Gpu
from replicas.catalog import catalog_apply
from replicas.choices import MemberState, ReplicaStatus
from replicas.models import Member, Replica

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

TELEMETRY_INTERVAL = 2.0
NODES = [SimNode("node01", "127.0.1.1", gpus=4, fabric="ib-a", hcas=("mlx5_0", "mlx5_1")),
         SimNode("node02", "127.0.1.2", gpus=4, fabric="ib-a", hcas=("mlx5_0", "mlx5_1"))]


def ready_count() -> int:
    return Replica.objects.filter(status=ReplicaStatus.READY).count()


def a_ready_member() -> Member:
    return (Member.objects.filter(replica__status=ReplicaStatus.READY).exclude(state=MemberState.GONE)
            .select_related("node", "replica").order_by("replica_id").first())


def quarantined(node: str, index: int) -> bool:
    return Gpu.objects.filter(node__name=node, index=index, quarantined_at__isnull=False).exists()


def test_gpu_faults_quarantine_fail_over_and_stay_until_cleared(sim_cluster):
    cluster = sim_cluster(NODES, agent_timings={"telemetry.interval": f"{TELEMETRY_INTERVAL:g}s"})
    catalog_apply(entries=[{"name": "small", "engine": "sim", "model": "/m", "nodes": 1, "gpus_per_node": 1,
                            "replicas": 3}])
    wait_until(lambda: ready_count() == 3, timeout=60, message="three ready replicas")
    wait_until(lambda: Gpu.objects.count() == 8, timeout=10, message="the GPUs registered")

    # Critical Xids: each quarantines its GPU and fails its replica over.
    for xid in (79, 48, 94):
        member = a_ready_member()
        node, index, replica_id = member.node.name, member.gpus[0], member.replica_id
        started = time.monotonic()
        inject_fault(cluster.nodes[node].dir, {"gpu": index, "xid": xid})
        wait_until(lambda: quarantined(node, index), timeout=TELEMETRY_INTERVAL + 5,
                   message=f"GPU {index} of {node} quarantined after Xid {xid}")
        took = time.monotonic() - started
        assert took <= TELEMETRY_INTERVAL + 5, took
        failed = Event.objects.get(kind="replica.status", subject=f"replica/{replica_id}", data__to="failed")
        assert f"Xid {xid} (" in failed.message
        wait_until(lambda: ready_count() == 3, timeout=30, message=f"the replica rebuilt after Xid {xid}")
        live = Member.objects.filter(replica__status=ReplicaStatus.READY).exclude(state=MemberState.GONE)
        assert not any(m.node.name == node and index in m.gpus for m in live.select_related("node"))

    # An application Xid is recorded and quarantines nothing.
    member = a_ready_member()
    node, index = member.node.name, member.gpus[0]
    inject_fault(cluster.nodes[node].dir, {"gpu": index, "xid": 13})
    wait_until(lambda: Event.objects.filter(kind=NodeEventKind.GPU_XID, node__name=node).exists(),
               timeout=TELEMETRY_INTERVAL + 5, message="the application Xid recorded")
    assert not quarantined(node, index)
    assert Replica.objects.get(pk=member.replica_id).status == ReplicaStatus.READY

    # NVML failing for one GPU quarantines that GPU only.
    used = {(m.node.name, g) for m in Member.objects.exclude(state=MemberState.GONE).select_related("node")
            for g in m.gpus}
    out = set(Gpu.objects.filter(quarantined_at__isnull=False).values_list("node__name", "index"))
    spare_node, spare = sorted({(n.name, i) for n in NODES for i in range(n.gpus)} - used - out)[0]
    before = set(Gpu.objects.filter(quarantined_at__isnull=False).values_list("pk", flat=True))
    inject_fault(cluster.nodes[spare_node].dir, {"gpu": spare, "nvml_error": "Unknown Error"})
    wait_until(lambda: quarantined(spare_node, spare), timeout=TELEMETRY_INTERVAL + 5,
               message="the GPU NVML cannot read quarantined")
    after = set(Gpu.objects.filter(quarantined_at__isnull=False).values_list("pk", flat=True))
    assert after - before == {Gpu.objects.get(node__name=spare_node, index=spare).pk}

    # The agent restarts (engines adopted): the quarantines stand; no placement uses those GPUs.
    quarantined_now = set(Gpu.objects.filter(quarantined_at__isnull=False).values_list("node__name", "index"))
    for name in ("node01", "node02"):
        os.kill(cluster.agent_pid(name), signal.SIGTERM)
        cluster.nodes[name].proc.wait(timeout=15)
        cluster.start_agent(name)
    time.sleep(3 * TELEMETRY_INTERVAL)
    assert set(Gpu.objects.filter(quarantined_at__isnull=False).values_list("node__name", "index")) == quarantined_now
    catalog_apply(entries=[{"name": "small", "engine": "sim", "model": "/m", "nodes": 1, "gpus_per_node": 1,
                            "replicas": 8 - len(quarantined_now) + 1}])
    wait_until(lambda: ready_count() == 8 - len(quarantined_now), timeout=60,
               message="every GPU in service holding a replica")
    pending = Replica.objects.get(status=ReplicaStatus.PENDING)
    live = Member.objects.exclude(state=MemberState.GONE).select_related("node")
    used = {(m.node.name, g) for m in live for g in m.gpus}
    assert not used & quarantined_now, "a quarantined GPU was placed on"

    # An operator clears the GPU NVML failed on, after a reset: the pending replica takes it.
    inject_fault(cluster.nodes[spare_node].dir, {"gpu": spare, "reset": True})
    time.sleep(TELEMETRY_INTERVAL + 1)
    gpu_clear(node_name=spare_node, index=spare, actor="user operator")
    wait_until(lambda: Replica.objects.get(pk=pending.pk).status == ReplicaStatus.READY, timeout=30,
               message="the pending replica placed on the cleared GPU")
    assert (spare_node, spare) in {(m.node.name, g) for m in Member.objects.filter(replica=pending)
                                   .select_related("node") for g in m.gpus}
    assert "user operator" in Event.objects.get(kind=NodeEventKind.GPU_CLEARED).message
