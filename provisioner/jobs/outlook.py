"""The scheduler's next move on each machine — what, when and why — decided once, for
``sweep --dry-run``, ``status NAME`` and the dashboard's fleet page alike. Read-only: the
scheduler's own rules (:func:`provisioner.jobs.sweep.decide`, the recovery's
``_decide`` and its backoff, an intent's wait), asked about the future."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any

from policies.calendar import Calendar
from policies.duration import format_duration
from provisioner.app import App
from provisioner.jobs import recover, sweep
from provisioner.machines import waiting
from provisioner.models import Machine
from provisioner.schema import MachineStatus as S
from provisioner.tries import events, tries


@dataclass(frozen=True)
class Move:
    """One machine's next move. ``action``: stop, terminate, start, relaunch, try (an intent
    waiting for capacity), keep (left alone until ``at``) or none. ``at``: when it is due (at or
    before now: at the next pass); None: not scheduled. ``conditional``: only if the machine is
    then idle. ``key``/``params``: the dashboard's words for it; ``why``: the CLI's."""

    action: str
    at: datetime | None
    reason: str
    why: str
    conditional: bool = False
    key: str = "dash_next_none"
    params: dict[str, Any] = field(default_factory=dict)

    def due(self, now: datetime) -> bool:
        return self.action not in ("none", "keep") and self.at is not None and self.at <= now

    def to_json(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "at": self.at.isoformat() if self.at else None,
            "reason": self.reason,
            "why": self.why,
            "conditional": self.conditional,
        }


@lru_cache(maxsize=64)  # one answer per policy calendar per pass, not one per machine
def next_off(cal: Calendar, now: datetime) -> datetime | None:
    """The first instant after ``now`` that is out of hours, within two weeks
    (:meth:`Calendar.next_off`); None when the calendar has none."""
    return cal.next_off(now)


def _local(cal: Calendar, at: datetime, now: datetime) -> str:
    loc = cal.local(at)
    day = "" if loc.date() == cal.local(now).date() else f"{loc:%a %d %b} "
    return f"{day}{loc:%H:%M} {cal.spec.timezone}"


def why_not(a: sweep.Assessment, now: datetime) -> str:
    """Why the sweep leaves ``a.machine`` alone now, and when that may change."""
    m, r = a.machine, a.rules
    parts: list[str] = _lifetime_left(a, now)
    if m.status != S.RUNNING:
        parts.insert(0, f"{m.status}: no idle rule applies until it runs")
    for check in r.idle if m.status == S.RUNNING else []:
        parts.append(_not_idle(a, check, now))
    if a.autostop is not None:
        parts.append(f"autostop {sweep.autostop.short(a.autostop.autostop)}: {a.autostop.text()}")
    if not r.idle and not r.lifetime and a.autostop is None:
        parts.append("no idle rule, lifetime or autostop applies")
    return "; ".join(parts)


def _lifetime_left(a: sweep.Assessment, now: datetime) -> list[str]:
    """When the machine's max lifetime ends (none: it has none, or it is stopped and its
    lifetime only stops it)."""
    m = a.machine
    if a.rules.lifetime and m.launched_at:
        after, how, source = a.rules.lifetime
        ends = m.launched_at + after
        if m.status == S.RUNNING or how == "terminate":
            return [f"lifetime ends in {format_duration(ends - now)} ({how}, {source})"]
    return []


def _not_idle(a: sweep.Assessment, check: sweep.IdleCheck, now: datetime) -> str:
    """Why an idle check does not stop the running machine now."""
    signal = a.signals.get(check)
    if check.calendar is not None and check.calendar.why_off(now) is None:
        nxt = next_off(check.calendar, now)
        until = f" until {_local(check.calendar, nxt, now)}" if nxt else ""
        return f"in hours{until} ({check.source})"
    rule = check.rule
    if a.jobs and not rule.gpus_only:
        return f"job {', '.join(a.jobs)} running: busy ({check.source})"
    return {
        "busy": f"GPUs busy (not below {rule.gpu_util_below:g}% for {rule.for_minutes} min)",
        "starting": f"started less than {rule.for_minutes} min ago",
        "unknown": "no recent heartbeat (not counted as idle)",
    }.get(signal or "", f"signal {signal}") + f" ({check.source})"


def outlook(app: App, machines: list[Machine], now: datetime | None = None) -> dict[str, str]:
    """Per machine name: the action due now (as the sweep would say it), or why none is and
    what comes next."""
    now = now or app.clock.now()
    out: dict[str, str] = {}
    assessed, failed = sweep.assess(app, now, machines)
    names = {m.id: m.name for m in machines}
    for machine_id, e in failed.items():
        out[names[machine_id]] = f"its rules cannot be evaluated: {e}"
    decided = moves(app, now, assessed)
    for a in assessed:
        move = decided[a.machine.id]
        if move.due(now):
            out[a.machine.name] = f"{move.action} due now [{move.reason}]: {move.why}"
        elif move.action == "keep":
            out[a.machine.name] = f"left alone: {move.why}"
        else:
            text = "nothing due: " + (
                why_not(a, now) if a.machine.status in (S.RUNNING, S.STOPPED) else move.why
            )
            if move.at is not None and move.action != "none":
                text += f"; next: {move.action} [{move.reason}] at {move.at:%Y-%m-%d %H:%M} UTC"
                text += " if idle then" if move.conditional else ""
            out[a.machine.name] = text
    return out


def next_moves(app: App, machines: list[Machine], now: datetime) -> dict[str, Move]:
    """Per machine name: its next move (rules that cannot be evaluated: ``none`` with why)."""
    assessed, failed = sweep.assess(app, now, machines)
    decided = moves(app, now, assessed)
    out = {a.machine.name: decided[a.machine.id] for a in assessed}
    for m in machines:
        if m.id in failed:
            out[m.name] = Move(
                "none", None, "error", f"its rules cannot be evaluated: {failed[m.id]}"
            )
    return out


def moves(app: App, now: datetime, assessed: list[sweep.Assessment]) -> dict[str, Move]:
    """Per machine id: its next move (see :class:`Move`)."""
    out: dict[str, Move] = {}
    for a in assessed:
        m = a.machine
        if m.status == S.WAITING:
            out[m.id] = _waiting(app, m, now)
        elif m.status == S.PREEMPTED:
            out[m.id] = _recovery(app, m, now)
        elif m.status in (S.RUNNING, S.STOPPED):
            out[m.id] = _swept(a, now)
        else:
            out[m.id] = Move("none", None, "", f"{m.status}: nothing scheduled")
    return out


def _now_move(action: str, reason: str, why: str, now: datetime) -> Move:
    return Move(
        action, now, reason, why, key="dash_next_now", params={"action": action, "why": why}
    )


def _swept(a: sweep.Assessment, now: datetime) -> Move:
    """A running or stopped machine: what the sweep does now, else the earliest of its
    lifetime's end, the start of off hours for an idle rule and its autostop."""
    m = a.machine
    act = sweep.decide(a, now)
    if act is not None and act.action == "keep":
        return Move("keep", m.kept_until, "kept", act.why, key="dash_next_keep_ends")
    if act is not None:
        return _now_move(act.action, act.reason, act.why, now)
    return _next(_coming(a, now), now) or Move("none", None, "", why_not(a, now))


