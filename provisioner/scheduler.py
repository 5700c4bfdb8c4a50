"""The scheduler's jobs, each a function of (app, now) that returns what it did — or, with
``dry_run``, what it would do — and why:

- sweep: out of hours AND idle → stop/terminate per policy; max lifetime reached → act;
  a machine kept by ``provisioner keep`` is left alone until then;
- recover: a preempted spot machine → relaunched per its spec's ``on_preemption``: its zone and
  region first, then the planner's next candidates, within policy and budget, with backoff;
- reconcile: state vs what the clouds report; orphans listed.

Two schedulers on one database never act twice: each pass first takes a lease (a table row,
``UPDATE … WHERE expired OR mine``, the same on SQLite and PostgreSQL); the other skips the pass.
Every action is an event on the machine, with its reason.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, time, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.exc import IntegrityError

from policies.calendar import Calendar
from policies.duration import parse_duration
from policies.schema import IdleRule, Policy, matching
from provisioner import idle, lifecycle
from provisioner.crashpoints import crashpoint
from provisioner.errors import ProvisionerError, UserError
from provisioner.models import ACTIVE_EXCLUDED, Event, Lease, Machine

if TYPE_CHECKING:
    from provisioner.app import App
    from provisioner.spec import Experiment

log = logging.getLogger("provisioner.scheduler")

HOLDER = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
HEARTBEAT_RETENTION = timedelta(days=1)
RECOVER_BACKOFF = timedelta(minutes=1)  # doubled per failed attempt …
RECOVER_BACKOFF_MAX = timedelta(hours=1)  # … up to this
RECOVER_MAX_ATTEMPTS = 10
# event reasons the scheduler writes (reports and /metrics count them)
REASONS = ("off-hours-idle", "idle", "max-lifetime", "preempted", "recovered")


@dataclass
class Action:
    machine: str
    action: str  # stop | terminate | relaunch | record | keep (left alone)
    reason: str
    why: str
    done: bool = False
    error: str | None = None
    idle_since: datetime | None = None  # start of the window proven idle (for idle waste)
    warn_minutes: int = 0  # the owner is mailed this long before the machine is acted on

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __str__(self) -> str:
        verb = {"keep": "left alone", "warn": "owner warned"}.get(self.action, self.action)
        state = "" if self.done or self.action == "keep" else " (dry run)"
        if self.error:
            state = f" FAILED: {self.error}"
        return f"{self.machine}: {verb} [{self.reason}] — {self.why}{state}"


@dataclass
class Pass:
    job: str
    leader: bool = True
    dry_run: bool = False
    actions: list[Action] = field(default_factory=list)
    checked: int = 0
    orphans: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""

    def as_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "leader": self.leader,
            "dry_run": self.dry_run,
            "checked": self.checked,
            "actions": [a.as_json() for a in self.actions],
            "orphans": self.orphans,
            "note": self.note,
        }


# --- the lease -------------------------------------------------------------------------------


def acquire(app: App, job: str, now: datetime, holder: str = HOLDER) -> bool:
    """Take (or renew) the lease for ``job``; False while another holder's lease runs."""
    ttl = timedelta(seconds=app.settings.scheduler.lease_seconds)
    try:
        with app.db.session() as s:
            if s.get(Lease, job) is None:
                s.add(Lease(name=job, holder="", expires_at=EPOCH))
    except IntegrityError:  # another scheduler inserted it first: fine, it exists
        pass
    with app.db.session() as s:
        current = s.get(Lease, job)
        takeable = [holder] + ([current.holder] if current and _dead_here(current.holder) else [])
        won = s.execute(
            update(Lease)
            .where(Lease.name == job, or_(Lease.expires_at < now, Lease.holder.in_(takeable)))
            .values(holder=holder, expires_at=now + ttl)
        ).rowcount
    return won == 1


