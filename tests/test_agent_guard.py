"""The machine guards itself (issue #32): the agent's own decisions on its ``guard.json``
(autostop, on_finish, max_lifetime) with an injected clock and fake supervisor job dirs (no
sleeping), its ``stop.json`` and its ``--report``; and once end to end, the real agent as a
subprocess whose job ends: stop.json written, the shutdown command run, once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from provisioner import agent, agent_guard
from provisioner.agent_guard import Guard, job_states, since_from_ssh

T0 = datetime(2026, 12, 7, 10, 0, tzinfo=UTC)
BOOT = "boot-1"
AGENT = Path(agent.__file__)


class Clock:
    def __init__(self, at: datetime = T0) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at.timestamp()

    def tick(self, **delta: float) -> None:
        self.at += timedelta(**delta)


def job(jobs: Path, name: str, *, pid: int = 4242, boot: str = BOOT, code: int | None = None):
    d = jobs / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "pid").write_text(f"{pid}\n")
    (d / "boot").write_text(boot + "\n")
    if code is not None:
        (d / "exit").write_text(f"{code}\n")
    return d


def write_guard(state: Path, jobs: Path, **rules) -> dict:
    doc = {
        "v": 1,
        "machine": "m-1",
        "launched_at": "2026-12-07T10:00:00Z",
        "autostop_s": None,
        "idle": {"gpu_util_below": 10, "gpus_only": False},
        "on_finish": None,
        "max_lifetime_at": None,
        "max_lifetime_action": "stop",
        "jobs_dir": str(jobs),
        **rules,
    }
    state.mkdir(parents=True, exist_ok=True)
    (state / "guard.json").write_text(json.dumps(doc))
    return doc


@pytest.fixture
def machine(tmp_path):
    """(state dir, jobs dir, clock, shutdowns run, alive pids, the guard's maker)."""
    state, jobs, clock = tmp_path / "state", tmp_path / "jobs", Clock()
    shutdowns: list[str] = []
    alive: set[int] = set()

    def make(**kw):
        return Guard(
            str(state),
            shutdown_cmd="poweroff-for-test",
            interval=30,
            now=clock,
            boot=lambda: kw.get("boot", BOOT),
            alive=lambda pid: pid in alive,
            run=lambda cmd: shutdowns.append(cmd) or 0,
            log=lambda msg: None,
        )

    return state, jobs, clock, shutdowns, alive, make


IDLE_GPU = [{"index": 0, "util": 2.0, "mem_used_mb": 100}]
BUSY_GPU = [{"index": 0, "util": 90.0, "mem_used_mb": 30000}]


def stop_doc(state: Path) -> dict:
    return json.loads((state / "stop.json").read_text())


def test_on_finish_stops_the_machine_when_its_job_ends_and_only_then(machine):
    state, jobs, clock, shutdowns, alive, make = machine
    write_guard(state, jobs, on_finish={"job": "run", "action": "stop"})
    job(jobs, "run")
    alive.add(4242)
    g = make()
    for _ in range(3):  # running, GPUs busy or not: nothing
        assert g.tick(IDLE_GPU, None, 0) is None
        clock.tick(seconds=30)
    (jobs / "run" / "exit").write_text("0\n")
    alive.clear()
    doc = g.tick(IDLE_GPU, None, 0)
    assert doc is not None and shutdowns == ["poweroff-for-test"]
    assert stop_doc(state) == doc
    assert (doc["reason"], doc["action"], doc["jobs_ended"]) == ("on-finish", "stop", {})
    assert doc["detail"] == "job run ended" and doc["at"] == "2026-12-07T10:01:30.000Z"
    clock.tick(seconds=30)
    assert g.tick(IDLE_GPU, None, 0) is None and shutdowns == ["poweroff-for-test"]  # once


def test_a_job_that_ended_in_an_earlier_boot_does_not_stop_the_machine_again(machine):
    state, jobs, _clock, shutdowns, _alive, make = machine
    write_guard(state, jobs, on_finish={"job": "run", "action": "terminate"})
    job(jobs, "run", boot="boot-0", code=0)  # stopped by on_finish, then started by hand
    assert make().tick(IDLE_GPU, None, 0) is None and shutdowns == []


def test_the_agent_started_again_in_the_same_boot_does_not_shut_down_twice(machine):
    state, jobs, _clock, shutdowns, _alive, make = machine
    write_guard(state, jobs, on_finish={"job": "run", "action": "stop"})
    job(jobs, "run", code=1)
    assert make().tick(IDLE_GPU, None, 0) is not None
    assert make().tick(IDLE_GPU, None, 0) is None  # systemd restarted it: stop.json says done
    assert shutdowns == ["poweroff-for-test"]
    assert make(boot="boot-2").tick(IDLE_GPU, None, 0) is None  # the old job's end: not again


def test_autostop_needs_the_whole_span_idle_and_a_busy_sample_restarts_it(machine):
    state, jobs, clock, shutdowns, _alive, make = machine
    write_guard(state, jobs, autostop_s=600)
    g = make()
    for _ in range(15):  # 7.5 min idle, then one busy GPU sample
        assert g.tick(IDLE_GPU, None, 0) is None
        clock.tick(seconds=30)
    assert g.tick(BUSY_GPU, None, 0) is None
    clock.tick(seconds=30)
    for _ in range(20):  # the span starts again: 9.5 min of it is not enough
        assert g.tick(IDLE_GPU, None, 0) is None
        clock.tick(seconds=30)
    doc = g.tick(IDLE_GPU, None, 0)
    assert doc is not None and doc["reason"] == "autostop" and doc["action"] == "stop"
    assert doc["detail"] == "idle since 2026-12-07T10:08:00.000Z (600 s allowed)"
    assert shutdowns == ["poweroff-for-test"]


@pytest.mark.parametrize(
    ("what", "gpus", "ssh", "running"),
    [
        ("an SSH session", IDLE_GPU, 1, False),
        ("a running job with idle GPUs", IDLE_GPU, 0, True),
        ("a busy GPU", BUSY_GPU, 0, False),
        ("SSH not readable", IDLE_GPU, None, False),
        ("a GPU read without its utilisation", [{"index": 0, "util": None}], 0, False),
    ],
)
def test_a_machine_in_use_is_never_autostopped(machine, what, gpus, ssh, running):
    state, jobs, clock, shutdowns, alive, make = machine
    write_guard(state, jobs, autostop_s=60)
    if running:
        job(jobs, "exec-1", pid=7)
        alive.add(7)
    g = make()
    for _ in range(10):
        assert g.tick(gpus, None, ssh) is None, what
        clock.tick(seconds=30)
    assert shutdowns == []


def test_gpus_only_stops_a_machine_whose_job_idles_and_names_the_job_it_ends(machine):
    state, jobs, clock, _shutdowns, alive, make = machine
    write_guard(state, jobs, autostop_s=60, idle={"gpu_util_below": 10, "gpus_only": True})
    job(jobs, "run", pid=7)
    alive.add(7)
    g = make()
    assert g.tick(IDLE_GPU, None, 2) is None
    clock.tick(seconds=60)
    doc = g.tick(IDLE_GPU, None, 2)
    assert doc is not None and doc["jobs_ended"] == {"run": "killed by the autostop stop"}
    assert stop_doc(state)["jobs_ended"] == {"run": "killed by the autostop stop"}


def test_gpus_only_without_a_gpu_reading_is_not_idle(machine):
    state, jobs, clock, shutdowns, _alive, make = machine
    write_guard(state, jobs, autostop_s=60, idle={"gpu_util_below": 10, "gpus_only": True})
    g = make()
    for _ in range(5):
        assert g.tick([], "no gpu: NVMLError", 0) is None
        clock.tick(seconds=60)
    assert shutdowns == []


def test_no_gpu_counts_jobs_and_ssh_only(machine):
    state, jobs, clock, _shutdowns, _alive, make = machine
    write_guard(state, jobs, autostop_s=60)
    g = make()
    g.tick([], "no gpu", 0)
    clock.tick(seconds=60)
    assert g.tick([], "no gpu", 0)["reason"] == "autostop"


def test_max_lifetime_acts_even_on_a_running_job_and_records_it(machine):
    state, jobs, clock, _shutdowns, alive, make = machine
    write_guard(
        state,
        jobs,
        max_lifetime_at="2026-12-07T12:00:00Z",
        max_lifetime_action="terminate",
        on_finish={"job": "run", "action": "stop"},
    )
    job(jobs, "run", pid=7)
    alive.add(7)
    g = make()
    clock.tick(hours=1, minutes=59, seconds=59)
    assert g.tick(BUSY_GPU, None, 1) is None
    clock.tick(seconds=1)
    doc = g.tick(BUSY_GPU, None, 1)
    assert doc is not None
    assert (doc["reason"], doc["action"]) == ("max-lifetime", "terminate")
    assert doc["jobs_ended"] == {"run": "killed by the max-lifetime stop"}
    assert doc["detail"] == "max lifetime reached at 2026-12-07T12:00:00.000Z"


def test_without_a_guard_the_agent_only_keeps_samples(machine):
    state, _jobs, clock, _shutdowns, _alive, make = machine
    g = make()
    for _ in range(3):
        assert g.tick(IDLE_GPU, None, 0) is None
        clock.tick(seconds=30)
    lines = (state / "samples.jsonl").read_text().splitlines()
    assert [json.loads(x)["at"] for x in lines] == [
        "2026-12-07T10:00:00.000Z",
        "2026-12-07T10:00:30.000Z",
        "2026-12-07T10:01:00.000Z",
    ]
    assert json.loads(lines[0]) == {
        "at": "2026-12-07T10:00:00.000Z",
        "gpus": [{"index": 0, "util": 2.0, "mem_used_mb": 100}],
        "gpu_error": None,
        "ssh": 0,
        "jobs_running": [],
    }
    assert oct(os.stat(state).st_mode & 0o777) == "0o755"
    assert oct(os.stat(state / "samples.jsonl").st_mode & 0o777) == "0o644"


def test_samples_stay_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(agent_guard, "KEEP_SECONDS", 300)  # 10 samples at 30 s
    clock = Clock()
    g = Guard(str(tmp_path), interval=30, now=clock, boot=lambda: BOOT, log=lambda m: None)
    for _ in range(100):
        g.tick([], "no gpu", 0)
        clock.tick(seconds=30)
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert 10 <= len(lines) <= 12
    assert json.loads(lines[-1])["at"] == "2026-12-07T10:49:30.000Z"  # the newest kept


def test_job_states_read_the_supervisors_files(tmp_path):
    jobs = tmp_path / "jobs"
    job(jobs, "run", pid=1, code=0)
    job(jobs, "exec-1", pid=2)
    job(jobs, "exec-2", pid=3, boot="boot-0")  # its boot is gone: lost
    job(jobs, "exec-3", pid=4)  # not alive: lost
    (jobs / "notstarted").mkdir()
    states = job_states(str(jobs), BOOT, alive=lambda pid: pid in (2, 3))
    assert states == {"run": "exit 0", "exec-1": "running", "exec-2": "lost", "exec-3": "lost"}
    assert job_states(str(tmp_path / "none"), BOOT) == {}


def test_the_report_gives_samples_since_jobs_guard_and_stop(machine, monkeypatch):
    state, jobs, clock, _shutdowns, _alive, make = machine
    guard = write_guard(state, jobs, on_finish={"job": "run", "action": "stop"})
    job(jobs, "run", code=0)
    g = make()
    g.tick(IDLE_GPU, None, 0)
    clock.tick(seconds=30)
    g.tick(IDLE_GPU, None, 0)
    doc = agent_guard.report(
        str(state),
        since=agent_guard.parse_iso("2026-12-07T10:00:00Z"),
        now=clock,
        boot=lambda: BOOT,
    )
    assert doc["v"] == 1 and doc["machine"] == "m-1" and doc["boot"] == BOOT
    assert [s["at"] for s in doc["samples"]] == ["2026-12-07T10:00:30.000Z"]
    assert doc["jobs"] == {"run": "exit 0"} and doc["guard"] == guard
    assert doc["stop"]["reason"] == "on-finish"


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (None, (True, None)),
        ("", (True, None)),
        ("--report", (True, None)),
        ("provisioner-agent --report", (True, None)),
        (
            "/usr/local/bin/provisioner-agent --report --since 2026-12-07T10:00:00.500Z",
            (True, "2026-12-07T10:00:00.500Z"),
        ),
        ("--report --since yesterday", (False, None)),
        ("--report; rm -rf /", (False, None)),
        ("cat /etc/provisioner/agent-token", (False, None)),
        ("--report --state-dir /tmp", (False, None)),
    ],
)
def test_the_pull_key_may_ask_only_for_the_report(command, expected):
    assert since_from_ssh(command) == expected


