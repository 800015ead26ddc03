"""Failure modes on the simulated cluster: fencing a node that comes back,
holding failovers when most nodes go silent at once, a fabric-less node,
and a drain whose replacement is ready before the original stops."""

import os

import pytest

from cli.simcluster import SimNode
from cli.wait import wait_until
from core.models import Event
from nodes.choices import NodeStatus
from nodes.models import Node
from replicas.catalog import catalog_apply
from replicas.choices import MemberState, ReplicaStatus
from replicas.drain import drain_start
from replicas.models import Drain, Member, Replica
from tests.e2e.sim import GRACE

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0] != "Z"


def ready(count: int, **filters):
    return lambda: Replica.objects.filter(status=ReplicaStatus.READY, **filters).count() == count


def test_frozen_node_comes_back_and_fences_its_rebuilt_replicas(sim_cluster):
    nodes = [SimNode("node01", "127.0.1.1", fabric="ib-a"), SimNode("node02", "127.0.1.2", fabric="ib-a"),
             SimNode("node03", "127.0.1.3", fabric="ib-b")]
    cluster = sim_cluster(nodes)
    catalog_apply(entries=[{"name": "small", "engine": "sim", "model": "/m", "nodes": 1, "gpus_per_node": 8,
                            "replicas": 2}])
    wait_until(ready(2), timeout=60, message="two ready replicas")
    victim = Member.objects.filter(replica__status=ReplicaStatus.READY).select_related("node").order_by("node__name").first()
    old_pid = victim.pid
    assert alive(old_pid)
    cluster.freeze_agent(victim.node.name)  # SIGSTOP: the machine hangs, its engine keeps running
    wait_until(lambda: Node.objects.get(name=victim.node.name).status == NodeStatus.LOST, timeout=GRACE + 15,
               message="the frozen node declared lost")
    wait_until(ready(2), timeout=60, message="the replica rebuilt elsewhere")
    assert alive(old_pid), "the frozen node's engine still runs: nobody told it otherwise"
    cluster.thaw_agent(victim.node.name)  # SIGCONT: it comes back
    wait_until(lambda: not alive(old_pid), timeout=15, message="the orphaned engine stopped at once")
    wait_until(lambda: Node.objects.get(name=victim.node.name).status == NodeStatus.READY, timeout=15,
               message="the node back, empty")
    assert not Member.objects.filter(node=victim.node).exclude(state=MemberState.GONE).exclude(
        replica__status=ReplicaStatus.READY).exists()
    # No GPU is used twice: every live member's GPUs are its own.
    used = [(m.node_id, g) for m in Member.objects.exclude(state=MemberState.GONE) for g in m.gpus]
    assert len(used) == len(set(used))


def test_most_nodes_silent_at_once_holds_failovers(sim_cluster):
    cluster = sim_cluster()
    catalog_apply(entries=[{"name": "small", "engine": "sim", "model": "/m", "nodes": 1, "gpus_per_node": 8,
                            "replicas": 4}])
    wait_until(ready(4), timeout=60, message="four ready replicas")
    for name in ("node01", "node02", "node03"):
        cluster.freeze_agent(name)
    wait_until(lambda: Event.objects.filter(kind="control_plane", message__contains="went silent at once").exists(),
               timeout=GRACE + 15, message="the mass-silence warning")
    assert not Node.objects.filter(status=NodeStatus.LOST).exists()
    assert Replica.objects.filter(status=ReplicaStatus.READY).count() == 4
    assert not Replica.objects.filter(status=ReplicaStatus.FAILED).exists()
    for name in ("node01", "node02", "node03"):
        cluster.thaw_agent(name)
    wait_until(lambda: Event.objects.filter(kind="control_plane", message__contains="no longer holding").exists(),
               timeout=15, message="the hold released")
    assert not Node.objects.filter(status=NodeStatus.LOST).exists()


