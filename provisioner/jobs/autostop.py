"""Autostop at any hour: a running machine whose GPUs were idle, with no job running and no SSH
session open, continuously for its autostop duration is stopped by the sweep, whatever the hour
(out-of-hours rules still apply besides).

A machine's own duration comes from ``lifecycle.autostop`` at ``up`` and ``provisioner autostop
NAME 30m`` after (``--cancel`` clears it), stored as ``machines.autostop_seconds``. A matching
policy's ``max_autostop`` caps it — and gives one to a machine that has none.

Idle is judged on the heartbeats the idle rules use (:mod:`provisioner.idle`): each beat's
busiest GPU below the machine's idle threshold (its rules' lowest ``gpu_util_below``, 5% by
default) and no SSH session, beats no further apart than the heartbeat grace. Silence is not
idle unless one of the machine's idle rules says ``unknown_counts_as_idle``. A job runs while
its ``job-started`` event has no later ``job-finished`` of the same job id; the idle span
starts no earlier than the last job's end nor the machine's last start.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select

from policies.duration import autostop_duration, format_duration, short_duration
from policies.schema import Policy, autostop_cap
from provisioner import idle, machines, outages
from provisioner.app import App
from provisioner.errors import UserError
from provisioner.models import Event, Heartbeat, Machine
from provisioner.schema import EventKind as K
from provisioner.schema import MachineStatus as S
from provisioner.state import machine as machine_row

JOB_STARTED, JOB_FINISHED = K.JOB_STARTED, K.JOB_FINISHED


short = short_duration  # 30m, 2h


# --- the setting -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """A machine's autostop: its own, the policy cap, and the one that applies."""

    own: timedelta | None
    cap: timedelta | None
    cap_policy: str | None

    @property
    def duration(self) -> timedelta | None:
        if self.cap is not None and (self.own is None or self.own > self.cap):
            return self.cap
        return self.own

    @property
    def capped(self) -> bool:
        return self.duration is not None and self.duration != self.own

    @property
    def note(self) -> str:
        """``30m``, ``1h (capped from 4h by policy lab)``, ``1h (policy lab's max_autostop)``,
        or ``off``."""
        d = self.duration
        if d is None:
            return "off"
        if not self.capped:
            return short(d)
        if self.own is None:
            return f"{short(d)} (policy {self.cap_policy}'s max_autostop)"
        return f"{short(d)} (capped from {short(self.own)} by policy {self.cap_policy})"


cap = autostop_cap  # the shortest max_autostop of the policies that apply, and its policy


def setting(policies: list[Policy], m: Machine) -> Setting:
    own = timedelta(seconds=m.autostop_seconds) if m.autostop_seconds else None
    c = cap(policies, m.project, m.owner)
    return Setting(own, c[0] if c else None, c[1] if c else None)


def initial(experiment_autostop: timedelta | None) -> int | None:
    """``machines.autostop_seconds`` at ``up``: the file's ``lifecycle.autostop``."""
    return None if experiment_autostop is None else round(experiment_autostop.total_seconds())


# --- the command -------------------------------------------------------------------------------


def set_autostop(app: App, name: str, duration: str) -> tuple[Machine, Setting]:
    """``provisioner autostop NAME 30m``: a live machine's own autostop (event
    ``autostop-set``)."""
    try:
        d = autostop_duration(duration)
    except ValueError as e:
        raise UserError(f"autostop {duration!r}: {e}") from None
    m = machines.find_to_act(app, name)
    if m.status not in (S.RUNNING, S.PENDING, S.STOPPED):
        raise UserError(f"{m.name} is {m.status}: autostop needs a live machine")
    seconds = round(d.total_seconds())
    with app.db.session() as s:
        mm = machine_row(s, m.id)
        mm.autostop_seconds = seconds
        st = setting(app.policies, mm)
        detail = {"seconds": seconds, "applies": st.note}
        at = app.clock.now()
        s.add(Event(machine_id=m.id, at=at, kind=K.AUTOSTOP_SET, reason="user", detail=detail))
        return mm, st


def cancel_autostop(app: App, name: str) -> tuple[Machine, Setting, bool]:
    """``provisioner autostop NAME --cancel`` (event ``autostop-cancelled``); a policy's
    ``max_autostop`` still applies. Returns whether the machine had one of its own."""
    m = machines.find_to_act(app, name)
    with app.db.session() as s:
        mm = machine_row(s, m.id)
        had = mm.autostop_seconds is not None
        if had:
            mm.autostop_seconds = None
            at = app.clock.now()
            s.add(Event(machine_id=m.id, at=at, kind=K.AUTOSTOP_CANCELLED, reason="user"))
        return mm, setting(app.policies, mm), had


