"""Revisions and rollouts through the services on PostgreSQL: a change of a
model's launch reaches its running replicas, replacement first; pause,
resume, undo; a broken revision stops after the bound."""

from __future__ import annotations

import pytest
from django.db import transaction

from core.models import Event
from nodes.choices import NodeStatus
from nodes.models import Node
from replicas import reconcile, rollout, services
from replicas.catalog import catalog_apply
from replicas.choices import MemberState, ReplicaStatus, RolloutStatus
from replicas.exceptions import InvalidRolloutTransition
from replicas.models import CatalogEntry, Member, ModelRevision, Replica, Rollout
from tests.factories import node_with_gpus

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_reconcile_enqueue")]

ENTRY = {"name": "llama", "engine": "sim", "model": "/m", "nodes": 1, "gpus_per_node": 4, "replicas": 4}


@pytest.fixture(autouse=True)
def _no_settle(settings):
    settings.LLMGW_ROUTING_SETTLE = 0
    settings.LLMGW_ROLLOUT_MAX_FAILURES = 2


def _report_all(broken: str | None = None):
    """Every live node's agent reports its members running and healthy (the
    ones it was told to stop, gone); a member whose argv holds ``broken``
    exited with status 2 at start."""
    for _ in range(2):
        for node in Node.objects.exclude(status=NodeStatus.LOST):
            engines = []
            for member in Member.objects.filter(node=node).exclude(state=MemberState.GONE).select_related("replica"):
                if member.replica.status in (ReplicaStatus.FAILED, ReplicaStatus.STOPPED) or (
                        member.replica.status == ReplicaStatus.STOPPING and member.replica.quiesced):
                    continue
                bad = broken is not None and broken in member.argv
                engines.append({"member": member.member_id, "replica": str(member.replica_id), "rank": member.rank,
                                "state": "exited" if bad else "running", "pid": 100 + member.pk,
                                "exit_code": 2 if bad else None, "healthy": not bad,
                                "log_tail": ["error: argument --token-delay: invalid float value: " + broken] if bad else []})
            with transaction.atomic():
                services.members_report(node=node, engines=engines)


def _ready(model="llama"):
    return list(Replica.objects.filter(model__name=model, status=ReplicaStatus.READY))


def _settle(rounds=1, broken=None, watch=None):
    for _ in range(rounds):
        reconcile.replicas_reconcile()
        _report_all(broken)
        if watch is not None:
            watch.append(len([r for r in _ready() if not r.draining or r.status == ReplicaStatus.READY]))


def _argvs(model="llama"):
    return {tuple(m.argv) for m in Member.objects.filter(replica__model__name=model,
                                                         replica__status=ReplicaStatus.READY)}


@pytest.fixture
def spare():
    """Room for two more replicas than the model wants (6 nodes of 4 GPUs)."""
    for i in range(6):
        node_with_gpus(f"node{i:02d}", gpus=4, addr=f"127.0.1.{i + 1}")
    catalog_apply(entries=[ENTRY])
    _settle(3)
    assert len(_ready()) == 4


def test_a_revision_is_recorded_per_launch_change_and_on_each_replica(spare):
    model = CatalogEntry.objects.get(name="llama")
    assert model.revision == 1
    assert {r.revision.number for r in _ready()} == {1}
    catalog_apply(entries=[{**ENTRY, "replicas": 5}])  # not launch-relevant
    assert CatalogEntry.objects.get(name="llama").revision == 1
    catalog_apply(entries=[{**ENTRY, "replicas": 5, "max_surge": 2}])
    assert CatalogEntry.objects.get(name="llama").revision == 1
    assert not Rollout.objects.exists()
    catalog_apply(entries=[{**ENTRY, "args": ["--token-delay", "0.01"]}])
    assert CatalogEntry.objects.get(name="llama").revision == 2
    assert ModelRevision.objects.filter(model=model).count() == 2
    assert Rollout.objects.get().to_revision == 2


