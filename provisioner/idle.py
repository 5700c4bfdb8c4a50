"""The idle signal: whether a machine has been idle for a rule's window, from the heartbeats
:mod:`provisioner.heartbeats` keeps — the evidence summed up by the database for a sweep, the
verdict, each machine's rules and threshold, and the machines idle now.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import func, select

from policies.schema import IdleRule, Policy, matching
from provisioner.models import Event, Heartbeat, Machine, UTCDateTime, epoch_us
from provisioner.schema import RUNNING_SINCE

if TYPE_CHECKING:
    from provisioner.app import App

Signal = Literal["idle", "busy", "unknown", "starting"]
RUNNING_SINCE_EVENTS = RUNNING_SINCE


@dataclass(frozen=True)
class Beat:
    at: datetime
    max_util: float | None


@dataclass(frozen=True)
class Evidence:
    """What the verdict needs of a machine's heartbeats for one window (times in microseconds
    since 1970): the first beat at or after ``start - grace`` and the latest one, the busiest
    GPU and the beats that saw no GPU at or after ``start``, and the longest silence between
    two beats at or after ``start - grace``. The database sums these up (:func:`evidence`), so
    a sweep over a thousand machines reads a row per machine, not each heartbeat."""

    first_us: int | None
    last_us: int | None
    top: float | None
    blind: int
    gap_us: int | None

    @classmethod
    def of(
        cls, beats: list[Beat], *, now: datetime, window: timedelta, grace: timedelta
    ) -> Evidence:
        """The same, from heartbeats in hand (oldest first)."""
        lo, start = epoch_us(now - window - grace), epoch_us(now - window)
        seen = [epoch_us(b.at) for b in beats if epoch_us(b.at) >= lo]
        inside = [b.max_util for b in beats if epoch_us(b.at) >= start]
        return cls(
            seen[0] if seen else None,
            seen[-1] if seen else None,
            max((u for u in inside if u is not None), default=None),
            sum(u is None for u in inside),
            max((b - a for a, b in itertools.pairwise(seen)), default=None),
        )


def judge(
    ev: Evidence,
    *,
    now: datetime,
    running_since: datetime | None,
    below: float,
    window: timedelta,
    grace: timedelta,
) -> Signal:
    """Idle = every GPU below ``below`` percent for the whole ``window``, seen without a gap
    longer than ``grace``. Silence for longer than ``grace`` (or an agent that sees no GPU)
    is ``unknown``; a machine that has not run for the whole window yet is ``starting``."""
    start = now - window
    if running_since is not None and running_since > start:
        return "starting"
    g, now_us = grace // timedelta(microseconds=1), epoch_us(now)
    if ev.first_us is None or ev.last_us is None or ev.last_us < now_us - g:
        return "unknown"
    if ev.top is not None and ev.top >= below:
        return "busy"
    if ev.blind:
        return "unknown"
    if ev.first_us > epoch_us(start) + g or (ev.gap_us is not None and ev.gap_us > g):
        return "unknown"
    return "idle"


def classify(
    beats: list[Beat],
    *,
    now: datetime,
    running_since: datetime | None,
    below: float,
    window: timedelta,
    grace: timedelta,
) -> Signal:
    """:func:`judge` of heartbeats in hand (oldest first)."""
    ev = Evidence.of(beats, now=now, window=window, grace=grace)
    return judge(ev, now=now, running_since=running_since, below=below, window=window, grace=grace)


def beat_machine(app: App) -> Any:
    """The heartbeat's machine id to group recent heartbeats by. On SQLite an expression, not
    the column: grouping by the column, SQLite walks the (machine, time) index over the whole
    day kept, for its order, instead of reading the last minutes by the time index (a day of
    1,000 machines: 0.29 s -> 0.04 s)."""
    col = Heartbeat.__table__.c.machine_id
    return col.concat("") if app.db.engine.dialect.name == "sqlite" else col


def evidence(
    app: App,
    machine_ids: Iterable[str],
    now: datetime,
    windows: Iterable[timedelta],
    grace: timedelta,
    busy_at: float | None = None,
) -> dict[tuple[str, timedelta], Evidence]:
    """Each machine's :class:`Evidence` for each window, summed up by the database (times as
    exact integer microseconds): one query for all machines, then the silences (``lag`` over
    each machine's beats, the costly part) only of those whose verdict still turns on them.
    ``busy_at``: the highest threshold of any rule; a machine whose busiest GPU reaches it is
    busy whatever its silences, and its ``gap_us`` is left None."""
    wanted, spans = set(machine_ids), sorted(set(windows))
    if not wanted or not spans:
        return {}
    with app.db.session() as s:
        out, silent = _summed(app, s, wanted, now, spans, grace, busy_at)
        _add_gaps(app, s, out, sorted(silent), now, spans, grace)
    return out


def _summed(
    app: App,
    s: Any,
    wanted: set[str],
    now: datetime,
    spans: list[timedelta],
    grace: timedelta,
    busy_at: float | None,
) -> tuple[dict[tuple[str, timedelta], Evidence], set[str]]:
    """:func:`evidence`'s one query for all machines, without the silences; and the machines
    whose silences decide some window's verdict."""
    from sqlalchemy import and_, case, type_coerce

    since = now - spans[-1] - grace
    g, now_us = grace // timedelta(microseconds=1), epoch_us(now)
    starts = [now - w for w in spans]
    at, util = Heartbeat.at, Heartbeat.max_util  # compared as stored: no arithmetic per row
    machine = beat_machine(app)
    cols: list[Any] = [machine, func.max(at)]
    for start in starts:
        cols += [
            type_coerce(func.min(case((at >= start - grace, at))), UTCDateTime),
            func.max(case((at >= start, util))),
            func.sum(case((and_(at >= start, util.is_(None)), 1), else_=0)),
        ]
    out: dict[tuple[str, timedelta], Evidence] = {}
    silent: set[str] = set()  # machines whose silences decide some window's verdict
    query = select(*cols).where(at >= since).group_by(machine)
    if len(wanted) <= 500:  # a page of the fleet: by its machines' index, not the whole
        query = query.where(Heartbeat.machine_id.in_(wanted))
    for row in s.execute(query):
        if row[0] not in wanted:
            continue
        for i, (w, start) in enumerate(zip(spans, starts, strict=True)):
            ev = out[row[0], w] = _from_sums(row[1], *row[2 + 3 * i : 5 + 3 * i])
            if _turns_on_silence(ev, now_us - g, epoch_us(start) + g, busy_at):
                silent.add(row[0])
    return out, silent


def _from_sums(last: datetime, first: datetime | None, top: Any, blind: Any) -> Evidence:
    """A window's :class:`Evidence` from its sums (no beat in it: no first, no last)."""
    return Evidence(
        None if first is None else epoch_us(first),
        None if first is None else epoch_us(last),
        None if top is None else float(top),
        int(blind or 0),
        None,
    )


def _turns_on_silence(ev: Evidence, heard_from: int, first_by: int, busy_at: float | None) -> bool:
    """Whether ``ev``'s verdict still turns on its silences: heard lately, from early enough,
    with every GPU seen and none busy for sure."""
    return (
        ev.first_us is not None
        and ev.last_us is not None
        and ev.last_us >= heard_from
        and (busy_at is None or ev.top is None or ev.top < busy_at)
        and not ev.blind
        and ev.first_us <= first_by
    )


def _add_gaps(
    app: App,
    s: Any,
    out: dict[tuple[str, timedelta], Evidence],
    todo: list[str],
    now: datetime,
    spans: list[timedelta],
    grace: timedelta,
) -> None:
    """The longest silence of each of ``todo`` in each window, into ``out`` (``lag`` over
    each machine's beats: the costly part)."""
    from sqlalchemy import case, literal

    col, us = epoch_us_sql(app)
    since = now - spans[-1] - grace
    bounds = [epoch_us(now - w - grace) for w in spans]  # the silences: from start - grace
    for k in range(0, len(todo), 500):  # bound the IN list
        gaps = (
            select(
                Heartbeat.machine_id.label("mid"),
                us.label("us"),
                func.lag(us).over(partition_by=Heartbeat.machine_id, order_by=col).label("prev"),
            )
            .where(Heartbeat.at >= since, Heartbeat.machine_id.in_(todo[k : k + 500]))
            .subquery()
        )
        q = [gaps.c.mid] + [
            func.max(case((gaps.c.prev >= literal(lo), gaps.c.us - gaps.c.prev))) for lo in bounds
        ]
        for row in s.execute(select(*q).group_by(gaps.c.mid)):
            for i, w in enumerate(spans):
                if row[1 + i] is not None and (row[0], w) in out:
                    out[row[0], w] = replace(out[row[0], w], gap_us=int(row[1 + i]))


def epoch_us_sql(app: App) -> tuple[Any, Any]:
    """The heartbeat time column and it as exact integer microseconds since 1970 in SQL."""
    from sqlalchemy import BigInteger, Integer, cast

    col = Heartbeat.__table__.c.at
    if app.db.engine.dialect.name == "sqlite":  # stored as 'YYYY-MM-DD HH:MM:SS.ffffff'
        whole = func.strftime("%s", func.substr(col, 1, 19))  # no rounding of .999999 up
        return col, cast(whole, Integer) * 1_000_000 + cast(func.substr(col, 21, 6), Integer)
    return col, cast(func.round(func.extract("epoch", col) * 1_000_000), BigInteger)


def running_since(app: App, machine_ids: Iterable[str]) -> dict[str, datetime]:
    """When each machine last came up (launched, started, seen running again)."""
    wanted = set(machine_ids)
    with app.db.session() as s:
        rows = s.execute(
            select(Event.machine_id, func.max(Event.at))
            .where(Event.kind.in_(RUNNING_SINCE_EVENTS))
            .group_by(Event.machine_id)
        )
        return {mid: at for mid, at in rows if mid in wanted}


def threshold(rules: Iterable[IdleRule]) -> tuple[float, bool]:
    """The machine's idle threshold (its rules' lowest, else the default) and whether silence
    counts as idle (a rule of its says so)."""
    rules = list(rules)
    below = min((r.gpu_util_below for r in rules), default=IdleRule().gpu_util_below)
    return below, any(r.unknown_counts_as_idle for r in rules)


def idle_rules(policies: list[Policy], m: Machine) -> list[IdleRule]:
    """The machine's idle rules: its matching policies' and its experiment's own."""
    rules = [p.idle_rule for p in matching(policies, m.project, m.owner) if p.idle_rule]
    own = ((m.spec or {}).get("lifecycle") or {}).get("idle")
    return rules + ([IdleRule(**own)] if own else [])


IDLE_NOW = timedelta(minutes=10)  # GPUs below the threshold this long: flagged "idle now"


@dataclass(frozen=True)
class IdleNow:
    """A running machine whose GPUs have stayed below ``below`` % since ``since``."""

    machine_id: str
    since: datetime
    below: float


def idle_now(
    app: App, now: datetime, thresholds: dict[str, float], grace: timedelta
) -> dict[str, IdleNow]:
    """Of the running machines in ``thresholds`` (id: its idle threshold), those idle now: heard
    within ``grace``, every GPU below the threshold in every heartbeat since the last busy one,
    for :data:`IDLE_NOW` at least. ``since``: the first heartbeat after the last busy one (or,
    with none in the day of heartbeats kept, when the machine came up, else its first
    heartbeat). A heartbeat without GPUs (``max_util`` None) counts as busy: not judged. One
    query over the last minutes of every machine's heartbeats (:func:`_idle_candidates`), then
    one (two passes) per distinct threshold over the day of the machines still in question,
    summed up by the database."""

    by_below: dict[float, list[str]] = {}
    for mid in _idle_candidates(app, now, thresholds, grace):
        by_below.setdefault(thresholds[mid], []).append(mid)
    latest, first_idle = _idle_marks(app, by_below)
    came_up = running_since(app, [m for m in first_idle if m in latest])
    out: dict[str, IdleNow] = {}
    for mid, first in first_idle.items():
        last = latest.get(mid)
        if last is None or now - last > grace:
            continue
        since = first
        up = came_up.get(mid)
        if up is not None and up > since:  # beats of an earlier run: from when it came up
            since = up
        if now - since >= IDLE_NOW:
            out[mid] = IdleNow(mid, since, thresholds[mid])
    return out


def _idle_marks(
    app: App, by_below: dict[float, list[str]]
) -> tuple[dict[str, datetime], dict[str, datetime]]:
    """Of the machines by idle threshold, each one's latest heartbeat and its first one after
    its last busy one (one query, two passes, per threshold and 500 machines)."""
    from sqlalchemy import case, or_

    h = Heartbeat
    latest: dict[str, datetime] = {}
    first_idle: dict[str, datetime] = {}
    with app.db.session() as s:
        for below, ids in by_below.items():
            for k in range(0, len(ids), 500):
                chunk = ids[k : k + 500]
                busy = or_(h.max_util.is_(None), h.max_util >= below)
                marks = (  # each machine's latest heartbeat and latest busy one, in one pass
                    select(
                        h.machine_id.label("mid"),
                        func.max(h.at).label("last_at"),
                        func.max(case((busy, h.at))).label("busy_at"),
                    )
                    .where(h.machine_id.in_(chunk))
                    .group_by(h.machine_id)
                    .subquery()
                )
                rows = s.execute(
                    select(h.machine_id, marks.c.last_at, func.min(h.at))
                    .join(marks, marks.c.mid == h.machine_id)
                    .where(
                        h.machine_id.in_(chunk),
                        or_(marks.c.busy_at.is_(None), h.at > marks.c.busy_at),
                    )
                    .group_by(h.machine_id, marks.c.last_at)
                )
                for mid, last, first in rows:
                    latest[mid], first_idle[mid] = last, first
    return latest, first_idle


def _idle_candidates(
    app: App, now: datetime, thresholds: dict[str, float], grace: timedelta
) -> list[str]:
    """The machines :func:`idle_now` must look into, found in the last minutes alone: heard
    within ``grace`` and not busy within :data:`IDLE_NOW` (a busy heartbeat then means idle
    for less than that). A fleet at work is mostly left out, without a pass over its day."""
    from sqlalchemy import case, or_

    if not thresholds:
        return []
    h, recent = Heartbeat, now - IDLE_NOW
    belows = sorted(set(thresholds.values()))
    col = {below: 2 + i for i, below in enumerate(belows)}
    machine = beat_machine(app)
    cols: list[Any] = [machine, func.max(h.at)]
    cols += [
        func.max(case((or_(h.max_util.is_(None), h.max_util >= below), h.at))) for below in belows
    ]
    out = []
    with app.db.session() as s:
        rows = s.execute(select(*cols).where(h.at >= recent - grace).group_by(machine))
        for row in rows:
            below = thresholds.get(row[0])
            if below is None or now - row[1] > grace:
                continue
            busy = row[col[below]]
            if busy is None or busy < recent:
                out.append(row[0])
    return out
