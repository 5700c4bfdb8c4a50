"""The state brought in line with the clouds: each live machine observed (a preemption, a stop
or a delete outside provisioner, a boot finishing, a new address), and the machines carrying
our tag that no machine in the state owns (orphans), with the network pieces nobody uses."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from providers.base import Instance, MachineState, NotFound, Provider, ProviderError
from provisioner import ledger, notify
from provisioner.app import App
from provisioner.heartbeats import NOTICE_EVENT
from provisioner.machines import guard_stops
from provisioner.machines.record import ref
from provisioner.models import ACTIVE_EXCLUDED, Event, Heartbeat, Machine, UsageInterval
from provisioner.schema import COMPUTE_BILLED, INTENTS, EventKind, MachineStatus, observed

log = logging.getLogger("provisioner")
S = MachineStatus
#: what a machine is found in when the cloud stopped, took or deleted it
HALTED = frozenset({S.STOPPED, S.PREEMPTED, S.TERMINATED})


@dataclass
class Observation:
    machine: Machine
    observed: MachineStatus | None  # status the cloud reports, None when it could not be asked
    changed: bool
    error: str | None = None


@dataclass(frozen=True)
class Orphan:
    """A machine carrying our tag that no live machine in the state owns: it bills, unseen."""

    cloud: str
    instance: Instance
    adoptable_by: str | None = None  # the name of an interrupted `up` that launched it

    def __str__(self) -> str:
        i = self.instance
        where = f"{self.cloud}/{i.zone or i.region} {i.id} ({i.name}, {i.state.value})"
        if self.adoptable_by:
            return (
                f"{where}: an interrupted `up` of {self.adoptable_by} launched it; rerun to adopt"
            )
        return f"{where}: no machine in the state owns it"


def _orphans(app: App, cloud: str, listed: Iterable[Instance]) -> list[Orphan]:
    with app.db.session() as s:
        rows = s.execute(
            select(Machine.id, Machine.name, Machine.status, Machine.instance_id).where(
                Machine.cloud.is_(None) | (Machine.cloud == cloud)
            )
        ).all()
    owned = {iid for _, _, status, iid in rows if iid and status not in ACTIVE_EXCLUDED}
    launching = {mid: name for mid, name, status, _ in rows if status in INTENTS}
    return [
        Orphan(cloud, i, launching.get(i.machine_id or ""))
        for i in listed
        if i.state is not MachineState.TERMINATED and i.id not in owned
    ]


def orphans(app: App, clouds: Iterable[str] | None = None) -> tuple[list[Orphan], dict[str, str]]:
    """Orphans in every enabled cloud (not only where the state has machines), and the clouds
    that could not be asked, with why."""
    found: list[Orphan] = []
    errors: dict[str, str] = {}
    for cloud in clouds or app.settings.enabled_clouds:
        try:
            provider = app.provider(cloud)
            check = provider.check()
            if not check.ok:
                errors[cloud] = check.message
                continue
            found += _orphans(app, cloud, provider.list_managed())
        except ProviderError as e:
            errors[cloud] = str(e)
    return found, errors


def unused_network(
    app: App, clouds: Iterable[str] | None, errors: dict[str, str], *, remove: bool
) -> dict[str, list[str]]:
    """Each asked cloud's network pieces of ours that no machine uses (removed when
    ``remove``); a cloud that could not be asked before is skipped, one that fails now is
    added to ``errors``."""
    out: dict[str, list[str]] = {}
    for cloud in clouds or app.settings.enabled_clouds:
        if cloud in errors:
            continue
        try:
            pieces = app.provider(cloud).unused_network(remove=remove)
        except ProviderError as e:
            errors[cloud] = str(e)
            continue
        if pieces:
            out[cloud] = pieces
    return out


def collect(app: App, found: Iterable[Orphan]) -> list[Orphan]:
    """Terminate orphans (never one an interrupted `up` may still adopt); returns those done."""
    done = []
    for o in found:
        if o.adoptable_by:
            continue
        app.provider(o.cloud).terminate(o.instance.ref)
        done.append(o)
    return done


def reconcile(
    app: App,
    *,
    now: datetime | None = None,
    orphans: list[Orphan] | None = None,
    keep: Callable[[], bool] = lambda: True,
) -> list[Observation]:
    """Ask each cloud about every live machine and record what changed (a preemption, a machine
    stopped or deleted outside provisioner). One list call per cloud, not one call per machine.
    ``orphans``, when given, receives the orphans seen in those lists. ``keep()`` is asked
    before each cloud and each machine (a scheduler keeps its lease): False stops here, with
    what was observed so far."""
    now = now or app.clock.now()
    out: list[Observation] = []
    for cloud, ms in _live_by_cloud(app).items():
        if not keep():
            return out
        try:
            provider = app.provider(cloud)
            seen = _listed(provider, ms)
        except ProviderError as e:
            out += [Observation(m, None, False, str(e)) for m in ms]
            continue
        if orphans is not None:
            orphans += _orphans(app, cloud, seen.values())
        for m in ms:
            if not keep():
                return out
            out += _observe(app, provider, m, seen.get(m.instance_id or ""), now)
    return out


def _listed(provider: Provider, ms: list[Machine]) -> dict[str, Instance]:
    """The cloud's managed machines in the regions of ``ms``, by id: one list call."""
    return {i.id: i for i in provider.list_managed(sorted({m.region for m in ms if m.region}))}


