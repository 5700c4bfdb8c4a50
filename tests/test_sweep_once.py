"""``provisioner sweep`` is the whole scheduler, once (issue #32, points 4 and 5): the cron pass
sees a detached job's end and acts on its ``on_finish``; a machine with a running job is busy
unless its idle rule says ``gpus_only``; a stop that ends a running job (a GPUs-only idle stop
out of hours, a max lifetime, an exhausted budget) records the job's end with the reason and
tells the owner, and the machine's autostop fires again later."""

from __future__ import annotations

import contextlib
import os
import signal
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from provisioner import machines
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.jobs import cycle, daemon, enforce, outlook, sweep
from provisioner.machines import jobs
from provisioner.models import Delivery, Event, Machine
from provisioner.spec import Experiment
from tests.conftest import (
    TEST_START,
    make_settings,
    sandbox_experiment,
    write_settings,
    write_yaml,
)
from tests.test_scheduler import heartbeats, status

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

NIGHTS = """
name: nights
applies_to: {projects: ["demo"]}
off_hours:
  timezone: Europe/Berlin
  windows: [{days: mon-fri, start: "20:00", end: "08:00"}]
idle: {gpu_util_below: 5, for_minutes: 30, action: stop%s}
"""
FRI_2100 = datetime(2026, 11, 6, 20, 0, tzinfo=UTC)  # Friday 21:00 in Berlin: out of hours
MON_1100 = datetime(2026, 11, 9, 10, 0, tzinfo=UTC)  # Monday 11:00 in Berlin: in hours
OWNERS = {"ana@*": [{"telegram": {"chat_id": 5, "token_env": "TG_TOKEN"}}]}


def end_run(app: App, m: Machine, code: int = 0) -> None:
    """The detached ``run`` exits with ``code`` now (as its process would, written where the
    sandbox machine keeps it), its process gone."""
    job = app.provider("sandbox").machine_dir(m.instance_id or "") / "jobs" / jobs.RUN
    pid = int((job / "pid").read_text())
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    (job / "exit_code").write_text(f"{code}\n")


def up(app: App, name: str, **spec: object) -> Machine:
    data = sandbox_experiment(name, market="reserved")
    data.update(spec)
    return machines.up(app, Experiment.model_validate(data)).machine


def finished(app: App, m: Machine) -> list[Event]:
    with app.db.session() as s:
        return list(
            s.scalars(
                select(Event)
                .where(Event.machine_id == m.id, Event.kind == jobs.FINISHED)
                .order_by(Event.id)
            )
        )


def told(app: App, topic: str = "job-ended") -> list[Delivery]:
    with app.db.session() as s:
        return list(s.scalars(select(Delivery).where(Delivery.topic == topic)))


# ---- one cycle: the daemon's jobs, `sweep` once ------------------------------------------------


def test_the_daemon_and_sweep_run_the_same_steps(home, clock):
    """One list: the daemon schedules each step on its interval, `sweep` runs them all once, in
    the same order (reconcile first: what ended and what the clouds say, before any judgement)."""
    app = App(make_settings(home), clock)
    scheduled = [n for n, _, _ in daemon.schedule(app)]
    assert scheduled == [s.name for s in cycle.STEPS]
    assert scheduled[:4] == ["reconcile", "sweep", "recover", "wait"]
    assert {"budget.enforce", "notify.deliver"} <= set(scheduled)
    app.close()


def test_a_detached_jobs_end_is_acted_on_by_the_next_cron_sweep(home, tmp_path, cli):
    """The measured case: a detached job ended; with only `provisioner sweep` from cron, the
    next pass records its end and its on_finish (stop, the default with a run) ends billing."""
    cfg = write_settings(home)
    app = App(make_settings(home), ManualClock(TEST_START))  # the CLI's clock: TEST_START
    m = up(app, "train", run="sleep 600")
    first = cli("--config", str(cfg), "sweep")
    assert first.code == 0, first.err
    assert status(app, "train") == "running"  # its job runs: nothing to do
    end_run(app, m, 0)
    swept = cli("--config", str(cfg), "sweep")
    assert swept.code == 0, swept.err
    assert "train: stop [on-finish] — run exited 0; on_finish: stop" in swept.out
    assert status(app, "train") == "stopped"
    [end] = finished(app, m)
    assert (end.reason, end.detail["exit_code"]) == ("exited", 0)
    with app.db.session() as s:
        stop = s.scalars(select(Event).where(Event.machine_id == m.id, Event.kind == "stopped"))
        assert [e.reason for e in stop] == ["on-finish"]
    app.close()


def test_a_dry_run_sweep_acts_on_nothing(home, tmp_path, cli):
    """`sweep --dry-run` leaves out what would record or act (reconcile, budgets, notices):
    a job that ended stays unrecorded and its machine runs."""
    cfg = write_settings(home)
    app = App(make_settings(home), ManualClock(TEST_START))
    m = up(app, "train", run="sleep 600")
    end_run(app, m, 0)
    dry = cli("--config", str(cfg), "sweep", "--dry-run")
    assert dry.code == 0, dry.err
    assert "not in a dry run (they record or act): reconcile, budget.enforce" in dry.out
    assert status(app, "train") == "running"
    assert finished(app, m) == []
    app.close()


