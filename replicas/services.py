"""Writes to replicas: status, what the agents report, failure and reaping.

Scheduling lives in ``replicas.scheduling``, the catalog in
``replicas.catalog``, drains in ``replicas.drain``.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from nodes.choices import EventKind, EventSeverity
from nodes.models import Event, Node
from nodes.services import event_record, node_desired_changed

from .choices import PLACED, REPLICA_TRANSITIONS, MemberState, ReplicaStatus
from .models import GpuAllocation, Member, PortAllocation, Replica

logger = logging.getLogger(__name__)


class InvalidReplicaTransition(Exception):
    pass


def _after_commit_reconcile(countdown: float = 0) -> None:
    from . import tasks

    if countdown:
        transaction.on_commit(lambda: tasks.replicas_reconcile.apply_async(countdown=countdown))
    else:
        transaction.on_commit(lambda: tasks.replicas_reconcile.delay())


def member_wanted(replica: Replica) -> bool:
    """Whether a replica's members should still run on their nodes."""
    return replica.status in PLACED or (replica.status == ReplicaStatus.STOPPING and not replica.quiesced)


def _inflight(replica_id: int) -> int:
    try:
        from gateway.selectors import replica_inflight
    except ImportError:
        return 0
    return replica_inflight(replica_id)


def replicas_quiesce() -> None:
    """Stop the members of stopping replicas once no request is in flight on
    them, or once LLMGW_STOP_GRACE has passed, whichever comes first."""
    now = timezone.now()
    for replica in Replica.objects.filter(status=ReplicaStatus.STOPPING, quiesced=False):
        waited = (now - replica.status_changed_at).total_seconds()
        if waited < settings.LLMGW_ROUTING_SETTLE:
            continue
        inflight = _inflight(replica.pk)
        if inflight and waited < settings.LLMGW_STOP_GRACE:
            continue
        with transaction.atomic():
            if not Replica.objects.filter(pk=replica.pk, quiesced=False).update(quiesced=True):
                continue
            for node_name in replica.members.values_list("node__name", flat=True):
                node_desired_changed(node_name=node_name)
            if inflight:
                event_record(
                    kind=EventKind.REPLICA_STATUS, subject=f"replica/{replica.pk}", severity=EventSeverity.WARNING,
                    message=f"replica {replica.pk} stopped with {inflight} request(s) still in flight after "
                    f"{settings.LLMGW_STOP_GRACE:.0f}s (LLMGW_STOP_GRACE)",
                )


def replica_transition(
    *,
    replica_id: int,
    to: str,
    reason: str = "",
    expected: str | frozenset | set | None = None,
    severity: str = EventSeverity.INFO,
) -> Replica | None:
    """The one place a replica's status changes. With ``expected`` (a status
    or a set of them) it is a compare-and-set that returns None on a miss."""
    with transaction.atomic():
        replica = Replica.objects.select_for_update().select_related("model").filter(pk=replica_id).first()
        if replica is None:
            return None
        if expected is not None:
            allowed = {expected} if isinstance(expected, str) else set(expected)
            if replica.status not in allowed:
                return None
        if to not in REPLICA_TRANSITIONS.get(replica.status, set()):
            raise InvalidReplicaTransition(f"replica {replica} is {replica.status}; it cannot become {to}")
        previous = replica.status
        replica.status = to
        replica.status_changed_at = timezone.now()
        replica.status_reason = reason
        fields = ["status", "status_changed_at", "status_reason"]
        if to == ReplicaStatus.READY:
            replica.ready_at = replica.status_changed_at
            fields.append("ready_at")
        if to == ReplicaStatus.SCHEDULED:
            replica.pending_reason = ""
            fields.append("pending_reason")
        replica.save(update_fields=fields)
        event_record(
            kind=EventKind.REPLICA_STATUS,
            subject=f"replica/{replica.pk}",
            message=f"{replica.model.name} replica {replica.pk}: {previous} -> {to}" + (f": {reason}" if reason else ""),
            severity=severity,
            data={"model": replica.model.name, "replica": replica.pk, "from": previous, "to": to},
        )
        if to == ReplicaStatus.READY:
            # A drain may be waiting for exactly this replica.
            _after_commit_reconcile()
        if previous in PLACED and to == ReplicaStatus.FAILED:
            # Its members leave their nodes' desired state: the agents stop them.
            for node_name in replica.members.values_list("node__name", flat=True):
                node_desired_changed(node_name=node_name)
            _after_commit_reconcile()
        if to == ReplicaStatus.STOPPING:
            # Routing stops now; the members stop once in-flight requests are done.
            _after_commit_reconcile(countdown=settings.LLMGW_ROUTING_SETTLE)
    return replica


def replicas_transition_scheduled(*, replicas: list[Replica], reasons: dict[int, str]) -> None:
    """pending -> scheduled for a batch of placements: the same checks and
    Events as replica_transition, in a few statements. The rows are locked
    by the caller."""
    now = timezone.now()
    events = []
    for replica in replicas:
        if ReplicaStatus.SCHEDULED not in REPLICA_TRANSITIONS[replica.status]:
            raise InvalidReplicaTransition(f"replica {replica} is {replica.status}; it cannot become scheduled")
        previous = replica.status
        replica.status, replica.status_changed_at = ReplicaStatus.SCHEDULED, now
        replica.status_reason, replica.pending_reason = reasons[replica.pk], ""
        message = f"{replica.model.name} replica {replica.pk}: {previous} -> scheduled: {replica.status_reason}"
        logger.info("event kind=%s subject=replica/%s %s", EventKind.REPLICA_STATUS, replica.pk, message)
        events.append(Event(kind=EventKind.REPLICA_STATUS, subject=f"replica/{replica.pk}", message=message,
                            data={"model": replica.model.name, "replica": replica.pk, "from": previous,
                                  "to": ReplicaStatus.SCHEDULED}))
    # A few plain UPDATEs, one per fabric, rather than a CASE per row: the
    # members and the Event say exactly where each replica went.
    by_fabric: dict = {}
    for replica in replicas:
        by_fabric.setdefault(replica.fabric, []).append(replica.pk)
    for fabric, ids in by_fabric.items():
        Replica.objects.filter(pk__in=ids).update(
            status=ReplicaStatus.SCHEDULED, status_changed_at=now, pending_reason="", fabric=fabric,
            status_reason=f"placed on {fabric.name if fabric else 'a fabric-less node'}",
        )
    Event.objects.bulk_create(events, batch_size=500)


