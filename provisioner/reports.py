"""Spend reports: one model (:class:`Report`, made by :func:`build`) from sums the database
makes — spend by group and day, forecast, budget standing, top machines, idle waste, savings,
rent or buy — with every shown figure rounded so that tables add up.
:mod:`provisioner.render` writes it for people (text, HTML, chart, CSV, email).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import ROUND_HALF_UP, Decimal
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from provisioner import budget, efficiency, ledger
from provisioner.errors import UserError
from provisioner.ledger import Period, Scope
from provisioner.ledger.unpriced import Unpriced, unpriced
from provisioner.models import Machine
from provisioner.money import CENT, US_PER_HOUR, Amounts, Money, Rates, Tally, allocate
from provisioner.ownership import Ownership, rent_or_buy
from provisioner.schema import MachineStatus as S
from provisioner.schema import UsageKind

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from policies.schema import Policy
    from provisioner.app import App

TOP = 10
#: The languages a report is written in, each with the title of a report over every project.
ALL_PROJECTS = {"en": "all projects", "ru": "все проекты"}


@dataclass
class Line:
    key: str
    amounts: Amounts  # in the currencies billed
    total: Money  # converted to the report's currency
    by_kind: dict[str, Amounts] = field(default_factory=dict)
    # to the cent, shared out so that a table's lines add up to its total (see money.allocate)
    shown: Money | None = None
    shown_by_kind: dict[str, Money] = field(default_factory=dict)
    shown_billed: list[Money] = field(default_factory=list)


@dataclass
class MachineLine(Line):
    """A machine (by name: a relaunch under the same name is the same line) and its usage."""

    owner: str = ""
    gpu: str | None = None
    gpu_count: int = 0
    hours: Decimal = Decimal(0)  # compute hours in the period
    rates: list[Money] = field(default_factory=list)  # compute rates per hour, lowest first


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
    top_machines: list[MachineLine]  # the TOP most expensive
    idle_waste: Money
    savings: list[tuple[str, Money]]
    rent_or_buy: list[Ownership]
    conversion: Rates
    budget: budget.Status | None = None
    language: str = "en"
    daily_shown: list[Money] = field(default_factory=list)
    shown_by_kind: dict[str, Money] = field(default_factory=dict)  # the columns' sums
    # how many machines the top list leaves out, and their spend as shown
    other_machines: tuple[int, Money] | None = None
    scope: Scope = field(default_factory=Scope)
    # what the clouds bill that the ledger holds at no price (no cited rate): said beside totals
    unpriced: list[Unpriced] = field(default_factory=list)
    # microseconds per ((project, owner), currency, rate): what budgets over the same period
    # spent, without another pass over the ledger (see spent_by)
    pairs: Tally = field(default_factory=Tally, repr=False)
    answers: efficiency.Answers | None = None  # GPU efficiency, unusual spend (build sets it)

    def spent_by(self, policy: Policy, period: Period) -> Amounts | None:
        """What ``policy``'s budget spent in ``period`` up to this report's ``now``, from this
        report's sums when they cover it (the same period, every machine); else None."""
        if period != self.period or self.scope != Scope() or self.scope.covers is not None:
            return None
        spent = Tally()
        for (pair, c, rate), us in self.pairs.items():
            if policy.applies_to.matches(*pair):  # type: ignore[misc]
                spent.add((), c, rate, us)
        return spent.amounts().get((), Amounts())

    @property
    def shown_forecast(self) -> Money | None:
        """The forecast shown, in words, JSON and charts alike: the budget's when the report
        has one (its standing's, when in the report's currency), else the report's own — never
        two for one budget. None once the period is over."""
        b = self.budget
        if self.forecast is None or b is None or b.forecast.currency != self.currency:
            return self.forecast
        return b.forecast

    @property
    def shown_total(self) -> Money:
        return self.total.rounded()

    @property
    def billed_differs(self) -> bool:
        """Whether the amounts as billed say more than the total: another currency, or several."""
        monies = self.native.monies()
        return len(monies) > 1 or (len(monies) == 1 and monies[0].currency != self.currency)

    def as_json(self) -> dict[str, Any]:
        def money(m: Money | None) -> dict[str, str] | None:
            return None if m is None else m.rounded().as_json()  # shown figures: cents

        def line(ln: Line) -> dict[str, Any]:
            return {
                "key": ln.key,
                "total": money(ln.shown or ln.total),
                "billed": [money(m) for m in ln.shown_billed],
            }

        def machine(ln: MachineLine) -> dict[str, Any]:
            return {
                **line(ln),
                "owner": ln.owner,
                "gpu": ln.gpu,
                "gpu_count": ln.gpu_count,
                "hours": str(ln.hours.quantize(Decimal("0.01"))),
                "rates": [money(m) for m in ln.rates],
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
            "by_kind": {k: money(v) for k, v in self.shown_by_kind.items()},
            "forecast": money(self.shown_forecast),
            "budget": self.budget.as_json() if self.budget else None,
            "lines": [line(ln) for ln in self.lines],
            "top_machines": [machine(ln) for ln in self.top_machines],
            "daily": [
                {"day": d.isoformat(), **(money(m) or {})}
                for (d, _), m in zip(self.daily, self.daily_shown, strict=True)
            ],
            "idle_waste": money(self.idle_waste),
            "unpriced": [u.as_json() for u in self.unpriced],
            "savings": {r: money(m) for r, m in self.savings},
            "savings_method": ledger.SAVINGS_METHOD,
            **(self.answers.as_json() if self.answers else {}),
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


#: What the report asks the database to group usage by (plus the ``by`` of the report).
USAGE = ("machine", "owner", "gpu", "gpu_count", "kind", "project")


#: What a report can group by: these, a team (settings.teams, by owner) or ``label:KEY``.
BY = ("project", "owner", "cloud", "gpu", "machine", "team")


def check_by(by: str) -> str:
    """``by`` if a report can group by it, else a :class:`UserError` saying what can."""
    key = by.removeprefix(ledger.LABEL)
    if by in BY or (by.startswith(ledger.LABEL) and 0 < len(key) <= 128):
        return by
    raise UserError(f"by: use one of {', '.join(BY)} or label:KEY (not {by!r})")


def _fields(by: str) -> tuple[str, ...]:
    return USAGE if by in (*USAGE, "team") else (*USAGE, by)


def _add_idle_now(
    app: App, waste: Amounts, period: ledger.Period, now: datetime, scope: Scope
) -> None:
    """Add to ``waste`` what machines idle now have cost since they went idle (within the
    period): the idle time no stop has closed yet, which :func:`ledger.idle_waste` cannot see."""
    from datetime import timedelta

    from provisioner import idle

    with app.db.session() as s:
        q = select(Machine).where(Machine.status == S.RUNNING, Machine.rate.is_not(None))
        admits = scope.admitter()
        running = [m for m in s.scalars(q.where(*scope.clauses())) if admits(m.project, m.owner)]
    if not running:
        return
    thresholds = {m.id: idle.threshold(idle.idle_rules(app.policies, m))[0] for m in running}
    grace = timedelta(seconds=app.settings.scheduler.heartbeat_grace_seconds)
    found = idle.idle_now(app, now, thresholds, grace)
    to = period.clip(now)
    for m in running:
        if m.id in found and m.rate is not None and m.currency:
            lo = max(found[m.id].since, period.start)
            if to > lo:
                waste.add(m.currency, m.rate * ledger.hours(to - lo))


@dataclass
class _Sums:
    """What the database adds up (usage per machine and kind, per day) and the event queries
    find, in billed currencies."""

    usage: Tally  # keyed by _fields(by)
    days: Tally  # keyed by (day,)
    native: Amounts
    pairs: Tally  # keyed by (project, owner)
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
    """The report of ``scope`` over ``period`` up to ``now``: the public entry point (the CLI,
    mail and the dashboard build theirs here). The database clamps the intervals to the period
    and groups them (:func:`ledger.tally`, :func:`ledger.day_tally`); Python prices the groups.
    With ``budget_policy``, the budget's own status (over the budget's whole scope) is shown."""
    check_by(by)
    if language not in ALL_PROJECTS:
        raise UserError(f"unknown language {language!r}; use {', '.join(ALL_PROJECTS)}")
    now = now or app.clock.now()
    currency = _currency(app, currency, budget_policy)
    with app.db.session() as s:
        if scope.project is not None:
            _known_project(s, app, scope.project)
        sums = _sums(s, period, now, scope, by, _savings_bound(app))
        held_free = unpriced(s, period, now, scope)
    _add_idle_now(app, sums.waste, period, now, scope)
    st = _own_budget(app, budget_policy, period, now, scope, sums.native)
    try:  # conversion fails on a currency without a rate: say which
        r = _assemble(
            app,
            period,
            now,
            sums,
            st,
            currency=currency,
            by=by,
            title=title or ALL_PROJECTS[language],
            language=language,
            scope=scope,
        )
    except ValueError as e:
        raise UserError(str(e)) from None
    r.unpriced = held_free
    r.answers = efficiency.answers(app, period, now, scope, currency)
    return r


def _currency(app: App, currency: str | None, budget_policy: Policy | None) -> str:
    """The report's currency: the one asked, else the budget's, else the settings'."""
    if budget_policy is not None and budget_policy.budget is not None:
        currency = currency or budget_policy.budget.amount.currency
    return (currency or app.settings.currency).upper()


def _savings_bound(app: App) -> ledger.Bound:
    """Where a scheduled stop's saving ends (:data:`ledger.SAVINGS_METHOD`), by the policies
    of the machine's project and owner: an off-hours stop, when working hours begin again; a
    stop within hours, when off-hours would have stopped it anyway; each at most 12 h on."""
    from policies.calendar import Calendar
    from policies.schema import matching

    calendars: dict[tuple[str, str], Calendar | None] = {}

    def bound(project: str, owner: str, at: datetime) -> datetime:
        if (project, owner) not in calendars:
            found = (p.off_hours for p in matching(app.policies, project, owner) if p.off_hours)
            calendars[(project, owner)] = next((Calendar(oh) for oh in found), None)
        cal, horizon = calendars[(project, owner)], at + ledger.SAVINGS_HORIZON
        if cal is None:
            return horizon
        if cal.is_off(at):  # someone is back when the working hours begin
            return cal.next_on(at) or horizon
        return min(horizon, cal.next_off(at) or horizon)

    return bound


def _sums(
    s: Session, period: Period, now: datetime, scope: Scope, by: str, bound: ledger.Bound
) -> _Sums:
    """What the database sums for the report up to ``now``: usage by ``by``'s fields and by
    day, the sums over every machine and per (project, owner) priced once per rate, the
    forecast, savings and idle waste."""
    to = period.clip(now)
    usage = ledger.tally(s, period.start, to, _fields(by), scope)
    days = ledger.day_tally(s, period.start, to, period.days(), (), scope, tz=period.tz)
    everything, pairs = Tally(), Tally()
    for (key, c, rate), us in usage.items():
        everything.add((), c, rate, us)
        pairs.add((key[5], key[1]), c, rate, us)  # type: ignore[index]
    native = everything.amounts().get((), Amounts())
    return _Sums(
        usage,
        days,
        native,
        pairs,
        ledger.forecast(s, period, now, scope, actual=native),
        ledger.savings(s, period, now, scope, bound),
        ledger.idle_waste(s, period, now, scope),
    )


def _own_budget(
    app: App,
    budget_policy: Policy | None,
    period: Period,
    now: datetime,
    scope: Scope,
    native: Amounts,
) -> budget.Status | None:
    """The standing of ``budget_policy``'s budget, if any; over the budget's own scope the
    report's sums are the budget's: no second pass."""
    if budget_policy is None or budget_policy.budget is None:
        return None
    own = scope == Scope() and scope.covers == budget_policy.applies_to.matches
    return budget.status(app, budget_policy, now, period=period, actual=native if own else None)


def _known_project(s: Session, app: App, project: str) -> None:
    """A project (or glob) that no machine and no policy names is a typo, not a zero."""
    projects = set(s.scalars(select(Machine.project).distinct()))
    for p in app.policies:
        projects.update(x for x in p.applies_to.projects if x != "*")
    if not any(fnmatchcase(x, project) for x in projects):
        known = ", ".join(sorted(projects)[:10]) or "none yet"
        raise UserError(f"no project {project!r} (projects: {known})")


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
    scope: Scope,
) -> Report:
    rates, cur = app.settings.money_rates, currency
    group_kind, per, gpus = _tallies(app, sums.usage, by)
    lines, kinds = _lines(group_kind, rates, cur)
    order, top = _top(sums.usage, per, rates, cur)
    seen = set(sums.native) | set(sums.forecast.total) | {cur}
    if st is not None:
        seen.add(st.amount.currency)
    days = sums.days.amounts()
    r = Report(
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
        daily=[(d, days.get((d,), Amounts()).total(rates, cur)) for d in period.days()],
        forecast=sums.forecast.total.total(rates, cur) if now < period.end else None,
        top_machines=top,
        idle_waste=sums.waste.total(rates, cur),
        savings=sorted(
            ((r, a.total(rates, cur)) for r, a in sums.saved.items()),
            key=lambda rm: -rm[1].amount,
        ),
        rent_or_buy=rent_or_buy(
            app, gpus, ledger.hours(period.clip(now) - period.start), rates, cur
        ),
        conversion=rates,
        budget=st,
        language=language,
        scope=scope,
        pairs=sums.pairs,
    )
    _round(r)
    _round_machines(r, [amount for amount, _ in order], [per[name] for _, name in order])
    return r


