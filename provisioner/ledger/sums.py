"""Spend summed by the database: what a query covers (:class:`Scope`), totals per key and per
day, as exact integer microseconds per (key, currency, rate) priced once at the end."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from fnmatch import fnmatchcase
from itertools import pairwise
from typing import Any
from zoneinfo import ZoneInfo

from sqlalchemy import (
    BigInteger,
    String,
    and_,
    case,
    cast,
    func,
    literal,
    or_,
    select,
    text,
    true,
    tuple_,
    type_coerce,
    union_all,
)
from sqlalchemy.orm import Session

from provisioner.ledger.periods import DAY, midnight
from provisioner.models import Machine, UsageInterval, epoch_us
from provisioner.money import Amounts, Tally

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

    @property
    def in_python(self) -> bool:
        """Whether part of the scope is tested in Python (see :meth:`admitter`)."""
        return self.covers is not None or any(v and _is_glob(v) for v in (self.project, self.owner))

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


# --- sums in the database ------------------------------------------------------------------


#: What usage can be grouped by: a machine's columns, the interval's kind, and ``day``.
FIELDS: dict[str, Any] = {
    "project": Machine.project,
    "owner": Machine.owner,
    "cloud": Machine.cloud,
    "gpu": Machine.gpu,
    "gpu_count": Machine.gpu_count,
    "machine": Machine.name,
    "kind": UsageInterval.kind,
}
BY = ("project", "owner", "cloud", "gpu", "machine", "kind", "day")
LABEL = "label:"  # ``label:KEY``: the value of the experiment's label KEY (None: no such label)


def column_of(name: str) -> Any:
    """The column of :data:`FIELDS` named ``name``, or for ``label:KEY`` the label's value as
    stored in the machine's spec (JSON path ``labels.KEY``; SQLite and PostgreSQL alike)."""
    if name.startswith(LABEL):
        return Machine.spec[("labels", name.removeprefix(LABEL))].as_string()
    return FIELDS[name]


def _machines(s: Session, scope: Scope) -> Any:
    """The scope as one SQL condition on usage (None: every machine). A test only Python can
    make (globs, a budget's ``covers``) is made once per distinct (project, owner) and handed
    to the database as the list of pairs it admits."""
    clauses = scope.clauses()
    if scope.in_python:
        admits = scope.admitter()
        pairs = s.execute(select(Machine.project, Machine.owner).distinct().where(*clauses))
        clauses.append(tuple_(Machine.project, Machine.owner).in_([p for p in pairs if admits(*p)]))
    return UsageInterval.machine_id.in_(select(Machine.id).where(*clauses)) if clauses else None


def _usage(
    s: Session,
    start: datetime,
    end: datetime,
    scope: Scope,
    kinds: Sequence[str] | None,
    where: Any = None,
) -> list[Any]:
    """Which intervals have usage inside [start, end), in the scope, of the kinds asked and
    meeting ``where`` (a condition on usage), if given."""
    lo_us, hi_us = epoch_us(start), epoch_us(end)
    iv = UsageInterval
    out = [
        iv.start_us < hi_us,
        or_(iv.end_us.is_(None), and_(iv.end_us > lo_us, iv.end_us > iv.start_us)),
    ]
    if kinds is not None:
        out.append(iv.kind.in_(kinds))
    if (machines := _machines(s, scope)) is not None:
        out.append(machines)
    if where is not None:
        out.append(where)
    return out


def _span(
    s: Session,
    start: datetime,
    end: datetime,
    scope: Scope,
    kinds: Sequence[str] | None,
    where: Any = None,
):
    """The usage inside [start, end) as a subquery: each interval's machine, kind, currency and
    rate (its exact text), and ``lo``/``hi`` — its times clamped to the span, integer
    microseconds — so sums are integers (exact on every backend, no float, no text dates)."""
    lo_us, hi_us = epoch_us(start), epoch_us(end)
    most, least = (func.max, func.min) if _sqlite(s) else (func.greatest, func.least)
    iv = UsageInterval
    return (
        select(
            iv.machine_id,
            iv.kind,
            iv.currency,
            type_coerce(iv.rate, String).label("rate"),  # the exact text: priced once per rate
            most(iv.start_us, lo_us, type_=BigInteger).label("lo"),
            least(func.coalesce(iv.end_us, hi_us), hi_us, type_=BigInteger).label("hi"),
        )
        .where(*_usage(s, start, end, scope, kinds, where))
        .subquery("u")
    )