def replica_fail(*, replica_id: int, reason: str) -> Replica | None:
    """Fail a placed replica; its members are reaped and a replacement is
    scheduled at once (by the reconcile enqueued on commit)."""
    return replica_transition(
        replica_id=replica_id, to=ReplicaStatus.FAILED, reason=reason, expected=PLACED, severity=EventSeverity.ERROR
    )


def member_release(*, member: Member, reason: str) -> None:
    """The member no longer runs: free its GPUs and ports."""
    GpuAllocation.objects.filter(member=member).delete()
    PortAllocation.objects.filter(member=member).delete()
    member.state = MemberState.GONE
    member.save(update_fields=["state"])
    logger.info("member released replica=%s rank=%s node=%s: %s", member.replica_id, member.rank, member.node_id, reason)


def _replica_settle(replica: Replica) -> None:
    """Advance a replica from what its members now say."""
    members = list(replica.members.select_related("node").order_by("rank"))
    if replica.status in PLACED:
        exited = [m for m in members if m.state == MemberState.EXITED]
        if exited:
            m = exited[0]
            last = next((line for line in reversed(m.log_tail or []) if line.strip()), "")
            code = "an unknown status" if m.exit_code is None else f"status {m.exit_code}"
            replica_fail(
                replica_id=replica.pk,
                reason=f"rank {m.rank} on {m.node.name} exited with {code}" + (f": {last}" if last else ""),
            )
            return
        running = all(m.state == MemberState.RUNNING for m in members)
        if replica.status == ReplicaStatus.SCHEDULED and running:
            replica_transition(
                replica_id=replica.pk, to=ReplicaStatus.STARTING, expected=ReplicaStatus.SCHEDULED,
                reason="every member is running",
            )
            replica.refresh_from_db()
        leader = members[0] if members else None
        if replica.status == ReplicaStatus.STARTING and running and leader is not None and leader.healthy:
            replica_transition(
                replica_id=replica.pk, to=ReplicaStatus.READY, expected=ReplicaStatus.STARTING,
                reason=f"the leader on {leader.node.name} passes its health check",
            )
        return
    if replica.status in (ReplicaStatus.FAILED, ReplicaStatus.STOPPING):
        if all(m.state == MemberState.GONE for m in members):
            replica_transition(
                replica_id=replica.pk, to=ReplicaStatus.STOPPED, expected=replica.status,
                reason="every member has stopped; GPUs and ports are free",
            )


def members_report(*, node: Node, engines: list[dict[str, Any]]) -> None:
    """Apply an agent's report of its engines (inside the heartbeat's transaction)."""
    reported = {e["member"]: e for e in engines}
    now = timezone.now()
    touched: set[int] = set()
    members = (
        Member.objects.select_for_update()
        .filter(node=node)
        .exclude(state=MemberState.GONE)
        .select_related("replica")
    )
    for member in members:
        engine = reported.get(member.member_id)
        if member.replica.status not in PLACED:
            # Stopping or failed: once its engine is gone, its GPUs are free.
            if engine is None or engine["state"] == "exited":
                member_release(member=member, reason="stopped by its agent")
                touched.add(member.replica_id)
            continue
        if engine is None:
            if member.state in (MemberState.RUNNING, MemberState.STARTING):
                member.state = MemberState.EXITED
                member.healthy = False
                member.save(update_fields=["state", "healthy"])
                touched.add(member.replica_id)
            continue
        state = {"starting": MemberState.STARTING, "running": MemberState.RUNNING}.get(engine["state"], MemberState.EXITED)
        changes = {
            "state": state,
            "pid": engine.get("pid"),
            "exit_code": engine.get("exit_code"),
            "healthy": bool(engine.get("healthy")) and state == MemberState.RUNNING,
            "log_tail": engine.get("log_tail") or [],
        }
        if any(getattr(member, k) != v for k, v in changes.items() if k != "log_tail") or state == MemberState.EXITED:
            touched.add(member.replica_id)
        for key, value in changes.items():
            setattr(member, key, value)
        member.reported_at = now
        member.save(update_fields=[*changes, "reported_at"])
    for replica in Replica.objects.filter(pk__in=touched).select_related("model"):
        _replica_settle(replica)


def replicas_node_lost(*, node_name: str) -> None:
    """A node was declared lost: every replica with a member on it fails; that
    member's GPUs are freed now (the node runs nothing we will count on, and
    when it returns it starts empty and stops what it still runs)."""
    with transaction.atomic():
        members = list(
            Member.objects.select_for_update()
            .filter(node__name=node_name)
            .exclude(state=MemberState.GONE)
            .select_related("replica", "replica__model")
        )
        for member in members:
            replica = member.replica
            if replica.status in PLACED:
                replica_fail(replica_id=replica.pk, reason=f"node {node_name} was lost (rank {member.rank})")
            member_release(member=member, reason=f"node {node_name} lost")
        for replica in {m.replica for m in members}:
            replica.refresh_from_db()
            _replica_settle(replica)
