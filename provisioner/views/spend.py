"""A spend report as ``provisioner report`` and the dashboard's Spend page show it: the options
read the same way (:func:`report`), one report model (:func:`provisioner.reports.build`) whose
shown figures add up — the lines and the days to the total, by largest remainder
(:func:`provisioner.money.allocate`) — and ONE forecast per budget
(:attr:`provisioner.reports.Report.shown_forecast`, the budget's standing)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from provisioner import budget, ledger, reports
from provisioner.errors import UserError
from provisioner.money import Money

if TYPE_CHECKING:
    from policies.schema import Policy
    from provisioner.app import App
    from provisioner.render import Fmt

BY = reports.BY  # and label:KEY


@dataclass
class Query:
    """What to report: the options of ``provisioner report`` and the Spend page's query, read
    alike (the page with ``project=demo`` is ``report --project demo``).

    ``policy`` names the budget to compare with; the report then covers what that budget
    covers (its projects and owners, within the other filters), as the budget's own standing
    does — so ``report --policy P`` and the Spend page's ``budget=P`` total what P's budget
    counts. Without it, ``project``'s budget is compared with the project's spend."""

    period: str | None = None
    project: str | None = None
    owner: str | None = None
    cloud: str | None = None
    gpu: str | None = None
    by: str = "project"
    policy: str | None = None
    currency: str | None = None
    language: str | None = None
    compare: bool = False  # the previous period beside it

    @classmethod
    def of_page(cls, q: dict[str, str] | None, language: str) -> Query:
        """The Spend page's query string (``budget``, ``period``, ``by``, the filters; ``from``
        and ``to``, the picker's own days, are the period ``from..to``), with the previous
        period beside it."""
        q = q or {}
        return cls(
            period=page_period(q),
            project=q.get("project") or None,
            owner=q.get("owner") or None,
            cloud=q.get("cloud") or None,
            gpu=q.get("gpu") or None,
            by=q.get("by") or "project",
            policy=q.get("budget") or None,
            language=language,
            compare=True,
        )


def page_period(q: dict[str, str]) -> str | None:
    """The ``period`` a page's query asks for: the picker's ``from`` and ``to`` days as
    ``from..to`` (the words ``report --period`` reads), else ``period``."""
    first, last = (q.get(k, "").strip() for k in ("from", "to"))
    if first or last:
        if not (first and last):
            raise UserError("period: give both days, from and to")
        return f"{first}..{last}"
    return q.get("period") or None


@dataclass
class Day:
    day: date
    spent: Money  # shown: the days add up to the report's shown total


@dataclass
class Change:
    """One line (or the total) now and in the previous period, as each report shows it."""

    key: str
    now: Money
    before: Money

    @property
    def diff(self) -> Money:
        return self.now - self.before

    @property
    def pct(self) -> Decimal | None:
        """The change in per cent; None when there was nothing before (new, or nothing)."""
        if self.before.amount == 0:
            return None
        return self.diff.amount * 100 / self.before.amount

    def text(self, f: Fmt) -> str:
        """As people read it: ``+$12.00 (+25 %)``; ``new`` when there was nothing before."""
        if self.before.amount == 0:
            return f.t("new") if self.now.amount else "—"
        sign = "+" if self.diff.amount > 0 else ""
        return f"{sign}{f.money(self.diff)} ({sign}{f.pct(self.pct or Decimal(0))})"

    def as_json(self) -> dict[str, Any]:
        pct = self.pct
        return {
            "key": self.key,
            "total": self.before.as_json(),
            "change": self.diff.as_json(),
            "change_pct": None if pct is None else str(pct.quantize(Decimal("0.1"))),
            "new": self.before.amount == 0 and self.now.amount != 0,
        }


@dataclass
class Previous:
    """The same-length period just before, reported over the same scope by the same
    :func:`provisioner.reports.build`: its lines add up to its total."""

    report: reports.Report
    lines: list[Change]  # the report's lines, then those spent only before
    total: Change

    def line(self, key: str) -> Change | None:
        return next((c for c in self.lines if c.key == key), None)

    @property
    def only_before(self) -> list[Change]:
        """Lines with spend before and none now (the current report has no line for them)."""
        return [c for c in self.lines if c.now.amount == 0 and c.before.amount != 0]

    def as_json(self) -> dict[str, Any]:
        p = self.report.period
        return {
            "period": {"label": p.label, "start": p.start, "end": p.end, "timezone": p.tz},
            **{k: v for k, v in self.total.as_json().items() if k != "key"},
            "lines": [c.as_json() for c in self.lines],
        }


def previous(app: App, r: reports.Report) -> Previous | None:
    """``r``'s previous period beside it (None before the earliest date the ledger knows)."""
    try:
        period = r.period.previous()
    except ValueError:
        return None
    p = reports.build(
        app,
        period,
        r.scope,
        by=r.by,
        title=r.title,
        currency=r.currency,
        language=r.language,
        now=r.now,
    )
    zero = Money.zero(r.currency)
    before = {ln.key: ln.shown or zero for ln in p.lines}
    now = {ln.key: ln.shown or zero for ln in r.lines}
    keys = [ln.key for ln in r.lines] + [ln.key for ln in p.lines if ln.key not in now]
    lines = [Change(k, now.get(k, zero), before.get(k, zero)) for k in keys]
    return Previous(p, lines, Change("", r.shown_total, p.shown_total))


