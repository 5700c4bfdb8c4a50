"""The fleet as listed and one machine in detail: ``status``, ``status NAME`` and the
dashboard's fleet and machine pages. What a machine has cost comes from one place,
:mod:`provisioner.fleet` (its launches' usage, summed by the database at launch-time rates),
whoever shows it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

from provisioner.fleet import Fleet, Row, Sql, costs_of, failure, launches, read, waiting_line
from provisioner.money import CENT, US_PER_HOUR, Money, allocate
from provisioner.schema import ACTIVE_EXCLUDED, INTENTS, EventKind, epoch_us
from provisioner.schema import MachineStatus as S

if TYPE_CHECKING:
    from provisioner.app import App
    from provisioner.models import Event, Machine


def monies(spent: Mapping[str, Decimal]) -> list[Money]:
    """Amounts per currency as money, by currency."""
    return [Money(v, c) for c, v in sorted(spent.items())]


# --- the fleet as listed ----------------------------------------------------------------------


@dataclass
class StatusList:
    """``status``: the machines shown (:class:`provisioner.fleet.Fleet`: rows and warnings) and
    the clouds that could not be asked."""

    fleet: Fleet
    problems: list[str] = field(default_factory=list)  # "could not ask …" lines

    @property
    def rows(self) -> list[Row]:
        return self.fleet.rows

    @property
    def totals(self) -> list[Money]:
        """What the machines shown have cost, per currency: the sum of their rows."""
        return fleet_totals(self.fleet.rows)


def fleet_totals(rows: list[Row]) -> list[Money]:
    out: dict[str, Decimal] = {}
    for m in rows:
        for c, v in m.spent.items():
            out[c] = out.get(c, Decimal(0)) + v
    return monies(out)


def status_list(app: App, *, all_: bool, refresh: bool) -> StatusList:
    """The fleet as ``status`` lists it. With ``refresh``, the clouds are asked first about the
    machines they hold (:func:`provisioner.machines.reconcile`) and the rows read again only
    when that moved one of them."""
    from provisioner.schema import known_empty

    if known_empty(app.settings.database_url, all_):
        return StatusList(Fleet([], {}))
    fleet = read_fleet(app, all_)
    asked = {m.id for m in fleet.rows if m.status not in (*INTENTS, *ACTIVE_EXCLUDED)}
    if not (refresh and asked):
        return StatusList(fleet)
    observed = reconcile(app)
    ended = jobs_ended(app)
    problems = [
        f"could not ask {o.machine.cloud} about {o.machine.name}: {o.error}"
        for o in observed
        if o.error
    ]
    if ended or _moved(fleet.rows, asked, observed):
        fleet = read_fleet(app, all_)
    return StatusList(fleet, problems)


def read_fleet(app: App, all_: bool) -> Fleet:
    """The fleet as listed (:func:`provisioner.fleet.read`), on the session's connection, with
    the settings' heartbeat grace."""
    now = app.clock.now()
    grace = timedelta(seconds=app.settings.scheduler.heartbeat_grace_seconds)
    with app.db.session() as s:
        return read(Sql.on(s), all_=all_, now=now, seen_since=now - grace)


def reconcile(app: App) -> list[Any]:
    from provisioner import machines  # the providers and planning: only when asking the clouds

    return machines.reconcile(app)


def jobs_ended(app: App, names: list[str] | None = None) -> list[Any]:
    """Jobs found ended: each recorded, its ``on_finish`` done (:mod:`provisioner.jobs.finish`)."""
    from provisioner.jobs import finish

    return finish.check(app, names)


def _moved(rows: list[Row], asked: set[str], observed: list[Any]) -> bool:
    """Whether asking the clouds moved a row shown (its status or address), or saw other
    machines than those read: only then are the rows read again."""
    seen = {m.id: (m.status, m.public_ip) for m in rows}
    return {o.machine.id for o in observed} != asked or any(
        o.changed or seen.get(o.machine.id) != (o.machine.status, o.machine.public_ip)
        for o in observed
    )


