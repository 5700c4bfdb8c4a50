"""The dashboard's fleet page: every live machine with what it has cost (the rows ``status``
lists, :func:`provisioner.views.status.read_fleet`: one cost for both), its GPU utilisation, why
it is up and the next thing the scheduler will do to it, in the page's words."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from provisioner import idle
from provisioner.errors import UserError
from provisioner.jobs import outlook, sweep
from provisioner.money import Money, Rates
from provisioner.render import Fmt
from provisioner.schema import MachineStatus as S
from provisioner.views.status import MachineDetail, machine_detail, monies, read_fleet
from provisioner.views.summary import COUNTS, IdleMachine, Summary, burn, summary

if TYPE_CHECKING:
    from provisioner.app import App
    from provisioner.budget import Status
    from provisioner.models import Heartbeat, Machine

SPARK_SPAN = timedelta(hours=2)  # the sparklines: the last two hours of heartbeats
SPARK_STEP = timedelta(minutes=5)
PER_PAGE = 100  # rows on a page: sparklines, next moves and act forms are made for these only


@dataclass
class Row:
    machine: Machine
    spent: list[Money]  # per currency, across its launches: what `status` says
    beats: list[tuple[datetime, float | None]]
    why: str
    next_action: str
    next_at: datetime | None
    tz: ZoneInfo | None  # the team's (:attr:`App.zone`): times are shown in it
    move: outlook.Move | None = None  # the decision behind ``next_action``
    idle: IdleMachine | None = None  # idle now: since when, what it has wasted
    burn: Money | None = None  # per hour now (:func:`provisioner.views.summary.burn`)
    #: ``spent`` and ``burn`` as shown (rounded alone); the totals row sums these
    spent_shown: list[Money] = field(default_factory=list)
    burn_shown: Money | None = None
    #: the highest GPU utilisation in its latest sparkline step (the figure shown beside it)
    util: float | None = None
    #: the summary's count it is in (``held``: preempted, its relaunch refused or given up)
    state: str = ""
    #: ``next_action`` in one short line, for the table (the whole of it on the machine page)
    next_short: str = ""


#: ``state=``: the summary's counts (``idle``: running and idle now)
STATES = COUNTS
#: ``sort=``: the fleet's columns. Money sorts by its amount converted to the settings'
#: currency (``rates``), names naturally (gpu-2 before gpu-10); a row without the value last.
SORTS = ("name", "project", "owner", "gpu", "state", "util", "cost", "burn", "next")
FILTERS = ("budget", "project", "owner", "cloud", "state")


@dataclass
class Fleet:
    rows: list[Row]
    projects: list[str]
    owners: list[str]
    clouds: list[str]
    filters: dict[str, str]
    total: int  # live machines before filtering
    spark_start: datetime
    at: datetime  # as of
    spent: list[Money]  # the rows' spend, per currency
    summary: Summary | None = None  # what burns now, counts, budgets, idle now
    burning: list[Money] = field(default_factory=list)  # the rows' burn per hour, per currency
    budgets: list[str] = field(default_factory=list)  # the policies with a budget
    sort: str = ""
    desc: bool = False
    count: int = 0  # the machines filtered: the totals are theirs, over every page
    page: int = 1
    pages: int = 1
    first: int = 0  # the rows shown are ``first``-th to ``first + len(rows) - 1``-th (from 1)


@dataclass(frozen=True)
class FleetQuery:
    """What a fleet page asks for: its filters (``budget``: the machines that policy's budget
    covers; exact ``project``, ``owner``, ``cloud``; ``state``: one of the summary's counts),
    its sort (a column of :data:`SORTS`, ``desc``) and its page (from 1; past the last: the
    last)."""

    filters: Mapping[str, str] = field(default_factory=dict)
    sort: str = ""
    desc: bool = False
    page: int = 1

    @classmethod
    def parse(cls, query: Mapping[str, str]) -> FleetQuery:
        """From a page's query string (``sort``, ``dir``, ``page`` and the filters). Bad
        input: :class:`UserError`."""
        chosen = {k: query[k] for k in FILTERS if query.get(k)}
        sort, desc = _sort_of(query)
        page = _page_of(query)
        state = chosen.get("state")
        if state is not None and state not in STATES:
            raise UserError(f"state {state!r}: one of {', '.join(STATES)}")
        return cls(chosen, sort, desc, page)

    def admits(self, m: Machine) -> bool:
        """``m`` has the exact project, owner and cloud asked for."""
        return all(
            getattr(m, k) == v for k in EXACT if (v := self.filters.get(k, EVERYONE)) != EVERYONE
        )


#: ``owner=*``: every owner's machines, chosen over a signed-in user's own (:func:`mine_first`).
EVERYONE = "*"


def mine_first(query: Mapping[str, str], user: str | None) -> dict[str, str]:
    """The fleet page's query with "my machines" the signed-in ``user``'s default: the page
    opened with no filter shows theirs (kept as ``owner=<them>`` in its links); a filter asked
    (a budget's, a project's machines…) is everyone's in it; the owner filter's "all"
    (``owner=``) is everyone's, kept as ``owner=*``. Anonymous viewers see every machine."""
    q = dict(query)
    if user is not None:
        if "owner" not in q and not any(q.get(k) for k in FILTERS):
            q["owner"] = user
        elif "owner" in q and not q["owner"]:
            q["owner"] = EVERYONE
    return q


EXACT = ("project", "owner", "cloud")  # the filters a machine's own column answers


def fleet(
    app: App,
    now: datetime,
    f: Fmt,
    query: FleetQuery | Mapping[str, str],
    paged: bool = True,
    budgets: Callable[[], list[Status]] | None = None,
) -> Fleet:
    """Every live machine, filtered and sorted as ``query`` asks (a :class:`FleetQuery`, or
    the page's query string it is parsed from), with what it has cost, its GPU utilisation,
    why it is up and the next thing the scheduler will do to it. ``paged``: only
    :data:`PER_PAGE` rows, the only ones given sparklines and next moves (the costly parts);
    the totals are over every filtered machine either way. Not paged (the CSV): every row with
    its next move, without sparklines. ``budgets``: every budget's standing, as other pages
    share it (default: made anew). Bad input: :class:`UserError`."""
    q = query if isinstance(query, FleetQuery) else FleetQuery.parse(query)
    with_budget = _with_budget(app)
    listed = {r.id: r for r in read_fleet(app, all_=False).rows}
    live = _live(app)
    machines = _filtered(live, q, with_budget)
    sm = summary(app, now, machines, budgets() if budgets else None)  # of machines in any state
    if (state := q.filters.get("state")) is not None:
        machines = [m for m in machines if sm.in_state(m, state)]
    make = _Making(app, now, f, listed, now - SPARK_SPAN)
    every = q.sort == "next" or not paged  # every row's next move: the sort needs it, the CSV too
    rows = make.ordered(make.rows(machines, sm), q, every)
    spent_total, burn_total = _share(rows), _share_burn(rows)
    shown, page, pages, first = make.page(rows, q, every) if paged else (rows, 1, 1, 0)
    return Fleet(
        shown,
        *_choices(live),
        dict(q.filters),
        len(live),
        make.start,
        now,
        spent_total,
        sm,
        burn_total,
        sorted(with_budget),
        q.sort,
        q.desc,
        len(rows),
        page,
        pages,
        first + 1 if shown else 0,
    )


def _with_budget(app: App) -> dict[str, Any]:
    """The policies with a budget, by name."""
    return {p.name: p for p in app.policies if p.budget is not None}


def _choices(live: list[Machine]) -> tuple[list[str], list[str], list[str]]:
    """What the filters offer: the live machines' projects, owners and clouds."""
    return (
        sorted({m.project for m in live}),
        sorted({m.owner for m in live}),
        sorted({m.cloud for m in live if m.cloud}),
    )


def _filtered(live: list[Machine], q: FleetQuery, with_budget: Mapping[str, Any]) -> list[Machine]:
    """The machines with the project, owner and cloud asked for, that the budget asked for
    covers. A policy with no budget: :class:`UserError`, naming those that have one."""
    name = q.filters.get("budget")
    if name is not None and name not in with_budget:
        raise UserError(
            f"no policy {name!r} with a budget (budgets: "
            f"{', '.join(sorted(with_budget)) or 'none'})"
        )
    covers = with_budget[name].applies_to.matches if name is not None else None
    return [m for m in live if q.admits(m) and (covers is None or covers(m.project, m.owner))]


def _live(app: App) -> list[Machine]:
    from sqlalchemy import select

    from provisioner.models import ACTIVE_EXCLUDED, Machine

    with app.db.session() as s:
        return list(
            s.scalars(
                select(Machine)
                .where(Machine.status.not_in(ACTIVE_EXCLUDED))
                .order_by(Machine.project, Machine.name)
            )
        )


@dataclass
class _Making:
    """What each step of making a fleet's rows needs."""

    app: App
    now: datetime
    f: Fmt
    listed: Mapping[str, Any]  # the rows ``status`` lists, by machine id: their costs
    start: datetime  # of the sparklines

    def rows(self, machines: list[Machine], sm: Summary) -> list[Row]:
        """Each machine's row: its cost as ``status`` lists it, idle now, its burn."""
        idle_now = {i.machine.id: i for i in sm.idle}
        rows = []
        for m in machines:
            lr = self.listed.get(m.id)
            spent = monies(lr.spent) if lr is not None else []
            idle = idle_now.get(m.id)
            row = Row(m, spent, [], "", "", None, None, idle=idle, burn=burn(m))
            row.state = sm.state_of.get(m.id, m.status)
            rows.append(row)
        return rows

    def ordered(self, rows: list[Row], q: FleetQuery, every: bool) -> list[Row]:
        """``rows`` sorted as ``q`` asks; ``every``: each with its next move."""
        if every:
            _moves(self.app, self.now, self.f, rows, self.listed)
        if q.sort == "util":
            ids = [r.machine.id for r in rows]
            utils = latest_util(self.app, ids, self.start, self.now, SPARK_STEP)
            for r in rows:
                r.util = utils.get(r.machine.id)
        return sort_rows(rows, q.sort, q.desc, self.app.settings.money_rates) if q.sort else rows

    def page(self, rows: list[Row], q: FleetQuery, every: bool) -> tuple[list[Row], int, int, int]:
        """The page ``q`` asks for (past the last: the last), with the sparklines and (unless
        ``every`` row has it) the next moves: the page shown, its number, how many there are,
        the index of its first row."""
        pages = max(1, -(-len(rows) // PER_PAGE))
        page = min(q.page, pages)
        first = (page - 1) * PER_PAGE
        shown = rows[first : first + PER_PAGE]
        if not every:
            _moves(self.app, self.now, self.f, shown, self.listed)
        beats = spark_points(self.app, [r.machine.id for r in shown], self.start, SPARK_STEP)
        for r in shown:
            r.beats = beats.get(r.machine.id, [])
            r.util = r.beats[-1][1] if r.beats else None
        return shown, page, pages, first


def _moves(app: App, now: datetime, f: Fmt, rows: list[Row], listed: Mapping[str, Any]) -> None:
    """``rows``' next moves (``sweep --dry-run``'s decisions), why each is up and its calendar's
    time zone."""
    if not rows:
        return
    by_id = {r.machine.id: r for r in rows}
    assessed, failed = sweep.assess(app, now, [r.machine for r in rows])
    decided = outlook.moves(app, now, assessed)
    zone = app.zone  # one time zone on every row: the team's
    for mid, e in failed.items():  # shown, with why the scheduler cannot judge it
        by_id[mid].why = f"rules cannot be evaluated: {e}"
    for a in assessed:
        m, row = a.machine, by_id[a.machine.id]
        row.move = decided[m.id]
        row.next_action, row.next_at = _next(row.move, now, f)
        row.next_short = _short(row.move, now, f)
        listed_row = listed.get(m.id)
        row.why = (
            listed_row.why
            if m.status == S.WAITING and listed_row is not None and listed_row.why
            else _why_up(a, now, f, zone)
        )
        row.tz = zone


def row_of(app: App, now: datetime, f: Fmt, m: Machine) -> Row:
    """One machine's row as the fleet makes it, for its own page: idle now, its next move in
    full (the fleet shows it in one short line) and why it is up."""
    from provisioner.views.summary import idle_of

    row = Row(m, [], [], "", "", None, None, idle=idle_of(app, now, m), burn=burn(m))
    if m.status in (S.RUNNING, S.PENDING, S.STOPPED, S.PREEMPTED, S.WAITING):
        listed = {r.id: r for r in read_fleet(app, all_=False).rows if r.id == m.id}
        _moves(app, now, f, [row], listed)
    return row


def _page_of(query: Mapping[str, str]) -> int:
    text = query.get("page", "") or "1"
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise UserError(f"page {text!r}: a whole number from 1")
    return int(text)


def _sort_of(query: Mapping[str, str]) -> tuple[str, bool]:
    sort, way = query.get("sort", ""), query.get("dir", "") or "asc"
    if sort and sort not in SORTS:
        raise UserError(f"sort {sort!r}: one of {', '.join(SORTS)}")
    if way not in ("asc", "desc"):
        raise UserError(f"dir {way!r}: asc or desc")
    return sort, way == "desc"


def natural(text: str | None) -> tuple[Any, ...]:
    """``gpu-2`` before ``gpu-10``: runs of digits compared as numbers."""
    return tuple(
        (0, int(p), "") if p.isdigit() else (1, 0, p.casefold())
        for p in re.split(r"(\d+)", text or "")
        if p
    )


def sort_rows(rows: list[Row], by: str, desc: bool, rates: Rates) -> list[Row]:
    """``rows`` by column ``by``, ties by name; rows without a value (no cost, no heartbeat,
    nothing scheduled) last either way."""

    def convert(monies: list[Money]) -> Decimal:
        return sum((rates.convert(mo, rates.base).amount for mo in monies), Decimal(0))

    keys: dict[str, Callable[[Row], Any]] = {
        "name": lambda r: natural(r.machine.name),
        "project": lambda r: natural(r.machine.project),
        "owner": lambda r: natural(r.machine.owner),
        "gpu": lambda r: (natural(r.machine.gpu), r.machine.gpu_count) if r.machine.gpu else None,
        "state": lambda r: r.machine.status,
        "util": lambda r: r.util,
        "cost": lambda r: convert(r.spent) if r.spent else None,
        "burn": lambda r: convert([r.burn]) if r.burn else None,
        "next": lambda r: r.next_at,
    }
    key = keys[by]
    rows = sorted(rows, key=lambda r: natural(r.machine.name))
    valued = [r for r in rows if key(r) is not None]
    return sorted(valued, key=key, reverse=desc) + [r for r in rows if key(r) is None]


def _share(rows: list[Row]) -> list[Money]:
    """Each row's cost to the cent as ``status NAME`` and the machine page show it; the totals
    are the sums of the rows as shown, so the table adds up (per currency)."""
    totals: dict[str, Decimal] = {}
    for r in rows:
        r.spent_shown = sorted((mo.rounded() for mo in r.spent), key=lambda mo: mo.currency)
        for mo in r.spent_shown:
            totals[mo.currency] = totals.get(mo.currency, Decimal(0)) + mo.amount
    return [Money(a, c) for c, a in sorted(totals.items())]


def _share_burn(rows: list[Row]) -> list[Money]:
    """The same for what the rows burn per hour: the totals are the landing summary's
    "burning now" when nothing is filtered out."""
    totals: dict[str, Decimal] = {}
    for r in rows:
        if r.burn is not None:
            r.burn_shown = r.burn  # to the cent already (:func:`burn`)
            c = r.burn.currency
            totals[c] = totals.get(c, Decimal(0)) + r.burn_shown.amount
    return [Money(a, c) for c, a in sorted(totals.items())]


def _bucket(app: App, start: datetime, step: timedelta) -> Any:
    """A heartbeat's sparkline step since ``start`` (0, 1, …) in SQL."""
    from sqlalchemy import Integer, cast, func

    from provisioner.models import Heartbeat

    col = Heartbeat.__table__.c.at  # the raw column: no datetime per heartbeat in Python
    secs = step.total_seconds()
    base = int(start.timestamp())
    if app.db.engine.dialect.name == "sqlite":
        import sqlite3

        # unixepoch() (SQLite 3.38) is a fifth cheaper than strftime('%s') over 240,000 rows
        fn = func.unixepoch if sqlite3.sqlite_version_info >= (3, 38) else _strftime_s
        return (cast(fn(col), Integer) - base) // int(secs)  # whole seconds
    return func.floor((func.extract("epoch", col) - base) / secs)


def spark_points(
    app: App, ids: list[str], start: datetime, step: timedelta
) -> dict[str, list[tuple[datetime, float | None]]]:
    """Each machine's highest GPU utilisation per ``step`` since ``start``, summed up by the
    database (a sparkline needs 24 points, not the 240 heartbeats of two hours)."""
    from sqlalchemy import func, select

    from provisioner.models import Heartbeat

    if not ids:
        return {}
    bucket = _bucket(app, start, step).label("bucket")
    machine = Heartbeat.machine_id
    q = (
        select(machine, bucket, func.max(Heartbeat.max_util))
        .where(Heartbeat.at >= start, machine.in_(ids))  # a page of machines: by their index
        .group_by(machine, bucket)
        .order_by(machine, bucket)
    )
    out: dict[str, list[tuple[datetime, float | None]]] = {}
    middle: dict[int, datetime] = {}  # each bucket's time, made once, not once per machine
    with app.db.session() as s:
        for mid, k, util in s.execute(q):
            k = int(k)
            if k not in middle:
                middle[k] = start + step * k + step / 2
            out.setdefault(mid, []).append((middle[k], None if util is None else float(util)))
    return out


def latest_util(
    app: App, ids: list[str], start: datetime, now: datetime, step: timedelta
) -> dict[str, float | None]:
    """The last point of each machine's sparkline since ``start`` (:func:`spark_points`), the
    figure shown beside it, without the sparklines: each machine's latest heartbeat (looked
    for in the last ``step`` first: a fleet at work is found there), then the highest
    utilisation from the start of that heartbeat's step on."""
    from sqlalchemy import and_, func, or_, select

    from provisioner.models import Heartbeat as h

    secs, base = int(step.total_seconds()), int(start.timestamp())
    steps: dict[datetime, list[str]] = {}  # the start of each machine's latest step
    wanted, machine = set(ids), idle.beat_machine(app)
    with app.db.session() as s:
        for since in (max(start, now - step), start):
            if not wanted:
                break
            last = s.execute(select(machine, func.max(h.at)).where(h.at >= since).group_by(machine))
            for mid, at in last:
                if mid in wanted:
                    wanted.discard(mid)
                    k = int((at.timestamp() - base) // secs)
                    begin = max(start, datetime.fromtimestamp(base + k * secs, start.tzinfo))
                    steps.setdefault(begin, []).append(mid)
        if not steps:
            return {}
        within = or_(*(and_(h.at >= b, h.machine_id.in_(mids)) for b, mids in steps.items()))
        rows = s.execute(
            select(h.machine_id, func.max(h.max_util)).where(within).group_by(h.machine_id)
        )
        return {mid: None if u is None else float(u) for mid, u in rows}


def _strftime_s(col: Any) -> Any:
    from sqlalchemy import func

    return func.strftime("%s", col)


def _why_up(a: sweep.Assessment, now: datetime, f: Fmt, zone: ZoneInfo) -> str:
    m = a.machine
    if m.kept_until is not None and m.kept_until > now:
        return f.t("dash_why_kept", when=when(f, m.kept_until, now, zone))
    if m.status != S.RUNNING:
        try:
            return f.t(f"dash_state_{m.status}")
        except KeyError:
            return m.status
    if not a.rules.idle:
        return f.t("dash_why_no_rule")
    reasons = []
    for check, signal in a.signals.items():
        if check.calendar is not None and check.calendar.why_off(now) is None:
            reasons.append(f.t("dash_why_in_hours", policy=check.source))
        elif signal == "busy":
            reasons.append(f.t("dash_why_busy", below=f"{check.rule.gpu_util_below:g}"))
        else:
            reasons.append(f.t(f"dash_why_{signal}"))
    return "; ".join(dict.fromkeys(reasons))


def _next(move: outlook.Move, now: datetime, f: Fmt) -> tuple[str, datetime | None]:
    """The scheduler's next move in the page's words, and when
    (:func:`provisioner.jobs.outlook.moves`: the decision ``sweep --dry-run`` prints)."""
    params = dict(move.params)
    if "action" in params:
        params["action"] = f.t(f"dash_act_{params['action']}")
    if move.due(now):
        action = f.t(f"dash_act_{move.action}")
        return f.t("dash_next_now", action=action, why=move.why), now
    return f.t(move.key, **params), move.at


def _short(move: outlook.Move, now: datetime, f: Fmt) -> str:
    """The next move in one short line (``stop if idle after`` 19:20 …): the rule, its policy
    and why are on the machine page."""
    if move.due(now):
        return f.t("dash_short_now", action=f.t(f"dash_act_{move.action}"))
    params = dict(move.params)
    if "action" in params:
        params["action"] = f.t(f"dash_act_{params['action']}")
    key = "dash_next_idle_at" if move.key == "dash_next_idle" and move.at else move.key
    try:
        return f.t(key + "_short", **params)
    except KeyError:
        return f.t(move.key, **params)


def when(f: Fmt, at: datetime, now: datetime, tz: ZoneInfo | None = None) -> str:
    """``19:20 Europe/Berlin`` today, ``Tue 3 Nov 19:20 …`` another day."""
    zone = tz or ZoneInfo("UTC")
    return _when(f.locale, at, now.astimezone(zone).date(), zone)


@functools.lru_cache(maxsize=4096)
def _when(locale: Any, at: datetime, today: date, zone: ZoneInfo) -> str:
    """Formatted once per instant: a fleet's machines share their next stops (19:20 …)."""
    from babel.dates import format_datetime

    local = at.astimezone(zone)
    pattern = "HH:mm" if local.date() == today else "EEE d MMM HH:mm"
    return f"{format_datetime(local, pattern, locale=locale)} {zone.key}"


# --- one machine ------------------------------------------------------------------------------

MACHINE_BEATS = timedelta(hours=24)  # a machine's page (heartbeats are kept a day)


@dataclass
class MachinePage:
    """The dashboard's machine page: ``status NAME``'s detail (its cost across launches, the
    parts of it adding up to it) and the day's heartbeats."""

    detail: MachineDetail
    beats: list[Heartbeat]
    beats_start: datetime

    @property
    def machine(self) -> Machine:
        return self.detail.machine

    @property
    def points(self) -> list[tuple[datetime, float | None]]:
        return [(b.at, b.max_util) for b in self.beats]


def machine_page(app: App, now: datetime, key: str) -> MachinePage | None:
    """By id, else the machine of that name ``status NAME`` shows."""
    from sqlalchemy import select

    from provisioner.models import Heartbeat

    d = machine_detail(app, key, by_id=True)
    if d is None:
        return None
    start = now - MACHINE_BEATS
    with app.db.session() as s:
        beats = list(
            s.scalars(
                select(Heartbeat)
                .where(Heartbeat.machine_id == d.machine.id, Heartbeat.at >= start)
                .order_by(Heartbeat.at)
            )
        )
    # the sparkline spans the heartbeats kept (a day at most), not an empty day before them
    return MachinePage(d, beats, beats[0].at if beats else start)
