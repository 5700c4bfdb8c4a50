"""Crash safety: the process is killed (SIGKILL) at each step of a sweep and of a recovery; the
next run converges — one machine per intent, no orphan, every usage interval closed once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from provisioner import machines
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.models import Machine, UsageInterval
from provisioner.spec import Experiment
from tests.conftest import ROOT, make_settings, sandbox_experiment, write_settings, write_yaml

pytestmark = pytest.mark.slow  # real processes killed at each step

T0 = datetime(2026, 11, 2, 9, 0, tzinfo=UTC)

DRIVER = """
import importlib, json, sys
from datetime import datetime
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.settings import load_settings

app = App(load_settings(sys.argv[1]), ManualClock(datetime.fromisoformat(sys.argv[2])))
job = importlib.import_module(f"provisioner.jobs.{sys.argv[3]}")
print(json.dumps(job.run(app).as_json(), default=str))
"""


def run_job(cfg, job: str, at: datetime, crash: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"PROVISIONER_CRASH_AT": crash} if crash else {})}
    env.pop("PROVISIONER_CRASH_AT", None) if not crash else None
    return subprocess.run(
        [sys.executable, "-c", DRIVER, str(cfg), at.isoformat(), job],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


@pytest.fixture
def world(home, tmp_path, db_url):
    policy = write_yaml(
        tmp_path / "idle.yaml",
        {
            "name": "always-idle-stop",
            "applies_to": {"projects": ["*"]},
            "idle": {
                "gpu_util_below": 10,
                "for_minutes": 10,
                "unknown_counts_as_idle": True,
                "action": "stop",
            },
        },
    )
    cfg = write_settings(home, state_url=db_url, policies=[str(policy)])
    settings = make_settings(home, state_url=db_url, policies=[str(policy)])
    return cfg, settings


def consistent(settings, name: str) -> tuple[Machine, list]:
    """One live machine of this name, the cloud agrees, no orphan, no dangling interval."""
    app = App(settings, ManualClock(T0))
    try:
        with app.db.session() as s:
            live = list(
                s.scalars(
                    select(Machine).where(
                        Machine.name == name, Machine.status.not_in(("terminated", "failed"))
                    )
                )
            )
            ivs = list(s.scalars(select(UsageInterval)))
            dead = {m.id for m in s.scalars(select(Machine).where(Machine.status == "terminated"))}
        assert len(live) == 1, [(m.id, m.status) for m in live]
        sandbox = app.provider("sandbox")
        ours = [i for i in sandbox.list_managed() if i.state.value != "terminated"]
        assert [i.id for i in ours] == [live[0].instance_id]
        found, _ = machines.orphans(app, ["sandbox"])
        assert found == []
        assert not [iv for iv in ivs if iv.machine_id in dead and iv.ended_at is None]
        for kind in ("compute", "disk"):  # never two open intervals of one kind
            open_ = [
                iv
                for iv in ivs
                if iv.machine_id == live[0].id and iv.kind == kind and iv.ended_at is None
            ]
            assert len(open_) <= 1
        return live[0], ivs
    finally:
        app.close()


@pytest.mark.parametrize("point", ["after-stop", None])
def test_sweep_killed_after_the_cloud_stopped_converges(world, point):
    cfg, settings = world
    app = App(settings, ManualClock(T0))
    machines.up(app, Experiment.model_validate(sandbox_experiment("sleepy")))
    app.close()
    at = T0 + timedelta(hours=1)
    first = run_job(cfg, "sweep", at, crash=point)
    assert first.returncode == (-9 if point else 0), first.stderr
    rerun = run_job(cfg, "sweep", at + timedelta(minutes=5))
    assert rerun.returncode == 0, rerun.stderr
    m, ivs = consistent(settings, "sleepy")
    assert m.status == "stopped"
    compute = [iv for iv in ivs if iv.machine_id == m.id and iv.kind == "compute"]
    assert len(compute) == 1 and compute[0].ended_at is not None


@pytest.mark.parametrize(
    "point", ["recover-after-down", "after-intent", "before-launch", "after-launch", None]
)
def test_recovery_killed_at_each_step_converges(world, point):
    cfg, settings = world
    app = App(settings, ManualClock(T0))
    first = machines.up(app, Experiment.model_validate(sandbox_experiment("spotty"))).machine
    app.provider("sandbox").preempt(machines.ref(first))
    machines.reconcile(app)
    app.provider("sandbox").terminate(machines.ref(first))  # not kept: a new machine
    app.close()
    at = T0 + timedelta(minutes=3)  # before the idle rule could act on the new machine
    r = run_job(cfg, "recover", at, crash=point)
    assert r.returncode == (-9 if point else 0), r.stderr
    rerun = run_job(cfg, "recover", at + timedelta(minutes=1))
    assert rerun.returncode == 0, rerun.stderr
    m, _ = consistent(settings, "spotty")
    assert m.status == "running" and m.id != first.id
    again = json.loads(run_job(cfg, "recover", at + timedelta(minutes=2)).stdout)
    assert not [a for a in again["actions"] if a.get("done")]  # nothing left to do


@pytest.mark.parametrize("point", ["after-start", None])
def test_a_start_in_place_killed_after_the_cloud_started_converges(world, point):
    cfg, settings = world
    app = App(settings, ManualClock(T0))
    first = machines.up(app, Experiment.model_validate(sandbox_experiment("spotty"))).machine
    app.provider("sandbox").preempt(machines.ref(first))  # kept stopped, with its disk
    machines.reconcile(app)
    app.close()
    at = T0 + timedelta(minutes=3)
    r = run_job(cfg, "recover", at, crash=point)
    assert r.returncode == (-9 if point else 0), r.stderr
    rerun = run_job(cfg, "recover", at + timedelta(minutes=1))
    assert rerun.returncode == 0, rerun.stderr
    m, ivs = consistent(settings, "spotty")
    assert (m.id, m.status) == (first.id, "running")  # the same machine, started once
    compute = [iv for iv in ivs if iv.kind == "compute"]
    assert len(compute) == 2 and compute[0].ended_at == T0  # stopped when the cloud took it
    again = json.loads(run_job(cfg, "recover", at + timedelta(minutes=2)).stdout)
    assert not [a for a in again["actions"] if a.get("done")]  # nothing left to do
