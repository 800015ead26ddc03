"""Writes to replicas: status, what the agents report, failure and reaping.

Scheduling lives in ``replicas.scheduling``, the catalog in
``replicas.catalog``, drains in ``replicas.drain``, the reconciler in
``replicas.reconcile``.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core.choices import EventSeverity
from core.events import event_record
from core.statemachine import StateMachine
from nodes.choices import LIVE
from nodes.models import Node
from nodes.services import nodes_desired_changed

from . import hooks
from .choices import PLACED, REPLICA_TRANSITIONS, MemberState, ReplicaEventKind, ReplicaStatus
from .enqueue import reconcile_after_commit
from .exceptions import InvalidReplicaTransition
from .models import GpuAllocation, Member, PortAllocation, Replica

logger = logging.getLogger(__name__)


def replicas_quiesce() -> None:
    """Stop the members of stopping replicas, and the live members of failed
    ones that may still serve (``replica_fail(..., finish_inflight=True)``),
    once no request is in flight on them, or once LLMGW_STOP_GRACE has
    passed, whichever comes first; never before LLMGW_ROUTING_SETTLE, so
    that every gateway has stopped routing to them."""
    now = timezone.now()
    for replica in Replica.objects.filter(status__in=[ReplicaStatus.STOPPING, ReplicaStatus.FAILED], quiesced=False):
        waited = (now - replica.status_changed_at).total_seconds()
        if waited < settings.LLMGW_ROUTING_SETTLE:
            continue
        inflight = hooks.replica_inflight(replica_id=replica.pk)
        if inflight and waited < settings.LLMGW_STOP_GRACE:
            continue
        with transaction.atomic():
            if not Replica.objects.filter(pk=replica.pk, quiesced=False).update(quiesced=True):
                continue
            nodes_desired_changed(node_names=list(
                replica.members.exclude(state=MemberState.GONE).values_list("node__name", flat=True)))
            what = "stopped" if replica.status == ReplicaStatus.STOPPING else "failed, its live members stopped"
            if inflight:
                event_record(
                    kind=ReplicaEventKind.REPLICA_STATUS, subject=f"replica/{replica.pk}", severity=EventSeverity.WARNING,
                    message=f"replica {replica.pk} {what} with {inflight} request(s) still in flight after "
                    f"{settings.LLMGW_STOP_GRACE:.0f}s (LLMGW_STOP_GRACE)",
                )
            elif replica.status == ReplicaStatus.FAILED:
                event_record(
                    kind=ReplicaEventKind.REPLICA_STATUS, subject=f"replica/{replica.pk}",
                    message=f"replica {replica.pk} failed: no request in flight on it any more, its live members stop",
                )


class ReplicaStates(StateMachine):
    noun = "replica"
    table = REPLICA_TRANSITIONS
    error = InvalidReplicaTransition
    event_kind = ReplicaEventKind.REPLICA_STATUS

    def subject(self, replica: Replica) -> str:
        return f"replica/{replica.pk}"

    def message(self, replica: Replica, previous: str, to: str, reason: str) -> str:
        return f"{replica.model.name} replica {replica.pk}: " + super().message(replica, previous, to, reason)

    def data(self, replica: Replica, previous: str, to: str) -> dict[str, Any]:
        return {"model": replica.model.name, "replica": replica.pk, "from": previous, "to": to}

    def changing(self, replica: Replica, previous: str, to: str) -> list[str]:
        if to == ReplicaStatus.READY:
            replica.ready_at = replica.status_changed_at
            return ["ready_at"]
        if to == ReplicaStatus.SCHEDULED:
            replica.pending_reason = ""
            return ["pending_reason"]
        if to == ReplicaStatus.FAILED:
            # Counted by a rollout when it was never ready (replicas.rollout).
            replica.failed_reason = replica.status_reason
            return ["failed_reason"]
        return []

    def changed(self, replica: Replica, previous: str, to: str) -> None:
        if to == ReplicaStatus.READY:
            # A drain may be waiting for exactly this replica.
            reconcile_after_commit()
        if previous in PLACED and to == ReplicaStatus.FAILED:
            # Its members leave their nodes' desired state: the agents stop them.
            nodes_desired_changed(node_names=list(replica.members.values_list("node__name", flat=True)))
            reconcile_after_commit()
        if to == ReplicaStatus.STOPPED and previous != ReplicaStatus.PENDING:
            # Its GPUs are free: a pending replica may fit now, and its reason changes.
            reconcile_after_commit()
        if to == ReplicaStatus.STOPPING:
            # Routing stops now; the members stop once in-flight requests are done.
            reconcile_after_commit(countdown=settings.LLMGW_ROUTING_SETTLE)


REPLICA_STATES = ReplicaStates()


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
    return REPLICA_STATES.transition(
        Replica.objects.select_related("model").filter(pk=replica_id),
        to=to, reason=reason, expected=expected, severity=severity,
    )


def replicas_transition_scheduled(*, replicas: list[Replica], reasons: dict[int, str]) -> None:
    """pending -> scheduled for a batch of placements, under the same rules and
    with the same Events as replica_transition, in a few statements. The rows
    are locked by the caller, which has set each one's fabric."""
    REPLICA_STATES.apply_many(replicas, to=ReplicaStatus.SCHEDULED, reasons=reasons, also=("fabric",))