def _dead_here(holder: str) -> bool:
    """A holder that was a process on this host which no longer runs (killed mid-pass): its
    lease need not be waited out."""
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def release(app: App, job: str, holder: str = HOLDER) -> None:
    with app.db.session() as s:
        s.execute(
            update(Lease).where(Lease.name == job, Lease.holder == holder).values(expires_at=EPOCH)
        )


@contextmanager
def leading(app: App, job: str, now: datetime, holder: str, dry_run: bool) -> Iterator[bool]:
    """Hold the lease for one pass. A dry run changes nothing, so it needs none."""
    if dry_run:
        yield True
        return
    if not acquire(app, job, now, holder):
        yield False
        return
    try:
        yield True
    finally:
        release(app, job, holder)


def _not_leader(job: str, app: App, dry_run: bool) -> Pass:
    with app.db.session() as s:
        lease = s.get(Lease, job)
        who = lease.holder if lease else "?"
    return Pass(job, leader=False, dry_run=dry_run, note=f"another scheduler ({who}) runs it")


# --- rules per machine -----------------------------------------------------------------------


@dataclass(frozen=True)
class IdleCheck:
    source: str  # the policy's name, or "experiment"
    rule: IdleRule
    calendar: Calendar | None  # None: the rule acts at any hour


@dataclass
class Rules:
    idle: list[IdleCheck]
    lifetime: tuple[timedelta, str, str] | None  # (after, action, source): the shortest wins


class RuleBook:
    """Each machine's idle and lifetime rules: its matching policies plus its own spec."""

    def __init__(self, policies: list[Policy]) -> None:
        self.policies = policies
        self.calendars = {p.name: Calendar(p.off_hours) for p in policies if p.off_hours}
        self._by_scope: dict[tuple[str, str], list[Policy]] = {}

    def for_machine(self, m: Machine) -> Rules:
        key = (m.project, m.owner)
        if key not in self._by_scope:
            self._by_scope[key] = matching(self.policies, *key)
        checks: list[IdleCheck] = []
        lifetimes: list[tuple[timedelta, str, str]] = []
        for p in self._by_scope[key]:
            if p.idle_rule is not None:
                checks.append(IdleCheck(p.name, p.idle_rule, self.calendars.get(p.name)))
            if p.max_lifetime is not None:
                lifetimes.append((p.max_lifetime.after, p.max_lifetime.action, p.name))
        own = (m.spec or {}).get("lifecycle") or {}
        if own.get("idle"):
            checks.append(IdleCheck("experiment", IdleRule(**own["idle"]), None))
        if own.get("max_lifetime") is not None:
            lifetimes.append((parse_duration(own["max_lifetime"]), "stop", "experiment"))
        lifetime = min(lifetimes, key=lambda x: (x[0], x[1] != "terminate")) if lifetimes else None
        return Rules(checks, lifetime)


def stored_experiment(m: Machine) -> Experiment:
    """The experiment a machine was launched from, read back from the state."""
    from provisioner.spec import Experiment

    return Experiment.model_validate(m.spec)


# --- sweep -----------------------------------------------------------------------------------


@dataclass
class Assessment:
    machine: Machine
    rules: Rules
    signals: dict[IdleCheck, idle.Signal]


def assess(app: App, now: datetime, machines: list[Machine]) -> list[Assessment]:
    """Each machine's rules and, for each idle rule, its signal (two queries in all)."""
    book = RuleBook(app.policies)
    rules = {m.id: book.for_machine(m) for m in machines}
    grace = timedelta(seconds=app.settings.scheduler.heartbeat_grace_seconds)
    windows = [c.rule.for_minutes for r in rules.values() for c in r.idle]
    running = [m.id for m in machines if m.status == "running" and rules[m.id].idle]
    beats: dict[str, list[idle.Beat]] = {}
    since: dict[str, datetime] = {}
    if running:
        beats = idle.beats_since(app, running, now - timedelta(minutes=max(windows)) - grace)
        since = idle.running_since(app, running)
    out = []
    for m in machines:
        r = rules[m.id]
        signals: dict[IdleCheck, idle.Signal] = {}
        if m.status == "running":
            for c in r.idle:
                signals[c] = idle.classify(
                    beats.get(m.id, []),
                    now=now,
                    running_since=since.get(m.id, m.launched_at),
                    below=c.rule.gpu_util_below,
                    window=timedelta(minutes=c.rule.for_minutes),
                    grace=grace,
                )
        out.append(Assessment(m, r, signals))
    return out


