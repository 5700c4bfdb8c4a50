"""The experiment's job on its machine: ``workdir`` copied, ``setup`` once, ``run`` detached;
``exec`` jobs beside it; their output and ends read back from the machine.

Jobs are named ``run`` (the experiment's), ``exec-1``, ``exec-2``… Each start is a
``job-started`` event (detail ``{"job", "command"}``), each end a ``job-finished`` event (detail
``{"job", "exit_code"}``; reason ``exited``, or ``killed`` with exit code None when the job ended
without one — its machine was stopped or taken). The sandbox runs jobs as local processes
(its adapter's calls); every other cloud over SSH (:mod:`provisioner.machines.remote`). What
``lifecycle.on_finish`` does at the end is :mod:`provisioner.jobs.finish`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select

from providers.base import JobState, NotFound, ProviderError
from provisioner import permits
from provisioner.app import App
from provisioner.errors import OperationFailed, ProvisionerError, UserError
from provisioner.machines import joblogs, workdirs
from provisioner.machines.record import find_to_act, record_event, ref
from provisioner.models import Event, Machine
from provisioner.schema import EventKind, MachineStatus
from provisioner.spec import Experiment
from provisioner.workdir import BadWorkdir
from provisioner.workdir import files as listed_files

RUN = "run"
STARTED, FINISHED, FAILED = EventKind.JOB_STARTED, EventKind.JOB_FINISHED, EventKind.JOB_FAILED
QUEUED = EventKind.JOB_QUEUED  # waits for the GPUs it asks (:mod:`provisioner.machines.gpuqueue`)
# provisioner-job's exit when a volume of the machine is not mounted and the job was not run
# (templates/provisioner-job.sh, pv_volumes): its end is recorded with that reason
NO_VOLUME_EXIT = 97
NO_VOLUME = "volume-not-mounted"
CANCELLED = "cancelled"  # `cancel`: TERM, then KILL after a grace (detail: cancelled_by)


class JobNotStarted(OperationFailed):
    """The machine runs but its ``run`` could not start (the workdir not copied, the
    supervisor refused): recorded as a ``job-failed`` event."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"{name}: could not start its job: {why}")
        self.name, self.why = name, why


@dataclass
class Job:
    """A job as the events tell it: started, and maybe finished with an exit code."""

    id: str
    command: str
    started_at: datetime
    finished_at: datetime | None = None
    exit_code: int | None = None
    reason: str | None = None  # exited | killed | cancelled | volume-not-mounted
    stage: str = "run"  # setup: it ended in its setup, the run never started
    gpus: list[int] | None = None  # the GPUs it was given (`exec --gpus`); `run`: all

    @property
    def running(self) -> bool:
        return self.finished_at is None

    @property
    def text(self) -> str:
        """``running since …: CMD``, ``exited 0 at …``, ``killed at …`` (with its machine)."""
        at = (self.finished_at or self.started_at).strftime("%Y-%m-%d %H:%M:%S UTC")
        if self.running:
            first = self.command.strip().splitlines()[0] if self.command.strip() else ""
            return f"running since {at}: {first}"
        if self.reason == NO_VOLUME:
            return f"not run at {at}: a volume is not mounted (see its output)"
        return f"{self.end} at {at}"

    @property
    def end(self) -> str:
        """How it ended: ``exited 3``, ``setup exited 1``, ``cancelled``, ``killed with its
        machine``."""
        if self.reason == CANCELLED:
            return "cancelled"
        if self.exit_code is None:
            return "killed with its machine"
        return f"{'setup ' if self.stage == 'setup' else ''}exited {self.exit_code}"

    @property
    def said(self) -> str:
        """``run exited 3``, ``setup exited 1``, ``run cancelled`` (for ``run``, its setup)."""
        return self.end if self.end.startswith("setup") else f"run {self.end}"

    @property
    def code(self) -> int:
        """The exit code ``logs`` exits with once it ended: the job's own, else 143 (128 +
        TERM, as a shell reports a job ended by TERM) when cancelled, 137 (128 + KILL) when
        killed with its machine."""
        if self.exit_code is not None:
            return self.exit_code
        return 143 if self.reason == CANCELLED else 137

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.id,
            "command": self.command,
            "state": "running" if self.running else self.reason,
            "started_at": self.started_at.isoformat(),
            "finished_at": self.finished_at.isoformat() if self.finished_at else None,
            "exit_code": self.exit_code,
            "stage": self.stage,
        }


