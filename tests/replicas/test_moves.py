"""Moves that make room (replicas.moves), through the services, on the demo's
catalog and topology: replacement first, original stopped once its model has
its ready replicas without it, then the pending replica placed."""

from __future__ import annotations

import pytest
import yaml

from cli.demo import SAMPLE_CATALOG
from core.models import Event
from nodes.choices import NodeStatus
from nodes.services import node_transition
from replicas import reconcile, services
from replicas.catalog import catalog_apply
from replicas.choices import PLACED, ReplicaStatus
from replicas.models import Member, ModelRevision, Replica
from replicas.weights_cache import node_weights_report

from .test_services import _no_settle, _placement, _report, seeds_cluster  # noqa: F401 - fixtures

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_reconcile_enqueue")]


def _ready(model: str) -> int:
    return Replica.objects.filter(model__name=model, status=ReplicaStatus.READY).count()


def _converge(nodes, times: int = 2) -> None:
    for _ in range(times):
        for node in nodes.values():
            if node.name in {n.name for n in type(node).objects.filter(status=NodeStatus.READY)}:
                _report(node)


@pytest.fixture
def demo(seeds_cluster):  # noqa: F811 - the fixture imported above
    catalog_apply(entries=yaml.safe_load(SAMPLE_CATALOG)["models"], prune=False)
    reconcile.replicas_reconcile()
    _converge(seeds_cluster)
    assert _ready("llama-70b-sim") == 2 and _ready("qwen-7b-sim") == 2
    qwen = {r.pk: set(_placement(r)) for r in Replica.objects.filter(model__name="qwen-7b-sim")}
    assert sorted(qwen.values(), key=sorted) == [{"node01"}, {"node03"}]  # as on the demo
    return seeds_cluster


def _lose(nodes, name: str) -> None:
    held = list(Replica.objects.filter(members__node__name=name).distinct())
    node_transition(node_name=name, to=NodeStatus.LOST, reason="test")
    services.replicas_node_lost(node_name=name)
    for replica in held:
        for member in replica.members.exclude(node__name=name).select_related("node"):
            _report(member.node, **{member.member_id: (None, False)})


def test_demo_node02_lost_the_qwen_replica_moves_and_llama_comes_back_on_ib_b(demo):
    _lose(demo, "node02")
    reconcile.replicas_reconcile()

    # The move has started: the replacement on node01, the original still ready on node03.
    original = Replica.objects.get(model__name="qwen-7b-sim", draining=True)
    assert set(_placement(original)) == {"node03"} and original.status == ReplicaStatus.READY
    replacement = Replica.objects.get(model__name="qwen-7b-sim", status=ReplicaStatus.SCHEDULED)
    assert set(_placement(replacement)) == {"node01"}
    llama = Replica.objects.get(model__name="llama-70b-sim", status=ReplicaStatus.PENDING)
    event = Event.objects.get(subject=f"replica/{original.pk}", message__startswith="moving")
    assert event.message == (
        f"moving qwen-7b-sim replica {original.pk} from node03 to node01 to make room for "
        f"llama-70b-sim replica {llama.pk} on ib-b (replacement: replica {replacement.pk})"
    )
    assert "making room: qwen-7b-sim replica" in Replica.objects.get(pk=llama.pk).pending_reason
    assert _ready("qwen-7b-sim") == 2

    reconcile.replicas_reconcile()  # nothing new while a move is in flight
    assert Replica.objects.filter(model__name="qwen-7b-sim").count() == 3
    assert Replica.objects.get(pk=original.pk).status == ReplicaStatus.READY

    _converge(demo)  # the replacement starts and passes its health check
    assert _ready("qwen-7b-sim") == 3
    reconcile.replicas_reconcile()
    assert Replica.objects.get(pk=original.pk).status == ReplicaStatus.STOPPING
    assert _ready("qwen-7b-sim") == 2  # never fewer than before
    reconcile.replicas_reconcile()  # quiesced: no request in flight
    _report(demo["node03"], **{m.member_id: (None, False) for m in original.members.all()})
    assert Replica.objects.get(pk=original.pk).status == ReplicaStatus.STOPPED

    reconcile.replicas_reconcile()
    llama.refresh_from_db()
    assert llama.status == ReplicaStatus.SCHEDULED and llama.fabric.name == "ib-b"
    assert set(_placement(llama)) == {"node03", "node04"}
    assert Replica.objects.filter(model__name="qwen-7b-sim").exclude(status=ReplicaStatus.STOPPED).count() == 2


def test_no_move_helps_the_replica_stays_pending_with_the_reason(demo):
    _lose(demo, "node02")
    _lose(demo, "node04")
    reconcile.replicas_reconcile()

    assert not Replica.objects.filter(draining=True).exists()
    pending = Replica.objects.filter(model__name="llama-70b-sim", status=ReplicaStatus.PENDING)
    assert pending.count() == 2
    for replica in pending:
        assert replica.pending_reason.endswith(
            "; no set of moves makes room (ib-a: 1 schedulable node(s) of 4+ GPUs; "
            "ib-b: 1 schedulable node(s) of 4+ GPUs)"
        ), replica.pending_reason
    events = Event.objects.filter(message__contains="no set of moves").count()
    reconcile.replicas_reconcile()
    assert Event.objects.filter(message__contains="no set of moves").count() == events  # said once


