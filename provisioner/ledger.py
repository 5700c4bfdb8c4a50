"""The cost ledger: usage intervals opened and closed on every observed transition, priced at the
rate fixed at launch, and spend as the exact overlap of intervals with a period.

Everything is derived from the intervals on demand — there is no accrual job to re-run, so a
report asked twice, or a transition observed twice, cannot count anything twice. Sums are exact:
overlaps are added as integer microseconds per (key, currency, rate) and priced once at the end
(Decimal), amounts keep their currency, and conversion happens only when a caller asks for one.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from fnmatch import fnmatchcase
from functools import lru_cache
from typing import Any, NamedTuple
from zoneinfo import ZoneInfo

from sqlalchemy import String, func, or_, select, type_coerce
from sqlalchemy.orm import Session

from policies.duration import parse_duration
from provisioner.models import Event, Machine, UsageInterval
from provisioner.money import Money, Rates

COMPUTE_BILLED = frozenset({"pending", "running", "stopping"})
DISK_BILLED = frozenset({"pending", "running", "stopping", "stopped", "preempted"})
SECONDS_PER_HOUR = Decimal(3600)
_US = timedelta(microseconds=1)
_US_PER_HOUR = Decimal(3_600_000_000)
DAY = timedelta(days=1)

# Stops that were not the scheduler's doing, so they count for no savings.
NOT_SCHEDULER_STOPS = frozenset({"user", "outside-provisioner", "preempted"})
IDLE_REASONS = ("idle", "off-hours-idle")  # the scheduler's stops of idle machines
DEFAULT_IDLE_MINUTES = 30  # when neither the event nor the spec says how long it was idle
MIN_TREND_HISTORY = DAY  # a trend from the first minutes of a period would be noise


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


# --- amounts in several currencies ---------------------------------------------------------


class Amounts(dict[str, Decimal]):
    """Sums that keep their currencies apart; converted only on request."""

    def add(self, currency: str, amount: Decimal) -> None:
        self[currency] = self.get(currency, Decimal(0)) + amount

    def merge(self, other: Amounts, k: Decimal | int = 1) -> Amounts:
        for c, a in other.items():
            self.add(c, a * k)
        return self

    def total(self, rates: Rates, currency: str) -> Money:
        out = Money.zero(currency)
        for c in sorted(self):
            out += rates.convert(Money(self[c], c), currency)
        return out

    def monies(self) -> list[Money]:
        return [Money(self[c], c) for c in sorted(self)]

    def __str__(self) -> str:
        return " + ".join(str(m) for m in self.monies()) or "0"


# --- periods -------------------------------------------------------------------------------

_MONTH = re.compile(r"^(\d{4})-(\d{2})$")
_WEEK = re.compile(r"^(\d{4})-W(\d{2})$", re.I)
_RANGE = re.compile(r"^(\d{4}-\d{2}-\d{2})\s*\.\.\s*(\d{4}-\d{2}-\d{2})$")


@lru_cache(maxsize=4096)  # a report asks for the same few days a million times
def midnight(d: date, tz: str = "UTC") -> datetime:
    """The start of day ``d`` in ``tz``, as a UTC datetime."""
    return datetime.combine(d, time(0), tzinfo=ZoneInfo(tz)).astimezone(UTC)


@dataclass(frozen=True)
class Period:
    """[start, end) between local midnights of ``tz`` (a policy's timezone; UTC by default),
    with the label people use for it (``2026-11``, ``2026-W48``)."""

    start: datetime
    end: datetime
    label: str
    tz: str = "UTC"

    @classmethod
    def month(cls, at: datetime, tz: str = "UTC") -> Period:
        local = at.astimezone(ZoneInfo(tz))
        first = date(local.year, local.month, 1)
        nxt = date(local.year + local.month // 12, local.month % 12 + 1, 1)
        return cls(midnight(first, tz), midnight(nxt, tz), f"{first:%Y-%m}", tz)

    @classmethod
    def week(cls, at: datetime, tz: str = "UTC") -> Period:
        day = at.astimezone(ZoneInfo(tz)).date()
        monday = day - timedelta(days=day.weekday())
        y, w, _ = monday.isocalendar()
        return cls(midnight(monday, tz), midnight(monday + 7 * DAY, tz), f"{y}-W{w:02d}", tz)

    @classmethod
    def between(cls, first: date, last: date, tz: str = "UTC") -> Period:
        """Whole days ``first`` to ``last``, both included."""
        if last < first:
            raise ValueError(f"period ends ({last}) before it starts ({first})")
        return cls(midnight(first, tz), midnight(last + DAY, tz), f"{first}..{last}", tz)

    @classmethod
    def parse(cls, text: str, tz: str = "UTC") -> Period:
        """``2026-11`` (a month), ``2026-W48`` (an ISO week), ``2026-11-01..2026-11-15``."""
        text = text.strip()
        try:
            if m := _MONTH.match(text):
                return cls.month(midnight(date(int(m[1]), int(m[2]), 1), tz), tz)
            if m := _WEEK.match(text):
                return cls.week(midnight(date.fromisocalendar(int(m[1]), int(m[2]), 1), tz), tz)
            if m := _RANGE.match(text):
                return cls.between(date.fromisoformat(m[1]), date.fromisoformat(m[2]), tz)
        except ValueError as e:
            raise ValueError(f"not a period: {text!r} ({e})") from None
        raise ValueError(
            f"not a period: {text!r} (write 2026-11, 2026-W48 or 2026-11-01..2026-11-15)"
        )

    def clip(self, at: datetime) -> datetime:
        return min(max(at, self.start), self.end)

    def days(self) -> list[date]:
        """The local days of the period."""
        d, out = self.start.astimezone(ZoneInfo(self.tz)).date(), []
        while midnight(d, self.tz) < self.end:
            out.append(d)
            d += DAY
        return out


def hours(delta: timedelta) -> Decimal:
    return Decimal(delta // _US) / _US_PER_HOUR


# --- what a query covers -------------------------------------------------------------------


@dataclass(frozen=True)
class Scope:
    """Which machines a query covers. ``project`` and ``owner`` may be glob patterns
    (``nlp-*``, ``*@example.com``); ``covers`` is any further test on (project, owner), such as
    "a budget's policy applies"."""

    project: str | None = None
    owner: str | None = None
    cloud: str | None = None
    gpu: str | None = None
    machine: str | None = None
    covers: Callable[[str, str], bool] | None = field(default=None, compare=False)

    def clauses(self) -> list[Any]:
        out = []
        pairs: tuple[tuple[str | None, Any], ...] = (
            (self.project, Machine.project),
            (self.owner, Machine.owner),
        )
        for value, col in pairs:
            if value is not None and not _is_glob(value):
                out.append(col == value)
        for value, col in (
            (self.cloud, Machine.cloud),
            (self.gpu, Machine.gpu),
            (self.machine, Machine.name),
        ):
            if value is not None:
                out.append(col == value)
        return out

    def admitter(self) -> Callable[[str, str], bool]:
        """The part of the scope tested in Python, cached per (project, owner) pair."""
        globs = [(i, v) for i, v in enumerate((self.project, self.owner)) if v and _is_glob(v)]
        if not globs and self.covers is None:
            return lambda project, owner: True
        seen: dict[tuple[str, str], bool] = {}

        def admits(project: str, owner: str) -> bool:
            key = (project, owner)
            if key not in seen:
                seen[key] = all(fnmatchcase(key[i], v) for i, v in globs) and (
                    self.covers is None or self.covers(project, owner)
                )
            return seen[key]

        return admits


def _is_glob(value: str) -> bool:
    return any(ch in value for ch in "*?[")


# --- streaming the intervals of a period ---------------------------------------------------


class Usage(NamedTuple):
    """The part of one usage interval inside the period asked for."""

    machine_id: str
    machine: str
    project: str
    owner: str
    cloud: str | None
    gpu: str | None
    gpu_count: int | None
    kind: str
    currency: str
    rate: str  # exact decimal text: priced once per distinct rate, not once per row
    lo: datetime
    hi: datetime

    @property
    def us(self) -> int:
        return (self.hi - self.lo) // _US

    def days(self, tz: str = "UTC") -> Iterator[tuple[date, int]]:
        """(local day, microseconds) pieces of this usage."""
        zone, lo = ZoneInfo(tz), self.lo
        while lo < self.hi:
            day = lo.date() if tz == "UTC" else lo.astimezone(zone).date()
            nxt = min(midnight(day + DAY, tz), self.hi)
            yield day, (nxt - lo) // _US
            lo = nxt


def scan(
    s: Session,
    start: datetime,
    end: datetime,
    scope: Scope = Scope(),
    *,
    kinds: Sequence[str] | None = None,
    batch: int = 20_000,
) -> Iterator[Usage]:
    """Every usage inside [start, end), streamed in batches (flat memory over millions of rows).
    Open intervals run to ``end``: pass ``min(period end, now)`` for spend to date."""
    q = (
        select(
            UsageInterval.machine_id,
            Machine.name,
            Machine.project,
            Machine.owner,
            Machine.cloud,
            Machine.gpu,
            Machine.gpu_count,
            UsageInterval.kind,
            UsageInterval.currency,
            type_coerce(UsageInterval.rate, String),
            UsageInterval.started_at,
            UsageInterval.ended_at,
        )
        .join(Machine, Machine.id == UsageInterval.machine_id)
        .where(
            UsageInterval.started_at < end,
            or_(UsageInterval.ended_at.is_(None), UsageInterval.ended_at > start),
            *scope.clauses(),
        )
        .execution_options(yield_per=batch)
    )
    if kinds is not None:
        q = q.where(UsageInterval.kind.in_(kinds))
    admits = scope.admitter()
    for r in s.connection().execute(q):  # Core rows: no ORM bookkeeping per row
        if not admits(r[2], r[3]):
            continue
        lo = max(r[10], start)
        hi = end if r[11] is None else min(r[11], end)
        if hi > lo:
            yield Usage(*r[:10], lo, hi)


class Tally:
    """Exact sums: integer microseconds per (key, currency, rate), priced once at the end."""

    def __init__(self) -> None:
        self._us: defaultdict[tuple[Hashable, str, str], int] = defaultdict(int)

    def add(self, key: Hashable, u: Usage, us: int | None = None) -> None:
        self._us[(key, u.currency, u.rate)] += u.us if us is None else us

    def amounts(self) -> dict[Any, Amounts]:
        out: dict[Any, Amounts] = {}
        prices: dict[str, Decimal] = {}
        for (key, currency, rate), us in self._us.items():
            price = prices.get(rate)
            if price is None:
                price = prices[rate] = Decimal(rate)
            out.setdefault(key, Amounts()).add(currency, price * us / _US_PER_HOUR)
        return out

    def hours(self) -> dict[Any, Decimal]:
        out: dict[Any, int] = defaultdict(int)
        for (key, _, _), us in self._us.items():
            out[key] += us
        return {k: Decimal(us) / _US_PER_HOUR for k, us in out.items()}


BY = ("project", "owner", "cloud", "gpu", "machine", "kind", "day")


def spend_by(
    s: Session,
    start: datetime,
    end: datetime,
    by: Sequence[str] = (),
    scope: Scope = Scope(),
    *,
    kinds: Sequence[str] | None = None,
    tz: str = "UTC",
) -> dict[tuple[Any, ...], Amounts]:
    """Spend over [start, end) grouped by any of :data:`BY`; ``day`` (the local day in
    ``tz``), when asked for, is always the last item of the key."""
    unknown = set(by) - set(BY)
    if unknown:
        raise ValueError(f"cannot group by {', '.join(sorted(unknown))}; use {', '.join(BY)}")
    fields = [f for f in by if f != "day"]
    tally = Tally()
    for u in scan(s, start, end, scope, kinds=kinds):
        key = tuple(getattr(u, f) for f in fields)
        if "day" in by:
            for d, us in u.days(tz):
                tally.add((*key, d), u, us)
        else:
            tally.add(key, u)
    return tally.amounts()


def total(s: Session, start: datetime, end: datetime, scope: Scope = Scope()) -> Amounts:
    return spend_by(s, start, end, (), scope).get((), Amounts())


# --- forecast, commitments, savings, idle waste --------------------------------------------


def max_lifetime(spec: dict[str, Any] | None) -> timedelta | None:
    """The spec's ``lifecycle.max_lifetime`` as stored with the machine (JSON)."""
    raw = ((spec or {}).get("lifecycle") or {}).get("max_lifetime")
    return None if raw is None else parse_duration(raw)


@dataclass
class Forecast:
    """Spend to the end of a period: what is spent, what live machines will add at their
    launch-time rates until the period ends (or their max lifetime does), and the trend of the
    period's other usage (machines that came and went) carried on at its daily average."""

    actual: Amounts
    run_rate: Amounts
    trend: Amounts

    @property
    def total(self) -> Amounts:
        return Amounts().merge(self.actual).merge(self.run_rate).merge(self.trend)


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
        .where(UsageInterval.ended_at.is_(None), UsageInterval.started_at <= now, *scope.clauses())
    )
    admits = scope.admitter()
    return [r for r in s.execute(q) if admits(r[3], r[4])]


