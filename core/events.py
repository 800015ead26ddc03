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


def events_record(events: list[Event]) -> None:
    """Many events in a few statements (a batch of placements)."""
    for event in events:
        event_kind_check(event.kind)
    for event in events:
        _log(event.kind, event.subject, event.message, event.severity)
    Event.objects.bulk_create(events, batch_size=500)
