"""Revisions of a catalog entry: what its replicas launch as.

A revision is the launch-relevant fields of an entry (``LAUNCH_FIELDS``:
what changes the engine's argv, environment or shape), their digest and a
number that only grows per model. The replica count, the rollout settings
and anything about routing or scaling are not in it: changing them starts
or stops replicas, it does not replace them.

Each replica records the revision it was made from, and is placed and
launched from that revision's spec, not from the entry as it is now: a
replica made before a change keeps its argv until a rollout
(``replicas.rollout``) replaces it. Two revisions with the same digest
launch the same thing: a replica of either counts as current.

A revision keeps the manifest its weights source resolved to (the files,
sizes and sha256): replicas of an older revision keep fetching and running
their own weights while a rollout brings the new ones
(``replicas.rollout_weights``).

A launch-relevant field added later (a weights revision, an engine
version) goes in ``LAUNCH_FIELDS``; nothing else changes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from .models import CatalogEntry, ModelRevision, Replica

LAUNCH_FIELDS = ("engine", "weights", "nodes", "gpus_per_node", "args", "env", "source")
# Revisions kept per model besides those a replica still runs (kubectl's revisionHistoryLimit).
HISTORY = 10


def launch_fields(model: CatalogEntry) -> dict[str, Any]:
    return {f: getattr(model, f) for f in LAUNCH_FIELDS}


def revision_digest(spec: dict[str, Any]) -> str:
    # A weights source (replicas.weights) counts only when there is one, so
    # that revisions recorded before sources existed keep their digests.
    fields = {f: spec.get(f) for f in LAUNCH_FIELDS if f != "source" or spec.get(f)}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class Launch:
    """What a replica launches as: its model's name and its revision's fields
    (the attributes ``replicas.launch.member_launch`` and placement read)."""

    name: str
    engine: str
    weights: str
    nodes: int
    gpus_per_node: int
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    revision: int = 0
    # The revision's resolved weights (replicas.weights; {}: not managed).
    manifest: dict = field(default_factory=dict)


def revision_manifest(revision: ModelRevision | None, model: CatalogEntry) -> dict[str, Any]:
    """The weights a revision launches with: what its source resolved to when
    it was recorded. A revision with no source has none; one recorded before
    manifests were kept with revisions (or a replica with no revision) has
    the entry's."""
    if revision is None:
        return model.manifest or {}
    if "source" in revision.spec and not revision.spec.get("source"):
        return {}
    return revision.manifest or model.manifest or {}


def weights_key_of(name: str, manifest: dict[str, Any]) -> str:
    """model@revision of managed weights ('' when not managed): what a node's cache holds them as."""
    return f"{name}@{manifest['revision']}" if manifest else ""


def replica_launch(replica: Replica) -> Launch:
    model = replica.model
    revision = replica.revision
    spec = revision.spec if revision is not None else launch_fields(model)
    return Launch(name=model.name, engine=spec["engine"], weights=spec["weights"], nodes=spec["nodes"],
                  gpus_per_node=spec["gpus_per_node"], args=list(spec.get("args") or []),
                  env=dict(spec.get("env") or {}), revision=revision.number if revision is not None else 0,
                  manifest=revision_manifest(revision, model))


def revision_current(model: CatalogEntry) -> ModelRevision:
    """The model's current revision; recorded now when the entry has changed
    since the last one (or none was). Called with the entry's row locked."""
    spec = launch_fields(model)
    digest = revision_digest(spec)
    current = ModelRevision.objects.filter(model=model, number=model.revision).first() if model.revision else None
    if current is not None and current.digest == digest:
        if model.manifest and not current.manifest:
            current.manifest = model.manifest
            current.save(update_fields=["manifest"])
        return current
    number = (ModelRevision.objects.filter(model=model).order_by("-number").values_list("number", flat=True).first()
              or 0) + 1
    current = ModelRevision.objects.create(model=model, number=number, digest=digest, spec=spec,
                                           manifest=model.manifest or {})
    model.revision = number
    CatalogEntry.objects.filter(pk=model.pk).update(revision=number)
    _history_prune(model)
    return current


def revision_previous(model: CatalogEntry) -> ModelRevision | None:
    """The latest revision before the current one that launches differently (what undo returns to)."""
    current = ModelRevision.objects.filter(model=model, number=model.revision).first()
    older = ModelRevision.objects.filter(model=model, number__lt=model.revision).order_by("-number")
    if current is not None:
        older = older.exclude(digest=current.digest)
    return older.first()


def revision_get(model: CatalogEntry, number: int) -> ModelRevision | None:
    return ModelRevision.objects.filter(model=model, number=number).first()


def _history_prune(model: CatalogEntry) -> None:
    keep = list(ModelRevision.objects.filter(model=model).order_by("-number").values_list("pk", flat=True)[:HISTORY])
    (ModelRevision.objects.filter(model=model).exclude(pk__in=keep)
     .exclude(pk__in=Replica.objects.filter(model=model).values("revision_id")).delete())


def short(digest: str) -> str:
    return digest[:12]
