"""`provisioner selftest --cloud C` (issue #32, point 9): one small real run checks the agent, a
volume, a job's end, the machine's own stop and the billing tag, removes all it made — also
when it is interrupted or killed — and says what it cost. Run here on the sandbox, whose
machines run the same agent and guard as a cloud machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from provisioner.app import App
from provisioner.clock import CLOCK_ENV
from provisioner.schema import MachineStatus as S
from tests.conftest import ROOT, TEST_START, make_settings, run_cli, write_settings

pytestmark = pytest.mark.slow  # a real job on the sandbox and its guard, a minute at most

#: the sandbox's machines run their own agent (off in most tests), every second
GUARDED = {"agent": True, "agent_interval_seconds": 1}


def _live(home: Path) -> tuple[list[str], list[str]]:
    """What the sandbox still has: instances that are not terminated, volumes not deleted."""
    app = App(make_settings(home, sandbox=GUARDED))
    try:
        provider = app.provider("sandbox")
        inst = [i.id for i in provider.list_managed() if i.state != "terminated"]
        vols = [v.id for v in provider.volumes.ours()]
        return inst, vols
    finally:
        app.close()


def _popen(settings: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "provisioner", "--config", str(settings), "selftest", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, CLOCK_ENV: TEST_START.isoformat()},
        cwd=ROOT,
    )


def _until_said(proc: subprocess.Popen[str], words: str) -> list[str]:
    """Lines of stderr until one holds ``words`` (the run is real: it takes its own time)."""
    seen: list[str] = []
    assert proc.stderr is not None
    for line in proc.stderr:
        seen.append(line)
        if words in line:
            return seen
    pytest.fail(f"never said {words!r}: {''.join(seen)}")


def test_selftest_on_the_sandbox_checks_every_step_and_leaves_nothing(home: Path) -> None:
    settings = write_settings(home, sandbox=GUARDED)
    r = run_cli(
        "--config", str(settings), "selftest", "--cloud", "sandbox", "--job-seconds", "1",
        "--timeout", "3m", "-o", "json", timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    steps = {c["step"]: c for c in out["checks"]}
    assert list(steps) == [
        "leftovers", "credentials", "launch", "reachable", "agent", "job end", "own stop",
        "billing tag", "cleanup",
    ]  # fmt: skip
    assert all(c["ok"] for c in out["checks"]), out["checks"]
    assert "run exited 0" in steps["job end"]["detail"]
    assert "on-finish" in steps["own stop"]["detail"]  # the guard's reason, not ours
    assert out["left"] == []
    assert out["cost"] and all(c["currency"] == "USD" for c in out["cost"])
    assert _live(home) == ([], [])
    status = run_cli("--config", str(settings), "status", "--all", "-o", "json")
    rows = json.loads(status.stdout)
    assert rows and all(row["status"] == S.TERMINATED for row in rows)


def test_selftest_interrupted_removes_what_it_made(home: Path) -> None:
    settings = write_settings(home, sandbox=GUARDED)
    proc = _popen(settings, "--cloud", "sandbox", "--job-seconds", "300")
    _until_said(proc, "reachable")
    assert _live(home)[0], "the machine runs"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert _live(home) == ([], [])


def test_a_killed_selftest_is_cleaned_by_the_next_one(home: Path) -> None:
    settings = write_settings(home, sandbox=GUARDED)
    proc = _popen(settings, "--cloud", "sandbox", "--job-seconds", "300")
    _until_said(proc, "reachable")
    proc.kill()  # no cleanup of its own can run
    proc.wait(timeout=60)
    assert _live(home)[0]
    again = _popen(settings, "--cloud", "sandbox", "--job-seconds", "300")
    lines = _until_said(again, "leftovers")
    again.send_signal(signal.SIGTERM)
    again.communicate(timeout=120)
    assert "removed 1" in lines[-1]
    deadline = time.monotonic() + 60
    while _live(home) != ([], []) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _live(home) == ([], [])


def test_selftest_of_a_cloud_not_enabled_is_one_line(home: Path) -> None:
    settings = write_settings(home, sandbox=GUARDED)
    r = run_cli("--config", str(settings), "selftest", "--cloud", "nimbus")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: selftest: cloud 'nimbus' is not enabled in settings (clouds: sandbox)"
    ]
