"""The sweep: out of hours AND idle → stop/terminate per policy; max lifetime reached → act;
idle (GPUs, jobs, SSH) for its autostop → stop, at any hour (:mod:`.autostop`); a machine kept by
``provisioner keep`` is left alone until then (and ``keep`` itself). An owner whose rule asks
for it is mailed before the machine is acted on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime, time, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from sqlalchemy import select

from policies.calendar import Calendar
from policies.duration import format_duration, parse_duration
from policies.schema import IdleRule, Policy, matching
from provisioner import heartbeats, idle, machines, mail, notify, outages
from provisioner.app import App
from provisioner.errors import ProvisionerError, UserError
from provisioner.jobs import autostop, ended
from provisioner.jobs.lease import HOLDER, Held, run_pass
from provisioner.jobs.passes import Action, Pass
from provisioner.machines import pull
from provisioner.models import Event, Machine
from provisioner.schema import EventKind as K
from provisioner.schema import MachineStatus as S
from provisioner.state import machine as machine_row

HEARTBEAT_RETENTION = timedelta(days=1)
#: The owner's warning before the sweep terminates a machine that it would have stopped but
#: whose cloud cannot stop it (an AWS spot machine: terminated with its boot disk), when the
#: rule asks for less: such a terminate loses the disk, a stop would not.
UNSTOPPABLE_WARN_MINUTES = 15


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


# --- the pass ------------------------------------------------------------------------------


@dataclass
class Assessment:
    machine: Machine
    rules: Rules
    signals: dict[IdleCheck, idle.Signal]
    autostop: autostop.Verdict | None = None  # a running machine with an autostop
    # checks whose window overlaps an outage of the heartbeat endpoint: silence is not idle
    blinded: frozenset[IdleCheck] = frozenset()
    jobs: tuple[str, ...] = ()  # jobs running (their events): busy unless a rule is gpus_only


def assess(
    app: App, now: datetime, machines: list[Machine]
) -> tuple[list[Assessment], dict[str, Exception]]:
    """Each machine's rules and, for each idle rule, its signal (two queries in all, each a row
    per machine: the heartbeats are summed up by the database). A machine
    whose rules or data cannot be evaluated (a duration past what a date can hold…) is left out
    with its error, and the others are assessed."""
    book = RuleBook(app.policies)
    grace = timedelta(seconds=app.settings.scheduler.heartbeat_grace_seconds)
    failed: dict[str, Exception] = {}
    rules, lookback = _rules(book, machines, now - grace, failed)
    evidence, since = _evidence(app, rules, list(lookback), now, grace)
    running = ended.running(app, list(lookback)) if lookback else {}
    spans = outages.overlapping(app, min(lookback.values()), now) if lookback else []
    stops = _autostops(app, now, machines, rules, failed, grace)
    none = idle.Evidence(None, None, None, 0, None)
    out = []
    for m in machines:
        if m.id in failed:
            continue
        r = rules[m.id]
        signals: dict[IdleCheck, idle.Signal] = {}
        blinded: set[IdleCheck] = set()
        try:
            if m.id in lookback:
                for c in r.idle:
                    window = timedelta(minutes=c.rule.for_minutes)
                    ev = evidence.get((m.id, window), none)
                    signals[c] = _judge(ev, c, now, since.get(m.id, m.launched_at), grace)
                    if outages.overlaps(spans, now - window - grace, now):
                        blinded.add(c)
        except Exception as e:
            failed[m.id] = e
            continue
        out.append(
            Assessment(
                m, r, signals, stops.get(m.id), frozenset(blinded), tuple(running.get(m.id, ()))
            )
        )
    return out, failed


def _rules(
    book: RuleBook, machines: list[Machine], heard_by: datetime, failed: dict[str, Exception]
) -> tuple[dict[str, Rules], dict[str, datetime]]:
    """Each machine's rules, and the running machines with idle rules: their heartbeats since
    when (their longest window before ``heard_by``, now less the grace). A machine whose rules
    cannot be read goes into ``failed``."""
    rules: dict[str, Rules] = {}
    lookback: dict[str, datetime] = {}  # running machines with idle rules: beats since when
    for m in machines:
        try:
            r = rules[m.id] = book.for_machine(m)
            if m.status == S.RUNNING and r.idle:
                window = max(timedelta(minutes=c.rule.for_minutes) for c in r.idle)
                lookback[m.id] = heard_by - window
        except Exception as e:  # one machine's failure is its own
            failed[m.id] = e
    return rules, lookback


def _evidence(
    app: App, rules: dict[str, Rules], ids: list[str], now: datetime, grace: timedelta
) -> tuple[dict[tuple[str, timedelta], idle.Evidence], dict[str, datetime]]:
    """The idle evidence of machines ``ids`` for each of their idle rules' windows, and when
    each came up: two queries."""
    if not ids:
        return {}, {}
    checks = [c for m in ids for c in rules[m].idle]
    windows = {timedelta(minutes=c.rule.for_minutes) for c in checks}
    busy_at = max(c.rule.gpu_util_below for c in checks)
    evidence = idle.evidence(app, ids, now, windows, grace, busy_at)
    return evidence, idle.running_since(app, ids)


def _judge(
    ev: idle.Evidence, c: IdleCheck, now: datetime, up: datetime | None, grace: timedelta
) -> idle.Signal:
    """An idle check's signal on its window's evidence."""
    return idle.judge(
        ev,
        now=now,
        running_since=up,
        below=c.rule.gpu_util_below,
        window=timedelta(minutes=c.rule.for_minutes),
        grace=grace,
    )


def _autostops(
    app: App,
    now: datetime,
    machines: list[Machine],
    rules: dict[str, Rules],
    failed: dict[str, Exception],
    grace: timedelta,
) -> dict[str, autostop.Verdict]:
    """The autostop verdict of each running machine that has an autostop (its own or its
    policy's), judged on its idle rules' threshold."""
    wanted: dict[str, tuple[timedelta, float, bool]] = {}
    for m in machines:
        if m.status != S.RUNNING or m.id in failed:
            continue
        try:
            d = autostop.setting(app.policies, m).duration
            if d is not None:
                wanted[m.id] = (d, *idle.threshold(c.rule for c in rules[m.id].idle))
        except Exception as e:  # one machine's failure is its own
            failed[m.id] = e
    return autostop.verdicts(app, now, wanted, grace)


def _stoppable(m: Machine, how: str, why: str) -> tuple[str, str]:
    """A spot machine on a cloud that cannot stop one (AWS one-time spot) is terminated
    instead: left running it would bill all night, and its cloud may take it back any time."""
    if how == "stop" and m.market == "spot" and not machines.can_stop(m):
        return "terminate", (
            f"{why}; spot machine on {m.cloud} cannot be stopped: terminated with its boot disk "
            "(its volumes survive)"
        )
    return how, why


def _unstoppable_warning(how: str, was: str, warn: int) -> int:
    """At least :data:`UNSTOPPABLE_WARN_MINUTES` when a stop became a terminate."""
    return max(warn, UNSTOPPABLE_WARN_MINUTES) if (was, how) == ("stop", "terminate") else warn


def decide(a: Assessment, now: datetime) -> Action | None:
    """What the sweep does to one machine, and why; None: nothing."""
    m = a.machine
    if m.kept_until is not None and m.kept_until > now:
        return Action(m.name, "keep", "kept", f"kept until {m.kept_until:%Y-%m-%d %H:%M} UTC")
    lived = _lifetime(a, now)
    if lived is not None:
        return lived
    fired = _fired(a, now)
    if not fired:
        return _autostop(a)
    return _idle(a, fired, now)


def _lifetime(a: Assessment, now: datetime) -> Action | None:
    """The stop or terminate of a machine past its max lifetime; None: not past it."""
    m = a.machine
    if a.rules.lifetime and m.launched_at:
        after, how, source = a.rules.lifetime
        age = now - m.launched_at
        if age >= after and (how == "terminate" or m.status == S.RUNNING):
            why = f"up {format_duration(age)}, max lifetime {format_duration(after)} ({source})"
            was = how
            how, why = _stoppable(m, how, why)
            warn = _unstoppable_warning(how, was, 0)
            return Action(m.name, how, "max-lifetime", why, warn_minutes=warn)
    return None


def _fired(a: Assessment, now: datetime) -> list[tuple[IdleCheck, str | None, idle.Signal]]:
    """The idle checks that fire now: each with why its calendar is off (None: no calendar)
    and its signal."""
    fired = []
    for check, signal in a.signals.items():
        off = check.calendar.why_off(now) if check.calendar else None
        if check.calendar and off is None:
            continue
        if a.jobs and not check.rule.gpus_only:
            continue  # a running job keeps the machine busy
        if _idleness(a, check, signal):
            fired.append((check, off, signal))
    return fired


def _idleness(a: Assessment, check: IdleCheck, signal: idle.Signal) -> bool:
    """Whether ``signal`` counts as idle by ``check``'s rule: silence only when the rule says
    so, and never silence the endpoint caused."""
    return signal == "idle" or (
        signal == "unknown"
        and check.rule.unknown_counts_as_idle
        and check not in a.blinded  # silence the endpoint caused is not idleness
    )


def _idle(
    a: Assessment, fired: list[tuple[IdleCheck, str | None, idle.Signal]], now: datetime
) -> Action:
    """The stop (or terminate, if any rule says so) of an idle machine, by the first check
    that fired."""
    m = a.machine
    check, off, signal = fired[0]
    how = "terminate" if any(c.rule.action == "terminate" for c, _, _ in fired) else "stop"
    activity = (
        f"GPUs below {check.rule.gpu_util_below:g}% for {check.rule.for_minutes} min"
        if signal == "idle"
        else "no heartbeat (counted as idle)"
    )
    why = f"{off}; {activity} ({check.source})" if off else f"{activity} ({check.source})"
    if a.jobs:  # a gpus_only rule: the stop ends the job (recorded, the owner told)
        why += f"; job {', '.join(a.jobs)} running ends with it (gpus_only)"
    since = now - timedelta(minutes=check.rule.for_minutes) if signal == "idle" else None
    warn = max((c.rule.warn_minutes for c, _, _ in fired), default=0)
    was = how
    how, why = _stoppable(m, how, why)
    warn = _unstoppable_warning(how, was, warn)
    return Action(
        m.name, how, "off-hours-idle" if off else "idle", why, idle_since=since, warn_minutes=warn
    )


def _autostop(a: Assessment) -> Action | None:
    """Stop a machine idle for its autostop (terminated where its cloud cannot stop it)."""
    v = a.autostop
    if v is None or not v.due or a.machine.status != S.RUNNING:
        return None
    how, why = _stoppable(a.machine, "stop", v.text())
    warn = _unstoppable_warning(how, "stop", 0)
    return Action(a.machine.name, how, "autostop", why, idle_since=v.idle_since, warn_minutes=warn)


#: Machines acted on per batch call and per transaction; the lease is kept before each.
BATCH = 1000


def run(
    app: App, now: datetime | None = None, *, dry_run: bool = False, holder: str = HOLDER
) -> Pass:
    pass_now = now or app.clock.now()
    app.policies  # noqa: B018  (a bad policy file stops the pass before anything is done)

    def body(lease: Held) -> Pass:
        now = pass_now
        machines = _machines(app, now, lease)
        result = Pass("sweep", dry_run=dry_run, checked=len(machines))
        # each machine's own report (samples, job ends), read now: idle known behind NAT
        pulled = pull.pull_all(app, machines)
        result.pulls = pulled.lines
        result.actions += [
            Action(n, "record", "job-ended", f"job {j}: {how}", True)
            for n, j, how in pulled.job_ends
        ]
        assessed, failed = assess(app, now, machines)
        by_id = {a.machine.id: a for a in assessed}
        todo: list[tuple[Action, Machine]] = []
        for m in lease.each(machines):  # owners may be mailed on the way
            try:
                if m.id in failed:
                    raise failed[m.id]
                action = decide(by_id[m.id], now)
                if action is None:
                    continue
                if action.warn_minutes and action.action in ("stop", "terminate"):
                    action = _warned_first(app, m, action, now, dry_run)
            except Exception as e:  # shown (and logged by the daemon); the others are acted on
                why = f"could not be assessed ({type(e).__name__}: {e}); left as it is"
                action = Action(m.name, "skip", "error", why, error=f"{type(e).__name__}: {e}")
            result.actions.append(action)
            if not dry_run and action.action in ("stop", "terminate"):
                todo.append((action, m))
        _act(app, lease, todo)
        if not dry_run and lease:
            heartbeats.prune(app, now - _retention(app, assessed))
        return result

    return run_pass(app, "sweep", pass_now, body, holder=holder, dry_run=dry_run)


def _retention(app: App, assessed: list[Assessment]) -> timedelta:
    """How long heartbeats are kept: a day, or as long as the longest autostop in force needs
    to be proven (up to seven days)."""
    grace = timedelta(seconds=app.settings.scheduler.heartbeat_grace_seconds)
    longest = max((a.autostop.autostop for a in assessed if a.autostop), default=timedelta(0))
    return max(HEARTBEAT_RETENTION, longest + grace)


def _machines(app: App, now: datetime, lease: Held) -> list[Machine]:
    """The machines the sweep may act on, read once: from the pass's reconcile (one list call
    per cloud brings the state up to date), or from the state in a dry run."""
    if not lease.dry_run:
        return [
            o.machine
            for o in machines.reconcile(app, now=now, keep=lease.renew)
            if o.machine.status in (S.RUNNING, S.STOPPED) and o.machine.instance_id
        ]
    with app.db.session() as s:
        return list(
            s.scalars(
                select(Machine).where(
                    Machine.status.in_((S.RUNNING, S.STOPPED)), Machine.instance_id.is_not(None)
                )
            )
        )


def _act(app: App, lease: Held, todo: list[tuple[Action, Machine]]) -> None:
    """The stops and terminates, in batches per cloud, region, action and reason: one batch
    call and one transaction each, the lease kept before each. A machine that fails is
    recorded on its action (and tried again by the next pass)."""
    groups: dict[tuple[str, str, str, str], list[tuple[Action, Machine]]] = {}
    for action, m in todo:
        key = (m.cloud or "", m.region or "", action.action, action.reason)
        groups.setdefault(key, []).append((action, m))
    batches = [
        (how, reason, items[k : k + BATCH])
        for (_, _, how, reason), items in groups.items()
        for k in range(0, len(items), BATCH)
    ]
    for how, reason, batch in lease.each(batches, lambda b: [a for a, _ in b[2]]):
        details = {m.id: _detail(action) for action, m in batch}
        group = [m for _, m in batch]
        done = ended.act_many(app, group, how, reason=reason, details=details)
        for action, m in batch:
            outcome = done[m.id]
            if outcome.error:
                action.error = outcome.error
                continue
            action.done = True
            if not outcome.changed:
                action.why += " (it already was)"


def _detail(action: Action) -> dict[str, Any]:
    detail = {"why": action.why}
    if action.idle_since is not None:
        detail["idle_since"] = action.idle_since.isoformat()
    return detail


def _warned_first(app: App, m: Machine, action: Action, now: datetime, dry_run: bool) -> Action:
    """The owner hears of an idle stop ``warn_minutes`` before it happens (and can `keep` the
    machine). A warning older than twice that, with the machine busy in between, is stale:
    the next idle spell is warned again."""
    wait = timedelta(minutes=action.warn_minutes)
    with app.db.session() as s:
        last = s.scalars(
            select(Event)
            .where(
                Event.machine_id == m.id, Event.kind.in_((K.STOP_WARNING, K.STARTED, K.LAUNCHED))
            )
            .order_by(Event.id.desc())
        ).first()
    warned = last.at if last is not None and last.kind == K.STOP_WARNING else None
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
    machines.record_event(app, m.id, K.STOP_WARNING, reason=action.reason, detail=detail)
    key = f"stop-warning:{m.id}:{when.isoformat(timespec='seconds')}"
    done = "stopped" if action.action == "stop" else "terminated"
    subject = f"{m.name} will be {done} at {when:%H:%M} UTC"
    notify.record_mail(
        app, key, "stop-warning", [m.owner], subject, pending.error, retried=False, machine=m.name
    )
    notify.tell(app, _warning_notice(m, action, when, key), m.project, m.owner)
    pending.done = pending.error is None
    return pending


def _warning_notice(m: Machine, action: Action, when: datetime, key: str) -> notify.Notice:
    done = "stopped" if action.action == "stop" else "terminated"
    return notify.Notice(
        "stop-warning",
        key,
        notify.texts(
            "stop-warning",
            machine=m.name,
            where=f"{m.cloud} {m.zone or m.region}, {m.gpu_count}×{m.gpu}",
            done=done,
            done_ru="остановлена" if action.action == "stop" else "удалена",
            when=f"{when:%Y-%m-%d %H:%M}",
            why=action.why,
            keep=(when + timedelta(hours=2)).strftime("%H:%M"),
        ),
        machine=m.name,
        link=f"/machine/{m.name}",
        extra={"act_at": when.isoformat(), "action": action.action, "reason": action.reason},
    )


def _mail_warning(app: App, m: Machine, action: Action, when: datetime) -> None:
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
    why = "max lifetime" if action.reason == "max-lifetime" else "idle"
    subject = f"provisioner: {m.name} will be {done} at {when:%H:%M} UTC ({why})"
    mail.send(smtp, mail.compose(sender=smtp.sender, to=[m.owner], subject=subject, text=text))


# --- keep ------------------------------------------------------------------------------------


def calendar_for(app: App, m: Machine) -> Calendar | None:
    """The off-hours calendar of the first policy with one that applies to ``m``."""
    for p in matching(app.policies, m.project, m.owner):
        if p.off_hours:
            return Calendar(p.off_hours)
    return None


def keep_timezone(app: App, m: Machine) -> Any:
    """The zone ``keep`` reads and answers times in: the machine's policy calendar's, else
    settings' ``timezone``."""
    cal = calendar_for(app, m)
    return cal.tz if cal else ZoneInfo(app.settings.timezone)


