"""`provisioner selftest --cloud aws` through the AWS emulator (moto behind the wire-level
wrapper) and a real machine stood in by this host: its address is a real sshd on loopback, its
jobs run under the supervisor pushed over SSH, and its agent — the real ``provisioner/agent.py``
with the ``guard.json`` the startup data carried, read back from the user data EC2 received —
powers it off by telling the emulator "shut down from inside" (what EC2 then does to a one-time
spot instance: terminated). The pull reads the agent's report with the team's key, restricted
to that report in ``authorized_keys`` as the startup data restricts it."""

# ruff: noqa: F811  (the fixtures of tests/test_remote_jobs.py, imported, are taken as arguments)
from __future__ import annotations

import base64
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from providers.userdata import decoded
from provisioner import catalog, keys, selftest, startup
from provisioner.app import App
from tests.conftest import make_settings
from tests.contract.test_fits import unwrap
from tests.sshd import NO_SSHD, SSHD
from tests.test_remote_jobs import (  # noqa: F401  (fixtures)
    emu,
    machine_home,
    sshd,
    user_key,
)

pytestmark = [
    pytest.mark.slow,  # moto, a real sshd, the real agent and a real job
    pytest.mark.skipif(
        os.geteuid() != 0, reason="the machine's volume is mounted as its startup data would: root"
    ),
    pytest.mark.skipif(SSHD is None or shutil.which("rsync") is None, reason=NO_SSHD + "; rsync"),
]

AGENT = Path(__file__).resolve().parents[1] / "provisioner" / "agent.py"


class Machine(threading.Thread):
    """This host as the one machine the selftest launches: once EC2 has it, its agent runs
    here over a state dir of its own, as the startup data would have started it."""

    def __init__(self, emu, sshd_dir: Path, jobs_dir: Path, state: Path, app: App) -> None:
        super().__init__(daemon=True)
        self.emu, self.sshd_dir, self.jobs_dir, self.state, self.app = (
            emu,
            sshd_dir,
            jobs_dir,
            state,
            app,
        )
        self.done = threading.Event()
        self.agent: subprocess.Popen[bytes] | None = None
        self.halted = ""
        self.mounted = False

    def run(self) -> None:
        while not self.done.is_set() and not self.emu.run_instances_requests:
            time.sleep(0.1)
        if self.done.is_set():
            return
        call = self.emu.calls("RunInstances")[-1]
        data = unwrap(decoded(base64.b64decode(call.params["UserData"])))
        guard = data.split("guard.json <<'PV_GUARD_EOF'\n", 1)[1].split("\nPV_GUARD_EOF", 1)[0]
        self.state.mkdir(parents=True, exist_ok=True)
        doc = guard.replace(startup.STATE_DIR, str(self.state))
        (self.state / "guard.json").write_text(
            doc.replace(f'"/home/{_user()}/.provisioner/jobs"', f'"{self.jobs_dir}"')
        )
        # the pull key's line, as the startup data writes it, its command pointed here
        public = keys.published_pull_key(self.app)
        assert public is not None
        here = f"{sys.executable} {AGENT} --report --state-dir {self.state}"
        line = startup.pull_line(public).replace(f"{startup.AGENT_BIN} --report", here)
        with (self.sshd_dir / "authorized_keys").open("a") as f:
            f.write(line + "\n")
        # its volume mounted where the experiment wants it, as the startup data's mount script
        # does (the job waits for it: provisioner-job refuses to run without its volumes)
        Path(selftest.MOUNT).mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "selftest", selftest.MOUNT], check=True)
        self.mounted = True
        halt = self.state / "halted"
        self.agent = subprocess.Popen(
            [
                sys.executable,
                str(AGENT),
                "--state-dir",
                str(self.state),
                "--interval",
                "1",
                "--shutdown-cmd",
                shlex.join(["touch", str(halt)]),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        while not self.done.is_set() and not halt.exists():
            time.sleep(0.2)
        if halt.exists():  # the guest's power-off, as EC2 answers it
            self.halted = self.emu.guest_shutdown(_instance_id(self.emu, call.region), call.region)
        self.agent.terminate()

    def stop(self) -> None:
        self.done.set()
        self.join(30)
        if self.agent is not None and self.agent.poll() is None:
            self.agent.kill()
        if self.mounted:
            subprocess.run(["umount", selftest.MOUNT], check=False)


def _user() -> str:
    import providers

    return providers.spec("aws").ssh_user


def _instance_id(emu, region: str) -> str:
    ec2 = emu.client("ec2", region)
    found = [
        i["InstanceId"]
        for r in ec2.describe_instances()["Reservations"]
        for i in r["Instances"]
        if i["State"]["Name"] == "running"
    ]
    assert len(found) == 1, found
    return found[0]


@pytest.fixture
def aws_app(home: Path, emu) -> Iterator[App]:
    options = {"endpoint": emu.endpoint_url, "retry_base_seconds": 0.001}
    app = App(make_settings(home, clouds={"aws": options}))  # the wall clock, as on a machine
    catalog.refresh(app.settings, "aws", app.provider("aws").fetch_offers())
    yield app
    app.close()


def test_selftest_on_aws_checks_every_step_and_leaves_nothing(
    emu, sshd, user_key, machine_home, aws_app, tmp_path
):
    machine = Machine(
        emu, sshd[1], machine_home / ".provisioner" / "jobs", tmp_path / "agent", aws_app
    )
    machine.start()
    try:
        result = selftest.run(aws_app, "aws", job_seconds=2, timeout=timedelta(minutes=4), poll=1.0)
    finally:
        machine.stop()
    steps = {c.step: c for c in result.checks}
    assert all(c.ok for c in result.checks), [(c.step, c.detail) for c in result.checks]
    assert list(steps) == [
        "leftovers", "credentials", "launch", "reachable", "agent", "job end", "own stop",
        "billing tag", "cleanup",
    ]  # fmt: skip
    assert machine.halted in ("stopped", "terminated")  # the machine powered itself off
    assert "on-finish" in steps["own stop"].detail
    assert result.left == [] and result.cost
    region = emu.calls("RunInstances")[-1].region
    ec2 = emu.client("ec2", region)
    states = {
        i["State"]["Name"] for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]
    }
    assert states == {"terminated"}
    assert [v for v in ec2.describe_volumes()["Volumes"] if v.get("Tags")] == []