def test_a_change_of_args_replaces_every_replica_never_below_wanted(spare):
    before = _argvs()
    catalog_apply(entries=[{**ENTRY, "args": ["--token-delay", "0.01"]}])
    ready_counts = []
    for _ in range(20):
        reconcile.replicas_reconcile()
        ready_counts.append(len(_ready()))
        _report_all()
        ready_counts.append(len(_ready()))
        if Rollout.objects.get().status == RolloutStatus.DONE:
            break
    done = Rollout.objects.get()
    assert done.status == RolloutStatus.DONE, done.log
    assert min(ready_counts) >= 4, ready_counts
    assert {r.revision.number for r in _ready()} == {2}
    after = _argvs()
    assert all("0.01" in argv for argv in after) and after.isdisjoint(before)
    messages = list(Event.objects.filter(kind="rollout").values_list("message", flat=True))
    assert any("llama revision 1 -> 2: replica" in m and "stopping (" in m and "of 4)" in m for m in messages), messages


def test_no_spare_capacity_keeps_at_most_max_unavailable_down():
    for i in range(4):
        node_with_gpus(f"node{i:02d}", gpus=4, addr=f"127.0.1.{i + 1}")
    catalog_apply(entries=[ENTRY])
    _settle(3)
    assert len(_ready()) == 4
    catalog_apply(entries=[{**ENTRY, "args": ["--token-delay", "0.01"]}])
    counts = []
    for _ in range(30):
        reconcile.replicas_reconcile()
        counts.append(len(_ready()))
        _report_all()
        counts.append(len(_ready()))
        if Rollout.objects.get().status == RolloutStatus.DONE:
            break
    assert Rollout.objects.get().status == RolloutStatus.DONE, Rollout.objects.get().log
    assert min(counts) >= 3, counts
    assert {r.revision.number for r in _ready()} == {2}
    assert Event.objects.filter(kind="rollout", message__contains="no room to surge").exists()


def test_a_broken_revision_stops_after_the_bound_and_the_old_replicas_serve(spare):
    old = {r.pk for r in _ready()}
    # A launch the catalog accepts and the engine refuses at start (status 2,
    # as for weights that are not there): the agents' reports are this test's.
    catalog_apply(entries=[{**ENTRY, "args": ["--prefill-overhead", "0.0421"]}])
    for _ in range(12):
        _settle(broken="0.0421")
    failed = Rollout.objects.get()
    assert failed.status == RolloutStatus.FAILED, failed.log
    assert "failed before becoming ready" in failed.status_reason
    assert "exited with status 2" in failed.status_reason
    assert {r.pk for r in _ready()} == old
    assert not Replica.objects.filter(model__name="llama", draining=True).exclude(status=ReplicaStatus.STOPPED).exists()
    # Nothing more of the broken revision is tried; a lost replica is rebuilt as the old revision.
    _settle(3, broken="0.0421")
    assert {r.pk for r in _ready()} == old
    # Undo: back to revision 1's launch, as revision 3; nothing to replace.
    model, again = rollout.rollout_undo(name="llama", actor="ops")
    assert model.revision == 3 and model.args == [] and again is None
    assert Rollout.objects.get().status == RolloutStatus.SUPERSEDED


def test_pause_holds_resume_continues_undo_returns_to_the_old_argv(spare):
    before = _argvs()
    catalog_apply(entries=[{**ENTRY, "args": ["--token-delay", "0.01"]}])
    _settle(2)
    rollout.rollout_pause(name="llama", actor="ops")
    with pytest.raises(InvalidRolloutTransition):
        rollout.rollout_pause(name="llama")
    _settle(2)
    held = sorted(r.revision.number for r in _ready())
    _settle(4)
    assert sorted(r.revision.number for r in _ready()) == held
    assert 2 in held and 1 in held
    assert Rollout.objects.get().status == RolloutStatus.PAUSED
    rollout.rollout_resume(name="llama", actor="ops")
    _settle(12)
    assert Rollout.objects.get().status == RolloutStatus.DONE
    assert {r.revision.number for r in _ready()} == {2}
    model, undo = rollout.rollout_undo(name="llama", actor="ops")
    assert model.revision == 3 and undo is not None
    _settle(14)
    assert Rollout.objects.first().status == RolloutStatus.DONE
    # The old argv: no --token-delay any more (ports and nodes differ, as with any new replica).
    assert all("--token-delay" not in argv for argv in _argvs())
    assert all("--token-delay" not in argv for argv in before)
    with pytest.raises(InvalidRolloutTransition):
        rollout.rollout_resume(name="llama")