class _Local:
    """The adapter's own job calls (the sandbox: local processes), as :class:`remote.Remote`."""

    def __init__(self, app: App, m: Machine) -> None:
        self.provider, self.ref = app.provider(m.cloud or ""), ref(m)

    def put_files(self, source: str, paths: list[str]) -> None:
        self.provider.put_files(self.ref, source, paths)

    def start_job(
        self, job_id: str, command: str, *, env: dict[str, str], setup: str | None = None
    ) -> None:
        self.provider.start_job(self.ref, job_id, command, env=env, setup=setup)

    def job_state(self, job_id: str) -> JobState:
        return self.provider.job_state(self.ref, job_id)

    def job_output(self, job_id: str, offset: int = 0) -> bytes:
        return self.provider.job_output(self.ref, job_id, offset)

    def cancel_job(self, job_id: str, grace: float) -> JobState:
        return self.provider.cancel_job(self.ref, job_id, grace)


def runner(app: App, m: Machine) -> _Local | Any:
    """Who runs ``m``'s jobs: its adapter when it can (the sandbox), else SSH."""
    if app.provider(m.cloud or "").runs_jobs:
        return _Local(app, m)
    from provisioner.machines.remote import Remote

    return Remote(app, m)


def workdir_files(app: App, path: str) -> tuple[list[str], str]:
    """The files of the workdir ``path`` to copy, and how they were chosen
    (:func:`provisioner.workdir.files`, within settings' limits); a bad one is a
    :class:`UserError`."""
    try:
        return listed_files(path, *app.settings.workdir.limits)
    except BadWorkdir as e:
        raise UserError(f"workdir: {e}") from None


def start_run(app: App, m: Machine, experiment: Experiment, progress: Any = None) -> Job | None:
    """On a machine just launched, or started again after a preemption: the workdir copied,
    then ``setup`` (once per machine) and ``run`` started as job ``run``. None: nothing to run,
    or a cloud machine that does not answer SSH yet (its start is due: the next ``up``, ``logs``
    or scheduler pass starts it, :func:`ensure_run`)."""
    if not (experiment.run or experiment.setup or experiment.workdir):
        return None
    say = progress or (lambda _: None)
    if not app.provider(m.cloud or "").runs_jobs and not _answers(app, m):
        say(f"{m.name}: its job starts once it answers SSH")
        return None
    try:
        jobs = runner(app, m)
        if experiment.workdir:
            _copy_workdir(app, m, jobs, experiment.workdir, say)
        if not (experiment.run or experiment.setup):
            return None
        command = experiment.run or "true"  # setup alone: the job is the setup
        env = dict(experiment.env)
        if experiment.volumes and not app.provider(m.cloud or "").runs_jobs:
            # provisioner-job waits for these to be mounted, else refuses the job (exit 97)
            env["PV_VOLUMES"] = "\n".join(v.path for v in experiment.volumes)
        jobs.start_job(RUN, command, env=env, setup=experiment.setup)
    except Exception as e:  # anything: one line about this machine, never a traceback
        from provisioner.machines.remote import Unreachable

        if isinstance(e, Unreachable):  # booting still, or gone: tried again later
            say(f"{m.name}: its job starts once it answers SSH ({e})")
            return None
        why = str(e) if isinstance(e, ProviderError | UserError) else f"{type(e).__name__}: {e}"
        record_event(app, m.id, FAILED, detail={"job": RUN, "error": why})
        raise JobNotStarted(m.name, why) from None
    record_event(app, m.id, STARTED, detail={"job": RUN, "command": command})
    return jobs_of(app, m)[RUN]


def _copy_workdir(app: App, m: Machine, jobs: Any, workdir: str, say: Any) -> None:
    """The workdir copied to the machine as ``up`` took it (kept with the state,
    :mod:`provisioner.machines.workdirs`); a machine from before it was kept: the folder."""
    row = workdirs.kept(app, m)
    if row is None:
        files, how = workdir_files(app, workdir)
        jobs.put_files(workdir, files)
        say(f"copied {len(files)} files of {workdir} ({how})")
        return
    with workdirs.restored(row) as (folder, files):
        jobs.put_files(folder, files)
    at = row.taken_at.strftime("%Y-%m-%d %H:%M:%S UTC")
    say(f"copied {len(files)} files of {workdir} (as `up` took them at {at})")


def _answers(app: App, m: Machine) -> bool:
    """A cloud machine that runs with an address whose SSH port accepts a connection."""
    from providers.base import port_open
    from provisioner.machines.remote import ssh_port

    if m.status != MachineStatus.RUNNING or not m.public_ip:
        return False
    return port_open(m.public_ip, ssh_port(app.provider(m.cloud or "")), 3)


DUE = EventKind.RUN_DUE  # the machine was started again in place: its `run` starts anew