# ---- a running job is never killed silently -----------------------------------------------------


@pytest.fixture
def nights(home, db_url, tmp_path):
    """make(gpus_only) -> an App at Friday 21:00 Berlin whose policy stops idle machines out of
    hours, the owner's channel in settings."""
    apps: list[App] = []

    def make(extra: str = "") -> App:
        path = tmp_path / "nights.yaml"
        path.write_text(NIGHTS % extra)
        app = App(
            make_settings(home, state_url=db_url, policies=[str(path)], notify={"owners": OWNERS}),
            ManualClock(FRI_2100 - timedelta(hours=3)),
        )
        apps.append(app)
        return app

    yield make
    for a in apps:
        a.close()


def test_a_running_job_keeps_its_machine_out_of_hours_by_default(nights):
    app = nights()
    m = up(app, "train", run="sleep 600")
    app.clock.set(FRI_2100)
    heartbeats(app, m, 1.0, 60)  # its GPUs idle for an hour: the job waits on I/O, say
    p = sweep.run(app)
    assert [a.action for a in p.actions] == []
    assert status(app, "train") == "running"
    [why] = outlook.outlook(app, [machines.find(app, "train")]).values()
    assert "job run running: busy (nights)" in why
    assert jobs.jobs_of(app, m)[jobs.RUN].running


def test_gpus_only_stops_it_records_the_jobs_end_tells_the_owner_and_autostop_fires_later(nights):
    app = nights(", gpus_only: true")
    m = up(app, "train", run="sleep 600", lifecycle={"autostop": "30m"})
    app.clock.set(FRI_2100)
    heartbeats(app, m, 1.0, 60)
    [stop] = sweep.run(app).actions
    assert (stop.action, stop.reason, stop.done) == ("stop", "off-hours-idle", True)
    assert "job run running ends with it (gpus_only)" in stop.why
    assert status(app, "train") == "stopped"
    [end] = finished(app, m)
    assert end.at == FRI_2100 and end.reason == "killed"
    assert end.detail["job"] == jobs.RUN and end.detail["exit_code"] is None
    assert end.detail["ended_by"] == "off-hours-idle" and "gpus_only" in end.detail["why"]
    assert not jobs.jobs_of(app, m)[jobs.RUN].running  # no longer counted as running
    [notice] = told(app)
    assert notice.subject == "train: job run ended: the machine was stopped (off-hours-idle)"
    assert notice.kind == "telegram" and notice.machine == "train"
    # Monday: started again by hand, idle for its autostop in hours — it fires
    app.clock.set(MON_1100)
    machines.start(app, "train")
    app.clock.set(MON_1100 + timedelta(minutes=40))
    heartbeats(app, m, 1.0, 40, every=1)
    [auto] = sweep.run(app).actions
    assert (auto.action, auto.reason, auto.done) == ("stop", "autostop", True)


def test_max_lifetime_ends_a_running_job_on_the_record(nights):
    app = nights()
    m = up(app, "train", run="sleep 600", lifecycle={"max_lifetime": "2h"})
    app.clock.advance(timedelta(hours=2, minutes=5))  # 2 h 5 min after its launch
    [stop] = sweep.run(app).actions
    assert (stop.action, stop.reason, stop.done) == ("stop", "max-lifetime", True)
    [end] = finished(app, m)
    assert (end.reason, end.detail["ended_by"]) == ("killed", "max-lifetime")
    [notice] = told(app)
    assert "max-lifetime" in notice.subject and "max lifetime 2 h" in notice.text


def test_an_exhausted_budget_ends_a_running_job_on_the_record(home, db_url, tmp_path, clock):
    policy = {
        "name": "demo-budget",
        "applies_to": {"projects": ["demo"]},
        "budget": {"amount": "1 USD", "alerts": {"actual": [100]}, "on_exhausted": "stop"},
    }
    folder = tmp_path / "policies"
    folder.mkdir()
    app = App(
        make_settings(home, state_url=db_url, policies=[str(folder)], notify={"owners": OWNERS}),
        clock,
    )
    m = up(app, "train", run="sleep 600", resources=sandbox_experiment()["resources"])
    write_yaml(folder / "b.yaml", policy)  # the budget lowered after the launch
    app.__dict__.pop("policies", None)  # an App reads its policies once
    clock.advance(timedelta(hours=10))  # about 1.57 USD: over
    stops = [a for a in enforce.run(app, clock.now()) if a.kind == "stop"]
    assert [(a.machine, a.error) for a in stops] == [("train", None)]
    [end] = finished(app, m)
    assert (end.reason, end.detail["ended_by"]) == ("killed", "budget")
    assert "budget exhausted" in end.detail["why"]
    [notice] = told(app)
    assert notice.subject == "train: job run ended: the machine was stopped (budget)"
    app.close()


def test_gpus_only_is_read_from_the_policy_file_and_bad_values_are_refused(home, tmp_path, cli):
    path = tmp_path / "nights.yaml"
    path.write_text(NIGHTS % ", gpus_only: sometimes")
    cfg = write_settings(home, policies=[str(path)])
    r = cli("--config", str(cfg), "sweep")
    assert r.code == 2
    assert f"{path}:7:" in r.err and "idle.gpus_only" in r.err
    assert "Traceback" not in r.err