def _live_by_cloud(app: App) -> dict[str, list[Machine]]:
    """The live machines to ask about, by cloud: on a team's PostgreSQL state only those the
    connected role may act on (the database refuses its writes of the others: their owners
    and the scheduler observe them)."""
    q = select(Machine).where(Machine.status.not_in((S.TERMINATED, S.FAILED, *INTENTS)))
    if app.db.engine.dialect.name == "postgresql":
        q = q.where(func.prov_may_act(Machine.owner, Machine.project))
    with app.db.session() as s:
        live = s.scalars(q)
        by_cloud: dict[str, list[Machine]] = {}
        for m in live:
            by_cloud.setdefault(m.cloud or "", []).append(m)
    return by_cloud


def _observe(
    app: App, provider: Provider, m: Machine, inst: Instance | None, now: datetime
) -> list[Observation]:
    """What the cloud says of ``m`` (``inst``: as its list showed it), recorded; and the stop of
    a halted machine its cloud still bills."""
    if inst is None:  # not listed: ask directly (terminated machines drop out of lists)
        try:
            inst = provider.get(ref(m))
        except NotFound:
            inst = None
        except ProviderError as e:
            return [Observation(m, None, False, str(e))]
    seen_now = _record(app, m, inst, now)
    if seen_now is None:
        return []
    if inst is not None and inst.halted_billing and seen_now.observed == S.STOPPING:
        return [seen_now, _end_billing(app, provider, seen_now.machine, inst, now)]
    return [seen_now]


#: why reconcile stops a machine that is already halted
STILL_BILLED = (
    "its OS shut down, but its cloud keeps it allocated and billed until it is stopped through "
    "the API (an Azure VM is deallocated): provisioner stopped it so"
)


def _end_billing(
    app: App, provider: Provider, m: Machine, inst: Instance, now: datetime
) -> Observation:
    """A machine halted from inside that its cloud still bills (Azure: PowerState/stopped, still
    allocated): stopped through the API, which ends the billing; the stop is recorded at the
    cloud's time of it, with the guard's reason when the machine says one, and why provisioner
    made it. Usage stays open (``stopping``) when the stop fails: the next pass tries again."""
    try:
        provider.stop(inst.ref)
        after = provider.get(inst.ref)
    except ProviderError as e:
        log.warning("reconcile: %s is halted but billed; could not stop it: %s", m.name, e)
        return Observation(m, S.STOPPING, False, f"halted but billed; could not stop it: {e}")
    seen = _record(app, m, after, now, note={"ended_billing": STILL_BILLED})
    return seen or Observation(m, S.STOPPING, False)