@dataclass
class ReportView:
    report: reports.Report
    policy: Policy | None  # the budget compared with
    previous: Previous | None = None  # asked for: the same-length period just before

    def as_json(self) -> dict[str, Any]:
        out = self.report.as_json()
        if self.previous is not None:
            out["previous"] = self.previous.as_json()
        return out

    @property
    def days(self) -> list[Day]:
        r = self.report
        return [Day(d, m) for (d, _), m in zip(r.daily, r.daily_shown, strict=True)]

    @property
    def forecast(self) -> Money | None:
        return self.report.shown_forecast

    @property
    def recipients(self) -> list[str]:
        """Whom the report is mailed to unless told: its budget's recipients."""
        return list(self.policy.budget.recipients) if self.policy and self.policy.budget else []


def budget_policies(app: App) -> list[Policy]:
    return [p for p in app.policies if p.budget is not None]


def choose_policy(app: App, q: Query) -> Policy | None:
    """The budget to compare with: ``q.policy`` by name; else the first policy with a budget
    that applies to the project (and owner) asked, naming projects more narrowly than '*' if
    one does."""
    policies = budget_policies(app)
    if q.policy:
        found = next((p for p in policies if p.name == q.policy), None)
        if found is None:
            raise UserError(f"no policy {q.policy!r} with a budget (see settings.policies)")
        return found
    if not q.project:
        return None
    return _covering(policies, q.project, q.owner or "*")


def _covering(policies: list[Policy], project: str, owner: str) -> Policy | None:
    """The first policy that applies to ``project`` and ``owner``, one naming projects more
    narrowly than '*' first."""
    covering = [p for p in policies if p.applies_to.matches(project, owner)]
    narrow = [p for p in covering if p.applies_to.projects != ["*"]]
    return next(iter(narrow or covering), None)


def report(app: App, q: Query, now: datetime | None = None) -> ReportView:
    """The report ``q`` asks for, up to ``now``: its period by default the budget's running
    one, else this month (in the budget's time zone, else UTC)."""
    reports.check_by(q.by)
    now = now or app.clock.now()
    policy = choose_policy(app, q)
    language = q.language or (policy.budget.language if policy and policy.budget else "en")
    r = reports.build(
        app,
        _period(q, policy, now),
        _scope(q, policy),
        by=q.by,
        title=policy.name if policy and (q.policy or not q.project) else q.project,
        budget_policy=policy,
        currency=q.currency,
        language=language,
        now=now,
    )
    return ReportView(r, policy, previous(app, r) if q.compare else None)


def _scope(q: Query, policy: Policy | None) -> ledger.Scope:
    """The machines ``q`` asks about; with a policy named, only those its budget covers."""
    return ledger.Scope(
        project=q.project,
        owner=q.owner,
        cloud=q.cloud,
        gpu=q.gpu and q.gpu.upper(),
        covers=policy.applies_to.matches if policy and q.policy else None,
    )


def _period(q: Query, policy: Policy | None, now: datetime) -> ledger.Period:
    tz = policy.timezone if policy else "UTC"
    try:
        if q.period:
            return ledger.Period.parse(q.period, tz)
    except ValueError as e:
        raise UserError(f"period: {e}") from None
    return (budget.period_of(policy, now) if policy else None) or ledger.Period.month(now, tz)


# --- the Spend page ---------------------------------------------------------------------------


@dataclass
class Choice:
    """A quick choice of the period picker: its words' key and the ``period`` it asks for
    (empty: the default, the budget's running period)."""

    key: str
    period: str
    on: bool = False  # the period shown


