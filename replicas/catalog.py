"""The catalog: models to serve, applied declaratively from catalog.yaml,
the REST API or the admin. Its rules are ``replicas.validation``; the
replicas each entry asks for are made by ``replicas.reconcile``."""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction

from core.choices import EventSeverity
from core.events import event_record
from core.exceptions import NotFound

from .choices import ReplicaEventKind
from .enqueue import reconcile_after_commit
from .envmask import env_unmask
from .models import CatalogEntry
from .scheduling import model_never_fits
from .validation import MAX_REPLICAS, CatalogEntryInvalid, admin_only_problems, catalog_entry_clean
from .weights import SourceUnresolvable, source_resolve

logger = logging.getLogger(__name__)

FIELDS = ("engine", "weights", "nodes", "gpus_per_node", "replicas", "args", "env", "source", "manifest", "spares")


class CatalogInvalid(ValueError):
    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


def _from_yaml(entry: Any, index: int) -> dict[str, Any]:
    """catalog.yaml calls the weights 'model'; the API calls them 'weights'."""
    if not isinstance(entry, dict):
        raise CatalogInvalid([f"models[{index}]: each entry must be a mapping with name, engine, model, ..."])
    data = dict(entry)
    if "model" in data and "weights" not in data:
        data["weights"] = data.pop("model")
    return data