def _record(
    app: App,
    m: Machine,
    inst: Instance | None,
    now: datetime,
    note: dict[str, str] | None = None,
) -> Observation | None:
    """What the cloud's answer ``inst`` (None: it no longer knows the machine) says of ``m``,
    written if it changed anything; None when the row changed meanwhile (skipped: the next
    reconcile sees anew)."""
    status, address = observed(inst, m.public_ip)
    if status == m.status and address == m.public_ip:
        return Observation(m, status, False)  # no write per unchanged machine
    # A launched machine finishing its boot is no outside change, and its running time started
    # at launch: "booted" is not a running-since event (idle windows).
    booted = m.status == S.PENDING and status == S.RUNNING
    reason = _reason(status, booted)
    said = _guard_said(app, m, status)
    with app.db.session() as s:
        row = s.get(Machine, m.id)
        if row is None or row.status != m.status:
            # deleted by hand, or changed by another process since we read it: what the cloud
            # said is about the old row
            log.warning("reconcile: %s (%s) changed meanwhile; skipped", m.name, m.id)
            return None
        row.public_ip = address
        detail = _detail(inst, note)
        status, explained = _explained(s, row, status, said, detail)
        at = _stopped_at(s, row, status, inst, explained, now, detail)
        if explained is not None:
            reason = explained.reason
            detail.update(explained.detail)
            guard_stops.record_jobs(s, row, explained, at)
        changed = ledger.record_transition(
            s,
            row,
            status,
            at,
            event=EventKind.BOOTED if booted else None,
            reason=reason,
            detail=detail,
        )
        who = _who(row)
        seen = Observation(row, status, changed)
    if changed and status == S.PREEMPTED:
        _tell_preempted(app, who, at)
    return seen


#: what a halted machine's guard says: its report, its running jobs, what is recorded of it
Said = tuple[dict[str, Any] | None, list[str], guard_stops.Explained | None]


def _reason(status: MachineStatus, booted: bool) -> str:
    """The event reason of a change the cloud shows, before the machine's guard explains it."""
    if status == S.PREEMPTED:
        return "preempted"
    return "launched" if booted else guard_stops.UNEXPLAINED


def _guard_said(app: App, m: Machine, status: MachineStatus) -> Said:
    """A halted machine's own guard, maybe: what the machine says (its report, its running
    jobs), else what is recorded (guessed only when it says nothing)."""
    report, running, guessed = None, [], None
    if status in HALTED:
        report, running = guard_stops.read_report(app, m), guard_stops.running_jobs(app, m)
        guessed = guard_stops.inferred(app, m) if report is None else None
    return report, running, guessed


def _detail(inst: Instance | None, note: dict[str, str] | None) -> dict[str, Any]:
    return {
        "observed": inst.state.value if inst else "gone",
        "cloud_reason": inst.state_reason if inst else None,
        **(note or {}),
    }


def _explained(
    s: Session, row: Machine, status: MachineStatus, said: Said, detail: dict[str, Any]
) -> tuple[MachineStatus, guard_stops.Explained | None]:
    """A halted machine's status and its stop as its guard explains it (None: not halted, or
    preempted): a preemption its guard explains is a stop (``read_as`` in ``detail``)."""
    if status not in HALTED:
        return status, None
    report, running, guessed = said
    explained = guard_stops.explain(report, running, _open_since(s, row))
    if explained.reason == guard_stops.UNEXPLAINED and guessed is not None:
        explained = guessed
    if status == S.PREEMPTED and explained.reason != guard_stops.UNEXPLAINED:
        # a cloud that records no reason (SberCloud) or guesses one (a Yandex VM that
        # went down without a stop operation) read as preempted what its guard stopped
        status, detail["read_as"] = S.STOPPED, "preempted"
    return status, (None if status == S.PREEMPTED else explained)