def run_due(app: App, m: Machine, *, after_failure: bool = True) -> bool:
    """``run`` not started since the machine's launch or its last start in place. With
    ``after_failure`` False, a start that failed (``job-failed``: not a machine that did not
    answer yet, but rsync or the supervisor refusing) counts as started: the scheduler does
    not retry it every pass; an ``up`` of the experiment does."""
    kinds = (STARTED, DUE, FINISHED) if after_failure else (STARTED, DUE, FAILED, FINISHED)
    with app.db.session() as s:
        events = s.scalars(
            select(Event)
            .where(Event.machine_id == m.id, Event.kind.in_(kinds))
            .order_by(Event.id.desc())
        ).all()
    for e in events:
        if e.kind == DUE:
            return True
        if (e.detail or {}).get("job") != RUN:
            continue
        if e.kind != FINISHED or e.reason != "killed":  # started, or ended by itself
            return False
    return True


def ended_itself(job: Job | None) -> bool:
    """A job that ended on its own (an exit code, or cancelled): never run again after a
    preemption. Killed with its machine: it did not finish."""
    return job is not None and not job.running and job.reason != "killed"


def _settled(app: App, m: Machine, say: Any) -> bool:
    """Before ``run`` starts again on a machine started again after a preemption: a previous
    ``run`` the events say still ran is asked about. Ended by itself meanwhile (its exit code
    on the machine's disk): recorded, and True — it is not run again. Killed: recorded (its
    output kept as its attempt's log), False."""
    prior = jobs_of(app, m).get(RUN)
    if prior is None:
        return _ended_before(app, m, say)
    if not prior.running:
        return False
    try:
        st = state(app, m, RUN)
    except OperationFailed:
        return False
    if st.running:
        return True  # it runs (the machine was never down): nothing to start
    reason = "exited" if st.exit_code is not None else "killed"
    _record_end(app, m, prior, st, reason)
    if st.exit_code is not None:
        say(f"{m.name}: its run had {prior.end} before the machine went down: not run again")
        return True
    return False


def _ended_before(app: App, m: Machine, say: Any) -> bool:
    """A replacement's first start (:mod:`provisioner.jobs.recover`): the ``run`` of the
    machine it replaces, if the events say it still ran, gets its end (killed with its
    machine, its output kept as that attempt's log where it can still be read). One that had
    ended by itself is not run again: its end is recorded on ``m`` too (``ended_on``), so
    ``run`` is no longer due there."""
    lineage = joblogs.lineage(app, m)
    replaced = workdirs.replacing() or (lineage[-2] if len(lineage) > 1 else None)
    with app.db.session() as s:
        old = s.get(Machine, replaced) if replaced else None
    prior = jobs_of(app, old).get(RUN) if old is not None else None
    if old is None or prior is None:
        return False
    if prior.running:
        try:
            st = state(app, old, RUN)
        except OperationFailed:
            st = JobState(False, None)
        if st.running:  # a machine taken back runs nothing
            st = JobState(False, None)
        prior = _record_end(app, old, prior, st, "exited" if st.exit_code is not None else "killed")
    if not ended_itself(prior):
        return False
    detail = {"job": RUN, "exit_code": prior.exit_code, "ended_on": old.id}
    record_event(app, m.id, FINISHED, reason=prior.reason, detail=detail)
    say(f"{m.name}: its run had {prior.end} on the machine it replaces: not run again")
    return True


def ensure_run(app: App, m: Machine, experiment: Experiment, progress: Any = None) -> Job | None:
    """``run`` started unless it was already (once per launch or start in place, whoever asks:
    the launching ``up``, a second ``up`` of the same intent, an ``up`` again after one
    interrupted before it started the job, the scheduler once a cloud machine answers SSH).
    The new job, or None."""
    if not (experiment.run or experiment.setup or experiment.workdir):
        return None
    with app.db.lock(f"jobs-{m.id}"):
        if not run_due(app, m) or _settled(app, m, progress or (lambda _: None)):
            return None
        return start_run(app, m, experiment, progress)


def sync(app: App, name: str) -> tuple[int, str, str]:
    """The experiment's ``workdir`` copied again to its running machine (rsync over SSH on a
    cloud: only what changed travels). (files, how they were chosen, the folder). Its owner's
    doing, or whom a policy lets act as them (:mod:`provisioner.permits`)."""
    m = find_to_act(app, name)
    if m.status != MachineStatus.RUNNING:
        raise UserError(f"{m.name} is {m.status}: `sync` needs it running")
    workdir = Experiment.model_validate(m.spec).workdir
    if not workdir:
        raise UserError(f"{m.name}'s experiment has no workdir: to sync")
    files, how = workdir_files(app, workdir)
    workdirs.take(app, m, workdir, files)  # a relaunch restores the folder as it is now
    try:
        runner(app, m).put_files(workdir, files)
    except ProviderError as e:
        raise OperationFailed(f"{m.name}: could not copy {workdir}: {e}") from None
    return len(files), how, workdir


