"""The node page's GPU charts: the last hour, drawn on the server as SVG.

One small chart per quantity (utilisation, memory used, temperature, power)
with a line per GPU, and a strip per GPU of its health over the hour, from
the samples ``nodes.telemetry`` keeps (Redis, or rows). No script, no library: a
chart is a few polylines, and its numbers are in its title and table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from nodes import telemetry
from nodes.telemetry import HISTORY_FIELDS, HISTORY_SECONDS

WIDTH, HEIGHT, PAD = 360, 90, 2
# (field in a sample, title, unit, fixed top of the scale or None for the data's maximum)
QUANTITIES = (
    ("util", "Utilisation", "%", 100.0),
    ("mem_used_mib", "Memory used", " MiB", None),
    ("temp_c", "Temperature", " °C", None),
    ("power_w", "Power", " W", None),
)
HEALTH_NAMES = {0: "healthy", 1: "degraded", 2: "quarantined"}


@dataclass
class Chart:
    title: str
    svg: SafeString
    latest: list[tuple[int, str, str]]  # (GPU index, its last value as text, its line's class)


def _x(t: float, now: float) -> float:
    return round(PAD + (WIDTH - 2 * PAD) * (1 - (now - t) / HISTORY_SECONDS), 1)


def _line_class(index: int) -> str:
    return f"l{index % 8}"


def node_gpu_charts(node_name: str, *, now: float | None = None) -> tuple[list[Chart], SafeString]:
    """(the four charts, the health strips) of the node's last hour; ([], '') without samples."""
    try:
        samples = telemetry.store().history(node_name)
    except Exception:  # noqa: BLE001 - Redis away: no charts, the rest of the page stands
        return [], mark_safe("")
    now = time.time() if now is None else now
    samples = [s for s in samples if now - s[0] <= HISTORY_SECONDS]
    if not samples:
        return [], mark_safe("")
    position = {name: i for i, name in enumerate(HISTORY_FIELDS)}
    series: dict[int, list[tuple[float, list]]] = {}
    for at, gpus in samples:
        for gpu in gpus:
            series.setdefault(gpu[0], []).append((at, gpu))
    charts = []
    for field, title, unit, top in QUANTITIES:
        i = position[field]
        values = [g[i] for points in series.values() for _, g in points if g[i] is not None]
        scale = top or max(values or [1]) * 1.1 or 1
        lines, latest = [], []
        for index, points in sorted(series.items()):
            coords = " ".join(f"{_x(at, now)},{round(HEIGHT - PAD - (HEIGHT - 2 * PAD) * g[i] / scale, 1)}"
                              for at, g in points if g[i] is not None)
            if coords:
                lines.append(f'<polyline class="{_line_class(index)}" points="{coords}"><title>GPU {index}</title>'
                             "</polyline>")
            last = next((g[i] for _, g in reversed(points) if g[i] is not None), None)
            latest.append((index, "—" if last is None else f"{last:g}{unit}", _line_class(index)))
        label = f"{title} of each GPU over the last hour, 0 to {scale:g}{unit}"
        svg = (f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(label)}">'
               f'<title>{escape(label)}</title><rect class="frame" x="0" y="0" width="{WIDTH}" height="{HEIGHT}"/>'
               + "".join(lines) + "</svg>")
        charts.append(Chart(title=title, svg=mark_safe(svg), latest=latest))
    return charts, health_strips(series, now)


def health_strips(series: dict[int, list[tuple[float, list]]], now: float) -> SafeString:
    """One bar per GPU: a cell per sample, coloured by the health it had then."""
    code = HISTORY_FIELDS.index("health")
    rows = []
    for index, points in sorted(series.items()):
        cells = []
        for n, (at, gpu) in enumerate(points):
            end = points[n + 1][0] if n + 1 < len(points) else now
            x0, x1 = _x(at, now), _x(end, now)
            name = HEALTH_NAMES.get(gpu[code], "healthy")
            cells.append(f'<rect class="h-{name}" x="{x0}" y="0" width="{max(1.0, round(x1 - x0, 1))}" '
                         f'height="10"><title>GPU {index}: {name}</title></rect>')
        label = f"Health of GPU {index} over the last hour"
        rows.append(f'<div class="strip"><span>GPU {index}</span><svg viewBox="0 0 {WIDTH} 10" '
                    f'preserveAspectRatio="none" role="img" aria-label="{label}"><title>{label}</title>'
                    f'{"".join(cells)}</svg></div>')
    return mark_safe(f'<div class="strips">{"".join(rows)}</div>')
