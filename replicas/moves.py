"""Moving replicas to make room for a pending one (``replicas.defrag`` plans).

A move is a drain's move of one replica: the original is marked ``draining``
(its model is one short, and routing to it goes on), its replacement is
created and placed where the plan says, in the same transaction; once the
model has as many ready replicas as it wants without the original, the
original stops, after its in-flight requests finish (``replicas_quiesce``).
So the moved replica's model never has fewer ready replicas than before.

Level-triggered, from the reconcile: ``moves_step`` finishes the moves whose
replacements are ready, and plans new ones only when none is in flight, at
most ``LLMGW_DEFRAG_MAX_MOVES`` at once. ``LLMGW_DEFRAG=0`` turns it off.

Managed weights bind a move as they bind placement: a moved replica goes
where its revision's weights are, or where there is room to fetch them (its
replacement stages them first), and the pending replica is given only nodes
that may take its own (``defrag.plan_room`` reads the nodes' caches).
"""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from core.choices import EventSeverity
from core.events import event_record

from . import defrag, placement
from .choices import DRAIN_ACTIVE, PLACED, MemberState, ReplicaEventKind, ReplicaStatus
from .models import CatalogEntry, Member, ModelRevision, Replica
from .revisions import replica_launch, revision_manifest
from .scheduling import PlacementConflict, cluster_snapshot, nodes_lock, placements_persist
from .services import replica_transition
from .weights_cache import weights_need, weights_need_of, weights_view

logger = logging.getLogger(__name__)

# Pending replicas looked at per reconcile, oldest first: planning is bounded
# even when many wait (each plan is linear in the nodes of a group).
PLANNED_PER_PASS = 5
GIVE_UP = "; "


def moves_in_flight():
    """Replicas being moved to make room: draining, not for a node's drain
    nor a rollout (replicas.rollout), and still holding their GPUs (placed,
    or stopping with members left)."""
    return (
        Replica.objects.filter(draining=True, rolling=False)
        .filter(Q(status__in=PLACED) | Q(status=ReplicaStatus.STOPPING, members__state__in=[
            s for s in MemberState.values if s != MemberState.GONE]))
        .exclude(members__node__drains__status__in=DRAIN_ACTIVE)
        .distinct()
    )


def moves_finish() -> int:
    """Stop each moved original whose model has its ready replicas without it."""
    stopped = 0
    for replica in moves_in_flight().filter(status__in=PLACED).select_related("model"):
        model = replica.model
        ready = Replica.objects.filter(model=model, status=ReplicaStatus.READY, draining=False).count()
        if ready >= model.replicas:
            if replica_transition(
                replica_id=replica.pk, to=ReplicaStatus.STOPPING, expected=PLACED,
                reason="moved to make room: its replacement is ready",
            ):
                stopped += 1
    return stopped


def _movable() -> list[defrag.Movable]:
    single = Q(replica__revision__isnull=True, replica__model__nodes=1) | Q(replica__revision__spec__nodes=1)
    rows = list(Member.objects.filter(single, replica__status=ReplicaStatus.READY, replica__draining=False).values_list(
        "replica_id", "replica__model_id", "replica__revision_id", "node__name", "gpus"))
    # Each replica's weights are its revision's (a few models and revisions, read once each).
    models = CatalogEntry.objects.in_bulk({row[1] for row in rows})
    revisions = ModelRevision.objects.in_bulk({row[2] for row in rows if row[2] is not None})
    needs = {(m, r): weights_need_of(models[m].name, revision_manifest(revisions.get(r), models[m]))
             for _, m, r, _, _ in rows}
    return [defrag.Movable(replica_id, models[model_id].name, node, tuple(gpus), needs[(model_id, revision_id)])
            for replica_id, model_id, revision_id, node, gpus in rows]


def _note(replica: Replica, base: str, note: str, severity: str = EventSeverity.WARNING) -> None:
    """Add the defragmentation's word to a pending replica's reason (once)."""
    reason = base + note
    if replica.pending_reason == reason:
        return
    if Replica.objects.filter(pk=replica.pk, status=ReplicaStatus.PENDING).update(pending_reason=reason):
        event_record(
            kind=ReplicaEventKind.REPLICA_PENDING, subject=f"replica/{replica.pk}", severity=severity,
            message=f"{replica.model.name} replica {replica.pk} stays pending: {reason}",
            data={"model": replica.model.name, "replica": replica.pk, "never": False},
        )


