"""The nodes' weights caches as the control plane knows them, and staging.

- ``node_weights_report`` (a ``nodes.hooks`` handler): what an agent says its
  cache holds becomes ``CachedWeights`` and ``NodeCache`` rows, written when
  the report changes (the heartbeat's hot path compares a digest of it), and
  the progress of the staging replicas with a member there;
- ``weights_view``: those rows as ``replicas.weights_placement`` reads them;
- ``replicas_staging_begin``: a replica placed where its weights are missing
  goes ``scheduled -> staging``; ``replicas_staging_advance`` moves it on to
  ``starting`` once every node of it holds them (its members then reach the
  agents: ``replicas.selectors.node_desired_members`` leaves out those of a
  staging replica), from the heartbeat hook and from every reconcile; or
  fails it when a node of it cannot stage them (``staging_verdict``, pure:
  ``no space``, or no progress for ``LLMGW_STAGING_TIMEOUT``), so that the
  reconcile places a replacement, and ``weights_view`` keeps that node from
  being chosen for the same weights for as long;
- ``node_desired_weights`` (a ``nodes.hooks`` provider): the weights a node
  should hold: those of its members, of spares and stagings asked for
  (``replicas.weights_spares``), and the in-place sources it should look for.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections import defaultdict
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core.choices import EventSeverity
from core.events import event_record
from nodes.models import Node
from nodes.services import nodes_desired_changed

from .choices import PLACED, ReplicaEventKind, ReplicaStatus
from .models import CachedWeights, CatalogEntry, Member, NodeCache, Replica, StagedWeights
from .services import replica_fail, replica_transition
from .revisions import revision_manifest, weights_key_of
from .weights import FETCHED
from .weights_placement import WeightsNeed, WeightsView, size_text

logger = logging.getLogger(__name__)

MILESTONES = (25, 50, 75)
# An agent's error that waiting will not fix: its cache has no room for the
# weights and nothing it may evict (agent.weights).
NO_SPACE = "no space"


def weights_key(model: CatalogEntry) -> str:
    """model@revision of a managed model ('' when its weights are not managed):
    of its current revision (or of a replica's launch, ``revisions.Launch``)."""
    return weights_key_of(model.name, model.manifest)


def weights_need(model: CatalogEntry) -> WeightsNeed | None:
    """What a model's weights ask of a node (None: not managed): of its
    current revision, or of a replica's launch (``revisions.Launch``)."""
    return weights_need_of(model.name, model.manifest)


def weights_need_of(name: str, manifest: dict[str, Any]) -> WeightsNeed | None:
    if not manifest:
        return None
    return WeightsNeed(key=weights_key_of(name, manifest), total=int(manifest.get("total_bytes") or 0),
                       fetchable=manifest.get("kind") in FETCHED)


# --- what the nodes hold --------------------------------------------------------------------------


def _members_weights(members) -> list[tuple[str, CatalogEntry, dict[str, Any]]]:
    """(node, model, manifest) of each member: the weights of its replica's revision."""
    return [(m.node.name, m.replica.model, revision_manifest(m.replica.revision, m.replica.model))
            for m in members.select_related("node", "replica__model", "replica__revision")]


def weights_in_use() -> dict[str, set[str]]:
    """{node: keys of the weights its placed replicas use}: never evicted."""
    managed = CatalogEntry.objects.exclude(manifest={})
    used: dict[str, set[str]] = defaultdict(set)
    for node, model, manifest in _members_weights(
            Member.objects.filter(replica__status__in=PLACED, replica__model__in=managed)):
        if manifest:
            used[node].add(weights_key_of(model.name, manifest))
    # Spares and stagings asked for are kept too (the agents are told to hold them).
    keys = {m.pk: weights_key(m) for m in managed.only("pk", "name", "manifest")}
    for node, model_id in StagedWeights.objects.filter(model_id__in=keys).values_list("node__name", "model_id"):
        used[node].add(keys[model_id])
    return used


def weights_view() -> WeightsView:
    view = WeightsView()
    in_use = weights_in_use()
    evictable: dict[str, int] = defaultdict(int)
    for node, model, revision, size, complete in CachedWeights.objects.values_list(
            "node__name", "model", "revision", "bytes", "complete"):
        key = f"{model}@{revision}"
        if complete:
            view.holders.setdefault(key, set()).add(node)
            if key not in in_use.get(node, ()):
                evictable[node] += size
        else:
            view.partial[(node, key)] = size
    for node, free in NodeCache.objects.values_list("node__name", "free_bytes"):
        view.caches.add(node)
        view.room[node] = free + evictable[node]
    view.failed = staging_failures()
    return view


def staging_failures(*, now: float | None = None) -> dict[tuple[str, str], str]:
    """{(node, key): why}: nodes that could not stage these weights for a
    replica within the last LLMGW_STAGING_TIMEOUT; not chosen for them again
    meanwhile (a stalled link or a full cache is likely to be so still)."""
    now = time.time() if now is None else now
    window = settings.LLMGW_STAGING_TIMEOUT
    since = timezone.now() - dt.timedelta(seconds=window)
    failed: dict[tuple[str, str], str] = {}
    for state in Replica.objects.filter(status__in=[ReplicaStatus.FAILED, ReplicaStatus.STOPPED],
                                        status_changed_at__gte=since, staging__has_key="failed"
                                        ).values_list("staging", flat=True):
        what = state["failed"]
        if now - float(what.get("at") or 0) < window:
            failed[(what["node"], state.get("key", ""))] = what.get("cause", "")
    return failed


def node_weights_report(*, node_name: str, report: dict[str, Any] | None) -> None:
    """An agent's report of its weights cache (a cleaned ``WeightsReport``,
    or None for an agent that keeps none)."""
    with transaction.atomic():
        node = Node.objects.filter(name=node_name).only("id").first()
        if node is None:
            return
        if report is None:
            NodeCache.objects.filter(node=node).delete()
            CachedWeights.objects.filter(node=node).delete()
            return
        NodeCache.objects.update_or_create(node=node, defaults={
            "free_bytes": report["free_bytes"], "budget_bytes": report["budget_bytes"],
            "used_bytes": report["used_bytes"]})
        held = {(c.model, c.revision): c for c in CachedWeights.objects.filter(node=node)}
        seen = set()
        for entry in report["models"]:
            ident = (entry["model"], entry["revision"])
            if ident in seen:
                continue
            seen.add(ident)
            values = {"bytes": entry["bytes"], "total": entry["total"], "complete": entry["complete"],
                      "rate": entry["rate"], "error": entry["error"][:1000]}
            row = held.get(ident)
            if row is None:
                CachedWeights.objects.create(node=node, model=ident[0], revision=ident[1], **values)
            elif any(getattr(row, k) != v for k, v in values.items()):
                CachedWeights.objects.filter(pk=row.pk).update(**values)
        gone = [c.pk for ident, c in held.items() if ident not in seen]
        if gone:
            CachedWeights.objects.filter(pk__in=gone).delete()
    staging_progress(node_name=node_name, report=report)
    replicas_staging_advance()


# --- staging --------------------------------------------------------------------------------------


def _holding(node_names: set[str], key: str) -> set[str]:
    model, _, revision = key.partition("@")
    return set(CachedWeights.objects.filter(node__name__in=node_names, model=model, revision=revision, complete=True)
               .values_list("node__name", flat=True))


def replicas_staging_begin(*, replicas: list[Replica]) -> None:
    """Just placed (scheduled, in the placement's transaction): a replica
    whose nodes do not all hold its weights stages them first."""
    for replica in replicas:
        manifest = revision_manifest(replica.revision, replica.model)
        key = weights_key_of(replica.model.name, manifest)
        if not key:
            continue
        nodes = set(Member.objects.filter(replica=replica).values_list("node__name", flat=True))
        missing = sorted(nodes - _holding(nodes, key))
        if not missing:
            continue
        total = int(manifest.get("total_bytes") or 0)
        replica_transition(
            replica_id=replica.pk, to=ReplicaStatus.STAGING, expected=ReplicaStatus.SCHEDULED,
            reason=f"fetching {key} ({total} bytes) on {', '.join(missing)}",
        )
        Replica.objects.filter(pk=replica.pk).update(staging={
            "key": key, "bytes": 0, "total": total * len(missing), "rate": 0.0, "eta": None,
            "started": time.time(), "nodes": {n: {"bytes": 0, "total": total, "rate": 0.0, "error": "",
                                                  "progressed": time.time()} for n in missing}})


def staging_progress(*, node_name: str, report: dict[str, Any]) -> None:
    """The node's report on the replicas staging there: bytes, rate, ETA."""
    entries = {f"{m['model']}@{m['revision']}": m for m in report["models"]}
    staging = Replica.objects.filter(status=ReplicaStatus.STAGING, members__node__name=node_name).select_related("model")
    for replica in staging:
        state = dict(replica.staging or {})
        nodes = dict(state.get("nodes") or {})
        entry = entries.get(state.get("key", ""))
        if node_name not in nodes or entry is None:
            continue
        before = nodes[node_name]
        now = {"bytes": entry["total"] if entry["complete"] else entry["bytes"],
               "total": entry["total"] or before.get("total", 0), "rate": entry["rate"], "error": entry["error"][:1000]}
        if all(before.get(k) == v for k, v in now.items()):
            continue
        # When it last fetched more: a node stalled that long gives up (staging_verdict).
        progressed = now["bytes"] > before.get("bytes", 0) or entry["complete"]
        now["progressed"] = time.time() if progressed else before.get("progressed", state.get("started"))
        nodes[node_name] = now
        done = sum(n["bytes"] for n in nodes.values())
        total = sum(n["total"] for n in nodes.values())
        rate = sum(n["rate"] for n in nodes.values())
        # The slowest node sets the time left: each fetches its own copy.
        eta = max(((n["total"] - n["bytes"]) / n["rate"] for n in nodes.values() if n["rate"] > 0
                   and n["bytes"] < n["total"]), default=None)
        previous_pct = int(100 * state.get("bytes", 0) / total) if total else 0
        pct = int(100 * done / total) if total else 100
        state.update(nodes=nodes, bytes=done, total=total, rate=round(rate, 1),
                     eta=None if eta is None else round(eta, 1))
        Replica.objects.filter(pk=replica.pk, status=ReplicaStatus.STAGING).update(staging=state)
        for milestone in MILESTONES:
            if previous_pct < milestone <= pct:
                event_record(kind=ReplicaEventKind.WEIGHTS, subject=f"replica/{replica.pk}",
                             message=f"{replica.model.name} replica {replica.pk}: weights {milestone}% staged "
                             f"({done} of {total} bytes, {rate / 1e6:.1f} MB/s"
                             + (f", about {eta:.0f}s left)" if eta is not None else ")"),
                             data={"replica": replica.pk, "bytes": done, "total": total, "rate": rate, "eta": eta})
        if now["error"] and now["error"] != before.get("error"):
            event_record(kind=ReplicaEventKind.WEIGHTS, subject=f"replica/{replica.pk}", severity=EventSeverity.WARNING,
                         message=f"{replica.model.name} replica {replica.pk}: {node_name} cannot stage "
                         f"{state['key']}: {now['error']}", data={"replica": replica.pk, "node": node_name})


def staging_verdict(*, key: str, nodes: dict[str, dict[str, Any]], holding: set[str], now: float,
                    timeout: float, started: float | None = None) -> tuple[str, str] | None:
    """(node, cause) when a staging replica gives up, or None while it may
    go on (pure). ``nodes`` is its ``staging["nodes"]``: what each node last
    reported. A node that holds the weights is done; one whose cache has no
    room for them (``no space``) gives up at once; one that has fetched
    nothing more for ``timeout`` seconds (since ``started`` when it never
    said), whatever it says, gives up then."""
    for name, node in sorted(nodes.items()):
        if name in holding:
            continue
        error = node.get("error") or ""
        if error.startswith(NO_SPACE):
            return name, error
        progressed = node.get("progressed", started)
        if progressed is not None and now - progressed >= timeout:
            fetched = f"{size_text(int(node.get('bytes') or 0))} of {size_text(int(node.get('total') or 0))}"
            cause = (f"no progress for {now - progressed:.0f}s (LLMGW_STAGING_TIMEOUT), {fetched} fetched"
                     + (f"; last error: {error}" if error else ""))
            return name, cause
    return None


def replicas_staging_advance(*, now: float | None = None) -> list[int]:
    """staging -> starting for every replica whose nodes all hold its
    weights; its members then reach the agents. staging -> failed for one
    that a node of it cannot stage (``staging_verdict``): the reconcile
    enqueued on commit places its replacement, elsewhere. Level-triggered:
    the heartbeat hook and every reconcile call it."""
    advanced = []
    for replica in Replica.objects.filter(status=ReplicaStatus.STAGING).select_related("model", "revision"):
        key = weights_key_of(replica.model.name, revision_manifest(replica.revision, replica.model))
        nodes = set(replica.members.values_list("node__name", flat=True))
        holding = _holding(nodes, key) if key else nodes
        if nodes - holding:
            _staging_give_up(replica, key=key, holding=holding, now=time.time() if now is None else now)
            continue
        with transaction.atomic():
            started = (replica.staging or {}).get("started")
            took = f" in {time.time() - started:.1f}s" if started else ""
            moved = replica_transition(replica_id=replica.pk, to=ReplicaStatus.STARTING, expected=ReplicaStatus.STAGING,
                                       reason=f"weights {key} staged on {', '.join(sorted(nodes))}{took}")
            if moved is not None:
                Replica.objects.filter(pk=replica.pk).update(
                    staging={**(replica.staging or {}), "bytes": (replica.staging or {}).get("total", 0),
                             "eta": 0, "rate": 0.0, "done": time.time()})
                nodes_desired_changed(node_names=sorted(nodes))
                advanced.append(replica.pk)
    return advanced


def _staging_give_up(replica: Replica, *, key: str, holding: set[str], now: float) -> None:
    state = replica.staging or {}
    verdict = staging_verdict(key=key, nodes=state.get("nodes") or {}, holding=holding, now=now,
                              timeout=settings.LLMGW_STAGING_TIMEOUT, started=state.get("started"))
    if verdict is None:
        return
    node, cause = verdict
    with transaction.atomic():
        # Its own row only (a status change); the reconcile on commit makes
        # the replacement, which staging_failures keeps off this node.
        failed = replica_fail(replica_id=replica.pk,
                              reason=f"{node} cannot stage {key}: {cause}; a replacement is placed elsewhere")
        if failed is not None:
            Replica.objects.filter(pk=replica.pk).update(
                staging={**state, "failed": {"node": node, "cause": cause[:1000], "at": now}})
            logger.warning("staging gave up replica=%s node=%s key=%s: %s", replica.pk, node, key, cause)


# --- what a node should hold ----------------------------------------------------------------------


def _desired_entry(model: CatalogEntry, manifest: dict[str, Any]) -> dict[str, Any]:
    entry = {"model": model.name, "revision": manifest["revision"], "files": [], "path": ""}
    if manifest.get("kind") in FETCHED:
        entry["files"] = [{k: f[k] for k in ("name", "size", "sha256", "url")} for f in manifest["files"]]
    else:
        entry["path"] = manifest.get("path") or model.weights
    return entry


def node_desired_weights(*, node_name: str) -> list[dict[str, Any]]:
    """The weights a node should hold (agent.protocol.DesiredWeights): those
    of the revisions its members run (during a rollout, an original's and
    its replacement's may both be here), and the entry's current ones for
    spares, stagings asked for and in-place sources."""
    models = {m.pk: m for m in CatalogEntry.objects.exclude(manifest={}).filter(removing=False)}
    wanted: dict[str, tuple[CatalogEntry, dict[str, Any]]] = {}
    for _, model, manifest in _members_weights(
            Member.objects.filter(node__name=node_name, replica__status__in=PLACED, replica__model_id__in=models)):
        if manifest:
            wanted.setdefault(weights_key_of(model.name, manifest), (model, manifest))
    staged = set(StagedWeights.objects.filter(node__name=node_name).values_list("model_id", flat=True))
    for pk, model in models.items():
        # In place (a shared path, placed by hand): every node looks, and says.
        if pk in staged or model.manifest.get("kind") not in FETCHED:
            wanted.setdefault(weights_key(model), (model, model.manifest))
    return [_desired_entry(model, manifest) for _, (model, manifest) in sorted(wanted.items())]
