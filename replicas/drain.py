"""Draining a node: one replica moving at a time, each replacement ready
before its original stops; a replica that cannot move anywhere keeps running
while the drain tries the others. An operator can end a drain (cancel,
uncordon, or a new drain of the node); an ended drain never resumes.

Rows are taken in the project's lock order (docs/architecture.md): the node,
then the drain, then replicas.
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from core.choices import EventSeverity
from core.events import event_record
from core.exceptions import InvalidTransition, NotFound
from core.statemachine import StateMachine
from nodes.choices import NodeStatus
from nodes.models import Node
from nodes.services import node_transition

from .choices import (DRAIN_ACTIVE, DRAIN_ENDED, DRAIN_TRANSITIONS, PLACED, DrainOutcome, DrainStatus, MemberState,
                      ReplicaEventKind, ReplicaStatus)
from .defrag import MAKING_ROOM, NO_ROOM
from .drainwait import Release, replacement_wait
from .enqueue import reconcile_after_commit
from .exceptions import InvalidDrainTransition
from .models import Drain, Member, Replica
from .scheduling import cluster_snapshot
from .snapshot import PlacementRequest
from .services import replica_transition


def _log_line(drain: Drain, message: str) -> None:
    drain.log = [*drain.log, f"{timezone.now():%H:%M:%S} {message}"][-200:]


def _log(drain: Drain, message: str, severity: str = EventSeverity.INFO) -> None:
    _log_line(drain, message)
    event_record(kind=ReplicaEventKind.DRAIN, subject=f"node/{drain.node.name}", message=f"drain: {message}",
                 node=drain.node, severity=severity)


class DrainStates(StateMachine):
    """A drain's status changes; the reason is the line added to its log, and
    its Event is that line, like every other step of the drain."""

    noun = "drain"
    table = DRAIN_TRANSITIONS
    error = InvalidDrainTransition
    event_kind = ReplicaEventKind.DRAIN
    reason_field = None

    def subject(self, drain: Drain) -> str:
        return f"node/{drain.node.name}"

    def message(self, drain: Drain, previous: str, to: str, reason: str) -> str:
        return f"drain: {reason}"

    def event_node(self, drain: Drain) -> Node:
        return drain.node

    def changing(self, drain: Drain, previous: str, to: str) -> list[str]:
        return ["log", *(["finished_at"] if to in DRAIN_ENDED else [])]

    def apply(self, drain: Drain, *, to: str, reason: str = "", severity: str = EventSeverity.INFO) -> str:
        self.check(drain, to)
        _log_line(drain, reason)
        if to in DRAIN_ENDED:
            drain.finished_at = timezone.now()
        return super().apply(drain, to=to, reason=reason, severity=severity)


DRAIN_STATES = DrainStates()


def _node_lock(**lookup) -> Node | None:
    return Node.objects.select_for_update(no_key=True).filter(**lookup).first()


def _active_lock(node: Node) -> Drain | None:
    return (
        Drain.objects.select_for_update(of=("self",), no_key=True).select_related("node")
        .filter(node=node, status__in=DRAIN_ACTIVE).first()
    )


def _on_node(node: Node):
    """The node's placed replicas, oldest first."""
    return Replica.objects.filter(
        pk__in=Member.objects.filter(node=node).values("replica_id"), status__in=PLACED
    ).order_by("pk")


def drain_start(*, node_name: str, actor: str = "") -> Drain:
    """Start draining a node. A drain already under way on it ends (its
    replicas already moving keep moving, now under the new drain, which
    reports every replica afresh)."""
    with transaction.atomic():
        node = _node_lock(name=node_name)
        if node is None:
            raise NotFound(f"no node named {node_name!r}; 'llmgw ctl nodes' lists them")
        active = _active_lock(node)
        if active is None and node.status not in (NodeStatus.READY, NodeStatus.CORDONED, NodeStatus.DRAINING):
            raise InvalidTransition(f"node {node_name} is {node.status}; only a ready or cordoned node can be drained")
        if active is not None:
            _drain_end(active, reason=f"a new drain of {node_name} was requested; it takes over", release=False)
        if node.status != NodeStatus.DRAINING:
            node_transition(node_name=node_name, to=NodeStatus.DRAINING, reason=f"drain requested by {actor or 'an operator'}")
        drain = Drain.objects.create(node=node, remaining=_on_node(node).count())
        _log(drain, f"started: {drain.remaining} replica(s) to move, one at a time")
        drain.save(update_fields=["log"])
        reconcile_after_commit()
    return drain


