"""A report (:mod:`provisioner.reports`) for people and spreadsheets: plain text and HTML
(Jinja2 templates), a matplotlib chart of daily spend with the budget line and the forecast, CSV,
and the email that carries them all.

Numbers, dates and currencies are formatted for the language (Babel); English by default,
Russian per policy (``budget.language``) or per command (``report --language ru``).
"""

from __future__ import annotations

import csv as csvlib
import io
from base64 import b64encode
from collections.abc import Iterable
from datetime import date, timedelta
from decimal import ROUND_HALF_UP, Decimal
from functools import cache, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from provisioner import mail
from provisioner.errors import UserError
from provisioner.ledger import Period
from provisioner.money import CENT, Money
from provisioner.ownership import Ownership
from provisioner.reports import MachineLine, Report
from provisioner.words import messages

if TYPE_CHECKING:
    from email.message import EmailMessage

    from provisioner.app import App

TEMPLATES = Path(__file__).parent / "templates"
LOCALES = {"en": "en_US", "ru": "ru_RU"}
CSV_PLACES = Decimal("0.000001")  # rows keep micro-units so the column sums to the ledger's total

Alert = tuple[str, Decimal]  # (actual | forecast, the threshold crossed)


@cache
def _babel_locale(name: str) -> Any:
    from babel import Locale

    return Locale.parse(name)


@lru_cache(maxsize=8192)
def _money(cents: str, currency: str, language: str) -> str:
    """An amount in cents (its exact text: ``-0.00`` is not ``0.00``), formatted once (Babel:
    ~0.15 ms each; a fleet's machines share rates, so many of their amounts)."""
    from babel.numbers import format_currency

    return format_currency(Decimal(cents), currency, locale=_babel_locale(LOCALES[language]))


class Fmt:
    """Numbers, money, dates and words for one language."""

    def __init__(self, language: str) -> None:
        if language not in LOCALES:
            raise UserError(f"unknown language {language!r}; use {', '.join(LOCALES)}")
        self.language = language

    @property
    def locale(self) -> Any:
        """Babel's locale, parsed once: given its name, every amount of a 1,000-row fleet page
        parsed it again (a fifth of the page's formatting)."""
        return _babel_locale(LOCALES[self.language])

    def t(self, key: str, **kw: Any) -> str:
        if key.startswith("label:"):  # a report by label:KEY
            return messages(self.language)["label_key"].format(key=key.removeprefix("label:"))
        text = messages(self.language)[key]
        return text.format(**kw) if kw else text

    def reason(self, reason: str) -> str:
        """A scheduler's reason (``off-hours-idle``…) in words; its own name when it has none."""
        return messages(self.language).get(f"dash_reason_{reason}", reason)

    def money(self, m: Money | None) -> str:
        if m is None:
            return "—"
        return _money(str(m.amount.quantize(CENT, ROUND_HALF_UP)), m.currency, self.language)

    def rate(self, m: Money) -> str:
        """A rate per hour with every digit it has (0.0068, not 0.01), at least the cents."""
        from babel.numbers import format_currency

        amount = format_currency(
            m.amount, m.currency, locale=self.locale, decimal_quantization=False
        )
        return self.t("per_hour", amount=amount)

    def machine_gpu(self, m: MachineLine) -> str:
        return f"{m.gpu_count}× {m.gpu}" if m.gpu else "—"

    def num(self, d: Decimal | int, places: int = 0) -> str:
        from babel.numbers import format_decimal

        pattern = "#,##0" + ("." + "0" * places if places else "")
        return format_decimal(d, pattern, locale=self.locale)

    def ratio(self, d: Decimal | None) -> str:
        """A ratio from 0 to 1 as a percent to one place (0.4333 → 43.3 %); None: "—"."""
        return "—" if d is None else f"{self.num((d * 100).quantize(Decimal('0.1')), 1)} %"

    def pct(self, d: Decimal) -> str:
        return f"{self.num(d.quantize(Decimal(1), ROUND_HALF_UP))} %"

    def date(self, d: date) -> str:
        from babel.dates import format_date

        return format_date(d, "medium", locale=self.locale)

    def period(self, p: Period) -> str:
        last = p.end.astimezone(ZoneInfo(p.tz)).date() - timedelta(days=1)
        return (
            f"{p.label} ({self.date(p.start.astimezone(ZoneInfo(p.tz)).date())} – "
            f"{self.date(last)})"
        )


