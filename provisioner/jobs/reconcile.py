"""Reconcile: the state brought in line with what the clouds report; orphans listed."""

from __future__ import annotations

from datetime import datetime

from provisioner import machines
from provisioner.app import App
from provisioner.jobs import finish
from provisioner.jobs.lease import HOLDER, Held, run_pass
from provisioner.jobs.passes import Action, Pass
from provisioner.machines.pull import pull_all


def run(app: App, now: datetime | None = None, *, holder: str = HOLDER) -> Pass:
    when = now or app.clock.now()

    def body(lease: Held) -> Pass:
        orphans: list[machines.Orphan] = []
        observations = machines.reconcile(app, now=when, orphans=orphans, keep=lease.renew)
        result = Pass("reconcile", checked=len(observations))
        for o in observations:
            if o.error:
                result.actions.append(Action(o.machine.name, "record", "error", o.error))
            elif o.changed:
                why = f"the cloud reports {o.observed}"
                result.actions.append(Action(o.machine.name, "record", o.observed or "", why, True))
        result.orphans = [  # launches in flight are not orphans
            {
                "cloud": o.cloud,
                "id": o.instance.id,
                "name": o.instance.name,
                "region": o.instance.region,
                "zone": o.instance.zone,
            }
            for o in orphans
            if not o.adoptable_by
        ]
        # each machine's own report (samples, job ends) read before its jobs are judged: idle
        # and job ends known without a public endpoint
        pulled = pull_all(app)
        result.pulls = pulled.lines
        for name, job, how in pulled.job_ends:
            result.actions.append(Action(name, "record", "job-ended", f"job {job}: {how}", True))
        result.actions += finish.check(app)  # a job that ended: its on_finish
        return result

    return run_pass(app, "reconcile", when, body, holder=holder)