def decide(a: Assessment, now: datetime) -> Action | None:
    """What the sweep does to one machine, and why; None: nothing."""
    m = a.machine
    if m.kept_until is not None and m.kept_until > now:
        return Action(m.name, "keep", "kept", f"kept until {m.kept_until:%Y-%m-%d %H:%M} UTC")
    if a.rules.lifetime and m.launched_at:
        after, how, source = a.rules.lifetime
        age = now - m.launched_at
        if age >= after and (how == "terminate" or m.status == "running"):
            why = f"up {_hours(age)}, max lifetime {_hours(after)} ({source})"
            return Action(m.name, how, "max-lifetime", why)
    fired = []
    for check, signal in a.signals.items():
        off = check.calendar.why_off(now) if check.calendar else None
        if check.calendar and off is None:
            continue
        if signal == "idle" or (signal == "unknown" and check.rule.unknown_counts_as_idle):
            fired.append((check, off, signal))
    if not fired:
        return None
    check, off, signal = fired[0]
    how = "terminate" if any(c.rule.action == "terminate" for c, _, _ in fired) else "stop"
    activity = (
        f"GPUs below {check.rule.gpu_util_below:g}% for {check.rule.for_minutes} min"
        if signal == "idle"
        else "no heartbeat (counted as idle)"
    )
    why = f"{off}; {activity} ({check.source})" if off else f"{activity} ({check.source})"
    since = now - timedelta(minutes=check.rule.for_minutes) if signal == "idle" else None
    warn = max((c.rule.warn_minutes for c, _, _ in fired), default=0)
    return Action(
        m.name, how, "off-hours-idle" if off else "idle", why, idle_since=since, warn_minutes=warn
    )


def sweep(
    app: App, now: datetime | None = None, *, dry_run: bool = False, holder: str = HOLDER
) -> Pass:
    now = now or app.clock.now()
    app.policies  # noqa: B018  (a bad policy file stops the pass before anything is done)
    with leading(app, "sweep", now, holder, dry_run) as leader:
        if not leader:
            return _not_leader("sweep", app, dry_run)
        if not dry_run:  # one list call per cloud brings the state up to date
            lifecycle.reconcile(app, now=now)
        with app.db.session() as s:
            machines = list(
                s.scalars(
                    select(Machine).where(
                        Machine.status.in_(("running", "stopped")),
                        Machine.instance_id.is_not(None),
                    )
                )
            )
        result = Pass("sweep", dry_run=dry_run, checked=len(machines))
        for a in assess(app, now, machines):
            action = decide(a, now)
            if action is None:
                continue
            if action.warn_minutes and action.action in ("stop", "terminate"):
                action = _warned_first(app, a.machine, action, now, dry_run)
            if not dry_run and action.action in ("stop", "terminate"):
                _act(app, action)
            result.actions.append(action)
        if not dry_run:
            idle.prune(app, now - HEARTBEAT_RETENTION)
        return result