def _top(
    usage: Tally, per: dict[str, Amounts], rates: Rates, cur: str
) -> tuple[list[tuple[Decimal, str]], list[MachineLine]]:
    """Every machine's total (largest first, then by name), but lines only for the top ones:
    a fleet is 20,000 machines."""
    order = sorted(
        ((a.total(rates, cur).amount, name) for name, a in per.items()),
        key=lambda tn: (-tn[0], tn[1]),
    )
    info = _machine_info(usage, {name for _, name in order[:TOP]})
    top = [
        MachineLine(name, per[name], Money(amount, cur), **info[name])
        for amount, name in order[:TOP]
    ]
    return order, top


def _tallies(app: App, usage: Tally, by: str) -> tuple[Tally, dict[str, Amounts], Tally]:
    """The usage summed by (group, kind), by machine, and by (GPU, cards) of compute."""
    at_by = _fields(by).index("owner" if by == "team" else by)
    team = app.settings.team_of() if by == "team" else None
    group_kind, per_machine, gpus = Tally(), Tally(), Tally()
    for (key, c, rate), us in usage.items():
        name, owner, gpu, count, kind = key[:5]  # type: ignore[index]
        group = team(owner) if team else key[at_by]  # type: ignore[index]
        group_kind.add((group or "—", kind), c, rate, us)
        per_machine.add(name, c, rate, us)
        if kind == UsageKind.COMPUTE and gpu:
            gpus.add((gpu, count or 1), c, rate, us)
    return group_kind, per_machine.amounts(), gpus  # the machines' Tally dropped


