"""A real OpenSSH server on loopback for tests (the ``sshd`` fixture): it admits the current
user with a key made for the test; ``authorized_keys`` in its folder says which keys get in."""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if Path("/usr/sbin/sshd").exists() else None)
NO_SSHD = "OpenSSH server/client not installed (Debian: openssh-server; .ci/run installs it)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _clock_env() -> str:
    """sshd gives a session an environment of its own making, not the test's: under
    libfaketime (the suite's edge-instant run, .ci/run) the commands run over SSH — the job
    supervisor, the agent's ``--report`` — would read the real clock while the test and the
    processes it starts read the faked one, as far apart as the offset (weeks); the pull
    refuses a report more than 5 minutes off its own clock. The session gets the test's
    clock, as NTP keeps a real machine on its scheduler's."""
    if "FAKETIME" not in os.environ:
        return ""
    faked = [k for k in os.environ if k == "LD_PRELOAD" or k.startswith("FAKETIME")]
    return "SetEnv " + " ".join(f'{k}="{os.environ[k]}"' for k in faked) + "\n"


def run_sshd(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """An sshd on 127.0.0.1 admitting the current user with a key made for the test: yields
    its port and its folder (``user`` the key, ``authorized_keys``). A fixture's body:
    ``yield from run_sshd(tmp_path)``."""
    d = tmp_path / "sshd"
    d.mkdir()
    for name in ("host", "user"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True
        )
    (d / "authorized_keys").write_text((d / "user.pub").read_text())
    port = free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host'}\n"
        f"AuthorizedKeysFile {d / 'authorized_keys'}\nPidFile {d / 'sshd.pid'}\n"
        "StrictModes no\nUsePAM no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PubkeyAuthentication yes\nPermitRootLogin prohibit-password\n"
        f"AllowUsers {getpass.getuser()}\n{_clock_env()}"
    )
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # its privilege-separation directory
    proc = subprocess.Popen(
        [str(SSHD), "-D", "-e", "-f", str(d / "sshd_config")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"sshd exited: {proc.stderr.read().decode() if proc.stderr else ''}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield port, d
    finally:
        proc.terminate()
        proc.wait(timeout=10)