def _warned_first(app: App, m: Machine, action: Action, now: datetime, dry_run: bool) -> Action:
    """The owner hears of an idle stop ``warn_minutes`` before it happens (and can `keep` the
    machine). A warning older than twice that, with the machine busy in between, is stale:
    the next idle spell is warned again."""
    wait = timedelta(minutes=action.warn_minutes)
    with app.db.session() as s:
        last = s.scalars(
            select(Event)
            .where(
                Event.machine_id == m.id, Event.kind.in_(("stop-warning", "started", "launched"))
            )
            .order_by(Event.id.desc())
        ).first()
    warned = last.at if last is not None and last.kind == "stop-warning" else None
    if warned is not None and warned + 2 * wait >= now:
        if now >= warned + wait:
            return action  # warned in time: act
        return replace(
            action,
            action="warn",
            why=f"{action.why}; {action.action} at {warned + wait:%H:%M} UTC, owner warned",
            done=True,
        )
    when = now + wait
    pending = replace(
        action, action="warn", why=f"{action.why}; {action.action} at {when:%H:%M} UTC"
    )
    if dry_run:
        return pending
    detail: dict[str, Any] = {"why": action.why, "act_at": when.isoformat(), "to": m.owner}
    try:
        _mail_warning(app, m, action, when)
    except ProvisionerError as e:  # a broken mail server must not keep machines running
        detail["mail_error"] = str(e)
        pending.error = str(e)
    lifecycle.record_event(app, m.id, "stop-warning", reason=action.reason, detail=detail)
    pending.done = pending.error is None
    return pending


def _mail_warning(app: App, m: Machine, action: Action, when: datetime) -> None:
    from provisioner import mail

    if "@" not in m.owner:
        raise UserError(f"owner {m.owner!r} is not an email address")
    smtp = app.settings.smtp
    keep_until = (when + timedelta(hours=2)).strftime("%H:%M")
    done = "stopped" if action.action == "stop" else "terminated"
    text = (
        f"{m.name} ({m.cloud} {m.zone or m.region}, {m.gpu_count}×{m.gpu}) will be {done} at "
        f"{when:%Y-%m-%d %H:%M} UTC:\n{action.why}.\n\n"
        f"To keep it running, run:\n  provisioner keep {m.name} --until {keep_until}\n"
    )
    subject = f"provisioner: {m.name} will be {done} at {when:%H:%M} UTC (idle)"
    mail.send(smtp, mail.compose(sender=smtp.sender, to=[m.owner], subject=subject, text=text))


def _act(app: App, action: Action) -> None:
    fn = lifecycle.stop if action.action == "stop" else lifecycle.down
    try:
        detail = {"why": action.why}
        if action.idle_since is not None:
            detail["idle_since"] = action.idle_since.isoformat()
        _, changed = fn(app, action.machine, reason=action.reason, detail=detail)
        action.done = True
        if not changed:
            action.why += " (it already was)"
    except ProvisionerError as e:
        action.error = str(e)
        log.warning("sweep: %s %s failed: %s", action.action, action.machine, e)


def _hours(d: timedelta) -> str:
    h = d.total_seconds() / 3600
    return f"{h:.0f} h" if h >= 10 else f"{h:.1f} h"


# --- keep ------------------------------------------------------------------------------------


def calendar_for(app: App, m: Machine) -> Calendar | None:
    """The off-hours calendar of the first policy with one that applies to ``m``."""
    for p in matching(app.policies, m.project, m.owner):
        if p.off_hours:
            return Calendar(p.off_hours)
    return None


def keep(app: App, name: str, until: str) -> Machine:
    """Leave ``name`` alone until ``until``: ``HH:MM`` (next such time in the machine's policy
    calendar, else this computer's timezone) or an ISO date-time."""
    now = app.clock.now()
    m = lifecycle.find(app, name)
    cal = calendar_for(app, m)
    tz = cal.tz if cal else datetime.now().astimezone().tzinfo
    try:
        if len(until) <= 5 and ":" in until:
            t = time.fromisoformat(until.zfill(5))
            when = (cal or _LocalCalendar(tz)).next_at(now, t)
        else:
            when = datetime.fromisoformat(until)
            when = (when if when.tzinfo else when.replace(tzinfo=tz)).astimezone(UTC)
    except ValueError:
        raise UserError(f"--until {until!r}: write HH:MM or an ISO date-time") from None
    if when <= now:
        raise UserError(f"--until {until!r} is in the past")
    with app.db.session() as s:
        mm = s.get(Machine, m.id)
        mm.kept_until = when
        s.add(
            Event(
                machine_id=m.id,
                at=now,
                kind="kept",
                reason="user",
                detail={"until": when.isoformat(), "timezone": str(tz)},
            )
        )
        return mm