def _next(moves: list[Move], now: datetime) -> Move | None:
    """The earliest of the timed ``moves``, else the first one at any time; None: none."""
    timed = [x for x in moves if x.at is not None]
    if timed:
        return min(timed, key=lambda x: x.at or now)
    anytime = [x for x in moves if x.at is None]
    return anytime[0] if anytime else None


def _coming(a: sweep.Assessment, now: datetime) -> list[Move]:
    """The moves to come, in this order: the lifetime's end; while the machine runs, each
    idle rule's stop and its autostop."""
    moves: list[Move] = []
    lived = _lifetime_end(a, now)
    if lived is not None:
        moves.append(lived)
    if a.machine.status == S.RUNNING:
        for c in a.rules.idle:
            move = _idle_move(a, c, now)
            if move is not None:
                moves.append(move)
        if a.autostop is not None:
            moves.append(_autostop_move(a, now))
    return moves


def _lifetime_end(a: sweep.Assessment, now: datetime) -> Move | None:
    """The stop or terminate at the end of the machine's max lifetime; None: it has none."""
    m = a.machine
    if a.rules.lifetime and m.launched_at:
        after, how, source = a.rules.lifetime
        if how == "terminate" or m.status == S.RUNNING:
            how, _ = sweep._stoppable(m, how, "")
            why = f"{how}: max lifetime {format_duration(after)} ({source})"
            at = max(m.launched_at + after, now)
            said = {"action": how, "source": source}
            return Move(how, at, "max-lifetime", why, False, "dash_next_lifetime", said)
    return None


