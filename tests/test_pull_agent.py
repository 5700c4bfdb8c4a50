"""The two ends of the pull agree (issue #32, point 3): what the machine's own agent keeps and
prints for ``--report`` (the real ``provisioner/agent.py``, run as its forced command runs it,
the ``--since`` it is sent in ``SSH_ORIGINAL_COMMAND``) is what the scheduler's reader accepts,
sample for sample; a command of any other form is refused by the agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from provisioner.agent_guard import Guard
from provisioner.clock import CLOCK_ENV
from provisioner.machines import pull

AGENT = Path(__file__).resolve().parents[1] / "provisioner" / "agent.py"
T0 = datetime(2026, 11, 2, 21, 0, tzinfo=UTC)


def _report(state: Path, asked: str, now: datetime) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, CLOCK_ENV: now.isoformat(), "SSH_ORIGINAL_COMMAND": asked}
    return subprocess.run(
        [sys.executable, str(AGENT), "--report", "--state-dir", str(state)],
        capture_output=True,
        env=env,
        timeout=60,
    )


def test_the_agents_report_is_what_the_pull_reads(tmp_path: Path) -> None:
    state = tmp_path / "agent"
    guard = {"v": 1, "machine": "m-1", "launched_at": T0.isoformat(), "autostop_s": None}
    state.mkdir()
    (state / "guard.json").write_text(json.dumps(guard))
    ticks = iter(T0 + timedelta(seconds=30 * i) for i in range(10))
    g = Guard(str(state), interval=30, now=lambda: next(ticks).timestamp(), run=lambda _: 0)
    for util in (3, 4, 2, 80, 1, 0):
        g.tick([{"index": 0, "util": util, "mem_used_mb": 100}], None, 0)
    now = T0 + timedelta(minutes=5)
    since = T0 + timedelta(seconds=60)  # the pull holds the first three samples
    r = _report(state, f"--report --since {pull.since_text(since)}", now)
    assert r.returncode == 0, r.stderr
    report = pull.parse_report(r.stdout, "m-1", now)
    assert [s.at for s in report.samples] == [T0 + timedelta(seconds=30 * i) for i in (3, 4, 5)]
    assert [s.gpus[0]["util"] for s in report.samples] == [80, 1, 0]


def test_the_agent_refuses_any_other_command_of_the_pull_key(tmp_path: Path) -> None:
    state = tmp_path / "agent"
    state.mkdir()
    for asked in ("id", "--report; id", "--since 2026-11-02T21:00:00Z", "--report --since x"):
        r = _report(state, asked, T0)
        assert r.returncode == 2, asked
        assert r.stdout == b""
