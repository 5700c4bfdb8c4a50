"""A sandbox machine's own guard: the same agent a cloud machine runs (``provisioner/agent.py``,
started as a process, never imported), and the "OS shutdown" it ends the machine with.

Each machine's directory (``<sandbox db folder>/machines/<id>/``) holds, besides its jobs:

- ``guard.request.json``: the guard its launch asked for (``LaunchRequest.guard``), in the
  sandbox's time; kept, as a cloud machine keeps its startup data, so a start runs it again;
- ``agent/``: the agent's state dir (``guard.json``, ``samples.jsonl``, ``stop.json``);
- ``boot_id``: the current run's boot, which its jobs record (the host's boot is every
  machine's, so each run gets its own, given to the agent as ``--boot-file``);
- ``agent.pid``, ``agent.log``, ``clock.json``: the current run's agent, under a keeper (its
  process group: the keeper, the agent, what the agent runs) that ends it once the machine is
  no longer up in the sandbox's table, however that happened.

Time: the agent reads the wall clock (it runs as it would on a machine), while the sandbox dates
its machines by the application's clock (``PROVISIONER_CLOCK``, a test's clock). So each run
keeps ``shift`` = sandbox time − wall time when it started: the guard's instants are handed to
the agent in wall time, what its report says is read back in sandbox time, and the shutdown
marks the machine stopped at wall time + shift — the sandbox's own instant.

Run as a script, standard library only: ``python guard.py halt --db D --machine ID --shift S``
is the command the agent runs as ``--shutdown-cmd``; ``guard.py keep`` is the keeper. The
machine halts as a guest OS halting does on a cloud whose guest shutdown stops billing (GCP:
TERMINATED): it is ``stopped`` (or
``terminated`` when the guard's stop says so, as EC2's shutdown behaviour ``terminate``), its
jobs and its agent end at that instant, and the cloud's reason says ``guest-shutdown``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

#: the agent every machine runs: provisioner's own file, started by path (providers/ imports
#: nothing from provisioner/); ``SandboxOptions.agent_path`` may name another
AGENT = Path(__file__).resolve().parents[2] / "provisioner" / "agent.py"
GUEST_SHUTDOWN = "guest-shutdown"  # the sandbox's reason for a machine halted from inside
_HALTABLE = ("pending", "running", "stopping")
_TIMES = ("launched_at", "max_lifetime_at")  # the guard's instants


def state_dir(machine_dir: Path) -> Path:
    return machine_dir / "agent"


def _iso(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _moved(value: Any, by: timedelta) -> Any:
    """An ISO instant moved ``by``; anything else as it is."""
    if not isinstance(value, str):
        return value
    try:
        return (_iso(value) + by).astimezone(UTC).isoformat()
    except ValueError:
        return value


def keep_request(machine_dir: Path, guard: Mapping[str, Any]) -> None:
    machine_dir.mkdir(parents=True, exist_ok=True)
    (machine_dir / "guard.request.json").write_text(json.dumps(dict(guard)))


def start(
    machine_dir: Path,
    db_path: Path,
    machine_id: str,
    now: datetime,
    *,
    interval: float,
    agent: Path | None = None,
) -> bool:
    """Start the machine's agent for a new run (launch, start), its guard in wall time; False
    when the launch asked for no guard. A stop of the run before left its ``stop.json``: it is
    kept beside as ``stop.previous.json``, so this run's report shows this run's stop only."""
    request = machine_dir / "guard.request.json"
    if not request.exists():
        return False
    stop(machine_dir)  # one agent per machine, whatever came before
    shift = now - datetime.now(UTC)
    d = state_dir(machine_dir)
    d.mkdir(parents=True, exist_ok=True)
    if (d / "stop.json").exists():
        (d / "stop.json").replace(d / "stop.previous.json")
    # each run its own boot (the host's is every machine's): the agent acts once per boot and
    # tells this run's jobs from an earlier run's by it, as on a machine that booted again
    (machine_dir / "boot_id").write_text(str(uuid.uuid4()) + "\n")
    guard = json.loads(request.read_text())
    for key in _TIMES:
        guard[key] = _moved(guard.get(key), -shift)
    guard["jobs_dir"] = str(machine_dir / "jobs")
    (machine_dir / "jobs").mkdir(exist_ok=True)
    (d / "guard.json").write_text(json.dumps(guard))
    (machine_dir / "clock.json").write_text(json.dumps({"shift_s": shift.total_seconds()}))
    halt = [
        sys.executable,
        str(Path(__file__).resolve()),
        "halt",
        "--db",
        str(db_path.resolve()),
        "--machine",
        machine_id,
        # one word: a negative shift ("-8.7e-05") would read as an option of its own
        f"--shift={shift.total_seconds()!r}",
    ]
    argv = [
        sys.executable,
        str(agent or AGENT),
        "--state-dir",
        str(d),
        "--guard-file",
        str(d / "guard.json"),
        "--shutdown-cmd",
        shlex.join(halt),
        "--interval",
        f"{interval:g}",
        "--boot-file",
        str(machine_dir / "boot_id"),
    ]
    # its "power": a keeper that runs the agent and ends it once the machine is no longer up
    keeper = [sys.executable, str(Path(__file__).resolve()), "keep"]
    keeper += ["--db", str(db_path.resolve()), "--machine", machine_id, "--agent", json.dumps(argv)]
    # the wall clock, as on a machine: a clock of the command that launched it
    # (PROVISIONER_CLOCK) would start over at the agent's start; the shift above is exact
    with (machine_dir / "agent.log").open("ab") as log:
        proc = subprocess.Popen(
            keeper,
            env=_wall_clock_env(),
            cwd=machine_dir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # it outlives the command that launched the machine
        )
    (machine_dir / "agent.pid").write_text(str(proc.pid))
    return True


def _wall_clock_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PROVISIONER_CLOCK"}


def boot_id(machine_dir: Path) -> str:
    """The machine's current boot (its run's), else the host's."""
    for path in (machine_dir / "boot_id", Path("/proc/sys/kernel/random/boot_id")):
        with contextlib.suppress(OSError):
            return path.read_text().strip()
    return "unknown"


