"""The catalog: models to serve, applied declaratively from catalog.yaml,
the REST API or the admin. Its rules are ``replicas.validation``; the
replicas each entry asks for are made by ``replicas.reconcile``."""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from rest_framework.exceptions import ValidationError

from core.choices import EventSeverity
from core.events import event_record
from core.exceptions import InvalidTransition, NotFound
from core.strict import error_lines, unknown_keys

from .autoscaling.policy import policy_clean
from .choices import ReplicaEventKind
from .enqueue import reconcile_after_commit
from .envmask import env_unmask
from .models import CatalogEntry, Rollout
from .revisions import revision_current
from .rollout import rollout_begin
from .scheduling import model_never_fits
from .validation import MAX_REPLICAS, CatalogEntryInvalid, admin_only_problems, catalog_entry_clean
from .weights import SourceUnresolvable, source_resolve

logger = logging.getLogger(__name__)

# model_scale_bounds's arguments are the policy's names.
min_, max_ = min, max

FIELDS = ("engine", "weights", "nodes", "gpus_per_node", "replicas", "args", "env", "routing", "autoscale", "max_surge",
          "max_unavailable", "source", "manifest", "spares", "timeouts")


class CatalogInvalid(ValueError):
    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


# The top level of a catalog file (catalog.yaml, the UI's catalog page).
DOCUMENT_KEYS = ("models",)


def catalog_document_models(document: Any) -> list[Any]:
    """The 'models' list of a catalog file, or CatalogInvalid: a key other
    than 'models' is refused by name (``modles:`` must not read as an empty
    catalog, which --prune would apply as "remove everything")."""
    if document is None:
        return []
    if not isinstance(document, dict):
        raise CatalogInvalid(["the file must be a mapping with a 'models' list"])
    errors = [f"{key}: {message}" for key, message in unknown_keys(document, DOCUMENT_KEYS).items()]
    if not isinstance(document.get("models", []), list):
        errors.append("models: must be a list of entries (- name: ...)")
    if errors:
        raise CatalogInvalid(errors)
    return document.get("models") or []


def _from_yaml(entry: Any, index: int) -> dict[str, Any]:
    """An entry as given; catalog.yaml's 'model' (the weights) is an alias
    ``CatalogEntryFields`` reads."""
    if not isinstance(entry, dict):
        raise CatalogInvalid([f"models[{index}]: each entry must be a mapping with name, engine, model, ..."])
    return dict(entry)


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
            errors.extend(f"{label}: {line}" for line in error_lines(exc.errors))
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


