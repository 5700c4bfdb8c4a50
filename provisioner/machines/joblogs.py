"""A job's output kept with the state when it ends (table ``job_logs``, 0016), so ``logs`` reads
it with the machine stopped or gone — the state may be a team's PostgreSQL, so not files.

Kept: the output's last :data:`KEEP_BYTES` (1 MiB; a longer output is marked ``truncated``,
with its whole size), its exit code, the stage it ended in (``setup`` when the setup failed),
how it ended (``exited``, ``killed``, ``cancelled``…). One row per attempt: a job of the same
id started again — a ``run`` after its machine was preempted, in place or on a replacement —
is the next attempt (``logs --attempt N``). A machine's lineage is itself and the machines it
replaced (``recovered`` events, :mod:`provisioner.jobs.recover`), so a relaunched machine's
``logs`` still reads its predecessor's attempts.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select

from provisioner.app import App
from provisioner.models import Event, JobLog, Machine
from provisioner.schema import EventKind

KEEP_BYTES = 1 << 20  # the last MiB of a job's output is kept with the state


def lineage(app: App, m: Machine) -> list[str]:
    """``m``'s id and those of the machines it replaced, oldest first."""
    ids = [m.id]
    with app.db.session() as s:
        while len(ids) < 100:  # a chain of relaunches; bounded against a cycle
            ev = s.scalars(
                select(Event)
                .where(Event.machine_id == ids[0], Event.kind == EventKind.RECOVERED)
                .order_by(Event.id.desc())
                .limit(1)
            ).first()
            replaced = (ev.detail or {}).get("replaces") if ev else None
            if not replaced or replaced in ids:
                break
            ids.insert(0, str(replaced))
    return ids


def attempt_of(app: App, m: Machine, job_id: str) -> int:
    """The attempt of ``m``'s latest start of ``job_id``: its ``job-started`` events counted over
    the lineage (1 for a first start)."""
    with app.db.session() as s:
        n = s.scalar(
            select(func.count(Event.id)).where(
                Event.machine_id.in_(lineage(app, m)),
                Event.kind == EventKind.JOB_STARTED,
                Event.detail["job"].as_string() == job_id,
            )
        )
    return max(1, int(n or 0))


def keep(
    app: App,
    m: Machine,
    job_id: str,
    data: bytes | None,
    *,
    reason: str,
    exit_code: int | None,
    stage: str = "run",
) -> int:
    """The ended job's output (None: it could not be read) kept as its latest attempt's row;
    an attempt kept already is replaced (its end seen after a stop kept what it had written:
    unread now, that output stays)."""
    attempt = attempt_of(app, m, job_id)
    before = [r for r in kept(app, m, job_id) if r.attempt == attempt] if data is None else []
    text = before[-1].text if before else (data or b"")[-KEEP_BYTES:]
    size = before[-1].size if before else len(data or b"")
    row = JobLog(
        machine_id=m.id,
        job=job_id,
        attempt=attempt,
        stage=stage,
        exit_code=exit_code,
        reason=reason,
        ended_at=app.clock.now(),
        size=size,
        text=text,
        truncated=size > len(text),
    )
    with app.db.session() as s:
        for old in s.scalars(
            select(JobLog).where(
                JobLog.machine_id.in_(lineage(app, m)),
                JobLog.job == job_id,
                JobLog.attempt == attempt,
            )
        ):
            s.delete(old)
        s.add(row)
    return attempt


def kept(app: App, m: Machine, job_id: str) -> list[JobLog]:
    """Every kept attempt of ``job_id`` over ``m``'s lineage, the first attempt first."""
    with app.db.session() as s:
        rows = list(
            s.scalars(
                select(JobLog)
                .where(JobLog.machine_id.in_(lineage(app, m)), JobLog.job == job_id)
                .order_by(JobLog.attempt, JobLog.id)
            )
        )
        for r in rows:
            s.expunge(r)
    return rows


def note(row: JobLog) -> str | None:
    """What a reader of a kept output should know: it was cut, or could not be read."""
    if row.truncated:
        return (
            f"the last {len(row.text)} of its {row.size} bytes, as kept with the state "
            f"(at most {KEEP_BYTES} bytes are kept)"
        )
    if row.size == 0 and row.reason == "killed":
        return "no output was kept: the machine was gone before it could be read"
    return None


def ended_text(row: JobLog) -> str:
    at: datetime = row.ended_at
    return f"attempt {row.attempt}, ended {at.strftime('%Y-%m-%d %H:%M:%S UTC')}"