def tell_machine(app: App, m: Machine, st: Setting) -> str | None:
    """The running machine's own guard told the autostop that now applies (the agent reads
    ``~/.provisioner/autostop.json`` of the login user each tick, over its ``guard.json``).
    None when told; else what the owner should know (the machine enforces the old one)."""
    from providers.base import ProviderError
    from provisioner.machines.remote import Remote

    if m.status != S.RUNNING or app.provider(m.cloud or "").runs_jobs:
        return None  # stopped: its guard is idle; the sandbox runs its agent itself
    seconds = None if st.duration is None else round(st.duration.total_seconds())
    body = json.dumps({"autostop_s": seconds})
    path = '"$PV_HOME/.provisioner/autostop.json"'
    script = (
        f'mkdir -p "$PV_HOME/.provisioner" && printf "%s\\n" {shlex.quote(body)} > {path}.tmp '
        f"&& mv {path}.tmp {path}\n"
    )
    try:
        done = Remote(app, m).run(script, timeout=20)
    except ProviderError as e:
        return f"its own guard could not be told ({e}): it keeps the autostop it had"
    if done.returncode != 0:
        return f"its own guard could not be told (exit {done.returncode}): it keeps the old one"
    return None


# --- the evidence ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Beat:
    at: datetime
    max_util: float | None
    ssh_sessions: int | None  # None: an agent too old to count them (no evidence of one)


@dataclass(frozen=True)
class Jobs:
    running: tuple[str, ...]  # job ids started and not finished
    last_end: datetime | None  # the latest job-finished


@dataclass(frozen=True)
class Verdict:
    """How long the machine has been idle, or why it is not."""

    autostop: timedelta
    idle_since: datetime | None  # None: not idle now
    idle: timedelta  # so far (0 when not idle)
    why_not: str | None  # what keeps it from idling: a job, an SSH session, busy GPUs, silence

    @property
    def due(self) -> bool:
        return self.idle_since is not None and self.idle >= self.autostop

    def text(self) -> str:
        """``idle 12 min so far`` / ``idle 31 min ≥ autostop 30m`` / ``not idle: a job runs``."""
        if self.why_not:
            return f"not idle: {self.why_not}"
        if self.due:
            return f"idle {format_duration(self.idle)} ≥ autostop {short(self.autostop)}"
        return f"idle {format_duration(self.idle)} so far"


def jobs(app: App, machine_ids: Iterable[str]) -> dict[str, Jobs]:
    """Each machine's running jobs and last job end, from its ``job-started`` and
    ``job-finished`` events: a job runs while no later ``job-finished`` has its id."""
    wanted = sorted(set(machine_ids))
    open_: dict[str, dict[str, datetime]] = {}
    ends: dict[str, datetime] = {}
    with app.db.session() as s:
        for k in range(0, len(wanted), 500):
            rows = s.execute(
                select(Event.machine_id, Event.kind, Event.at, Event.detail)
                .where(
                    Event.machine_id.in_(wanted[k : k + 500]),
                    Event.kind.in_((JOB_STARTED, JOB_FINISHED)),
                )
                .order_by(Event.id)
            )
            for mid, kind, at, detail in rows:
                job = str((detail or {}).get("job"))
                started = open_.setdefault(mid, {})
                if kind == JOB_STARTED:
                    started[job] = at
                else:
                    started.pop(job, None)
                    ends[mid] = max(ends.get(mid, at), at)
    return {
        mid: Jobs(tuple(sorted(open_.get(mid, {}))), ends.get(mid))
        for mid in wanted
        if open_.get(mid) or mid in ends
    }


def beats(app: App, since: dict[str, datetime]) -> dict[str, list[Beat]]:
    """Each machine's heartbeats from its ``since``, oldest first."""
    out: dict[str, list[Beat]] = {mid: [] for mid in since}
    if not since:
        return out
    wanted = sorted(since)
    earliest = min(since.values())
    with app.db.session() as s:
        for k in range(0, len(wanted), 500):
            h = Heartbeat
            rows = s.execute(
                select(h.machine_id, h.at, h.max_util, h.ssh_sessions)
                .where(h.machine_id.in_(wanted[k : k + 500]), h.at >= earliest)
                .order_by(h.machine_id, h.at)
            )
            for mid, at, util, ssh in rows:
                if at >= since[mid]:
                    out[mid].append(Beat(at, util, ssh))
    return out


