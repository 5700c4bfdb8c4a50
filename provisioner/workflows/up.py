"""``up`` end to end: a name that exists is resumed or refused → launch (or wait for capacity)
→ wait until the machine runs and answers SSH → start its job when due → follow its run until
it ends. One function, :func:`up`: a typed :class:`UpRequest` in, each step reported as an
:data:`Event`, an :data:`Outcome` back; Ctrl-C becomes :class:`Interrupted`, saying what was
left and how to resume or undo it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from provisioner import keys, machines, permits
from provisioner.app import App
from provisioner.errors import OperationFailed
from provisioner.fleet import at_text
from provisioner.jobs import finish
from provisioner.machines import jobs, volumes, waiting
from provisioner.machines.attempts import LaunchAttempt
from provisioner.models import Machine
from provisioner.planner import VolumePin
from provisioner.schema import MachineStatus
from provisioner.spec import Experiment
from provisioner.state import live_machine
from provisioner.views.plan import machine_guard

S = MachineStatus
POLL_SECONDS = 0.5  # how often a followed job's output is read


@dataclass(frozen=True)
class UpRequest:
    experiment: Experiment
    spec_path: str
    wait: bool = True  # until it runs and answers SSH, then start its job when due
    wait_timeout: float = 600  # seconds
    follow: bool = True  # the run's output as it comes, until it ends
    retry_until_up: bool = False  # no capacity anywhere: stay queued and retry
    timeout: timedelta | None = None  # how long (default: the file's on_no_capacity, else 6 h)


# --- what happens as it goes ------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """A step begins: launching, or waiting until the machine is ready."""

    step: Literal["launching", "waiting"]
    name: str


@dataclass(frozen=True)
class Note:
    """A line for people from the step under way: an attempt, a round of the wait, a job."""

    text: str


@dataclass(frozen=True)
class Warned:
    """Something beside the launch went wrong; the launch itself did not."""

    text: str


@dataclass(frozen=True)
class Launched:
    """The machine is up (and ready, when waited for): what to show before a followed run."""

    launch: Launch


@dataclass(frozen=True)
class RunResumed:
    """An earlier ``up`` launched the machine and never started its run: started now."""

    name: str


@dataclass(frozen=True)
class Following:
    """The run's output follows, then what ``on_finish`` did."""

    name: str
    on_finish: str


@dataclass(frozen=True)
class RunOutput:
    chunk: bytes


Event = Stage | Note | Warned | Launched | RunResumed | Following | RunOutput
Progress = Callable[[Event], None]


# --- how it ended -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Already:
    """The name exists: nothing launched. ``differences`` from the recorded spec (``field: old
    → new``): none is no error; some are (the new spec was not launched)."""

    machine: Machine
    differences: list[str]


@dataclass(frozen=True)
class VolumeUse:
    listed: volumes.Listed
    path: str  # where the machine mounts it


@dataclass(frozen=True)
class Launch:
    """A machine launched (or adopted) by this ``up``, and what to say about it."""

    machine: Machine
    attempts: list[LaunchAttempt]
    volumes: list[VolumeUse] | None  # None: its experiment names no volume
    pins: list[VolumePin]  # the volumes that chose its zone
    guard: list[str]  # who enforces each of its rules
    run: bool  # its experiment has a ``run``
    run_started: bool
    can_stop: bool


@dataclass(frozen=True)
class RunEnded:
    """The followed run ended: its job (None: gone) and its machine's status after on_finish."""

    name: str
    job: jobs.Job | None
    status: str

    @property
    def failed(self) -> bool:
        return self.job is None or self.job.exit_code != 0


Outcome = Already | Launch | RunEnded


