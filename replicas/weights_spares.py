"""Weights ready before they are needed: spares per fabric, staging by hand,
and what the operator sees of it all.

- ``spares_choose`` (pure): for a model that wants ``spares`` nodes per fabric
  holding its weights beyond those serving it, which nodes: those that hold
  them already first, then the most room; never a node without room;
- ``spares_reconcile`` (every reconcile): keeps ``StagedWeights`` rows of
  kind spare to that choice, and tells the nodes whose list changed;
- ``weights_stage`` (``llmgw ctl models stage``, the REST API): rows of kind
  manual on the nodes named, or on every ready node of a fabric;
- ``weights_unstage``: the rows go; the agents may evict the weights when
  they need room (never while a replica uses them);
- ``weights_overview``: per node, its cache and what it holds; per model,
  where it is staged (the API, ``ctl nodes``, ``ctl models``, the UI).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from django.db import transaction

from core.events import event_record
from core.exceptions import NotFound
from nodes.choices import NodeStatus
from nodes.models import Node
from nodes.services import nodes_desired_changed

from .choices import PLACED, ReplicaEventKind
from .models import CachedWeights, CatalogEntry, Member, NodeCache, StagedWeights
from .weights import FETCHED
from .weights_cache import weights_key, weights_need, weights_view
from .weights_placement import WeightsNeed, WeightsView

logger = logging.getLogger(__name__)


class StageRefused(ValueError):
    """What cannot be staged, and what to do instead (a 400)."""


def spares_choose(*, count: int, candidates: list[str], view: WeightsView, need: WeightsNeed,
                  current: set[str]) -> list[str]:
    """``count`` nodes of one fabric to keep the weights on (pure): current
    spares that still fit first (no churn), then holders, then the most room."""
    able = [n for n in candidates if view.fits(n, need)]
    ranked = sorted(able, key=lambda n: (n not in current, not view.holds(n, need.key), -view.room.get(n, 0), n))
    return ranked[:count]


def spares_reconcile() -> list[str]:
    """Keep every model's spares per fabric; returns the nodes told anew."""
    models = [m for m in CatalogEntry.objects.exclude(manifest={}).filter(removing=False)
              if m.manifest.get("kind") in FETCHED]
    wanted: dict[tuple[int, str], str] = {}  # (model pk, node) -> why
    if any(m.spares for m in models):
        view = weights_view()
        fabrics: dict[str, list[str]] = defaultdict(list)
        for name, fabric in (Node.objects.filter(status=NodeStatus.READY)
                             .values_list("name", "fabrics__name")):
            if fabric:
                fabrics[fabric].append(name)
        serving: dict[int, set[str]] = defaultdict(set)
        for model_id, node in Member.objects.filter(replica__status__in=PLACED).values_list(
                "replica__model_id", "node__name"):
            serving[model_id].add(node)
        current: dict[int, set[str]] = defaultdict(set)
        for model_id, node in StagedWeights.objects.filter(why=StagedWeights.Why.SPARE).values_list(
                "model_id", "node__name"):
            current[model_id].add(node)
        for model in models:
            if not model.spares:
                continue
            need = weights_need(model)
            for fabric, names in sorted(fabrics.items()):
                candidates = sorted(n for n in names if n not in serving[model.pk])
                for node in spares_choose(count=model.spares, candidates=candidates, view=view, need=need,
                                          current=current[model.pk]):
                    wanted[(model.pk, node)] = StagedWeights.Why.SPARE
                    if not view.holds(node, need.key):
                        view.room[node] = view.room.get(node, 0) - view.need_on(node, need)
    told: set[str] = set()
    with transaction.atomic():
        rows = {(s.model_id, s.node.name): s for s in
                StagedWeights.objects.filter(why=StagedWeights.Why.SPARE).select_related("node", "model")}
        for ident, row in rows.items():
            if ident not in wanted:
                row.delete()
                told.add(ident[1])
        nodes = {n.name: n for n in Node.objects.filter(name__in={n for _, n in wanted})}
        names = {m.pk: m.name for m in models}
        for (model_id, node), why in wanted.items():
            if (model_id, node) in rows or StagedWeights.objects.filter(model_id=model_id, node__name=node).exists():
                continue
            StagedWeights.objects.create(model_id=model_id, node=nodes[node], why=why)
            told.add(node)
            event_record(kind=ReplicaEventKind.WEIGHTS, subject=f"model/{names[model_id]}",
                         message=f"{names[model_id]}: {node} keeps its weights as a spare of its fabric",
                         data={"model": names[model_id], "node": node, "why": "spare"})
    if told:
        nodes_desired_changed(node_names=sorted(told))
    return sorted(told)