def fmt(r: Report) -> Fmt:
    return Fmt(r.language)


def subject(r: Report, alert: Alert | None = None) -> str:
    f, b = fmt(r), r.budget
    if b is None:
        return f.t("subject_plain", name=r.title, total=f.money(r.total), period=r.period.label)
    kw = {
        "name": r.title,
        "pct": f.pct(b.pct),
        "fpct": f.pct(b.forecast_pct),
        "spent": f.money(b.spent),
        "amount": f.money(b.amount),
        "period": b.period.label,
    }
    if alert is not None:
        return f.t(f"subject_{alert[0]}", **kw)
    return f.t("subject_budget", **kw)


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(text: str) -> str:
    """A text cell a spreadsheet shows as text: one starting with ``= + - @``, a tab or a
    carriage return gets a leading ``'`` (OWASP, https://owasp.org/www-community/attacks/
    CSV_Injection), so ``=HYPERLINK(...)`` in a project or owner is not a live formula."""
    return "'" + text if text.startswith(_FORMULA_START) else text


def csv(r: Report) -> str:
    """One row per (group, kind, currency): the amount billed and its conversion."""
    rates = r.conversion
    return csv_table(
        ["period", r.by, "kind", "currency", "amount", f"amount_{r.currency}"],
        (
            [r.period.label, line.key, kind, m.currency, m.amount, conv.amount]
            for line in r.lines
            for kind, amounts in sorted(line.by_kind.items())
            for m in amounts.monies()
            for conv in (rates.convert(m, r.currency),)
        ),
    )


def csv_table(header: list[str], rows: Iterable[Iterable[Any]]) -> str:
    """A CSV file of ``rows``: text through :func:`csv_cell`, amounts (Decimal) to
    :data:`CSV_PLACES`, nothing (None) empty."""
    buf = io.StringIO()
    w = csvlib.writer(buf, lineterminator="\n")
    w.writerow(header)
    for row in rows:
        w.writerow(
            [
                _csv_amount(v)
                if isinstance(v, Decimal)
                else csv_cell(v)
                if isinstance(v, str)
                else ("" if v is None else v)
                for v in row
            ]
        )
    return buf.getvalue()


def ownership_text(r: Report, o: Ownership) -> str:
    f = fmt(r)
    parts = [
        f.t(
            "own_use_one" if o.cards == 1 else "own_use",
            hours=f.num(o.hours_per_week, 1),
            per_card=f.num(o.hours_per_week / o.cards, 1),
            cards=o.cards,
            rental=f.money(o.rental_month),
        )
    ]
    if o.price_low is None:
        parts.append(f.t("own_unknown", gpu=o.gpu))
    elif o.payback_low is None:
        parts.append(f.t("own_never", months=o.amortisation_months))
    else:
        pb = f.t("months", n=_range(f, o.payback_low, o.payback_high))
        parts.append(
            f.t(
                "own_pays",
                low=f.money(o.price_low),
                high=f.money(o.price_high),
                months=o.amortisation_months,
                power=f.money(o.power_month),
                pb=pb,
            )
        )
        if o.breakeven_low is not None:
            parts.append(f.t("own_breakeven", be=_range(f, o.breakeven_low, o.breakeven_high)))
    if o.verdict:
        parts.append(f.t(f"verdict_{o.verdict}"))
    return f"{o.gpu}: " + "; ".join(parts) + "."