def _drain_end(drain: Drain, *, reason: str, release: bool = True) -> None:
    """End an active drain (cancelled). With ``release``, the replicas it was
    moving stop moving: they keep running where they are, and the
    replacements made for them are scaled away by the reconcile."""
    node = drain.node
    released = []
    if release:
        others = Drain.objects.filter(status__in=DRAIN_ACTIVE).exclude(pk=drain.pk).values("node_id")
        # A replica that spans another node under drain keeps moving for that drain.
        shared = Member.objects.filter(node_id__in=others).values("replica_id")
        rows = (
            Replica.objects.select_for_update(of=("self",), no_key=True).select_related("model")
            .filter(pk__in=Member.objects.filter(node=node).values("replica_id"), draining=True, status__in=PLACED)
            .exclude(pk__in=shared).order_by("pk")
        )
        released = list(rows)
        Replica.objects.filter(pk__in=[r.pk for r in released]).update(draining=False)
        for replica in released:
            entry = drain.replicas.get(str(replica.pk), {"model": replica.model.name})
            drain.replicas[str(replica.pk)] = {**entry, "outcome": DrainOutcome.RELEASED,
                                               "reason": "the drain ended; it keeps running here"}
    summary = f"{drain.moved} replica(s) moved"
    if released:
        summary += "; no longer moving, and running on here: " + ", ".join(
            f"{r.model.name} replica {r.pk}" for r in released)
    drain.remaining = _on_node(node).count()
    DRAIN_STATES.apply(drain, to=DrainStatus.CANCELLED, severity=EventSeverity.WARNING,
                       reason=f"drain {drain.pk} of {node.name} ended ({reason}): {summary}")
    drain.current = None
    drain.save(update_fields=["replicas", "remaining", "current"])
    reconcile_after_commit()


def drain_cancel(*, drain_id: int, actor: str = "", reason: str = "") -> Drain:
    """End a drain under way; its node stays cordoned (uncordon puts it back
    in service). ``actor`` (who asked) goes into the log and its Event."""
    reason = reason or f"cancelled by {actor or 'an operator'}"
    node_id = Drain.objects.filter(pk=drain_id).values_list("node_id", flat=True).first()
    if node_id is None:
        raise NotFound(f"no drain {drain_id}; 'llmgw ctl drain NODE' starts one, /api/v1/drains/ lists them")
    with transaction.atomic():
        node = _node_lock(pk=node_id)
        drain = Drain.objects.select_for_update(of=("self",), no_key=True).select_related("node").get(pk=drain_id)
        if drain.status not in DRAIN_ACTIVE:
            raise InvalidDrainTransition(
                f"drain {drain.pk} of {node.name} is {drain.status}; only a running or blocked drain can be cancelled")
        _drain_end(drain, reason=reason)
        if node.status == NodeStatus.DRAINING:
            node_transition(node_name=node.name, to=NodeStatus.CORDONED, expected=NodeStatus.DRAINING,
                            reason="its drain was cancelled; it stays cordoned until uncordoned")
    drain.refresh_from_db()
    return drain


def drain_end_for_node(*, node_name: str, reason: str) -> None:
    """nodes' hook: the node left draining (uncordoned): its drain ends.
    Called inside the transaction that holds the node's row."""
    node = _node_lock(name=node_name)
    drain = _active_lock(node) if node is not None else None
    if drain is not None:
        _drain_end(drain, reason=reason)


