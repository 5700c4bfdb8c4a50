"""Which key `up` launches with, and what `provisioner ssh` says of an address that does not
answer — in process; tests/test_ssh.py connects to a real sshd with them."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from provisioner import keys
from provisioner.errors import OperationFailed
from provisioner.spec import Experiment
from tests.conftest import make_settings, sandbox_experiment

#: A well-formed public key (its blob is any base64): only files are read, nothing connects.
RSA = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7 me@laptop"


@pytest.fixture
def user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "user"
    (h / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(h))
    return h


def choose(app, **fields) -> tuple[keys.Key, list[str]]:
    said: list[str] = []
    exp = Experiment.model_validate(sandbox_experiment("box") | fields)
    return keys.choose(app, exp, said.append), said


def test_id_rsa_is_used_when_there_is_no_ed25519_key(app, user):
    (user / ".ssh" / "id_rsa.pub").write_text(RSA + "\n")
    (user / ".ssh" / "id_rsa").write_text("private\n")
    key, said = choose(app)
    assert said == ["key: ~/.ssh/id_rsa.pub"]
    assert (key.public_key, key.private_path) == (RSA, user / ".ssh" / "id_rsa")
    assert key.detail()["fingerprint"].startswith("SHA256:")
    assert not keys.generated_path(app).exists()  # the home holds only the team's pull key
    made = sorted(p.name for p in (app.settings.home / "keys").iterdir())
    assert made == ["pull_ed25519", "pull_ed25519.pub"]


def test_a_public_key_without_its_private_half_is_sent_but_not_passed_to_ssh(app, user):
    (user / ".ssh" / "id_ed25519.pub").write_text(RSA)  # the private key lives in an agent
    key, _ = choose(app)
    assert key.public_key == RSA and key.private_path is None


def test_the_experiments_key_wins_and_names_no_file(app, user):
    (user / ".ssh" / "id_ed25519.pub").write_text(RSA)
    own = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA mine"
    key, said = choose(app, ssh_public_key=own)
    assert (key.public_key, key.source, key.private_path) == (own, "experiment", None)
    assert said == [
        "key: the experiment's ssh_public_key (your agent or ~/.ssh/config picks the key)"
    ]


def test_without_ssh_keygen_up_says_there_is_no_key(app, user, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    key, said = choose(app)
    assert key.public_key is None and key.source == "none"
    assert "ssh-keygen is not installed" in said[0] and "ssh_public_key" in said[0]


def test_a_cloud_machine_that_does_not_answer_names_the_firewall_and_ssh_cidrs(
    home, clock, monkeypatch
):
    """The probe is bounded by SSH_PROBE_SECONDS (or the environment's), and its failure says
    what to check on that cloud."""
    from providers import base
    from provisioner.app import App

    asked: list[tuple[str, int, float]] = []
    monkeypatch.setattr(base, "port_open", lambda h, p, t: asked.append((h, p, t)) or False)
    app = App(make_settings(home, clouds={"aws": {"ssh_cidrs": ["203.0.113.0/24"]}}), clock)
    m = SimpleNamespace(name="box", cloud="aws", public_ip="10.1.2.3")
    with pytest.raises(OperationFailed) as e:
        keys.check_reachable(app, m)  # type: ignore[arg-type]
    assert asked == [("10.1.2.3", 22, keys.SSH_PROBE_SECONDS)]
    assert "box at 10.1.2.3:22 did not answer SSH within 15 s" in str(e.value)
    assert "`provisioner status box`" in str(e.value)
    assert "the aws firewall / security group admits TCP 22" in str(e.value)
    assert "clouds.aws.ssh_cidrs in the settings: 203.0.113.0/24" in str(e.value)
    monkeypatch.setenv("PROVISIONER_SSH_PROBE_SECONDS", "0.5")
    with pytest.raises(OperationFailed, match=r"within 0\.5 s"):
        keys.check_reachable(app, m)  # type: ignore[arg-type]
    assert asked[-1][2] == 0.5
    app.close()


def _spoil(path: Path, how: str) -> None:
    if how == "empty":
        path.write_bytes(b"")
    elif how == "readable":
        path.chmod(0o644)
    else:  # a symlink to the very key: still not the file made here
        elsewhere = path.with_name("elsewhere")
        path.rename(elsewhere)
        path.symlink_to(elsewhere)


@pytest.mark.parametrize(
    ("how", "why"),
    [
        ("empty", "0 bytes: empty"),
        ("readable", "mode 0644: others may read or write it"),
        ("symlink", "a symlink, not the key file made here"),
    ],
)
def test_a_generated_key_that_is_not_as_made_is_replaced(app, user, caplog, how, why):
    first, _ = choose(app)
    assert first.source == "generated" and first.private_path == keys.generated_path(app)
    path = keys.generated_path(app)
    _spoil(path, how)
    caplog.set_level("INFO", logger="provisioner")
    again, said = choose(app)
    assert said[0] == f"key: generated {path} (none in ~/.ssh)"
    assert again.public_key != first.public_key  # a new pair, never the one others could read
    lines = [r.getMessage() for r in caplog.records if r.name == "provisioner.keys"]
    assert len(lines) == 1 and lines[0].startswith(f"{path}: {why}")
    assert lines[0].endswith("; replaced with a new key pair")
    st = path.lstat()
    assert not path.is_symlink() and st.st_size > 0 and st.st_mode & 0o077 == 0
    kept, said = choose(app)  # a good one is kept
    assert kept.public_key == again.public_key and said[0].startswith("key: the one generated")


def test_a_pull_key_others_may_read_is_not_used(app, user, caplog):
    keys.pull_public_key(app)
    assert keys.pull_private(app) == keys.pull_path(app)
    keys.pull_path(app).chmod(0o640)
    caplog.set_level("INFO", logger="provisioner")
    assert keys.pull_private(app) is None
    [line] = [r.getMessage() for r in caplog.records if r.name == "provisioner.keys"]
    assert "mode 0640: others may read or write it" in line and "not used" in line