def _flat(errors: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Field errors, nested ones (the autoscale policy's) as ``autoscale.min``."""
    if isinstance(errors, dict):
        out = []
        for field, messages in errors.items():
            name = prefix if field == "non_field_errors" and prefix else f"{prefix}.{field}" if prefix else field
            out.extend(_flat(messages, name))
        return out
    if isinstance(errors, list):
        return [pair for item in errors for pair in _flat(item, prefix)]
    return [(prefix, str(errors))]


def autoscaled_count(data: dict[str, Any], model: CatalogEntry | None) -> None:
    """With a policy, the replica count is the autoscaler's: an existing model
    keeps its count (within the new bounds), a new one starts at the given
    count within them. The count in the entry never fights the autoscaler."""
    policy = data.get("autoscale")
    if not policy:
        return
    start = model.replicas if model is not None and model.autoscale else data.get("replicas", 1)
    data["replicas"] = min(max(start, policy["min"]), policy["max"])


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
                  admin: bool = True) -> dict[str, list[Any]]:
    """Create and update the given models; with ``prune``, remove the others.
    All or nothing: one bad entry (or a weights source that cannot be
    resolved) and nothing changes. ``admin``: whether the caller may set
    admin-only flags (replicas.engines.policy)."""
    result: dict[str, list[Any]] = {"created": [], "updated": [], "unchanged": [], "removed": [], "rollouts": []}
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
            autoscaled_count(data, model)
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
            started = model_revise(model=model, actor=actor)
            if started is not None:
                result["rollouts"].append({"model": model.name, "from_revision": started.from_revision,
                                           "to_revision": started.to_revision, "status": started.status})
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


def model_revise(*, model: CatalogEntry, actor: str = "") -> Rollout | None:
    """Record the entry's revision; when its launch changed, roll it out to
    the replicas running the previous one (replicas.rollout). The entry's
    row is locked. Returns the rollout started, if any (it starts paused
    when the one it supersedes was)."""
    previous = model.revision
    current = revision_current(model)
    if previous and current.number != previous:
        event_record(kind=ReplicaEventKind.MODEL, subject=f"model/{model.name}",
                     message=f"{model.name}: revision {previous} -> {current.number}",
                     data={"revision": current.number, "previous": previous})
        return rollout_begin(model=model, previous=previous, actor=actor)
    return None


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
        if model.autoscale:
            raise AutoscaledModel(model_scale_refusal(model))
        previous = model.replicas
        model.replicas = replicas
        model.save(update_fields=["replicas", "updated_at"])
        event_record(kind=ReplicaEventKind.MODEL, subject=f"model/{name}",
                     message=f"{name} scaled from {previous} to {replicas}" + (f" by {actor}" if actor else ""),
                     data={"actor": actor} if actor else None)
        reconcile_after_commit()
    return model


class AutoscaledModel(InvalidTransition):
    """A replica count set by hand on a model whose count the autoscaler sets (a 409)."""


def model_scale_refusal(model: CatalogEntry) -> str:
    p = model.autoscale
    return (f"{model.name} is autoscaled ({p['min']}-{p['max']} replicas, now {model.replicas}): its replica count "
            f"follows the load. Set its bounds instead ('llmgw ctl scale {model.name} --min N --max M'), or remove "
            "its autoscale policy from the catalog to fix the count by hand")


def model_scale_bounds(*, name: str, min: int | None = None, max: int | None = None, actor: str = "") -> CatalogEntry:
    """Set an autoscaled model's bounds (``ctl scale --min/--max``); the count
    moves into them at once, the autoscaler does the rest."""
    with transaction.atomic():
        model = CatalogEntry.objects.select_for_update(no_key=True).filter(name=name).first()
        if model is None:
            raise NotFound(f"no model named {name!r} in the catalog; 'llmgw ctl models' lists them")
        if not model.autoscale:
            raise CatalogInvalid([f"{name} has no autoscale policy: --min and --max bound an autoscaled model; "
                                  f"give a count ('llmgw ctl scale {name} N') or add 'autoscale:' to its entry"])
        wanted = {**model.autoscale, **({"min": min} if min is not None else {}),
                  **({"max": max} if max is not None else {})}
        try:
            policy = policy_clean(wanted)
        except ValidationError as exc:
            raise CatalogInvalid([f"{name}: autoscale.{field}: {message}"
                                  for field, message in _flat(exc.detail)]) from None
        previous = (model.autoscale["min"], model.autoscale["max"], model.replicas)
        model.autoscale = policy
        model.replicas = min_(max_(model.replicas, policy["min"]), policy["max"])
        model.save(update_fields=["autoscale", "replicas", "updated_at"])
        event_record(kind=ReplicaEventKind.MODEL, subject=f"model/{name}",
                     message=f"{name} autoscale bounds {previous[0]}-{previous[1]} -> {policy['min']}-{policy['max']}"
                     + (f", replicas {previous[2]} -> {model.replicas}" if model.replicas != previous[2] else "")
                     + (f" by {actor}" if actor else ""),
                     data={"actor": actor, "min": policy["min"], "max": policy["max"]})
        reconcile_after_commit()
    return model


def model_autoscale_set(*, name: str, policy: dict[str, Any] | None, actor: str = "") -> CatalogEntry:
    """Give a model an autoscaling policy, change it, or (None) take it away:
    the count then stays where the autoscaler left it, fixed."""
    with transaction.atomic():
        model = CatalogEntry.objects.select_for_update(no_key=True).filter(name=name).first()
        if model is None:
            raise NotFound(f"no model named {name!r} in the catalog; 'llmgw ctl models' lists them")
        clean = None
        if policy is not None:
            try:
                clean = policy_clean(policy)
            except ValidationError as exc:
                raise CatalogInvalid([f"{name}: autoscale{'.' + f if f else ''}: {m}"
                                      for f, m in _flat(exc.detail)]) from None
        before = model.replicas
        model.autoscale = clean
        if clean:
            model.replicas = min_(max_(model.replicas, clean["min"]), clean["max"])
        model.save(update_fields=["autoscale", "replicas", "updated_at"])
        what = (f"autoscales {clean['min']}-{clean['max']}" if clean else f"has a fixed count of {model.replicas}")
        event_record(kind=ReplicaEventKind.MODEL, subject=f"model/{name}",
                     message=f"{name} {what}" + (f" (replicas {before} -> {model.replicas})"
                                                 if model.replicas != before else "")
                     + (f" by {actor}" if actor else ""), data={"actor": actor, "autoscale": clean})
        reconcile_after_commit()
    return model


def catalog_upsert(*, entry: dict[str, Any], admin: bool = True) -> None:
    """One entry, created or updated (the REST API and the admin)."""
    manifests = catalog_manifests(catalog_validate([entry]))
    with transaction.atomic():
        held = catalog_held(CatalogEntry.objects.select_for_update(no_key=True).filter(name=str(entry.get("name", ""))))
        (data,) = catalog_validate([entry], admin=admin, held=held)
        current = CatalogEntry.objects.select_for_update(no_key=True).filter(name=data["name"]).first()
        data["manifest"] = manifests.get(data["name"], {})
        _keep_masked_secrets(data, current)
        autoscaled_count(data, current)
        model, created = CatalogEntry.objects.select_for_update(no_key=True).get_or_create(name=data["name"], defaults=data)
        if not created:
            for field in FIELDS:
                if field in data:
                    setattr(model, field, data[field])
            model.removing = False
            model.save()
        event_record(kind=ReplicaEventKind.MODEL, subject=f"model/{model.name}",
                     message=f"catalog: {model.name} {'created' if created else 'updated'}")
        model_revise(model=model)
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
