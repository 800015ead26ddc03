"""Durations as people write them in agent.yaml: ``5s``, ``1m``, ``500ms``, ``1m30s``."""

from __future__ import annotations

import re

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


class BadDuration(ValueError):
    pass


def parse_duration(value: object) -> float:
    """Seconds. A bare number is seconds; a string is one or more number+unit parts."""
    if isinstance(value, bool):
        raise BadDuration(f"{value!r} is not a duration")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().replace(" ", "")
        pos, seconds = 0, 0.0
        for match in _PART.finditer(text):
            if match.start() != pos:
                break
            seconds += float(match.group(1)) * _UNITS[match.group(2)]
            pos = match.end()
        if not text or pos != len(text):
            raise BadDuration(f"{value!r} is not a duration; write it like 5s, 1m, 500ms or 1m30s")
    else:
        raise BadDuration(f"{value!r} is not a duration; write it like 5s, 1m, 500ms or 1m30s")
    if seconds < 0:
        raise BadDuration(f"{value!r} is negative")
    return seconds


def format_duration(seconds: float) -> str:
    if seconds < 1 and seconds != int(seconds):
        return f"{round(seconds * 1000)}ms"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    return f"{seconds:g}s"
