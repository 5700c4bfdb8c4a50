"""One cloud-init document carries the key, the scheduler's agent and the user's own script."""

from __future__ import annotations

import base64
import email

import yaml

from providers.userdata import cloud_init, combine
from provisioner.startup import startup_data

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample ana@laptop"


def parts(doc: str) -> list[tuple[str, str]]:
    return [
        (p.get_content_subtype(), p.get_payload(decode=True).decode())
        for p in email.message_from_string(doc).walk()
        if not p.is_multipart()
    ]


def test_script_and_key_become_one_cloud_config_that_runs_the_script():
    doc = cloud_init("echo hi\n", KEY, user="provisioner")
    config = yaml.safe_load(doc)
    assert config["users"][1]["name"] == "provisioner"
    assert config["users"][1]["ssh_authorized_keys"] == [KEY]
    (f,) = config["write_files"]
    assert base64.b64decode(f["content"]).decode() == "#!/bin/sh\necho hi\n"
    assert config["runcmd"] == [[f["path"]]]


def test_nothing_to_say_is_none_and_a_lone_script_is_untouched():
    assert cloud_init(None, None) is None
    assert cloud_init("#!/bin/bash\necho hi\n", None) == "#!/bin/bash\necho hi\n"


def test_agent_install_and_user_cloud_config_and_key_keep_their_kinds_and_order():
    user = "#cloud-config\npackages: [htop]\n"
    boot = startup_data(user, "http://10.0.0.1:8787", "tok-secret", 30, "m-1")
    doc = cloud_init(boot, KEY)
    kinds = [k for k, _ in parts(doc)]
    assert kinds == ["cloud-config", "x-shellscript", "cloud-config"]
    key_part, agent, theirs = (c for _, c in parts(doc))
    assert yaml.safe_load(key_part) == {"ssh_authorized_keys": [KEY]}
    assert "provisioner agent" in agent and agent.startswith("#!")
    assert yaml.safe_load(theirs) == {"packages": ["htop"]}


def test_combine_flattens_nested_multiparts():
    inner = combine("#!/bin/sh\necho a\n", "#cloud-config\n{}\n")
    assert [k for k, _ in parts(combine(inner, "echo b\n"))] == [
        "x-shellscript",
        "cloud-config",
        "x-shellscript",
    ]


def test_agent_install_keeps_the_token_to_the_agents_own_user(tmp_path):
    """The token file is 0600 in a 0700 directory owned by a system user the agent runs as
    (root only where that user cannot be made); the script is valid bash."""
    import subprocess

    boot = startup_data(None, "http://10.0.0.1:8787", "tok-secret", 30, "m-1")
    assert "umask 077" in boot and "chmod 0600 /etc/provisioner/agent-token" in boot
    assert "chmod 0700 /etc/provisioner" in boot
    assert "useradd --system" in boot and "chown -R provisioner-agent:" in boot
    assert "s/^User=root$/User=$run_as/" in boot
    assert "--machine 'm-1'" in boot
    assert boot.count("tok-secret") == 1  # in the heredoc only: not in the unit or a command
    script = tmp_path / "boot.sh"
    script.write_text(boot)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
