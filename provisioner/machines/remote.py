"""Jobs on a cloud machine over SSH: the same calls the sandbox's adapter makes locally
(``put_files``, ``start_job``, ``job_state``, ``job_output``, ``cancel_job``), made with OpenSSH
and rsync at the machine's address, as its cloud's user, with the key ``up`` launched it with.

On the machine a small supervisor, ``provisioner-job`` (``templates/provisioner-job.sh``), runs
each job as its own session (``setsid nohup``), so it survives the SSH connection, and keeps its
output and exit code in ``~/.provisioner/jobs/<id>/``. The startup data installs it in
``/usr/local/bin``; every call here pushes it to ``~/.provisioner/bin`` when neither copy is
there (a machine launched before). The workdir is copied to ``~/workdir``, where jobs run.

Every call is bounded (``ConnectTimeout``, server-alive probes, a timeout on the process): a
machine that does not answer raises :class:`Unreachable` — "could not ask", never "it ended".

``$PROVISIONER_SSH_COMMAND`` (as for ``provisioner ssh``) replaces ``ssh``, its options first;
``$PROVISIONER_REMOTE_HOME`` replaces the login home on the machine (tests share one sshd).
"""

from __future__ import annotations

import base64
import itertools
import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from providers.base import JobState, NotFound, Provider, ProviderError
from provisioner import keys
from provisioner.app import App
from provisioner.models import Machine
from provisioner.startup import SUPERVISOR_PATH as SYSTEM_COPY
from provisioner.startup import supervisor_script as supervisor

MARK = "provisioner-job v2"  # the supervisor's version line; another version is replaced
CALL_SECONDS = 60.0  # one short call (state, output, start)
SYNC_SECONDS = 600.0  # one rsync of a workdir


class Unreachable(ProviderError):
    """The machine did not answer over SSH (or the call timed out): nothing is known."""


def _remote_home() -> str | None:
    return os.environ.get("PROVISIONER_REMOTE_HOME") or None


def ssh_port(provider: Provider) -> int:
    """The port SSH reaches the cloud's machines on: ``-p`` in $PROVISIONER_SSH_COMMAND (its
    options come first: OpenSSH keeps the first), else the cloud's."""
    words = shlex.split(os.environ.get("PROVISIONER_SSH_COMMAND") or "ssh")
    for flag, value in itertools.pairwise(words):
        if flag == "-p" and value.isdigit():
            return int(value)
    return provider.ssh_port


