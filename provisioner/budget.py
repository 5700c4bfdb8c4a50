"""Budgets from the policies' ``budget`` blocks: where each stands, and what a new machine would
add.

- :func:`status` — a budget's period, spend, commitments and forecast (reports and alerts show it).
- :func:`projections` — for ``plan``: each budget that applies to the experiment, with what the
  cheapest candidate would cost until the period ends (or its max lifetime does) against what is
  left. What is left counts the spend so far AND what live machines will still cost at their
  rates until the period ends: ten machines that each fit alone must not overspend together.
- :func:`guard` — for ``up``: refuse (exit 2) with the numbers when even the cheapest candidate
  does not fit; drop from failover the candidates that would not fit.

What the scheduler does when a budget is crossed (alerts, stops) is :mod:`provisioner.jobs.enforce`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from policies.schema import CustomPeriod, Policy
from provisioner import catalog, ledger
from provisioner.errors import UserError
from provisioner.ledger import Period, Scope
from provisioner.money import Amounts, Money, Rates, one_place

if TYPE_CHECKING:
    from provisioner.app import App
    from provisioner.planner import Candidate, Plan

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
    relaunches: Money  # what preempted machines being relaunched will add to the period's end
    forecast: Money  # spent + committed + relaunches
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
            "amount": self.amount.as_json(),
            "spent": self.spent.as_json(),
            "committed": self.committed.as_json(),
            "relaunches": self.relaunches.as_json(),
            "forecast": self.forecast.as_json(),
            "spent_percent": one_place(self.pct),
            "forecast_percent": one_place(self.forecast_pct),
            "left": self.left.as_json(),
            "on_exhausted": self.policy.budget.on_exhausted,  # type: ignore[union-attr]
            "rates": self.rates,
        }


def status(
    app: App,
    policy: Policy,
    now: datetime,
    *,
    period: Period | None = None,
    actual: Amounts | None = None,
) -> Status | None:
    """The budget's standing at ``now`` in ``period`` (default: the period running now)."""
    period = period or period_of(policy, now)
    if period is None:
        return None
    rates = app.settings.money_rates
    cur = policy.budget.amount.currency  # type: ignore[union-attr]
    with app.db.session(snapshot=True) as s:  # a launch between two reads counts once
        fc = ledger.forecast(s, period, now, scope_of(policy), actual=actual)
    seen = set(fc.total) | {cur}
    spent, committed, relaunches = (
        a.total(rates, cur).rounded() for a in (fc.actual, fc.committed, fc.relaunches)
    )
    return Status(
        policy=policy,
        period=period,
        amount=amount_of(policy),
        spent=spent,
        committed=committed,
        relaunches=relaunches,
        forecast=spent + committed + relaunches,  # the parts shown add up to it
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
            "projected_cost": c[1].as_json() if c else None,
            "fits": None if c is None else self.fits(c[1]),
        }


def _lifetime(policy: Policy, spec_lifetime: timedelta | None) -> timedelta | None:
    limits = [t for t in (spec_lifetime, policy.max_lifetime and policy.max_lifetime.after) if t]
    return min(limits) if limits else None


def candidate_cost(
    app: App,
    c: Candidate,
    disk_gb: int,
    hours: Decimal,
    currency: str,
    *,
    volume_gb: int = 0,
    volume_hours: Decimal = Decimal(0),
) -> Money:
    """Compute plus disk at the candidate's rates for ``hours``, and new volumes of
    ``volume_gb`` at the disk rate for ``volume_hours`` (they outlive the machine), in
    ``currency``."""
    per_gb_month, hours_per_month, _ = catalog.disk_price(
        app.settings, c.offer.cloud, c.price.currency
    )
    rate, cost = c.price.amount, Decimal(0)
    if per_gb_month is not None:
        rate += per_gb_month * disk_gb / hours_per_month
        if volume_gb:
            cost = per_gb_month * volume_gb / hours_per_month * volume_hours
    cost += rate * hours
    return app.settings.money_rates.convert(Money(cost, c.price.currency), currency)


def projections(
    app: App, plan: Plan, now: datetime | None = None, *, disk_gb: int | None = None
) -> list[Projection]:
    """One per budget that applies to the plan's experiment (none without budget policies).
    ``disk_gb`` overrides the experiment's disk (0: a machine whose disk already bills)."""
    now = now or app.clock.now()
    e = plan.experiment
    out = []
    for policy in budgets_for(app.policies, e.project, e.owner):
        st = status(app, policy, now)
        if st is None:
            continue
        until = st.period.end
        life = _lifetime(policy, e.lifecycle.max_lifetime)
        if life is not None:
            until = min(until, now + life)
        hours = ledger.hours(max(until - now, timedelta(0)))
        disk = e.resources.disk_gb if disk_gb is None else disk_gb
        # a new volume bills until it is removed: to the end of the period, whatever the
        # machine's lifetime
        volume_hours = ledger.hours(max(st.period.end - now, timedelta(0)))
        costs = [
            (
                c,
                candidate_cost(
                    app,
                    c,
                    disk,
                    hours,
                    st.amount.currency,
                    volume_gb=plan.new_volume_gb,
                    volume_hours=volume_hours,
                ),
            )
            for c in plan.candidates
        ]
        out.append(Projection(st, hours, costs))
    return out


def budgets_for(policies: list[Policy], project: str, owner: str) -> list[Policy]:
    """The budgets that apply to ``project`` and ``owner``: each policy's own, and its
    ``per_owner.budget`` as a policy of its own whose scope is this owner alone."""
    out = []
    for p in policies:
        if not p.applies_to.matches(project, owner):
            continue
        if p.budget is not None:
            out.append(p)
        if p.per_owner is not None and p.per_owner.budget is not None:
            alone = p.applies_to.model_copy(update={"owners": [_literal(owner)]})
            out.append(
                p.model_copy(
                    update={
                        "name": f"{p.name} (per owner {owner})",
                        "budget": p.per_owner.budget,
                        "applies_to": alone,
                    }
                )
            )
    return out


def _literal(text: str) -> str:
    """A glob matching ``text`` only (fnmatch has no escape character: brackets do it)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


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
