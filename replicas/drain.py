"""Draining a node: one replica at a time, each replacement ready before its
original stops, and a replica that cannot move anywhere keeps running."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from nodes.choices import EventKind, EventSeverity, NodeStatus
from nodes.events import event_record
from nodes.exceptions import InvalidTransition, NotFound
from nodes.models import Node
from nodes.services import node_transition
from nodes.statemachine import StateMachine

from .choices import DRAIN_ACTIVE, DRAIN_TRANSITIONS, PLACED, DrainStatus, ReplicaStatus
from .defrag import MAKING_ROOM
from .enqueue import reconcile_after_commit
from .exceptions import InvalidDrainTransition
from .models import Drain, Replica
from .services import replica_transition


def _log_line(drain: Drain, message: str) -> None:
    drain.log = [*drain.log, f"{timezone.now():%H:%M:%S} {message}"][-200:]


def _log(drain: Drain, message: str, severity: str = EventSeverity.INFO) -> None:
    _log_line(drain, message)
    event_record(kind=EventKind.DRAIN, subject=f"node/{drain.node.name}", message=f"drain: {message}",
                 node=drain.node, severity=severity)


class DrainStates(StateMachine):
    """A drain's status changes; the reason is the line added to its log, and
    its Event is that line, like every other step of the drain."""

    noun = "drain"
    table = DRAIN_TRANSITIONS
    error = InvalidDrainTransition
    event_kind = EventKind.DRAIN
    reason_field = None

    def subject(self, drain: Drain) -> str:
        return f"node/{drain.node.name}"

    def message(self, drain: Drain, previous: str, to: str, reason: str) -> str:
        return f"drain: {reason}"

    def event_node(self, drain: Drain) -> Node:
        return drain.node

    def changing(self, drain: Drain, previous: str, to: str) -> list[str]:
        return ["log", *(["finished_at"] if to == DrainStatus.DONE else [])]

    def apply(self, drain: Drain, *, to: str, reason: str = "", severity: str = EventSeverity.INFO) -> str:
        self.check(drain, to)
        _log_line(drain, reason)
        if to == DrainStatus.DONE:
            drain.finished_at = timezone.now()
        return super().apply(drain, to=to, reason=reason, severity=severity)


DRAIN_STATES = DrainStates()


def drain_start(*, node_name: str) -> Drain:
    with transaction.atomic():
        node = Node.objects.select_for_update().filter(name=node_name).first()
        if node is None:
            raise NotFound(f"no node named {node_name!r}; 'llmgw ctl nodes' lists them")
        active = Drain.objects.filter(node=node, status__in=DRAIN_ACTIVE).first()
        if active is not None:
            return active
        if node.status not in (NodeStatus.READY, NodeStatus.CORDONED):
            raise InvalidTransition(f"node {node_name} is {node.status}; only a ready or cordoned node can be drained")
        node_transition(node_name=node_name, to=NodeStatus.DRAINING, reason="drain requested by an operator")
        drain = Drain.objects.create(node=node, remaining=_placed_on(node).count())
        _log(drain, f"started: {drain.remaining} replica(s) to move, one at a time")
        drain.save(update_fields=["log"])
        reconcile_after_commit()
    return drain


def _placed_on(node: Node):
    return Replica.objects.filter(members__node=node, status__in=PLACED).distinct().order_by("id")


def drain_step(*, drain_id: int) -> None:
    """Advance a drain as far as it can go now. Idempotent."""
    with transaction.atomic():
        drain = Drain.objects.select_for_update(of=("self",)).select_related("node", "current__model").filter(pk=drain_id).first()
        if drain is None or drain.status not in DRAIN_ACTIVE:
            return
        node = drain.node
        current = drain.current
        if current is not None:
            current.refresh_from_db()
            if current.status not in PLACED:
                drain.moved += 1 if current.status in (ReplicaStatus.STOPPING, ReplicaStatus.STOPPED) else 0
                drain.current = None
                current = None
            else:
                model = current.model
                ready = Replica.objects.filter(model=model, status=ReplicaStatus.READY, draining=False).count()
                if ready >= model.replicas:
                    replica_transition(
                        replica_id=current.pk, to=ReplicaStatus.STOPPING, expected=PLACED,
                        reason=f"drained off {node.name}: its replacement is ready",
                    )
                    _log(drain, f"{model.name} replica {current.pk}: replacement ready, stopping the original")
                    drain.moved += 1
                    drain.current = None
                    current = None
                else:
                    stuck = (Replica.objects.filter(model=model, status=ReplicaStatus.PENDING).exclude(pending_reason="")
                             .exclude(pending_reason__contains=MAKING_ROOM).first())
                    if stuck is not None and drain.status != DrainStatus.BLOCKED:
                        DRAIN_STATES.apply(
                            drain, to=DrainStatus.BLOCKED, severity=EventSeverity.ERROR,
                            reason=f"{model.name} replica {current.pk} cannot be moved anywhere, so it keeps "
                            f"running on {node.name}: {stuck.pending_reason}",
                        )
                    elif stuck is None and drain.status == DrainStatus.BLOCKED:
                        DRAIN_STATES.apply(
                            drain, to=DrainStatus.RUNNING,
                            reason=f"{model.name} replica {current.pk}: a replacement fits now",
                        )
        if current is None:
            following = _placed_on(node).filter(draining=False).first()
            if following is not None:
                Replica.objects.filter(pk=following.pk).update(draining=True)
                drain.current = following
                message = f"moving {following.model.name} replica {following.pk}: scheduling its replacement"
                if drain.status == DrainStatus.BLOCKED:
                    DRAIN_STATES.apply(drain, to=DrainStatus.RUNNING, reason=message)
                else:
                    _log(drain, message)
            elif not _placed_on(node).exists() and not Replica.objects.filter(
                members__node=node, status__in=[ReplicaStatus.STOPPING, ReplicaStatus.FAILED]
            ).exists():
                node_transition(node_name=node.name, to=NodeStatus.DRAINED, expected=NodeStatus.DRAINING,
                                reason=f"drained: {drain.moved} replica(s) moved")
                DRAIN_STATES.apply(
                    drain, to=DrainStatus.DONE,
                    reason=f"done: {drain.moved} replica(s) moved; {node.name} holds none",
                )
        drain.remaining = _placed_on(node).count()
        drain.save()


def drains_active():
    return Drain.objects.filter(status__in=DRAIN_ACTIVE).values_list("pk", flat=True)