#: the longest a `keep` may last: an evening, a weekend, a conference deadline — not for good
MAX_KEEP = timedelta(days=31)


def keep(app: App, name: str, until: str) -> Machine:
    """Leave ``name`` alone until ``until``: ``HH:MM`` (next such time in the machine's policy
    calendar, else settings' ``timezone``, UTC by default) or an ISO date-time. Only a
    running machine can be kept running."""
    now = app.clock.now()
    m = machines.find_to_act(app, name)
    if m.status not in (S.RUNNING, S.PENDING):
        raise UserError(
            f"{m.name} is {m.status}: there is nothing to keep running"
            + (f" (start it with `provisioner start {m.name}`)" if m.status == S.STOPPED else "")
        )
    cal = calendar_for(app, m)
    tz = keep_timezone(app, m)
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
    if when > now + MAX_KEEP:
        raise UserError(
            f"--until {until!r}: at most {MAX_KEEP.days} days ahead (a machine kept for good "
            "belongs in a policy, where the team sees it)"
        )
    with app.db.session() as s:
        mm = machine_row(s, m.id)
        mm.kept_until = when
        s.add(
            Event(
                machine_id=m.id,
                at=now,
                kind=K.KEPT,
                reason="user",
                detail={"until": when.isoformat(), "timezone": str(tz)},
            )
        )
        return mm


def unkeep(app: App, name: str) -> tuple[Machine, bool]:
    """Cancel ``keep``: the sweep judges the machine again from its next pass. Returns
    (machine, whether it was kept)."""
    now = app.clock.now()
    m = machines.find_to_act(app, name)
    with app.db.session() as s:
        mm = machine_row(s, m.id)
        was = mm.kept_until is not None and mm.kept_until > now
        if mm.kept_until is not None:
            mm.kept_until = None
            s.add(Event(machine_id=m.id, at=now, kind=K.KEEP_CANCELLED, reason="user"))
        return mm, was


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