def catalog_validate(entries: list[Any], *, admin: bool = True,
                     held: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Clean entries, or CatalogInvalid listing every problem. Without
    ``admin``, an entry may carry an admin-only flag (--trust-remote-code)
    only as ``held`` already has it: unchanged in engine, weights, args and
    env, as an admin wrote it (an operator re-applying the catalog)."""
    errors: list[str] = []
    clean: list[dict[str, Any]] = []
    names: set[str] = set()
    for index, raw in enumerate(entries):
        try:
            data = _from_yaml(raw, index)
        except CatalogInvalid as exc:
            errors.extend(exc.errors)
            continue
        label = f"models[{index}] ({data.get('name', '?')})"
        try:
            value = catalog_entry_clean(data)
        except CatalogEntryInvalid as exc:
            for field, messages in exc.errors.items():
                for message in messages if isinstance(messages, list) else [messages]:
                    errors.append(f"{label}: {field}: {message}")
            continue
        if not admin and not _held_unchanged(value, (held or {}).get(value["name"])):
            errors.extend(f"{label}: args: {message}" for message in admin_only_problems(value))
        if value["name"] in names:
            errors.append(f"{label}: name: {value['name']} appears twice in the catalog")
        names.add(value["name"])
        clean.append(value)
    if errors:
        raise CatalogInvalid(errors)
    return clean


def _keep_masked_secrets(data: dict[str, Any], model: CatalogEntry | None) -> None:
    """A secret sent back masked (as the API showed it) keeps its stored value."""
    if "env" not in data:
        return
    data["env"], missing = env_unmask(new=data["env"], old=model.env if model else None)
    if missing:
        raise CatalogInvalid([f"{data['name']}: env: {name} is the mask, not a value; give the value "
                              "(a masked value keeps the stored one only where one is stored)" for name in missing])


TRUSTED_FIELDS = ("engine", "weights", "args", "env")


def _held_unchanged(value: dict[str, Any], held: dict[str, Any] | None) -> bool:
    if held is None:
        return False
    # A secret sent back masked is the held value (_keep_masked_secrets).
    env, _ = env_unmask(new=value.get("env") or {}, old=held.get("env"))
    return all((env if f == "env" else value.get(f)) == held.get(f) for f in TRUSTED_FIELDS)


def catalog_held(models) -> dict[str, dict[str, Any]]:
    return {m.name: {f: getattr(m, f) for f in TRUSTED_FIELDS} for m in models}


def catalog_manifests(clean: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each entry's weights manifest: the stored one while its source is
    unchanged (a source is resolved once), else resolved now, outside any
    transaction (it reads the source over the network). CatalogInvalid
    names every source that cannot be resolved."""
    stored = {m.name: (m.source, m.manifest) for m in
              CatalogEntry.objects.filter(name__in=[d["name"] for d in clean]).only("name", "source", "manifest")}
    manifests, errors = {}, []
    for data in clean:
        source = data.get("source") or {}
        held_source, held_manifest = stored.get(data["name"], ({}, {}))
        if source == held_source and (held_manifest or not source):
            manifests[data["name"]] = held_manifest
            continue
        try:
            manifests[data["name"]] = source_resolve(source, weights=data.get("weights", ""))
        except SourceUnresolvable as exc:
            errors.append(f"{data['name']}: source: {exc}")
    if errors:
        raise CatalogInvalid(errors)
    return manifests


def catalog_apply(*, entries: list[Any], prune: bool = False, actor: str = "",
                  admin: bool = True) -> dict[str, list[str]]:
    """Create and update the given models; with ``prune``, remove the others.
    All or nothing: one bad entry (or a weights source that cannot be
    resolved) and nothing changes. ``admin``: whether the caller may set
    admin-only flags (replicas.engines.policy)."""
    result: dict[str, list[str]] = {"created": [], "updated": [], "unchanged": [], "removed": []}
    # Shape first (every problem at once), then the sources, before any lock.
    clean = catalog_validate(entries)
    manifests = catalog_manifests(clean)
    with transaction.atomic():
        existing = {m.name: m for m in CatalogEntry.objects.select_for_update(no_key=True)}
        if not admin:
            clean = catalog_validate(entries, admin=False, held=catalog_held(existing.values()))
        for data in clean:
            model = existing.get(data["name"])
            _keep_masked_secrets(data, model)
            data["manifest"] = manifests.get(data["name"], {})
            if model is None:
                model = CatalogEntry.objects.create(**data)
                result["created"].append(model.name)
            elif any(getattr(model, f) != data.get(f, getattr(model, f)) for f in FIELDS) or model.removing:
                for field in FIELDS:
                    if field in data:
                        setattr(model, field, data[field])
                model.removing = False
                model.save()
                result["updated"].append(model.name)
            else:
                result["unchanged"].append(model.name)
                continue
            model_refresh_fit(model=model, never=model_never_fits(model))
        if prune:
            wanted = {d["name"] for d in clean}
            for name, model in existing.items():
                if name not in wanted and not model.removing:
                    model.removing = True
                    model.replicas = 0
                    model.save(update_fields=["removing", "replicas"])
                    result["removed"].append(name)
        for verb in ("created", "updated", "removed"):
            for name in result[verb]:
                event_record(kind=ReplicaEventKind.MODEL, subject=f"model/{name}",
                             message=f"catalog: {name} {verb}" + (f" by {actor}" if actor else ""),
                             data={"actor": actor} if actor else None)
        reconcile_after_commit()
    return result


def model_refresh_fit(*, model: CatalogEntry, never: str | None) -> None:
    reason = never or ""
    if model.never_fits_reason == reason:
        return
    model.never_fits_reason = reason
    model.save(update_fields=["never_fits_reason"])
    if reason:
        event_record(
            kind=ReplicaEventKind.MODEL,
            subject=f"model/{model.name}",
            message=f"{model.name} can never be placed on this cluster as it is: {reason}",
            severity=EventSeverity.ERROR,
        )


def model_scale(*, name: str, replicas: int, actor: str = "") -> CatalogEntry:
    if not 0 <= replicas <= MAX_REPLICAS:
        raise CatalogInvalid([f"replicas: must be between 0 and {MAX_REPLICAS}, got {replicas}"])
    with transaction.atomic():
        model = CatalogEntry.objects.select_for_update(no_key=True).filter(name=name).first()
        if model is None:
            raise NotFound(f"no model named {name!r} in the catalog; 'llmgw ctl models' lists them")
        previous = model.replicas
        model.replicas = replicas
        model.save(update_fields=["replicas", "updated_at"])
        event_record(kind=ReplicaEventKind.MODEL, subject=f"model/{name}",
                     message=f"{name} scaled from {previous} to {replicas}" + (f" by {actor}" if actor else ""),
                     data={"actor": actor} if actor else None)
        reconcile_after_commit()
    return model


def catalog_upsert(*, entry: dict[str, Any], admin: bool = True) -> None:
    """One entry, created or updated (the REST API and the admin)."""
    manifests = catalog_manifests(catalog_validate([entry]))
    with transaction.atomic():
        held = catalog_held(CatalogEntry.objects.select_for_update(no_key=True).filter(name=str(entry.get("name", ""))))
        (data,) = catalog_validate([entry], admin=admin, held=held)
        data["manifest"] = manifests.get(data["name"], {})
        _keep_masked_secrets(data, CatalogEntry.objects.select_for_update(no_key=True).filter(name=data["name"]).first())
        model, created = CatalogEntry.objects.select_for_update(no_key=True).get_or_create(name=data["name"], defaults=data)
        if not created:
            for field in FIELDS:
                if field in data:
                    setattr(model, field, data[field])
            model.removing = False
            model.save()
        event_record(kind=ReplicaEventKind.MODEL, subject=f"model/{model.name}",
                     message=f"catalog: {model.name} {'created' if created else 'updated'}")
        model_refresh_fit(model=model, never=model_never_fits(model))
        reconcile_after_commit()


def model_remove(*, name: str) -> None:
    """Stop every replica of the model, then drop the entry."""
    with transaction.atomic():
        model = CatalogEntry.objects.select_for_update(no_key=True).filter(name=name).first()
        if model is None:
            raise NotFound(f"no model named {name!r} in the catalog")
        model.removing = True
        model.replicas = 0
        model.save(update_fields=["removing", "replicas"])
        event_record(kind=ReplicaEventKind.MODEL, subject=f"model/{name}", message=f"{name} is being removed")
        reconcile_after_commit()
