"""What spend will be: forecast, commitments of live machines, savings of the scheduler's stops,
and idle waste."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    func,
    select,
)
from sqlalchemy.orm import Session

from policies.duration import parse_duration
from provisioner.ledger.periods import DAY, Period, hours
from provisioner.ledger.sums import Scope, total
from provisioner.models import Event, Machine, UsageInterval
from provisioner.money import Amounts
from provisioner.schema import EventKind, UsageKind
from provisioner.schema import MachineStatus as S

# Stops that were not the scheduler's doing, so they count for no savings.
NOT_SCHEDULER_STOPS = frozenset({"user", "outside-provisioner", "preempted"})
IDLE_REASONS = ("idle", "off-hours-idle", "autostop")  # the scheduler's stops of idle machines
DEFAULT_IDLE_MINUTES = 30  # when neither the event nor the spec says how long it was idle

# --- forecast, commitments, savings, idle waste --------------------------------------------


def max_lifetime(spec: dict[str, Any] | None) -> timedelta | None:
    """The spec's ``machines.max_lifetime`` as stored with the machine (JSON)."""
    raw = ((spec or {}).get("lifecycle") or {}).get("max_lifetime")
    return None if raw is None else parse_duration(raw)


@dataclass
class Forecast:
    """Spend to the end of a period: what is spent, what live machines will add at their
    launch-time rates until the period ends (or their max lifetime does), and what preempted
    machines being relaunched will add likewise. Nothing is extrapolated: with nothing running
    and nothing to relaunch, the forecast is what was spent."""

    actual: Amounts
    committed: Amounts
    relaunches: Amounts

    @property
    def total(self) -> Amounts:
        return Amounts().merge(self.actual).merge(self.committed).merge(self.relaunches)


def _open_intervals(s: Session, now: datetime, scope: Scope) -> list[tuple[Any, ...]]:
    q = (
        select(
            UsageInterval.started_at,
            UsageInterval.rate,
            UsageInterval.currency,
            Machine.project,
            Machine.owner,
            Machine.launched_at,
            Machine.spec,
        )
        .join(Machine, Machine.id == UsageInterval.machine_id)
        # the open intervals are the few in the partial index uq_usage_one_open; asked for
        # ``started_at <= now`` too, SQLite reads every interval's start instead (0.1 s a 1M)
        .where(UsageInterval.ended_at.is_(None), *scope.clauses())
    )
    admits = scope.admitter()
    return [r for r in s.execute(q) if r[0] <= now and admits(r[3], r[4])]


def commitments(s: Session, period: Period, now: datetime, scope: Scope = Scope()) -> Amounts:
    """What machines live now will cost from ``now`` to the end of ``period`` at their rates,
    each until its max lifetime ends if that comes first."""
    out = Amounts()
    frm = period.clip(now)
    for _, rate, currency, _, _, launched_at, spec in _open_intervals(s, now, scope):
        until = _until(period.end, spec, launched_at)
        if until > frm:
            out.add(currency, rate * hours(until - frm))
    # intents still launching, at the rate of their plan's first candidate: `up`s
    # checked one after another must each see what the ones before them will spend
    admits = scope.admitter()
    launching = s.execute(
        select(
            Machine.rate,
            Machine.disk_rate,
            Machine.address_rate,
            Machine.currency,
            Machine.project,
            Machine.owner,
            Machine.created_at,
            Machine.spec,
        ).where(Machine.status == S.REQUESTED, Machine.rate.is_not(None), *scope.clauses())
    )
    for rate, disk_rate, address_rate, currency, project, owner, created_at, spec in launching:
        if not admits(project, owner):
            continue
        until = _until(period.end, spec, created_at)
        if until > frm:
            out.add(currency, (rate + (disk_rate or 0) + (address_rate or 0)) * hours(until - frm))
    return out


def forecast(
    s: Session,
    period: Period,
    now: datetime,
    scope: Scope = Scope(),
    *,
    actual: Amounts | None = None,
) -> Forecast:
    """``actual``, when the caller has already summed the period to ``now``, saves a pass."""
    if actual is None:
        actual = total(s, period.start, period.clip(now), scope)
    if period.clip(now) >= period.end:
        return Forecast(actual, Amounts(), Amounts())
    return Forecast(actual, commitments(s, period, now, scope), relaunches(s, period, now, scope))


def relaunches(s: Session, period: Period, now: datetime, scope: Scope = Scope()) -> Amounts:
    """What preempted machines the scheduler is relaunching (``on_preemption: relaunch``, not
    held by a refusal, not given up) will cost from ``now`` to the end of ``period`` at their
    launch-time compute rates, each until its max lifetime ends if that comes first. Their
    disks bill already: they are open intervals, counted by :func:`commitments`."""
    from provisioner.tries import tries

    out = Amounts()
    frm = period.clip(now)
    rows = _relaunching(s, scope)
    if not rows:
        return out
    evs: dict[str, list[Event]] = {r.id: [] for r in rows}
    for e in s.scalars(select(Event).where(Event.machine_id.in_(evs)).order_by(Event.id)):
        evs[e.machine_id].append(e)
    for r in rows:
        t = tries(evs[r.id])
        if t.refusal is not None or t.gave_up is not None:
            continue  # held: not relaunched until someone acts
        until = _until(period.end, r.spec, r.launched_at)
        if until > frm:
            out.add(r.currency, r.rate * hours(until - frm))
    return out