def _outcome(drain: Drain, replica: Replica, outcome: str, reason: str = "") -> bool:
    """Record a replica's outcome; log it when it changed. Returns whether it changed."""
    key = str(replica.pk)
    before = drain.replicas.get(key, {})
    entry = {"model": replica.model.name, "outcome": outcome, "reason": reason}
    drain.replicas[key] = entry
    if (before.get("outcome"), before.get("reason")) == (outcome, reason):
        return False
    if outcome == DrainOutcome.WAITING:
        _log(drain, f"{replica.model.name} replica {replica.pk} cannot be moved anywhere yet, so it keeps running "
             f"on {drain.node.name}: {reason}", severity=EventSeverity.WARNING)
    elif outcome == DrainOutcome.MOVING and before.get("outcome") == DrainOutcome.WAITING:
        _log(drain, f"{replica.model.name} replica {replica.pk}: a replacement fits now")
    elif outcome == DrainOutcome.MOVING and reason.startswith("waiting "):
        _log(drain, f"{replica.model.name} replica {replica.pk}: its replacement does not fit yet, {reason}")
    return True


def _releases(replica: Replica) -> list[Release]:
    """What is under way that will give GPUs back, the moves first (the
    drain's own, and those making room), then replicas stopping or failed."""
    rows = (
        Replica.objects.exclude(pk=replica.pk)
        .filter(Q(draining=True, status__in=PLACED) | Q(status__in=(ReplicaStatus.STOPPING, ReplicaStatus.FAILED)))
        .select_related("model").prefetch_related("members__node").order_by("-draining", "pk")
    )
    releases = []
    for row in rows:
        held = [m for m in row.members.all() if m.state != MemberState.GONE and m.gpus]
        if not held:
            continue
        gpus = tuple((m.node.name, tuple(m.gpus)) for m in held)
        if row.draining:
            # Off the node being drained (or cleared to make room): the others are where it frees GPUs.
            off = {m.node.name for m in held if m.node.status == NodeStatus.DRAINING} or {m.node.name for m in held}
            what = f"{row.model.name} replica {row.pk}'s move off {'/'.join(sorted(off))}"
        else:
            what = f"{row.model.name} replica {row.pk}, {row.status},"
        releases.append(Release(what, gpus))
    return releases


def _replacement_wait(replica: Replica, pending_reason: str) -> str | None:
    """What the replica's replacement waits for (``replicas.drainwait``), or
    None when nothing under way would make it fit. The scheduler's moves
    (``replicas.moves``) plan only once stopping replicas are gone: while it
    says it will, and has not found that no set of moves makes room, the
    replacement waits for that too."""
    model = replica.model
    request = PlacementRequest(model.name, model.nodes, model.gpus_per_node)
    wait = replacement_wait(request, cluster_snapshot().nodes.values(), _releases(replica))
    if wait is None and MAKING_ROOM in pending_reason and NO_ROOM not in pending_reason:
        wait = "waiting while room is made for it: " + pending_reason.split(MAKING_ROOM, 1)[1]
    return wait


