"""Events: every decision the control plane makes, in words a person can act on."""

from __future__ import annotations

import logging
from typing import Any

from .choices import EventSeverity
from .models import Event, Node

logger = logging.getLogger(__name__)


def _log(kind: str, subject: str, message: str, severity: str) -> None:
    log = logger.warning if severity != EventSeverity.INFO else logger.info
    log("event kind=%s subject=%s %s", kind, subject, message)


def event_record(
    *,
    kind: str,
    subject: str,
    message: str,
    node: Node | None = None,
    severity: str = EventSeverity.INFO,
    data: dict[str, Any] | None = None,
) -> Event:
    _log(kind, subject, message, severity)
    return Event.objects.create(
        kind=kind, subject=subject, message=message, node=node, severity=severity, data=data or {}
    )


def events_record(events: list[Event]) -> None:
    """Many events in a few statements (a batch of placements)."""
    for event in events:
        _log(event.kind, event.subject, event.message, event.severity)
    Event.objects.bulk_create(events, batch_size=500)
