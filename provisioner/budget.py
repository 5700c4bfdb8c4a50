"""Budgets from the policies' ``budget`` blocks: where each stands, what a new machine would add,
and what to do when one is crossed.

- :func:`projections` — for ``plan``: each budget that applies to the experiment, with what the
  cheapest candidate would cost until the period ends (or its max lifetime does) against what is
  left. What is left counts the spend so far AND what live machines will still cost at their
  rates until the period ends: ten machines that each fit alone must not overspend together.
- :func:`guard` — for ``up``: refuse (exit 2) with the numbers when even the cheapest candidate
  does not fit; drop from failover the candidates that would not fit.
- :func:`enforce` — for the scheduler: alerts at each threshold once per period (actual spend and
  forecast), and on an exhausted budget stop or terminate the machines in scope if the policy
  says so (events with reason ``budget``).

Each alert, exhaustion and scheduled report is a row in ``budget_notices``, unique per policy,
period and mark: claiming the row and sending the mail happen in one transaction, so a mail is
sent once, or again only if the process died between the send and the commit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from policies.schema import CustomPeriod, Policy
from provisioner import catalog, ledger
from provisioner.errors import OperationFailed, UserError
from provisioner.ledger import Period, Scope
from provisioner.models import Machine, Notice
from provisioner.money import Money, Rates

if TYPE_CHECKING:
    from provisioner.app import App
    from provisioner.planner import Candidate, Plan

REASON = "budget"
HUNDRED = Decimal(100)


def period_of(policy: Policy, now: datetime) -> Period | None:
    """The budget period containing ``now`` in the policy's timezone; None when a one-off
    period is not running."""
    b = policy.budget
    if b is None:
        return None
    tz = policy.timezone
    if isinstance(b.period, CustomPeriod):
        p = Period.between(b.period.start, b.period.end, tz)
        return p if p.start <= now < p.end else None
    return Period.week(now, tz) if b.period == "week" else Period.month(now, tz)


def scope_of(policy: Policy) -> Scope:
    return Scope(covers=policy.applies_to.matches)


def amount_of(policy: Policy) -> Money:
    a = policy.budget.amount  # type: ignore[union-attr]
    return Money(a.amount, a.currency)


def percent(part: Money, whole: Money) -> Decimal:
    return part.amount * HUNDRED / whole.amount


@dataclass
class Status:
    """Where one budget stands, in its own currency."""

    policy: Policy
    period: Period
    amount: Money
    spent: Money
    committed: Money  # live machines until the period ends, at their rates
    forecast: Money  # spent + committed + the trend of the period's other usage
    rates: str

    @property
    def pct(self) -> Decimal:
        return percent(self.spent, self.amount)

    @property
    def forecast_pct(self) -> Decimal:
        return percent(self.forecast, self.amount)

    @property
    def left(self) -> Money:
        """What new machines may still spend: the budget less spend and commitments."""
        return self.amount - self.spent - self.committed

    @property
    def exhausted(self) -> bool:
        return self.spent >= self.amount

    def as_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name,
            "period": self.period.label,
            "budget": _money_json(self.amount),
            "spent": _money_json(self.spent),
            "committed": _money_json(self.committed),
            "forecast": _money_json(self.forecast),
            "percent": str(self.pct.quantize(Decimal("0.1"))),
            "forecast_percent": str(self.forecast_pct.quantize(Decimal("0.1"))),
            "left": _money_json(self.left),
            "on_exhausted": self.policy.budget.on_exhausted,  # type: ignore[union-attr]
            "rates": self.rates,
        }


def _money_json(m: Money) -> dict[str, str]:
    return {"amount": str(m.rounded().amount), "currency": m.currency}


def status(
    app: App,
    policy: Policy,
    now: datetime,
    *,
    period: Period | None = None,
    actual: ledger.Amounts | None = None,
) -> Status | None:
    """The budget's standing at ``now`` in ``period`` (default: the period running now)."""
    period = period or period_of(policy, now)
    if period is None:
        return None
    rates = app.settings.money_rates
    cur = policy.budget.amount.currency  # type: ignore[union-attr]
    with app.db.session() as s:
        fc = ledger.forecast(s, period, now, scope_of(policy), actual=actual)
    seen = set(fc.total) | {cur}
    return Status(
        policy=policy,
        period=period,
        amount=amount_of(policy),
        spent=fc.actual.total(rates, cur),
        committed=fc.run_rate.total(rates, cur),
        forecast=fc.total.total(rates, cur),
        rates=describe_rates(rates, seen),
    )