def move_start(*, move: defrag.Move, target: Replica, fabric: str | None) -> bool:
    """Start one move: mark the original, create and place its replacement."""
    where = fabric or "a fabric-less node"
    destination = move.destination.members[0].node
    try:
        with transaction.atomic():
            # The lock order (docs/architecture.md): catalog entry, the
            # destination's nodes (ascending pk), then the original replica;
            # its replacement is locked inside ``placements_persist``. NO KEY
            # locks, so that foreign-key checks at others' commits pass.
            model = CatalogEntry.objects.select_for_update(no_key=True).get(name=move.model)
            nodes_lock(m.node for m in move.destination.members)
            original = (
                Replica.objects.select_for_update(of=("self",), no_key=True)
                .filter(pk=move.replica, status=ReplicaStatus.READY, draining=False).first()
            )
            if original is None:
                return False
            Replica.objects.filter(pk=original.pk).update(draining=True)
            # A move keeps the launch: the replacement runs the original's revision.
            replacement = Replica.objects.create(model=model, status=ReplicaStatus.PENDING, revision=original.revision,
                                                 status_changed_at=timezone.now())
            event_record(
                kind=ReplicaEventKind.REPLICA_STATUS, subject=f"replica/{original.pk}",
                message=f"moving {model.name} replica {original.pk} from {move.source} to {destination} "
                f"to make room for {target.model.name} replica {target.pk} on {where} "
                f"(replacement: replica {replacement.pk})",
                data={"model": model.name, "replica": original.pk, "replacement": replacement.pk,
                      "from": move.source, "to": destination, "for": target.pk, "fabric": fabric},
            )
            placements_persist([(replacement, move.destination)])
    except (IntegrityError, PlacementConflict) as exc:
        logger.info("move of replica=%s not started (%s); the next reconcile plans again", move.replica, exc)
        return False
    return True


def moves_plan() -> int:
    """Plan room for the oldest pending replicas that fit nowhere now; start
    the first plan's moves (up to the setting). Returns the moves started."""
    pending = list(
        Replica.objects.filter(status=ReplicaStatus.PENDING, model__never_fits_reason="", model__removing=False)
        .select_related("model", "revision").order_by("id")[:PLANNED_PER_PASS]
    )
    if not pending:
        return 0
    snapshot = cluster_snapshot()
    movable = _movable()
    view = None  # the nodes' weights caches, read once managed weights are in play
    for replica in pending:
        model = replica_launch(replica)
        request = placement.PlacementRequest(model.name, model.nodes, model.gpus_per_node)
        result = placement.place(request, snapshot)
        if not isinstance(result, placement.Unplaceable) or result.never:
            continue
        need = weights_need(model)
        if view is None and (need is not None or any(m.weights is not None for m in movable)):
            view = weights_view()
        plan = defrag.plan_room(request, snapshot, movable, view=view, need=need)
        if isinstance(plan, defrag.NoRoom) or not plan.moves:
            reason = plan.reason if isinstance(plan, defrag.NoRoom) else "nothing to move"
            _note(replica, result.reason, GIVE_UP + reason)
            continue
        started = []
        for move in plan.moves[: settings.LLMGW_DEFRAG_MAX_MOVES]:
            if move_start(move=move, target=replica, fabric=plan.fabric):
                started.append(f"{move.model} replica {move.replica} {move.source} -> {move.destination.members[0].node}")
        if started:
            _note(replica, result.reason, defrag.MAKING_ROOM + ", ".join(started), severity=EventSeverity.INFO)
        return len(started)
    return 0


def _freeing() -> str:
    """What is still giving GPUs back (moves in flight, replicas stopping), in words; empty if nothing."""
    moving = moves_in_flight().count()
    stopping = (
        Replica.objects.filter(status__in=[ReplicaStatus.STOPPING, ReplicaStatus.FAILED])
        .filter(members__state__in=[s for s in MemberState.values if s != MemberState.GONE]).distinct().count()
    )
    parts = ([f"{moving} move(s) in flight"] if moving else []) + (
        [f"{stopping} stopping replica(s) to free their GPUs"] if stopping else [])
    return " and ".join(parts)


def moves_step() -> None:
    """From the reconcile: finish what can finish; plan when nothing is moving
    and no replica is still giving GPUs back (a plan made then would move
    what need not move, or give up too soon)."""
    if not settings.LLMGW_DEFRAG:
        return
    moves_finish()
    freeing = _freeing()
    if not freeing:
        moves_plan()
        return
    # The scheduler has just written why each of these cannot be placed; say
    # that room may come, so that a drain waiting on one does not call it stuck.
    waiting = (
        Replica.objects.filter(status=ReplicaStatus.PENDING, model__never_fits_reason="", model__removing=False)
        .exclude(pending_reason="").exclude(pending_reason__contains=defrag.MAKING_ROOM)
        .select_related("model").order_by("id")[:PLANNED_PER_PASS]
    )
    for replica in waiting:
        _note(replica, replica.pending_reason, f"{defrag.MAKING_ROOM}waiting for {freeing}", severity=EventSeverity.INFO)
