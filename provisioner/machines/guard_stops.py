"""A machine that stopped itself: what its guard said, read back by reconcile.

The agent on every machine (``provisioner/agent.py``) enforces ``autostop``, ``on_finish`` and
``max_lifetime`` by shutting the machine's OS down, having first written ``stop.json`` (its
report's ``stop``): when, why (``autostop`` / ``on-finish`` / ``max-lifetime``), and the jobs
the stop ended. When reconcile finds a machine halted that provisioner did not halt, it reads
the machine's report (the sandbox: :meth:`Provider.machine_report`; a cloud: the report the
pull reads over SSH) and :func:`explain` turns it into the stop's reason and detail, and the
jobs' ends; without a readable stop, the event says the machine was stopped from inside or
outside with no reason known. The ledger still closes at the cloud's own stop time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from providers.base import ProviderError
from provisioner.app import App
from provisioner.machines import jobs
from provisioner.machines.record import ref
from provisioner.models import Event, Machine

GUARD_REASONS = ("autostop", "on-finish", "max-lifetime")
#: the reason of a stop neither provisioner nor the machine's guard explains
UNEXPLAINED = "outside-provisioner"
UNKNOWN = "stopped from inside the machine or outside provisioner; no reason known"
#: how far the machine's clock may lag the scheduler's and its stop still count for this run
SKEW = timedelta(minutes=1)


@dataclass
class Explained:
    """Why a machine stopped, as recorded: its event's reason and detail, and the ends of the
    jobs the events still say run (job id → (reason, exit code))."""

    reason: str
    detail: dict[str, Any]
    jobs: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    at: datetime | None = None  # when the guard shut the machine down, by its clock


def _iso(text: Any) -> datetime | None:
    if not isinstance(text, str):
        return None
    try:
        at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return at if at.tzinfo is not None else None


def _exit_code(state: Any) -> int | None:
    """``"exit N"`` → N; anything else (``lost``, ``running``) → None."""
    if isinstance(state, str) and state.startswith("exit "):
        try:
            return int(state.split()[1])
        except (IndexError, ValueError):
            return None
    return None


def explain(report: dict[str, Any] | None, running: list[str], since: datetime | None) -> Explained:
    """The stop a parsed report (``provisioner-agent --report``) explains: its guard's reason
    when it holds a well-formed ``stop`` of this run (not before ``since``, the open usage's
    start), with what it said and each job in ``running`` (the jobs the events say still run)
    ended as the report tells; else "no reason known"."""
    stop = _guard_stop((report or {}).get("stop"), since)
    if stop is None:
        return Explained(UNEXPLAINED, {"by": UNKNOWN})
    at = _iso(stop.get("at"))
    assert at is not None
    said = _said(stop.get("jobs_ended"))
    states = (report or {}).get("jobs")
    states = states if isinstance(states, dict) else {}
    reason = str(stop["reason"])
    out = Explained(
        reason,
        at=at,
        detail={
            "by": "the machine's guard",
            "guard": {
                "at": at.isoformat(),
                "action": str(stop.get("action") or ""),
                "detail": str(stop.get("detail") or "")[:500],
                "jobs_ended": said,
            },
        },
    )
    for job in running:
        out.jobs[job] = _job_end(_exit_code(states.get(job)), job in said, reason)
    return out


def _said(ended: Any) -> dict[str, str]:
    """The guard's ``jobs_ended`` (job → what it said), each said cut to 200 characters; {}
    when not a dict."""
    return {str(k): str(v)[:200] for k, v in ended.items()} if isinstance(ended, dict) else {}


def _guard_stop(stop: Any, since: datetime | None) -> dict[str, Any] | None:
    """A report's ``stop`` when well formed: a dict with a guard's reason and a time not
    before ``since`` (less the clocks' skew); else None."""
    at = _iso(stop.get("at")) if isinstance(stop, dict) else None
    if (
        not isinstance(stop, dict)
        or stop.get("reason") not in GUARD_REASONS
        or at is None
        or (since is not None and at < since - SKEW)
    ):
        return None
    return stop


def _job_end(code: int | None, said: bool, reason: str) -> tuple[str, int | None]:
    """How a job running at the stop ended: exited with ``code`` before it (its own end),
    ended by the guard's stop that ``said`` so, else killed with its machine."""
    if code is not None:  # it exited before the stop: its own end
        return ("exited", code)
    if said:  # the guard's stop ended it, and said so
        return (reason, None)
    return ("killed", None)  # ended with its machine


def inferred(app: App, m: Machine) -> Explained | None:
    """A stop whose report cannot be read (a cloud machine its cloud terminated, or keeps
    stopped out of reach of SSH), explained by what is recorded: its ``run`` exited (the
    pull or a look over SSH recorded the code) and its ``on_finish`` stops or terminates it —
    what its guard does then. None when nothing recorded explains it."""
    from provisioner.spec import Experiment

    try:
        on_finish = Experiment.model_validate(m.spec or {}).on_finish
    except ValueError:
        return None
    run = jobs.jobs_of(app, m).get(jobs.RUN)
    if on_finish not in ("stop", "terminate") or run is None or run.exit_code is None:
        return None
    said = f"inferred: its run exited {run.exit_code} and on_finish {on_finish}s it"
    return Explained("on-finish", {"by": "the machine's guard", "guard": {"detail": said}})


def said_by_guard(detail: Any) -> bool:
    """A stop event's detail as :func:`explain` writes it from the guard's own ``stop`` (with
    the guard's time), not one :func:`inferred` from what is recorded."""
    guard = detail.get("guard") if isinstance(detail, dict) else None
    return isinstance(guard, dict) and _iso(guard.get("at")) is not None


def read_report(app: App, m: Machine) -> dict[str, Any] | None:
    """The machine's report where its cloud keeps it (None: not readable there; the pull
    reads a cloud machine's over SSH)."""
    try:
        raw = app.provider(m.cloud or "").machine_report(ref(m))
    except (ProviderError, OSError):
        return None
    if raw is None:
        return None
    try:
        parsed = json.loads(raw)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def record_jobs(s: Session, m: Machine, explained: Explained, at: datetime) -> None:
    """Each job the stop ended (or that had exited before it), as a ``job-finished`` event at
    the stop, with the guard's reason when the guard ended it: never a job left running."""
    for job, (reason, code) in explained.jobs.items():
        detail: dict[str, Any] = {"job": job, "exit_code": code}
        if reason in GUARD_REASONS:
            detail["how"] = explained.detail["guard"]["jobs_ended"].get(job, "")
        s.add(Event(machine_id=m.id, at=at, kind=jobs.FINISHED, reason=reason, detail=detail))


def running_jobs(app: App, m: Machine) -> list[str]:
    return [j.id for j in jobs.jobs_of(app, m).values() if j.running]
