"""Curves drawn as inline SVG (no script library, nothing fetched): the loss over steps, the loss by noise level,
the held-out score, the learning rate and seconds per step."""

from __future__ import annotations

import math
from html import escape

WIDTH, HEIGHT, PAD = 560, 200, 40


def line_chart(title: str, xs: list[float], series: dict[str, list[float]], css_id: str, bars: bool = False) -> str:
    """An SVG of `series` (name -> values over `xs`), one polyline each (bars instead with `bars`); NaNs skipped.
    Empty data draws the frame with a note, so the page keeps its place."""
    points = [(x, y) for values in series.values() for x, y in zip(xs, values, strict=False) if math.isfinite(y)]
    parts = [f'<svg id="{escape(css_id)}" class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
             f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
             f'<text x="{PAD}" y="16" class="chart-title">{escape(title)}</text>',
             f'<rect x="{PAD}" y="24" width="{WIDTH - 2 * PAD}" height="{HEIGHT - 24 - PAD}" class="chart-frame"/>']
    if not points:
        parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" class="chart-empty">no data yet'
                     "</text></svg>")
        return "".join(parts)
    low_x, high_x = min(p[0] for p in points), max(p[0] for p in points)
    low_y, high_y = min(p[1] for p in points), max(p[1] for p in points)
    if bars:  # levels in [0, 1], from zero
        low_x, high_x, low_y = 0.0, 1.0, min(low_y, 0.0)
    span_x, span_y = (high_x - low_x) or 1.0, (high_y - low_y) or 1.0

    def at(x: float, y: float) -> tuple[float, float]:
        return (PAD + (x - low_x) / span_x * (WIDTH - 2 * PAD),
                HEIGHT - PAD - (y - low_y) / span_y * (HEIGHT - 24 - PAD))

    for number, (name, values) in enumerate(series.items()):
        pairs = [at(x, y) for x, y in zip(xs, values, strict=False) if math.isfinite(y)]
        if bars:
            width = max((WIDTH - 2 * PAD) / 10 * 0.8, 2)  # a tenth of the range per bin
            base = at(low_x, low_y)[1]
            parts += [f'<rect x="{x - width / 2:.1f}" y="{y:.1f}" width="{width:.1f}" height="{base - y:.1f}" '
                      f'class="series-{number}"/>' for x, y in pairs]
        else:
            text = " ".join(f"{x:.1f},{y:.1f}" for x, y in pairs)
            parts.append(f'<polyline points="{text}" class="series-{number}" fill="none"/>')
            if len(pairs) == 1:
                parts.append(f'<circle cx="{pairs[0][0]:.1f}" cy="{pairs[0][1]:.1f}" r="3" class="series-{number}"/>')
        parts.append(f'<text x="{WIDTH - PAD}" y="{16 + 12 * number}" text-anchor="end" '
                     f'class="legend series-{number}">{escape(name)}</text>')
    parts += [f'<text x="{PAD - 4}" y="{HEIGHT - PAD}" text-anchor="end" class="tick">{low_y:.3g}</text>',
              f'<text x="{PAD - 4}" y="32" text-anchor="end" class="tick">{high_y:.3g}</text>',
              f'<text x="{PAD}" y="{HEIGHT - PAD + 14}" class="tick">{low_x:.3g}</text>',
              f'<text x="{WIDTH - PAD}" y="{HEIGHT - PAD + 14}" text-anchor="end" class="tick">{high_x:.3g}</text>',
              "</svg>"]
    return "".join(parts)
