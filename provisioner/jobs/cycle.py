"""The scheduler's passes, named once, in the order one cycle runs them: what ``scheduler run``
schedules on their intervals and what ``provisioner sweep`` (cron, a systemd timer, a
Kubernetes CronJob) runs once, so the two cannot drift apart.

1. ``reconcile`` — the state brought in line with what the clouds report (and what the
   machines report of themselves), jobs found ended recorded, their ``on_finish`` acted on;
2. ``sweep`` — max lifetime, idle out of hours, autostop;
3. ``recover`` — preempted machines relaunched or started again;
4. ``wait`` — intents waiting for capacity tried;
5. ``budget.enforce``, ``reports.run_scheduled``, ``notify.deliver`` — budgets (their alerts
   and, when exhausted, their stops), scheduled reports, and the notices the passes above
   queued, sent.

A dry run acts on nothing: the passes that can say what they would do (sweep, recover, wait)
say it; the others are left out, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from provisioner import notify
from provisioner.app import App
from provisioner.jobs import enforce, reconcile, recover, scheduled_reports, sweep, waiting
from provisioner.jobs.lease import HOLDER, leading, not_leader
from provisioner.jobs.passes import Pass
from provisioner.settings import SchedulerSettings

CYCLE = "cycle"  # the lease of a whole `sweep`
HOUSEKEEPING_SECONDS = 60  # budgets, reports and deliveries: every minute under the daemon


@dataclass(frozen=True)
class Step:
    name: str
    call: Callable[[App, bool], Any]  # (app, dry_run) → a Pass, a list of lines, None
    every: Callable[[SchedulerSettings], int]  # its interval under the daemon, in seconds
    dry: bool  # it can run as a dry run (and then acts on nothing)
    why_not_dry: str = ""


STEPS: tuple[Step, ...] = (
    Step(
        "reconcile",
        lambda app, _: reconcile.run(app),
        lambda c: c.reconcile_interval_seconds,
        False,
        "not in a dry run: it records what the clouds report and acts on jobs that ended",
    ),
    Step(
        "sweep",
        lambda app, dry: sweep.run(app, dry_run=dry),
        lambda c: c.sweep_interval_seconds,
        True,
    ),
    Step(
        "recover",
        lambda app, dry: recover.run(app, dry_run=dry),
        lambda c: c.recover_interval_seconds,
        True,
    ),
    Step(
        "wait",
        lambda app, dry: waiting.run(app, dry_run=dry),
        lambda c: c.recover_interval_seconds,
        True,
    ),
    Step(
        "budget.enforce",
        lambda app, _: enforce.run(app, app.clock.now()),
        lambda _: HOUSEKEEPING_SECONDS,
        False,
        "not in a dry run: budgets are enforced only for real",
    ),
    Step(
        "reports.run_scheduled",
        lambda app, _: scheduled_reports.run(app, app.clock.now()),
        lambda _: HOUSEKEEPING_SECONDS,
        False,
        "not in a dry run: reports are sent only for real",
    ),
    Step(
        "notify.deliver",
        lambda app, _: notify.deliver(app, app.clock.now()),
        lambda _: HOUSEKEEPING_SECONDS,
        False,
        "not in a dry run: notices are sent only for real",
    ),
)


def jobs(app: App) -> list[tuple[str, Callable[[], Any], int]]:
    """Each step as the daemon schedules it: (name, call, interval in seconds), in cycle
    order."""
    cfg = app.settings.scheduler
    return [(s.name, _bound(app, s), s.every(cfg)) for s in STEPS]


def _bound(app: App, step: Step) -> Callable[[], Any]:
    return lambda: step.call(app, False)


def once(app: App, *, dry_run: bool = False, holder: str = HOLDER) -> list[tuple[str, Any]]:
    """One whole cycle, every step once in order: ``provisioner sweep``. Each step's result
    by name; a dry run leaves out the steps that cannot act on nothing (their result is the
    reason, a string). Under one lease for the whole cycle (each step still takes its own):
    two cron processes on one state run their cycles one after the other, so one never lists
    the clouds while the other is halfway through stopping a machine (which would record the
    stop twice). Another holder's cycle: one not-leader pass named ``cycle``."""
    out: list[tuple[str, Any]] = []
    with leading(app, CYCLE, app.clock.now(), holder, dry_run) as lease:
        if not lease:
            return [(CYCLE, not_leader(CYCLE, app, dry_run))]
        for step in STEPS:
            if dry_run and not step.dry:
                out.append((step.name, step.why_not_dry))
                continue
            if not lease.renew():
                out.append((step.name, Pass(step.name, leader=False, note=lease.lost)))
                continue
            out.append((step.name, step.call(app, dry_run)))
    return out
