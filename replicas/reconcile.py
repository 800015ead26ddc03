"""Converging desired and actual: replica counts, placement, drains.

Run on every change (enqueued after commit) and periodically by beat, so that
nothing depends on a task message arriving exactly once.
"""

from __future__ import annotations

import datetime as dt
import logging

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from core.events import event_record
from nodes.choices import LIVE
from nodes.services import nodes_desired_changed

from . import drain, moves, respread, rollout, spread
from .catalog import model_refresh_fit
from .choices import PLACED, MemberState, ReplicaEventKind, ReplicaStatus
from .models import CatalogEntry, Member, ModelRevision, Replica
from .scheduling import cluster_snapshot, model_never_fits, replicas_schedule_pending
from .services import replica_transition, replicas_lock, replicas_lost_nodes_reap, replicas_quiesce
from .weights_cache import replicas_staging_advance
from .weights_spares import spares_reconcile

logger = logging.getLogger(__name__)

# How long an agent may take to act on a desired-state change before it is told again.
NUDGE_AFTER = dt.timedelta(seconds=15)


def replicas_reconcile() -> None:
    # Replicas still placed on lost nodes (the sweep's follow-up was lost
    # with a worker) fail first, so that their models' reconciles replace them.
    replicas_lost_nodes_reap()
    # Drains next: a drain step that marks a replica for moving makes its
    # model one short, and the model's reconcile creates the replacement.
    for drain_id in list(drain.drains_active()):
        drain.drain_step(drain_id=drain_id, may_block=False)
    # Rollouts likewise: an original marked for replacing makes its model one
    # short, and the model's reconcile creates its replacement.
    rollout.rollouts_step()
    for model_id in list(CatalogEntry.objects.values_list("pk", flat=True)):
        model_reconcile(model_id=model_id)
    replicas_schedule_pending()
    replicas_staging_advance()
    spares_reconcile()
    moves.moves_step()
    respread.spread_step()
    # Again, now that this pass has tried to place what was pending: a drain
    # is called blocked only on what is true now.
    for drain_id in list(drain.drains_active()):
        drain.drain_step(drain_id=drain_id)
    # Again, now that replacements were placed or found no room.
    rollout.rollouts_step()
    replicas_quiesce()
    members_nudge()
    snapshot = cluster_snapshot()
    for model in CatalogEntry.objects.all():
        with transaction.atomic():
            model_refresh_fit(model=model, never=model_never_fits(model, snapshot=snapshot))


def model_reconcile(*, model_id: int) -> None:
    """Converge one model's replica count: create pending replicas, or stop
    the extra ones (pending first, then the newest)."""
    with transaction.atomic():
        model = CatalogEntry.objects.select_for_update(no_key=True).filter(pk=model_id).first()
        if model is None:
            return
        counted = list(
            Replica.objects.filter(model=model, status__in=[ReplicaStatus.PENDING, *PLACED], draining=False).order_by("id")
        )
        missing = model.replicas - len(counted)
        revision = rollout.revision_for_new_replicas(model)
        if missing > 0:
            for _ in range(missing):
                replica = Replica.objects.create(model=model, revision=revision, status=ReplicaStatus.PENDING,
                                                 status_changed_at=timezone.now())
                event_record(
                    kind=ReplicaEventKind.REPLICA_STATUS,
                    subject=f"replica/{replica.pk}",
                    message=f"{model.name} replica {replica.pk} created (want {model.replicas}, have {len(counted)})",
                    data={"model": model.name, "replica": replica.pk, "to": "pending"},
                )
        elif missing < 0:
            # Pending first, then those not on the revision new replicas get, each
            # group in the order that best keeps the model spread (a stable sort).
            digests = dict(ModelRevision.objects.filter(model=model).values_list("pk", "digest"))
            extra = sorted(_scale_down_order(counted), key=lambda r: (
                r.status != ReplicaStatus.PENDING, digests.get(r.revision_id, revision.digest) == revision.digest,
            ))[: -missing]
            # Their rows locked first, in ascending pk (the lock order): they
            # are stopped in the order above, which a placement locking the
            # same pending replicas in ascending pk would otherwise cross.
            replicas_lock(r.pk for r in extra)
            for replica in extra:
                to = ReplicaStatus.STOPPED if replica.status == ReplicaStatus.PENDING else ReplicaStatus.STOPPING
                replica_transition(replica_id=replica.pk, to=to, reason=f"{model.name} scaled to {model.replicas}")
        if model.removing and not Replica.objects.filter(model=model).exclude(status=ReplicaStatus.STOPPED).exists():
            event_record(kind=ReplicaEventKind.MODEL, subject=f"model/{model.name}", message=f"{model.name} removed from the catalog")
            model.delete()


def _scale_down_order(counted: list[Replica]) -> list[Replica]:
    """Pending replicas first (newest first), then the placed ones in the
    order that best keeps the model spread (``spread.removal_order``)."""
    pending = sorted((r for r in counted if r.status == ReplicaStatus.PENDING), key=lambda r: -r.pk)
    placed = {r.pk: r for r in counted if r.status != ReplicaStatus.PENDING}
    nodes: dict[int, list[str]] = {pk: [] for pk in placed}
    fabrics: dict[int, str | None] = {}
    for replica_id, node, fabric in (
        Member.objects.filter(replica_id__in=placed).order_by("replica_id", "rank")
        .values_list("replica_id", "node__name", "replica__fabric__name")
    ):
        nodes[replica_id].append(node)
        fabrics[replica_id] = fabric
    order = spread.removal_order([
        spread.SpreadReplica(pk, fabrics.get(pk), tuple(nodes[pk]) or (f"replica-{pk}",),
                             ready=r.status == ReplicaStatus.READY)
        for pk, r in placed.items()
    ])
    return pending + [placed[pk] for pk in order]


def members_nudge() -> list[str]:
    """Tell again the live nodes whose agents have not acted on a change for
    a while: a member to start that has not been reported, or one to stop
    that still holds its GPUs. Version bumps follow commits (lock order), so
    one lost with a process is made up for here; an agent told twice just
    finds nothing new."""
    before = timezone.now() - NUDGE_AFTER
    stale = Q(replica__status__in=[ReplicaStatus.SCHEDULED, ReplicaStatus.STARTING], state=MemberState.PENDING) | Q(
        replica__status__in=[ReplicaStatus.FAILED, ReplicaStatus.STOPPING], replica__quiesced=True)
    names = sorted(set(
        Member.objects.filter(stale, replica__status_changed_at__lt=before, node__status__in=LIVE)
        .exclude(state=MemberState.GONE).values_list("node__name", flat=True)
    ))
    if names:
        logger.info("desired state told again to %s: a change not acted on for %ss", ",".join(names),
                    int(NUDGE_AFTER.total_seconds()))
        nodes_desired_changed(node_names=names)
    return names