def replica_fail(*, replica_id: int, reason: str, finish_inflight: bool = False) -> Replica | None:
    """Fail a placed replica: it leaves every routing table at once, and a
    replacement is scheduled at once (by the reconcile enqueued on commit).
    Its members are reaped at once, unless ``finish_inflight`` (the failure
    does not mean they cannot serve: a node lost, whose engines may well run
    on): then its members that are still alive stop once its in-flight
    requests have finished, within LLMGW_STOP_GRACE (``replicas_quiesce``),
    as a drained original does."""
    with transaction.atomic():
        replica = replica_transition(
            replica_id=replica_id, to=ReplicaStatus.FAILED, reason=reason, expected=PLACED,
            severity=EventSeverity.ERROR,
        )
        if replica is None:
            return None
        replica.quiesced = not finish_inflight
        Replica.objects.filter(pk=replica.pk).update(quiesced=replica.quiesced)
        if finish_inflight:
            reconcile_after_commit(countdown=settings.LLMGW_ROUTING_SETTLE)
    return replica


def member_release(*, member: Member, reason: str) -> int:
    """The member no longer runs: free its GPUs and ports. Returns how many GPUs were freed."""
    freed, _ = GpuAllocation.objects.filter(member=member).delete()
    PortAllocation.objects.filter(member=member).delete()
    member.state = MemberState.GONE
    member.save(update_fields=["state"])
    logger.info("member released replica=%s rank=%s node=%s: %s", member.replica_id, member.rank, member.node_id, reason)
    return freed


def replicas_lock(replica_ids) -> dict[int, Replica]:
    """Lock replicas in ascending pk (the lock order: docs/architecture.md),
    only their own rows. A service that changes several replicas one by one,
    in an order of its own (which to stop first), takes them here first."""
    return {
        r.pk: r
        for r in Replica.objects.select_for_update(of=("self",), no_key=True).select_related("model")
        .filter(pk__in=set(replica_ids)).order_by("pk")
    }


