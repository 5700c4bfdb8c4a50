"""A preempted machine comes back with its disk: where its cloud kept it stopped (GCP STOP, Azure
Deallocate, Yandex, the sandbox), recovery starts the same machine again in place — one machine
row, compute billed again from the start, the disk billed throughout — and launches a new
machine only when the cloud has no room to start it. On the sandbox, over a simulated hour."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select

from providers.base import MachineState
from provisioner import machines
from provisioner.app import App
from provisioner.jobs import reconcile, recover
from provisioner.models import Event, Machine, UsageInterval
from tests.conftest import run_cli, write_settings
from tests.test_scheduler import events, preempt, sched, status, up  # noqa: F401

US = "name: us\nallow: {regions: ['sandbox-us']}\n"


def preempted(app: App, name: str = "spot") -> tuple[Machine, datetime]:
    """A spot machine launched to be relaunched, taken back by the cloud after two hours and
    recorded so five minutes later: (the machine, when the cloud took it)."""
    m = up(app, name, lifecycle={"on_preemption": "relaunch"})
    app.clock.advance(timedelta(hours=2))
    taken = app.clock.now()
    preempt(app, name)
    app.clock.advance(timedelta(minutes=5))
    reconcile.run(app)
    assert status(app, name) == "preempted"
    return m, taken


def intervals(app: App, machine_id: str) -> dict[str, list[tuple[datetime, datetime | None]]]:
    with app.db.session() as s:
        rows = s.scalars(
            select(UsageInterval)
            .where(UsageInterval.machine_id == machine_id)
            .order_by(UsageInterval.started_at)
        )
        out: dict[str, list[tuple[datetime, datetime | None]]] = {}
        for iv in rows:
            out.setdefault(iv.kind, []).append((iv.started_at, iv.ended_at))
        return out


def rows_named(app: App, name: str) -> list[Machine]:
    with app.db.session() as s:
        return list(s.scalars(select(Machine).where(Machine.name == name)))


def test_a_preempted_machine_is_started_again_in_place_with_its_disk(
    sched,  # noqa: F811
    home,
    db_url,
    tmp_path,
):
    app = sched(US)
    launched = app.clock.now()
    m, taken = preempted(app)

    # what would be done, before it is: start in place, not relaunch
    [planned] = recover.run(app, dry_run=True).actions
    assert planned.action == "start" and not planned.done
    assert f"start in place in {m.zone} (same machine, same disk)" in planned.why
    cfg = write_settings(home, state_url=db_url, policies=[str(tmp_path / "policy.yaml")])
    shown = run_cli("--config", str(cfg), "sweep", "--dry-run", now=app.clock.now())
    assert shown.returncode == 0, shown.stderr
    assert "spot: start in place [preempted]" in shown.stdout.replace("\n", " ")
    assert status(app, "spot") == "preempted"  # a dry run does nothing

    app.clock.advance(timedelta(minutes=5))
    restarted = app.clock.now()
    [done] = recover.run(app).actions
    assert (done.action, done.done, done.error) == ("start", True, None)
    assert done.why.endswith("→ started in place")

    back = machines.find(app, "spot")
    assert (back.id, back.instance_id, back.zone, back.status) == (
        m.id,
        m.instance_id,
        m.zone,
        "running",
    )
    assert app.provider("sandbox").get(machines.ref(back)).state is MachineState.RUNNING
    assert [r.id for r in rows_named(app, "spot")] == [m.id]  # no second machine
    assert [i.id for i in app.provider("sandbox").list_managed()] == [m.instance_id]
    # compute stopped billing when the cloud took it and bills again from the start; the disk
    # billed all along
    assert intervals(app, m.id) == {
        "compute": [(launched, taken), (restarted, None)],
        "disk": [(launched, None)],
    }
    ev = events(app, "spot")
    assert ev[ev.index(("preempted", "preempted")) :] == [
        ("preempted", "preempted"),
        ("started", "preempted"),
    ]
    assert recover.run(app).actions == []  # recovered once

    shown = run_cli("--config", str(cfg), "status", "spot", "--no-refresh", now=app.clock.now())
    assert shown.returncode == 0, shown.stderr
    assert "started in place after its preemption" in shown.stdout.replace("\n", " ")


def test_no_room_to_start_it_in_place_launches_a_new_machine_in_its_zone_first(sched):  # noqa: F811
    app = sched(US)
    sandbox = app.provider("sandbox")
    m, _ = preempted(app)
    sandbox.inject(capacity={m.zone: 0})  # its zone has no room now, the other zones have

    [done] = recover.run(app).actions
    assert (done.action, done.done) == ("relaunch", True)
    assert "no room to start it in place" in done.why and "SandboxZoneExhausted" in done.why
    new = machines.find(app, "spot")
    assert new.id != m.id and new.status == "running" and new.zone != m.zone
    old = next(r for r in rows_named(app, "spot") if r.id == m.id)
    assert old.status == "terminated"  # its name freed for the new machine
    with app.db.session() as s:
        tried = [
            (e.kind, (e.detail or {}).get("zone"))
            for e in s.scalars(
                select(Event)
                .where(Event.machine_id == new.id, Event.kind.like("launch-%"))
                .order_by(Event.id)
            )
        ]
    # the lost zone first (it has no room), then the next candidate
    assert tried[:2] == [("launch-attempt", m.zone), ("launch-failed", m.zone)]
    assert tried[2:] == [("launch-attempt", new.zone)]
    [relaunched] = [e for e in _events_of(app, m.id) if e.kind == "relaunched"]
    assert relaunched.detail["machine"] == new.id
    assert relaunched.detail["why"].startswith("no room to start it in place: sandbox: zone")


def _events_of(app: App, machine_id: str) -> list[Event]:
    with app.db.session() as s:
        return list(
            s.scalars(select(Event).where(Event.machine_id == machine_id).order_by(Event.id))
        )


def test_a_start_the_cloud_fails_otherwise_is_a_failed_try_and_the_machine_is_kept(sched):  # noqa: F811
    app = sched(US)
    sandbox = app.provider("sandbox")
    m, _ = preempted(app)
    sandbox.inject(auth_fail=True)  # the cloud refuses our credentials for a while

    [failed] = recover.run(app).actions
    assert (failed.action, failed.done) == ("start", False) and "credentials" in failed.error
    assert events(app, "spot")[-1] == ("recover-failed", "preempted")
    assert status(app, "spot") == "preempted"  # nothing terminated: it still has its disk
    sandbox.inject(auth_fail=False)
    assert sandbox.get(machines.ref(m)).state is MachineState.PREEMPTED
    assert recover.run(app).actions == []  # backing off

    app.clock.advance(recover.backoff(1))
    [done] = recover.run(app).actions
    assert (done.action, done.done) == ("start", True) and "(try 2 of 10)" in done.why
    assert [r.id for r in rows_named(app, "spot")] == [m.id]
    assert machines.find(app, "spot").status == "running"
