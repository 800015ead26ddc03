"""Scheduling persisted, the lifecycle driven by agent reports, failure,
rebuild and drain, through the services on PostgreSQL."""

import datetime as dt

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from core.models import Event
from nodes.choices import NodeStatus
from nodes.models import Node
from nodes.services import node_transition
from replicas import drain, hooks, reconcile, services
from replicas.choices import MemberState, ReplicaStatus
from replicas.models import GpuAllocation, Member, PortAllocation, Replica
from tests.factories import CatalogEntryFactory, node_with_gpus

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_reconcile_enqueue")]


@pytest.fixture(autouse=True)
def _no_settle(settings):
    settings.LLMGW_ROUTING_SETTLE = 0


@pytest.fixture
def seeds_cluster():
    return {
        "node01": node_with_gpus("node01", fabric="ib-a", addr="127.0.1.1"),
        "node02": node_with_gpus("node02", fabric="ib-a", addr="127.0.1.2"),
        "node03": node_with_gpus("node03", fabric="ib-b", addr="127.0.1.3"),
        "node04": node_with_gpus("node04", fabric="ib-b", addr="127.0.1.4"),
    }


def _report(node, **states):
    """An agent report: member id -> (state, healthy)."""
    engines = []
    for member in Member.objects.filter(node=node).exclude(state=MemberState.GONE):
        state, healthy = states.get(member.member_id, ("running", True))
        if state is None:
            continue
        engines.append({"member": member.member_id, "replica": str(member.replica_id), "rank": member.rank,
                        "state": state, "pid": 100 + member.pk, "exit_code": 1 if state == "exited" else None,
                        "healthy": healthy, "log_tail": ["NCCL error: remote process exited"] if state == "exited" else []})
    with transaction.atomic():
        services.members_report(node=node, engines=engines)


def _placement(replica):
    return {m.node.name: m.gpus for m in replica.members.select_related("node")}


def test_seeds_scenario_one_replica_per_fabric_then_rebuild_on_the_other(seeds_cluster):
    model = CatalogEntryFactory(name="llama-70b", nodes=2, gpus_per_node=4, replicas=2)
    reconcile.replicas_reconcile()
    replicas = list(Replica.objects.filter(model=model).order_by("id"))
    assert [r.status for r in replicas] == [ReplicaStatus.SCHEDULED] * 2
    by_fabric = {r.fabric.name: _placement(r) for r in replicas}
    assert set(by_fabric["ib-a"]) == {"node01", "node02"}
    assert set(by_fabric["ib-b"]) == {"node03", "node04"}
    assert all(len(gpus) == 4 for p in by_fabric.values() for gpus in p.values())

    for node in seeds_cluster.values():
        _report(node)
    for node in seeds_cluster.values():
        _report(node)
    assert set(Replica.objects.values_list("status", flat=True)) == {ReplicaStatus.READY}

    ib_a = Replica.objects.get(fabric__name="ib-a")
    node_transition(node_name="node02", to=NodeStatus.LOST, reason="test")
    services.replicas_node_lost(node_name="node02")
    ib_a.refresh_from_db()
    assert ib_a.status == ReplicaStatus.FAILED
    # node01's member may still be serving with node02's (issue 27): it stays
    # until the routing has settled and nothing is in flight on it; then it
    # is reaped: out of its desired state, GPUs freed once its agent stops it.
    from replicas.selectors import node_desired_members

    assert [m["replica"] for m in node_desired_members(node_name="node01")] == [str(ib_a.pk)]
    Replica.objects.filter(pk=ib_a.pk).update(status_changed_at=timezone.now() - dt.timedelta(seconds=30))
    services.replicas_quiesce()
    assert node_desired_members(node_name="node01") == []
    _report(seeds_cluster["node01"], **{m.member_id: (None, False) for m in ib_a.members.all()})
    ib_a.refresh_from_db()
    assert ib_a.status == ReplicaStatus.STOPPED
    assert not GpuAllocation.objects.filter(member__replica=ib_a).exists()

    reconcile.replicas_reconcile()
    replacement = Replica.objects.filter(model=model, status=ReplicaStatus.SCHEDULED).get()
    assert replacement.fabric.name == "ib-b"
    assert set(_placement(replacement)) == {"node03", "node04"}
    # node01 sits idle rather than being paired across fabrics.
    assert not Member.objects.filter(node__name="node01").exclude(state=MemberState.GONE).exists()


def _ready_pair(seeds_cluster):
    CatalogEntryFactory(name="llama-70b", nodes=2, gpus_per_node=4, replicas=2)
    reconcile.replicas_reconcile()
    for _ in range(2):
        for node in seeds_cluster.values():
            _report(node)
    return Replica.objects.get(fabric__name="ib-a")