def _replica_settle(replica: Replica) -> None:
    """Advance a replica from what its members now say."""
    members = list(replica.members.select_related("node").order_by("rank"))
    if replica.status in PLACED:
        exited = [m for m in members if m.state == MemberState.EXITED]
        # An engine in crash-loop backoff: once it had served (its replica
        # ready) it exited as any other; at start, its agent restarts it, and
        # the replica fails once it has failed LLMGW_ENGINE_START_ATTEMPTS times.
        looping = [m for m in members if m.state == MemberState.BACKOFF]
        if looping and replica.status == ReplicaStatus.READY:
            exited = exited or looping
        elif looping and not exited:
            m = max(looping, key=lambda m: m.restarts)
            if m.restarts + 1 >= settings.LLMGW_ENGINE_START_ATTEMPTS:
                last = next((line for line in reversed(m.log_tail or []) if line.strip()), "")
                code = "an unknown status" if m.exit_code is None else f"status {m.exit_code}"
                replica_fail(
                    replica_id=replica.pk,
                    reason=f"rank {m.rank} on {m.node.name} failed at start {m.restarts + 1} times (exited with "
                    f"{code}), giving up" + (f": {last}" if last else ""),
                )
            return
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
    """Apply an agent's report of its engines (inside the heartbeat's
    transaction, which holds the node's row: node, then its members, then
    their replicas)."""
    reported = {e["member"]: e for e in engines}
    now = timezone.now()
    touched: set[int] = set()
    members = list(
        Member.objects.select_for_update(of=("self",), no_key=True)
        .filter(node=node)
        .exclude(state=MemberState.GONE)
        .order_by("pk")
    )
    replicas = replicas_lock(m.replica_id for m in members)
    freed = 0
    for member in members:
        member.replica = replicas[member.replica_id]
        engine = reported.get(member.member_id)
        if member.replica.status not in PLACED:
            # Stopping or failed: once its engine is gone, its GPUs are free.
            if engine is None or engine["state"] in ("exited", "backoff"):
                freed += member_release(member=member, reason="stopped by its agent")
                touched.add(member.replica_id)
            continue
        if engine is None:
            if member.state in (MemberState.RUNNING, MemberState.STARTING):
                member.state = MemberState.EXITED
                member.healthy = False
                member.save(update_fields=["state", "healthy"])
                touched.add(member.replica_id)
            continue
        state = {"starting": MemberState.STARTING, "running": MemberState.RUNNING,
                 "backoff": MemberState.BACKOFF}.get(engine["state"], MemberState.EXITED)
        changes = {
            "state": state,
            "pid": engine.get("pid"),
            "exit_code": engine.get("exit_code"),
            "healthy": bool(engine.get("healthy")) and state == MemberState.RUNNING,
            "log_tail": engine.get("log_tail") or [],
            "restarts": engine.get("restarts") or 0,
        }
        if any(getattr(member, k) != v for k, v in changes.items() if k != "log_tail") or state == MemberState.EXITED:
            touched.add(member.replica_id)
        for key, value in changes.items():
            setattr(member, key, value)
        member.reported_at = now
        member.save(update_fields=[*changes, "reported_at"])
    for replica in Replica.objects.filter(pk__in=touched).select_related("model"):
        _replica_settle(replica)
    # A member whose engine its live node reports exited holds nothing any
    # more: once its replica has failed, its GPUs and ports are free now, not
    # when the replica's other members (perhaps on a dead node) have stopped.
    exited = [m for m in members if m.state in (MemberState.EXITED, MemberState.BACKOFF)]
    if exited:
        failed = set(Replica.objects.filter(pk__in={m.replica_id for m in exited}).exclude(status__in=PLACED)
                     .values_list("pk", flat=True))
        for member in exited:
            if member.replica_id in failed:
                freed += member_release(member=member, reason="its engine exited; its replica has failed")
        for replica in Replica.objects.filter(pk__in=failed).select_related("model"):
            _replica_settle(replica)
    if freed:
        # GPUs came free: a pending replacement may fit now.
        reconcile_after_commit()