class _LocalCalendar:
    def __init__(self, tz: Any) -> None:
        self.tz = tz

    def next_at(self, now: datetime, t: Any) -> datetime:
        day = now.astimezone(self.tz).date()
        for d in (day, day + timedelta(days=1), day + timedelta(days=2)):
            at = datetime.combine(d, t).replace(tzinfo=self.tz).astimezone(UTC)
            if at > now:
                return at
        raise ValueError(t)


# --- recover ---------------------------------------------------------------------------------


def recover(
    app: App, now: datetime | None = None, *, dry_run: bool = False, holder: str = HOLDER
) -> Pass:
    now = now or app.clock.now()
    app.policies  # noqa: B018
    with leading(app, "recover", now, holder, dry_run) as leader:
        if not leader:
            return _not_leader("recover", app, dry_run)
        result = Pass("recover", dry_run=dry_run)
        for m, attempts, last in _to_recover(app):
            result.checked += 1
            exp = stored_experiment(m)
            mode = exp.lifecycle.on_preemption
            if mode == "leave":
                continue
            if mode == "terminate":
                action = Action(m.name, "terminate", "preempted", "on_preemption: terminate")
                if not dry_run:
                    _act(app, action)
                result.actions.append(action)
                continue
            if attempts >= RECOVER_MAX_ATTEMPTS:
                continue
            if last is not None:
                wait = min(RECOVER_BACKOFF * 2 ** (attempts - 1), RECOVER_BACKOFF_MAX)
                if now < last + wait:
                    continue
            near = m.zone or m.region or "?"
            action = Action(
                m.name,
                "relaunch",
                "preempted",
                f"on_preemption: relaunch, {near} first (attempt {attempts + 1})",
            )
            if not dry_run:
                _relaunch(app, m, exp, action, attempts, now)
            result.actions.append(action)
        return result


def _to_recover(app: App) -> list[tuple[Machine, int, datetime | None]]:
    """Preempted machines, and those whose relaunch failed or was interrupted (terminated to
    be relaunched, with no machine of that name since): (machine, failed attempts so far, when
    the last one failed)."""
    with app.db.session() as s:
        out: list[tuple[Machine, int, datetime | None]] = [
            (m, 0, None) for m in s.scalars(select(Machine).where(Machine.status == "preempted"))
        ]
        failed = {
            mid: (n, last)
            for mid, n, last in s.execute(
                select(Event.machine_id, func.count(), func.max(Event.at))
                .where(Event.kind == "recover-failed")
                .group_by(Event.machine_id)
            )
        }
        pending = set(failed) | set(
            s.scalars(
                select(Event.machine_id).where(
                    Event.kind == "terminated", Event.reason == "preempted"
                )
            )
        )
        for mid in pending:
            m = s.get(Machine, mid)
            latest = s.scalars(
                select(Event).where(Event.machine_id == mid).order_by(Event.id.desc())
            ).first()
            interrupted = latest.kind == "terminated" and (latest.detail or {}).get("relaunching")
            live = s.scalars(
                select(Machine.status).where(
                    Machine.name == m.name, Machine.status.not_in(ACTIVE_EXCLUDED)
                )
            ).first()
            # a relaunch killed mid-`up` left its intent "requested": resuming it finishes the job
            if (latest.kind == "recover-failed" or interrupted) and live in (None, "requested"):
                out.append((m, *failed.get(mid, (0, None))))
        return out


def _near(m: Machine) -> Callable[[Any], int]:
    def rank(c: Any) -> int:
        o = c.offer
        if o.cloud == m.cloud and o.zone and o.zone == m.zone:
            return 0
        return 1 if (o.cloud, o.region) == (m.cloud, m.region) else 2

    return rank


