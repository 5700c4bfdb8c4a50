"""The agent is installed on every machine, endpoint or not (issue #32): the startup script run
for real inside a throwaway root (bubblewrap), then the installed ``provisioner-agent --report``
read back; the token only with an endpoint; the team's pull key restricted to the report."""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from provisioner import guard, startup
from provisioner.spec import Experiment
from tests.conftest import sandbox_experiment

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

PULL = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPullKeyExample team@scheduler"
LINE = (
    'restrict,command="/usr/local/bin/provisioner-agent --report" '
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPullKeyExample provisioner-pull"
)
LAUNCHED = datetime(2026, 12, 7, 10, 0, tzinfo=UTC)


def experiment(**lifecycle) -> Experiment:
    raw = sandbox_experiment("exp") | {"run": "python train.py"}
    raw["lifecycle"] = {**raw.get("lifecycle", {}), **lifecycle}
    return Experiment.model_validate(raw)


def doc(launched: datetime = LAUNCHED, **lifecycle) -> dict:
    rules = guard.rules(experiment(**lifecycle), [])
    return guard.guard_doc(rules, "m-1", launched, "root")


def run_as_machine(tmp_path: Path, script: str, after: str) -> subprocess.CompletedProcess:
    """``script`` run as root in a throwaway root (tmpfs over /usr/local, /var, /etc, /root),
    then ``after``; what the machine's files became is copied to ``tmp_path/out``."""
    if not shutil.which("bwrap"):
        pytest.skip("bubblewrap is not installed")
    (tmp_path / "boot.sh").write_text(script)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pip3").write_text("#!/bin/sh\nexit 1\n")  # no network here
    (tmp_path / "bin" / "pip3").chmod(0o755)
    (tmp_path / "out").mkdir()
    etc = ["/etc/passwd", "/etc/group", "/etc/nsswitch.conf"]
    cmd = ["bwrap", "--unshare-pid", "--die-with-parent", "--bind", "/", "/"]
    cmd += ["--tmpfs", "/usr/local", "--tmpfs", "/var", "--tmpfs", "/root", "--tmpfs", "/run"]
    cmd += ["--tmpfs", "/etc", *[a for f in etc if Path(f).exists() for a in ("--ro-bind", f, f)]]
    cmd += ["--dev", "/dev", "--proc", "/proc", "--bind", str(tmp_path), "/t"]
    cmd += ["--setenv", "PATH", "/t/bin:/usr/local/bin:/usr/bin:/bin", "bash", "-c"]
    cmd += [f"mkdir -p /var/log && bash /t/boot.sh; {after}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


WAIT_KEY = (
    "for i in $(seq 100); do grep -q provisioner-pull /root/.ssh/authorized_keys 2>/dev/null"
    " && break; sleep 0.1; done"
)


def test_without_an_endpoint_the_agent_guards_and_keeps_its_record(tmp_path):
    # the agent is a real process on this host's clock (libfaketime's, in CI's second run): its
    # machine was launched now, so its 48 h are ahead of it whatever the date
    launched = datetime.now(UTC).replace(microsecond=0)
    g = doc(launched, autostop="10m", max_lifetime="48h")
    script = startup.startup_data(None, None, None, 30, "m-1", cloud="aws", guard=g)
    (cmd,) = [x for x in script.splitlines() if x.startswith("ExecStart=")]
    assert cmd == (
        "ExecStart=/usr/local/bin/provisioner-agent --state-dir /var/lib/provisioner/agent"
        " --interval 30 --cloud 'aws'"
    )
    assert "agent-token" not in script
    after = (
        "/usr/local/bin/provisioner-agent --report > /t/out/report.json; "
        "stat -c '%a' /var/lib/provisioner/agent /var/lib/provisioner/agent/guard.json "
        "/usr/local/lib/provisioner/agent.py > /t/out/modes; "
        "test -e /etc/provisioner && echo secrets-dir > /t/out/etc; "
        "cat /var/log/provisioner-agent-install.log > /t/out/log"
    )
    done = run_as_machine(tmp_path, script, after)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["guard"] == g and report["machine"] == "m-1" and report["stop"] is None
    ends = (launched + timedelta(hours=48)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert g["autostop_s"] == 600 and g["max_lifetime_at"] == ends
    assert g["on_finish"] == {"job": "run", "action": "stop"}
    assert g["jobs_dir"] == "/root/.provisioner/jobs"
    assert (tmp_path / "out" / "modes").read_text().split() == ["755", "644", "755"]
    assert not (tmp_path / "out" / "etc").exists()  # no secret, no secrets directory


def test_with_an_endpoint_the_token_is_kept_apart_from_the_state(tmp_path):
    script = startup.startup_data(
        None, "http://10.0.0.1:8787", "tok-secret", 30, "m-1", guard=doc()
    )
    assert script.count("tok-secret") == 1  # in the heredoc only: not in the unit or a command
    assert "--token-file /etc/provisioner/agent-token" in script
    after = (
        "stat -c '%a' /etc/provisioner /etc/provisioner/agent-token > /t/out/modes; "
        "grep -rl tok-secret /var/lib/provisioner > /t/out/leak || true"
    )
    done = run_as_machine(tmp_path, script, after)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "modes").read_text().split() == ["700", "600"]
    assert (tmp_path / "out" / "leak").read_text() == ""


def test_the_pull_key_may_only_read_the_report(tmp_path):
    script = startup.startup_data(
        None, None, None, 30, "m-1", guard=doc(), pull_key=PULL, login_user="root"
    )
    twice = script + script  # a second boot's script: the line is not added again
    after = f"{WAIT_KEY}; sleep 0.5; cp /root/.ssh/authorized_keys /t/out/keys; "
    after += "stat -c '%a' /root/.ssh/authorized_keys > /t/out/mode"
    done = run_as_machine(tmp_path, twice, after)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "keys").read_text().splitlines() == [LINE]
    assert (tmp_path / "out" / "mode").read_text().strip() == "600"
    assert startup.pull_line(PULL) == LINE


