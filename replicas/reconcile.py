"""Converging desired and actual: replica counts, placement, drains.

Run on every change (enqueued after commit) and periodically by beat, so that
nothing depends on a task message arriving exactly once.
"""

from __future__ import annotations

import logging

from django.db import transaction

from . import drain
from .catalog import model_reconcile, model_refresh_fit
from .models import Model
from .services import replicas_quiesce
from .scheduling import cluster_snapshot, model_never_fits, replicas_schedule_pending

logger = logging.getLogger(__name__)


def replicas_reconcile() -> None:
    # Drains first: a drain step that marks a replica for moving makes its
    # model one short, and the model's reconcile creates the replacement.
    for drain_id in list(drain.drains_active()):
        drain.drain_step(drain_id=drain_id)
    for model_id in list(Model.objects.values_list("pk", flat=True)):
        model_reconcile(model_id=model_id)
    replicas_schedule_pending()
    replicas_quiesce()
    snapshot = cluster_snapshot()
    for model in Model.objects.all():
        with transaction.atomic():
            model_refresh_fit(model=model, never=model_never_fits(model, snapshot=snapshot))
