"""Events: every decision the control plane makes, in words a person can act on.

Each app owns the kinds of Event it records: it declares them in its
``choices.py`` (``NodeEventKind``, ``ReplicaEventKind``, ...) and registers
them here from its ``AppConfig.ready``. ``event_record`` refuses a kind no
app registered, before anything is written, so that a typo is a clear error
rather than a row no filter finds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from .bulk import rows_insert
from .choices import EventSeverity
from .exceptions import UnknownEventKind
from .models import Event

logger = logging.getLogger(__name__)

# kind -> the label of the app that registered it, in registration order
# (INSTALLED_APPS order, since every app registers in its ready()).
_kinds: dict[str, str] = {}


def event_kinds_register(*, owner: str, kinds: Iterable[str]) -> None:
    """Register ``kinds`` (a TextChoices class or strings) as ``owner``'s.
    Registering again is harmless; a kind another app owns is refused."""
    for kind in kinds:
        kind = str(kind)
        if len(kind) > Event._meta.get_field("kind").max_length:
            raise ImproperlyConfigured(f"event kind {kind!r} of {owner} is longer than the Event.kind column")
        holder = _kinds.setdefault(kind, owner)
        if holder != owner:
            raise ImproperlyConfigured(f"event kind {kind!r} of {owner} is already registered by {holder}")


def event_kinds() -> list[str]:
    """Every registered kind (for filters in the UI and the API)."""
    return list(_kinds)


def event_kind_check(kind: str) -> None:
    if kind not in _kinds:
        raise UnknownEventKind(
            f"event kind {kind!r} is not registered: an app declares the kinds it records in its "
            f"choices.py and registers them in its AppConfig.ready (core.events.event_kinds_register); "
            f"known kinds: {', '.join(sorted(_kinds))}"
        )


def _log(kind: str, subject: str, message: str, severity: str) -> None:
    log = logger.warning if severity != EventSeverity.INFO else logger.info
    log("event kind=%s subject=%s %s", kind, subject, message)


def event_record(
    *,
    kind: str,
    subject: str,
    message: str,
    node: Any = None,
    severity: str = EventSeverity.INFO,
    data: dict[str, Any] | None = None,
) -> Event:
    """Write one Event (``node``: the nodes.Node it is about, if any)."""
    event_kind_check(kind)
    _log(kind, subject, message, severity)
    return Event.objects.create(
        kind=kind, subject=subject, message=message, node=node, severity=severity, data=data or {}
    )


def events_record(events: list[Event | dict[str, Any]]) -> None:
    """Many events in one statement (a batch of placements): Event instances,
    or dicts of ``event_record``'s arguments. Every kind is checked before
    anything is written."""
    rows = [_event_row(event) for event in events]
    for row in rows:
        event_kind_check(row["kind"])
    for row in rows:
        _log(row["kind"], row["subject"], row["message"], row.get("severity", EventSeverity.INFO))
    rows_insert(Event, rows)


def _event_row(event: Event | dict[str, Any]) -> dict[str, Any]:
    if isinstance(event, Event):
        return {f.attname: getattr(event, f.attname) for f in Event._meta.concrete_fields
                if not f.primary_key and getattr(event, f.attname) is not None}
    row = dict(event)
    node = row.pop("node", None)
    row["node_id"] = node.pk if node is not None else None
    if row.get("data") is None:
        row["data"] = {}
    return row
