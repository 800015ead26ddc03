"""Keeping a model spread: when two of its replicas share a node (or a
fabric) and a placement that shares less fits now, one of them moves there
(``replicas.spread`` decides which and where).

A move is a defragmentation's move (``replicas.moves``): the original is
marked ``draining`` and keeps serving, its replacement is placed in the same
transaction, and the original stops once the model has its ready replicas
without it, after its in-flight requests finish. One move at a time, and
only on a quiet cluster (``_quiet``), so that it never competes with what
the operator or a failure asked for. ``LLMGW_SPREAD=0`` turns it off.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections import defaultdict

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from core.events import event_record

from . import moves, spread
from .choices import DRAIN_ACTIVE, PLACED, MemberState, ReplicaEventKind, ReplicaStatus, RolloutStatus
from .models import CatalogEntry, Drain, Member, Replica, Rollout
from .scheduling import PlacementConflict, cluster_snapshot, nodes_lock, placements_persist
from .snapshot import ExistingReplica, PlacementRequest

logger = logging.getLogger(__name__)


# How long a pending replica whose model fits the cluster counts as churn
# (a scale-up, a lost node's replacement: room may come within minutes, and
# a move now would only add to what is changing). Past it, the replica waits
# for capacity that is not coming soon (a node away for good, a scale-up
# beyond the cluster) and would otherwise keep every model from being spread
# again for as long as it waits. It loses nothing by that: the reconcile
# schedules before it spreads, so room that fits it is its first, and the
# defragmentation still plans room for it whenever no move is in flight.
PENDING_PATIENCE = dt.timedelta(minutes=10)


def _quiet() -> bool:
    """Nothing the operator or a failure asked for is still under way:
    no drain, no move, no rollout running or paused, no replica scheduled,
    staging or starting, none stopping or failed with members left, and no
    replica pending for less than ``PENDING_PATIENCE`` unless its model can
    never fit the cluster (it would hold the cluster busy forever)."""
    if moves.moves_in_flight().exists() or Drain.objects.filter(status__in=DRAIN_ACTIVE).exists():
        return False
    # A rollout running has its own moves to make, and a paused one holds them on purpose.
    if Rollout.objects.filter(status__in=[RolloutStatus.RUNNING, RolloutStatus.PAUSED]).exists():
        return False
    if Replica.objects.filter(status__in=[ReplicaStatus.SCHEDULED, ReplicaStatus.STAGING,
                                          ReplicaStatus.STARTING]).exists():
        return False
    # never_fits_reason is the model's (refreshed by every reconcile and on catalog apply), as moves_plan reads it.
    if Replica.objects.filter(status=ReplicaStatus.PENDING, model__never_fits_reason="",
                              status_changed_at__gt=timezone.now() - PENDING_PATIENCE).exists():
        return False
    return not Member.objects.filter(replica__status__in=[ReplicaStatus.STOPPING, ReplicaStatus.FAILED]).exclude(
        state=MemberState.GONE).exists()


def placed_replicas() -> tuple[dict[str, list[spread.SpreadReplica]], list[tuple[int, ExistingReplica]]]:
    """Every placed replica: per model (ready and not moving), and all of them for the snapshot."""
    rows = (
        Member.objects.filter(replica__status__in=PLACED)
        .values_list("replica_id", "replica__model__name", "replica__fabric__name", "node__name",
                     "replica__status", "replica__draining")
        .order_by("replica_id", "rank")
    )
    found: dict[int, dict] = defaultdict(lambda: {"nodes": []})
    for replica_id, model, fabric, node, status, draining in rows:
        entry = found[replica_id]
        entry.update(model=model, fabric=fabric, status=status, draining=draining)
        entry["nodes"].append(node)
    by_model: dict[str, list[spread.SpreadReplica]] = defaultdict(list)
    existing = []
    for replica_id, e in found.items():
        nodes = tuple(e["nodes"])
        existing.append((replica_id, ExistingReplica(e["model"], e["fabric"], nodes)))
        if e["status"] == ReplicaStatus.READY and not e["draining"]:
            by_model[e["model"]].append(spread.SpreadReplica(replica_id, e["fabric"], nodes))
    return by_model, existing


def spread_move_start(*, model: CatalogEntry, move: spread.SpreadMove) -> bool:
    """Mark the original moving and place its replacement, in one
    transaction. Rows in the lock order (docs/architecture.md): the catalog
    entry, the destination's nodes (ascending pk), then the original, then
    its replacement (a higher pk) inside ``placements_persist``."""
    try:
        with transaction.atomic():
            entry = CatalogEntry.objects.select_for_update(no_key=True).get(pk=model.pk)
            nodes_lock(move.destination.nodes)
            if not Replica.objects.filter(pk=move.replica, status=ReplicaStatus.READY,
                                          draining=False).update(draining=True):
                return False
            # The replacement runs what the original runs (replicas.revisions), as a drain's does.
            revision_id = Replica.objects.filter(pk=move.replica).values_list("revision_id", flat=True).first()
            replacement = Replica.objects.create(model=entry, status=ReplicaStatus.PENDING, revision_id=revision_id,
                                                 status_changed_at=timezone.now())
            event_record(
                kind=ReplicaEventKind.REPLICA_STATUS, subject=f"replica/{move.replica}",
                message=f"moving {entry.name} replica {move.replica} to spread the model (replacement: replica "
                f"{replacement.pk}, ready before the original stops; LLMGW_SPREAD=0 turns this off): {move.reason}",
                data={"model": entry.name, "replica": move.replica, "replacement": replacement.pk,
                      "to": list(move.destination.nodes), "fabric": move.destination.fabric, "why": "spread"},
            )
            placements_persist([(replacement, move.destination)])
    except (IntegrityError, PlacementConflict) as exc:
        logger.info("spread move of replica=%s not started (%s); the next reconcile plans again", move.replica, exc)
        return False
    return True


def spread_step() -> int:
    """From the reconcile: finish spread moves whose replacements are ready;
    on a quiet cluster, start at most one. Returns the moves started."""
    if not settings.LLMGW_SPREAD:
        return 0
    moves.moves_finish()
    if not _quiet():
        return 0
    by_model, existing = placed_replicas()
    crowded = [name for name, replicas in by_model.items() if len(replicas) >= 2]
    if not crowded:
        return 0
    nodes = list(cluster_snapshot().nodes.values())
    models = {}
    planned = []
    for model in CatalogEntry.objects.filter(name__in=crowded, removing=False).order_by("name"):
        replicas = by_model[model.name]
        if len(replicas) != model.replicas:
            continue
        request = PlacementRequest(model.name, model.nodes, model.gpus_per_node)
        move = spread.respread(model.name, request, replicas, nodes, existing)
        if move is not None:
            models[model.name] = model
            planned.append((model.name, move))
    for name, move in spread.node_moves_first(planned):
        if spread_move_start(model=models[name], move=move):
            return 1
    return 0
