"""A rollout to new weights stages them before its first replacement.

When a rollout's new revision runs other weights than the old one (another
source, so another manifest: ``ModelRevision.manifest``), replacing a
replica would otherwise wait on a download each time. So, before any
replacement starts, the rollout asks the nodes its replacements will likely
land on to fetch the new weights, through the rows ``llmgw ctl models
stage`` writes (``StagedWeights``, of kind ``rollout``), and waits while the
old replicas keep serving:

- the targets (``staging_targets``, pure): the nodes of the replicas being
  replaced (a replacement takes their GPUs once they stop), the model's
  spares and nodes staged by hand, and where the first ``max_surge``
  replacements would be placed now; only nodes with a weights cache and
  room for them (the others are named in the log);
- the gate (``staging_gate``, pure): done once every target holds them,
  verified; failed when a node has no space, or keeps an error (a source
  that does not answer, a file whose sha256 never matches) for
  ``LLMGW_ROLLOUT_STAGING_GRACE`` seconds; otherwise what it waits for, in
  words: ``staging weights m@v2: 1 of 3 nodes, 40.0 MB of 120.0 MB, about
  12s left``.

The progress (bytes, rate, errors) is what the agents last reported of their
caches (``CachedWeights``), read at each step of the rollout.
The rows go when the rollout ends (done, superseded or failed): by then the
replacements' own members keep the weights wanted where they run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from django.conf import settings

from nodes.choices import NodeStatus
from nodes.models import Node
from nodes.services import nodes_desired_changed

from . import placement
from .choices import PLACED
from .models import CachedWeights, CatalogEntry, Member, ModelRevision, Replica, Rollout, StagedWeights
from .revisions import revision_manifest, weights_key_of
from .scheduling import cluster_snapshot
from .weights import FETCHED
from .weights_cache import weights_view
from .weights_placement import WeightsNeed, WeightsView, place_weights, size_text

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeStage:
    """One target node's progress, as its agent last reported it."""

    name: str
    total: int
    bytes: int = 0
    rate: float = 0.0
    error: str = ""
    error_since: float | None = None
    complete: bool = False


@dataclass(frozen=True, slots=True)
class Gate:
    waiting: str = ""  # what the rollout waits for ('' once staged)
    failed: str = ""  # why the weights cannot be staged ('' while they may be)


def staging_targets(*, originals: list[str], staged: list[str], landing: list[str], view: WeightsView,
                    need: WeightsNeed) -> tuple[list[str], list[str]]:
    """(nodes to stage on, nodes left out for want of room or a cache) (pure)."""
    candidates = list(dict.fromkeys([*originals, *staged, *landing]))
    able = [n for n in candidates if view.fits(n, need)]
    return sorted(able), sorted(set(candidates) - set(able))


def staging_gate(*, key: str, nodes: list[NodeStage], now: float, grace: float) -> Gate:
    """Where the staging of ``key`` on ``nodes`` stands (pure)."""
    for node in nodes:
        if node.complete:
            continue
        if node.error.startswith("no space"):
            return Gate(failed=f"{node.name} cannot stage {key}: {node.error}")
        if node.error and node.error_since is not None and now - node.error_since >= grace:
            return Gate(failed=f"{node.name} cannot stage {key}: {node.error} (for {now - node.error_since:.0f}s)")
    done = sum(1 for n in nodes if n.complete)
    if done == len(nodes):
        return Gate()
    fetched = sum(n.total if n.complete else min(n.bytes, n.total) for n in nodes)
    total = sum(n.total for n in nodes)
    eta = max(((n.total - n.bytes) / n.rate for n in nodes if not n.complete and n.rate > 0), default=None)
    words = f"staging weights {key}: {done} of {len(nodes)} nodes, {size_text(fetched)} of {size_text(total)}"
    words += f", about {eta:.0f}s left" if eta is not None else ""
    errors = [f"{n.name}: {n.error}" for n in nodes if n.error and not n.complete]
    if errors:
        words += f" (retrying: {'; '.join(errors[:3])})"
    return Gate(waiting=words + "; the old replicas keep serving")


# --- the service -----------------------------------------------------------------------------


def _landing(model: CatalogEntry, target: ModelRevision, need: WeightsNeed, view: WeightsView) -> list[str]:
    """Where the first replacements would be placed now (the view's holders first, as the scheduler does)."""
    spec = target.spec
    snapshot = cluster_snapshot()
    request = placement.PlacementRequest(model.name, spec["nodes"], spec["gpus_per_node"])
    nodes: list[str] = []
    for _ in range(max(1, model.max_surge)):
        result = place_weights(request, snapshot, view, need)
        if not isinstance(result, placement.Placement):
            break
        snapshot.allocate(result)
        nodes += [m.node for m in result.members]
    return nodes