def text(r: Report, alert: Alert | None = None) -> str:
    return _template("alert.txt" if alert else "report.txt", r, alert)


def html(r: Report, chart_src: str | None, alert: Alert | None = None) -> str:
    return _template("alert.html" if alert else "report.html", r, alert, chart_src=chart_src)


def _template(name: str, r: Report, alert: Alert | None, **kw: Any) -> str:
    return (
        _env()
        .get_template(name)
        .render(
            r=r,
            f=fmt(r),
            alert=alert,
            subject=subject(r, alert),
            ownership=lambda o: ownership_text(r, o),
            unpriced_text=unpriced_text,
            efficiency_text=efficiency_text,
            unusual_text=unusual_text,
            **kw,
        )
    )


def _range(f: Fmt, lo: Decimal | None, hi: Decimal | None) -> str:
    a, b = f.num(lo or 0, 1), f.num(hi or 0, 1)
    return a if a == b else f"{a}–{b}"


def _csv_amount(d: Decimal) -> str:
    return str(d.quantize(CSV_PLACES, ROUND_HALF_UP))


def _env() -> Any:
    from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape

    return Environment(
        loader=FileSystemLoader(TEMPLATES),
        autoescape=select_autoescape(["html"], default_for_string=False, default=False),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def chart_png(r: Report) -> bytes | None:
    """The chart (:func:`chart`) as PNG; None without matplotlib (the ``charts`` extra): the
    report is whole without its picture."""
    fig = chart(r)
    if fig is None:
        return None
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def chart(r: Report) -> Any:
    """Two panels over the period's days: above, cumulative spend against the budget line and
    the forecast to the period's end (one axis, one currency); below, each day's spend. Every
    figure in the locale's numbers (ru: a decimal comma). A matplotlib Figure, or None."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter, MaxNLocator
    except ImportError:
        return None

    f = fmt(r)
    days = [d for d, _ in r.daily]
    daily = [float(m.amount) for _, m in r.daily]
    today = r.now.astimezone(ZoneInfo(r.period.tz)).date()
    cumulative, run = [], 0.0
    for d, v in zip(days, daily, strict=True):
        run += v
        cumulative.append(run if d <= today else None)
    fig = Figure(figsize=(8, 4.8), dpi=100)
    top, bottom = fig.subplots(
        2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1], "hspace": 0.08}
    )
    x = list(range(1, len(days) + 1))
    _spend_panel(top, r, f, x, cumulative)
    bottom.bar(x, daily, color="#4c72b0")
    bottom.set_ylabel(f.t("axis_daily", currency=r.currency))
    bottom.set_xlabel(f.t("axis_day"))
    bottom.set_xlim(0.3, len(days) + 0.7)
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (top, bottom):
        ax.yaxis.set_major_locator(MaxNLocator(nbins=5 if ax is top else 3))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _tick(f, v)))
        ax.grid(axis="y", color="#e4e4e4")
        ax.set_axisbelow(True)
    fig.align_ylabels()
    fig.subplots_adjust(left=0.12, right=0.98, top=0.93, bottom=0.1)
    return fig


def _spend_panel(top: Any, r: Report, f: Fmt, x: list[int], cumulative: list[float | None]) -> None:
    """The upper panel: cumulative spend up to today, the budget line, the forecast to the
    period's end."""
    top.plot(
        [i for i, c in zip(x, cumulative, strict=True) if c is not None],
        [c for c in cumulative if c is not None],
        color="#222222",
        marker=".",
        label=f"{f.t('cumulative')} {f.money(r.total)}",
    )
    if r.budget is not None:
        top.axhline(
            float(r.budget.amount.amount),
            color="#c44e52",
            label=f"{f.t('budget_line')} {f.money(r.budget.amount)}",
        )
    _forecast_line(top, r, f, x, cumulative)
    top.set_ylim(0, _highest(r, cumulative) * 1.1 or 1)
    top.set_ylabel(f.t("axis_cumulative", currency=r.currency))
    top.legend(loc="lower right", fontsize=8)  # the spend climbs from the lower left
    top.set_title(f"{r.title} — {r.period.label}")


def _forecast_line(
    top: Any, r: Report, f: Fmt, x: list[int], cumulative: list[float | None]
) -> None:
    """The forecast's dashed line from today's spend to the period's end (when today is in
    the period): the budget's forecast when it has one, as the text says."""
    days = [d for d, _ in r.daily]
    today = r.now.astimezone(ZoneInfo(r.period.tz)).date()
    forecast = r.shown_forecast
    if forecast is not None and today in days:
        i = days.index(today)
        top.plot(
            [x[i], x[-1]],
            [cumulative[i] or 0.0, float(forecast.amount)],
            color="#dd8452",
            linestyle="--",
            label=f"{f.t('forecast_line')} {f.money(forecast)}",
        )


def _highest(r: Report, cumulative: list[float | None]) -> float:
    """The highest of spend, budget and forecast (0 for none), to leave room above: the
    budget line never on the frame."""
    marks = [r.shown_forecast, r.budget.amount if r.budget else None]
    return max(
        [c for c in cumulative if c is not None]
        + [float(m.amount) for m in marks if m is not None]
        + [0.0]
    )


def _tick(f: Fmt, v: float) -> str:
    """An axis figure in the locale's numbers: whole above 10, else with the decimals it needs."""
    d = Decimal(repr(float(v)))
    if abs(d) >= 10 or d == d.to_integral():
        return f.num(d.quantize(Decimal(1), ROUND_HALF_UP))
    return f.num(d.quantize(Decimal("0.01"), ROUND_HALF_UP), 2)


def html_page(r: Report) -> str:
    """A standalone HTML page (the chart inlined as a data: URL)."""
    png = chart_png(r)
    return html(r, "data:image/png;base64," + b64encode(png).decode() if png else None)


# --- mail ----------------------------------------------------------------------------------


def message(app: App, r: Report, to: Iterable[str], alert: Alert | None = None) -> EmailMessage:
    """Plain text, HTML with the chart inline, and the CSV attached."""
    png = chart_png(r)
    return mail.compose(
        sender=app.settings.smtp.sender,
        to=list(to),
        subject=subject(r, alert),
        text=text(r, alert),
        html=html(r, "cid:chart" if png else None, alert),
        images={"chart": png} if png else {},
        attachments=[(f"spend-{_slug(r.title)}-{r.period.label}.csv", csv(r).encode(), "text/csv")],
    )


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in text).strip("-") or "all"