def run_agent(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(AGENT), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        cwd="/",  # not the checkout: the file must run on its own
        **kw,
    )


def test_report_from_ssh_refuses_any_other_command(tmp_path):
    done = run_agent(
        "--report", "--state-dir", str(tmp_path), env={"SSH_ORIGINAL_COMMAND": "sh -c id"}
    )
    assert done.returncode == 2 and "only `--report [--since ISO]`" in done.stderr
    done = run_agent("--report", "--state-dir", str(tmp_path))
    assert done.returncode == 0
    doc = json.loads(done.stdout)
    assert doc["samples"] == [] and doc["guard"] is None and doc["stop"] is None


def test_the_real_agent_stops_its_machine_when_the_job_ends(tmp_path):
    """End to end: the agent file run as on a machine (no endpoint), a job that ends, a shutdown
    command that writes a file: stop.json first, then the command, once."""
    state, jobs = tmp_path / "state", tmp_path / "jobs"
    write_guard(state, jobs, on_finish={"job": "run", "action": "stop"})
    boot = tmp_path / "boot_id"
    boot.write_text(BOOT)
    sleeper = subprocess.Popen(["sleep", "600"])
    job(jobs, "run", pid=sleeper.pid)
    marker = tmp_path / "shut-down"
    cmd = f"echo down >> {marker}"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(AGENT),
            "--state-dir",
            str(state),
            "--interval",
            "0.05",
            "--shutdown-cmd",
            cmd,
            "--boot-file",
            str(boot),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (state / "samples.jsonl").exists():
            time.sleep(0.05)
        assert not marker.exists()
        sleeper.kill()
        sleeper.wait()
        (jobs / "run" / "exit").write_text("137\n")
        while time.monotonic() < deadline and not marker.exists():
            time.sleep(0.05)
        time.sleep(0.3)  # a few more ticks: it must not run the command again
        assert marker.read_text() == "down\n"
        stop = json.loads((state / "stop.json").read_text())
        assert stop["reason"] == "on-finish" and stop["jobs_ended"] == {}
        report = json.loads(run_agent("--report", "--state-dir", str(state)).stdout)
        assert report["stop"] == stop and report["jobs"] == {"run": "exit 137"}
        assert any(s["jobs_running"] == ["run"] for s in report["samples"])
    finally:
        proc.kill()
        proc.wait()
        sleeper.kill()
        sleeper.wait()


def test_the_owners_later_autostop_overrides_the_launch_one(machine):
    """`provisioner autostop NAME --cancel` writes ~/.provisioner/autostop.json over SSH: a
    cancelled autostop never stops the machine; a new one applies at the next tick."""
    state, jobs, clock, shutdowns, _alive, make = machine
    write_guard(state, jobs, autostop_s=60)
    told = jobs.parent / "autostop.json"
    jobs.mkdir(parents=True)
    told.write_text('{"autostop_s": null}')
    g = make()
    for _ in range(5):
        assert g.tick(IDLE_GPU, None, 0) is None
        clock.tick(seconds=60)
    told.write_text('{"autostop_s": 120}')
    clock.tick(seconds=60)
    assert g.tick(IDLE_GPU, None, 0)["detail"].endswith("(120 s allowed)")
    assert shutdowns == ["poweroff-for-test"]
    for bad in ('{"autostop_s": "1h"}', '{"autostop_s": -5}', "not json"):
        told.write_text(bad)  # a bad file is no override
        assert agent_guard.effective({"autostop_s": 60, "jobs_dir": str(jobs)})["autostop_s"] == 60