def _relaunch(
    app: App, m: Machine, exp: Experiment, action: Action, attempts: int, now: datetime
) -> None:
    """Free the name (the lost machine is terminated: its disk still bills), then ``up`` with
    the lost zone and region first. ``up`` applies every policy and budget."""
    try:
        if m.status == "preempted":
            lifecycle.down(app, m.name, reason="preempted", detail={"relaunching": True})
            crashpoint("recover-after-down")
        result = lifecycle.up(app, exp, spec_path=m.spec_path, prefer=_near(m))
    except ProvisionerError as e:
        action.error = str(e)
        lifecycle.record_event(
            app,
            m.id,
            "recover-failed",
            reason="preempted",
            detail={"attempt": attempts + 1, "error": str(e)},
        )
        log.warning("recover: %s not relaunched: %s", m.name, e)
        return
    new = result.machine
    where = f"{new.cloud}/{new.zone or new.region}"
    action.done = True
    action.why += f" → {where}"
    lifecycle.record_event(
        app, m.id, "relaunched", reason="preempted", detail={"machine": new.id, "where": where}
    )
    lifecycle.record_event(
        app, new.id, "recovered", reason="recovered", detail={"replaces": m.id, "lost_zone": m.zone}
    )


# --- reconcile -------------------------------------------------------------------------------


def reconcile(app: App, now: datetime | None = None, *, holder: str = HOLDER) -> Pass:
    now = now or app.clock.now()
    with leading(app, "reconcile", now, holder, False) as leader:
        if not leader:
            return _not_leader("reconcile", app, False)
        orphans: list[lifecycle.Orphan] = []
        observations = lifecycle.reconcile(app, now=now, orphans=orphans)
        result = Pass("reconcile", checked=len(observations))
        for o in observations:
            if o.error:
                result.actions.append(Action(o.machine.name, "record", "error", o.error))
            elif o.changed:
                why = f"the cloud reports {o.observed}"
                result.actions.append(Action(o.machine.name, "record", o.observed or "", why, True))
        result.orphans = [  # launches in flight are not orphans
            {
                "cloud": o.cloud,
                "id": o.instance.id,
                "name": o.instance.name,
                "region": o.instance.region,
                "zone": o.instance.zone,
            }
            for o in orphans
            if not o.adoptable_by
        ]
        return result


# --- the daemon ------------------------------------------------------------------------------


def jobs(app: App) -> list[tuple[str, Callable[[], Any], int]]:
    """(name, call, interval seconds) of every job ``scheduler run`` schedules. Budget
    enforcement and scheduled reports join when their modules provide them."""
    cfg = app.settings.scheduler
    out: list[tuple[str, Callable[[], Any], int]] = [
        ("sweep", lambda: sweep(app), cfg.sweep_interval_seconds),
        ("recover", lambda: recover(app), cfg.recover_interval_seconds),
        ("reconcile", lambda: reconcile(app), cfg.reconcile_interval_seconds),
    ]
    for module, fn in (("budget", "enforce"), ("reports", "run_scheduled")):
        call = _optional(module, fn)
        if call is not None:
            out.append((f"{module}.{fn}", lambda call=call: call(app, app.clock.now()), 60))
    return out


def _optional(module: str, fn: str) -> Callable[..., Any] | None:
    import importlib

    try:
        return getattr(importlib.import_module(f"provisioner.{module}"), fn)
    except (ImportError, AttributeError):
        return None


def run(app: App) -> None:
    """``provisioner scheduler run``: the jobs on their intervals, and the heartbeat and
    metrics endpoint, until SIGTERM or Ctrl-C."""
    import signal

    from apscheduler.schedulers.blocking import BlockingScheduler

    app.policies  # noqa: B018  (refuse to start with a bad policy rather than act on half)
    host, _, port = app.settings.scheduler.listen.rpartition(":")
    metrics = Metrics(app)
    endpoint = idle.Endpoint(app, host or "127.0.0.1", int(port), metrics).start()
    log.info("heartbeats and /metrics on %s", endpoint.url)
    sched = BlockingScheduler(timezone=UTC)
    for name, call, every in jobs(app):
        sched.add_job(
            _guarded(name, call),
            "interval",
            seconds=every,
            id=name,
            name=name,
            next_run_time=datetime.now(UTC),
            coalesce=True,
            max_instances=1,
            misfire_grace_time=every,
        )
    signal.signal(signal.SIGTERM, lambda *_: sched.shutdown(wait=False))
    try:
        sched.start()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        endpoint.stop()