def commitments(s: Session, period: Period, now: datetime, scope: Scope = Scope()) -> Amounts:
    """What machines live now will cost from ``now`` to the end of ``period`` at their rates,
    each until its max lifetime ends if that comes first."""
    out = Amounts()
    frm = period.clip(now)
    for _, rate, currency, _, _, launched_at, spec in _open_intervals(s, now, scope):
        until = period.end
        ttl = max_lifetime(spec)
        if ttl is not None and launched_at is not None:
            until = min(until, launched_at + ttl)
        if until > frm:
            out.add(currency, rate * hours(until - frm))
    # intents still launching, at the rate of their plan's first candidate: `up`s
    # checked one after another must each see what the ones before them will spend
    admits = scope.admitter()
    launching = s.execute(
        select(
            Machine.rate,
            Machine.disk_rate,
            Machine.currency,
            Machine.project,
            Machine.owner,
            Machine.created_at,
            Machine.spec,
        ).where(Machine.status == "requested", Machine.rate.is_not(None), *scope.clauses())
    )
    for rate, disk_rate, currency, project, owner, created_at, spec in launching:
        if not admits(project, owner):
            continue
        until = period.end
        ttl = max_lifetime(spec)
        if ttl is not None:
            until = min(until, created_at + ttl)
        if until > frm:
            out.add(currency, (rate + (disk_rate or 0)) * hours(until - frm))
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
    to = period.clip(now)
    if actual is None:
        actual = total(s, period.start, to, scope)
    if to >= period.end:
        return Forecast(actual, Amounts(), Amounts())
    open_spend = Amounts()
    for started_at, rate, currency, *_ in _open_intervals(s, now, scope):
        lo = max(started_at, period.start)
        if to > lo:
            open_spend.add(currency, rate * hours(to - lo))
    history = max(to - period.start, MIN_TREND_HISTORY)
    k = hours(period.end - to) / hours(history)
    trend = Amounts()
    for c, a in actual.items():
        other = a - open_spend.get(c, Decimal(0))
        if other > 0:
            trend.add(c, other * k)
    return Forecast(actual, commitments(s, period, now, scope), trend)


