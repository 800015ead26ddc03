"""An engine in crash-loop backoff, as its agent reports it: the replica
waits while its agent restarts it, shows the exit status and last lines, and
fails after LLMGW_ENGINE_START_ATTEMPTS failed starts, not before."""

from __future__ import annotations

import pytest
from django.db import transaction

from replicas import reconcile, services
from replicas.catalog import catalog_apply
from replicas.choices import MemberState, ReplicaStatus
from replicas.models import Member, Replica
from tests.factories import node_with_gpus

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_reconcile_enqueue")]


def _report(member: Member, **engine):
    with transaction.atomic():
        services.members_report(node=member.node, engines=[{
            "member": member.member_id, "replica": str(member.replica_id), "rank": member.rank, **engine}])


def test_backoff_waits_then_fails_with_the_exit_status_and_last_line(settings):
    settings.LLMGW_ENGINE_START_ATTEMPTS = 3
    node = node_with_gpus("node01", gpus=2, addr="127.0.1.1")
    catalog_apply(entries=[{"name": "m", "engine": "sim", "model": "/m", "gpus_per_node": 1, "replicas": 1}])
    reconcile.replicas_reconcile()
    member = Member.objects.select_related("node").get(node=node)
    tail = ["usage: llmgw sim engine ...", "error: argument --token-delay: invalid float value: 'slow'"]
    for restarts in (0, 1):
        _report(member, state="backoff", exit_code=2, restarts=restarts, log_tail=tail)
        replica = Replica.objects.get(pk=member.replica_id)
        assert replica.status == ReplicaStatus.SCHEDULED, "its agent is restarting it"
        member.refresh_from_db()
        assert (member.state, member.exit_code, member.restarts) == (MemberState.BACKOFF, 2, restarts)
        assert member.log_tail == tail
    _report(member, state="backoff", exit_code=2, restarts=2, log_tail=tail)
    replica = Replica.objects.get(pk=member.replica_id)
    assert replica.status in (ReplicaStatus.FAILED, ReplicaStatus.STOPPED)
    assert replica.failed_reason == ("rank 0 on node01 failed at start 3 times (exited with status 2), giving up: "
                                     "error: argument --token-delay: invalid float value: 'slow'")


def test_backoff_of_a_ready_replica_is_an_exit(settings):
    node = node_with_gpus("node01", gpus=2, addr="127.0.1.1")
    catalog_apply(entries=[{"name": "m", "engine": "sim", "model": "/m", "gpus_per_node": 1, "replicas": 1}])
    reconcile.replicas_reconcile()
    member = Member.objects.select_related("node").get(node=node)
    for _ in range(2):
        _report(member, state="running", pid=10, healthy=True)
    assert Replica.objects.get(pk=member.replica_id).status == ReplicaStatus.READY
    _report(member, state="backoff", exit_code=1, restarts=0, log_tail=["boom"])
    replica = Replica.objects.get(pk=member.replica_id)
    assert replica.status in (ReplicaStatus.FAILED, ReplicaStatus.STOPPED)
    assert "exited with status 1: boom" in replica.failed_reason