def _stopped_at(
    s: Session,
    row: Machine,
    status: MachineStatus,
    inst: Instance | None,
    explained: guard_stops.Explained | None,
    now: datetime,
    detail: dict[str, Any],
) -> datetime:
    """When a halted machine stopped (:func:`halted_at`, what says so into ``detail``); else
    ``now``."""
    if status not in HALTED:
        return now
    cloud_at = inst.stopped_at if inst else None
    guard_at = explained.at if explained is not None else None
    at, detail["at_source"] = halted_at(s, row, cloud_at, now, guard_at)
    return at


def _who(row: Machine) -> tuple[str, str, str, str, str]:
    """A machine as a notice names it: id, name, where, project, owner."""
    return row.id, row.name, f"{row.cloud} {row.zone or row.region}", row.project, row.owner


def _tell_preempted(app: App, who: tuple[str, str, str, str, str], at: datetime) -> None:
    notice = notify.Notice(
        "preempted",
        f"preempted:{who[0]}:{at.isoformat()}",
        notify.texts("preempted", machine=who[1], where=who[2]),
        machine=who[1],
        link=f"/machine/{who[1]}",
    )
    notify.tell(app, notice, who[3], who[4])


def halted_at(
    s: Session,
    m: Machine,
    cloud_at: datetime | None,
    now: datetime,
    guard_at: datetime | None = None,
) -> tuple[datetime, str]:
    """When ``m``, found stopped, preempted or gone at ``now``, stopped billing, and what says
    so: the cloud's own time (``"cloud"``), else the time the machine's guard shut it down
    (``"guard"``: its ``stop.json``), else the time a preemption notice announced
    (``"notice"``), else the agent's last heartbeat in the open usage (``"heartbeat"``: it ran
    at least until then), else ``now`` (``"noticed"``). Never before
    the open usage began (a stale time bills nothing twice, and no interval ends before it
    starts) and never after ``now``. Between two scheduler ticks, or through an outage of the
    scheduler, usage is so closed where the cloud closed it, not where it was noticed."""
    floor = s.scalar(
        select(func.max(UsageInterval.started_at)).where(
            UsageInterval.machine_id == m.id, UsageInterval.ended_at.is_(None)
        )
    )
    if cloud_at is not None:
        return min(max(cloud_at, floor or cloud_at), now), "cloud"
    if m.status not in COMPUTE_BILLED:  # a machine already stopped has no running to bound
        return now, "noticed"
    if guard_at is not None:
        return min(max(guard_at, floor or guard_at), now), "guard"
    if (announced := _announced(s, m, floor)) is not None:
        return min(announced, now), "notice"
    beat = s.scalar(
        select(func.max(Heartbeat.at)).where(Heartbeat.machine_id == m.id, Heartbeat.at <= now)
    )
    if beat is not None and (floor is None or beat >= floor):
        return beat, "heartbeat"
    return now, "noticed"


def _open_since(s: Session, m: Machine) -> datetime | None:
    return s.scalar(
        select(func.max(UsageInterval.started_at)).where(
            UsageInterval.machine_id == m.id, UsageInterval.ended_at.is_(None)
        )
    )


def _announced(s: Session, m: Machine, floor: datetime | None) -> datetime | None:
    """When the cloud said, in a preemption notice the agent forwarded during the open usage,
    it would take the machine (``not_before``; GCP gives no time: when the notice came)."""
    notices = s.scalars(
        select(Event)
        .where(Event.machine_id == m.id, Event.kind == NOTICE_EVENT)
        .order_by(Event.id.desc())
    )
    for e in notices:
        if floor is not None and e.at < floor:
            return None  # a notice of an earlier run
        not_before = e.detail.get("not_before")
        at = datetime.fromisoformat(not_before.replace("Z", "+00:00")) if not_before else e.at
        return max(at, floor or at)
    return None
