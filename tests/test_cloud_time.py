"""Billed to the cloud's minute: a machine the cloud stopped or took is billed until the instant
the cloud says, not until the scheduler noticed. On the sandbox, on a manual clock."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta
from decimal import Decimal

import pytest
from sqlalchemy import select

from providers.sandbox.adapter import SandboxProvider
from provisioner import ledger, machines
from provisioner.app import App
from provisioner.jobs import reconcile as reconcile_pass
from provisioner.models import Event, Heartbeat, Machine
from provisioner.spec import Experiment
from provisioner.views.status import status_list
from tests.conftest import sandbox_experiment

TICK = timedelta(minutes=5)  # the scheduler's default sweep
# 73 GB at the sandbox's 0.10 per GB-month over 730 hours: 0.01 an hour, so every cost is exact
DISK_GB = 73


def up(app: App, name: str = "exp") -> Machine:
    exp = Experiment.model_validate(sandbox_experiment(name, disk_gb=DISK_GB))
    m = machines.up(app, exp).machine
    assert (m.market, m.rate, m.disk_rate) == ("spot", Decimal("0.15"), Decimal("0.01"))
    return m


def total(app: App, start: datetime, end: datetime) -> Decimal:
    with app.db.session() as s:
        return ledger.total(s, start, end).get("USD", Decimal(0))


def cost(rate: Decimal, span: timedelta) -> Decimal:
    return rate * Decimal(int(span.total_seconds())) / 3600


def preempted_event(app: App, m: Machine) -> Event:
    with app.db.session() as s:
        return s.scalars(
            select(Event).where(Event.machine_id == m.id, Event.kind == "preempted")
        ).one()


def test_a_preemption_between_two_ticks_bills_nothing_past_the_clouds_time(app, clock):
    t0 = clock.now()
    m = up(app)
    clock.advance(TICK)
    reconcile_pass.run(app)  # a tick: still running
    clock.advance(timedelta(minutes=2))
    taken = clock.now()
    app.provider("sandbox").preempt(machines.ref(m))
    clock.advance(TICK - timedelta(minutes=2))
    p = reconcile_pass.run(app)  # the next tick notices, 3 minutes later
    assert [(a.machine, a.reason) for a in p.actions] == [("exp", "preempted")]
    end = clock.now() + timedelta(hours=1)

    event = preempted_event(app, m)
    assert (event.at, event.detail["at_source"]) == (taken, "cloud")
    # compute for the 7 minutes it ran, the disk (kept with the stopped machine) throughout
    expected = cost(m.rate, taken - t0) + cost(m.disk_rate, end - t0)
    assert total(app, t0, end) == expected
    assert total(app, taken, end) == cost(m.disk_rate, end - taken)  # 0.00 of compute past it
    clock.set(end)
    (row,) = status_list(app, all_=True, refresh=False).fleet.rows  # what `status` shows
    assert (row.status, row.spent) == ("preempted", {"USD": expected})


def test_a_preemption_at_the_start_of_a_scheduler_outage_bills_nothing_for_the_outage(app, clock):
    t0 = clock.now()
    m = up(app, "h100")
    clock.advance(TICK)
    reconcile_pass.run(app)
    clock.advance(timedelta(minutes=1))
    taken = clock.now()
    app.provider("sandbox").preempt(machines.ref(m))  # the scheduler goes down now …
    clock.advance(timedelta(hours=6))
    reconcile_pass.run(app)  # … and is back six hours later
    event = preempted_event(app, m)
    assert (event.at, event.detail["at_source"]) == (taken, "cloud")
    assert total(app, t0, clock.now()) == cost(m.rate, taken - t0) + cost(
        m.disk_rate, clock.now() - t0
    )
    compute_in_outage = total(app, taken, clock.now()) - cost(m.disk_rate, clock.now() - taken)
    assert compute_in_outage == Decimal(0)


def test_a_preemption_the_cloud_makes_while_nobody_looks_is_dated_when_due(home, clock, db_url):
    """The sandbox's own preempt_after_seconds: taken when due, found an hour later."""
    from tests.conftest import make_settings

    app = App(make_settings(home, state_url=db_url, sandbox={"preempt_after_seconds": 600}), clock)
    try:
        t0 = clock.now()
        m = up(app)
        clock.advance(timedelta(hours=1))
        machines.reconcile(app)
        event = preempted_event(app, m)
        assert (event.at, event.detail["at_source"]) == (t0 + timedelta(minutes=10), "cloud")
    finally:
        app.close()


