"""Usage intervals opened and closed on every transition, priced at the rate fixed at launch."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    select,
)
from sqlalchemy.orm import Session

from provisioner.ledger.periods import _US, SECONDS_PER_HOUR
from provisioner.models import Event, Machine, UsageInterval
from provisioner.money import Money
from provisioner.schema import (
    ADDRESS_BILLED,
    COMPUTE_BILLED,
    DISK_BILLED,
    EventKind,
    MachineStatus,
    UsageKind,
)


def record_transition(
    s: Session,
    m: Machine,
    status: MachineStatus,
    at: datetime,
    *,
    event: EventKind | None = None,
    reason: str | None = None,
    detail: dict[str, Any] | None = None,
) -> bool:
    """Move ``m`` to ``status`` at ``at``: an event, and the usage intervals opened or closed to
    match. Re-recording the state a machine is already in changes nothing (returns False)."""
    if m.status == status:
        return False
    m.status = status
    s.add(Event(machine_id=m.id, at=at, kind=event or status, reason=reason, detail=detail or {}))
    for kind, rate, billed in _meters(m, status):
        _bill(s, m, kind, rate, billed, at)
    if status == MachineStatus.TERMINATED:
        m.terminated_at = at
    return True


def record_transitions(
    s: Session,
    machines: Sequence[Machine],
    status: MachineStatus,
    at: datetime,
    *,
    event: EventKind | None = None,
    reason: str | None = None,
    details: dict[str, dict[str, Any]] | None = None,
) -> dict[str, bool]:
    """:func:`record_transition` for many machines at once, as a batch stop records them: their
    open intervals read in one query, one flush. Returns machine id → changed."""
    moving = [m for m in machines if m.status != status]
    open_ = _open_intervals(s, [m.id for m in moving])
    for m in moving:
        detail = (details or {}).get(m.id) or {}
        _move(
            s,
            m,
            status,
            at,
            Event(machine_id=m.id, at=at, kind=event or status, reason=reason, detail=detail),
            open_,
        )
    s.flush()
    changed = {m.id for m in moving}
    return {m.id: m.id in changed for m in machines}


def _move(
    s: Session,
    m: Machine,
    status: MachineStatus,
    at: datetime,
    event: Event,
    open_: dict[tuple[str, str], UsageInterval],
) -> None:
    """One machine of a batch to ``status`` at ``at``: its event, its intervals opened or
    closed (``open_``: the batch's open ones), its end when terminated."""
    m.status = status
    s.add(event)
    for kind, rate, billed in _meters(m, status):
        _meter(s, m, kind, rate, billed, at, open_.get((m.id, kind)))
    if status == MachineStatus.TERMINATED:
        m.terminated_at = at


def _open_intervals(s: Session, ids: list[str]) -> dict[tuple[str, str], UsageInterval]:
    """The open usage intervals of the machines ``ids`` by (machine id, kind), read in
    batches of 1000 (to bound the statement's parameters); the first read of a pair wins."""
    open_: dict[tuple[str, str], UsageInterval] = {}
    for k in range(0, len(ids), 1000):
        for row in s.scalars(
            select(UsageInterval).where(
                UsageInterval.machine_id.in_(ids[k : k + 1000]), UsageInterval.ended_at.is_(None)
            )
        ):
            open_.setdefault((row.machine_id, row.kind), row)
    return open_


def _meters(m: Machine, status: MachineStatus) -> list[tuple[UsageKind, Decimal | None, bool]]:
    """Each kind of usage of ``m``: (kind, its rate, billed in ``status``)."""
    return [
        (UsageKind.COMPUTE, m.rate, status in COMPUTE_BILLED),
        (UsageKind.DISK, m.disk_rate, status in DISK_BILLED),
        (UsageKind.ADDRESS, m.address_rate, _address_billed(m, status)),
    ]


def _meter(
    s: Session,
    m: Machine,
    kind: UsageKind,
    rate: Decimal | None,
    billed: bool,
    at: datetime,
    iv: UsageInterval | None,
) -> None:
    """Open an interval of ``kind`` at ``at`` when billed and none is open (``iv``) and the
    rate is known; close the open one at ``at`` (never before its start) when not billed."""
    if billed and iv is None and rate is not None:
        s.add(
            UsageInterval(machine_id=m.id, kind=kind, started_at=at, rate=rate, currency=m.currency)
        )
    elif not billed and iv is not None:
        iv.ended_at = max(at, iv.started_at)


def _address_billed(m: Machine, status: MachineStatus) -> bool:
    return status in ADDRESS_BILLED.get(m.address_billed or "running", COMPUTE_BILLED)


def _bill(
    s: Session, m: Machine, kind: UsageKind, rate: Decimal | None, billed: bool, at: datetime
) -> None:
    open_ = s.scalars(
        select(UsageInterval).where(
            UsageInterval.machine_id == m.id,
            UsageInterval.kind == kind,
            UsageInterval.ended_at.is_(None),
        )
    ).first()
    _meter(s, m, kind, rate, billed, at, open_)
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