def _lines(group_kind: Tally, rates: Rates, cur: str) -> tuple[dict[str, Line], dict[str, Amounts]]:
    """The report's lines by group (kinds, total in ``cur``), and the amounts of each kind."""
    lines: dict[str, Line] = {}
    kinds: dict[str, Amounts] = {}
    for (key, kind), amounts in group_kind.amounts().items():
        ln = lines.setdefault(key, Line(key, Amounts(), Money.zero(cur)))
        ln.by_kind[kind] = amounts
        ln.amounts.merge(amounts)
        kinds.setdefault(kind, Amounts()).merge(amounts)
    for ln in lines.values():
        ln.total = ln.amounts.total(rates, cur)
    return lines, kinds


def _machine_info(usage: Tally, names: set[str]) -> dict[str, dict[str, Any]]:
    """Who, which GPUs, how many cards, compute hours and rates of these machines (by name).
    Asked only for the top machines: kept for every machine it was most of a report's memory."""
    found: dict[str, tuple[set[str], set[str], list[int], set[tuple[str, str]]]] = {}
    for (key, c, rate), us in usage.items():
        name, owner, gpu, count, kind = key[:5]  # type: ignore[index]
        if name not in names:
            continue
        owners, gpu_names, counts, machine_rates = found.setdefault(
            name, (set(), set(), [0, 0], set())
        )
        owners.add(owner)
        if gpu:
            gpu_names.add(gpu)
        if kind == UsageKind.COMPUTE:
            counts[0] = max(counts[0], count or (1 if gpu else 0))
            counts[1] += us
            machine_rates.add((c, rate))
    # a name reused by another owner or GPU shows both, in one order whatever the query's
    return {
        name: {
            "owner": ", ".join(sorted(owners)),
            "gpu": ", ".join(sorted(gpu_names)) or None,
            "gpu_count": cards,
            "hours": Decimal(us) / US_PER_HOUR,
            "rates": sorted(Money(Decimal(r), c) for c, r in machine_rates),
        }
        for name, (owners, gpu_names, (cards, us), machine_rates) in found.items()
    }


