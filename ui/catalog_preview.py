"""What applying a catalog would change, worked out before it is applied."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from replicas.catalog import (FIELDS, CatalogInvalid, autoscaled_count, catalog_document_models, catalog_held,
                              catalog_validate)
from replicas.models import CatalogEntry

# catalog_validate's messages: "models[2] (name): field: what is wrong".
_ERROR = re.compile(r"^(?P<entry>models\[\d+\](?: \([^)]*\))?): (?:(?P<field>[\w.\[\]]+): )?(?P<message>.*)$", re.S)


@dataclass
class FieldError:
    entry: str
    field: str
    message: str


@dataclass
class Preview:
    entries: list[Any] = field(default_factory=list)
    errors: list[FieldError] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    scaled: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)

    @property
    def changes(self) -> bool:
        return bool(self.created or self.scaled or self.updated or self.pruned)


class _CatalogLoader(yaml.SafeLoader):
    """YAML without aliases: a catalog has no use for them, and a few KB of
    nested aliases expand to gigabytes once built (a "billion laughs").
    Refused at the first alias, before any object is constructed."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"alias *{event.anchor} refused: a catalog may not use YAML aliases (*name) or merge "
                "keys (<<); write each value out", event.start_mark)
        return super().compose_node(parent, index)


def catalog_yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_CatalogLoader)  # noqa: S506 - a SafeLoader without aliases


def catalog_parse(text: str) -> tuple[list[Any] | None, list[FieldError]]:
    """The 'models' list of a catalog.yaml, or the reason it is not one."""
    try:
        document = catalog_yaml_load(text) or {}
    except yaml.YAMLError as exc:
        return None, [FieldError("file", "yaml", str(exc))]
    try:
        return catalog_document_models(document), []
    except CatalogInvalid as exc:
        return None, [FieldError("file", *text.split(": ", 1)) if ": " in text else FieldError("file", "", text)
                      for text in exc.errors]


def field_errors(exc: CatalogInvalid) -> list[FieldError]:
    result = []
    for text in exc.errors:
        match = _ERROR.match(text)
        if match:
            result.append(FieldError(match["entry"], match["field"] or "", match["message"]))
        else:
            result.append(FieldError("", "", text))
    return result


def catalog_preview(*, text: str, prune: bool, admin: bool = False) -> Preview:
    entries, errors = catalog_parse(text)
    if entries is None:
        return Preview(errors=errors)
    preview = Preview(entries=entries)
    existing = {m.name: m for m in CatalogEntry.objects.all()}
    try:
        clean = catalog_validate(entries, admin=admin, held=catalog_held(existing.values()))
    except CatalogInvalid as exc:
        preview.errors = field_errors(exc)
        return preview
    for data in clean:
        model = existing.get(data["name"])
        autoscaled_count(data, model)  # as the apply will: an autoscaled model's count is the autoscaler's
        if model is None:
            preview.created.append(f"{data['name']} ({data.get('replicas', 1)} replicas)")
            continue
        other = [f for f in FIELDS if f != "replicas" and f in data and getattr(model, f) != data[f]]
        if "replicas" in data and data["replicas"] != model.replicas:
            preview.scaled.append(f"{model.name}: {model.replicas} → {data['replicas']}")
        if other or model.removing:
            preview.updated.append(f"{model.name}: {', '.join(other) or 'kept (was being removed)'}")
        elif "replicas" not in data or data["replicas"] == model.replicas:
            preview.unchanged.append(model.name)
    if prune:
        wanted = {d["name"] for d in clean}
        preview.pruned = [name for name, m in existing.items() if name not in wanted and not m.removing]
    return preview
