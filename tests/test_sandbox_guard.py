"""The sandbox runs the guard a cloud machine runs: each machine its own agent process
(``provisioner/agent.py``), so a detached job's machine stops by itself once the job ends, with
no provisioner command run, and the next look records why and closes the ledger at the
machine's own stop."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from providers.base import InstanceRef, MachineState
from providers.sandbox.adapter import SandboxProvider
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.models import UsageInterval
from tests.conftest import (
    ROOT,
    TEST_START,
    make_settings,
    run_cli,
    sandbox_experiment,
    write_settings,
    write_yaml,
)
from tests.contract.harness import t4_request

AGENT = ROOT / "provisioner" / "agent.py"
STANDIN = ROOT / "tests" / "guard_standin.py"
DEADLINE_S = 120  # generous: the guard acts within its interval; nothing here measures speed


def agent_path() -> str | None:
    """None (the real agent) once it keeps a state dir; until then the stand-in
    ($PROVISIONER_TEST_AGENT: another agent file, e.g. a branch's, to try this against)."""
    if os.environ.get("PROVISIONER_TEST_AGENT"):
        return os.environ["PROVISIONER_TEST_AGENT"]
    said = subprocess.run([sys.executable, str(AGENT), "--help"], capture_output=True, text=True)
    return None if "--state-dir" in said.stdout else str(STANDIN)


@pytest.fixture
def guarded(home: Path):
    """Settings whose sandbox machines run their agent, every second; every agent left is
    ended at the end (a machine still running is stopped: its agent with it)."""
    sandbox = {"agent": True, "agent_interval_seconds": 1}
    if (path := agent_path()) is not None:
        sandbox["agent_path"] = path
    cfg = write_settings(home, sandbox=sandbox)
    provider = SandboxProvider({"db_path": str(home / "sandbox.db"), **sandbox})
    yield cfg, provider
    for i in provider.list_managed():
        if i.state is MachineState.RUNNING:
            provider.stop(i.ref)
    provider.close()


def _wait_halted(provider: SandboxProvider, instance_id: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while provider.get(InstanceRef(instance_id, "")).state is MachineState.RUNNING:
        assert time.monotonic() < deadline, "the machine's guard never stopped it"
        time.sleep(0.5)


@pytest.mark.slow  # a CLI run end to end, and a machine's agent acting on its own
def test_a_detached_jobs_machine_stops_itself_and_status_says_why(home, tmp_path, guarded):
    cfg, provider = guarded
    spec = sandbox_experiment("solo", market="reserved")
    spec["run"] = "sleep 2; echo trained"
    path = write_yaml(tmp_path / "solo.yaml", spec)
    up = run_cli("--config", str(cfg), "up", str(path), "--detach")
    assert up.returncode == 0 and "job run started" in up.stdout, up.stderr

    [inst] = provider.list_managed()
    _wait_halted(provider, inst.id)  # no provisioner command in between
    halted = provider.get(inst.ref)
    assert halted.state is MachineState.STOPPED and halted.state_reason == "guest-shutdown"
    report = json.loads(provider.machine_report(inst.ref) or b"null")
    assert report["stop"]["reason"] == "on-finish" and report["jobs"]["run"] == "exit 0"
    guard_at = datetime.fromisoformat(report["stop"]["at"])
    # the stop in the sandbox's time: just after the guard decided, on the clock `up` ran on
    assert guard_at <= halted.stopped_at < guard_at + timedelta(seconds=30)
    assert TEST_START <= halted.stopped_at < TEST_START + timedelta(minutes=10)

    later = TEST_START + timedelta(hours=1)
    st = run_cli("--config", str(cfg), "status", "solo", "-o", "json", now=later)
    assert st.returncode == 0, st.stderr
    detail = json.loads(st.stdout)
    assert detail["status"] == "stopped"
    [stopped] = [e for e in detail["events"] if e["event"] == "stopped"]
    assert stopped["reason"] == "on-finish"
    assert datetime.fromisoformat(stopped["at"]) == halted.stopped_at
    assert [(j["job"], j["exit_code"]) for j in detail["jobs"]] == [("run", 0)]
    app = App(make_settings(home), ManualClock(later))
    try:
        with app.db.session() as s:
            compute = s.scalars(
                select(UsageInterval).where(
                    UsageInterval.machine_id == detail["id"], UsageInterval.kind == "compute"
                )
            ).all()
    finally:
        app.close()
    # compute billed from the launch to the guard's instant, not to the look an hour later
    assert [u.ended_at for u in compute] == [halted.stopped_at]


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in status


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not _gone(pid):
        assert time.monotonic() < deadline, f"agent {pid} still runs"
        time.sleep(0.2)


def test_a_machine_stopped_or_gone_leaves_no_agent_behind(guarded):
    """A stop through the API ends the machine's agent with it; a machine that disappears with
    no hook seeing it (its row deleted) ends its agent within the keeper's poll."""
    _, provider = guarded
    guard_request = {"v": 1, "machine": "m-1", "on_finish": None, "autostop_s": None}
    request = t4_request("1", ("sandbox-us", "sandbox-us-1a"), "sbx-t4-1", False)
    first = provider.launch(dataclasses.replace(request, guard=guard_request))
    home = provider.machine_dir(first.id)
    pid = int((home / "agent.pid").read_text())
    assert not _gone(pid)
    provider.stop(first.ref)
    _wait_gone(pid)

    provider.start(first.ref)  # a new run: a new agent
    again = int((home / "agent.pid").read_text())
    assert again != pid and not _gone(again)
    with sqlite3.connect(provider.db_path) as db:
        db.execute("DELETE FROM machines WHERE id = ?", (first.id,))
    _wait_gone(again)
