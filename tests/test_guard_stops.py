"""Reconcile reads why a machine stopped itself: its guard's ``stop.json`` (in the report the
machine's agent prints) names the rule (autostop, on-finish, max-lifetime) and the jobs the stop
ended; without one, the stop is "from inside or outside, no reason known". Either way the
ledger closes at the cloud's own stop time."""

from __future__ import annotations

import json
from datetime import timedelta

from sqlalchemy import select

from providers.base import InstanceRef
from providers.sandbox import guard
from provisioner import machines
from provisioner.machines import guard_stops, jobs
from provisioner.models import Event, UsageInterval
from provisioner.spec import Experiment
from tests.conftest import sandbox_experiment


def _report(stop: dict | None, jobs_: dict | None = None) -> dict:
    return {"v": 1, "machine": "m", "at": "x", "samples": [], "jobs": jobs_ or {}, "stop": stop}


def test_a_guard_stop_of_this_run_is_explained_with_the_jobs_it_ended(clock):
    at = clock.now()
    stop = {
        "at": at.isoformat(),
        "reason": "max-lifetime",
        "action": "stop",
        "detail": "max lifetime 4h reached",
        "jobs_ended": {"run": "killed by the stop (SIGTERM, then the halt)"},
    }
    got = guard_stops.explain(
        _report(stop, {"run": "running", "exec-1": "exit 0", "exec-2": "lost"}),
        ["run", "exec-1", "exec-2"],
        since=at - timedelta(hours=4),
    )
    assert got.reason == "max-lifetime"
    assert got.detail["guard"]["detail"] == "max lifetime 4h reached"
    assert got.jobs == {
        "run": ("max-lifetime", None),  # the guard's stop ended it, and says so
        "exec-1": ("exited", 0),  # it had ended on its own
        "exec-2": ("killed", None),  # it ended with the machine
    }


def test_no_stop_a_stale_stop_or_a_bad_one_is_no_reason_known(clock):
    now = clock.now()
    stale = {"at": (now - timedelta(days=1)).isoformat(), "reason": "autostop"}
    for report in (
        None,
        _report(None),
        _report(stale),  # a stop of a run before this one
        _report({"at": now.isoformat(), "reason": "because"}),
        _report({"at": "yesterday", "reason": "autostop"}),
    ):
        got = guard_stops.explain(report, ["run"], since=now - timedelta(hours=1))
        assert (got.reason, got.jobs) == ("outside-provisioner", {})
        assert "no reason known" in got.detail["by"]


def test_a_stop_the_guard_said_is_told_from_one_inferred_from_what_is_recorded(app, clock):
    """selftest hears the agent in the first, never in the second: reconcile infers an
    on-finish stop from a recorded run exit with every report of the machine refused."""
    exp = Experiment.model_validate({**sandbox_experiment("guarded"), "run": "true"})
    m = machines.up(app, exp).machine
    machines.record_event(app, m.id, jobs.STARTED, detail={"job": "run", "command": "true"})
    machines.record_event(
        app, m.id, jobs.FINISHED, reason="exited", detail={"job": "run", "exit_code": 0}
    )
    guessed = guard_stops.inferred(app, m)
    assert guessed is not None and guessed.reason == "on-finish"
    assert not guard_stops.said_by_guard(guessed.detail)
    stop = {"at": clock.now().isoformat(), "reason": "on-finish", "action": "stop"}
    said = guard_stops.explain(_report(stop), ["run"], since=None)
    assert said.reason == "on-finish" and guard_stops.said_by_guard(said.detail)


