from datetime import timedelta
from provisioner import machines
from provisioner.jobs import recover, reconcile
from tests.test_volumes import experiment, sandbox_volumes  # noqa: F401
import sqlite3


def test_probe(app, clock):
    lost = machines.up(app, experiment(lifecycle={"on_preemption": "relaunch"})).machine
    clock.advance(timedelta(hours=1))
    sb = app.provider("sandbox")
    sb.preempt(machines.ref(lost))
    reconcile.run(app)
    with sb._db() as db:
        db.execute("DELETE FROM machines WHERE id = ?", (lost.instance_id,))
    for _ in range(3):
        p = recover.run(app)
        print([(a.action, a.done, a.error, a.why) for a in p.actions])
        clock.advance(timedelta(minutes=30))
