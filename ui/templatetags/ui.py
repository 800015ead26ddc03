"""Small formatting filters shared by the web UI's templates."""

from __future__ import annotations

import datetime as dt

from django import template
from django.urls import NoReverseMatch, reverse
from django.utils import timezone

from ..cluster import age_text

register = template.Library()


@register.filter
def age(seconds: float | None) -> str:
    return age_text(seconds)


@register.filter
def since(when: dt.datetime | None) -> str:
    return age(None if when is None else max(0.0, (timezone.now() - when).total_seconds()))


@register.filter
def percent(part: int, whole: int) -> int:
    return 0 if not whole else round(100 * part / whole)


@register.filter
def lines(items) -> str:
    """Log lines, one a line (a template tag cannot span lines)."""
    return "\n".join(str(item) for item in items or ())


@register.filter
def subject_url(subject: str) -> str:
    """The page of an event's subject ('node/node01', 'replica/12'), or ''."""
    kind, _, name = subject.partition("/")
    try:
        if kind == "node" and name:
            return reverse("ui-node", args=[name])
        if kind == "replica" and name.isdigit():
            return reverse("ui-replica", args=[int(name)])
    except NoReverseMatch:  # a name the URL pattern does not take
        pass
    return ""
