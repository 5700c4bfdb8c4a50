"""A spend report as ``provisioner report`` and the dashboard's Spend page show it: the options
read the same way (:func:`report`), one report model (:func:`provisioner.reports.build`) whose
shown figures add up — the lines and the days to the total, by largest remainder
(:func:`provisioner.money.allocate`) — and ONE forecast per budget
(:attr:`provisioner.reports.Report.shown_forecast`, the budget's standing)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import TYPE_CHECKING
from zoneinfo import ZoneInfo

from provisioner import budget, ledger, reports
from provisioner.errors import UserError
from provisioner.money import Money

if TYPE_CHECKING:
    from policies.schema import Policy
    from provisioner.app import App

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

    @classmethod
    def of_page(cls, q: dict[str, str] | None, language: str) -> Query:
        """The Spend page's query string (``budget``, ``period``, ``by``, the filters)."""
        q = q or {}
        return cls(
            period=q.get("period") or None,
            project=q.get("project") or None,
            owner=q.get("owner") or None,
            cloud=q.get("cloud") or None,
            gpu=q.get("gpu") or None,
            by=q.get("by") or "project",
            policy=q.get("budget") or None,
            language=language,
        )


@dataclass
class Day:
    day: date
    spent: Money  # shown: the days add up to the report's shown total


@dataclass
class ReportView:
    report: reports.Report
    policy: Policy | None  # the budget compared with

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
    covering = [p for p in policies if p.applies_to.matches(q.project, q.owner or "*")]
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
        ledger.Scope(
            project=q.project,
            owner=q.owner,
            cloud=q.cloud,
            gpu=q.gpu and q.gpu.upper(),
            covers=policy.applies_to.matches if policy and q.policy else None,
        ),
        by=q.by,
        title=policy.name if policy and (q.policy or not q.project) else q.project,
        budget_policy=policy,
        currency=q.currency,
        language=language,
        now=now,
    )
    return ReportView(r, policy)


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
class Spend(ReportView):
    budgets: list[budget.Status] = field(default_factory=list)  # every budget's standing
    params: dict[str, str] = field(default_factory=dict)  # the query, to link with
    today: int | None = None  # today's index in the days; None: the period is over (-1: ahead)

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
        lent = same.budget if same is not None else None
        if lent is not None and lent.policy is p and lent.period == period:  # its own report
            out.append(lent)
            continue
        spent = None if same is None else same.spent_by(p, period)
        st = budget.status(app, p, now, period=period, actual=spent)
        if st is not None:
            out.append(st)
    return out


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
    shown = standings(app, now, r) if budgets is None else budgets(r)
    if r.budget is not None:  # the report's own budget: its standing, not another reckoning
        own = r.budget
        shown = [own if (st.policy, st.period) == (own.policy, own.period) else st for st in shown]
    local_today = now.astimezone(ZoneInfo(r.period.tz)).date()
    days = [d for d, _ in r.daily]
    today = days.index(local_today) if local_today in days and now < r.period.end else None
    if today is None and now < r.period.start:
        today = -1
    params = {
        k: q.get(k, "") for k in ("budget", "period", "by", "project", "owner", "cloud", "gpu")
    }
    return Spend(r, v.policy, shown, {k: v for k, v in params.items() if v}, today)