def test_fabric_less_node_never_receives_a_multi_node_member(sim_cluster):
    nodes = [SimNode("island1", "127.0.1.5"), SimNode("island2", "127.0.1.6"),
             SimNode("node01", "127.0.1.1", fabric="ib-a"), SimNode("node02", "127.0.1.2", fabric="ib-a")]
    sim_cluster(nodes)
    catalog_apply(entries=[{"name": "wide", "engine": "sim", "model": "/m", "nodes": 2, "gpus_per_node": 4,
                            "replicas": 3}])
    wait_until(ready(2), timeout=60, message="two ready 2-node replicas")
    assert not Member.objects.filter(node__name__startswith="island").exists()
    stuck = Replica.objects.get(status=ReplicaStatus.PENDING)
    assert "fabric" in stuck.pending_reason


def test_drain_replacement_ready_before_original_stops(sim_cluster):
    sim_cluster()
    catalog_apply(entries=[{"name": "small", "engine": "sim", "model": "/m", "nodes": 1, "gpus_per_node": 8,
                            "replicas": 2}])
    wait_until(ready(2), timeout=60, message="two ready replicas")
    original = Member.objects.filter(replica__status=ReplicaStatus.READY).select_related("node", "replica").first()
    drain = drain_start(node_name=original.node.name)
    wait_until(lambda: Drain.objects.get(pk=drain.pk).status == "done", timeout=90, message="the drain to finish")
    stopping = Event.objects.get(subject=f"replica/{original.replica_id}", data__to="stopping")
    replacement_ready = Event.objects.filter(kind="replica.status", data__to="ready",
                                             created_at__gt=drain.started_at).order_by("created_at").first()
    assert replacement_ready is not None and replacement_ready.created_at < stopping.created_at
    node = Node.objects.get(pk=original.node_id)
    assert node.status == NodeStatus.DRAINED
    assert not Member.objects.filter(node=node).exclude(state=MemberState.GONE).exists()
    assert not alive(original.pid)
    assert Replica.objects.filter(status=ReplicaStatus.READY).count() == 2


def test_rebuild_on_the_survivors_does_not_wait_for_the_dead_node(sim_cluster):
    """Three 6-GPU nodes in one fabric, a 2x4 replica, its rank-1 node killed
    with its engines. The group breaks and the leader's engine exits on its
    live node, which frees those GPUs at once: the replacement is ready on the
    surviving pair long before the dead node is declared lost (a 60 s grace
    here, so that 'before' is beyond doubt). The periodic reconcile is slowed
    to 10 minutes: what places the replacement is the GPUs coming free, not a
    timer that happens to run."""
    nodes = [SimNode(f"hx{i}", f"127.0.7.{i}", gpus=6, fabric="fab-x") for i in (1, 2, 3)]
    cluster = sim_cluster(nodes, grace=60, LLMGW_RECONCILE_INTERVAL="600")
    catalog_apply(entries=[{"name": "wide", "engine": "sim", "model": "/m", "nodes": 2, "gpus_per_node": 4,
                            "replicas": 1}])
    wait_until(ready(1), timeout=60, message="the 2x4 replica ready")
    original = Replica.objects.get(status=ReplicaStatus.READY)
    dead = original.members.select_related("node").get(rank=1).node.name
    survivors = {n.name for n in nodes} - {dead}

    cluster.kill_node(dead)

    wait_until(lambda: Replica.objects.filter(status=ReplicaStatus.READY).exclude(pk=original.pk).exists(),
               timeout=40, message="the replacement ready on the surviving pair")
    assert Node.objects.get(name=dead).status == NodeStatus.READY, "declared lost: the test proves nothing"
    replacement = Replica.objects.exclude(pk=original.pk).get(status=ReplicaStatus.READY)
    assert {m.node.name for m in replacement.members.select_related("node")} == survivors
    assert Replica.objects.get(pk=original.pk).status == ReplicaStatus.FAILED  # its dead member holds on, until lost
    used = [(m.node_id, g) for m in Member.objects.exclude(state=MemberState.GONE) for g in m.gpus]
    assert len(used) == len(set(used))