def _guarded(name: str, call: Callable[[], Any]) -> Callable[[], None]:
    def job() -> None:
        try:
            result = call()
        except Exception:  # a job that fails is logged and runs again next interval
            log.exception("job %s failed", name)
            return
        for line in describe(result):
            log.info("%s: %s", name, line)

    return job


def describe(result: Any) -> list[str]:
    """Lines for people: a pass's actions and orphans, or whatever a job returned."""
    if isinstance(result, Pass):
        if not result.leader:
            return [f"skipped: {result.note}"]
        lines = [str(a) for a in result.actions]
        lines += [f"orphan: {o['cloud']} {o['id']} ({o['name']})" for o in result.orphans]
        return lines
    if isinstance(result, list):
        return [str(x) for x in result]
    return [] if result is None else [str(result)]


# --- metrics ---------------------------------------------------------------------------------


class Metrics:
    """Prometheus metrics, read from the state at each scrape, so every scheduler sharing the
    database reports the same numbers (actions come from the machines' events)."""

    def __init__(self, app: App) -> None:
        from prometheus_client import CollectorRegistry

        self.app = app
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        app, now = self.app, self.app.clock.now()
        by_state = GaugeMetricFamily(
            "provisioner_machines", "Machines by state and cloud", labels=["state", "cloud"]
        )
        actions = CounterMetricFamily(
            "provisioner_scheduler_actions",
            "Actions the scheduler took, by kind and reason",
            labels=["action", "reason"],
        )
        with app.db.session() as s:
            for status, cloud, n in s.execute(
                select(Machine.status, Machine.cloud, func.count())
                .where(Machine.status.not_in(ACTIVE_EXCLUDED))
                .group_by(Machine.status, Machine.cloud)
            ):
                by_state.add_metric([status, cloud or ""], n)
            for kind, reason, n in s.execute(
                select(Event.kind, Event.reason, func.count())
                .where(Event.reason.in_(REASONS))
                .group_by(Event.kind, Event.reason)
            ):
                actions.add_metric([kind, reason], n)
            running = list(s.scalars(select(Machine).where(Machine.status == "running")))
        yield by_state
        yield actions
        grace = timedelta(seconds=app.settings.scheduler.heartbeat_grace_seconds)
        util = GaugeMetricFamily(
            "provisioner_gpu_utilization_percent",
            "GPU utilisation from each machine's latest heartbeat",
            labels=["machine", "cloud", "gpu"],
        )
        for m, g in idle.iter_latest_gpus(app, now - grace):
            util.add_metric([m.name, m.cloud or "", str(g["index"])], g["util"])
        yield util
        signals = GaugeMetricFamily(
            "provisioner_machine_activity",
            "Running machines by their strictest idle rule's signal (idle, busy, unknown, "
            "starting), whatever the hour",
            labels=["signal"],
        )
        counts = dict.fromkeys(("idle", "busy", "unknown", "starting"), 0)
        for a in assess(app, now, running):
            if a.signals:
                counts[_strictest(a.signals)] += 1
        for k, n in counts.items():
            signals.add_metric([k], n)
        yield signals
        yield GaugeMetricFamily(
            "provisioner_idle_machines",
            "Running machines idle under one of their rules",
            value=counts["idle"],
        )


def _strictest(signals: dict[IdleCheck, idle.Signal]) -> idle.Signal:
    for s in ("idle", "unknown", "busy", "starting"):
        if s in signals.values():
            return s  # type: ignore[return-value]
    return "starting"
