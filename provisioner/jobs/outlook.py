"""What the sweep will do next to each machine, and why not yet: for ``sweep --dry-run`` (why
nothing is due) and ``status NAME`` (next scheduled action). Read-only: the sweep's own rules
(:func:`provisioner.jobs.sweep.assess` and ``decide``), asked about the future."""

from __future__ import annotations

from datetime import datetime, time, timedelta
from functools import lru_cache

from policies.calendar import Calendar
from policies.duration import format_duration
from provisioner.app import App
from provisioner.jobs import sweep
from provisioner.models import Machine
from provisioner.schema import MachineStatus as S


@lru_cache(maxsize=64)  # one answer per policy calendar per pass, not one per machine
def next_off(cal: Calendar, now: datetime) -> datetime | None:
    """The first instant after ``now`` that is out of hours (a window's start or a day off's
    midnight), within two weeks; None when the calendar has none."""
    today = cal.local(now).date()
    starts = sorted(
        cal.to_instant(today + timedelta(days=d), t)
        for d in range(15)
        for t in {time(0), *(w.start for w in cal.spec.windows)}
    )
    return next((at for at in starts if at > now and cal.is_off(at)), None)


def _local(cal: Calendar, at: datetime, now: datetime) -> str:
    loc = cal.local(at)
    day = "" if loc.date() == cal.local(now).date() else f"{loc:%a %d %b} "
    return f"{day}{loc:%H:%M} {cal.spec.timezone}"


def why_not(a: sweep.Assessment, now: datetime) -> str:
    """Why the sweep leaves ``a.machine`` alone now, and when that may change."""
    m, r = a.machine, a.rules
    parts: list[str] = []
    if r.lifetime and m.launched_at:
        after, how, source = r.lifetime
        ends = m.launched_at + after
        if m.status == S.RUNNING or how == "terminate":
            parts.append(f"lifetime ends in {format_duration(ends - now)} ({how}, {source})")
    if m.status != S.RUNNING:
        parts.insert(0, f"{m.status}: no idle rule applies until it runs")
    for check in r.idle if m.status == S.RUNNING else []:
        signal = a.signals.get(check)
        if check.calendar is not None and check.calendar.why_off(now) is None:
            nxt = next_off(check.calendar, now)
            until = f" until {_local(check.calendar, nxt, now)}" if nxt else ""
            parts.append(f"in hours{until} ({check.source})")
            continue
        rule = check.rule
        parts.append(
            {
                "busy": f"GPUs busy (not below {rule.gpu_util_below:g}%"
                f" for {rule.for_minutes} min)",
                "starting": f"started less than {rule.for_minutes} min ago",
                "unknown": "no recent heartbeat (not counted as idle)",
            }.get(signal or "", f"signal {signal}")
            + f" ({check.source})"
        )
    if a.autostop is not None:
        parts.append(f"autostop {sweep.autostop.short(a.autostop.autostop)}: {a.autostop.text()}")
    if not r.idle and not r.lifetime and a.autostop is None:
        parts.append("no idle rule, lifetime or autostop applies")
    return "; ".join(parts)


def outlook(app: App, machines: list[Machine], now: datetime | None = None) -> dict[str, str]:
    """Per machine name: the action due now (as the sweep would say it), or why none is."""
    now = now or app.clock.now()
    out: dict[str, str] = {}
    assessed, failed = sweep.assess(app, now, machines)
    names = {m.id: m.name for m in machines}
    for machine_id, e in failed.items():
        out[names[machine_id]] = f"its rules cannot be evaluated: {e}"
    for a in assessed:
        action = sweep.decide(a, now)
        if action is None:
            out[a.machine.name] = "nothing due: " + why_not(a, now)
        elif action.action == "keep":
            out[a.machine.name] = f"left alone: {action.why}"
        else:
            out[a.machine.name] = f"{action.action} due now [{action.reason}]: {action.why}"
    return out