def _busy(b: Beat, below: float) -> str | None:
    if b.max_util is None:
        return "the agent sees no GPU"
    if b.max_util >= below:
        return f"GPUs busy ({b.max_util:g}% ≥ {below:g}%)"
    if b.ssh_sessions:
        return f"{b.ssh_sessions} SSH session(s) open"
    return None


NO_BEAT = "no recent heartbeat (not counted as idle)"


def _heard(
    beats: list[Beat], now: datetime, below: float, grace: timedelta
) -> tuple[datetime | None, str]:
    """(start of the idle run of beats that ends now, else None; why not idle): silence
    longer than ``grace`` breaks the run."""
    start, later = None, now
    for b in reversed(beats):
        why = NO_BEAT if later - b.at > grace else _busy(b, below)
        if why is not None:
            return start, why
        start = later = b.at
    return start, NO_BEAT


def _silent(beats: list[Beat], since: datetime, below: float) -> tuple[datetime | None, str]:
    """The same where silence (and an agent that sees no GPU) counts as idle: only busy GPUs
    or an SSH session break the run, which otherwise goes back to ``since``."""
    start = None
    for b in reversed(beats):
        if b.ssh_sessions or (b.max_util is not None and b.max_util >= below):
            return start, _busy(b, below) or ""
        start = b.at
    return since, ""


def judge(
    beats: list[Beat],
    *,
    now: datetime,
    autostop: timedelta,
    below: float,
    grace: timedelta,
    silence_is_idle: bool,
    running_since: datetime | None,
    job: Jobs | None,
) -> Verdict:
    """The current idle span of one machine (``beats`` oldest first): every beat idle (GPUs
    below ``below``, no SSH session), none further than ``grace`` from the next nor from now,
    from after the last job's end and the machine's last start."""
    if job is not None and job.running:
        return Verdict(autostop, None, timedelta(0), f"job {', '.join(job.running)} running")
    if silence_is_idle:
        start, why = _silent(beats, now - autostop - grace, below)
    else:
        start, why = _heard(beats, now, below, grace)
    if start is None:
        return Verdict(autostop, None, timedelta(0), why)
    for floor in (running_since, job.last_end if job else None):
        if floor is not None and floor > start:
            start = floor
    return Verdict(autostop, start, max(now - start, timedelta(0)), None)


def verdicts(
    app: App,
    now: datetime,
    wanted: dict[str, tuple[timedelta, float, bool]],
    grace: timedelta,
) -> dict[str, Verdict]:
    """Each running machine's :class:`Verdict`: ``wanted`` maps a machine id to its (autostop,
    idle threshold, silence counts as idle). Three queries in all. The idle span is looked for
    only as far back as it must be to be due (autostop + grace): one idle for longer shows
    that much."""
    if not wanted:
        return {}
    since = {mid: now - d - grace for mid, (d, _, _) in wanted.items()}
    seen = beats(app, since)
    running = jobs(app, wanted)
    started = idle.running_since(app, wanted)
    spans = outages.overlapping(app, min(since.values()), now)
    out: dict[str, Verdict] = {}
    for mid, (d, below, silence) in wanted.items():
        out[mid] = judge(
            seen.get(mid, []),
            now=now,
            autostop=d,
            below=below,
            grace=grace,
            # silence the heartbeat endpoint caused (refusing, or down) is not idleness
            silence_is_idle=silence and not outages.overlaps(spans, since[mid], now),
            running_since=started.get(mid),
            job=running.get(mid),
        )
    return out


def show(app: App, m: Machine, st: Setting | None = None) -> dict[str, Any]:
    """What ``autostop NAME`` and ``status NAME`` say of a machine's autostop: the setting,
    its cap, and (running) how long it has been idle so far."""
    st = st or setting(app.policies, m)
    d = st.duration
    out: dict[str, Any] = {
        "autostop": short(d) if d else None,
        "seconds": round(d.total_seconds()) if d else None,
        "own": short(st.own) if st.own else None,
        "capped_by": st.cap_policy if st.capped else None,
        "idle_seconds": None,
        "idle_since": None,
        "why_not": None,
    }
    if d is None:
        return {**out, "text": "off"}
    if m.status != S.RUNNING:
        return {**out, "text": f"{st.note} (counts once it runs)"}
    now = app.clock.now()
    grace = timedelta(seconds=app.settings.scheduler.heartbeat_grace_seconds)
    v = verdicts(app, now, {m.id: (d, *idle.threshold(idle.idle_rules(app.policies, m)))}, grace)[
        m.id
    ]
    out.update(
        idle_seconds=round(v.idle.total_seconds()) if v.idle_since else None,
        idle_since=v.idle_since,
        why_not=v.why_not,
    )
    return {**out, "text": f"{st.note} ({v.text()})"}
