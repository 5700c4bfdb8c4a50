"""Spend reports: one model (:class:`Report`) built in one streaming pass over the ledger, rendered
as JSON, CSV, plain text and HTML (Jinja2, with a matplotlib chart of daily spend, the budget line
and the forecast), and mailed — on demand, on each policy's cron, and as threshold alerts.

Numbers, dates and currencies are formatted for the language (Babel); English by default,
Russian per policy (``budget.language``) or per command (``report --language ru``).
"""

from __future__ import annotations

import csv
import io
import math
from base64 import b64encode
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from provisioner import budget, ledger, mail
from provisioner.errors import UserError
from provisioner.ledger import Amounts, Period, Scope, Tally
from provisioner.money import CENT, Money, Rates

if TYPE_CHECKING:
    from email.message import EmailMessage

    from policies.schema import Policy
    from provisioner.app import App

TEMPLATES = Path(__file__).parent / "templates"
LOCALES = {"en": "en_US", "ru": "ru_RU"}
HOURS_PER_MONTH = Decimal(730)  # 8760 / 12, the clouds' own convention
WEEKS_PER_MONTH = Decimal(52) / Decimal(12)
TOP = 10
SCHEDULE_GRACE = timedelta(days=1)  # a report due longer ago than this is skipped, not sent late
CSV_PLACES = Decimal("0.000001")  # rows keep micro-units so the column sums to the ledger's total

TEXT: dict[str, dict[str, str]] = {
    "en": {
        "report": "Spend report",
        "all": "all projects",
        "period": "Period",
        "generated": "as of",
        "spent": "Spent",
        "budget": "Budget",
        "of_budget": "of budget",
        "forecast": "Forecast to period end",
        "committed": "Committed by live machines",
        "left": "Left for new machines",
        "on_exhausted": "When exhausted",
        "compute": "Compute",
        "disk": "Disks",
        "total": "Total",
        "share": "Share",
        "project": "Project",
        "owner": "Owner",
        "cloud": "Cloud",
        "gpu": "GPU",
        "machine": "Machine",
        "top": "Top machines",
        "idle": "Idle waste (running idle before the scheduler stopped them)",
        "savings": "Saved by scheduled stops",
        "none": "none",
        "rates": "Rates used",
        "daily": "Daily spend",
        "cumulative": "Cumulative",
        "rent": "Rent or buy",
        "rule": "Rule of thumb: a GPU busy more than 20–30 hours a week is cheaper to own.",
        "subject_budget": "{name}: {pct} of budget, forecast {fpct}",
        "subject_plain": "{name}: {total} spent in {period}",
        "subject_actual": "{name}: {pct} of budget spent ({spent} of {amount})",
        "subject_forecast": "{name}: forecast {fpct} of budget by the end of {period}",
        "alert_actual": "Spend has reached the {t} threshold of the budget.",
        "alert_forecast": "The forecast to the end of the period has reached the {t} threshold.",
        "csv_note": "The attached CSV holds the spend per {by} and kind.",
        "own_use": "{hours} GPU-hours a week ({per_card} h per card on {cards} card(s)); "
        "renting costs {rental} a month",
        "own_pays": "owning ({low}–{high} a card, {months}-month amortisation, {power} a month "
        "of power) would pay off after {pb}",
        "own_never": "at this use owning would not pay off within the card's {months}-month life",
        "own_breakeven": "owning wins above {be} hours a week per card",
        "own_unknown": "no ownership figures for {gpu} (set ownership.gpus.{gpu} in settings)",
        "months": "{n} months",
        "verdict_own": "owning would be cheaper",
        "verdict_rent": "renting is cheaper",
        "verdict_close": "close: depends on the card's price",
        "axis_day": "day",
        "budget_line": "budget",
        "forecast_line": "forecast",
    },
    "ru": {
        "report": "Отчёт о расходах",
        "all": "все проекты",
        "period": "Период",
        "generated": "на",
        "spent": "Потрачено",
        "budget": "Бюджет",
        "of_budget": "бюджета",
        "forecast": "Прогноз на конец периода",
        "committed": "Обязательства работающих машин",
        "left": "Остаток для новых машин",
        "on_exhausted": "При исчерпании",
        "compute": "Вычисления",
        "disk": "Диски",
        "total": "Итого",
        "share": "Доля",
        "project": "Проект",
        "owner": "Владелец",
        "cloud": "Облако",
        "gpu": "GPU",
        "machine": "Машина",
        "top": "Самые дорогие машины",
        "idle": "Потери на простое (до остановки планировщиком)",
        "savings": "Сэкономлено плановыми остановками",
        "none": "нет",
        "rates": "Курсы",
        "daily": "Расходы по дням",
        "cumulative": "Нарастающим итогом",
        "rent": "Аренда или покупка",
        "rule": "Эмпирическое правило: GPU, занятый больше 20–30 часов в неделю, выгоднее купить.",
        "subject_budget": "{name}: {pct} бюджета, прогноз {fpct}",
        "subject_plain": "{name}: потрачено {total} за {period}",
        "subject_actual": "{name}: израсходовано {pct} бюджета ({spent} из {amount})",
        "subject_forecast": "{name}: прогноз {fpct} бюджета к концу периода {period}",
        "alert_actual": "Расходы достигли порога {t} бюджета.",
        "alert_forecast": "Прогноз на конец периода достиг порога {t} бюджета.",
        "csv_note": "В приложенном CSV — расходы по разрезу «{by}» и видам.",
        "own_use": "{hours} GPU-часов в неделю ({per_card} ч на карту, карт: {cards}); "
        "аренда стоит {rental} в месяц",
        "own_pays": "покупка ({low}–{high} за карту, амортизация {months} мес., электричество "
        "{power} в месяц) окупилась бы за {pb}",
        "own_never": "при такой загрузке покупка не окупится за {months} мес. службы карты",
        "own_breakeven": "покупка выгоднее при загрузке больше {be} ч в неделю на карту",
        "own_unknown": "нет данных о покупке {gpu} (задайте ownership.gpus.{gpu} в настройках)",
        "months": "{n} мес.",
        "verdict_own": "покупка выгоднее",
        "verdict_rent": "аренда выгоднее",
        "verdict_close": "на грани: зависит от цены карты",
        "axis_day": "день",
        "budget_line": "бюджет",
        "forecast_line": "прогноз",
    },
}


