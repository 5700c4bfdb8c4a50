"""The fleet as `status` lists it (provisioner/fleet.py): plain SQL on each database's own DB-API
connection — sqlite3, and psycopg under SQLAlchemy for PostgreSQL — giving what the ledger
gives: the same costs, launches across relaunches, and what to warn about."""

from __future__ import annotations

from datetime import timedelta

from provisioner import ledger, machines
from provisioner.fleet import Sql, read
from provisioner.jobs import reconcile, recover
from provisioner.models import EPOCH, Heartbeat
from provisioner.spec import Experiment
from tests.conftest import sandbox_experiment


def fleet_of(app, *, all_: bool = True):
    now = app.clock.now()
    with app.db.session() as s:
        return read(Sql.on(s), all_=all_, now=now, seen_since=now - timedelta(minutes=5))


def test_costs_launches_and_warnings_are_the_ledgers_on_each_database(app):
    for name in ("run", "idle", "gone"):
        data = {**sandbox_experiment(name), "lifecycle": {"on_preemption": "relaunch"}}
        machines.up(app, Experiment.model_validate(data))
    app.clock.advance(timedelta(hours=2, seconds=7, microseconds=3))
    machines.stop_many(app, ["idle"])
    machines.down_many(app, ["gone"])
    app.provider("sandbox").preempt(machines.ref(machines.find(app, "run")))
    reconcile.run(app)
    app.provider("sandbox").terminate(machines.ref(machines.find(app, "run")))  # not kept
    assert [x.done for x in recover.run(app).actions] == [True]
    app.clock.advance(timedelta(hours=1, minutes=13))
    now = app.clock.now()
    with app.db.session() as s:
        new = machines.find(app, "run")
        s.add(Heartbeat(machine_id=new.id, at=now - timedelta(minutes=2), gpus=[{}], max_util=1))
        s.add(Heartbeat(machine_id=new.id, at=now - timedelta(minutes=1), gpus=[], max_util=None))
    with app.db.session() as s:
        by_name = ledger.spend_by(s, EPOCH, now, ("machine",))

    fleet = fleet_of(app)
    rows = {m.name: m for m in fleet.rows}
    assert {n: (m.status, m.launches) for n, m in rows.items()} == {
        "run": ("running", 2),
        "idle": ("stopped", 1),
        "gone": ("terminated", 1),
    }
    assert rows["run"].id == new.id and rows["run"].created_at.tzinfo is not None
    for name, m in rows.items():  # the ledger's sums, to the ninth place JSON shows
        expected = {c: round(v, 9) for c, v in by_name[(name,)].items() if v}
        assert {c: round(v, 9) for c, v in m.spent.items()} == expected, name
        assert m.spent and all(v > 0 for v in m.spent.values())
    # the agent's latest heartbeat in the grace period sees no GPU of the machine's one
    assert fleet.warnings == {"run": "the agent sees 0 of 1 GPUs: driver missing or wrong image?"}
    assert [m.name for m in fleet_of(app, all_=False).rows] == ["idle", "run"]  # oldest first
