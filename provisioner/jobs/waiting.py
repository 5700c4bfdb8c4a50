"""The scheduler's pass over intents waiting for capacity (:mod:`provisioner.machines.waiting`):
each one whose next try is due is tried (every candidate, policy and budget checked first); one
past its deadline is given up; one whose try stopped midway is resumed (what it launched is
adopted). An intent another process is trying right now (its lock is held) is left to it."""

from __future__ import annotations

from datetime import datetime

from provisioner.app import App
from provisioner.errors import ProvisionerError
from provisioner.fleet import at_text
from provisioner.jobs.lease import HOLDER, Held, run_pass
from provisioner.jobs.passes import Action, Pass
from provisioner.machines import waiting
from provisioner.models import Machine
from provisioner.schema import INTENTS
from provisioner.schema import MachineStatus as S

REASON = "no-capacity"


def run(
    app: App, now: datetime | None = None, *, dry_run: bool = False, holder: str = HOLDER
) -> Pass:
    when = now or app.clock.now()
    app.policies  # noqa: B018  (a bad policy file stops the pass before anything is done)

    def body(lease: Held) -> Pass:
        result = Pass("wait", dry_run=dry_run)
        todo = []
        for m, w in waiting.queued(app):
            result.checked += 1
            action = decide(m, w, when)
            if action is not None:
                result.actions.append(action)
                todo.append((action, m))
        if dry_run:
            return result
        # a try can take minutes: the lease is kept before each intent
        for action, m in lease.each(todo, lambda x: [x[0]]):
            _act(app, action, m)
        return result

    return run_pass(app, "wait", when, body, holder=holder, dry_run=dry_run)


def decide(m: Machine, w: waiting.Wait, now: datetime) -> Action | None:
    """What the pass does to one queued intent now; None: its next try is not due."""
    since = f"waiting for capacity since {at_text(w.since, now)}"
    if now >= w.until:
        return Action(m.name, "give-up", REASON, f"{since}, deadline {at_text(w.until, now)}")
    if m.status == S.REQUESTED:
        return Action(m.name, "launch", REASON, f"{since}; its last try stopped midway: resumed")
    if now < w.next_try:
        return None
    return Action(m.name, "launch", REASON, f"{since}; try {w.rounds + 1}, every candidate")


def _act(app: App, action: Action, m: Machine) -> None:
    """One try (or the give-up): its outcome is written on the action. No capacity again is
    no error: the intent waits, as asked."""
    try:
        result = waiting.try_once(app, m.id)
    except waiting.StillWaiting as e:
        action.done = True
        action.why += f" → no capacity; next try {at_text(e.wait.next_try, app.clock.now())}"
        return
    except ProvisionerError as e:  # given up, refused, cancelled: the intent has ended
        ended, _ = waiting.state(app, m.id)
        if ended.status in INTENTS:  # a cloud that could not answer: the next pass resumes
            action.error = str(e)
            return
        action.done = True
        action.why += f" → {e}"
        return
    if result is None:
        action.why += " (another process holds it, or it is no longer waiting)"
        action.done = True
        return
    n = result.machine
    action.done = True
    action.why += f" → launched on {n.cloud} {n.zone or n.region}"