def _ours(pid: int, machine_dir: Path) -> bool:
    """Whether ``pid`` is still this machine's agent (not a pid the system reused)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return str(state_dir(machine_dir)).encode() in cmdline


def stop(machine_dir: Path) -> None:
    """End the machine's agent (its keeper's process group: the agent and whatever it runs, the
    halt among them), as the machine's halt ends every process on it."""
    pid_file = machine_dir / "agent.pid"
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return
    pid_file.unlink(missing_ok=True)
    if not _ours(pid, machine_dir):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # reaped when this process started it


def kill_jobs(machine_dir: Path) -> None:
    """Every job of the machine still running: its process group killed, as a halt would."""
    jobs = machine_dir / "jobs"
    for pid_file in jobs.glob("*/pid") if jobs.is_dir() else ():
        if (pid_file.parent / "exit_code").exists():
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)


def shift_of(machine_dir: Path) -> timedelta:
    try:
        return timedelta(
            seconds=float(json.loads((machine_dir / "clock.json").read_text())["shift_s"])
        )
    except (OSError, ValueError, KeyError, TypeError):
        return timedelta(0)


def in_sandbox_time(report: dict[str, Any], shift: timedelta) -> dict[str, Any]:
    """The agent's report with its instants read in the sandbox's time."""
    out = dict(report)
    out["at"] = _moved(report.get("at"), shift)
    out["samples"] = [
        {**s, "at": _moved(s.get("at"), shift)} if isinstance(s, dict) else s
        for s in report.get("samples") or []
    ]
    if isinstance(report.get("stop"), dict):
        out["stop"] = {**report["stop"], "at": _moved(report["stop"].get("at"), shift)}
    if isinstance(report.get("guard"), dict):
        out["guard"] = {
            k: _moved(v, shift) if k in _TIMES else v for k, v in report["guard"].items()
        }
    return out