def describe_rates(rates: Rates, currencies: Iterable[str]) -> str:
    """The conversion rates that matter for these currencies (shown wherever we convert)."""
    used = {c for c in currencies if c != rates.base}
    return ", ".join(
        f"1 {rates.base} = {rates.per_base[c]} {c}" for c in sorted(used) if c in rates.per_base
    )


# --- plan and up ---------------------------------------------------------------------------


@dataclass
class Projection:
    """A budget against what a new machine would cost until the period (or its life) ends."""

    status: Status
    hours: Decimal  # how long the new machine would bill within the period
    costs: list[tuple[Candidate, Money]] = field(default_factory=list)  # in plan order

    @property
    def cheapest(self) -> tuple[Candidate, Money] | None:
        return min(self.costs, key=lambda cc: cc[1].amount) if self.costs else None

    def fits(self, cost: Money) -> bool:
        return cost.amount <= self.status.left.amount

    @property
    def over(self) -> bool:
        c = self.cheapest
        return c is not None and not self.fits(c[1])

    def __str__(self) -> str:
        st = self.status
        head = (
            f"budget {st.policy.name} ({st.period.label}): {st.amount}; spent {st.spent}, "
            f"live machines commit {st.committed} more, {st.left} left"
        )
        c = self.cheapest
        if c is None:
            return head
        cand, cost = c
        verdict = "fits" if self.fits(cost) else f"OVER by {cost - st.left}"
        rates = f" ({st.rates})" if st.rates else ""
        return (
            f"{head}; {cand.where} {cand.offer.instance_type} {cand.market} for "
            f"{self.hours:.1f} h would cost {cost} → {verdict}{rates}"
        )

    def as_json(self) -> dict[str, Any]:
        c = self.cheapest
        return {
            "check": "budget",
            **self.status.as_json(),
            "hours": str(self.hours.quantize(Decimal("0.01"))),
            "projected_cost": _money_json(c[1]) if c else None,
            "fits": None if c is None else self.fits(c[1]),
        }


def _lifetime(policy: Policy, spec_lifetime: timedelta | None) -> timedelta | None:
    limits = [t for t in (spec_lifetime, policy.max_lifetime and policy.max_lifetime.after) if t]
    return min(limits) if limits else None


def candidate_cost(app: App, c: Candidate, disk_gb: int, hours: Decimal, currency: str) -> Money:
    """Compute plus disk at the candidate's rates for ``hours``, in ``currency``."""
    per_gb_month, hours_per_month, _ = catalog.disk_price(
        app.settings, c.offer.cloud, c.price.currency
    )
    rate = c.price.amount
    if per_gb_month is not None:
        rate += per_gb_month * disk_gb / hours_per_month
    return app.settings.money_rates.convert(Money(rate * hours, c.price.currency), currency)


def projections(app: App, plan: Plan, now: datetime | None = None) -> list[Projection]:
    """One per budget that applies to the plan's experiment (none without budget policies)."""
    now = now or app.clock.now()
    e = plan.experiment
    out = []
    for policy in app.policies:
        if policy.budget is None or not policy.applies_to.matches(e.project, e.owner):
            continue
        st = status(app, policy, now)
        if st is None:
            continue
        until = st.period.end
        life = _lifetime(policy, e.lifecycle.max_lifetime)
        if life is not None:
            until = min(until, now + life)
        hours = ledger.hours(max(until - now, timedelta(0)))
        costs = [
            (c, candidate_cost(app, c, e.resources.disk_gb, hours, st.amount.currency))
            for c in plan.candidates
        ]
        out.append(Projection(st, hours, costs))
    return out


def guard(plan: Plan) -> Plan:
    """Refuse when the cheapest candidate would overspend a budget; otherwise keep for failover
    only the candidates every budget can afford."""
    projs = [c for c in plan.checks if isinstance(c, Projection)]
    for p in projs:
        if p.over:
            st = p.status
            cand, cost = p.cheapest  # type: ignore[misc]
            raise UserError(
                f"refused by budget {st.policy.name} ({st.period.label}): {st.amount} budget, "
                f"{st.spent} spent, {st.committed} committed by live machines, {st.left} left; "
                f"the cheapest offer ({cand.where} {cand.offer.instance_type} {cand.market}) "
                f"would cost {cost} over {p.hours:.1f} h" + (f" ({st.rates})" if st.rates else "")
            )
    if projs:
        keep = [  # each projection's costs are in the plan's candidate order
            c for i, c in enumerate(plan.candidates) if all(p.fits(p.costs[i][1]) for p in projs)
        ]
        dropped = len(plan.candidates) - len(keep)
        if dropped:
            plan.rejected["over the budget left"] += dropped
        plan.candidates = keep
    return plan


