"""One cloud-init document carries the key, the scheduler's agent and the user's own script."""

from __future__ import annotations

import email
import subprocess

import pytest
import yaml

from providers.userdata import cloud_init, combine, file_content
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
    assert f["encoding"] == "gz+b64" and file_content(f) == "#!/bin/sh\necho hi\n"
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


def test_agent_install_keeps_the_token_in_a_root_only_directory(tmp_path):
    """The agent runs as root (it powers the machine off and reads the login user's jobs); the
    token file is 0600 in a 0700 directory, apart from the state; the script is valid bash."""

    boot = startup_data(None, "http://10.0.0.1:8787", "tok-secret", 30, "m-1")
    assert "umask 077" in boot and "chmod 0600 /etc/provisioner/agent-token" in boot
    assert "chmod 0700 /etc/provisioner" in boot
    assert "useradd" not in boot and "User=" not in boot  # root: the guard shuts it down
    assert "--machine 'm-1'" in boot
    assert boot.count("tok-secret") == 1  # in the heredoc only: not in the unit or a command
    script = tmp_path / "boot.sh"
    script.write_text(boot)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


# --- the job supervisor is not in the startup data: the first SSH call installs it -------------


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure", "yandex", "sbercloud", "sandbox"])
def test_every_cloud_gets_the_agent_at_boot_and_the_supervisor_over_ssh(home, clock, cloud):
    from provisioner.app import App
    from provisioner.boot import startup_for
    from provisioner.machines.remote import MARK
    from provisioner.spec import Experiment
    from tests.conftest import make_settings, sandbox_experiment

    app = App(make_settings(home, clouds={cloud: {}} if cloud != "sandbox" else {}), clock)
    job = Experiment.model_validate(sandbox_experiment("exp", clouds=[cloud]) | {"run": "true"})
    with_job = startup_for(app, job, cloud, [], token=None, machine_id="m-1") or ""
    # jobs start over SSH, and the first SSH call installs provisioner-job (machines/remote.py):
    # EC2's 16 KB are kept for the agent and the user's own script (docs/LIMITS.md)
    assert MARK not in with_job and "PV_JOB_EOF" not in with_job
    # the agent, though, on every machine of every cloud, endpoint or not (issue #32)
    assert "/usr/local/bin/provisioner-agent --state-dir" in with_job
    assert "/var/lib/provisioner/agent/guard.json" in with_job
    app.close()


def test_the_agent_ships_shrunk_even_with_non_ascii_docstrings():
    """ast counts columns in UTF-8 bytes: a "—" in a docstring once made the shrink give up and
    ship the agent whole (4 KB more of EC2's 16 KB)."""
    from provisioner.pyshrink import shrink
    from provisioner.startup import agent_sources

    source = 'def f():\n    """A rule — with a dash."""\n    return 1  # and a comment…\n'
    assert shrink(source) == "def f():\n return 1\n"
    assert shrink('def f():\n    """Only a docstring — here."""\n') == 'def f():\n ""\n'
    for name, text in agent_sources().items():
        assert '"""' not in text and text.isascii(), name


def test_the_shrink_keeps_what_runs_and_only_that():
    """What the machine gets of the agent: no docstring, comment, blank line, annotation of a
    function (nor of an assignment inside one: a class's, which a dataclass reads, is kept),
    a level one space, a statement on one line; what ``drop`` names gone; anything it cannot
    prove the same program is sent as it is."""
    from provisioner.pyshrink import shrink

    source = (
        "#!/usr/bin/env python3\n"
        '"""Module doc."""\n'
        "import os  # a comment\n\n\n"
        'def f(a: int, *rest: str, k: "X" = 1) -> dict[str, int]:\n'
        '    """Doc."""\n'
        '    out: dict = {\n        "a": a,\n        "k": k,\n    }\n'
        "    return out if a else 1 .real\n\n\n"
        '@register("gcp")\nclass Gone:\n    x: int = 1\n'
    )
    lean = (
        "#!/usr/bin/env python3\nimport os\ndef f(a,*rest,k=1):\n"
        ' out={"a":a,"k":k,}\n return out if a else 1 .real\n'
    )
    assert shrink(source, drop={"Gone"}) == lean
    assert shrink(source) == lean + '@register("gcp")\nclass Gone:\n x:int=1\n'
    ran: dict = {}
    exec(compile(lean, "lean", "exec"), ran)
    assert ran["f"](2) == {"a": 2, "k": 1} and ran["f"](0) == 1
    odd = "def g() -> (\n    int\n):\n    return 1\n"  # a parenthesised return annotation
    assert shrink(odd) == odd  # not proven the same program: sent whole
