"""What a team lead looks at first, made once for ``provisioner status --summary`` and the top of
the dashboard's fleet page: money burning now, the machines by state, every budget's standing,
and the machines idle now with what they waste."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import TYPE_CHECKING, Any

from provisioner.money import Amounts, Money, one_place
from provisioner.schema import MachineStatus as S

if TYPE_CHECKING:
    from provisioner.app import App
    from provisioner.budget import Status
    from provisioner.models import Machine

#: The counts, in the order shown. ``idle`` is of the running ones; ``held``: preempted machines
#: whose relaunch was refused or given up (the rest of the preempted are being relaunched).
COUNTS = ("running", "idle", "stopped", "preempted", "held", "waiting")
HOUR = timedelta(hours=1)
RATE_STEP = Decimal("0.01")  # what burns per hour: to the cent, as `status --summary` says it


@dataclass
class IdleMachine:
    machine: Machine
    since: datetime
    rate: Money  # its compute per hour: what stopping it saves (its disk bills either way)
    wasted: Money  # at that rate since ``since``

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.machine.name,
            "project": self.machine.project,
            "owner": self.machine.owner,
            "since": self.since.isoformat(),
            "rate_per_hour": self.rate.as_json(),
            "wasted": self.wasted.as_json(),
        }


@dataclass
class Summary:
    at: datetime
    burning: list[Money]  # per hour, per currency: compute of running machines, every disk
    burning_total: Money  # the same in the settings' currency
    counts: dict[str, int]
    budgets: list[Status]
    idle: list[IdleMachine]  # most wasteful per hour first
    #: each machine's count it is in (by id; idle ones are also ``running``): the fleet's
    #: ``state=`` filter
    state_of: dict[str, str] = field(default_factory=dict)

    def in_state(self, m: Machine, state: str) -> bool:
        if state == "idle":
            return any(i.machine.id == m.id for i in self.idle)
        return self.state_of.get(m.id) == state

    @property
    def idle_per_hour(self) -> list[Money]:
        a = Amounts()
        for i in self.idle:
            a.add(i.rate.currency, i.rate.amount)
        return a.monies()

    def to_json(self) -> dict[str, Any]:
        return {
            "at": self.at.isoformat(),
            "burning_per_hour": [m.as_json() for m in self.burning],
            "burning_per_hour_total": self.burning_total.as_json(),
            "counts": self.counts,
            "budgets": [
                {
                    "policy": b.policy.name,
                    "period": b.period.label,
                    "amount": b.amount.as_json(),
                    "spent": b.spent.as_json(),
                    "committed": b.committed.as_json(),
                    "relaunches": b.relaunches.as_json(),
                    "forecast": b.forecast.as_json(),
                    "spent_percent": one_place(b.pct),
                    "forecast_percent": one_place(b.forecast_pct),
                }
                for b in self.budgets
            ],
            "idle_now": [i.to_json() for i in self.idle],
        }


def summary(
    app: App,
    now: datetime,
    live: Iterable[Machine] | None = None,
    budgets: list[Status] | None = None,
) -> Summary:
    """The summary at ``now`` over ``live`` (default: every machine not terminated or failed)
    and ``budgets`` (default: every budget's standing in its running period)."""
    from provisioner.views.spend import standings

    machines = list(live) if live is not None else _live(app)
    counts = dict.fromkeys(COUNTS, 0)
    state_of = _states(app, machines)
    burning = Amounts()
    for m in machines:
        if (b := burn(m)) is not None:
            burning.add(b.currency, b.amount)
    for state in state_of.values():
        counts[state] += 1
    idle_list = _idle_now(app, now, machines)
    counts["idle"] = len(idle_list)
    rates = app.settings.money_rates
    return Summary(
        at=now,
        burning=burning.monies(),
        burning_total=burning.total(rates, app.settings.currency),
        counts=counts,
        budgets=standings(app, now) if budgets is None else budgets,
        idle=idle_list,
        state_of=state_of,
    )


def _states(app: App, machines: list[Machine]) -> dict[str, str]:
    """Each counted machine's state by id: running, stopped, waiting, or preempted (its relaunch
    still tried) or held (refused, or given up)."""
    from provisioner.tries import events, tries

    state_of: dict[str, str] = {}
    for m in machines:
        if m.status in (S.RUNNING, S.STOPPED, S.WAITING):
            state_of[m.id] = m.status
    preempted = [m for m in machines if m.status == S.PREEMPTED]
    if preempted:
        with app.db.session() as s:
            for m in preempted:
                t = tries(events(s, m.id))
                state_of[m.id] = "held" if (t.refusal or t.gave_up) else "preempted"
    return state_of


def idle_of(app: App, now: datetime, m: Machine) -> IdleMachine | None:
    """``m`` idle now (its page's flag: the fleet's verdict), else None."""
    found = _idle_now(app, now, [m])
    return found[0] if found else None


def _idle_now(app: App, now: datetime, machines: list[Machine]) -> list[IdleMachine]:
    """The running machines idle now, with what their idleness has cost: the dearest first."""
    from provisioner import idle

    running = [m for m in machines if m.status == S.RUNNING and m.rate is not None]
    thresholds = {m.id: idle.threshold(idle.idle_rules(app.policies, m))[0] for m in running}
    grace = timedelta(seconds=app.settings.scheduler.heartbeat_grace_seconds)
    found = idle.idle_now(app, now, thresholds, grace)
    idle_list = []
    for m in running:
        if m.id in found and m.currency and m.rate is not None:
            since = found[m.id].since
            hours = Decimal((now - since) // timedelta(microseconds=1)) / Decimal(3_600_000_000)
            rate = Money(m.rate, m.currency)
            idle_list.append(IdleMachine(m, since, rate, Money(m.rate * hours, m.currency)))
    idle_list.sort(key=lambda i: (-i.rate.amount, i.machine.name))
    return idle_list


def burn(m: Machine) -> Money | None:
    """What ``m`` costs per hour now: its compute while running or starting, its disk while
    that bills (None: nothing, or no rate known), to the cent as shown — so "burning now" is
    the sum of the fleet's rows as they show it, and what `status --summary` says."""
    if not m.currency:
        return None
    amount = Decimal(0)
    if m.status in (S.RUNNING, S.PENDING) and m.rate is not None:
        amount += m.rate
    if m.disk_rate is not None and m.status in _DISK_BILLS:
        amount += m.disk_rate
    return Money(amount.quantize(RATE_STEP, ROUND_HALF_UP), m.currency) if amount else None


_DISK_BILLS = (S.PENDING, S.RUNNING, S.STOPPING, S.STOPPED, S.PREEMPTED)


def _live(app: App) -> list[Machine]:
    from provisioner.state import live_machines

    with app.db.session() as s:
        return live_machines(s)
