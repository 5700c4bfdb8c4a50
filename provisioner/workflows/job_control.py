"""``cancel`` and ``logs`` below the CLI: a job ended on request (and ``on_finish`` acting as
for any end of ``run``), and a job's output read from its machine, or from the state where it
was kept when it ended (:mod:`provisioner.machines.joblogs`) — the machine stopped or gone, or
an earlier attempt asked for."""

from __future__ import annotations

from dataclasses import dataclass, field

from provisioner.app import App
from provisioner.errors import ProvisionerError, UserError
from provisioner.jobs import finish
from provisioner.jobs.passes import Action
from provisioner.machines import gpuqueue, joblogs, jobs
from provisioner.models import JobLog, Machine
from provisioner.schema import MachineStatus as S


@dataclass
class Cancelled:
    """What ``cancel`` did: the jobs it ended, and what ``on_finish`` then did."""

    name: str
    jobs: list[jobs.Job]
    actions: list[Action] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # queued jobs ended before they started


def cancel(app: App, name: str, job_ids: list[str] | None, grace: float | None = None) -> Cancelled:
    """End ``job_ids`` (None: every job that runs) on the machine ``name``: TERM to each job's
    process group, KILL after ``grace`` seconds (settings' ``jobs.cancel_grace_seconds``);
    each recorded ``cancelled``, its output kept; the ``run`` cancelled gets its
    ``on_finish`` (stop, terminate, keep) as any end of it. Its owner's doing, or whom a
    policy lets act as them (:mod:`provisioner.permits`)."""
    m = jobs.named(app, name)
    if m.status not in (S.RUNNING, S.PENDING):
        raise UserError(f"{m.name} is {m.status}: its jobs ended with it (`provisioner queue`)")
    wait = app.settings.jobs.cancel_grace_seconds if grace is None else grace
    dropped = gpuqueue.drop(app, m, job_ids)  # first: no end below starts them meanwhile
    rest = None if job_ids is None else [j for j in job_ids if j not in dropped]
    done = jobs.cancel(app, m, rest, wait) if rest is None or rest else []
    return Cancelled(m.name, done, finish.on_ended(app, m, done) if done else [], dropped)


@dataclass
class LogRead:
    """A job's output as ``logs`` shows it: from the machine (``row`` None) or as kept."""

    data: bytes
    job: jobs.Job | None  # the attempt read, as the events (or its kept row) tell it
    row: JobLog | None = None  # the kept attempt read
    note: str | None = None  # what to know about it (cut to the last MiB, not kept…)
    seen: list[jobs.Job] = field(default_factory=list)  # ends seen on the way: on_finish's

    @property
    def ended(self) -> bool:
        return self.job is not None and not self.job.running

    @property
    def end(self) -> str:
        """``exited 3``, ``setup exited 1``, ``cancelled``… (with the attempt when kept)."""
        if self.job is None:
            return ""
        return self.job.end + (f" ({joblogs.ended_text(self.row)})" if self.row else "")

    @property
    def code(self) -> int:
        """``logs``' exit code: the job's (:attr:`jobs.Job.code`) once it ended, else 0."""
        return self.job.code if self.job is not None and self.ended else 0


def _kept(row: JobLog, seen: list[jobs.Job]) -> LogRead:
    job = jobs.Job(row.job, "", row.ended_at, row.ended_at, row.exit_code, row.reason, row.stage)
    return LogRead(row.text, job, row, joblogs.note(row), seen)


def read(app: App, name: str, job_id: str, attempt: int | None = None) -> LogRead:
    """The output of ``job_id`` on the machine ``name`` (its latest attempt, or ``attempt``).
    Ends the machine's jobs reached meanwhile are recorded first (:func:`jobs.check_ended`);
    the caller hands :attr:`LogRead.seen` to :func:`finish.on_ended` once it showed it."""
    m = jobs.named(app, name)
    try:
        seen = jobs.check_ended(app, m)
    except ProvisionerError:
        seen = []  # could not ask: the output read below says why
    known = jobs.jobs_of(app, m)
    rows = joblogs.kept(app, m, job_id)
    job = known.get(job_id)
    if job is None and not rows:
        _no_such_job(app, m, job_id, known)
    current = joblogs.attempt_of(app, m, job_id) if job is not None else None
    if attempt is not None and attempt != current:
        return _kept(_attempt(m, job_id, rows, attempt, current), seen)
    mine = [r for r in rows if r.machine_id == m.id and r.attempt == current]
    if job is None or (not job.running and mine and m.status not in (S.RUNNING, S.PENDING)):
        return _kept((mine or rows)[-1], seen)
    try:
        return LogRead(jobs.output(app, m, job_id), job, seen=seen)
    except ProvisionerError:
        if not mine:
            raise
        return _kept(mine[-1], seen)


def _attempt(
    m: Machine, job_id: str, rows: list[JobLog], attempt: int, current: int | None
) -> JobLog:
    """The kept row of an earlier ``attempt`` of ``job_id``, or why there is none."""
    row = next((r for r in rows if r.attempt == attempt), None)
    if row is None:
        have = ", ".join(str(r.attempt) for r in rows) or "none"
        raise UserError(
            f"{m.name}'s job {job_id} has no attempt {attempt} kept (kept: {have}"
            + (f"; the current one is {current})" if current else ")")
        )
    return row


def _no_such_job(app: App, m: Machine, job_id: str, known: dict[str, jobs.Job]) -> None:
    due = (m.spec or {}).get("run") and jobs.run_due(app, m, after_failure=False)
    if job_id == jobs.RUN and m.status in (S.PENDING, S.RUNNING) and due:
        raise UserError(
            f"{m.name}'s run has not started: it starts once the machine answers SSH "
            "(the scheduler's reconcile pass starts it)"
        )
    waiting = next((q for q in gpuqueue.queued(app, m) if q.id == job_id), None)
    if waiting is not None:
        raise UserError(
            f"{m.name}'s job {job_id} is queued: it starts when {waiting.gpus} GPUs are free "
            f"(`provisioner queue {m.name}`)"
        )
    have = ", ".join(known) or "none"
    raise UserError(f"{m.name} has no job {job_id!r} (its jobs: {have})")