def test_no_pull_key_no_line():
    script = startup.startup_data(None, None, None, 30, "m-1", guard=doc(), login_user="root")
    assert "provisioner-pull" not in script and "authorized_keys" not in script


def test_the_machine_gets_the_experiments_and_the_policies_rules():
    from policies.schema import Policy

    cap = Policy.model_validate(
        {
            "name": "lab",
            "applies_to": {"projects": ["*"]},
            "max_autostop": "30m",
            "max_lifetime": {"after": "12h", "action": "terminate"},
            "idle": {"gpu_util_below": 3, "for_minutes": 20},
        }
    )
    r = guard.rules(experiment(autostop="2h", max_lifetime="48h", on_finish="terminate"), [cap])
    assert r.autostop == timedelta(minutes=30) and r.autostop_from == "capped from 2h by policy lab"
    assert r.lifetime == (timedelta(hours=12), "terminate", "policy lab")
    assert r.idle_below == 3 and r.on_finish == "terminate"
    g = guard.guard_doc(r, "m-1", LAUNCHED, "provisioner")
    assert g["jobs_dir"] == "/home/provisioner/.provisioner/jobs"
    assert (
        g["max_lifetime_at"] == "2026-12-07T22:00:00Z" and g["max_lifetime_action"] == "terminate"
    )
    assert g["on_finish"] == {"job": "run", "action": "terminate"}
    keep = guard.rules(experiment(on_finish="keep"), [])
    assert keep.on_finish is None and keep.autostop is None and keep.lifetime is None


def test_the_agent_sources_on_the_machine_are_the_same_program_leaner():
    sources = startup.agent_sources()
    for name, text in sources.items():
        assert text.startswith("#!/usr/bin/env python3\n")
        compile(text, name, "exec")
        assert '"""' not in text.split("\n", 2)[1]  # no module docstring
    whole = sum(len(Path(guard.__file__).with_name(n).read_text()) for n in sources)
    assert sum(map(len, sources.values())) < whole * 0.8


# --- plan and up say who enforces each rule ----------------------------------------------------


def lines(cloud: str, market: str, instance_type: str = "", **lifecycle) -> str:
    import providers

    r = guard.rules(experiment(**lifecycle), [])
    return "\n".join(guard.enforcement(r, providers.spec(cloud), market, instance_type))


@pytest.mark.parametrize("cloud", ["aws", "gcp", "yandex", "sbercloud", "sandbox"])
def test_where_a_power_off_ends_the_bill_the_machine_enforces_its_rules(cloud):
    said = lines(cloud, "reserved", "p3.2xlarge.8", autostop="10m", max_lifetime="48h")
    assert said.startswith("autostop 10m, on_finish stop, max_lifetime 2d (stop): on the machine")
    assert "compute billing ends" in said and "provisioner sweep" not in said


def test_on_azure_the_scheduler_must_deallocate_and_says_so():
    said = lines("azure", "spot", autostop="10m")
    assert "keeps billing until deallocated" in said
    assert "the scheduler (`provisioner sweep` from cron, or `provisioner scheduler run`)" in said
    assert "deallocates it — run one" in said and "on the machine (" not in said


def test_an_aws_spot_machine_powered_off_is_terminated_and_plan_says_so():
    said = lines("aws", "spot", on_finish="stop")
    assert "on_finish stop: on the machine (its agent powers it off; AWS then terminates" in said
    assert "its boot disk goes, volumes stay" in said


def test_huawei_flavors_that_bill_while_stopped_need_the_scheduler():
    assert "compute billing ends" in lines("sbercloud", "reserved", "pi2.2xlarge.4")
    said = lines("sbercloud", "reserved", "p2.2xlarge.8")
    assert "bills flavors with local disks" in said and "(p2.2xlarge.8)" in said
    assert "the scheduler (`provisioner sweep`" in said


def test_terminate_and_idle_rules_are_the_schedulers():
    said = lines("gcp", "reserved", on_finish="terminate", idle={"gpu_util_below": 5})
    assert "terminate: the machine only powers off; the scheduler" in said
    assert "idle rules (lifecycle.idle (30 min)): the scheduler" in said


def test_plan_lists_who_enforces_per_cloud_and_market(cli, home, tmp_path):
    from tests.conftest import write_settings, write_yaml

    data = sandbox_experiment("guarded") | {"run": "python train.py"}
    data["lifecycle"] = {"autostop": "10m"}
    spec = write_yaml(tmp_path / "guarded.yaml", data)
    cfg = write_settings(home)
    r = cli("--config", str(cfg), "plan", str(spec), "-o", "json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["guard"] == [
        "sandbox spot: autostop 10m, on_finish stop: on the machine (its agent powers it off; "
        "compute billing ends — Sandbox (simulated)), with no scheduler, endpoint or laptop needed"
    ]
    r = cli("--config", str(cfg), "plan", str(spec))
    assert "enforced by: sandbox spot: autostop 10m, on_finish stop: on the machine" in " ".join(
        r.out.split()
    )


@pytest.mark.parametrize(
    "bad", ["", "ssh-ed25519", 'ssh-ed25519 AAAA" x', "ssh-ed25519 AAA\nAAA", "x,y AAAA"]
)
def test_a_malformed_pull_key_is_refused_not_written(bad):
    with pytest.raises(ValueError, match="pull key"):
        startup.pull_line(bad)
