"""`provisioner ssh` against a real OpenSSH server on loopback: the sandbox cloud's machines
answer at 127.0.0.1 as the current user, so the command line the CLI builds (user, address,
the command after --) is checked by sshd itself, not by a mock."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import run_cli, sandbox_experiment, write_settings, write_yaml

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if Path("/usr/sbin/sshd").exists() else None)
pytestmark = pytest.mark.skipif(
    SSHD is None or shutil.which("ssh") is None,
    reason="OpenSSH server/client not installed (Debian: openssh-server; .ci/run installs it)",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """An sshd on 127.0.0.1 admitting the current user with a key made for the test."""
    d = tmp_path / "sshd"
    d.mkdir()
    for name in ("host", "user"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True
        )
    (d / "authorized_keys").write_text((d / "user.pub").read_text())
    port = _free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host'}\n"
        f"AuthorizedKeysFile {d / 'authorized_keys'}\nPidFile {d / 'sshd.pid'}\n"
        "StrictModes no\nUsePAM no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PubkeyAuthentication yes\nPermitRootLogin prohibit-password\n"
        f"AllowUsers {getpass.getuser()}\n"
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


def test_ssh_connects_as_the_clouds_user_at_the_machines_address(sshd, home, tmp_path):
    port, d = sshd
    me = getpass.getuser()
    sandbox = {"public_ip": "127.0.0.1", "ssh_port": port, "ssh_user": me}
    cfg = write_settings(home, sandbox=sandbox)
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("box"))
    up = run_cli("--config", str(cfg), "up", str(spec))
    assert up.returncode == 0, up.stderr
    assert "provisioner ssh box" in up.stdout  # up says how to connect
    env = {
        "PROVISIONER_SSH_COMMAND": f"ssh -i {d / 'user'} -p {port} -o BatchMode=yes "
        f"-o UserKnownHostsFile={d / 'known_hosts'}"
    }
    r = run_cli("--config", str(cfg), "ssh", "box", "--", "echo", "$USER@$SSH_CONNECTION", env=env)
    assert r.returncode == 0, r.stderr
    user, connection = r.stdout.strip().split("@")
    assert user == me and connection.split()[2] == "127.0.0.1"  # sshd saw who and where

    stopped = run_cli("--config", str(cfg), "stop", "box")
    assert stopped.returncode == 0, stopped.stderr
    r = run_cli("--config", str(cfg), "ssh", "box", env=env)
    assert r.returncode == 2 and "provisioner start box" in r.stderr
    assert "Traceback" not in r.stderr


def test_up_waits_for_ssh_within_its_bound_and_says_what_it_waited_for(home, tmp_path):
    closed = _free_port()  # nothing listens here
    cfg = write_settings(home, sandbox={"public_ip": "127.0.0.1", "ssh_port": closed})
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("slow"))
    r = run_cli("--config", str(cfg), "up", str(spec), "--wait-timeout", "2")
    assert r.returncode == 1 and "still waiting for SSH to answer after 2 s" in r.stderr
    assert "Traceback" not in r.stderr
    status = run_cli("--config", str(cfg), "status", "-o", "json", "--no-refresh")
    assert [m["status"] for m in json.loads(status.stdout)] == ["running"]  # left, not lost
    spec2 = write_yaml(tmp_path / "exp2.yaml", sandbox_experiment("quick"))
    r = run_cli("--config", str(cfg), "up", str(spec2), "--no-wait")
    assert r.returncode == 0, r.stderr