def _sqlite(s: Session) -> bool:
    return s.get_bind().dialect.name == "sqlite"


def tally(
    s: Session,
    start: datetime,
    end: datetime,
    by: Sequence[str],
    scope: Scope = Scope(),
    *,
    kinds: Sequence[str] | None = None,
) -> Tally:
    """Microseconds of usage inside [start, end) per (``by`` values, currency, rate), summed by
    the database: one pass grouping the intervals per machine (in the order of an index that
    covers the query, so SQLite needs no sort), then per ``by`` (any of :data:`FIELDS`). Open
    intervals run to ``end``: pass ``min(period end, now)`` for spend to date. Per machine and
    kind intervals never overlap, so no sum can overflow 64 bits."""
    u = _span(s, start, end, scope, kinds)
    if set(by) <= {"kind"} and not _sqlite(s):
        # a budget's spend needs no machine's column: PostgreSQL hashes the intervals straight
        # into (currency, rate), half the time of grouping per machine first (SQLite, though,
        # reads the scope's machines from ix_usage_machine_rate faster than the whole table)
        keys = [u.c.kind for _ in by]
        total_us = func.sum(u.c.hi - u.c.lo)
        q = (
            select(*keys, u.c.currency, u.c.rate, cast(total_us, BigInteger))
            .group_by(*keys, u.c.currency, u.c.rate)
            .having(total_us > 0)
        )
        return _tallied(s, q, len(by))
    per_machine = (
        select(
            u.c.machine_id,
            u.c.kind,
            u.c.currency,
            u.c.rate,
            func.sum(u.c.hi - u.c.lo).label("us"),
        )
        .group_by(u.c.machine_id, u.c.kind, u.c.currency, u.c.rate)
        .subquery("pm")
    )
    keys = [per_machine.c.kind if f == "kind" else column_of(f) for f in by]
    total_us = func.sum(per_machine.c.us)
    q = (
        # PostgreSQL sums bigints as numeric: 40,000 Decimals to parse, were it not cast back
        select(*keys, per_machine.c.currency, per_machine.c.rate, cast(total_us, BigInteger))
        .select_from(per_machine.join(Machine, Machine.id == per_machine.c.machine_id))
        .group_by(*keys, per_machine.c.currency, per_machine.c.rate)
        .having(total_us > 0)
    )
    _aggregating(s)
    return _tallied(s, q, len(by))


def _aggregating(s: Session) -> None:
    """PostgreSQL, for this transaction's aggregates over the whole ledger: 40,000 groups of
    texts hashed in memory, not sorted on disk (work_mem is 4 MB by default); and the scan
    split between workers. The planner guesses groups from the product of the columns'
    distinct values (98,264 for the 369 of a month's (currency, rate, day, day)), so it
    prices each worker's partial groups too high and, once the table has statistics, scans
    alone: 0.41 s where two workers take 0.23 s (bench/bench_report.py, 1M intervals)."""
    if not _sqlite(s):
        s.execute(text("SET LOCAL work_mem = '64MB'"))
        s.execute(text("SET LOCAL parallel_tuple_cost = 0.01"))


def _tallied(s: Session, q: Any, n: int) -> Tally:
    """The rows of a tally's query (``n`` key columns, currency, rate, microseconds)."""
    out = Tally()
    # one key per machine: its repeated texts (owner, project, rate…) kept once each
    same: dict[Any, Any] = {}
    for r in _stream(s, q):
        key = tuple(same.setdefault(v, v) for v in r[:n])
        out.add(key, same.setdefault(r[-3], r[-3]), same.setdefault(r[-2], r[-2]), int(r[-1]))
    return out


def _stream(s: Session, q: Any) -> Any:
    """The rows of ``q`` one at a time: through the session's connection, since an ORM
    session's ``execute`` buffers every row as an object before the first is read."""
    return s.connection().execute(q)