def _round_machines(r: Report, totals: list[Decimal], billed: list[Amounts]) -> None:
    """The machines share out the rounded total (and each currency billed its own) like the
    lines; those after the top ones are shown as one sum."""
    shown = allocate(totals, r.shown_total.amount)
    for m, amount in zip(r.top_machines, shown, strict=False):
        m.shown = Money(amount, r.currency)
    for c, native in sorted(r.native.items()):
        parts = allocate(
            [a.get(c, Decimal(0)) for a in billed], native.quantize(CENT, ROUND_HALF_UP)
        )
        for m, amount in zip(r.top_machines, parts, strict=False):
            if c in m.amounts:
                m.shown_billed.append(Money(amount, c))
    if len(totals) > TOP:
        r.other_machines = len(totals) - TOP, Money(sum(shown[TOP:], Decimal(0)), r.currency)


def _round_line(r: Report, ln: Line, amount: Decimal) -> None:
    """A line's share of the rounded total (``amount``), shared out among its kinds."""
    ln.shown = Money(amount, r.currency)
    kinds = sorted(ln.by_kind)
    converted = [ln.by_kind[k].total(r.conversion, r.currency).amount for k in kinds]
    ln.shown_by_kind = {
        k: Money(a, r.currency) for k, a in zip(kinds, allocate(converted, amount), strict=True)
    }


def _round_billed(r: Report) -> None:
    """Each currency billed shares out its rounded total among the lines that billed it."""
    for c, billed in sorted(r.native.items()):
        parts = [ln.amounts.get(c, Decimal(0)) for ln in r.lines]
        for ln, a in zip(
            r.lines, allocate(parts, billed.quantize(CENT, ROUND_HALF_UP)), strict=True
        ):
            if c in ln.amounts:
                ln.shown_billed.append(Money(a, c))


def _round(r: Report) -> None:
    """Shown figures to the cent that add up: the lines (and the days) share out the rounded
    total, each currency billed its rounded total; each line's kinds share out the line, and
    the kinds' totals are their columns' sums."""
    total = r.shown_total.amount
    for ln, amount in zip(
        r.lines, allocate([ln.total.amount for ln in r.lines], total), strict=True
    ):
        _round_line(r, ln, amount)
    _round_billed(r)
    r.shown_by_kind = {
        k: sum(
            (ln.shown_by_kind.get(k, Money.zero(r.currency)) for ln in r.lines),
            Money.zero(r.currency),
        )
        for k in r.by_kind
    }
    r.daily_shown = [Money(a, r.currency) for a in allocate([m.amount for _, m in r.daily], total)]


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