# --- enforcement (the scheduler's budget job) ----------------------------------------------


@dataclass
class Action:
    kind: str  # alert | exhausted | stop | terminate
    policy: str
    detail: str
    machine: str | None = None
    mailed: bool = False
    error: str | None = None

    def __str__(self) -> str:
        what = f"{self.kind} {self.machine}" if self.machine else self.kind
        extra = f" (failed: {self.error})" if self.error else ""
        return f"budget {self.policy}: {what}: {self.detail}{extra}"


def claimed(app: App, policy: str, period: Period) -> set[tuple[str, str]]:
    with app.db.session() as s:
        return {
            (n.kind, n.mark)
            for n in s.scalars(
                select(Notice).where(Notice.policy == policy, Notice.period_start == period.start)
            )
        }


def claim(
    app: App,
    policy: str,
    period: Period,
    marks: list[tuple[str, str]],
    now: datetime,
    send: Callable[[], None] | None,
    detail: dict[str, Any] | None = None,
) -> bool:
    """Record ``marks`` (kind, mark) and call ``send`` in one transaction: False when another
    run recorded them first; a failing send records nothing (the next run tries again)."""
    try:
        with app.db.session() as s:
            for kind, mark in marks:
                s.add(
                    Notice(
                        policy=policy,
                        kind=kind,
                        period_start=period.start,
                        mark=mark,
                        at=now,
                        detail=detail or {},
                    )
                )
            s.flush()
            if send is not None:
                send()
        return True
    except IntegrityError:
        return False


def _mark(t: Decimal) -> str:
    return str(t.normalize()) if t == t.to_integral() else str(t)


def enforce(app: App, now: datetime | None = None) -> list[Action]:
    """Alerts once per threshold and period; on exhaustion stop/terminate per policy."""
    from provisioner import reports

    now = now or app.clock.now()
    actions: list[Action] = []
    for policy in app.policies:
        st = status(app, policy, now) if policy.budget else None
        if st is None:
            continue
        b = policy.budget
        assert b is not None
        done = claimed(app, policy.name, st.period)
        for kind, thresholds, value in (
            ("actual", b.alerts.actual, st.pct),
            ("forecast", b.alerts.forecast, st.forecast_pct),
        ):
            new = [t for t in thresholds if value >= t and (kind, _mark(t)) not in done]
            if not new:
                continue
            top = max(new)
            a = Action(
                "alert",
                policy.name,
                f"{kind} {st.pct if kind == 'actual' else st.forecast_pct:.0f} % "
                f"(threshold {_mark(top)} %)",
            )
            send = None
            if b.recipients:

                def send(st: Status = st, kind: str = kind, top: Decimal = top) -> None:
                    reports.send_alert(app, st, kind, top, now)

                a.mailed = True
            try:
                if not claim(
                    app,
                    policy.name,
                    st.period,
                    [(kind, _mark(t)) for t in new],
                    now,
                    send,
                    {"percent": str(value)},
                ):
                    continue
            except OperationFailed as e:
                a.mailed, a.error = False, str(e)
            actions.append(a)
        if not st.exhausted:
            continue
        if ("exhausted", "100") not in done and claim(
            app,
            policy.name,
            st.period,
            [("exhausted", "100")],
            now,
            None,
            {"spent": str(st.spent.amount), "currency": st.spent.currency},
        ):
            actions.append(
                Action("exhausted", policy.name, f"{st.spent} of {st.amount}; launches blocked")
            )
        if b.on_exhausted in ("stop", "terminate"):
            actions += _stop_in_scope(app, policy, b.on_exhausted, st)
    return actions


def _stop_in_scope(app: App, policy: Policy, how: str, st: Status) -> list[Action]:
    from provisioner import lifecycle

    statuses = (
        ("pending", "running") if how == "stop" else ("pending", "running", "stopped", "preempted")
    )
    with app.db.session() as s:
        names = [
            m.name
            for m in s.scalars(select(Machine).where(Machine.status.in_(statuses)))
            if policy.applies_to.matches(m.project, m.owner)
        ]
    out = []
    for name in names:
        a = Action(how, policy.name, f"budget exhausted: {st.spent} of {st.amount}", name)
        try:
            (lifecycle.stop if how == "stop" else lifecycle.down)(app, name, reason=REASON)
        except OperationFailed as e:
            a.error = str(e)
        out.append(a)
    return out