def _desired(node_name):
    from replicas.selectors import node_desired_members

    return [m["replica"] for m in node_desired_members(node_name=node_name)]


def _ago(replica, seconds):
    Replica.objects.filter(pk=replica.pk).update(status_changed_at=timezone.now() - dt.timedelta(seconds=seconds))


def test_a_lost_nodes_replica_lets_its_requests_in_flight_finish_within_the_grace(seeds_cluster, settings,
                                                                                 monkeypatch):
    """issue 27: the replica fails (out of routing, replaced at once), but its
    member on the live node runs on while a request is in flight on it, and
    stops when none is, or at LLMGW_STOP_GRACE."""
    settings.LLMGW_ROUTING_SETTLE, settings.LLMGW_STOP_GRACE = 1.5, 60
    ib_a = _ready_pair(seeds_cluster)
    inflight = {ib_a.pk: 1}
    monkeypatch.setattr(hooks, "inflight_providers", [lambda *, replica_id: inflight.get(replica_id, 0)])
    node_transition(node_name="node02", to=NodeStatus.LOST, reason="test")
    services.replicas_node_lost(node_name="node02")
    ib_a.refresh_from_db()
    assert ib_a.status == ReplicaStatus.FAILED and not ib_a.quiesced
    assert _desired("node01") == [str(ib_a.pk)]
    assert _desired("node02") == []  # the lost node's member is released at once
    reconcile.replicas_reconcile()  # the replacement is created and placed meanwhile
    assert Replica.objects.filter(model=ib_a.model, status=ReplicaStatus.SCHEDULED).count() == 1
    _ago(ib_a, 30)
    services.replicas_quiesce()
    assert _desired("node01") == [str(ib_a.pk)]  # a request is still in flight
    inflight.clear()
    services.replicas_quiesce()
    assert _desired("node01") == []
    assert Event.objects.filter(subject=f"replica/{ib_a.pk}", message__contains="no request in flight").exists()


def test_a_lost_nodes_replica_stops_at_the_grace_with_requests_still_in_flight(seeds_cluster, settings, monkeypatch):
    settings.LLMGW_STOP_GRACE = 60
    ib_a = _ready_pair(seeds_cluster)
    monkeypatch.setattr(hooks, "inflight_providers", [lambda *, replica_id: 3])
    node_transition(node_name="node02", to=NodeStatus.LOST, reason="test")
    services.replicas_node_lost(node_name="node02")
    _ago(ib_a, 59)
    services.replicas_quiesce()
    assert _desired("node01") == [str(ib_a.pk)]
    _ago(ib_a, 61)
    services.replicas_quiesce()
    assert _desired("node01") == []
    assert Event.objects.filter(subject=f"replica/{ib_a.pk}", message__contains="3 request(s) still in flight").exists()


def test_an_exited_engine_stops_its_replicas_other_members_at_once(seeds_cluster, monkeypatch):
    """The group is broken: nothing left to finish, whatever is counted in flight."""
    ib_a = _ready_pair(seeds_cluster)
    monkeypatch.setattr(hooks, "inflight_providers", [lambda *, replica_id: 1])
    rank1 = ib_a.members.get(rank=1)
    _report(seeds_cluster["node02"], **{rank1.member_id: ("exited", False)})
    ib_a.refresh_from_db()
    assert ib_a.status == ReplicaStatus.FAILED and ib_a.quiesced
    assert _desired("node01") == []


def test_fabric_less_node_never_gets_a_multi_node_member():
    node_with_gpus("island1")
    node_with_gpus("island2")
    CatalogEntryFactory(name="big", nodes=2, gpus_per_node=4, replicas=1)
    CatalogEntryFactory(name="small", nodes=1, gpus_per_node=4, replicas=2)
    reconcile.replicas_reconcile()
    big = Replica.objects.get(model__name="big")
    assert big.status == ReplicaStatus.PENDING
    assert "fabric" in big.pending_reason
    assert Replica.objects.filter(model__name="small", status=ReplicaStatus.SCHEDULED).count() == 2
    assert Event.objects.filter(kind="replica.pending", subject=f"replica/{big.pk}").exists()


def test_gpu_cannot_be_allocated_twice():
    node = node_with_gpus("node01", gpus=1)
    CatalogEntryFactory(name="m", replicas=1)
    reconcile.replicas_reconcile()
    member = Member.objects.get()
    with pytest.raises(IntegrityError), transaction.atomic():
        GpuAllocation.objects.create(gpu=node.gpus.get(), member=member, node=node)


