"""Recover: a preempted spot machine → relaunched per its spec's ``on_preemption``: its zone and
region first, then the planner's next candidates, within policy and budget, with backoff."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select

from provisioner import machines
from provisioner.app import App
from provisioner.crashpoints import crashpoint
from provisioner.errors import ProvisionerError, UserError
from provisioner.jobs.lease import HOLDER, Held, run_pass
from provisioner.jobs.passes import Action, Pass, act
from provisioner.models import ACTIVE_EXCLUDED, Event, Machine
from provisioner.schema import MachineStatus as S
from provisioner.spec import Experiment
from provisioner.state import machine as machine_row

BACKOFF = timedelta(minutes=1)  # doubled per failed attempt …
BACKOFF_MAX = timedelta(hours=1)  # … up to this
MAX_ATTEMPTS = 10


def stored_experiment(m: Machine) -> Experiment:
    """The experiment a machine was launched from, read back from the state."""
    return Experiment.model_validate(m.spec)


def run(
    app: App, now: datetime | None = None, *, dry_run: bool = False, holder: str = HOLDER
) -> Pass:
    when = now or app.clock.now()
    app.policies  # noqa: B018

    def body(lease: Held) -> Pass:
        result = Pass("recover", dry_run=dry_run)
        todo = []
        for m, attempts, last in _to_recover(app):
            result.checked += 1
            action = _decide(m, attempts, last, when)
            if action is not None:
                result.actions.append(action)
                todo.append((action, m, attempts))
        if dry_run:
            return result
        # a relaunch can take minutes: the lease is kept before each machine
        for action, m, attempts in lease.each(todo, lambda t: [t[0]]):
            if action.action == "terminate":
                act(app, action)
            else:
                _relaunch(app, m, stored_experiment(m), action, attempts, when)
        return result

    return run_pass(app, "recover", when, body, holder=holder, dry_run=dry_run)


def _decide(m: Machine, attempts: int, last: datetime | None, now: datetime) -> Action | None:
    """What recovery does to a lost machine now: per its spec's ``on_preemption``, with the
    backoff of its failed attempts; None: nothing (left, given up, or waiting)."""
    mode = stored_experiment(m).lifecycle.on_preemption
    if mode == "leave":
        return None
    if mode == "terminate":
        return Action(m.name, "terminate", "preempted", "on_preemption: terminate")
    if attempts >= MAX_ATTEMPTS:
        return None
    if last is not None and now < last + min(BACKOFF * 2 ** (attempts - 1), BACKOFF_MAX):
        return None
    near = m.zone or m.region or "?"
    why = f"on_preemption: relaunch, {near} first (attempt {attempts + 1})"
    return Action(m.name, "relaunch", "preempted", why)


def _to_recover(app: App) -> list[tuple[Machine, int, datetime | None]]:
    """Preempted machines, and those whose relaunch failed or was interrupted (terminated to
    be relaunched, with no machine of that name since): (machine, failed attempts so far, when
    the last one failed)."""
    with app.db.session() as s:
        out: list[tuple[Machine, int, datetime | None]] = [
            (m, 0, None) for m in s.scalars(select(Machine).where(Machine.status == S.PREEMPTED))
        ]
        failed = {
            mid: (n, last)
            for mid, n, last in s.execute(
                select(Event.machine_id, func.count(), func.max(Event.at))
                .where(Event.kind == "recover-failed")
                .group_by(Event.machine_id)
            )
        }
        pending = set(failed) | set(
            s.scalars(
                select(Event.machine_id).where(
                    Event.kind == "terminated", Event.reason == "preempted"
                )
            )
        )
        for mid in pending:
            m = machine_row(s, mid)
            latest = s.scalars(
                select(Event).where(Event.machine_id == mid).order_by(Event.id.desc())
            ).first()
            if latest is None:
                continue
            interrupted = latest.kind == "terminated" and (latest.detail or {}).get("relaunching")
            live = s.scalars(
                select(Machine.status).where(
                    Machine.name == m.name, Machine.status.not_in(ACTIVE_EXCLUDED)
                )
            ).first()
            # a relaunch killed mid-`up` left its intent "requested": resuming it finishes the job
            if (latest.kind == "recover-failed" or interrupted) and live in (None, "requested"):
                out.append((m, *failed.get(mid, (0, None))))
        return out


def _near(m: Machine) -> Callable[[Any], int]:
    def rank(c: Any) -> int:
        o = c.offer
        if o.cloud == m.cloud and o.zone and o.zone == m.zone:
            return 0
        return 1 if (o.cloud, o.region) == (m.cloud, m.region) else 2

    return rank


def _relaunch(
    app: App, m: Machine, exp: Experiment, action: Action, attempts: int, now: datetime
) -> None:
    """Check the relaunch against policy and budget first (refused: the lost machine is kept,
    stopped, see :func:`machines.hold`); then free the name (the lost machine is terminated:
    its disk still bills) and ``up`` with the lost zone and region first."""
    if m.status == S.PREEMPTED:
        try:  # before anything is terminated: a refused relaunch keeps the machine and disk
            machines.check(app, exp)
        except UserError as e:
            action.error = str(e)
            machines.hold(app, m, str(e))
            return
    try:
        if m.status == S.PREEMPTED:
            machines.down(app, m.name, reason="preempted", detail={"relaunching": True})
            crashpoint("recover-after-down")
        result = machines.up(app, exp, spec_path=m.spec_path, prefer=_near(m))
    except ProvisionerError as e:
        action.error = str(e)
        machines.record_event(
            app,
            m.id,
            "recover-failed",
            reason="preempted",
            detail={"attempt": attempts + 1, "error": str(e)},
        )
        return
    new = result.machine
    where = f"{new.cloud}/{new.zone or new.region}"
    action.done = True
    action.why += f" → {where}"
    machines.record_event(
        app, m.id, "relaunched", reason="preempted", detail={"machine": new.id, "where": where}
    )
    machines.record_event(
        app, new.id, "recovered", reason="recovered", detail={"replaces": m.id, "lost_zone": m.zone}
    )
