"""A relaunch never destroys the disk first. A preempted machine its cloud kept stopped with its
boot disk is kept — billed for that disk only — until a replacement runs: each try starts it
in place first; only once a new machine runs elsewhere is the old one terminated. A machine the
cloud deleted meanwhile falls back to a new machine with its volumes, whichever step meets the
deletion. On the sandbox (its boot disk: the machine's own directory) over simulated hours."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import select

from providers.base import MachineState, Throttled
from provisioner import machines
from provisioner.app import App
from provisioner.jobs import reconcile, recover
from provisioner.machines import volumes
from provisioner.models import Event, Machine, UsageInterval
from tests.conftest import run_cli, sandbox_experiment, write_settings, write_yaml
from tests.test_scheduler import events, preempt, sched, status, up  # noqa: F401

US = "name: us\nallow: {regions: ['sandbox-us']}\n"
ZONES = ("sandbox-us-1a", "sandbox-us-1b", "sandbox-us-1c")
CKPT = {"name": "ckpt", "size_gb": 20, "path": "/ckpt"}


def counting(app: App) -> list[tuple[str, str]]:
    """Every launch and terminate the sandbox is asked for, in order: (call, instance or zone)."""
    sandbox = app.provider("sandbox")
    calls: list[tuple[str, str]] = []
    launch, terminate, terminate_many = sandbox.launch, sandbox.terminate, sandbox.terminate_many

    def on_launch(request: Any) -> Any:
        inst = launch(request)
        calls.append(("launch", inst.id))
        return inst

    def on_terminate(ref: Any) -> None:
        calls.append(("terminate", ref.id))
        terminate(ref)

    def on_terminate_many(refs: Any) -> Any:
        calls.extend(("terminate", r.id) for r in refs)
        return terminate_many(refs)

    sandbox.launch, sandbox.terminate = on_launch, on_terminate  # type: ignore[method-assign]
    sandbox.terminate_many = on_terminate_many  # type: ignore[method-assign]
    return calls


def preempted_with_a_file(app: App, **spec: Any) -> tuple[Machine, datetime]:
    """A spot machine that wrote a checkpoint to its boot disk, taken back by the cloud after two
    hours and recorded so: (the machine, when the cloud took it)."""
    m = up(
        app, "spot", lifecycle={"on_preemption": "relaunch", **spec.pop("lifecycle", {})}, **spec
    )
    work = app.provider("sandbox").machine_dir(m.instance_id) / "workdir"
    work.mkdir(parents=True, exist_ok=True)
    (work / "step-1200.ckpt").write_text("weights after 1200 steps\n")  # what its job wrote
    app.clock.advance(timedelta(hours=2))
    taken = app.clock.now()
    preempt(app, "spot")
    reconcile.run(app)
    assert status(app, "spot") == "preempted"
    return m, taken


def intervals(app: App, machine_id: str) -> dict[str, list[tuple[datetime, datetime | None]]]:
    with app.db.session() as s:
        out: dict[str, list[tuple[datetime, datetime | None]]] = {}
        for iv in s.scalars(
            select(UsageInterval)
            .where(UsageInterval.machine_id == machine_id)
            .order_by(UsageInterval.started_at)
        ):
            out.setdefault(iv.kind, []).append((_utc(iv.started_at), _utc(iv.ended_at)))
        return out


def _utc(at: datetime | None) -> datetime | None:
    from provisioner.tries import utc

    return None if at is None else utc(at)


def row(app: App, machine_id: str) -> Machine:
    with app.db.session() as s:
        m = s.get(Machine, machine_id)
        assert m is not None
        return m


def kinds(app: App, machine_id: str) -> list[str]:
    with app.db.session() as s:
        return [
            e.kind
            for e in s.scalars(
                select(Event).where(Event.machine_id == machine_id).order_by(Event.id)
            )
        ]


def test_no_room_anywhere_keeps_the_machine_and_its_disk_and_starts_it_in_place_later(sched):  # noqa: F811
    """The measured bug: no room in its zone to start in place, no room elsewhere either. Before,
    the machine was terminated first and came back 20 minutes later without its disk's files.
    Now nothing is terminated: it waits, billed for its disk only, each try starting it in
    place first; when room comes back it is the same machine with the same files."""
    app = sched(US)
    sandbox = app.provider("sandbox")
    calls = counting(app)
    launched = app.clock.now()
    m, taken = preempted_with_a_file(app)
    sandbox.inject(capacity=dict.fromkeys(ZONES, 0))  # no room in the region the policy allows

    p = recover.run(app)
    [failed] = p.actions
    assert not failed.done and "could not launch spot" in (failed.error or "")
    assert [c for c in calls if c[0] == "terminate"] == []  # nothing terminated
    assert (row(app, m.id).status, row(app, m.id).name) == ("preempted", "spot")  # its own name
    assert sandbox.get(machines.ref(m)).state is MachineState.PREEMPTED  # the cloud still has it

    # twenty minutes later, two more tries (backoff 1, 2 min), still nothing terminated
    for minutes in (1, 2):
        app.clock.advance(timedelta(minutes=minutes))
        [again] = recover.run(app).actions
        assert again.action == "relaunch" and "no room to start it in place" in again.why
    app.clock.advance(timedelta(minutes=17))
    sandbox.inject(capacity={})  # room again
    restarted = app.clock.now()
    [done] = recover.run(app).actions
    assert (done.action, done.done) == ("start", True) and done.why.endswith("started in place")

    assert [c for c in calls if c[0] == "terminate"] == []
    back = machines.find(app, "spot")
    assert (back.id, back.instance_id, back.status) == (m.id, m.instance_id, "running")
    work = sandbox.machine_dir(back.instance_id) / "workdir"
    assert (work / "step-1200.ckpt").read_text() == "weights after 1200 steps\n"  # its files
    # compute billed until the cloud took it and again from the start; the disk all along
    assert intervals(app, m.id) == {
        "compute": [(launched, taken), (restarted, None)],
        "disk": [(launched, None)],
    }
    ev = kinds(app, m.id)
    assert ev[ev.index("preempted") :].count("recover-failed") == 3
    assert ev[-1] == "started"


def test_a_replacement_elsewhere_runs_first_then_the_old_machine_is_terminated(sched):  # noqa: F811
    """No room in its zone, room in the next: a new machine is launched there, and only once it
    runs is the preempted one terminated; the ledger bills the old disk until that instant,
    nothing after."""
    app = sched(US)
    sandbox = app.provider("sandbox")
    calls = counting(app)
    launched = app.clock.now()
    m, taken = preempted_with_a_file(app)
    calls.clear()  # the first launch
    sandbox.inject(capacity={m.zone: 0})
    app.clock.advance(timedelta(minutes=5))
    relaunched = app.clock.now()

    [done] = recover.run(app).actions
    assert (done.action, done.done) == ("relaunch", True)
    new = machines.find(app, "spot")
    assert new.id != m.id and new.zone != m.zone and new.status == "running"
    # the order the cloud was asked: the new machine launched, then the old one terminated
    assert calls == [("launch", new.instance_id), ("terminate", m.instance_id)]
    old = row(app, m.id)
    assert (old.status, old.name) == ("terminated", "spot")  # its history under its name
    assert intervals(app, m.id) == {
        "compute": [(launched, taken)],
        "disk": [(launched, relaunched)],  # billed until terminated, not after
    }
    assert "spot: relaunched" not in done.why and "keeps its disk until" in done.why
    with app.db.session() as s:
        ended = s.scalars(
            select(Event).where(Event.machine_id == m.id, Event.kind == "terminated")
        ).one()
    assert ended.reason == "preempted"
    assert f"{new.id} runs; terminated now" in ended.detail["why"]

    app.clock.advance(timedelta(hours=1))
    assert intervals(app, m.id)["disk"] == [(launched, relaunched)]  # nothing after
    assert recover.run(app).actions == []  # recovered once


def test_a_replacement_not_yet_running_leaves_the_old_machine_kept(sched, monkeypatch):  # noqa: F811
    """The replacement is launched but not running yet (still booting): the preempted machine
    keeps its disk, under a name of its own, until a later pass sees the replacement run."""
    app = sched(US)
    sandbox = app.provider("sandbox")
    calls = counting(app)
    m, _ = preempted_with_a_file(app)
    sandbox.inject(capacity={m.zone: 0})
    real_up = machines.up

    def booting(*args: Any, **kwargs: Any) -> Any:
        result = real_up(*args, **kwargs)
        with app.db.session() as s:  # as a cloud answers while the machine boots
            s.get(Machine, result.machine.id).status = "pending"
        result.machine.status = "pending"
        return result

    monkeypatch.setattr(machines, "up", booting)
    [done] = recover.run(app).actions
    monkeypatch.setattr(machines, "up", real_up)
    assert done.done
    new = machines.find(app, "spot")
    assert new.status == "pending" and new.id != m.id
    assert [c for c in calls if c[0] == "terminate"] == []
    kept = row(app, m.id)
    assert (kept.status, kept.name) == ("preempted", recover.aside_name(m))
    assert recover.run(app).actions == []  # it waits for the replacement to run

    app.clock.advance(timedelta(minutes=2))
    reconcile.run(app)  # the replacement is seen running
    assert machines.find(app, "spot").status == "running"
    [retired] = recover.run(app).actions
    assert (retired.action, retired.done, retired.machine) == ("terminate", True, kept.name)
    assert calls[-1] == ("terminate", m.instance_id)
    assert (row(app, m.id).status, row(app, m.id).name) == ("terminated", "spot")


def test_the_owner_may_release_the_disk_before_the_relaunch(sched):  # noqa: F811
    """``lifecycle.on_preemption_disk: release``: terminated first, as the owner asked."""
    app = sched(US)
    sandbox = app.provider("sandbox")
    calls = counting(app)
    m, _ = preempted_with_a_file(app, lifecycle={"on_preemption_disk": "release"})
    calls.clear()  # the first launch
    sandbox.inject(capacity=dict.fromkeys(ZONES, 0))
    [failed] = recover.run(app).actions
    assert not failed.done
    assert calls == [("terminate", m.instance_id)]
    assert row(app, m.id).status == "terminated"


def test_a_bad_disk_setting_is_one_line_with_file_line_and_field(home, tmp_path):
    data = sandbox_experiment("spot")
    data["lifecycle"] = {"on_preemption": "relaunch", "on_preemption_disk": "drop"}
    path = write_yaml(tmp_path / "exp.yaml", data)
    r = run_cli("--config", str(write_settings(home)), "plan", str(path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    [line] = [x for x in r.stderr.splitlines() if "on_preemption_disk" in x]
    assert f"{path}:" in line and "lifecycle.on_preemption_disk" in line
    assert "'drop' is not one of keep, release" in line


# --- the cloud deleted the preempted machine: a new one with its volumes, 6 of 6 --------------


def _delete_terminated(app: App, m: Machine) -> None:
    """Ended by the cloud, still listed as terminated; its volume let go (as clouds do)."""
    app.provider("sandbox").terminate(machines.ref(m))


def _delete_gone(app: App, m: Machine) -> None:
    """Gone from the cloud's lists altogether (NotFound), its volume still showing it."""
    with app.provider("sandbox")._db() as db:
        db.execute("DELETE FROM machines WHERE id = ?", (m.instance_id,))


