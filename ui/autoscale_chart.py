"""The autoscaling chart of a model's page, drawn on the server as SVG:
replicas wanted and ready, and the load (divided by the policy's target, so
that it reads in replicas' worth), over the last hour of samples."""

from __future__ import annotations

from html import escape

WIDTH, HEIGHT = 720, 220
LEFT, RIGHT, TOP, BOTTOM = 40, 10, 10, 30


def _step_path(points: list[tuple[float, float]]) -> str:
    if not points:
        return ""
    out = [f"M{points[0][0]:.1f},{points[0][1]:.1f}"]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        out.append(f"H{x1:.1f}V{y1:.1f}")
    return " ".join(out)


def _line_path(points: list[tuple[float, float]]) -> str:
    return " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y) in enumerate(points))


def autoscale_svg(samples: list[dict], *, target: float, now: float, span: float = 3600.0) -> str:
    """An <svg> element (a string, safe to mark safe: every text in it is escaped or a number)."""
    start = now - span
    samples = [s for s in samples if s.get("at", 0) >= start]
    top = max([1.0] + [float(s.get("wanted", 0)) for s in samples] + [float(s.get("ready", 0)) for s in samples]
              + [float(s.get("load", 0)) / target for s in samples])
    top = float(int(top) + 1)
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(at: float) -> float:
        return LEFT + (at - start) / span * w

    def y(value: float) -> float:
        return TOP + h - value / top * h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
             f'class="autoscale-chart" aria-label="replicas wanted and ready, and load, over the last hour">']
    for tick in range(0, int(top) + 1, max(1, int(top) // 5)):
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" '
                     'stroke="#ddd" stroke-width="1"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y(tick) + 4:.1f}" text-anchor="end" font-size="11">{tick}</text>')
    for minutes in range(0, int(span // 60) + 1, 10):
        at = start + minutes * 60
        parts.append(f'<text x="{x(at):.1f}" y="{HEIGHT - 10}" text-anchor="middle" font-size="11">'
                     f'-{int(span // 60) - minutes}m</text>')
    if samples:
        load = [(x(s["at"]), y(float(s.get("load", 0)) / target)) for s in samples]
        wanted = [(x(s["at"]), y(float(s.get("wanted", 0)))) for s in samples]
        ready = [(x(s["at"]), y(float(s.get("ready", 0)))) for s in samples]
        parts.append(f'<path class="load" d="{_line_path(load)}" fill="none" stroke="#999" stroke-width="1.5"/>')
        parts.append(f'<path class="wanted" d="{_step_path(wanted)}" fill="none" stroke="#1f6feb" '
                     'stroke-width="2" stroke-dasharray="5 3"/>')
        parts.append(f'<path class="ready" d="{_step_path(ready)}" fill="none" stroke="#2da44e" stroke-width="2"/>')
    else:
        parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" font-size="13">'
                     f'{escape("no sample in the last hour")}</text>')
    legend = [("#1f6feb", "wanted"), ("#2da44e", "ready"), ("#999", f"load / target ({target:g})")]
    for i, (colour, label) in enumerate(legend):
        lx = LEFT + 10 + i * 150
        parts.append(f'<rect x="{lx}" y="{TOP + 2}" width="12" height="4" fill="{colour}"/>'
                     f'<text x="{lx + 16}" y="{TOP + 8}" font-size="11">{escape(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)