def day_tally(
    s: Session,
    start: datetime,
    end: datetime,
    days: Sequence[date],
    by: Sequence[str] = (),
    scope: Scope = Scope(),
    *,
    tz: str = "UTC",
    kinds: Sequence[str] | None = None,
) -> Tally:
    """Microseconds of usage per (``by`` values + local day of ``days`` in ``tz``, currency,
    rate) inside [start, end), which ``days`` (consecutive) cover.

    The database does not cut intervals at midnights. It counts, per key and day, the intervals
    that begin (their clamped start) and end in it, and the sums of their offsets into it; the
    usage of day k is then A·len(k) − o(k), A the intervals begun by day k and not ended before
    it, o(k) the offsets begun in k less those ended in k. Integers all the way: exact."""
    bounds = [epoch_us(midnight(d, tz)) for d in days]
    bounds.append(epoch_us(midnight(days[-1] + DAY, tz)))
    lengths = [b - a for a, b in pairwise(bounds)]
    every_machine = not scope.clauses() and not scope.in_python
    if _sqlite(s) and not by and bounds[0] == epoch_us(start) and every_machine:
        rows = _day_edges_by_range(s, start, end, bounds, scope, kinds)
    else:
        rows = _day_edges_grouped(s, start, end, bounds, by, scope, kinds)
    return _usage_by_day(_net(rows, len(days)), days, lengths)


Net = dict[tuple[Any, str, str], tuple[list[int], list[int]]]


def _net(rows: Iterable[Edge], n_days: int) -> Net:
    """Per (key, currency, rate) and day index: the intervals begun less those ended, and
    their offsets likewise."""
    net: Net = {}
    for key, cur, rate, day, count, offset in rows:
        if (key, cur, rate) not in net:
            net[(key, cur, rate)] = ([0] * (n_days + 1), [0] * (n_days + 1))
        counts, offsets = net[(key, cur, rate)]
        counts[int(day)] += int(count)
        offsets[int(day)] += int(offset or 0)
    return net


def _usage_by_day(net: Net, days: Sequence[date], lengths: list[int]) -> Tally:
    """The usage of each day k, A·len(k) − o(k), per (key + day, currency, rate): A the
    intervals begun by day k and not ended before it, o(k) the day's net offsets."""
    out = Tally()
    for (key, cur, rate), (counts, offsets) in net.items():
        active = 0
        for k, d in enumerate(days):
            active += counts[k]
            us = active * lengths[k] - offsets[k]
            if us:
                out.add((*key, d), cur, rate, us)
    return out


Edge = tuple[tuple[Any, ...], str, str, int, int, int]  # key, currency, rate, day, ±count, ±offset


def _day_edges_grouped(
    s: Session,
    start: datetime,
    end: datetime,
    bounds: list[int],
    by: Sequence[str],
    scope: Scope,
    kinds: Sequence[str] | None,
) -> Iterator[Edge]:
    """One GROUP BY (key, currency, rate, day begun, day ended): PostgreSQL hashes it."""
    u = _span(s, start, end, scope, kinds)
    lengths = [b - a for a, b in pairwise(bounds)]

    def day_and_offset(x: Any) -> tuple[Any, Any]:
        if len(set(lengths)) == 1:  # every day 24 h (UTC, or no clock change in the span)
            return (x - bounds[0]) // lengths[0], (x - bounds[0]) % lengths[0]
        pairs = list(pairwise(bounds))
        day = case(*((x < b, i) for i, (_, b) in enumerate(pairs)), else_=len(pairs))
        floor = case(*((x < b, a) for a, b in pairs), else_=bounds[-1])
        return day, x - floor

    (dlo, olo), (dhi, ohi) = day_and_offset(u.c.lo), day_and_offset(u.c.hi)
    keys = [u.c.kind if f == "kind" else FIELDS[f] for f in by]
    groups = [*keys, u.c.currency, u.c.rate, dlo, dhi]
    q = select(*groups, func.count(), func.sum(olo), func.sum(ohi)).group_by(*groups)
    if by and by != ["kind"] and tuple(by) != ("kind",):
        q = q.select_from(u.join(Machine, Machine.id == u.c.machine_id))
    n = len(by)
    _aggregating(s)
    for r in _stream(s, q):
        *_, cur, rate, d0, d1, count, off0, off1 = r
        yield tuple(r[:n]), cur, rate, d0, count, off0
        yield tuple(r[:n]), cur, rate, d1, -count, -off1


