"""Jobs wait their turn for the machine's GPUs. ``exec --gpus N`` asks for N of them (default 0:
the job counts for none and sees the machine as it is); the experiment's ``run`` holds all of
them while it runs. A job whose GPUs are free starts at once with ``CUDA_VISIBLE_DEVICES`` set
to the ones it was given; else it is queued (a ``job-queued`` event) and started, first come
first served, when a job's end frees enough — whenever provisioner sees that end: ``up``'s and
``logs -f``'s follow, ``logs``, ``cancel``, the scheduler's pass
(:func:`provisioner.jobs.finish.on_ended`). ``queue NAME`` lists them all.

The queue is kept in the state's events, not on the machine: a queued job starts at the next
look after the end that freed its GPUs, not the instant it ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select

from provisioner.app import App
from provisioner.errors import UserError
from provisioner.machines import jobs
from provisioner.machines.record import record_event
from provisioner.models import Event, Machine
from provisioner.schema import MachineStatus as S


@dataclass
class Queued:
    """A job that waits for ``gpus`` GPUs."""

    id: str
    command: str
    gpus: int
    since: datetime


def total(m: Machine) -> int:
    return int(m.gpu_count or 0)


def held(app: App, m: Machine) -> set[int]:
    """The GPUs the machine's running jobs hold (``run``: all of them)."""
    out: set[int] = set()
    for j in jobs.jobs_of(app, m).values():
        if j.running:
            out |= set(range(total(m))) if j.id == jobs.RUN else set(j.gpus or [])
    return out


def queued(app: App, m: Machine) -> list[Queued]:
    """The jobs that wait, first queued first (queued, neither started nor ended since)."""
    with app.db.session() as s:
        events = list(
            s.scalars(
                select(Event)
                .where(
                    Event.machine_id == m.id,
                    Event.kind.in_((jobs.QUEUED, jobs.STARTED, jobs.FINISHED)),
                )
                .order_by(Event.id)
            )
        )
    waiting: dict[str, Queued] = {}
    for e in events:
        d: dict[str, Any] = e.detail or {}
        jid = str(d.get("job"))
        if e.kind == jobs.QUEUED:
            waiting[jid] = Queued(jid, str(d.get("command", "")), int(d.get("gpus") or 0), e.at)
        else:
            waiting.pop(jid, None)
    return list(waiting.values())


def submit(app: App, name: str, command: str, gpus: int = 0) -> tuple[str, bool]:
    """``command`` as the machine's next exec job asking ``gpus`` GPUs: (its id, started now
    — else queued)."""
    m = jobs.running(app, name)
    if gpus > total(m):
        raise UserError(f"{m.name} has {total(m)} GPUs: a job cannot ask for {gpus}")
    with app.db.lock(f"jobs-{m.id}"):
        job_id = jobs.next_exec_id(app, m)
        ahead = gpus > 0 and queued(app, m)  # a job asking none never waits
        given = None if ahead else _free(app, m, gpus)
        if given is None:
            detail = {"job": job_id, "command": command, "gpus": gpus}
            record_event(app, m.id, jobs.QUEUED, detail=detail)
            return job_id, False
        jobs.start_exec(app, m, job_id, command, given)
    return job_id, True


def _free(app: App, m: Machine, gpus: int) -> list[int] | None:
    """``gpus`` GPUs no running job holds, the lowest first; None: not that many are free."""
    free = [g for g in range(total(m)) if g not in held(app, m)]
    return free[:gpus] if len(free) >= gpus else None


def dispatch(app: App, m: Machine) -> list[str]:
    """The queued jobs whose GPUs are free now started, in their order (the first that must
    wait keeps the others waiting: no job is passed over for ever). Their ids."""
    if m.status != S.RUNNING:
        return []
    started = []
    with app.db.lock(f"jobs-{m.id}"):
        for q in queued(app, m):
            given = _free(app, m, q.gpus)
            if given is None:
                break
            jobs.start_exec(app, m, q.id, q.command, given)
            started.append(q.id)
    return started


def drop(app: App, m: Machine, job_ids: list[str] | None) -> list[str]:
    """Queued jobs ``job_ids`` (None: all) ended before they started: ``cancelled``, by
    ``app.actor``. The ids dropped."""
    with app.db.lock(f"jobs-{m.id}"):
        dropped = [q.id for q in queued(app, m) if job_ids is None or q.id in job_ids]
        for jid in dropped:
            detail = {"job": jid, "exit_code": None, "cancelled_by": app.actor, "queued": True}
            record_event(app, m.id, jobs.FINISHED, reason=jobs.CANCELLED, detail=detail)
    return dropped


@dataclass
class Row:
    """One line of ``queue NAME``."""

    job: str
    state: str  # queued | running | exited 0 | setup exited 1 | cancelled | killed…
    gpus: str  # "all", "0,1", "2 (asked)", "-"
    command: str

    def to_json(self) -> dict[str, str]:
        return dict(self.__dict__)


def listing(app: App, name: str) -> list[Row]:
    """Every job of the machine ``name``: started ones in their order, then the queue."""
    m = jobs.named(app, name)
    rows = []
    for j in jobs.jobs_of(app, m).values():
        gpus = "all" if j.id == jobs.RUN and total(m) else ",".join(map(str, j.gpus or [])) or "-"
        rows.append(Row(j.id, "running" if j.running else j.end, gpus, _first(j.command)))
    rows += [Row(q.id, "queued", f"{q.gpus} (asked)", _first(q.command)) for q in queued(app, m)]
    return rows


def _first(command: str) -> str:
    lines = command.strip().splitlines()
    return lines[0] + (" …" if len(lines) > 1 else "") if lines else ""