def exec_job(app: App, name: str, command: str) -> str:
    """Another detached job on a running machine, with the experiment's env; its id. Its
    owner's doing, or whom a policy lets act as them (:mod:`provisioner.permits`). (Asking
    for GPUs, and waiting for them: :mod:`provisioner.machines.gpuqueue`.)"""
    m = running(app, name)
    with app.db.lock(f"jobs-{m.id}"):  # concurrent execs: one id each
        job_id = next_exec_id(app, m)
        start_exec(app, m, job_id, command)
    return job_id


def running(app: App, name: str) -> Machine:
    """The machine ``name``, which a job needs running, and the actor may act on."""
    m = find_to_act(app, name)
    if m.status != MachineStatus.RUNNING:
        raise UserError(f"{m.name} is {m.status}: `exec` needs it running")
    return m


def next_exec_id(app: App, m: Machine) -> str:
    """``exec-N``: one more than the machine's exec jobs started or queued (under its lock)."""
    with app.db.session() as s:
        ids = {
            str((d or {}).get("job"))
            for d in s.scalars(
                select(Event.detail).where(
                    Event.machine_id == m.id, Event.kind.in_((STARTED, QUEUED))
                )
            )
        }
    return f"exec-{sum(j.startswith('exec-') for j in ids) + 1}"


def start_exec(
    app: App, m: Machine, job_id: str, command: str, gpus: list[int] | None = None
) -> None:
    """``job_id`` started now with the experiment's env (and ``CUDA_VISIBLE_DEVICES``, the
    ``gpus`` it was given); its ``job-started`` event (``gpus`` in its detail when given)."""
    env = dict(Experiment.model_validate(m.spec).env)
    detail: dict[str, Any] = {"job": job_id, "command": command}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        detail["gpus"] = gpus
    try:
        runner(app, m).start_job(job_id, command, env=env)
    except ProviderError as e:
        raise OperationFailed(f"{m.name}: could not start {job_id}: {e}") from None
    record_event(app, m.id, STARTED, detail=detail)


def jobs_of(app: App, m: Machine) -> dict[str, Job]:
    """The machine's jobs by id, as its events tell (a job started again: its latest run)."""
    with app.db.session() as s:
        events = list(
            s.scalars(
                select(Event)
                .where(Event.machine_id == m.id, Event.kind.in_((STARTED, FINISHED)))
                .order_by(Event.id)
            )
        )
    jobs: dict[str, Job] = {}
    for e in events:
        d = e.detail or {}
        jid = str(d.get("job"))
        if e.kind == STARTED:
            jobs[jid] = Job(jid, str(d.get("command", "")), e.at, gpus=d.get("gpus"))
        elif jid in jobs and jobs[jid].running:
            j = jobs[jid]
            j.finished_at, j.exit_code, j.reason = e.at, d.get("exit_code"), e.reason
            j.stage = str(d.get("stage") or "run")
    return jobs


def state(app: App, m: Machine, job_id: str) -> JobState:
    """The job's state, from the machine. A cloud machine that is down killed its jobs; one
    that does not answer raises OperationFailed ("could not ask"), never "ended"."""
    if (
        m.status not in (MachineStatus.RUNNING, MachineStatus.PENDING)
        and not app.provider(m.cloud or "").runs_jobs
    ):
        return JobState(False, None)
    try:
        return runner(app, m).job_state(job_id)
    except NotFound:
        return JobState(False, None)
    except ProviderError as e:
        raise OperationFailed(f"{m.name}: could not ask about job {job_id}: {e}") from None


def check_ended(app: App, m: Machine) -> list[Job]:
    """Ask the machine about its jobs the events say run; each found ended gets its
    ``job-finished`` event. Returns those. Under the machine's jobs lock: when the scheduler
    and a ``logs -f`` look at once, one of them records (and acts on) the end."""
    with app.db.lock(f"jobs-{m.id}"):
        return _check_ended(app, m)


def _check_ended(app: App, m: Machine) -> list[Job]:
    ended = []
    for job in jobs_of(app, m).values():
        if not job.running:
            continue
        st = state(app, m, job.id)
        if st.running:
            continue
        reason = "exited" if st.exit_code is not None else "killed"
        if st.exit_code == NO_VOLUME_EXIT and not app.provider(m.cloud or "").runs_jobs:
            reason = NO_VOLUME  # provisioner-job did not run it; its output says why
        ended.append(_record_end(app, m, job, st, reason))
    return ended