def _relaunching(s: Session, scope: Scope) -> list[Any]:
    """The preempted machines in ``scope`` with a rate whose experiment relaunches them on a
    preemption (the default): id, rate, currency, project, owner, launched_at, spec."""
    admits = scope.admitter()
    return [
        r
        for r in s.execute(
            select(
                Machine.id,
                Machine.rate,
                Machine.currency,
                Machine.project,
                Machine.owner,
                Machine.launched_at,
                Machine.spec,
            ).where(Machine.status == S.PREEMPTED, Machine.rate.is_not(None), *scope.clauses())
        )
        if admits(r.project, r.owner)
        and ((r.spec or {}).get("lifecycle") or {}).get("on_preemption", "relaunch") == "relaunch"
    ]


def _until(end: datetime, spec: Any, launched_at: datetime | None) -> datetime:
    """When a relaunched machine stops billing: the period's ``end``, or its max lifetime's
    end from ``launched_at`` if that comes first."""
    ttl = max_lifetime(spec)
    if ttl is not None and launched_at is not None:
        return min(end, launched_at + ttl)
    return end


def _overlap(lo: datetime, hi: datetime, start: datetime, end: datetime) -> timedelta:
    return max(min(hi, end) - max(lo, start), timedelta(0))


#: How long a stopped machine is counted as saving when nothing else bounds it: a machine left
#: running idle would be noticed within a working day. Said beside the figure (SAVINGS_METHOD).
SAVINGS_HORIZON = timedelta(hours=12)
SAVINGS_METHOD = (
    "each scheduled stop counts the machine's compute rate until the earliest of: it started "
    "again or was deleted, its max lifetime would have ended it, its policy's working hours "
    "began again (an off-hours stop), or 12 h after the stop — never to the period's end"
)

#: (project, owner, the stop's instant) → the latest instant the stop may count to
Bound = Callable[[str, str, datetime], datetime]


def _horizon(_project: str, _owner: str, at: datetime) -> datetime:
    return at + SAVINGS_HORIZON


def savings(
    s: Session, period: Period, now: datetime, scope: Scope = Scope(), bound: Bound = _horizon
) -> dict[str, Amounts]:
    """What the scheduler's stops saved in ``period``, by reason: the compute rate times the
    hours each machine would have run but stayed stopped — until it started again, was
    terminated, its max lifetime's end, or ``bound`` (:data:`SAVINGS_METHOD`), within the
    period up to now."""
    to = period.clip(now)
    next_start = (
        select(func.min(UsageInterval.started_at))
        .where(
            UsageInterval.machine_id == Event.machine_id,
            UsageInterval.kind == UsageKind.COMPUTE,
            UsageInterval.started_at >= Event.at,
        )
        .scalar_subquery()
    )
    q = (
        select(
            Event.at,
            Event.reason,
            next_start,
            Machine.terminated_at,
            Machine.rate,
            Machine.currency,
            Machine.project,
            Machine.owner,
            Machine.launched_at,
            Machine.spec,
        )
        .join(Machine, Machine.id == Event.machine_id)
        .where(
            Event.kind == EventKind.STOPPED,
            Event.reason.is_not(None),
            Event.reason.not_in(NOT_SCHEDULER_STOPS),
            Event.at < to,
            Machine.rate.is_not(None),
            *scope.clauses(),
        )
    )
    admits = scope.admitter()
    out: dict[str, Amounts] = {}
    for row in s.execute(q):
        if not admits(row.project, row.owner):
            continue
        gap = _overlap(row.at, _saved_until(row, to, bound), period.start, to)
        if gap and row.reason and row.currency and row.rate is not None:
            out.setdefault(row.reason, Amounts()).add(row.currency, row.rate * hours(gap))
    return out


def _saved_until(row: Any, to: datetime, bound: Bound) -> datetime:
    """Where one stop's saving ends: it started again (``row[2]``), it was terminated, ``to``,
    the ``bound``, or where its max lifetime would have ended it anyway."""
    ends = [row[2], row.terminated_at, to, bound(row.project, row.owner, row.at)]
    if row.launched_at is not None and (ttl := max_lifetime(row.spec)) is not None:
        ends.append(row.launched_at + ttl)
    return min(t for t in ends if t is not None)


def idle_waste(s: Session, period: Period, now: datetime, scope: Scope = Scope()) -> Amounts:
    """What machines cost while idle before the scheduler stopped them: from ``idle_since`` in
    the stop event's detail (else the spec's idle rule's minutes before the stop) to the stop."""
    to = period.clip(now)
    q = (
        select(
            Event.at,
            Event.detail,
            Machine.spec,
            Machine.rate,
            Machine.currency,
            Machine.project,
            Machine.owner,
        )
        .join(Machine, Machine.id == Event.machine_id)
        .where(
            Event.reason.in_(IDLE_REASONS),
            Event.at >= period.start,
            Event.at < period.end + DAY,  # a stop just after the period may end an idle span in it
            Machine.rate.is_not(None),
            *scope.clauses(),
        )
    )
    admits = scope.admitter()
    out = Amounts()
    for at, detail, spec, rate, currency, project, owner in s.execute(q):
        if not admits(project, owner):
            continue
        since = (detail or {}).get("idle_since")
        if since:
            lo = datetime.fromisoformat(since).astimezone(UTC)
        else:
            rule = ((spec or {}).get("lifecycle") or {}).get("idle") or {}
            lo = at - timedelta(minutes=rule.get("for_minutes", DEFAULT_IDLE_MINUTES))
        gap = _overlap(lo, at, period.start, to)
        if gap:
            out.add(currency, rate * hours(gap))
    return out