def _idle_move(a: sweep.Assessment, c: sweep.IdleCheck, now: datetime) -> Move | None:
    """The stop an idle check would make: at the start of off hours (its calendar's), or at
    any time (no calendar; ``at`` None); None: in off hours now with none to come."""
    m = a.machine
    how, _ = sweep._stoppable(m, c.rule.action, "")
    below = f"{c.rule.gpu_util_below:g}"
    why = f"{how} if GPUs stay below {below}% for {c.rule.for_minutes} min ({c.source})"
    if a.jobs and not c.rule.gpus_only:  # a running job keeps it busy
        why += f" once job {', '.join(a.jobs)} ends"
    params: dict[str, Any] = {"action": how, "minutes": c.rule.for_minutes}
    params |= {"below": below, "policy": c.source}
    if c.calendar is not None and c.calendar.why_off(now) is None:
        if (start := next_off(c.calendar, now)) is not None:
            why += f", out of hours from {_local(c.calendar, start, now)}"
            reason = "off-hours-idle"
            return Move(how, start, reason, why, True, "dash_next_idle", params)
        return None
    reason = "off-hours-idle" if c.calendar is not None else "idle"
    return Move(how, None, reason, why, True, "dash_next_idle", params)


def _autostop_move(a: sweep.Assessment, now: datetime) -> Move:
    """The stop autostop makes when the machine has been idle for its duration (``at``
    None: not idle yet)."""
    v = a.autostop
    assert v is not None
    how, _ = sweep._stoppable(a.machine, "stop", "")
    limit = sweep.autostop.short(v.autostop)
    why = f"{how} after {limit} idle (autostop): {v.text()}"
    params = {"action": how, "autostop": limit}
    due = v.idle_since + v.autostop if v.idle_since is not None else None
    return Move(how, due, "autostop", why, True, "dash_next_autostop", params)


def _recovery(app: App, m: Machine, now: datetime) -> Move:
    """A preempted machine: what recovery does at its next pass, or when its next try is due
    after a failed or refused one, or that it is left (``on_preemption: leave``, given up)."""
    with app.db.session() as s:
        t = tries(events(s, m.id))
    act = recover._decide(m, t, now)
    if act is not None and act.action != "give-up":
        return _now_move(act.action, "preempted", act.why, now)
    held = recover.held_line(t, now, app.zone)
    mode = recover.stored_experiment(m).lifecycle.on_preemption
    if mode == "leave":
        return Move("none", None, "preempted", "on_preemption: leave", key="dash_next_left")
    if t.gave_up is not None or act is not None:
        why = held or "relaunch given up"
        return Move("none", None, "preempted", why, key="dash_next_gave_up")
    how = "start" if recover._restartable(m) else "relaunch"
    why = held or f"{how} after a failed try"
    return Move(how, t.next_try, "preempted", why, key="dash_next_retry", params={"action": how})


def _waiting(app: App, m: Machine, now: datetime) -> Move:
    from provisioner.fleet import waiting_line

    _, w = waiting.state(app, m.id)
    if w is None:
        return Move("none", None, "waiting", "waiting for capacity")
    why = waiting_line(w.detail, now, app.zone)
    return Move("try", max(min(w.next_try, w.until), now), "waiting", why, key="dash_next_try")
