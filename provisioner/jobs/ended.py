"""A running job is never killed silently. When the scheduler stops or terminates a machine on
which a job still runs (a GPUs-only idle rule out of hours, a max lifetime, an exhausted
budget, an ``on_finish`` while other jobs run), each such job gets its ``job-finished`` event
at that instant — reason ``killed``, no exit code, and in its detail the stop's reason
(``ended_by``) and why — so ``jobs_of`` no longer counts it as running (autostop can fire again
once the machine runs idle) and ``logs``/``status`` say how it ended; and the owner is told
through the notify path (topic ``job-ended``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import select

from provisioner import machines, notify
from provisioner.app import App
from provisioner.machines import jobs
from provisioner.models import Event, Machine

TOPIC = "job-ended"


def running(app: App, machine_ids: Iterable[str]) -> dict[str, list[str]]:
    """Each machine's jobs the events say run (started, no later end), by machine id; machines
    without one are left out. One query per 500 machines."""
    wanted = sorted(set(machine_ids))
    open_: dict[str, dict[str, None]] = {}
    with app.db.session() as s:
        for k in range(0, len(wanted), 500):
            rows = s.execute(
                select(Event.machine_id, Event.kind, Event.detail)
                .where(
                    Event.machine_id.in_(wanted[k : k + 500]),
                    Event.kind.in_((jobs.STARTED, jobs.FINISHED)),
                )
                .order_by(Event.id)
            )
            for mid, kind, detail in rows:
                job = str((detail or {}).get("job"))
                if kind == jobs.STARTED:
                    open_.setdefault(mid, {})[job] = None
                else:
                    open_.get(mid, {}).pop(job, None)
    return {mid: list(js) for mid, js in open_.items() if js}


def act_many(
    app: App,
    group: list[Machine],
    how: str,
    *,
    reason: str,
    details: dict[str, dict[str, Any]] | None = None,
    why: str = "",
) -> dict[str, machines.Outcome]:
    """:func:`machines.act_many`, and for each machine it stopped or terminated that had jobs
    running, their ends recorded and its owner told (:func:`record`)."""
    before = running(app, [m.id for m in group])
    done = machines.act_many(app, group, how, reason=reason, details=details)
    for m in group:
        outcome = done.get(m.id)
        if m.id in before and outcome is not None and not outcome.error and outcome.changed:
            said = why or ((details or {}).get(m.id) or {}).get("why", "")
            record(app, m, before[m.id], how=how, reason=reason, why=str(said))
    return done


def record(app: App, m: Machine, job_ids: list[str], *, how: str, reason: str, why: str) -> None:
    """The jobs ``job_ids`` of ``m`` ended now by a ``how`` (stop/terminate) for ``reason``:
    their ``job-finished`` events, and one notice to the owner."""
    if not job_ids:
        return
    now = app.clock.now()
    for job in job_ids:
        machines.record_event(
            app,
            m.id,
            jobs.FINISHED,
            reason="killed",
            detail={"job": job, "exit_code": None, "ended_by": reason, "why": why},
        )
    done = "stopped" if how == "stop" else "terminated"
    names = ", ".join(job_ids)
    notice = notify.Notice(
        TOPIC,
        f"{TOPIC}:{m.id}:{now.isoformat(timespec='seconds')}",
        notify.texts(
            TOPIC,
            machine=m.name,
            where=f"{m.cloud} {m.zone or m.region}",
            jobs=names,
            done={"en": done, "ru": "остановлена" if how == "stop" else "удалена"},
            reason=reason,
            why=why or reason,
        ),
        machine=m.name,
        link=f"/machine/{m.name}",
        extra={"jobs": job_ids, "action": how, "reason": reason},
    )
    notify.tell(app, notice, m.project, m.owner)
