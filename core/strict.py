"""Documents an operator writes refuse keys they do not know, by name.

A typo in a catalog entry (``replica: 3``) or a hypervisor body must not be
dropped silently: what runs on a GPU cluster would then differ from what the
operator wrote, and nothing would say why. As ``kubectl apply`` does (strict
field validation), an unknown key is refused with a 400 that names it and,
where one is close, the known key it was probably meant to be::

    replica: unknown key; did you mean replicas?

The known keys are the serializer's own fields, at every level: a nested
serializer (``routing = RoutingSerializer()``), a list or a mapping of them
(``many=True``, ``ListField(child=...)``, ``DictField(child=...)``) are walked
with the same rule, so a field added to an input serializer is known as soon
as it is declared. Read-only fields are known (they are the API's own words,
ignored on input, as DRF does). A ``JSONField`` or a ``DictField`` of plain
values holds free-form keys (an engine's ``env``) and is not walked.

``StrictInput`` is the mixin every input serializer of the operator API
carries; ``web.schema`` marks such bodies ``additionalProperties: false`` in
the OpenAPI document, and ``tests/test_strict_inputs.py`` fails for a write
endpoint whose body is not strict. ``unknown_keys`` is the same rule for
documents read without a serializer (the top of a catalog file), and
``no_body`` for an action that takes no body at all.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable, Mapping
from typing import Any

from rest_framework import serializers


def unknown_key_message(key: Any, known: Iterable[str]) -> str:
    """``unknown key; did you mean replicas?``, or the known keys when none is close."""
    known = sorted(known)
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean {close[0]}?"
    return f"unknown key; the keys here are {', '.join(known)}" if known else "unknown key; nothing may be given here"


def unknown_keys(data: Mapping, known: Iterable[str]) -> dict[str, str]:
    """Each key of ``data`` not in ``known``, with its message (empty when none)."""
    known = list(known)
    return {str(key): unknown_key_message(key, known) for key in data if key not in known}


def _nested(field: serializers.Field) -> tuple[str, serializers.BaseSerializer] | None:
    """How a field holds serializers: ("one" | "list" | "map", the item's serializer)."""
    if isinstance(field, serializers.ListSerializer):
        return "list", field.child
    if isinstance(field, serializers.BaseSerializer):
        return "one", field
    if isinstance(field, serializers.ListField) and isinstance(field.child, serializers.BaseSerializer):
        return "list", field.child
    if isinstance(field, serializers.DictField) and isinstance(field.child, serializers.BaseSerializer):
        return "map", field.child
    return None


def unknown_key_errors(serializer: serializers.BaseSerializer, data: Any) -> dict:
    """The unknown keys of ``data`` as ``serializer`` reads it, nested as DRF
    nests field errors (a list's items by index); empty when there are none."""
    if isinstance(serializer, serializers.ListSerializer):
        serializer = serializer.child
    fields = getattr(serializer, "fields", None)
    if fields is None or not isinstance(data, Mapping):
        return {}  # not a mapping: the serializer's own "expected a dictionary" says so
    known = [*fields, *getattr(serializer, "strict_aliases", {})]
    errors: dict[str, Any] = {key: [message] for key, message in unknown_keys(data, known).items()}
    for name, field in fields.items():
        if name not in data or field.read_only:
            continue
        nested = _nested(field)
        if nested is None:
            continue
        how, child = nested
        value = data[name]
        if how == "one":
            inner = unknown_key_errors(child, value)
        elif how == "list" and isinstance(value, list):
            inner = {i: e for i, item in enumerate(value) if (e := unknown_key_errors(child, item))}
        elif how == "map" and isinstance(value, Mapping):
            inner = {k: e for k, item in value.items() if (e := unknown_key_errors(child, item))}
        else:
            inner = {}
        if inner:
            errors[name] = inner
    return errors


class StrictInput:
    """A serializer mixin: input with a key the serializer does not know, at
    any level, is refused (a ValidationError naming each one) before any
    field is read, so nothing is created or changed."""

    strict_input = True
    # Other names a key may be given by: {"model": "weights"} (catalog.yaml's name).
    strict_aliases: dict[str, str] = {}

    def to_internal_value(self, data):
        if self.strict_aliases and isinstance(data, Mapping):
            data = self._unalias(data)
        errors = unknown_key_errors(self, data)
        if errors:
            raise serializers.ValidationError(errors)
        return super().to_internal_value(data)

    def _unalias(self, data: Mapping) -> dict:
        both = {alias: [f"{alias} and {name} are one key (the same value by two names): give one"]
                for alias, name in self.strict_aliases.items() if alias in data and name in data}
        if both:
            raise serializers.ValidationError(both)
        return {self.strict_aliases.get(key, key): value for key, value in data.items()}


def no_body(view_method):
    """For an action that takes no body (``extend_schema(request=None)``):
    a body with keys is refused by name rather than ignored (a ``reason``
    sent to cordon would otherwise vanish). Put it under ``@action``."""

    @functools.wraps(view_method)
    def inner(self, request, *args, **kwargs):
        data = request.data
        if isinstance(data, Mapping) and data:
            raise serializers.ValidationError(
                {str(key): ["unknown key; this request takes no body"] for key in data})
        return view_method(self, request, *args, **kwargs)

    inner.takes_no_body = True
    return inner


def is_strict(serializer: Any) -> bool:
    return getattr(serializer, "strict_input", False) is True


def error_lines(errors: Any, path: str = "") -> list[str]:
    """DRF's nested errors as lines a person reads: ``routing.policy: unknown
    key; did you mean ...``, ``items[2].name: ...``."""
    if isinstance(errors, Mapping):
        lines = []
        for key, value in errors.items():
            if isinstance(key, int):
                where = f"{path}[{key}]"
            elif key in ("non_field_errors", "__all__"):
                where = path
            else:
                where = f"{path}.{key}" if path else str(key)
            lines.extend(error_lines(value, where))
        return lines
    if isinstance(errors, (list, tuple)):
        if all(isinstance(e, str) for e in errors):
            return [f"{path}: {e}" if path else str(e) for e in errors]
        lines = []
        for index, value in enumerate(errors):
            if value:
                lines.extend(error_lines(value, f"{path}[{index}]"))
        return lines
    return [f"{path}: {errors}" if path else str(errors)]