class Remote:
    """One machine's jobs over SSH."""

    def __init__(self, app: App, m: Machine) -> None:
        if not m.public_ip:
            raise Unreachable(f"{m.name} has no public address to reach it over SSH")
        self.app, self.m = app, m
        self.provider = app.provider(m.cloud or "")
        self.target = f"{self.provider.ssh_user}@{m.public_ip}"

    # --- the command lines -----------------------------------------------------------------

    def ssh_argv(self, key: Path | None = None) -> list[str]:
        """``ssh`` with the options ``provisioner ssh`` gives it, never prompting; with ``key``
        alone when given (the pull key), else the key the machine was launched with."""
        key = key or keys.private_key(self.app, self.m)
        wait = keys.probe_seconds()
        return [
            *shlex.split(os.environ.get("PROVISIONER_SSH_COMMAND") or "ssh"),
            *(["-i", str(key), "-o", "IdentitiesOnly=yes"] if key else []),
            *("-o", f"Port={self.provider.ssh_port}"),
            *("-o", f"ConnectTimeout={wait:g}"),
            *("-o", "BatchMode=yes"),
            *("-o", f"ServerAliveInterval={max(1, int(wait))}", "-o", "ServerAliveCountMax=2"),
            *("-o", "StrictHostKeyChecking=accept-new"),
            *("-o", f"UserKnownHostsFile={keys.known_hosts(self.app)}"),
            *("-o", f"HostKeyAlias={keys.host_alias(self.m)}"),
        ]

    def _preamble(self) -> str:
        """Shell: ``$sup`` the supervisor (pushed when absent), ``$PV_HOME`` exported."""
        home = _remote_home()
        top = f"PV_HOME={shlex.quote(home)}" if home else 'PV_HOME="$HOME"'
        body = base64.b64encode(supervisor().encode()).decode()
        mine = '"$PV_HOME/.provisioner/bin/provisioner-job"'
        return (
            f"umask 077; {top}; export PV_HOME; sup={SYSTEM_COPY}\n"  # env, output: the user's
            f"grep -qs '{MARK}' \"$sup\" || {{ sup={mine}; grep -qs '{MARK}' \"$sup\" || {{ "
            'mkdir -p "$PV_HOME/.provisioner/bin" && '
            f'echo {body} | base64 -d > "$sup.tmp" && chmod 0755 "$sup.tmp" '
            '&& mv "$sup.tmp" "$sup" || exit 90; }; }\n'
        )

    def run(
        self, script: str, *, timeout: float = CALL_SECONDS
    ) -> subprocess.CompletedProcess[bytes]:
        """``script`` run by ``sh`` on the machine (after the preamble); exit 255 or a timeout:
        :class:`Unreachable`."""
        remote = "sh -c " + shlex.quote(self._preamble() + script)
        argv = [*self.ssh_argv(), self.target, remote]
        try:
            done = subprocess.run(
                argv, capture_output=True, stdin=subprocess.DEVNULL, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise Unreachable(f"{self.m.name}: no answer over SSH within {timeout:g} s") from None
        except OSError as e:
            raise ProviderError(f"cannot run ssh: {e.strerror} (is OpenSSH installed?)") from None
        if done.returncode == 255:
            why = done.stderr.decode(errors="replace").strip().splitlines()
            raise Unreachable(
                f"{self.m.name} at {self.m.public_ip}:{ssh_port(self.provider)} did not answer "
                f"SSH ({why[-1] if why else 'ssh exited 255'})"
            )
        return done

    # --- the job calls -------------------------------------------------------------------------

    def put_files(self, source: str, paths: Sequence[str]) -> None:
        """``paths`` of the local folder ``source`` copied to the machine's workdir by rsync."""
        self.run('mkdir -p "$PV_HOME/workdir"')
        home = _remote_home()
        dest = f"{home}/workdir/" if home else "workdir/"
        argv = [
            "rsync",
            "-az",
            "--files-from=-",
            "-e",
            shlex.join(self.ssh_argv()),
            str(Path(source)) + "/",
            f"{self.target}:{dest}",
        ]
        listing = "".join(p + "\n" for p in paths).encode()
        try:
            done = subprocess.run(argv, input=listing, capture_output=True, timeout=SYNC_SECONDS)
        except subprocess.TimeoutExpired:
            raise Unreachable(f"{self.m.name}: rsync took over {SYNC_SECONDS:g} s") from None
        except OSError as e:
            raise ProviderError(f"cannot run rsync: {e.strerror} (is rsync installed?)") from None
        if done.returncode != 0:
            why = done.stderr.decode(errors="replace").strip().splitlines()
            error = Unreachable if done.returncode == 255 else ProviderError
            raise error(f"rsync to {self.m.name} failed: {why[-1] if why else done.returncode}")

    def start_job(
        self, job_id: str, command: str, *, env: Mapping[str, str], setup: str | None = None
    ) -> None:
        """The job's files written, then ``provisioner-job start``: detached, it outlives us."""
        d = f'"$PV_HOME/.provisioner/jobs/"{shlex.quote(job_id)}'
        files = {"cmd": command + "\n"}
        files["env"] = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
        if setup is not None:
            files["setup"] = setup + "\n"
        lines = [f"rm -rf {d} && mkdir -p {d} || exit 91"]
        for name, text in files.items():
            b64 = base64.b64encode(text.encode()).decode()
            lines.append(f"echo {b64} | base64 -d > {d}/{name} || exit 91")
        lines.append(f'"$sup" start {shlex.quote(job_id)}')
        done = self.run("\n".join(lines) + "\n")
        if done.returncode != 0:
            raise ProviderError(f"{self.m.name}: could not start {job_id}: {_said(done)}")

    def job_state(self, job_id: str) -> JobState:
        done = self.run(f'"$sup" state {shlex.quote(job_id)}')
        said = done.stdout.decode(errors="replace").strip()
        if done.returncode != 0 or not said:
            raise ProviderError(f"{self.m.name}: could not ask about {job_id}: {_said(done)}")
        if said == "none":
            raise NotFound(f"{self.m.name}: no job {job_id}", code="NoJob")
        if said == "running":
            return JobState(True)
        if said.startswith("exit "):  # "exit CODE STAGE" (v1 said "exit CODE")
            words = said.split()
            try:
                return JobState(False, int(words[1]), words[2] if len(words) > 2 else "run")
            except (IndexError, ValueError):
                return JobState(False, None)
        return JobState(False, None)  # lost: ended with its machine's boot, no exit code

    def cancel_job(self, job_id: str, grace: float) -> JobState:
        """``provisioner-job cancel``: TERM, then KILL after ``grace`` seconds; its state after."""
        seconds = max(0, int(grace + 0.999))
        done = self.run(
            f'"$sup" cancel {shlex.quote(job_id)} {seconds}', timeout=CALL_SECONDS + seconds
        )
        if done.returncode == 3:
            raise NotFound(f"{self.m.name}: no job {job_id}", code="NoJob")
        if done.returncode != 0:
            raise ProviderError(f"{self.m.name}: could not cancel {job_id}: {_said(done)}")
        return self.job_state(job_id)

    def job_output(self, job_id: str, offset: int = 0) -> bytes:
        done = self.run(f'"$sup" output {shlex.quote(job_id)} {int(offset)}')
        if done.returncode == 3:
            raise NotFound(f"{self.m.name}: no job {job_id}", code="NoJob")
        if done.returncode != 0:
            raise ProviderError(f"{self.m.name}: could not read {job_id}'s output: {_said(done)}")
        return done.stdout


def _said(done: subprocess.CompletedProcess[bytes]) -> str:
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else f"exit {done.returncode}"