def drain_step(*, drain_id: int, may_block: bool = True) -> None:
    """Advance a drain as far as it can go now: every replica of the node is
    looked at and its outcome recorded. Idempotent. ``may_block=False`` (the
    reconcile's first pass, before it places pending replicas) never calls
    the drain blocked: the pending reasons it would go by are from the pass
    before."""
    node_id = Drain.objects.filter(pk=drain_id, status__in=DRAIN_ACTIVE).values_list("node_id", flat=True).first()
    if node_id is None:
        return
    with transaction.atomic():
        node = _node_lock(pk=node_id)
        drain = (
            Drain.objects.select_for_update(of=("self",), no_key=True).select_related("node")
            .filter(pk=drain_id, status__in=DRAIN_ACTIVE).first()
        )
        if drain is None or node is None:
            return
        drain.node = node
        if node.status not in (NodeStatus.DRAINING, NodeStatus.LOST):
            # Level-triggered: however the node left draining, the drain ends.
            _drain_end(drain, reason=f"{node.name} is {node.status}")
            return
        replicas = list(
            Replica.objects.select_for_update(of=("self",), no_key=True).select_related("model")
            .filter(pk__in=_on_node(node).values("pk")).order_by("pk")
        )
        present = {str(r.pk) for r in replicas}
        for key, entry in drain.replicas.items():
            if key not in present and entry["outcome"] in (DrainOutcome.MOVING, DrainOutcome.WAITING, DrainOutcome.QUEUED):
                drain.replicas[key] = {**entry, "outcome": DrainOutcome.GONE, "reason": "it left the node otherwise"}
        moving = waiting = 0
        queued = []
        for replica in replicas:
            model = replica.model
            if not replica.draining:
                queued.append(replica)
                _outcome(drain, replica, DrainOutcome.QUEUED)
                continue
            ready = Replica.objects.filter(model=model, status=ReplicaStatus.READY, draining=False).count()
            if ready >= model.replicas:
                replica_transition(
                    replica_id=replica.pk, to=ReplicaStatus.STOPPING, expected=PLACED,
                    reason=f"drained off {node.name}: its replacement is ready",
                )
                _outcome(drain, replica, DrainOutcome.MOVED, "its replacement is ready")
                _log(drain, f"{model.name} replica {replica.pk}: replacement ready, stopping the original")
                drain.moved += 1
                continue
            stuck = (Replica.objects.filter(model=model, status=ReplicaStatus.PENDING).exclude(pending_reason="")
                     .first())
            # Not stuck while something under way (the drain's own moves,
            # replicas stopping, moves making room) would free what it needs.
            wait = _replacement_wait(replica, stuck.pending_reason) if stuck is not None else None
            if wait is not None:
                moving += 1
                _outcome(drain, replica, DrainOutcome.MOVING, wait)
            elif stuck is not None:
                waiting += 1
                _outcome(drain, replica, DrainOutcome.WAITING, stuck.pending_reason)
            else:
                moving += 1
                _outcome(drain, replica, DrainOutcome.MOVING, "its replacement is being scheduled or is starting")
        if moving == 0 and queued:
            # One replica moves at a time; one that cannot move does not hold up the others.
            following = queued.pop(0)
            Replica.objects.filter(pk=following.pk).update(draining=True)
            drain.current = following
            moving += 1
            _outcome(drain, following, DrainOutcome.MOVING, "scheduling its replacement")
            _log(drain, f"moving {following.model.name} replica {following.pk}: scheduling its replacement")
        _drain_settle(drain, node, moving=moving, waiting=waiting, queued=len(queued), may_block=may_block)
        drain.remaining = _on_node(node).count()
        drain.save()


def _drain_settle(drain: Drain, node: Node, *, moving: int, waiting: int, queued: int, may_block: bool) -> None:
    if moving == 0 and waiting == 0 and queued == 0:
        if not Replica.objects.filter(
            members__node=node, status__in=[ReplicaStatus.STOPPING, ReplicaStatus.FAILED]
        ).exists():
            node_transition(node_name=node.name, to=NodeStatus.DRAINED, expected=NodeStatus.DRAINING,
                            reason=f"drained: {drain.moved} replica(s) moved")
            DRAIN_STATES.apply(
                drain, to=DrainStatus.DONE, reason=f"done: {drain.moved} replica(s) moved; {node.name} holds none",
            )
        return
    if moving == 0 and queued == 0 and drain.status != DrainStatus.BLOCKED and may_block:
        stuck = [f"{e['model']} replica {k}: {e['reason']}" for k, e in drain.replicas.items()
                 if e["outcome"] == DrainOutcome.WAITING]
        DRAIN_STATES.apply(
            drain, to=DrainStatus.BLOCKED, severity=EventSeverity.ERROR,
            reason=f"blocked: {waiting} replica(s) cannot be moved anywhere, so they keep running on {node.name} "
            f"(each is tried again as the cluster changes): " + "; ".join(stuck),
        )
    elif moving and drain.status == DrainStatus.BLOCKED:
        DRAIN_STATES.apply(drain, to=DrainStatus.RUNNING, reason="moving again: a replacement fits now")


def drains_active():
    return Drain.objects.filter(status__in=DRAIN_ACTIVE).values_list("pk", flat=True)