def _plan(rollout: Rollout, model: CatalogEntry, target: ModelRevision, say: Callable[..., None]) -> dict[str, Any]:
    previous = ModelRevision.objects.filter(model=model, number=rollout.from_revision).first()
    manifest = revision_manifest(target, model)
    key = weights_key_of(model.name, manifest)
    if not key or manifest.get("kind") not in FETCHED or key == weights_key_of(
            model.name, revision_manifest(previous, model)):
        return {"key": key, "done": time.time(), "nodes": {}}  # the same weights, or none to fetch
    need = WeightsNeed(key=key, total=int(manifest.get("total_bytes") or 0))
    view = weights_view()
    originals = sorted(set(Member.objects.filter(replica__model=model, replica__status__in=PLACED,
                                                 node__status=NodeStatus.READY).values_list("node__name", flat=True)))
    staged = sorted(StagedWeights.objects.filter(model=model, node__status=NodeStatus.READY)
                    .values_list("node__name", flat=True))
    landing = _landing(model, target, need, weights_view())
    nodes, left_out = staging_targets(originals=originals, staged=staged, landing=landing, view=view, need=need)
    state = {"key": key, "total": need.total, "started": time.time(), "left_out": left_out,
             "nodes": {n: {"bytes": 0, "total": need.total, "rate": 0.0, "error": "", "error_since": None}
                       for n in nodes}}
    if not nodes:
        if left_out:
            state["failed"] = (f"no node has room for {key} ({size_text(need.total)}): "
                               + ", ".join(f"{n}: {size_text(view.room.get(n, 0))} free" if n in view.caches
                                           else f"{n}: no weights cache" for n in left_out[:5])
                               + "; free space in the nodes' caches or raise their budget, then resume")
        else:
            state["done"] = time.time()  # no node keeps a cache: each replacement fetches its own
        return state
    rows = {n.name: n for n in Node.objects.filter(name__in=nodes)}
    for name in nodes:
        StagedWeights.objects.get_or_create(node=rows[name], model=model, defaults={"why": StagedWeights.Why.ROLLOUT})
    say(f"staging weights {key} ({size_text(need.total)}) on {', '.join(nodes)} before the first replacement"
        + (f" (left out, no room or no cache: {', '.join(left_out)})" if left_out else ""), key=key, nodes=nodes)
    nodes_desired_changed(node_names=nodes)
    return state


def rollout_weights_gate(rollout: Rollout, model: CatalogEntry, target: ModelRevision,
                         say: Callable[..., None]) -> Gate:
    """Whether the rollout may start replacements: its new weights staged.
    Called by ``rollout_step`` with the entry and the rollout locked; saves
    the rollout's ``staging`` (and log) when they change."""
    state = dict(rollout.staging or {})
    if state.get("done"):
        return Gate()
    if not state:
        state = _plan(rollout, model, target, say)
    if state.get("failed"):
        rollout.staging = state
        rollout.save(update_fields=["staging", "log"])
        return Gate(failed=state["failed"])
    if state.get("done"):
        rollout.staging = state
        rollout.save(update_fields=["staging", "log"])
        return Gate()
    key = state["key"]
    model_name, _, revision = key.partition("@")
    now = time.time()
    live = set(Node.objects.filter(name__in=state["nodes"], status=NodeStatus.READY).values_list("name", flat=True))
    rows = {c.node.name: c for c in CachedWeights.objects.filter(node__name__in=live, model=model_name,
                                                                revision=revision).select_related("node")}
    nodes, seen = [], {}
    for name, before in sorted(state["nodes"].items()):
        if name not in live:
            continue  # a node lost meanwhile is not waited for
        row = rows.get(name)
        error = row.error if row is not None and not row.complete else ""
        seen[name] = {**before, "bytes": row.bytes if row else 0, "total": (row.total if row else 0) or before["total"],
                      "rate": row.rate if row else 0.0, "error": error,
                      "error_since": (before.get("error_since") or now) if error else None}
        s = seen[name]
        nodes.append(NodeStage(name, total=int(s["total"]), bytes=int(s["bytes"]), rate=float(s["rate"]),
                               error=error, error_since=s["error_since"], complete=bool(row and row.complete)))
    state["nodes"] = {**state["nodes"], **seen}
    gate = staging_gate(key=key, nodes=nodes, now=now, grace=settings.LLMGW_ROLLOUT_STAGING_GRACE)
    if gate.failed:
        state["failed"] = gate.failed
    elif not gate.waiting:
        state["done"] = now
        held = sorted(n.name for n in nodes if n.complete)
        say(f"weights {key} staged on {', '.join(held) or 'no node'} in {now - state['started']:.1f}s: "
            "replacements start from local weights", key=key)
    if state != rollout.staging:
        rollout.staging = state
        rollout.save(update_fields=["staging", "log"])
    return gate


def rollout_weights_release(rollout: Rollout) -> None:
    """The rollout ended: its staging rows go (the nodes may evict the
    weights when they need room, never while a replica uses them)."""
    rows = StagedWeights.objects.filter(model_id=rollout.model_id, why=StagedWeights.Why.ROLLOUT)
    nodes = sorted(rows.values_list("node__name", flat=True))
    if nodes:
        rows.delete()
        nodes_desired_changed(node_names=nodes)
