"""The gateway page's usage chart, drawn on the server as SVG: tokens per
hour (prompt and completion stacked) over the last day, from the hourly
usage rows (gateway.selectors.key_usage), as the engines reported them."""

from __future__ import annotations

import datetime as dt
from html import escape

WIDTH, HEIGHT = 720, 220
LEFT, RIGHT, TOP, BOTTOM = 56, 10, 10, 30


def _nice(value: int) -> int:
    """A round ceiling for the axis (1, 2, 5 x 10^n)."""
    step = 1
    while True:
        for factor in (1, 2, 5):
            if value <= step * factor:
                return step * factor
        step *= 10


def usage_svg(rows: list[dict], *, now: dt.datetime, hours: int = 24, label: str = "every key") -> str:
    """An <svg> element (a string, safe to mark safe: every text in it is escaped or a number)."""
    last = now.replace(minute=0, second=0, microsecond=0)
    slots = [last - dt.timedelta(hours=hours - 1 - i) for i in range(hours)]
    prompt = {s: 0 for s in slots}
    completion = {s: 0 for s in slots}
    for row in rows:
        hour = row["hour"].astimezone(dt.timezone.utc)
        if hour in prompt:
            prompt[hour] += row["prompt_tokens"]
            completion[hour] += row["completion_tokens"]
    top = _nice(max([1] + [prompt[s] + completion[s] for s in slots]))
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    bar = w / hours

    def y(value: float) -> float:
        return TOP + h - value / top * h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
             f'class="usage-chart" aria-label="tokens per hour over the last {hours} hours, {escape(label)}">']
    for i in range(5):
        value = top * i // 4
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(value):.1f}" y2="{y(value):.1f}" '
                     'stroke="#ddd" stroke-width="1"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y(value) + 4:.1f}" text-anchor="end" font-size="11">{value:,}</text>')
    for i, slot in enumerate(slots):
        x = LEFT + i * bar
        p, c = prompt[slot], completion[slot]
        title = f"{slot:%Y-%m-%d %H}:00 UTC: {p:,} prompt + {c:,} completion tokens"
        if p:
            parts.append(f'<rect class="prompt" x="{x + 1:.1f}" y="{y(p):.1f}" width="{bar - 2:.1f}" '
                         f'height="{h - (y(p) - TOP):.1f}" fill="#9ecbff"><title>{title}</title></rect>')
        if c:
            parts.append(f'<rect class="completion" x="{x + 1:.1f}" y="{y(p + c):.1f}" width="{bar - 2:.1f}" '
                         f'height="{y(p) - y(p + c):.1f}" fill="#1f6feb"><title>{title}</title></rect>')
        if i % 4 == 3 or i == hours - 1:
            parts.append(f'<text x="{x + bar / 2:.1f}" y="{HEIGHT - 10}" text-anchor="middle" font-size="11">'
                         f'{slot:%H}h</text>')
    if not any(prompt.values()) and not any(completion.values()):
        parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" font-size="13">'
                     f'No usage in the last {hours} hours.</text>')
    parts.append("</svg>")
    return "".join(parts)
