"""The catalog: models to serve, applied declaratively from catalog.yaml,
the REST API or the admin."""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction

from nodes.choices import EventKind, EventSeverity
from nodes.services import event_record

from .choices import PLACED, ReplicaStatus
from .models import Model, Replica

logger = logging.getLogger(__name__)

FIELDS = ("engine", "weights", "nodes", "gpus_per_node", "replicas", "args", "env")


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


def catalog_validate(entries: list[Any]) -> list[dict[str, Any]]:
    from .api.serializers import ModelWriteSerializer

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
        serializer = ModelWriteSerializer(data=data)
        if not serializer.is_valid():
            for field, messages in serializer.errors.items():
                for message in messages if isinstance(messages, list) else [messages]:
                    errors.append(f"{label}: {field}: {message}")
            continue
        value = dict(serializer.validated_data)
        if value["name"] in names:
            errors.append(f"{label}: name: {value['name']} appears twice in the catalog")
        names.add(value["name"])
        clean.append(value)
    if errors:
        raise CatalogInvalid(errors)
    return clean


def catalog_apply(*, entries: list[Any], prune: bool = False) -> dict[str, list[str]]:
    """Create and update the given models; with ``prune``, remove the others.
    All or nothing: one bad entry and nothing changes."""
    from . import tasks
    from .scheduling import model_never_fits

    clean = catalog_validate(entries)
    result: dict[str, list[str]] = {"created": [], "updated": [], "unchanged": [], "removed": []}
    with transaction.atomic():
        existing = {m.name: m for m in Model.objects.select_for_update()}
        for data in clean:
            model = existing.get(data["name"])
            if model is None:
                model = Model.objects.create(**data)
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
                event_record(kind=EventKind.MODEL, subject=f"model/{name}", message=f"catalog: {name} {verb}")
        transaction.on_commit(lambda: tasks.replicas_reconcile.delay())
    return result


def model_refresh_fit(*, model: Model, never: str | None) -> None:
    reason = never or ""
    if model.never_fits_reason == reason:
        return
    model.never_fits_reason = reason
    model.save(update_fields=["never_fits_reason"])
    if reason:
        event_record(
            kind=EventKind.MODEL,
            subject=f"model/{model.name}",
            message=f"{model.name} can never be placed on this cluster as it is: {reason}",
            severity=EventSeverity.ERROR,
        )


def model_scale(*, name: str, replicas: int) -> Model:
    from nodes.exceptions import NotFound

    from . import tasks

    if replicas < 0:
        raise CatalogInvalid([f"replicas: must be 0 or more, got {replicas}"])
    with transaction.atomic():
        model = Model.objects.select_for_update().filter(name=name).first()
        if model is None:
            raise NotFound(f"no model named {name!r} in the catalog; 'llmgw ctl models' lists them")
        previous = model.replicas
        model.replicas = replicas
        model.save(update_fields=["replicas", "updated_at"])
        event_record(kind=EventKind.MODEL, subject=f"model/{name}", message=f"{name} scaled from {previous} to {replicas}")
        transaction.on_commit(lambda: tasks.replicas_reconcile.delay())
    return model


def model_reconcile(*, model_id: int) -> None:
    """Converge one model's replica count: create pending replicas, or stop
    the extra ones (pending first, then the newest)."""
    from .services import replica_transition

    with transaction.atomic():
        model = Model.objects.select_for_update().filter(pk=model_id).first()
        if model is None:
            return
        counted = list(
            Replica.objects.filter(model=model, status__in=[ReplicaStatus.PENDING, *PLACED], draining=False).order_by("id")
        )
        missing = model.replicas - len(counted)
        if missing > 0:
            from django.utils import timezone

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


def catalog_upsert(*, entry: dict[str, Any]) -> None:
    """One entry, created or updated (the REST API and the admin)."""
    from . import tasks
    from .scheduling import model_never_fits

    (data,) = catalog_validate([entry])
    with transaction.atomic():
        model, created = Model.objects.select_for_update().get_or_create(name=data["name"], defaults=data)
        if not created:
            for field in FIELDS:
                if field in data:
                    setattr(model, field, data[field])
            model.removing = False
            model.save()
        event_record(kind=EventKind.MODEL, subject=f"model/{model.name}",
                     message=f"catalog: {model.name} {'created' if created else 'updated'}")
        model_refresh_fit(model=model, never=model_never_fits(model))
        transaction.on_commit(lambda: tasks.replicas_reconcile.delay())


def model_remove(*, name: str) -> None:
    """Stop every replica of the model, then drop the entry."""
    from nodes.exceptions import NotFound

    from . import tasks

    with transaction.atomic():
        model = Model.objects.select_for_update().filter(name=name).first()
        if model is None:
            raise NotFound(f"no model named {name!r} in the catalog")
        model.removing = True
        model.replicas = 0
        model.save(update_fields=["removing", "replicas"])
        event_record(kind=EventKind.MODEL, subject=f"model/{name}", message=f"{name} is being removed")
        transaction.on_commit(lambda: tasks.replicas_reconcile.delay())