# --- one machine ------------------------------------------------------------------------------


@dataclass
class IdleState:
    """What the machine's agent last said: ``signal`` is its busiest GPU's utilisation, or
    ``"unknown"`` (no heartbeat), or None (not running)."""

    signal: float | str | None
    text: str
    at: datetime | None = None


@dataclass
class Part:
    """One span of billing of one of the machine's launches, and its share of the total: the
    parts of a currency add up to the machine's total in it, to the cent."""

    machine_id: str
    kind: str  # compute | disk
    started_at: datetime
    ended_at: datetime | None
    rate: Money  # per hour
    cost: Money  # shown: to the cent


@dataclass
class MachineDetail:
    machine: Machine
    spent: list[Money]  # per currency, across every launch of the machine
    launches: int
    parts: list[Part]  # newest first
    events: list[Event]  # of every launch, oldest first
    idle: IdleState
    next: str | None  # the scheduler's next action, or why none is due
    why: str | None  # why it failed
    held: str | None = None  # held after a refused relaunch: by what, the numbers, next try
    volumes: list[tuple[str, Any]] = field(default_factory=list)  # (mount path, volumes.Listed)
    waiting: str | None = None  # waiting for capacity: since, next try, gives up at
    jobs: list[Any] = field(default_factory=list)  # machines.jobs.Job, in order of start
    autostop: dict[str, Any] | None = None  # provisioner.jobs.autostop.show; None: no autostop

    @property
    def spec(self) -> dict[str, Any]:
        return self.machine.spec or {}


def machine_detail(app: App, key: str, *, by_id: bool = False) -> MachineDetail | None:
    """One machine: the live one of that name, else the newest (``by_id``: an id first); None
    when there is none. Its cost is :func:`provisioner.fleet.costs_of` over its launches."""
    from sqlalchemy import select

    from provisioner.models import Event, Heartbeat, Machine, UsageInterval
    from provisioner.state import named_machine

    now = app.clock.now()
    with app.db.session() as s:
        m = (s.get(Machine, key) if by_id else None) or named_machine(s, key)
        if m is None:
            return None
        sql = Sql.on(s)
        chain = launches(sql, [m.id])[m.id]
        cost = costs_of(sql, chain, now)
        events = list(
            s.scalars(select(Event).where(Event.machine_id.in_(chain)).order_by(Event.at, Event.id))
        )
        ivs = list(
            s.scalars(
                select(UsageInterval)
                .where(UsageInterval.machine_id.in_(chain))
                .order_by(UsageInterval.started_at.desc(), UsageInterval.kind)
            )
        )
        beat = s.scalars(
            select(Heartbeat).where(Heartbeat.machine_id == m.id).order_by(Heartbeat.id.desc())
        ).first()
    spent: dict[str, Decimal] = {}
    for per in cost.values():
        for c, a in per.items():
            spent[c] = spent.get(c, Decimal(0)) + a
    why = failure([e for e in events if e.machine_id == m.id]) if m.status == S.FAILED else None
    return MachineDetail(
        machine=m,
        spent=monies(spent),
        launches=len(chain),
        parts=_parts(ivs, spent, now),
        events=events,
        idle=_idle_state(app, m, beat, now),
        next=_next_action(app, m, now),
        why=why,
        held=_held(m, [e for e in events if e.machine_id == m.id], now, app.zone),
        volumes=_volumes(app, m, now),
        waiting=_waiting(m, events, now, app.zone),
        jobs=_jobs(app, m),
        autostop=_autostop(app, m),
    )


def _jobs(app: App, m: Machine) -> list[Any]:
    from provisioner.machines import jobs

    return list(jobs.jobs_of(app, m).values())  # in the order they first started