def weights_stage(*, model: str, nodes: list[str] | None = None, fabric: str | None = None,
                  actor: str = "") -> list[str]:
    """Stage a model's weights by hand on the nodes named, or on every ready
    node of a fabric; returns the nodes asked. StageRefused says why not."""
    entry = CatalogEntry.objects.filter(name=model).first()
    if entry is None:
        raise NotFound(f"no model named {model!r} in the catalog; 'llmgw ctl models' lists them")
    if not entry.manifest or entry.manifest.get("kind") not in FETCHED:
        raise StageRefused(f"{model} has no weights source to fetch from (source kind "
                           f"{(entry.manifest or {}).get('kind', 'unmanaged')}): give it a source of kind hf or http")
    if bool(nodes) == bool(fabric):
        raise StageRefused("name nodes (--node N, more than once) or one fabric (--fabric F), not both or neither")
    if fabric:
        targets = sorted(Node.objects.filter(fabrics__name=fabric, status=NodeStatus.READY)
                         .values_list("name", flat=True))
        if not targets:
            raise StageRefused(f"fabric {fabric} has no ready node; 'llmgw ctl fabrics' lists them")
    else:
        targets = sorted(set(nodes))
        known = set(Node.objects.filter(name__in=targets).values_list("name", flat=True))
        if missing := [n for n in targets if n not in known]:
            raise StageRefused(f"no node named {', '.join(missing)}; 'llmgw ctl nodes' lists them")
    view = weights_view()
    need = weights_need(entry)
    short = [n for n in targets if not view.fits(n, need)]
    if short:
        detail = ", ".join(f"{n}: {view.room.get(n, 0)} bytes of room" if n in view.caches else f"{n}: no weights cache"
                           for n in short)
        raise StageRefused(f"{model} needs {need.total} bytes; not enough room on {detail}. Free space, raise the "
                           "cache budget (agent.yaml weights.budget), or choose other nodes")
    with transaction.atomic():
        rows = {n.name: n for n in Node.objects.filter(name__in=targets)}
        for name in targets:
            StagedWeights.objects.update_or_create(node=rows[name], model=entry,
                                                   defaults={"why": StagedWeights.Why.MANUAL})
        event_record(kind=ReplicaEventKind.WEIGHTS, subject=f"model/{model}",
                     message=f"{model}: weights staged by hand on {', '.join(targets)}"
                     + (f" by {actor}" if actor else ""), data={"model": model, "nodes": targets, "actor": actor})
    nodes_desired_changed(node_names=targets)
    return targets


def weights_overview() -> dict[str, Any]:
    """What every node's cache holds and where every managed model is."""
    nodes: dict[str, dict[str, Any]] = {}
    for cache in NodeCache.objects.select_related("node").order_by("node__name"):
        nodes[cache.node.name] = {"node": cache.node.name, "free_bytes": cache.free_bytes,
                                  "budget_bytes": cache.budget_bytes, "used_bytes": cache.used_bytes, "models": []}
    for row in CachedWeights.objects.select_related("node").order_by("node__name", "model", "revision"):
        entry = nodes.setdefault(row.node.name, {"node": row.node.name, "free_bytes": 0, "budget_bytes": 0,
                                                 "used_bytes": 0, "models": []})
        entry["models"].append({"model": row.model, "revision": row.revision, "bytes": row.bytes,
                                "total": row.total, "complete": row.complete})
    staged = defaultdict(list)
    for model_id, node, why in StagedWeights.objects.values_list("model_id", "node__name", "why"):
        staged[model_id].append({"node": node, "why": why})
    models = []
    for model in CatalogEntry.objects.exclude(manifest={}).order_by("name"):
        key = weights_key(model)
        model_name, _, revision = key.partition("@")
        held = [n for n, e in nodes.items() if any(m["model"] == model_name and m["revision"] == revision
                                                   and m["complete"] for m in e["models"])]
        fetching = [n for n, e in nodes.items() if any(m["model"] == model_name and m["revision"] == revision
                                                       and not m["complete"] for m in e["models"])]
        models.append({"model": model.name, "revision": revision, "kind": model.manifest.get("kind"),
                       "total_bytes": model.manifest.get("total_bytes", 0), "spares": model.spares,
                       "staged_on": sorted(held), "fetching_on": sorted(fetching),
                       "asked": sorted(staged[model.pk], key=lambda s: s["node"])})
    return {"nodes": list(nodes.values()), "models": models}