class Fmt:
    """Numbers, money, dates and words for one language."""

    def __init__(self, language: str) -> None:
        if language not in LOCALES:
            raise UserError(f"unknown language {language!r}; use {', '.join(LOCALES)}")
        self.language = language
        self.locale = LOCALES[language]

    def t(self, key: str, **kw: Any) -> str:
        text = TEXT[self.language][key]
        return text.format(**kw) if kw else text

    def money(self, m: Money | None) -> str:
        from babel.numbers import format_currency

        if m is None:
            return "—"
        return format_currency(
            m.amount.quantize(CENT, ROUND_HALF_UP), m.currency, locale=self.locale
        )

    def num(self, d: Decimal | int, places: int = 0) -> str:
        from babel.numbers import format_decimal

        pattern = "#,##0" + ("." + "0" * places if places else "")
        return format_decimal(d, pattern, locale=self.locale)

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


# --- the model -----------------------------------------------------------------------------


@dataclass
class Line:
    key: str
    amounts: Amounts  # in the currencies billed
    total: Money  # converted to the report's currency
    by_kind: dict[str, Amounts] = field(default_factory=dict)


@dataclass
class Ownership:
    """Rent or buy for one GPU type, in the report's currency."""

    gpu: str
    gpu_hours: Decimal
    hours_per_week: Decimal
    cards: int
    rental_month: Money
    price_low: Money | None = None
    price_high: Money | None = None
    power_month: Money | None = None
    amortisation_months: int = 0
    payback_low: Decimal | None = None  # months until owning would have paid for itself
    payback_high: Decimal | None = None
    breakeven_low: Decimal | None = None  # hours a week per card above which owning wins
    breakeven_high: Decimal | None = None

    @property
    def verdict(self) -> str | None:
        if self.breakeven_low is None or self.breakeven_high is None:
            return None if self.price_low is None else "rent"
        use = self.hours_per_week / self.cards
        if use >= self.breakeven_high:
            return "own"
        return "rent" if use < self.breakeven_low else "close"