def test_leader_ports_allocated_without_collision_and_freed():
    node_with_gpus("node01", gpus=8)
    CatalogEntryFactory(name="m", replicas=4, gpus_per_node=2)
    reconcile.replicas_reconcile()
    ports = list(PortAllocation.objects.values_list("port", flat=True))
    # Single-node leaders: one HTTP port each, on one node, none shared.
    assert len(ports) == 4 and len(set(ports)) == 4
    for member in Member.objects.all():
        assert member.ports["http"] in ports
        assert member.env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, member.gpus))
    victim = Member.objects.order_by("id").first()
    services.replica_fail(replica_id=victim.replica_id, reason="test")
    _report(victim.node, **{victim.member_id: (None, False)})
    assert not PortAllocation.objects.filter(member=victim).exists()
    assert PortAllocation.objects.count() == 3


def test_exited_member_fails_replica_and_replacement_is_scheduled(seeds_cluster):
    CatalogEntryFactory(name="m", nodes=2, gpus_per_node=8, replicas=1)
    reconcile.replicas_reconcile()
    replica = Replica.objects.get()
    worker = replica.members.get(rank=1)
    _report(worker.node, **{worker.member_id: ("exited", False)})
    replica.refresh_from_db()
    assert replica.status == ReplicaStatus.FAILED
    assert "exited with status 1" in replica.status_reason
    reconcile.replicas_reconcile()
    assert Replica.objects.filter(status=ReplicaStatus.SCHEDULED).count() == 1


def test_scale_down_stops_newest(seeds_cluster):
    from replicas.catalog import model_scale

    CatalogEntryFactory(name="m", replicas=3)
    reconcile.replicas_reconcile()
    model_scale(name="m", replicas=1)
    reconcile.replicas_reconcile()
    statuses = list(Replica.objects.order_by("id").values_list("status", flat=True))
    assert statuses == [ReplicaStatus.SCHEDULED, ReplicaStatus.STOPPING, ReplicaStatus.STOPPING]


def test_drain_moves_one_at_a_time_replacement_ready_first(seeds_cluster):
    CatalogEntryFactory(name="m", nodes=1, gpus_per_node=8, replicas=2)
    reconcile.replicas_reconcile()
    for node in seeds_cluster.values():
        _report(node)
        _report(node)
    victim_node = Member.objects.order_by("id").first().node
    started = drain.drain_start(node_name=victim_node.name)
    reconcile.replicas_reconcile()
    original = Replica.objects.get(draining=True)
    # The replacement is scheduled elsewhere; the original keeps running until it is ready.
    replacement = Replica.objects.get(status=ReplicaStatus.SCHEDULED)
    assert victim_node.name not in _placement(replacement)
    assert Replica.objects.get(pk=original.pk).status == ReplicaStatus.READY
    reconcile.replicas_reconcile()
    assert Replica.objects.get(pk=original.pk).status == ReplicaStatus.READY
    for node in seeds_cluster.values():
        _report(node)
        _report(node)
    reconcile.replicas_reconcile()
    assert Replica.objects.get(pk=original.pk).status == ReplicaStatus.STOPPING
    _report(victim_node, **{m.member_id: (None, False) for m in original.members.all()})
    reconcile.replicas_reconcile()
    started.refresh_from_db()
    victim_node.refresh_from_db()
    assert started.status == "done"
    assert victim_node.status == NodeStatus.DRAINED


def test_drain_blocked_when_nothing_can_take_the_replica():
    node_with_gpus("node01", fabric="ib-a")
    CatalogEntryFactory(name="m", gpus_per_node=8, replicas=1)
    reconcile.replicas_reconcile()
    _report(Member.objects.get().node)
    _report(Member.objects.get().node)
    started = drain.drain_start(node_name="node01")
    reconcile.replicas_reconcile()
    reconcile.replicas_reconcile()
    started.refresh_from_db()
    assert started.status == "blocked"
    assert any("keeps running" in line for line in started.log)
    assert Replica.objects.get(draining=True).status == ReplicaStatus.READY


