"""Reads about models, replicas and members."""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.db.models import Prefetch, Q, QuerySet

from .choices import PLACED, MemberState, ReplicaStatus
from .models import CatalogEntry, Drain, Member, Replica
from .revisions import revision_manifest, weights_key_of


def members_wanted() -> QuerySet[Member]:
    """The members that should be running on their nodes: those of a placed
    replica, and of a stopping one or a failed one still finishing its
    in-flight requests (not yet quiesced: ``replicas_quiesce``), unless
    already gone. The one statement of that rule: the nodes' desired state
    and the scheduler's view of orphaned engines read it."""
    return Member.objects.filter(
        Q(replica__status__in=PLACED)
        | Q(replica__status__in=[ReplicaStatus.STOPPING, ReplicaStatus.FAILED], replica__quiesced=False)
    ).exclude(state=MemberState.GONE)


def node_desired_members(*, node_name: str) -> list[dict[str, Any]]:
    """The members a node should run: its wanted members."""
    members = (
        members_wanted().filter(node__name=node_name)
        # A staging replica's members start once all its nodes hold its
        # weights (replicas.weights_cache.replicas_staging_advance).
        .exclude(replica__status=ReplicaStatus.STAGING)
        .select_related("replica__model", "replica__revision")
        .order_by("replica_id", "rank")
    )
    return [
        {
            "member": m.member_id,
            "replica": str(m.replica_id),
            "model": m.replica.model.name,
            "rank": m.rank,
            # The engine of the revision it launched as (replicas.revisions).
            "engine": m.replica.revision.spec["engine"] if m.replica.revision_id else m.replica.model.engine,
            "argv": m.argv,
            "env": m.env,
            "gpus": m.gpus,
            "ports": m.ports,
            "serves_http": m.serves_http,
            "health_url": m.health_url or None,
            # The weights of that revision (an older replica keeps its own during a rollout).
            "weights": weights_key_of(m.replica.model.name, revision_manifest(m.replica.revision, m.replica.model)),
        }
        for m in members
    ]


def node_replica_counts() -> dict[str, int]:
    counts: Counter[str] = Counter()
    for node_name in (
        Member.objects.filter(replica__status__in=PLACED).exclude(state=MemberState.GONE).values_list("node__name", flat=True)
    ):
        counts[node_name] += 1
    return dict(counts)


def replica_list(*, model: str | None = None, include_stopped: bool = False):
    replicas = Replica.objects.select_related("model", "fabric", "revision").prefetch_related(
        Prefetch("members", queryset=Member.objects.select_related("node").order_by("rank"))
    )
    if model:
        replicas = replicas.filter(model__name=model)
    if not include_stopped:
        replicas = replicas.exclude(status="stopped")
    return replicas.order_by("model__name", "id")


def model_list():
    return CatalogEntry.objects.prefetch_related(
        Prefetch("replica_set", queryset=Replica.objects.select_related("revision")), "revisions")


def drain_list(*, node: str | None = None):
    drains = Drain.objects.select_related("node", "current")
    return drains.filter(node__name=node) if node else drains
