"""Reads about Events."""

from __future__ import annotations

import datetime as dt

from django.db.models import QuerySet

from .models import Event


def event_list(*, node: str | None = None, kind: str | None = None, since: dt.datetime | None = None) -> QuerySet[Event]:
    events = Event.objects.select_related("node")
    if node:
        events = events.filter(node__name=node)
    if kind:
        events = events.filter(kind=kind)
    if since:
        events = events.filter(created_at__gte=since)
    return events