def without_cloud_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox made to answer as a cloud whose API gives no stop time."""
    answer = SandboxProvider._instance

    def no_time(self, db, row):  # type: ignore[no-untyped-def]
        return dataclasses.replace(answer(self, db, row), stopped_at=None)

    monkeypatch.setattr(SandboxProvider, "_instance", no_time)


def beat(app: App, m: Machine, at: datetime) -> None:
    with app.db.session() as s:
        s.add(Heartbeat(machine_id=m.id, at=at, gpus=[], max_util=90.0))


def test_without_a_cloud_time_the_last_heartbeat_closes_usage(app, clock, monkeypatch):
    without_cloud_time(monkeypatch)
    t0 = clock.now()
    m = up(app)
    for minutes in (1, 2, 3):
        beat(app, m, t0 + timedelta(minutes=minutes))
    clock.advance(timedelta(minutes=4))
    app.provider("sandbox").preempt(machines.ref(m))
    clock.advance(timedelta(hours=6))
    machines.reconcile(app)
    event = preempted_event(app, m)
    assert (event.at, event.detail["at_source"]) == (t0 + timedelta(minutes=3), "heartbeat")
    assert total(app, t0, clock.now()) == cost(m.rate, timedelta(minutes=3)) + cost(
        m.disk_rate, clock.now() - t0
    )


def test_without_a_cloud_time_a_forwarded_notice_closes_usage_when_announced(
    app, clock, monkeypatch
):
    """The agent forwarded the cloud's notice (AWS: the time in spot/instance-action): usage
    closes when the cloud said it would take the machine, ahead of a later heartbeat's bound."""
    from provisioner import heartbeats

    without_cloud_time(monkeypatch)
    t0 = clock.now()
    m = up(app)
    beat(app, m, t0 + timedelta(minutes=1))
    clock.advance(timedelta(minutes=2))
    announced = t0 + timedelta(minutes=4)
    notice = {"cloud": "aws", "event_id": "n-1", "action": "terminate"}
    notice["not_before"] = announced.strftime("%Y-%m-%dT%H:%M:%SZ")
    heartbeats.record_notice(app, m.id, notice)
    clock.advance(timedelta(minutes=3))
    app.provider("sandbox").preempt(machines.ref(m))
    clock.advance(timedelta(hours=6))
    machines.reconcile(app)
    event = preempted_event(app, m)
    assert (event.at, event.detail["at_source"]) == (announced, "notice")
    assert total(app, t0, clock.now()) == cost(m.rate, announced - t0) + cost(
        m.disk_rate, clock.now() - t0
    )


def test_without_a_cloud_time_or_a_heartbeat_usage_closes_when_noticed(app, clock, monkeypatch):
    without_cloud_time(monkeypatch)
    m = up(app)
    beat(app, m, clock.now() - timedelta(minutes=1))  # before this launch: says nothing of it
    clock.advance(timedelta(minutes=20))
    app.provider("sandbox").preempt(machines.ref(m))
    clock.advance(timedelta(minutes=5))
    machines.reconcile(app)
    event = preempted_event(app, m)
    assert (event.at, event.detail["at_source"]) == (clock.now(), "noticed")


def test_a_cloud_time_before_the_open_usage_began_closes_it_empty(app, clock, monkeypatch):
    """A stale stop time (an earlier stop the cloud still reports) never bills backwards."""
    t0 = clock.now()
    m = up(app)
    answer = SandboxProvider._instance
    monkeypatch.setattr(
        SandboxProvider,
        "_instance",
        lambda self, db, row: dataclasses.replace(
            answer(self, db, row), stopped_at=t0 - timedelta(days=1)
        ),
    )
    clock.advance(timedelta(minutes=30))
    app.provider("sandbox").stop(machines.ref(m))  # stopped outside provisioner
    clock.advance(TICK)
    machines.reconcile(app)
    with app.db.session() as s:
        (event,) = s.scalars(
            select(Event).where(Event.machine_id == m.id, Event.kind == "stopped")
        ).all()
    assert (event.at, event.detail["at_source"]) == (t0, "cloud")
    assert total(app, t0, clock.now()) == cost(m.disk_rate, clock.now() - t0)


def test_the_sandbox_reports_when_it_stopped_or_took_a_machine(app, clock):
    sandbox = app.provider("sandbox")
    m = up(app)
    assert sandbox.get(machines.ref(m)).stopped_at is None
    clock.advance(timedelta(minutes=3))
    sandbox.stop(machines.ref(m))
    stopped = clock.now()
    clock.advance(timedelta(minutes=3))
    assert sandbox.get(machines.ref(m)).stopped_at == stopped
    sandbox.start(machines.ref(m))
    assert sandbox.get(machines.ref(m)).stopped_at is None
    clock.advance(timedelta(minutes=3))
    sandbox.terminate(machines.ref(m))
    assert sandbox.get(machines.ref(m)).stopped_at == clock.now()
