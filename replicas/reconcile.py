"""Converging desired and actual: replica counts, placement, drains.

Run on every change (enqueued after commit) and periodically by beat, so that
nothing depends on a task message arriving exactly once.
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.utils import timezone

from nodes.choices import EventKind
from nodes.events import event_record

from . import drain, moves
from .catalog import model_refresh_fit
from .choices import PLACED, ReplicaStatus
from .models import CatalogEntry, Replica
from .scheduling import cluster_snapshot, model_never_fits, replicas_schedule_pending
from .services import replica_transition, replicas_quiesce

logger = logging.getLogger(__name__)


def replicas_reconcile() -> None:
    # Drains first: a drain step that marks a replica for moving makes its
    # model one short, and the model's reconcile creates the replacement.
    for drain_id in list(drain.drains_active()):
        drain.drain_step(drain_id=drain_id)
    for model_id in list(CatalogEntry.objects.values_list("pk", flat=True)):
        model_reconcile(model_id=model_id)
    replicas_schedule_pending()
    moves.moves_step()
    replicas_quiesce()
    snapshot = cluster_snapshot()
    for model in CatalogEntry.objects.all():
        with transaction.atomic():
            model_refresh_fit(model=model, never=model_never_fits(model, snapshot=snapshot))


def model_reconcile(*, model_id: int) -> None:
    """Converge one model's replica count: create pending replicas, or stop
    the extra ones (pending first, then the newest)."""
    with transaction.atomic():
        model = CatalogEntry.objects.select_for_update().filter(pk=model_id).first()
        if model is None:
            return
        counted = list(
            Replica.objects.filter(model=model, status__in=[ReplicaStatus.PENDING, *PLACED], draining=False).order_by("id")
        )
        missing = model.replicas - len(counted)
        if missing > 0:
            for _ in range(missing):
                replica = Replica.objects.create(model=model, status=ReplicaStatus.PENDING, status_changed_at=timezone.now())
                event_record(
                    kind=EventKind.REPLICA_STATUS,
                    subject=f"replica/{replica.pk}",
                    message=f"{model.name} replica {replica.pk} created (want {model.replicas}, have {len(counted)})",
                    data={"model": model.name, "replica": replica.pk, "to": "pending"},
                )
        elif missing < 0:
            extra = sorted(counted, key=lambda r: (r.status != ReplicaStatus.PENDING, -r.pk))[: -missing]
            for replica in extra:
                to = ReplicaStatus.STOPPED if replica.status == ReplicaStatus.PENDING else ReplicaStatus.STOPPING
                replica_transition(replica_id=replica.pk, to=to, reason=f"{model.name} scaled to {model.replicas}")
        if model.removing and not Replica.objects.filter(model=model).exclude(status=ReplicaStatus.STOPPED).exists():
            event_record(kind=EventKind.MODEL, subject=f"model/{model.name}", message=f"{model.name} removed from the catalog")
            model.delete()