@dataclass
class Report:
    title: str
    period: Period
    now: datetime
    currency: str
    rates: str
    by: str
    lines: list[Line]
    native: Amounts
    total: Money
    by_kind: dict[str, Money]
    daily: list[tuple[date, Money]]
    forecast: Money | None
    top_machines: list[Line]
    idle_waste: Money
    savings: list[tuple[str, Money]]
    rent_or_buy: list[Ownership]
    conversion: Rates
    budget: budget.Status | None = None
    language: str = "en"

    @cached_property
    def fmt(self) -> Fmt:
        return Fmt(self.language)

    def subject(self, alert: tuple[str, Decimal] | None = None) -> str:
        f, b = self.fmt, self.budget
        if b is None:
            return f.t(
                "subject_plain",
                name=self.title,
                total=f.money(self.total),
                period=self.period.label,
            )
        kw = {
            "name": self.title,
            "pct": f.pct(b.pct),
            "fpct": f.pct(b.forecast_pct),
            "spent": f.money(b.spent),
            "amount": f.money(b.amount),
            "period": b.period.label,
        }
        if alert is not None:
            return f.t(f"subject_{alert[0]}", **kw)
        return f.t("subject_budget", **kw)

    # -- machine-readable ------------------------------------------------------------------

    def csv(self) -> str:
        """One row per (group, kind, currency): the amount billed and its conversion."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["period", self.by, "kind", "currency", "amount", f"amount_{self.currency}"])
        rates = self.conversion
        for line in self.lines:
            for kind, amounts in sorted(line.by_kind.items()):
                for m in amounts.monies():
                    conv = rates.convert(m, self.currency)
                    w.writerow(
                        [
                            self.period.label,
                            line.key,
                            kind,
                            m.currency,
                            _csv_amount(m.amount),
                            _csv_amount(conv.amount),
                        ]
                    )
        return buf.getvalue()

    def as_json(self) -> dict[str, Any]:
        def money(m: Money | None) -> dict[str, str] | None:
            return (
                None if m is None else {"amount": str(m.rounded().amount), "currency": m.currency}
            )

        def line(ln: Line) -> dict[str, Any]:
            return {
                "key": ln.key,
                "total": money(ln.total),
                "billed": [money(m.rounded()) for m in ln.amounts.monies()],
            }

        return {
            "title": self.title,
            "period": {
                "label": self.period.label,
                "start": self.period.start,
                "end": self.period.end,
                "timezone": self.period.tz,
            },
            "as_of": self.now,
            "currency": self.currency,
            "rates": self.rates,
            "by": self.by,
            "total": money(self.total),
            "billed": [money(m.rounded()) for m in self.native.monies()],
            "by_kind": {k: money(v) for k, v in self.by_kind.items()},
            "forecast": money(self.forecast),
            "budget": self.budget.as_json() if self.budget else None,
            "lines": [line(ln) for ln in self.lines],
            "top_machines": [line(ln) for ln in self.top_machines],
            "daily": [{"day": d.isoformat(), **(money(m) or {})} for d, m in self.daily],
            "idle_waste": money(self.idle_waste),
            "savings": {r: money(m) for r, m in self.savings},
            "rent_or_buy": [
                {
                    "gpu": o.gpu,
                    "gpu_hours": str(o.gpu_hours.quantize(Decimal("0.01"))),
                    "hours_per_week": str(o.hours_per_week.quantize(Decimal("0.1"))),
                    "cards": o.cards,
                    "rental_per_month": money(o.rental_month),
                    "price_low": money(o.price_low),
                    "price_high": money(o.price_high),
                    "power_per_month": money(o.power_month),
                    "payback_months": [_q(o.payback_low), _q(o.payback_high)],
                    "breakeven_hours_per_week": [_q(o.breakeven_low), _q(o.breakeven_high)],
                    "verdict": o.verdict,
                }
                for o in self.rent_or_buy
            ],
        }

    # -- for people --------------------------------------------------------------------------

    def ownership_text(self, o: Ownership) -> str:
        f = self.fmt
        parts = [
            f.t(
                "own_use",
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

    def text(self, alert: tuple[str, Decimal] | None = None) -> str:
        return (
            _env()
            .get_template("alert.txt" if alert else "report.txt")
            .render(r=self, f=self.fmt, alert=alert)
        )

    def html(self, chart_src: str | None, alert: tuple[str, Decimal] | None = None) -> str:
        return (
            _env()
            .get_template("alert.html" if alert else "report.html")
            .render(r=self, f=self.fmt, chart_src=chart_src, alert=alert)
        )

    def chart(self) -> bytes:
        return chart_png(self)


def _q(d: Decimal | None) -> str | None:
    return None if d is None else str(d.quantize(Decimal("0.1")))


def _range(f: Fmt, lo: Decimal | None, hi: Decimal | None) -> str:
    a, b = f.num(lo or 0, 1), f.num(hi or 0, 1)
    return a if a == b else f"{a}–{b}"


def _csv_amount(d: Decimal) -> str:
    return str(d.quantize(CSV_PLACES, ROUND_HALF_UP))


# --- building ------------------------------------------------------------------------------


@dataclass
class _Sums:
    """What one pass over the intervals and the event queries add up, in billed currencies."""

    by_group_kind: dict[tuple[str, str], Amounts]
    days: dict[date, Amounts]
    machines: dict[str, Amounts]
    gpus: Tally
    native: Amounts
    forecast: ledger.Forecast
    saved: dict[str, Amounts]
    waste: Amounts


def build(
    app: App,
    period: Period,
    scope: Scope = Scope(),
    *,
    by: str = "project",
    title: str | None = None,
    budget_policy: Policy | None = None,
    currency: str | None = None,
    language: str = "en",
    now: datetime | None = None,
) -> Report:
    """The report of ``scope`` over ``period`` up to ``now``, in one pass over the intervals.
    With ``budget_policy``, the budget's own status (over the budget's whole scope) is shown."""
    if by not in ("project", "owner", "cloud", "gpu", "machine"):
        raise UserError(f"cannot report by {by!r}; use project, owner, cloud, gpu or machine")
    now = now or app.clock.now()
    if budget_policy is not None and budget_policy.budget is not None:
        currency = currency or budget_policy.budget.amount.currency
    currency = (currency or app.settings.currency).upper()
    groups, days, machines, gpus = Tally(), Tally(), Tally(), Tally()
    with app.db.session() as s:
        for u in ledger.scan(s, period.start, period.clip(now), scope):
            groups.add((getattr(u, by) or "—", u.kind), u)
            machines.add(u.machine, u)
            for d, us in u.days(period.tz):
                days.add(d, u, us)
            if u.kind == "compute" and u.gpu:
                gpus.add((u.gpu, u.gpu_count or 1), u)
        by_group_kind = groups.amounts()
        native = Amounts()
        for a in by_group_kind.values():
            native.merge(a)
        sums = _Sums(
            by_group_kind,
            days.amounts(),
            machines.amounts(),
            gpus,
            native,
            ledger.forecast(s, period, now, scope, actual=native),
            ledger.savings(s, period, now, scope),
            ledger.idle_waste(s, period, now, scope),
        )
    st = None
    if budget_policy is not None and budget_policy.budget is not None:
        st = budget.status(app, budget_policy, now, period=period)
    try:  # conversion fails on a currency without a rate: say which
        return _assemble(
            app,
            period,
            now,
            sums,
            st,
            currency=currency,
            by=by,
            title=title or TEXT[language]["all"],
            language=language,
        )
    except ValueError as e:
        raise UserError(str(e)) from None


def _assemble(
    app: App,
    period: Period,
    now: datetime,
    sums: _Sums,
    st: budget.Status | None,
    *,
    currency: str,
    by: str,
    title: str,
    language: str,
) -> Report:
    rates, cur = app.settings.money_rates, currency
    lines: dict[str, Line] = {}
    kinds: dict[str, Amounts] = {}
    for (key, kind), amounts in sums.by_group_kind.items():
        ln = lines.setdefault(key, Line(key, Amounts(), Money.zero(cur)))
        ln.by_kind[kind] = amounts
        ln.amounts.merge(amounts)
        kinds.setdefault(kind, Amounts()).merge(amounts)
    for ln in lines.values():
        ln.total = ln.amounts.total(rates, cur)
    per_machine = [Line(k, a, a.total(rates, cur)) for k, a in sums.machines.items()]
    seen = set(sums.native) | set(sums.forecast.total) | {cur}
    if st is not None:
        seen.add(st.amount.currency)
    return Report(
        title=title,
        period=period,
        now=now,
        currency=cur,
        rates=budget.describe_rates(rates, seen),
        by=by,
        lines=sorted(lines.values(), key=lambda ln: (-ln.total.amount, ln.key)),
        native=sums.native,
        total=sums.native.total(rates, cur),
        by_kind={k: a.total(rates, cur) for k, a in sorted(kinds.items())},
        daily=[(d, sums.days.get(d, Amounts()).total(rates, cur)) for d in period.days()],
        forecast=sums.forecast.total.total(rates, cur) if now < period.end else None,
        top_machines=sorted(per_machine, key=lambda ln: (-ln.total.amount, ln.key))[:TOP],
        idle_waste=sums.waste.total(rates, cur),
        savings=sorted(
            ((r, a.total(rates, cur)) for r, a in sums.saved.items()),
            key=lambda rm: -rm[1].amount,
        ),
        rent_or_buy=_rent_or_buy(
            app, sums.gpus, ledger.hours(period.clip(now) - period.start), rates, cur
        ),
        conversion=rates,
        budget=st,
        language=language,
    )


def _rent_or_buy(
    app: App, gpus: Tally, elapsed_h: Decimal, rates: Rates, cur: str
) -> list[Ownership]:
    if elapsed_h <= 0:
        return []
    own = app.settings.ownership
    hours: dict[str, Decimal] = {}
    cost: dict[str, Money] = {}
    amounts = gpus.amounts()
    for (gpu, count), h in gpus.hours().items():
        hours[gpu] = hours.get(gpu, Decimal(0)) + h * count
        cost[gpu] = cost.get(gpu, Money.zero(cur)) + amounts[(gpu, count)].total(rates, cur)
    out = []
    for gpu in sorted(hours):
        gh = hours[gpu]
        if gh <= 0:
            continue
        o = Ownership(
            gpu=gpu,
            gpu_hours=gh,
            hours_per_week=gh / elapsed_h * 168,
            cards=max(1, math.ceil(gh / elapsed_h)),
            rental_month=cost[gpu] * (HOURS_PER_MONTH / elapsed_h),
        )
        spec = own.gpus.get(gpu)
        if spec is not None:
            conv = lambda a: rates.convert(Money(a, own.currency), cur)  # noqa: E731
            o.price_low, o.price_high = conv(spec.price_low), conv(spec.price_high)
            o.amortisation_months = own.amortisation_months
            kw = Decimal(spec.power_watts) / 1000
            o.power_month = conv(gh / elapsed_h * HOURS_PER_MONTH * kw * own.electricity_per_kwh)
            net = o.rental_month - o.power_month
            # a payback longer than the card's useful life is no payback at all
            if (
                net.amount > 0
                and o.price_low.amount * o.cards / net.amount <= own.amortisation_months
            ):
                o.payback_low = o.price_low.amount * o.cards / net.amount
                o.payback_high = o.price_high.amount * o.cards / net.amount
            per_hour_net = cost[gpu].amount / gh - conv(kw * own.electricity_per_kwh).amount
            if per_hour_net > 0:
                o.breakeven_low, o.breakeven_high = (
                    p.amount / own.amortisation_months / (per_hour_net * WEEKS_PER_MONTH)
                    for p in (o.price_low, o.price_high)
                )
        out.append(o)
    return out


# --- rendering -----------------------------------------------------------------------------


def _env() -> Any:
    from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape

    return Environment(
        loader=FileSystemLoader(TEMPLATES),
        autoescape=select_autoescape(["html"], default_for_string=False, default=False),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def chart_png(r: Report) -> bytes:
    """Daily spend (bars), cumulative spend, the budget line and the forecast to period end."""
    from matplotlib.figure import Figure

    f = r.fmt
    days = [d for d, _ in r.daily]
    daily = [float(m.amount) for _, m in r.daily]
    today = r.now.astimezone(ZoneInfo(r.period.tz)).date()
    cumulative, run = [], 0.0
    for d, v in zip(days, daily, strict=True):
        run += v
        cumulative.append(run if d <= today else None)
    fig = Figure(figsize=(8, 3.6), dpi=100)
    ax = fig.add_subplot()
    x = list(range(1, len(days) + 1))
    ax.bar(x, daily, color="#4c72b0", label=f.t("daily"))
    ax.set_xlabel(f.t("axis_day"))
    ax.set_ylabel(r.currency)
    ax2 = ax.twinx()
    ax2.plot(
        [i for i, c in zip(x, cumulative, strict=True) if c is not None],
        [c for c in cumulative if c is not None],
        color="#222222",
        label=f.t("cumulative"),
    )
    if r.budget is not None:
        ax2.axhline(
            float(r.budget.amount.amount),
            color="#c44e52",
            linestyle="-",
            label=f"{f.t('budget_line')} {f.money(r.budget.amount)}",
        )
    if r.forecast is not None and today in days:
        i = days.index(today)
        ax2.plot(
            [x[i], x[-1]],
            [cumulative[i] or 0.0, float(r.forecast.amount)],
            color="#dd8452",
            linestyle="--",
            label=f"{f.t('forecast_line')} {f.money(r.forecast)}",
        )
    ax2.set_ylim(bottom=0)
    ax2.set_ylabel(f.t("cumulative"))
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax2.legend(handles=handles, loc="upper left", fontsize=8)
    ax.set_title(f"{r.title} — {r.period.label}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def html_page(r: Report) -> str:
    """A standalone HTML page (the chart inlined as a data: URL)."""
    return r.html("data:image/png;base64," + b64encode(r.chart()).decode())


# --- mail ----------------------------------------------------------------------------------


def message(
    app: App, r: Report, to: Iterable[str], alert: tuple[str, Decimal] | None = None
) -> EmailMessage:
    """Plain text, HTML with the chart inline, and the CSV attached."""
    return mail.compose(
        sender=app.settings.smtp.sender,
        to=list(to),
        subject=r.subject(alert),
        text=r.text(alert),
        html=r.html("cid:chart", alert),
        images={"chart": r.chart()},
        attachments=[
            (f"spend-{_slug(r.title)}-{r.period.label}.csv", r.csv().encode(), "text/csv")
        ],
    )


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in text).strip("-") or "all"


def email(app: App, r: Report, to: Iterable[str], alert: tuple[str, Decimal] | None = None) -> None:
    to = list(to)
    if not to:
        raise UserError("no recipients: give --to, or set budget.recipients in the policy")
    mail.send(app.settings.smtp, message(app, r, to, alert))


def for_budget(
    app: App,
    policy: Policy,
    now: datetime,
    period: Period | None = None,
    language: str | None = None,
) -> Report:
    """The report a budget's recipients get: the budget's scope and period."""
    assert policy.budget is not None
    period = period or budget.period_of(policy, now)
    if period is None:
        raise UserError(f"budget {policy.name}: its period is not running")
    return build(
        app,
        period,
        budget.scope_of(policy),
        title=policy.name,
        budget_policy=policy,
        language=language or policy.budget.language,
        now=now,
    )


def send_alert(app: App, st: budget.Status, kind: str, threshold: Decimal, now: datetime) -> None:
    """A threshold alert: the budget's report in the short template."""
    policy = st.policy
    r = for_budget(app, policy, now, st.period)
    email(app, r, policy.budget.recipients, alert=(kind, threshold))  # type: ignore[union-attr]


