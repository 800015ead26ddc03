"""Small formatting filters shared by the web UI's templates."""

from __future__ import annotations

import datetime as dt

from django import template
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