def test_off_with_the_setting(demo, settings):
    settings.LLMGW_DEFRAG = False
    _lose(demo, "node02")
    reconcile.replicas_reconcile()
    assert not Replica.objects.filter(draining=True).exists()
    assert not Member.objects.filter(node__name="node01", replica__model__name="qwen-7b-sim",
                                     replica__status=ReplicaStatus.SCHEDULED).exists()


def test_never_more_moves_at_once_than_the_setting(seeds_cluster, settings):  # noqa: F811
    settings.LLMGW_DEFRAG_MAX_MOVES = 1
    catalog_apply(entries=[
        {"name": "a-small", "engine": "sim", "model": "/m/small", "nodes": 1, "gpus_per_node": 1, "replicas": 4},
    ], prune=False)
    reconcile.replicas_reconcile()
    _converge(seeds_cluster)
    assert _ready("a-small") == 4  # one on each node: none has 8 free
    catalog_apply(entries=[
        {"name": "z-big", "engine": "sim", "model": "/m/big", "nodes": 2, "gpus_per_node": 8, "replicas": 1},
    ], prune=False)

    reconcile.replicas_reconcile()
    # Two moves would make room on ib-a; one at a time.
    moving = Replica.objects.get(draining=True)
    assert set(_placement(moving)) <= {"node01", "node02"}
    reconcile.replicas_reconcile()
    assert Replica.objects.filter(draining=True).count() == 1

    for _ in range(3):  # each move: replacement ready, original stopped, then the next
        _converge(seeds_cluster)
        reconcile.replicas_reconcile()
        reconcile.replicas_reconcile()
        for replica in Replica.objects.filter(draining=True, status=ReplicaStatus.STOPPING):
            for member in replica.members.select_related("node"):
                _report(member.node, **{member.member_id: (None, False)})
        assert Replica.objects.filter(draining=True, status__in=[ReplicaStatus.READY]).count() <= 1
        reconcile.replicas_reconcile()
        assert _ready("a-small") >= 4
    big = Replica.objects.get(model__name="z-big")
    assert big.status in PLACED and set(_placement(big)) == {"node01", "node02"}
    assert Replica.objects.filter(draining=True).count() == 2


def test_gpus_freed_by_a_stopped_replica_trigger_a_reconcile(demo, no_reconcile_enqueue,
                                                              django_capture_on_commit_callbacks):
    """Capacity changed: the pending replicas are placed, or their reasons written again, at once."""
    asked = no_reconcile_enqueue
    del asked[:]  # what placing the demo asked for
    qwen = Replica.objects.filter(model__name="qwen-7b-sim").first()
    services.replica_transition(replica_id=qwen.pk, to=ReplicaStatus.STOPPING, reason="test")
    with django_capture_on_commit_callbacks(execute=True):
        _report(qwen.members.get().node, **{m.member_id: (None, False) for m in qwen.members.all()})
    assert Replica.objects.get(pk=qwen.pk).status == ReplicaStatus.STOPPED
    assert 0.0 in asked, "no reconcile asked for at once when the GPUs were freed"


def test_a_replica_with_managed_weights_moves_only_where_they_are_or_can_be(demo):
    """As if qwen's weights were managed: node01, where the move would put
    its replica, keeps no weights cache, so no move is made; once node01
    holds them, the move goes there and the replacement starts without staging."""
    manifest = {"kind": "http", "revision": "r1", "total_bytes": 3000,
                "files": [{"name": "w.bin", "size": 3000, "sha256": "a" * 64, "url": "http://127.0.0.1:9/w.bin"}]}
    for revision in ModelRevision.objects.filter(model__name="qwen-7b-sim"):
        revision.spec = {**revision.spec, "source": {"kind": "http", "url": "http://127.0.0.1:9/"}}
        revision.manifest = manifest
        revision.save(update_fields=["spec", "manifest"])
    _lose(demo, "node02")
    reconcile.replicas_reconcile()

    assert not Replica.objects.filter(draining=True).exists()
    llama = Replica.objects.get(model__name="llama-70b-sim", status=ReplicaStatus.PENDING)
    assert ("ib-b: qwen-7b-sim replica" in llama.pending_reason and "(1 GPUs) would fit nowhere else that holds "
            "or has room for its weights (qwen-7b-sim@r1)" in llama.pending_reason), llama.pending_reason

    node_weights_report(node_name="node01", report={
        "free_bytes": 0, "budget_bytes": 10**6, "used_bytes": 3000, "downloads": 0,
        "models": [{"model": "qwen-7b-sim", "revision": "r1", "bytes": 3000, "total": 3000, "complete": True,
                    "rate": 0.0, "error": ""}]})
    reconcile.replicas_reconcile()
    original = Replica.objects.get(model__name="qwen-7b-sim", draining=True)
    assert set(_placement(original)) == {"node03"}
    # node01 holds the weights: scheduled, no staging.
    replacement = Replica.objects.get(model__name="qwen-7b-sim", status=ReplicaStatus.SCHEDULED)
    assert set(_placement(replacement)) == {"node01"}
