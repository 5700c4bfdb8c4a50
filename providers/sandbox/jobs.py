"""A sandbox machine's jobs and its guard: local processes in the machine's own directory.

Mixed into :class:`providers.sandbox.adapter.SandboxProvider` (which keeps the machines' table);
the agent process and the guest halt are :mod:`providers.sandbox.guard`.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from providers.base import (
    Instance,
    InstanceRef,
    InvalidRequest,
    JobState,
    MachineState,
    NotFound,
)
from providers.sandbox import SandboxOptions, guard


class SandboxJobs:
    """The jobs half of the sandbox adapter."""

    db_path: Path
    options: SandboxOptions
    _procs: dict[Path, subprocess.Popen[bytes]]  # jobs this process started
    _call: Callable[[Callable[[sqlite3.Connection], Any]], Any]
    _instance: Callable[[sqlite3.Connection, sqlite3.Row], Instance]
    _row: Callable[[sqlite3.Connection, InstanceRef], sqlite3.Row]
    _now: Callable[[], datetime]

    # -- jobs: local processes in the machine's own directory -------------------------------
    # <sandbox db folder>/machines/<id>/: workdir/ (the copy, where jobs run), setup.sh and
    # setup.done (setup once per machine), jobs/<job>/{command.sh, output.log, pid, exit_code}.
    # Each job is a detached process group (its own session: it outlives the `up` that started
    # it); stopping, terminating or preempting the machine kills its groups.

    def machine_dir(self, machine_id: str) -> Path:
        return self.db_path.parent / "machines" / machine_id

    def _running_dir(self, ref: InstanceRef) -> Path:
        def look(db: sqlite3.Connection) -> str:
            return str(self._instance(db, self._row(db, ref)).state)

        state = self._call(look)
        if state != MachineState.RUNNING:
            raise InvalidRequest(
                f"sandbox: machine {ref.id} is {state}, not running", code="SandboxNotRunning"
            )
        return self.machine_dir(ref.id)

    def put_files(self, ref: InstanceRef, source: str, paths: Sequence[str]) -> None:
        work = self._running_dir(ref) / "workdir"
        for rel in paths:
            src, dst = Path(source) / rel, work / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)

    def start_job(
        self,
        ref: InstanceRef,
        job_id: str,
        command: str,
        *,
        env: Mapping[str, str],
        setup: str | None = None,
    ) -> None:
        home = self._running_dir(ref)
        job = home / "jobs" / job_id
        if job.exists():  # a job of that id again (a relaunched `run`): its output starts anew
            shutil.rmtree(job)
        job.mkdir(parents=True)
        (home / "workdir").mkdir(exist_ok=True)
        (job / "command.sh").write_text(command + "\n")
        q = shlex.quote
        lines = []
        if setup is not None:
            (home / "setup.sh").write_text(setup + "\n")
            done = q(str(home / "setup.done"))
            lines.append(  # a failing setup: its code, and ``stage`` saying it was setup's
                f"if [ ! -e {done} ]; then sh {q(str(home / 'setup.sh'))} || "
                f"{{ code=$?; echo setup > {q(str(job / 'stage'))}; "
                f"echo $code > {q(str(job / 'exit_code'))}; exit; }}; touch {done}; fi"
            )
        # the exit code kept twice: ``exit_code`` (the sandbox's own) and ``exit``, beside
        # ``pid`` and ``boot``, as provisioner-job keeps a job on a cloud machine, which the
        # machine's agent reads in its jobs_dir
        tmp, final = q(str(job / "exit_code.tmp")), q(str(job / "exit_code"))
        tmp2, final2 = q(str(job / "exit.tmp")), q(str(job / "exit"))
        lines.append(
            f"sh {q(str(job / 'command.sh'))}; code=$?; echo $code > {tmp2} && mv {tmp2} {final2};"
            f" echo $code > {tmp} && mv {tmp} {final}"
        )
        with (job / "output.log").open("wb") as log:
            proc = subprocess.Popen(
                ["sh", "-c", "\n".join(lines)],
                cwd=home / "workdir",
                env={**os.environ, **env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        (job / "boot").write_text(guard.boot_id(home) + "\n")
        (job / "pid.tmp").write_text(str(proc.pid))  # whole or not at all: the agent reads it
        (job / "pid.tmp").replace(job / "pid")
        self._procs[job] = proc

    def _job_dir(self, ref: InstanceRef, job_id: str) -> Path:
        job = self.machine_dir(ref.id) / "jobs" / job_id
        if not (job / "pid").exists():
            raise NotFound(f"sandbox: no job {job_id} on {ref.id}", code="SandboxNoJob")
        return job

    def job_state(self, ref: InstanceRef, job_id: str) -> JobState:
        job = self._job_dir(ref, job_id)
        code = job / "exit_code"
        if code.exists():
            return _ended(job)
        proc = self._procs.get(job)
        alive = proc.poll() is None if proc is not None else _alive(int((job / "pid").read_text()))
        if not alive and code.exists():  # it wrote its code between the two looks
            return _ended(job)
        return JobState(alive, None)

    def cancel_job(self, ref: InstanceRef, job_id: str, grace: float) -> JobState:
        """TERM to the job's process group, KILL after ``grace`` seconds (real ones: the job
        is a real process)."""
        job = self._job_dir(ref, job_id)
        pgid = int((job / "pid").read_text())
        _signal(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        proc = self._procs.get(job)
        while time.monotonic() < deadline:  # until no process of its group is left
            if proc is not None:
                proc.poll()  # our own child reaped once it ended
            if not _group_alive(pgid):
                break
            time.sleep(0.05)
        _signal(pgid, signal.SIGKILL)  # what ignored the TERM (none left: nothing)
        self._procs.pop(job, None)
        if proc is not None:
            proc.wait()
        return self.job_state(ref, job_id)

    def job_output(self, ref: InstanceRef, job_id: str, offset: int = 0) -> bytes:
        with (self._job_dir(ref, job_id) / "output.log").open("rb") as f:
            f.seek(offset)
            return f.read()

    def _kill_jobs(self, machine_id: str) -> None:
        """Every job of a machine that stops, and its agent: killed, as a halt would."""
        home = self.machine_dir(machine_id)
        guard.stop(home)
        guard.kill_jobs(home)
        for job in [j for j in self._procs if j.parent.parent == home]:
            self._procs.pop(job).wait()

    # -- the machine's own guard: the agent process ----------------------------------------

    def _agent(self) -> Path | None:
        return Path(self.options.agent_path) if self.options.agent_path else None

    def _start_guard(self, machine_id: str, request: Mapping[str, Any] | None = None) -> None:
        """A run of the machine begins (launch, start): its agent starts, with the guard its
        launch asked for (kept in its directory, as a cloud machine keeps its startup data)."""
        if not self.options.agent:
            return
        home = self.machine_dir(machine_id)
        if request is not None:
            guard.keep_request(home, request)
        guard.start(
            home,
            self.db_path,
            machine_id,
            self._now(),
            interval=self.options.agent_interval_seconds,
            agent=self._agent(),
        )

    def machine_report(self, ref: InstanceRef, since: datetime | None = None) -> bytes | None:
        """The agent's ``--report`` for the machine's state dir (no SSH: the sandbox's machines
        are directories here), its instants in the sandbox's time."""
        return guard.report(self.machine_dir(ref.id), self._agent(), since)


def _ended(job: Path) -> JobState:
    stage = job / "stage"
    said = stage.read_text().strip() if stage.exists() else "run"
    return JobState(False, int((job / "exit_code").read_text().strip()), said or "run")


def _signal(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (a zombie no one reaps counts as ended)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def _alive(pid: int) -> bool:
    """Whether a job started by another process still runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie has exited
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    return True