def test_reconcile_fails_a_replica_left_on_a_lost_node_whose_follow_up_never_ran(seeds_cluster):
    """The sweep commits LOST, then its handlers fail the node's replicas; if
    the worker dies in between, the periodic reconcile must still do it."""
    model = CatalogEntryFactory(name="m", nodes=2, gpus_per_node=4, replicas=1)
    reconcile.replicas_reconcile()
    replica = Replica.objects.get(model=model)
    for node in seeds_cluster.values():
        _report(node)
        _report(node)
    replica.refresh_from_db()
    assert replica.status == ReplicaStatus.READY
    dead = replica.members.get(rank=1).node
    # The transition alone, as the sweep commits it, without the lost-node hooks.
    node_transition(node_name=dead.name, to=NodeStatus.LOST, reason="test: the worker died after this commit")

    reconcile.replicas_reconcile()

    replica.refresh_from_db()
    assert replica.status == ReplicaStatus.FAILED
    assert f"node {dead.name} was lost" in replica.status_reason
    # The dead node's member holds nothing any more; a replacement is placed on live nodes.
    assert not GpuAllocation.objects.filter(member__replica=replica, node=dead).exists()
    reconcile.replicas_reconcile()
    replacement = Replica.objects.exclude(pk=replica.pk).get(model=model)
    assert replacement.status == ReplicaStatus.SCHEDULED
    assert dead.name not in _placement(replacement)


def test_rebuild_uses_the_survivors_gpus_without_waiting_for_the_dead_node():
    """Three 6-GPU nodes in one fabric, a 2x4 replica; its rank-1 node dies
    with its engines. The leader's engine exits (the group broke) and its live
    node says so: its GPUs are free at once, so the replacement is placed on
    the surviving pair while the dead node is not yet declared lost."""
    for i in (1, 2, 3):
        node_with_gpus(f"hx{i}", gpus=6, fabric="fab-x", addr=f"127.0.1.{i}")
    model = CatalogEntryFactory(name="m", nodes=2, gpus_per_node=4, replicas=1)
    reconcile.replicas_reconcile()
    replica = Replica.objects.get(model=model)
    for node in Node.objects.all():
        _report(node)
        _report(node)
    replica.refresh_from_db()
    assert replica.status == ReplicaStatus.READY
    leader = replica.members.select_related("node").get(rank=0)
    dead = replica.members.select_related("node").get(rank=1).node
    spare = Node.objects.exclude(pk__in=[leader.node_id, dead.pk]).get()

    # The dead node says nothing more; the leader's node reports its engine exited.
    _report(leader.node, **{leader.member_id: ("exited", False)})

    replica.refresh_from_db()
    assert replica.status == ReplicaStatus.FAILED
    assert not GpuAllocation.objects.filter(member__replica=replica, node=leader.node).exists()
    assert not PortAllocation.objects.filter(member__replica=replica, node=leader.node).exists()
    # Only the member on the unreachable node keeps its GPUs, until the node is lost.
    assert GpuAllocation.objects.filter(member__replica=replica, node=dead).count() == 4
    reconcile.replicas_reconcile()
    replacement = Replica.objects.exclude(pk=replica.pk).get(model=model)
    assert replacement.status == ReplicaStatus.SCHEDULED, replacement.pending_reason
    assert set(_placement(replacement)) == {leader.node.name, spare.name}
    assert Node.objects.get(pk=dead.pk).status == NodeStatus.READY  # not declared lost yet
    used = list(GpuAllocation.objects.values_list("gpu_id", flat=True))
    assert len(used) == len(set(used))


def test_a_lost_node_that_returns_first_fails_what_it_held_before_being_believed(seeds_cluster):
    """The sweep's follow-up was lost and the node heartbeats again before the
    reconcile ran: its own heartbeat fails the replicas it held (it comes
    back empty, as a lost node does), whatever its agent reports."""
    from nodes.inventory import node_heartbeat_apply

    model = CatalogEntryFactory(name="m", nodes=1, gpus_per_node=8, replicas=1)
    reconcile.replicas_reconcile()
    replica = Replica.objects.get(model=model)
    node = replica.members.get().node
    _report(node)
    _report(node)
    node_transition(node_name=node.name, to=NodeStatus.LOST, reason="test: the worker died after this commit")
    member = replica.members.get()
    engines = [{"member": member.member_id, "replica": str(replica.pk), "rank": 0, "state": "running", "pid": 4242,
                "exit_code": None, "healthy": True, "log_tail": []}]

    back = node_heartbeat_apply(node_name=node.name, inventory={"gpus": [], "fabrics": [], "hcas": []} | {
        k: getattr(node, k) for k in ("mgmt_addr", "mgmt_interface", "agent_version", "discovery_errors")},
        inventory_hash=node.inventory_hash, engines=engines)

    assert back.status == NodeStatus.READY
    replica.refresh_from_db()
    assert replica.status == ReplicaStatus.STOPPED  # failed, and its one member reaped
    assert Event.objects.filter(subject=f"replica/{replica.pk}", data__to="failed",
                                message__contains=f"node {node.name} was lost").exists()
    assert not GpuAllocation.objects.filter(member__replica=replica).exists()