def _record_end(app: App, m: Machine, job: Job, st: JobState, reason: str, **more: Any) -> Job:
    """The job's end: its ``job-finished`` event (``stage`` in its detail when its setup
    failed), and its output kept with the state (:mod:`provisioner.machines.joblogs`)."""
    detail: dict[str, Any] = {"job": job.id, "exit_code": st.exit_code, **more}
    if st.stage == "setup" and st.exit_code is not None:
        detail["stage"] = "setup"
    record_event(app, m.id, FINISHED, reason=reason, detail=detail)
    job.finished_at, job.exit_code, job.reason = app.clock.now(), st.exit_code, reason
    job.stage = str(detail.get("stage") or "run")
    keep_log(app, m, job)
    return job


def keep_log(app: App, m: Machine, job: Job) -> None:
    """The ended ``job``'s output kept with the state, whatever could be read of it."""
    try:
        data: bytes | None = output(app, m, job.id)
    except ProvisionerError:
        data = None  # a cloud machine down: what it kept is out of reach
    joblogs.keep(
        app, m, job.id, data, reason=job.reason or "", exit_code=job.exit_code, stage=job.stage
    )


def keep_before_down(app: App, m: Machine) -> None:
    """Before ``m`` is stopped or terminated: the output of each job still running kept as its
    attempt's log (``killed``; replaced if its end is seen after all) — on a cloud the
    machine's own copy is out of reach once it is down. Never in the way of the stop."""
    if m.status not in (MachineStatus.RUNNING, MachineStatus.PENDING):
        return
    for job in jobs_of(app, m).values():
        if not job.running:
            continue
        try:
            data = output(app, m, job.id)
        except Exception:  # unreachable, gone: the stop goes on
            continue
        joblogs.keep(app, m, job.id, data, reason="killed", exit_code=None)


def cancel(app: App, m: Machine, job_ids: list[str] | None, grace: float) -> list[Job]:
    """The jobs ``job_ids`` of ``m`` (None: all that run) ended: TERM, KILL after ``grace``
    seconds; each recorded ``cancelled`` (by ``app.actor``) with its output kept. A job that
    had ended already is recorded as it ended and not in the list. Under the jobs lock."""
    with app.db.lock(f"jobs-{m.id}"):
        _check_ended(app, m)
        known = jobs_of(app, m)
        if job_ids is not None:
            missing = [j for j in job_ids if j not in known]
            if missing:
                have = ", ".join(known) or "none"
                raise UserError(f"{m.name} has no job {missing[0]!r} (its jobs: {have})")
        targets = [known[j] for j in (job_ids or list(known)) if known[j].running]
        done = []
        for job in targets:
            try:
                st = runner(app, m).cancel_job(job.id, grace)
            except NotFound:
                st = JobState(False, None)
            except ProviderError as e:
                raise OperationFailed(f"{m.name}: could not cancel {job.id}: {e}") from None
            done.append(_record_end(app, m, job, st, CANCELLED, cancelled_by=app.actor))
        return done


def output(app: App, m: Machine, job_id: str, offset: int = 0) -> bytes:
    """The job's output from ``offset``, kept on the machine (a cloud machine must be up)."""
    if (
        m.status not in (MachineStatus.RUNNING, MachineStatus.PENDING)
        and not app.provider(m.cloud or "").runs_jobs
    ):
        raise UserError(
            f"{m.name} is {m.status}: its jobs' output is kept on the machine "
            + (
                f"(`provisioner start {m.name}` to read it)"
                if m.status == MachineStatus.STOPPED
                else ""
            )
        )
    try:
        return runner(app, m).job_output(job_id, offset)
    except NotFound:
        raise UserError(f"{m.name} has no job {job_id!r}") from None
    except ProviderError as e:
        raise OperationFailed(f"{m.name}: could not read the output of {job_id}: {e}") from None


def named(app: App, name: str) -> Machine:
    """The machine of that name whose jobs are asked about: the live one, else the newest (a
    machine its ``on_finish`` terminated keeps its output). Its jobs' output is its owner's to
    read, and whom a policy lets act as them (:mod:`provisioner.permits`): it may hold what
    they print, and reading it records their jobs' ends and runs their on_finish."""
    from provisioner.state import named_machine

    with app.db.session() as s:
        m = named_machine(s, name)
    if m is None:
        raise UserError(f"no machine named {name!r} (see `provisioner status --all`)")
    permits.check(app, m, m.name)
    return m
