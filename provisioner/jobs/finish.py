"""Billing ends with the job: when a machine's ``run`` exits, or could not start (its workdir
not copied, its supervisor refusing), ``lifecycle.on_finish`` acts at once, at any hour —
``stop`` (the default with a ``run``), ``terminate``, or ``keep``. Its
``job-finished`` event carries the exit code; the stop or terminate has reason ``on-finish``
and the exit code in its detail. A job killed with its machine (no exit code) is recorded but
not acted on: the machine is already down, or was started again by hand.

Looked at by the reconcile pass, and by ``status``/``logs`` when they look at a machine."""

from __future__ import annotations

from sqlalchemy import select

from provisioner import machines
from provisioner.app import App
from provisioner.errors import ProvisionerError
from provisioner.jobs import ended
from provisioner.jobs.passes import Action
from provisioner.machines import gpuqueue, jobs
from provisioner.models import Event, Machine
from provisioner.schema import MachineStatus as S
from provisioner.spec import Experiment

REASON = "on-finish"


def watched(app: App, names: list[str] | None = None) -> list[Machine]:
    """Running machines that started a job (:func:`jobs.check_ended` asks only about those
    the events say still run)."""
    with app.db.session() as s:
        q = select(Machine).where(
            Machine.status.in_((S.RUNNING, S.PENDING)),
            Machine.id.in_(select(Event.machine_id).where(Event.kind == jobs.STARTED)),
        )
        if names is not None:
            q = q.where(Machine.name.in_(names))
        return list(s.scalars(q))


def due(app: App, names: list[str] | None = None) -> list[Machine]:
    """Running machines whose experiment's ``run`` is due: a cloud machine launched (or
    started again in place) before it answered SSH."""
    with app.db.session() as s:
        q = select(Machine).where(Machine.status == S.RUNNING)
        if names is not None:
            q = q.where(Machine.name.in_(names))
        running = list(s.scalars(q))
    out = []
    for m in running:
        spec = m.spec or {}
        if (spec.get("run") or spec.get("setup")) and jobs.run_due(app, m, after_failure=False):
            out.append(m)
    return out


def check(app: App, names: list[str] | None = None) -> list[Action]:
    """Jobs found ended are recorded (at the application clock's now: when they were seen to
    have ended); a ``run`` that exited gets its ``on_finish``. A due ``run`` is started."""
    out: list[Action] = []
    for m in due(app, names):
        try:
            if jobs.ensure_run(app, m, Experiment.model_validate(m.spec)):
                out.append(Action(m.name, "start-job", "run-due", "run started", True))
        except jobs.JobNotStarted as e:  # one line about this machine; on_finish acts
            out.append(Action(m.name, "record", jobs.FAILED, f"could not start its job: {e.why}"))
            out.append(act(app, m, None, started=False))
        except Exception as e:  # one broken machine never breaks the others' pass or status
            out.append(Action(m.name, "skip", "error", f"could not start its job: {_why(e)}"))
    for m in watched(app, names):
        try:
            ended = jobs.check_ended(app, m)
        except Exception as e:  # as above
            out.append(Action(m.name, "skip", "error", f"could not ask about its jobs: {_why(e)}"))
            continue
        out += on_ended(app, m, ended)
    return out


def not_started(app: App, e: jobs.JobNotStarted) -> str:
    """`up`'s one line for a machine launched whose run could not start, once ``on_finish``
    acted on it (:func:`act`): it never stays billing unseen."""
    a = act(app, machines.find(app, e.name), None, started=False)
    done = {"stop": "stopped", "terminate": "terminated"}.get(a.action) if a.done else None
    if done:
        return f"{e}; {e.name} {done} (on_finish), compute billing ended"
    if a.error:
        return f"{e}; could not end it: {a.error}"
    return f"{e}; {e.name} keeps running (on_finish: keep): `provisioner down {e.name}` ends it"


def _why(e: Exception) -> str:
    return str(e) if isinstance(e, ProvisionerError) else f"{type(e).__name__}: {e}"


def on_ended(app: App, m: Machine, ended: list[jobs.Job]) -> list[Action]:
    """What :func:`check` does with the jobs :func:`jobs.check_ended` found ended: a ``run``
    that exited gets its ``on_finish``; the others are recorded only."""
    out: list[Action] = []
    for job in ended:
        cancelled = job.reason == jobs.CANCELLED
        if job.id != jobs.RUN or (job.exit_code is None and not cancelled):
            why = f"job {job.id} " + (
                f"exited {job.exit_code}" if job.exit_code is not None else "was killed"
            )
            if cancelled:
                why = f"job {job.id} cancelled"
            out.append(Action(m.name, "record", "job-finished", why, True))
            continue
        out.append(act(app, m, job.exit_code, said=job.said))
    if ended:  # GPUs freed: the jobs queued for them start, on a machine still running
        with app.db.session() as s:
            fresh = s.get(Machine, m.id)
        out += [
            Action(m.name, "start-job", "queued", f"job {jid} started: its GPUs are free", True)
            for jid in (gpuqueue.dispatch(app, fresh) if fresh is not None else [])
        ]
    return out


def act(
    app: App, m: Machine, exit_code: int | None, started: bool = True, said: str | None = None
) -> Action:
    """``on_finish`` done for ``m``'s run that exited ``exit_code`` (``said``: how it ended, when
    not that: its setup failed, it was cancelled) — or, ``started`` False, that could not
    start: billing ends as if it had (a job that never started produced nothing a running
    machine keeps; its disk, stopped, keeps the files and the setup)."""
    policy = Experiment.model_validate(m.spec).on_finish
    said = said or (f"run exited {exit_code}" if started else "its run could not start")
    why = f"{said}; on_finish: {policy}"
    action = Action(
        m.name, {"stop": "stop", "terminate": "terminate"}.get(policy, "keep"), REASON, why
    )
    if policy == "keep":
        return action
    detail = {"job": jobs.RUN, "exit_code": exit_code, "why": why}
    others = ended.running(app, [m.id]).get(m.id, [])  # exec jobs still running end with it
    try:
        if policy == "stop" and machines.can_stop(m):
            _, changed = machines.stop(app, m.name, reason=REASON, detail=detail)
        else:  # terminate, or a spot machine its cloud cannot stop
            action.action = "terminate"
            _, changed = machines.down(app, m.name, reason=REASON, detail=detail)
        action.done = True
    except ProvisionerError as e:
        action.error = str(e)
        return action
    if changed:
        ended.record(app, m, others, how=action.action, reason=REASON, why=why)
    return action