def test_reconcile_records_the_guards_stop_its_ended_job_and_the_clouds_time(
    app, clock, monkeypatch
):
    exp = Experiment.model_validate({**sandbox_experiment("guarded"), "run": "sleep 600"})
    m = machines.up(app, exp).machine
    machines.record_event(app, m.id, jobs.STARTED, detail={"job": "run", "command": "sleep 600"})
    sandbox = app.provider("sandbox")
    clock.advance(timedelta(hours=4))
    halted = clock.now()
    report = _report(
        {
            "at": halted.isoformat(),
            "reason": "max-lifetime",
            "action": "stop",
            "detail": "max lifetime 4h reached",
            "jobs_ended": {"run": "killed by the stop"},
        },
        {"run": "running"},
    )
    monkeypatch.setattr(
        type(sandbox), "machine_report", lambda self, ref, since=None: json.dumps(report).encode()
    )
    guard.halt(sandbox.db_path, m.instance_id, halted)  # the machine's OS shuts down
    clock.advance(timedelta(minutes=7))  # the next pass sees it

    machines.reconcile(app)

    with app.db.session() as s:
        events = s.scalars(select(Event).where(Event.machine_id == m.id)).all()
        compute = s.scalars(
            select(UsageInterval).where(
                UsageInterval.machine_id == m.id, UsageInterval.kind == "compute"
            )
        ).all()
    [stopped] = [e for e in events if e.kind == "stopped"]
    assert (stopped.reason, stopped.at) == ("max-lifetime", halted)
    assert stopped.detail["guard"]["jobs_ended"] == {"run": "killed by the stop"}
    [finished] = [e for e in events if e.kind == jobs.FINISHED]
    assert (finished.reason, finished.at, finished.detail["exit_code"]) == (
        "max-lifetime",
        halted,
        None,
    )
    assert not jobs.jobs_of(app, m)["run"].running  # never counted as running forever
    assert [u.ended_at for u in compute] == [halted]  # the cloud's time, not the look's
    assert sandbox.get(InstanceRef(m.instance_id or "", m.region or "")).stopped_at == halted


def test_a_stop_the_cloud_reads_as_a_preemption_is_the_guards_when_it_says_so(
    app, clock, monkeypatch
):
    """SberCloud records no reason and a Yandex VM down without a stop operation reads as
    preempted: when the machine's guard says it shut the machine down, it is a stop (nothing to
    relaunch), with the guard's reason."""
    m = machines.up(app, Experiment.model_validate(sandbox_experiment("spotty"))).machine
    sandbox = app.provider("sandbox")
    clock.advance(timedelta(hours=1))
    report = _report(
        {"at": clock.now().isoformat(), "reason": "autostop", "action": "stop", "detail": "idle"}
    )
    monkeypatch.setattr(
        type(sandbox), "machine_report", lambda self, ref, since=None: json.dumps(report).encode()
    )
    sandbox.preempt(machines.ref(m))  # what the cloud says: taken back
    clock.advance(timedelta(minutes=5))

    [seen] = machines.reconcile(app)

    assert seen.observed == "stopped"
    with app.db.session() as s:
        [stopped] = s.scalars(
            select(Event).where(Event.machine_id == m.id, Event.kind == "stopped")
        ).all()
        preempted = s.scalars(
            select(Event).where(Event.machine_id == m.id, Event.kind == "preempted")
        ).all()
    assert (stopped.reason, stopped.detail["read_as"]) == ("autostop", "preempted")
    assert preempted == []


def test_without_a_cloud_time_the_guards_own_time_closes_usage(app, clock, monkeypatch):
    """A cloud whose API dates no stop (a regular Yandex VM): the guard's ``stop.json`` time
    closes compute, not the moment reconcile looked."""
    from tests.test_cloud_time import without_cloud_time

    without_cloud_time(monkeypatch)
    m = machines.up(app, Experiment.model_validate(sandbox_experiment("undated"))).machine
    sandbox = app.provider("sandbox")
    clock.advance(timedelta(minutes=40))
    halted = clock.now()
    report = _report({"at": halted.isoformat(), "reason": "autostop", "action": "stop"})
    monkeypatch.setattr(
        type(sandbox), "machine_report", lambda self, ref, since=None: json.dumps(report).encode()
    )
    guard.halt(sandbox.db_path, m.instance_id, halted)
    clock.advance(timedelta(hours=3))

    machines.reconcile(app)

    with app.db.session() as s:
        [stopped] = s.scalars(
            select(Event).where(Event.machine_id == m.id, Event.kind == "stopped")
        ).all()
        [compute] = s.scalars(
            select(UsageInterval).where(
                UsageInterval.machine_id == m.id, UsageInterval.kind == "compute"
            )
        ).all()
    assert (stopped.at, stopped.detail["at_source"], stopped.reason) == (
        halted,
        "guard",
        "autostop",
    )
    assert compute.ended_at == halted