def replicas_gpus_vanished(*, node: Node, gpu_ids: list[int]) -> None:
    """GPUs a node no longer reports (inside the heartbeat's transaction): each
    placed replica using one fails, and so is rebuilt elsewhere. Its members
    are reaped as for any failure; the allocation goes when the engine stops."""
    members = (
        Member.objects.select_for_update(of=("self",), no_key=True)
        .filter(node=node, pk__in=GpuAllocation.objects.filter(gpu_id__in=gpu_ids).values("member_id"))
        .exclude(state=MemberState.GONE)
        .select_related("replica")
        .order_by("pk")
    )
    for member in members:
        if member.replica.status in PLACED:
            uuids = sorted(
                GpuAllocation.objects.filter(member=member, gpu_id__in=gpu_ids).values_list("gpu__uuid", flat=True)
            )
            replica_fail(
                replica_id=member.replica_id,
                reason=f"GPU {', '.join(uuids)} of rank {member.rank} vanished from node {node.name}",
            )


def replicas_gpus_quarantined(*, node: Node, reasons: dict[int, str]) -> None:
    """GPUs quarantined (inside the transaction of nodes.gpus, which holds the
    node): each placed replica using one fails at once, naming why (the Xid
    and what it means), and is rebuilt elsewhere by the usual path."""
    members = (
        Member.objects.select_for_update(of=("self",), no_key=True)
        .filter(node=node, pk__in=GpuAllocation.objects.filter(gpu_id__in=list(reasons)).values("member_id"))
        .exclude(state=MemberState.GONE)
        .select_related("replica")
        .order_by("pk")
    )
    for member in members:
        if member.replica.status in PLACED:
            why = [reasons[g] for g in GpuAllocation.objects.filter(member=member, gpu_id__in=list(reasons))
                   .order_by("gpu_id").values_list("gpu_id", flat=True)]
            replica_fail(replica_id=member.replica_id, reason=f"rank {member.rank}: {'; '.join(why)}"[:255])


def replicas_gpus_cleared(*, node: Node) -> None:
    """A GPU is back in service: a pending replica may fit now."""
    reconcile_after_commit()


def replicas_node_lost(*, node_name: str) -> None:
    """A node is lost: every replica with a member on it fails; that member's
    GPUs are freed now (the node runs nothing we will count on, and when it
    returns it starts empty and stops what it still runs). Idempotent, and a
    no-op for a node that is live again (its heartbeat ran this first)."""
    with transaction.atomic():
        # The lock order: the node, its members, their replicas.
        node = Node.objects.select_for_update(no_key=True).filter(name=node_name).first()
        if node is None or node.status in LIVE:
            return
        members = list(
            Member.objects.select_for_update(of=("self",), no_key=True)
            .filter(node=node)
            .exclude(state=MemberState.GONE)
            .order_by("pk")
        )
        replicas = replicas_lock(m.replica_id for m in members)
        freed = 0
        for member in members:
            if replicas[member.replica_id].status in PLACED:
                # Its members elsewhere may still be serving with the one here (an
                # agent frozen, a network split): they finish what is in flight.
                replicas[member.replica_id] = replica_fail(
                    replica_id=member.replica_id, reason=f"node {node_name} was lost (rank {member.rank})",
                    finish_inflight=True,
                ) or replicas[member.replica_id]
            freed += member_release(member=member, reason=f"node {node_name} lost")
        for replica in replicas.values():
            replica.refresh_from_db()
            _replica_settle(replica)
        if freed:
            reconcile_after_commit()


def replicas_lost_nodes_reap() -> list[str]:
    """Level-triggered follow-up of the lost-node sweep: any member still
    held on a node that is not live (its replica still placed, or its GPUs
    not yet freed) is dealt with as ``replicas_node_lost`` would have done.
    The sweep's hook is the fast path; this is the one that cannot be lost
    with a worker. Returns the nodes it found."""
    names = sorted(set(
        Member.objects.exclude(state=MemberState.GONE).exclude(node__status__in=LIVE)
        .values_list("node__name", flat=True)
    ))
    for name in names:
        logger.warning("node %s is lost but still holds members; failing them now", name)
        replicas_node_lost(node_name=name)
    return names
