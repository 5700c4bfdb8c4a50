"""Charts as inline SVG, drawn on the server: a GPU-utilisation sparkline and a budget's
burn-down. No script, no library, nothing fetched; presentation attributes and CSS classes only
(the pages' Content-Security-Policy forbids inline ``style``)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from decimal import Decimal
from html import escape

from markupsafe import Markup


def sparkline(
    points: Sequence[tuple[datetime, float | None]],
    start: datetime,
    end: datetime,
    *,
    width: int = 120,
    height: int = 24,
    label: str = "",
    scale: bool = False,
    step: timedelta | None = None,
    times: tuple[str, str] | None = None,
) -> Markup:
    """Max GPU utilisation (0–100 %) over [start, end): a line per run of known values; an
    agent that saw no GPU (None) breaks the line, and so does silence: two points more than
    two ``step`` apart (default: the median gap between points) are not joined, so hours
    without heartbeats show as a gap, not a straight line. ``scale``: with 0/50/100 % grid
    lines and their labels (a chart to read, not a glance in a table row); ``times``: the
    start and end labels of its time axis, drawn under it."""
    left = 40 if scale else 0
    top = 6 if scale else 1
    axis = 16 if times else 0
    height += axis
    plot_w, bottom = width - left, height - axis - (7 if scale else 1)
    span = (end - start).total_seconds() or 1.0
    gap = 2 * (step or _median_gap(points)).total_seconds()
    box = (left, top, plot_w, bottom)
    lines = _polylines(_runs(points, start, span, gap, box))
    grid = _spark_grid(box, width, height) if scale else ""
    if times:
        ty = height - 3
        grid += (
            f'<text class="spark-axis spark-start" x="{left}" y="{ty}">{escape(times[0])}</text>'
            f'<text class="spark-axis spark-end" x="{width}" y="{ty}" text-anchor="end">'
            f"{escape(times[1])}</text>"
        )
    return Markup(
        f'<svg class="sparkline" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="{escape(label)}">{grid}'
        f'<path class="spark-base" d="M{left} {bottom}H{width}"/>'
        f"{lines}</svg>"
    )


def _runs(
    points: Sequence[tuple[datetime, float | None]],
    start: datetime,
    span: float,
    gap: float,
    box: tuple[int, int, int, int],
) -> list[list[str]]:
    """The points as runs of ``x,y`` coordinates in ``box`` (left, top, width, bottom): a run
    ends at a point without GPUs, and at a silence longer than ``gap`` seconds."""
    left, top, plot_w, bottom = box
    runs: list[list[str]] = [[]]
    last: datetime | None = None
    for at, util in points:
        if util is None:
            runs.append([])
            last = None
            continue
        if last is not None and gap and (at - last).total_seconds() > gap:
            runs.append([])
        last = at
        x = left + (at - start).total_seconds() / span * plot_w
        y = bottom - max(0.0, min(util, 100.0)) / 100 * (bottom - top)
        runs[-1].append(f"{_n(x)},{_n(y)}")
    return runs


def _polylines(runs: list[list[str]]) -> str:
    """A line per run of points (a lone point: a dot)."""
    return "".join(
        f'<polyline class="spark" points="{" ".join(r)}"/>' if len(r) > 1 else _dot(r[0])
        for r in runs
        if r
    )


def _spark_grid(box: tuple[int, int, int, int], width: int, height: int) -> str:
    """The 0, 50 and 100 % grid lines and their labels."""
    left, top, _, bottom = box
    grid = ""
    for pct in (0, 50, 100):
        gy = _n(bottom - pct / 100 * (bottom - top))
        grid += (
            f'<path class="spark-grid" d="M{left} {gy}H{width}"/>'
            f'<text class="spark-axis" x="{left - 6}" y="{gy}" text-anchor="end" '
            f'dominant-baseline="middle">{pct} %</text>'
        )
    return grid


def _median_gap(points: Sequence[tuple[datetime, float | None]]) -> timedelta:
    """The usual time between two points (zero when there are fewer than two)."""
    gaps = sorted(b[0] - a[0] for a, b in itertools.pairwise(points))
    return gaps[len(gaps) // 2] if gaps else timedelta(0)


def _n(v: float) -> str:
    """A coordinate to a tenth of a pixel, without a trailing ``.0`` (a thousand sparklines
    on the fleet page: every byte counts a thousand times)."""
    return f"{v:.1f}".removesuffix(".0")


def _dot(point: str) -> str:
    x, y = point.split(",")
    return f'<circle class="spark-dot" cx="{x}" cy="{y}" r="1.5"/>'


def burndown(
    days: Sequence[tuple[str, Decimal]],
    today: int | None,
    *,
    amount: Decimal | None,
    forecast: Decimal | None,
    committed_to: Decimal | None,
    thresholds: Sequence[Decimal],
    labels: dict[str, str],
    money: dict[str, str],
    num: Callable[[Decimal], str] = str,
) -> Markup:
    """Cumulative spend by day against the budget: bars for each day's spend, the running
    total up to ``today`` (index into ``days``), a dashed line from there to the forecast at
    the period's end, the spent + committed mark, the budget line and a tick per threshold
    (no budget: ``amount`` None). ``labels``/``money``/``num`` give the words and formatted
    amounts in the page's language."""
    w, h, left, right, top, bottom = 720, 272, 64, 16, 28, 40
    pw, ph = w - left - right, h - top - bottom
    n = max(len(days), 1)
    daily = [v for _, v in days]
    cum = _running(daily, today)
    step, ticks = _scale(amount, *cum, forecast, committed_to)
    plot = _Plot(left, top, pw, ph, n, step * ticks)
    x, y = plot.x, plot.y
    peak_day = max(daily, default=Decimal(0)) or Decimal(1)
    parts = [
        f'<svg class="burndown" viewBox="0 0 {w} {h}" role="img" '
        f'aria-label="{escape(labels["title"])}">',
        f'<rect class="plot" x="{left}" y="{top}" width="{pw}" height="{ph}"/>',
    ]
    for k in range(ticks + 1):  # y grid in the budget's currency, at round numbers
        v = step * k
        parts.append(
            f'<line class="grid" x1="{left}" x2="{left + pw}" y1="{y(v):.1f}" y2="{y(v):.1f}"/>'
            f'<text class="axis" x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">'
            f"{escape(num(v))}</text>"
        )
    parts.append(f'<text class="axis" x="{left - 6}" y="{top - 14}" text-anchor="end">')
    parts.append(f"{escape(money['top'])}</text>")
    bar_w = max(pw / n * 0.6, 1)
    for i, v in enumerate(daily):  # daily spend, scaled to the lower third
        bh = float(v / peak_day) * ph / 3
        parts.append(
            f'<rect class="day" x="{x(i) - bar_w / 2:.1f}" y="{top + ph - bh:.1f}" '
            f'width="{bar_w:.1f}" height="{bh:.1f}"><title>{escape(days[i][0])}</title></rect>'
        )
    if amount is not None:
        parts += _budget_lines(plot, amount, thresholds, labels["budget"], money["amount"])
    parts += _spent_lines(plot, cum, forecast, committed_to)
    every = max(1, n // 10)
    for i in range(0, n, every):  # x axis: day of the period
        parts.append(
            f'<text class="axis" x="{x(i):.1f}" y="{top + ph + 14}" text-anchor="middle">'
            f"{escape(days[i][0][-2:])}</text>"
        )
    legend = [
        ("day", labels["daily"]),
        ("spent", labels["spent"]),
        *([("committed", labels["committed"])] if committed_to is not None else []),
        *([("forecast", labels["forecast"])] if forecast is not None else []),
        *([("budget", labels["budget"])] if amount is not None else []),
    ]
    parts += _legend(legend, left, h)
    parts.append("</svg>")
    return Markup("".join(parts))


def _scale(*values: Decimal | None) -> tuple[Decimal, int]:
    """The y axis over ``values`` (None: 0) with 4 % of headroom: its step and how many."""
    top_value = max([v or Decimal(0) for v in values])
    step = nice_step(top_value * Decimal("1.04") / 4)
    return step, max(1, math.ceil(top_value * Decimal("1.04") / step))


def _running(daily: list[Decimal], today: int | None) -> list[Decimal]:
    """The running total of ``daily`` up to ``today`` (None: every day)."""
    cum: list[Decimal] = []
    run = Decimal(0)
    for i, v in enumerate(daily):
        run += v
        if today is None or i <= today:
            cum.append(run)
    return cum


class _Plot:
    """A chart's plot area: day ``i`` and amount ``v`` to pixels."""

    def __init__(self, left: int, top: int, pw: int, ph: int, n: int, top_value: Decimal) -> None:
        self.left, self.top, self.pw, self.ph, self.n = left, top, pw, ph, n
        self.top_value = top_value

    def x(self, i: float) -> float:
        return self.left + (i + 0.5) * self.pw / self.n

    def y(self, v: Decimal) -> float:
        return self.top + self.ph - float(v / self.top_value) * self.ph


def _budget_lines(
    plot: _Plot, amount: Decimal, thresholds: Sequence[Decimal], label: str, shown: str
) -> list[str]:
    """The budget line, labelled with ``shown``, and a dotted line per alert threshold."""
    left, pw, parts = plot.left, plot.pw, []
    for t in thresholds:  # alert thresholds as dotted lines, labelled on the right
        if t == 100:
            continue  # the budget line itself
        ty = plot.y(amount * t / 100)
        if ty >= plot.top:
            parts.append(
                f'<line class="threshold" x1="{left}" x2="{left + pw}" y1="{ty:.1f}" '
                f'y2="{ty:.1f}"/><text class="axis" x="{left + pw - 4}" y="{ty - 3:.1f}" '
                f'text-anchor="end">{t:g} %</text>'
            )
    by = plot.y(amount)
    parts.append(
        f'<line class="budget" x1="{left}" x2="{left + pw}" y1="{by:.1f}" y2="{by:.1f}"/>'
        f'<text class="label budget-label" x="{left + 4}" y="{by - 4:.1f}">'
        f"{escape(label)} {escape(shown)}</text>"
    )
    return parts


def _spent_lines(
    plot: _Plot, cum: list[Decimal], forecast: Decimal | None, committed_to: Decimal | None
) -> list[str]:
    """The running total, then dashed lines from its last day to the forecast and to spent +
    committed at the period's end."""
    if not cum:
        return []
    x, y, n = plot.x, plot.y, plot.n
    pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(cum))
    parts = [f'<polyline class="spent" points="{pts}"/>']
    last = len(cum) - 1
    if forecast is not None and last < n - 1:
        parts.append(
            f'<line class="forecast" x1="{x(last):.1f}" y1="{y(cum[-1]):.1f}" '
            f'x2="{x(n - 1):.1f}" y2="{y(forecast):.1f}"/>'
            f'<circle class="forecast-dot" cx="{x(n - 1):.1f}" cy="{y(forecast):.1f}" r="3"/>'
        )
    if committed_to is not None and last < n - 1:
        parts.append(
            f'<line class="committed" x1="{x(last):.1f}" y1="{y(cum[-1]):.1f}" '
            f'x2="{x(n - 1):.1f}" y2="{y(committed_to):.1f}"/>'
        )
    return parts


def _legend(legend: list[tuple[str, str]], left: int, h: int) -> list[str]:
    """The legend along the bottom: a mark and its words for each line."""
    parts, lx = [], left
    for cls, text in legend:
        mark = (
            f'<rect class="day" x="{lx}" y="{h - 13}" width="18" height="9"/>'
            if cls == "day"
            else f'<line class="{cls}" x1="{lx}" x2="{lx + 18}" y1="{h - 8}" y2="{h - 8}"/>'
        )
        parts.append(f'{mark}<text class="legend" x="{lx + 22}" y="{h - 4}">{escape(text)}</text>')
        lx += 30 + 7 * len(text)
    return parts


def nice_step(raw: Decimal) -> Decimal:
    """The round number (1, 2, 2.5 or 5 × 10ⁿ) at or above ``raw``, for grid lines."""
    if raw <= 0:
        return Decimal(1)
    exp = Decimal(10) ** math.floor(math.log10(raw))
    return next(
        m * exp
        for m in (Decimal(1), Decimal(2), Decimal("2.5"), Decimal(5), Decimal(10))
        if m * exp >= raw
    )
