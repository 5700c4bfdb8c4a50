"""Spend reports: one model (:class:`Report`) built in one streaming pass over the ledger — spend
by group and day, forecast, budget standing, top machines, idle waste, savings, rent or buy.
:mod:`provisioner.render` writes it for people (text, HTML, chart, CSV, email).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from provisioner import budget, ledger
from provisioner.errors import UserError
from provisioner.ledger import Amounts, Period, Scope, Tally
from provisioner.money import Money, Rates

if TYPE_CHECKING:
    from policies.schema import Policy
    from provisioner.app import App

HOURS_PER_MONTH = Decimal(730)  # 8760 / 12, the clouds' own convention
WEEKS_PER_MONTH = Decimal(52) / Decimal(12)
TOP = 10
#: The languages a report is written in, each with the title of a report over every project.
ALL_PROJECTS = {"en": "all projects", "ru": "все проекты"}


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


def _q(d: Decimal | None) -> str | None:
    return None if d is None else str(d.quantize(Decimal("0.1")))


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
    if language not in ALL_PROJECTS:
        raise UserError(f"unknown language {language!r}; use {', '.join(ALL_PROJECTS)}")
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
            title=title or ALL_PROJECTS[language],
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