def _before_the_pass(app: App, m: Machine, delete: Callable[..., None], monkeypatch: Any) -> None:
    delete(app, m)


def _after_the_look(app: App, m: Machine, delete: Callable[..., None], monkeypatch: Any) -> None:
    """The cloud answers the look (still there, stopped), then deletes it before the start."""
    sandbox = app.provider("sandbox")
    real_get = sandbox.get

    def get(ref: Any) -> Any:
        inst = real_get(ref)
        if ref.id == m.instance_id:
            delete(app, m)
        return inst

    monkeypatch.setattr(sandbox, "get", get)


def _look_fails(app: App, m: Machine, delete: Callable[..., None], monkeypatch: Any) -> None:
    """The look fails for a while (a server error), and the machine is gone meanwhile."""
    sandbox = app.provider("sandbox")
    real_get = sandbox.get

    def get(ref: Any) -> Any:
        if ref.id == m.instance_id:
            delete(app, m)
            raise Throttled("sandbox: 503 Service Unavailable", code="SandboxUnavailable")
        return real_get(ref)

    monkeypatch.setattr(sandbox, "get", get)


@pytest.mark.parametrize("delete", [_delete_terminated, _delete_gone], ids=["ended", "gone"])
@pytest.mark.parametrize(
    "when", [_before_the_pass, _after_the_look, _look_fails], ids=["before", "look", "failed-look"]
)
def test_a_preempted_machine_the_cloud_deleted_comes_back_with_its_volume(
    sched,  # noqa: F811
    monkeypatch,
    when,
    delete,
):
    app = sched(US)
    m, _ = preempted_with_a_file(app, volumes=[CKPT])
    when(app, m, delete, monkeypatch)

    [done] = recover.run(app).actions
    monkeypatch.undo()
    assert done.done and done.error is None, done
    assert "the cloud no longer has it" in done.why or "gone from sandbox" in done.why
    new = machines.find(app, "spot")
    assert new.id != m.id and new.status == "running" and new.zone == m.zone
    with app.db.session() as s:
        (v,) = volumes.live(s, "demo")
        assert v.attached_machine_id == new.id
    cv = app.provider("sandbox").volumes.get(volumes.vref(v))
    assert cv.attached_to == new.instance_id
    assert row(app, m.id).status == "terminated"
    assert recover.run(app).actions == []  # once


def test_the_disk_billed_while_kept_is_counted_in_preempted(sched):  # noqa: F811
    """While kept, the old machine bills its disk at its disk rate and nothing else."""
    app = sched(US)
    sandbox = app.provider("sandbox")
    m, taken = preempted_with_a_file(app)
    sandbox.inject(capacity=dict.fromkeys(ZONES, 0))
    recover.run(app)
    app.clock.advance(timedelta(hours=3))
    ivs = intervals(app, m.id)
    assert ivs["compute"][-1][1] == taken and ivs["disk"][-1][1] is None
    assert row(app, m.id).disk_rate is not None and row(app, m.id).disk_rate > Decimal(0)