def _autostop(app: App, m: Machine) -> dict[str, Any] | None:
    """The machine's autostop and how long it has been idle so far; None when it has none."""
    if m.status not in (S.RUNNING, S.STOPPED, S.PENDING):
        return None
    from provisioner.jobs import autostop  # the policies and the heartbeats: only here

    shown = autostop.show(app, m)
    return shown if shown["autostop"] else None


def _volumes(app: App, m: Machine, now: datetime) -> list[tuple[str, Any]]:
    """The machine's experiment's volumes that exist, each with its mount path."""
    paths = {v["name"]: v["path"] for v in (m.spec or {}).get("volumes") or []}
    if not paths:
        return []
    from provisioner.machines import volumes

    return [
        (paths[v.volume.name], v)
        for v in volumes.listing(app, m.project, now)
        if v.volume.name in paths
    ]


def _parts(ivs: list[Any], spent: Mapping[str, Decimal], now: datetime) -> list[Part]:
    """Each interval's cost up to ``now`` (as the database sums it), shared out so that a
    currency's parts add up to its rounded total (:func:`provisioner.money.allocate`)."""
    hi = epoch_us(now)
    exact = [
        iv.rate
        * max(min(hi if iv.end_us is None else iv.end_us, hi) - max(iv.start_us, 0), 0)
        / US_PER_HOUR
        for iv in ivs
    ]
    shown = list(exact)
    for c in {iv.currency for iv in ivs}:
        at = [i for i, iv in enumerate(ivs) if iv.currency == c]
        total = spent.get(c, Decimal(0)).quantize(CENT, ROUND_HALF_UP)
        for i, a in zip(at, allocate([exact[i] for i in at], total), strict=True):
            shown[i] = a
    return [
        Part(
            iv.machine_id,
            iv.kind,
            iv.started_at,
            iv.ended_at,
            Money(iv.rate, iv.currency),
            Money(a, iv.currency),
        )
        for iv, a in zip(ivs, shown, strict=True)
    ]


def _idle_state(app: App, m: Machine, beat: Any, now: datetime) -> IdleState:
    from policies.duration import format_duration

    if m.status != S.RUNNING:
        return IdleState(None, f"{m.status}: no GPU activity expected")
    if beat is None:
        if not app.settings.scheduler.endpoint_url:
            text = "no heartbeat: no agent (scheduler.endpoint_url is not set)"
        else:
            text = "no heartbeat yet from its agent"
        return IdleState("unknown", text)
    util = beat.max_util
    ago = format_duration(now - beat.at)
    text = (
        f"busiest GPU at {util:g}% {ago} ago"
        if util is not None
        else f"the agent saw no GPU {ago} ago"
    )
    return IdleState(util, text, beat.at)


def _held(m: Machine, events: list[Event], now: datetime, zone: ZoneInfo) -> str | None:
    """ "held: relaunch refused by …; next try …" for a machine held after a refused relaunch."""
    if m.status not in (S.PREEMPTED, S.STOPPED, S.TERMINATED):
        return None
    from provisioner.jobs import recover  # the scheduler's rules: only here
    from provisioner.tries import tries

    return recover.held_line(tries(events), now, zone)


def _waiting(m: Machine, events: list[Event], now: datetime, zone: ZoneInfo) -> str | None:
    """``waiting for capacity since X, next try Y, gives up at Z`` for a waiting intent."""
    if m.status != S.WAITING:
        return None
    latest = next((e for e in reversed(events) if e.kind == EventKind.WAITING), None)
    return waiting_line(latest.detail or {}, now, zone) if latest is not None else None


def _next_action(app: App, m: Machine, now: datetime) -> str | None:
    if m.status not in (S.RUNNING, S.STOPPED, S.PREEMPTED, S.WAITING):
        return None
    if m.status in (S.RUNNING, S.STOPPED) and not m.instance_id:
        return None
    from provisioner.jobs import outlook  # the policies and the sweep's rules: only here

    return outlook.outlook(app, [m], now).get(m.name)