class Interrupted(Exception):
    """Ctrl-C: ``message`` says what was left and the commands that resume or undo it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# --- the workflow -----------------------------------------------------------------------------


def up(app: App, request: UpRequest, progress: Progress = lambda _: None) -> Outcome:
    """Launch the cheapest allowed offer for ``request.experiment`` and make it ready to use
    (see the module's docstring). Refusals raise as :func:`provisioner.machines.up` does."""
    experiment = request.experiment
    capacity = capacity_wait(experiment, request.retry_until_up, request.timeout)
    app.policies  # noqa: B018  (a bad policy file is reported before the state is opened)
    try:
        if (settled := _exists(app, request, capacity, progress)) is not None:
            return settled
        result, m = _launch(app, request, capacity, progress)
    except KeyboardInterrupt:
        raise Interrupted(interrupted(app, experiment.name, request.spec_path)) from None
    except jobs.JobNotStarted as e:  # launched, but its job cannot start: on_finish acts
        raise OperationFailed(finish.not_started(app, e)) from None
    if result.already:  # another `up` of this name won the race
        return _already(m, experiment)
    _refresh_ssh_config(app, progress)
    launch = _report(app, m, result, experiment)
    progress(Launched(launch))
    if request.follow and launch.run and launch.run_started:
        return _follow_run(app, m.name, experiment, progress)
    return launch


def _exists(
    app: App, request: UpRequest, capacity: timedelta | None, progress: Progress
) -> Already | RunEnded | None:
    """A live machine of the name that this ``up`` does not resume (None: there is none, or
    it is resumed): its run started and followed when it never started, else :class:`Already`.
    An intent ``requested`` is resumed, one ``waiting`` too when a wait is asked. Someone
    else's machine of the name is theirs: resumed, followed or reported only to whom may act on
    it (:mod:`provisioner.permits`)."""
    m = _existing(app, request.experiment.name)
    if m is None:
        return None
    permits.check(app, m, m.name)
    resume = (S.REQUESTED, S.WAITING) if capacity is not None else (S.REQUESTED,)
    if m.status in resume:
        return None
    if request.follow and (ended := _resume_run(app, m, progress)) is not None:
        return ended
    return _already(m, request.experiment)


def capacity_wait(
    experiment: Experiment, retry: bool, timeout: timedelta | None
) -> timedelta | None:
    """How long ``up`` waits for capacity, or None: fail at once. Asked (``retry``): for
    ``timeout``, else the file's ``lifecycle.on_no_capacity.wait``, else 6 h; not asked: the
    file's wait, if it has one."""
    asked = experiment.lifecycle.on_no_capacity
    if not retry:
        return asked.wait if asked is not None else None
    return timeout or (asked.wait if asked is not None else waiting.DEFAULT_WAIT)


def _launch(
    app: App, request: UpRequest, capacity: timedelta | None, progress: Progress
) -> tuple[machines.UpResult, Machine]:
    experiment = request.experiment

    def say(text: str) -> None:
        progress(Note(text))

    progress(Stage("launching", experiment.name))
    if capacity is None:
        result = machines.up(app, experiment, spec_path=request.spec_path, progress=say)
    else:
        result = waiting.up_until_up(
            app, experiment, wait=capacity, spec_path=request.spec_path, progress=say
        )
    m = result.machine
    _refresh_ssh_config(app, progress)  # before waiting: a wait that times out leaves it
    if result.already or not request.wait or m.status not in (S.PENDING, S.RUNNING):
        return result, m
    progress(Stage("waiting", m.name))
    m = machines.wait_ready(app, m.name, timeout=request.wait_timeout, progress=say)
    _start_due_run(app, m, experiment, say, request.wait_timeout)
    return result, m


def _refresh_ssh_config(app: App, progress: Progress) -> None:
    """Keep an installed ssh-config current after a machine came, went or moved."""
    if (why := keys.refreshed(app)) is not None:
        progress(Warned(why))


def _start_due_run(
    app: App, m: Machine, experiment: Experiment, say: Callable[[str], None], timeout: float
) -> None:
    """A cloud machine's job starts once it answers SSH: now, after the wait; tried again
    (bounded by ``timeout``) while its SSH port is open but the login is not ready yet
    (cloud-init still installing the key)."""
    if m.status != S.RUNNING or not (experiment.run or experiment.setup):
        return
    deadline = time.monotonic() + timeout
    while jobs.run_due(app, m):
        jobs.ensure_run(app, m, experiment, progress=say)
        if not jobs.run_due(app, m) or time.monotonic() + 5 > deadline:
            return
        time.sleep(5)


def _report(app: App, m: Machine, result: machines.UpResult, experiment: Experiment) -> Launch:
    used, pins = _volumes(app, m, result)
    return Launch(
        machine=m,
        attempts=result.attempts,
        volumes=used,
        pins=pins,
        guard=machine_guard(app, m),
        run=bool(experiment.run),
        run_started=bool(experiment.run) and jobs.RUN in jobs.jobs_of(app, m),
        can_stop=machines.can_stop(m),
    )


def _volumes(
    app: App, m: Machine, result: machines.UpResult
) -> tuple[list[VolumeUse] | None, list[VolumePin]]:
    """The machine's volumes where it mounts them (None: its experiment names none), and the
    pins that chose its zone."""
    named = {v["name"]: v["path"] for v in (m.spec or {}).get("volumes") or []}
    if not named:
        return None, []
    listed = volumes.listing(app, m.project)
    checks = result.plan.checks if result.plan else []
    return (
        [VolumeUse(v, named[v.volume.name]) for v in listed if v.volume.name in named],
        [c for c in checks if isinstance(c, VolumePin)],
    )


# --- a run followed ---------------------------------------------------------------------------


def _resume_run(app: App, m: Machine, progress: Progress) -> RunEnded | None:
    """A running machine whose stored experiment has a ``run`` that never started (an earlier
    `up` was interrupted between the launch and the job): started now and followed."""
    stored = Experiment.model_validate(m.spec)
    if m.status != S.RUNNING or not stored.run or not jobs.ensure_run(app, m, stored):
        return None
    progress(RunResumed(m.name))
    return _follow_run(app, m.name, stored, progress)


def _follow_run(app: App, name: str, experiment: Experiment, progress: Progress) -> RunEnded:
    """The run's output as it comes, then what on_finish did. Ctrl-C leaves the job running."""
    progress(Following(name, experiment.on_finish))
    try:
        job = follow(app, name, jobs.RUN, write=lambda chunk: progress(RunOutput(chunk)))
    except KeyboardInterrupt:
        raise Interrupted(
            f"{name}: the job keeps running; `provisioner logs {name} -f` follows it again"
        ) from None
    return RunEnded(name, job, jobs.named(app, name).status)


def follow(
    app: App,
    name: str,
    job_id: str,
    *,
    write: Callable[[bytes], None],
    offset: int = 0,
    sleep: Callable[[float], None] = time.sleep,
) -> jobs.Job | None:
    """Write the job's output from ``offset`` as it comes, until the job ends (its end is
    recorded and, for ``run``, its ``on_finish`` done on the way). Returns the ended Job."""
    m = jobs.named(app, name)
    while True:
        # the end seen first, then the last output read, then on_finish (a cloud machine
        # stopped by it keeps its output out of reach)
        ended = jobs.check_ended(app, m)
        job = jobs.jobs_of(app, m).get(job_id)
        if m.status in (S.RUNNING, S.PENDING) or app.provider(m.cloud or "").runs_jobs:
            chunk = jobs.output(app, m, job_id, offset)
            if chunk:
                write(chunk)
                offset += len(chunk)
        finish.on_ended(app, m, ended)
        if job is None or not job.running:
            return job
        sleep(POLL_SECONDS)
        m = jobs.named(app, name)


# --- a name that exists; an `up` interrupted ---------------------------------------------------


def _existing(app: App, name: str) -> Machine | None:
    with app.db.session() as s:
        return live_machine(s, name)


def _already(m: Machine, experiment: Experiment) -> Already:
    return Already(m, spec_differences(m.spec or {}, experiment.to_json()))


def spec_differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """``field: old → new`` for each leaf that differs between two stored specs."""
    if isinstance(old, dict) and isinstance(new, dict):
        diffs: list[str] = []
        for k in sorted(set(old) | set(new), key=str):
            diffs += spec_differences(old.get(k), new.get(k), f"{prefix}{k}.")
        return diffs
    if old == new:
        return []
    return [f"{prefix.rstrip('.')}: {_short(old)} → {_short(new)}"]


def _short(v: Any) -> str:
    text = "—" if v is None or v == {} or v == [] else str(v)
    return text if len(text) <= 40 else text[:39] + "…"


def interrupted(app: App, name: str, path: str) -> str:
    """After Ctrl-C: the state ``up`` left, and the commands that resume or undo it."""
    try:
        m = _existing(app, name)
    except Exception:  # the state itself was mid-write: say what we can
        m = None
    if m is None:
        return f"interrupted: nothing of {name} was written; run `provisioner up {path}`"
    queued = _queued(app, m)
    if queued is not None:
        return queued
    if m.status == S.REQUESTED:
        return (
            f"interrupted: {name} is requested (recorded, launch not finished; a machine may "
            f"be starting). Resume with `provisioner up {path}`, or undo with "
            f"`provisioner down {name}`"
        )
    return (
        f"interrupted: {name} is {m.status} on {m.cloud} {m.zone or m.region} "
        f"({m.instance_id}) and bills. See `provisioner status {name}`, connect with "
        f"`provisioner ssh {name}` once it answers, or remove it with `provisioner down {name}`"
    )


def _queued(app: App, m: Machine) -> str | None:
    """The Ctrl-C message of an intent waiting for capacity (None: it is not): it stays
    queued, the scheduler keeps trying, and how to cancel it."""
    try:
        m, w = waiting.state(app, m.id)
    except Exception:  # the state itself was mid-write: the plain message
        return None
    if w is None or m.status not in (S.WAITING, S.REQUESTED):
        return None
    until = at_text(w.until, app.clock.now())
    midway = (
        " (a try was under way: the next one adopts whatever it launched)"
        if m.status == S.REQUESTED
        else ""
    )
    return (
        f"interrupted: {m.name} stays queued (waiting for capacity until {until}){midway}; the "
        f"scheduler keeps trying (`provisioner scheduler run`, or `provisioner sweep` from "
        f"cron); cancel with `provisioner down {m.name}`"
    )