def choices(
    now: datetime, tz: str, shown: ledger.Period, budget_period: ledger.Period | None
) -> list[Choice]:
    """This budget period (with a budget: ``budget_period``), this and last month, the last 7
    and 30 days (today included), this quarter and year — the days in ``tz``, the report's
    zone."""
    today = now.astimezone(ZoneInfo(tz)).date()
    first = today.replace(day=1)
    last_month = (first - timedelta(days=1)).replace(day=1)
    q = (today.month - 1) // 3 * 3 + 1
    quarter_end = date(today.year + q // 10, (q + 2) % 12 + 1, 1) - timedelta(days=1)
    out = [Choice("dash_p_budget", "")] if budget_period else []
    out += [
        Choice("dash_p_month", f"{first:%Y-%m}"),
        Choice("dash_p_last_month", f"{last_month:%Y-%m}"),
        Choice("dash_p_7", f"{today - timedelta(days=6)}..{today}"),
        Choice("dash_p_30", f"{today - timedelta(days=29)}..{today}"),
        Choice("dash_p_quarter", f"{today.replace(month=q, day=1)}..{quarter_end}"),
        Choice("dash_p_year", f"{today.year}-01-01..{today.year}-12-31"),
    ]
    for c in out:
        p = ledger.Period.parse(c.period, tz) if c.period else budget_period
        c.on = p is not None and (p.start, p.end) == (shown.start, shown.end)
    if budget_period and out[0].on:  # the budget's period: one choice lit, not two
        for c in out[1:]:
            c.on = False
    return out


@dataclass
class Spend(ReportView):
    budgets: list[budget.Status] = field(default_factory=list)  # every budget's standing
    params: dict[str, str] = field(default_factory=dict)  # the query, to link with
    today: int | None = None  # today's index in the days; None: the period is over (-1: ahead)
    picks: list[Choice] = field(default_factory=list)  # the period picker's quick choices

    @property
    def days_so_far(self) -> list[Day]:
        """The days up to today (all of them once the period is over)."""
        return self.days if self.today is None else self.days[: self.today + 1]


def standings(app: App, now: datetime, report: reports.Report | None = None) -> list[budget.Status]:
    """Each budget's standing in its running period, as :func:`budget.status` gives it (its
    spend summed by the database). A ``report`` built at ``now`` lends its sums to the budgets
    it covers (its own; all of them over the same period) instead of a pass over the ledger
    each — and its own budget is the very standing it shows: one forecast per budget."""
    out = []
    same = report if report is not None and report.now == now else None
    for p in budget_policies(app):
        period = budget.period_of(p, now)
        if period is None:
            continue
        lent = _own(same, p, period)
        if lent is not None:
            out.append(lent)
            continue
        spent = None if same is None else same.spent_by(p, period)
        st = budget.status(app, p, now, period=period, actual=spent)
        if st is not None:
            out.append(st)
    return out


def _own(same: reports.Report | None, p: Policy, period: ledger.Period) -> budget.Status | None:
    """The standing of ``p``'s budget the report shows when it is ``p``'s own report over
    ``period``; else None."""
    lent = same.budget if same is not None else None
    return lent if lent is not None and lent.policy is p and lent.period == period else None


def spend(
    app: App,
    now: datetime,
    language: str,
    q: dict[str, str],
    budgets: Callable[[reports.Report], list[budget.Status]] | None = None,
) -> Spend:
    """The Spend page: the report ``provisioner report`` builds from the same options
    (``budget``: a policy name, its scope, period and standing), and every budget's standing
    (``budgets``: how to get them, e.g. cached; default :func:`standings`)."""
    v = report(app, Query.of_page(q, language), now)
    r = v.report
    shown = _own_standing(r, standings(app, now, r) if budgets is None else budgets(r))
    today = _today(r, now)
    default = _period(Query(), v.policy, now) if r.budget is not None else None
    picks = choices(now, r.period.tz, r.period, default)
    return Spend(r, v.policy, v.previous, shown, _params(q), today, picks)


def _own_standing(r: reports.Report, shown: list[budget.Status]) -> list[budget.Status]:
    """The standings shown, the report's own budget's replaced by the report's (its
    standing, not another reckoning)."""
    own = r.budget
    if own is None:
        return shown
    return [own if (st.policy, st.period) == (own.policy, own.period) else st for st in shown]


def _today(r: reports.Report, now: datetime) -> int | None:
    """Today's index among the report's days while its period runs; -1 before the period
    starts; None after it (or when today is not among its days)."""
    local_today = now.astimezone(ZoneInfo(r.period.tz)).date()
    days = [d for d, _ in r.daily]
    today = days.index(local_today) if local_today in days and now < r.period.end else None
    if today is None and now < r.period.start:
        today = -1
    return today


def _params(q: dict[str, str]) -> dict[str, str]:
    """The page's query options that are set (the period as the page reads it)."""
    params = {k: q.get(k, "") for k in ("budget", "by", "project", "owner", "cloud", "gpu")}
    params["period"] = page_period(q) or ""
    return {k: v for k, v in params.items() if v}
