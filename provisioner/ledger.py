"""The cost ledger's foundation: usage intervals opened and closed on every observed transition,
priced at the rate fixed at launch, and spend as the exact overlap of intervals with a period."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from provisioner.money import Money
from provisioner.state import Event, Machine, UsageInterval

COMPUTE_BILLED = frozenset({"pending", "running", "stopping"})
DISK_BILLED = frozenset({"pending", "running", "stopping", "stopped", "preempted"})
SECONDS_PER_HOUR = Decimal(3600)
_US = timedelta(microseconds=1)


def record_transition(
    s: Session,
    m: Machine,
    status: str,
    at: datetime,
    *,
    event: str | None = None,
    reason: str | None = None,
    detail: dict[str, Any] | None = None,
) -> bool:
    """Move ``m`` to ``status`` at ``at``: an event, and the usage intervals opened or closed to
    match. Re-recording the state a machine is already in changes nothing (returns False)."""
    if m.status == status:
        return False
    m.status = status
    s.add(Event(machine_id=m.id, at=at, kind=event or status, reason=reason, detail=detail or {}))
    _bill(s, m, "compute", m.rate, status in COMPUTE_BILLED, at)
    _bill(s, m, "disk", m.disk_rate, status in DISK_BILLED, at)
    if status == "terminated":
        m.terminated_at = at
    return True


def _bill(
    s: Session, m: Machine, kind: str, rate: Decimal | None, billed: bool, at: datetime
) -> None:
    open_ = s.scalars(
        select(UsageInterval).where(
            UsageInterval.machine_id == m.id,
            UsageInterval.kind == kind,
            UsageInterval.ended_at.is_(None),
        )
    ).first()
    if billed and open_ is None and rate is not None:
        s.add(
            UsageInterval(machine_id=m.id, kind=kind, started_at=at, rate=rate, currency=m.currency)
        )
    elif not billed and open_ is not None:
        open_.ended_at = max(at, open_.started_at)
    s.flush()


def interval_cost(iv: UsageInterval, start: datetime, end: datetime) -> Decimal:
    """Exact cost of the part of ``iv`` inside [start, end)."""
    lo = max(iv.started_at, start)
    hi = min(iv.ended_at or end, end)
    if hi <= lo:
        return Decimal(0)
    seconds = Decimal((hi - lo) // _US) / Decimal(1_000_000)
    return iv.rate * seconds / SECONDS_PER_HOUR


def spend(intervals: Iterable[UsageInterval], start: datetime, end: datetime) -> dict[str, Money]:
    """Total per currency of ``intervals`` over [start, end)."""
    totals: dict[str, Decimal] = {}
    for iv in intervals:
        cost = interval_cost(iv, start, end)
        if cost:
            totals[iv.currency] = totals.get(iv.currency, Decimal(0)) + cost
    return {c: Money(a, c) for c, a in totals.items()}


def machine_spend(s: Session, m: Machine, start: datetime, end: datetime) -> dict[str, Money]:
    return spend(
        s.scalars(select(UsageInterval).where(UsageInterval.machine_id == m.id)), start, end
    )