def test_a_new_apply_on_a_paused_rollout_starts_paused_and_undo_waits_for_resume(spare):
    catalog_apply(entries=[{**ENTRY, "args": ["--token-delay", "0.01"]}])
    _settle(2)
    rollout.rollout_pause(name="llama", actor="ops")
    _settle(3)  # what was under way finishes
    held = sorted((r.pk, r.revision.number) for r in _ready())
    assert {n for _, n in held} == {1, 2}
    result = catalog_apply(entries=[{**ENTRY, "args": ["--token-delay", "0.02"]}], actor="ops")
    assert result["updated"] == ["llama"]
    assert result["rollouts"] == [{"model": "llama", "from_revision": 1, "to_revision": 3, "status": "paused"}]
    old, new = Rollout.objects.order_by("pk")
    assert old.status == RolloutStatus.SUPERSEDED and "the new rollout starts paused" in old.status_reason
    assert new.status == RolloutStatus.PAUSED and new.status_reason == "paused: the rollout it superseded was paused"
    assert "started paused by ops (args changed)" in new.log[-1]
    assert "'llmgw ctl rollout resume llama' carries it on" in new.log[-1]
    # Paused: nothing more is replaced, whatever the change.
    _settle(4)
    assert sorted((r.pk, r.revision.number) for r in _ready()) == held
    assert Rollout.objects.get(pk=new.pk).status == RolloutStatus.PAUSED
    assert Rollout.objects.get(pk=new.pk).waiting_for.startswith("paused:")
    # As kubectl: no undo of a paused rollout; resume first.
    with pytest.raises(InvalidRolloutTransition, match="while it is paused .*resume it first"):
        rollout.rollout_undo(name="llama", actor="ops")
    assert CatalogEntry.objects.get(name="llama").revision == 3
    rollout.rollout_resume(name="llama", actor="ops")
    _settle(16)
    assert Rollout.objects.get(pk=new.pk).status == RolloutStatus.DONE
    assert {r.revision.number for r in _ready()} == {3} and len(_ready()) == 4
    # A change to a running rollout starts a running one, as before.
    catalog_apply(entries=[{**ENTRY, "args": ["--token-delay", "0.03"]}])
    _settle(1)
    assert catalog_apply(entries=[{**ENTRY, "args": ["--token-delay", "0.04"]}])["rollouts"][0]["status"] == "running"


def test_a_launch_changed_outside_the_catalog_services_is_rolled_out_by_the_reconcile(spare):
    CatalogEntry.objects.filter(name="llama").update(args=["--token-delay", "0.01"])  # a shell, SQL
    _settle(14)
    model = CatalogEntry.objects.get(name="llama")
    assert model.revision == 2
    done = Rollout.objects.get()
    assert done.status == RolloutStatus.DONE and done.actor == "reconcile"
    assert "started by reconcile (args changed)" in done.log[0]
    assert Event.objects.filter(message__contains="changed outside the catalog's services").exists()
    assert {r.revision.number for r in _ready()} == {2} and len(_ready()) == 4


def test_a_removed_model_goes_with_its_revisions_and_rollouts(spare):
    from replicas.catalog import model_remove

    catalog_apply(entries=[{**ENTRY, "args": ["--token-delay", "0.01"]}])
    _settle(2)
    model_remove(name="llama")
    _settle(6)
    assert not CatalogEntry.objects.filter(name="llama").exists()
    assert not ModelRevision.objects.exists() and not Rollout.objects.exists()
    assert not Replica.objects.exists()