def due_time(cron: str, tz: str, now: datetime) -> datetime | None:
    """The latest time ``cron`` (read in ``tz``) fired at or before ``now``, if within grace."""
    from apscheduler.triggers.cron import CronTrigger

    trigger = CronTrigger.from_crontab(cron, timezone=ZoneInfo(tz))
    last = None
    t = trigger.get_next_fire_time(None, now - SCHEDULE_GRACE)
    while t is not None and t <= now:
        last = t
        t = trigger.get_next_fire_time(t, t + timedelta(seconds=1))
    return last


def run_scheduled(app: App, now: datetime | None = None) -> list[str]:
    """Send each policy's scheduled report once per due time (the scheduler calls this every
    few minutes). Returns what was sent, or why not."""
    now = now or app.clock.now()
    out = []
    for policy in app.policies:
        b = policy.budget
        if b is None or b.report is None or not b.recipients:
            continue
        due = due_time(b.report.cron, policy.timezone, now)
        period = budget.period_of(policy, now)
        if due is None or period is None:
            continue
        mark = due.astimezone(ZoneInfo("UTC")).isoformat(timespec="minutes")
        if ("report", mark) in budget.claimed(app, policy.name, period):
            continue

        def send(policy: Policy = policy, period: Period = period) -> None:
            r = for_budget(app, policy, now, period)
            email(app, r, policy.budget.recipients)  # type: ignore[union-attr]

        try:
            if budget.claim(app, policy.name, period, [("report", mark)], now, send):
                out.append(f"report {policy.name} due {mark}: sent to {', '.join(b.recipients)}")
        except mail.MailError as e:
            out.append(f"report {policy.name} due {mark}: not sent: {e}")
    return out