def _day_edges_by_range(
    s: Session,
    start: datetime,
    end: datetime,
    bounds: list[int],
    scope: Scope,
    kinds: Sequence[str] | None,
) -> Iterator[Edge]:
    """SQLite sorts to GROUP BY, and sorting a million rows is most of a report's time. Here
    each (currency, rate, day) is instead a range of an index that covers the query
    (``ix_usage_rate_start`` for the days intervals begin, ``ix_usage_rate_end`` for those they
    end): counts and sums without a sort, in one statement. Over every machine only: each
    range reads every machine's intervals, so for some machines (a budget's) sorting just
    theirs is several times faster."""
    iv = UsageInterval
    lo_us, hi_us = epoch_us(start), epoch_us(end)
    where = _usage(s, start, end, scope, kinds)
    rate = type_coerce(iv.rate, String)
    pairs = list(s.execute(select(iv.currency, rate).distinct().where(*where)))
    n = len(bounds) - 1
    days = [k for k in range(n) if bounds[k] < hi_us]
    if not pairs or not days:
        return
    d = _days(bounds, days, lo_us, hi_us)
    cr = _rows(("cur", "rate"), pairs, "cr")
    same = [iv.currency == cr.c.cur, rate == cr.c.rate, *where]
    yield from _begun_and_ended(s, d, cr, same, lo_us)
    yield from _running_at_end(s, cr, same, bounds, hi_us)


def _days(bounds: list[int], days: list[int], lo_us: int, hi_us: int) -> Any:
    """The days as constant rows: (k, its start, where its begun and ended intervals count
    from, its end within the span). Day 0 takes what began before the span; what ends at the
    span's start has no usage."""
    return _rows(
        ("k", "base", "begun_from", "ended_from", "upto"),
        [
            (
                k,
                bounds[k],
                bounds[k] if k else -(2**62),
                bounds[k] if k else lo_us + 1,
                min(bounds[k + 1], hi_us),
            )
            for k in days
        ],
        "d",
    )


def _begun_and_ended(s: Session, d: Any, cr: Any, same: list[Any], lo_us: int) -> Iterator[Edge]:
    """Per (currency, rate) and day: the edges of the intervals begun that day (from the
    span's start at the earliest) and of those ended that day."""
    iv = UsageInterval
    begun = and_(iv.start_us >= d.c.begun_from, iv.start_us < d.c.upto, *same)
    ended = and_(iv.end_us >= d.c.ended_from, iv.end_us < d.c.upto, *same)
    q = select(
        cr.c.cur,
        cr.c.rate,
        d.c.k,
        select(func.count()).where(begun).scalar_subquery(),
        select(func.sum(func.max(iv.start_us, lo_us) - d.c.base)).where(begun).scalar_subquery(),
        select(func.count()).where(ended).scalar_subquery(),
        select(func.sum(iv.end_us - d.c.base)).where(ended).scalar_subquery(),
    ).select_from(cr.join(d, true()))  # every (currency, rate) with every day
    for cur, rt, k, count, offset, gone, gone_offset in s.execute(q):
        if count:
            yield (), cur, rt, k, count, offset
        if gone:
            yield (), cur, rt, k, -gone, -gone_offset


def _running_at_end(
    s: Session, cr: Any, same: list[Any], bounds: list[int], hi_us: int
) -> Iterator[Edge]:
    """The intervals still running at the span's end (or ending after it) end there: their
    edges on the day the span ends in, when that day is among ``bounds``'."""
    iv = UsageInterval
    n = len(bounds) - 1
    last = next((k for k in range(n) if bounds[k] <= hi_us < bounds[k + 1]), n)
    if last < n:
        running = and_(or_(iv.end_us.is_(None), iv.end_us >= hi_us), *same)
        for cur, rt, still in s.execute(
            select(cr.c.cur, cr.c.rate, select(func.count()).where(running).scalar_subquery())
        ):
            if still:
                yield (), cur, rt, last, -still, -still * (hi_us - bounds[last])


def _rows(names: Sequence[str], rows: Sequence[Sequence[Any]], name: str) -> Any:
    """Constant rows as a subquery (SQLite cannot name the columns of a VALUES list)."""
    return union_all(
        *(select(*(literal(v).label(c) for c, v in zip(names, row, strict=True))) for row in rows)
    ).subquery(name)


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
    if "day" not in by:
        return tally(s, start, end, fields, scope, kinds=kinds).amounts()
    first = start.astimezone(ZoneInfo(tz)).date()
    days = [first]
    while midnight(days[-1] + DAY, tz) < end:
        days.append(days[-1] + DAY)
    return day_tally(s, start, end, days, fields, scope, tz=tz, kinds=kinds).amounts()


def total(s: Session, start: datetime, end: datetime, scope: Scope = Scope()) -> Amounts:
    return spend_by(s, start, end, (), scope).get((), Amounts())