def report(
    machine_dir: Path, agent: Path | None = None, since: datetime | None = None
) -> bytes | None:
    """``provisioner-agent --report`` for the machine's state dir, in the sandbox's time; None
    when it has no agent's state, or the agent could not say."""
    d = state_dir(machine_dir)
    if not d.is_dir():
        return None
    shift = shift_of(machine_dir)
    argv = [sys.executable, str(agent or AGENT), "--report", "--state-dir", str(d)]
    argv += ["--boot-file", str(machine_dir / "boot_id")]  # the run's boot, as the agent's own
    if since is not None:
        argv += ["--since", (since - shift).astimezone(UTC).isoformat()]
    try:
        done = subprocess.run(
            argv, capture_output=True, timeout=60, stdin=subprocess.DEVNULL, env=_wall_clock_env()
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    try:
        parsed = json.loads(done.stdout)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    return json.dumps(in_sandbox_time(parsed, shift)).encode()


def halt(db_path: Path, machine_id: str, at: datetime) -> str | None:
    """The machine's OS shut down from inside at ``at`` (the sandbox's time): the state it is
    in after, or None when it was not running (a second halt, or the API stopped it first)."""
    machine_dir = db_path.parent / "machines" / machine_id
    action = "stop"
    with contextlib.suppress(OSError, ValueError, AttributeError):
        action = json.loads((state_dir(machine_dir) / "stop.json").read_text()).get("action")
    state = "terminated" if action == "terminate" else "stopped"
    conn = sqlite3.connect(db_path, timeout=30, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        done = conn.execute(
            f"UPDATE machines SET state = ?, reason = ?, stopped_at = ? WHERE id = ?"
            f" AND state IN {_HALTABLE}",
            (state, GUEST_SHUTDOWN, at.astimezone(UTC).isoformat(), machine_id),
        ).rowcount
        if done and state == "terminated":  # a terminated machine's volumes stay, detached
            conn.execute(
                "UPDATE volumes SET state = 'available', attached_to = NULL,"
                " device_index = NULL WHERE attached_to = ?",
                (machine_id,),
            )
        conn.execute("COMMIT")
    finally:
        conn.close()
    if not done:
        return None
    kill_jobs(machine_dir)
    stop(machine_dir)  # last: the halting process is of the agent's group, and ends with it
    return state


def _up(db_path: Path, machine_id: str) -> bool:
    """Whether the machine is still up in the sandbox's table (a look that cannot be made —
    the file busy — counts as up; a file or row gone does not)."""
    if not db_path.exists():
        return False
    try:
        conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
        try:
            row = conn.execute("SELECT state FROM machines WHERE id = ?", (machine_id,)).fetchone()
        finally:
            conn.close()
    except sqlite3.Error:
        return True
    return row is not None and row[0] in _HALTABLE


def keep(db_path: Path, machine_id: str, argv: list[str], poll: float = 5.0) -> int:
    """Run the agent as long as its machine is up: a machine stopped or deleted in a way no
    hook saw (its file removed, another process's crash) leaves no agent behind."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    while proc.poll() is None:
        time.sleep(poll)
        if not _up(db_path, machine_id):
            proc.terminate()
            break
    return proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a sandbox machine's OS halting from inside")
    p.add_argument("what", choices=["halt", "keep"])
    p.add_argument("--db", required=True, type=Path)
    p.add_argument("--machine", required=True)
    p.add_argument("--shift", type=float, default=0.0, help="sandbox time - wall time, seconds")
    p.add_argument("--agent", help="keep: the agent's command line, a JSON list")
    a = p.parse_args(argv)
    if a.what == "keep":
        agent = json.loads(a.agent or "[]")
        if not agent:
            p.error("keep: give the agent's command line (--agent)")
        return keep(a.db, a.machine, [str(x) for x in agent])
    now = datetime.now(UTC) + timedelta(seconds=a.shift)  # the sandbox's time: see above
    state = halt(a.db, a.machine, now)
    print(f"{a.machine}: {state or 'not running: nothing to halt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