def email(app: App, r: Report, to: Iterable[str], alert: Alert | None = None) -> None:
    to = list(to)
    if not to:
        raise UserError("no recipients: give --to, or set budget.recipients in the policy")
    mail.send(app.settings.smtp, message(app, r, to, alert))


def unpriced_text(f: Any, u: Any) -> str:
    """One :class:`provisioner.ledger.unpriced.Unpriced` in the report's language."""
    piece = f.t(f"unpriced_{u.piece}")
    return f.t("unpriced_line", count=u.count, piece=piece, cloud=u.cloud, setting=u.setting)


def efficiency_text(f: Any, t: Any) -> str:
    """One :class:`provisioner.efficiency.GpuTime` in the report's language."""
    return f.t(
        "gpu_efficiency_line",
        ratio=f.ratio(t.ratio),
        busy=f.num(t.hours(t.busy_us), 2),
        paid=f.num(t.hours(t.paid_us), 2),
        unknown=f.num(t.hours(t.unknown_us), 2),
    )


def unusual_text(f: Any, u: Any) -> str:
    """One :class:`provisioner.efficiency.Unusual` in the report's language."""
    return f.t(
        "unusual_line",
        name=u.key,
        by=f.t(u.by).lower(),
        day=f.date(u.day),
        spent=f.money(u.spent),
        median=f.money(u.median),
        limit=f.money(u.limit),
    )
