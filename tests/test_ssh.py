"""`provisioner ssh` against a real OpenSSH server on loopback: the sandbox cloud's machines
answer at 127.0.0.1 as the current user, so the command line the CLI builds (user, address,
the command after --) is checked by sshd itself, not by a mock."""

from __future__ import annotations

import getpass
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import run_cli, sandbox_experiment, write_settings, write_yaml
from tests.sshd import NO_SSHD, SSHD, run_sshd
from tests.sshd import free_port as _free_port

pytestmark = [
    pytest.mark.slow,  # a real sshd and the CLI end to end: README command and CI
    pytest.mark.skipif(SSHD is None or shutil.which("ssh") is None, reason=NO_SSHD),
]


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    yield from run_sshd(tmp_path)


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


# --- the key `up` chooses, `provisioner ssh` and plain `ssh NAME` (issue #24, points 5 and 6) ---


def _user_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HOME for the CLI runs: a fresh folder, so ~/.ssh is what the test puts there; no agent."""
    h = tmp_path / "user"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return h


def _keygen(path: Path, kind: str = "ed25519") -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(path)], check=True)


def _fingerprint(pub: Path) -> str:
    out = subprocess.run(["ssh-keygen", "-l", "-f", str(pub)], capture_output=True, text=True)
    return out.stdout.split()[1]


def _loopback(port: int) -> dict:
    return {"public_ip": "127.0.0.1", "ssh_port": port, "ssh_user": getpass.getuser()}


#: OpenSSH without a terminal prompt; the key and the port are what `provisioner ssh` adds.
BATCH = {"PROVISIONER_SSH_COMMAND": "ssh -o BatchMode=yes"}


def test_up_uses_the_users_key_and_ssh_connects_with_it(sshd, home, tmp_path, monkeypatch):
    port, d = sshd
    user = _user_home(tmp_path, monkeypatch)
    _keygen(user / ".ssh" / "id_rsa", "rsa")  # id_ed25519 comes first
    _keygen(user / ".ssh" / "id_ed25519")
    pub = user / ".ssh" / "id_ed25519.pub"
    (d / "authorized_keys").write_text(pub.read_text())  # only this key gets in
    cfg = write_settings(home, sandbox=_loopback(port))
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("box"))
    up = run_cli("--config", str(cfg), "up", str(spec))
    assert up.returncode == 0, up.stderr
    assert "key: ~/.ssh/id_ed25519.pub" in up.stderr

    r = run_cli("--config", str(cfg), "ssh", "box", "--", "echo", "hi", env=BATCH)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "hi"

    # the machine's record names the key by path and fingerprint, never by its material
    ev = json.loads(run_cli("--config", str(cfg), "events", "box", "-o", "json").stdout)
    recorded = [e["detail"]["ssh_key"] for e in ev if "ssh_key" in e["detail"]]
    assert recorded == [
        {
            "source": "user",
            "public_path": str(pub),
            "private_path": str(user / ".ssh" / "id_ed25519"),
            "fingerprint": _fingerprint(pub),
        }
    ]
    assert pub.read_text().split()[1] not in json.dumps(ev)


def test_without_a_key_up_generates_one_and_ssh_uses_it(sshd, home, tmp_path, monkeypatch):
    port, d = sshd
    _user_home(tmp_path, monkeypatch)  # no ~/.ssh at all
    cfg = write_settings(home, sandbox=_loopback(port))
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("box"))
    up = run_cli("--config", str(cfg), "up", str(spec))
    assert up.returncode == 0, up.stderr
    private = home / "keys" / "id_ed25519"
    assert f"key: generated {private}" in up.stderr
    assert private.stat().st_mode & 0o777 == 0o600
    assert private.parent.stat().st_mode & 0o777 == 0o700
    public = private.with_name("id_ed25519.pub").read_text()
    (d / "authorized_keys").write_text(public)

    r = run_cli("--config", str(cfg), "ssh", "box", "--", "echo", "hi", env=BATCH)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "hi"

    # made once: the next machine gets the same pair
    spec2 = write_yaml(tmp_path / "exp2.yaml", sandbox_experiment("box2"))
    up = run_cli("--config", str(cfg), "up", str(spec2))
    assert up.returncode == 0, up.stderr
    assert "generated earlier" in up.stderr
    assert private.with_name("id_ed25519.pub").read_text() == public
    r = run_cli("--config", str(cfg), "ssh", "box2", "--", "echo", "hi", env=BATCH)
    assert r.returncode == 0 and r.stdout.strip() == "hi", r.stderr


def test_an_experiments_own_key_leaves_the_choice_to_ssh(sshd, home, tmp_path, monkeypatch):
    port, d = sshd
    _user_home(tmp_path, monkeypatch)
    cfg = write_settings(home, sandbox=_loopback(port))
    exp = sandbox_experiment("box") | {"ssh_public_key": (d / "user.pub").read_text().strip()}
    up = run_cli("--config", str(cfg), "up", str(write_yaml(tmp_path / "exp.yaml", exp)))
    assert up.returncode == 0, up.stderr
    assert "key: the experiment's ssh_public_key" in up.stderr
    assert not (home / "keys" / "id_ed25519").exists()  # no key of the user's generated
    # `echo` in place of ssh shows the command line: the port and timeout, no -i
    r = run_cli("--config", str(cfg), "ssh", "box", env={"PROVISIONER_SSH_COMMAND": "echo"})
    assert r.returncode == 0, r.stderr
    args = r.stdout.split()
    assert "-i" not in args and "IdentitiesOnly=yes" not in args
    assert f"Port={port}" in args and "ConnectTimeout=15" in args
    # with that key, the user's own -i reaches the machine
    env = {"PROVISIONER_SSH_COMMAND": f"ssh -o BatchMode=yes -i {d / 'user'}"}
    r = run_cli("--config", str(cfg), "ssh", "box", "--", "echo", "hi", env=env)
    assert r.returncode == 0 and r.stdout.strip() == "hi", r.stderr


def test_ssh_config_install_lets_plain_ssh_reach_machines_by_name(
    sshd, home, tmp_path, monkeypatch
):
    port, d = sshd
    user = _user_home(tmp_path, monkeypatch)
    _keygen(user / ".ssh" / "id_ed25519")
    (d / "authorized_keys").write_text((user / ".ssh" / "id_ed25519.pub").read_text())
    mine = "Host elsewhere\n    User someone\n"
    (user / ".ssh" / "config").write_text(mine)
    cfg = write_settings(home, sandbox=_loopback(port))
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("box"))
    assert run_cli("--config", str(cfg), "up", str(spec)).returncode == 0

    printed = run_cli("--config", str(cfg), "ssh-config")
    assert printed.returncode == 0, printed.stderr
    assert "Host box\n" in printed.stdout and f"Port {port}\n" in printed.stdout
    assert not (home / "ssh_config").exists()  # printing writes nothing

    r = run_cli("--config", str(cfg), "ssh-config", "--install")
    assert r.returncode == 0, r.stderr
    include = f"Include {home / 'ssh_config'}"
    assert f"added `{include}` at the top of ~/.ssh/config" in r.stdout
    assert (user / ".ssh" / "config").read_text() == f"{include}\n\n{mine}"
    again = run_cli("--config", str(cfg), "ssh-config", "--install")
    assert "already includes it" in again.stdout
    assert (user / ".ssh" / "config").read_text().count("Include") == 1

    ssh = ["ssh", "-F", str(user / ".ssh" / "config"), "-o", "BatchMode=yes"]
    r = subprocess.run([*ssh, "box", "echo", "hi"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "hi"

    # up and down keep the installed file current
    spec2 = write_yaml(tmp_path / "exp2.yaml", sandbox_experiment("box2"))
    assert run_cli("--config", str(cfg), "up", str(spec2)).returncode == 0
    r = subprocess.run([*ssh, "box2", "echo", "hi"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "hi", r.stderr
    assert run_cli("--config", str(cfg), "down", "box").returncode == 0
    written = (home / "ssh_config").read_text()
    assert "Host box\n" not in written and "Host box2\n" in written


def test_ssh_config_install_creates_a_private_ssh_config(home, tmp_path, monkeypatch):
    user = _user_home(tmp_path, monkeypatch)
    cfg = write_settings(home)
    r = run_cli("--config", str(cfg), "ssh-config", "--install")
    assert r.returncode == 0, r.stderr
    config = user / ".ssh" / "config"
    assert config.read_text() == f"Include {home / 'ssh_config'}\n"
    assert config.stat().st_mode & 0o777 == 0o600
    assert "created ~/.ssh/config" in r.stdout


def test_ssh_to_a_port_that_does_not_answer_says_what_to_check(home, tmp_path, monkeypatch):
    _user_home(tmp_path, monkeypatch)
    closed = _free_port()  # nothing listens here
    cfg = write_settings(home, sandbox={"public_ip": "127.0.0.1", "ssh_port": closed})
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("box"))
    assert run_cli("--config", str(cfg), "up", str(spec), "--no-wait").returncode == 0
    # `true` would "succeed" if ssh were run at all
    r = run_cli("--config", str(cfg), "ssh", "box", env={"PROVISIONER_SSH_COMMAND": "true"})
    assert r.returncode == 1, r.stdout
    assert f"box at 127.0.0.1:{closed} did not answer SSH within 15 s" in r.stderr
    assert "provisioner status box" in r.stderr
    assert "clouds.sandbox.public_ip/ssh_port" in r.stderr
    assert "Traceback" not in r.stderr


def test_ssh_to_a_simulated_sandbox_address_says_it_is_simulated(home, tmp_path, monkeypatch):
    _user_home(tmp_path, monkeypatch)
    cfg = write_settings(home)  # the sandbox's default: a TEST-NET address
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("box"))
    assert run_cli("--config", str(cfg), "up", str(spec)).returncode == 0
    r = run_cli("--config", str(cfg), "ssh", "box", env={"PROVISIONER_SSH_COMMAND": "true"})
    assert r.returncode == 1, r.stdout
    assert "sandbox machines have a simulated address (198.51.100.x, TEST-NET)" in r.stderr
    assert "set clouds.sandbox.public_ip/ssh_port to reach a real sshd" in r.stderr
    assert "Traceback" not in r.stderr