def _overlap(lo: datetime, hi: datetime, start: datetime, end: datetime) -> timedelta:
    return max(min(hi, end) - max(lo, start), timedelta(0))


def savings(
    s: Session, period: Period, now: datetime, scope: Scope = Scope()
) -> dict[str, Amounts]:
    """What the scheduler's stops saved in ``period``, by reason: the compute rate times the
    hours each machine stayed stopped (until it started again, was terminated, or now)."""
    to = period.clip(now)
    next_start = (
        select(func.min(UsageInterval.started_at))
        .where(
            UsageInterval.machine_id == Event.machine_id,
            UsageInterval.kind == "compute",
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
        )
        .join(Machine, Machine.id == Event.machine_id)
        .where(
            Event.kind == "stopped",
            Event.reason.is_not(None),
            Event.reason.not_in(NOT_SCHEDULER_STOPS),
            Event.at < to,
            Machine.rate.is_not(None),
            *scope.clauses(),
        )
    )
    admits = scope.admitter()
    out: dict[str, Amounts] = {}
    for at, reason, restarted, terminated, rate, currency, project, owner in s.execute(q):
        if not admits(project, owner):
            continue
        until = min(t for t in (restarted, terminated, to) if t is not None)
        gap = _overlap(at, until, period.start, to)
        if gap and reason and currency and rate is not None:
            out.setdefault(reason, Amounts()).add(currency, rate * hours(gap))
    return out


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
