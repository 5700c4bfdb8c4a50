"""`provisioner selftest --cloud C` on every cloud, each through its real SDK against its
emulator (the contract suite's harness, tests/contract/<cloud>.py), with this host standing in
for the one machine the selftest launches. The emulator answers the machine's public address
as 127.0.0.1 (its ``public_address`` knob), where a real sshd runs; its jobs run under the
supervisor pushed over SSH; its agent — the agent files as the startup data shipped them, with the
``guard.json`` the startup data carried, read back from what the cloud received (EC2's
UserData, GCP's startup-script, Azure's customData, Yandex's and SberCloud's user-data) —
powers it off, and the harness tells the emulator "shut down from inside" (``guest_shutdown``:
what each cloud does then is cited there). The pull reads the agent's report with the team's
key, restricted to that report in ``authorized_keys`` as the startup data restricts it, while
the machine runs; halted, it is out of reach as a real one's is, and the stop is the guard's by
what was recorded (its run exited, ``on_finish: stop``).

What differs by cloud, and is asserted (:data:`AFTER`):

- AWS: the one-time spot instance shut down from inside is terminated, dated by EC2.
- GCP: the spot VM is stopped (TERMINATED), dated by ``lastStopTimestamp``.
- Azure: the VM is powered off but still allocated and billed; reconcile deallocates it, and
  the ledger bills to that deallocation.
- Yandex, SberCloud: a spot machine halted without a stop call reads as preempted; it is
  recorded as the guard's stop instead (no preemption: no relaunch, no notice). Yandex dates no
  stop: it is dated by the machine's last heartbeat or pull.
"""

# ruff: noqa: F811  (the fixtures of tests/test_remote_jobs.py, imported, are taken as arguments)
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

import providers
from providers.base import MachineState
from providers.gcp.prices import API_KEY_ENV
from provisioner import catalog, keys, selftest, startup
from provisioner.app import App
from provisioner.models import Event, Machine, UsageInterval
from provisioner.schema import MachineStatus as S
from tests.conftest import make_settings
from tests.contract.harness import Harness
from tests.contract.test_contract import open_harness
from tests.contract.test_fits import received, unwrap
from tests.sshd import NO_SSHD, SSHD
from tests.test_azure import PRICE_ROWS
from tests.test_remote_jobs import machine_home, sshd, user_key  # noqa: F401  (fixtures)
from tests.test_yandex import billing_fixture

pytestmark = [
    pytest.mark.slow,  # an emulator, a real sshd, the real agent and a real job
    pytest.mark.skipif(
        os.geteuid() != 0, reason="the machine's volume is mounted as its startup data would: root"
    ),
    pytest.mark.skipif(SSHD is None or shutil.which("rsync") is None, reason=NO_SSHD + "; rsync"),
]


def shipped(data: str, lib: Path) -> Path:
    """The agent's files as the startup data writes them (shrunk), written to ``lib``: its
    agent.py — so the code the cloud received is the code that runs here."""
    lib.mkdir(parents=True, exist_ok=True)
    for name in ("agent.py", "agent_guard.py"):
        head = f"cat > {startup.AGENT_LIB}/{name} <<'PV_AGENT_EOF'\n"
        (lib / name).write_text(data.split(head, 1)[1].split("PV_AGENT_EOF\n", 1)[0])
    return lib / "agent.py"


CLOUDS = [c for c in providers.REGISTRY if c != "sandbox"]  # the sandbox: tests/test_selftest.py

#: cloud → (what the cloud says of the machine right after its guest shut down, the status the
#: stop is recorded as, what the stop event's detail says of how it was read and dated)
AFTER: dict[str, tuple[MachineState, str, dict[str, str]]] = {
    "aws": (MachineState.TERMINATED, S.TERMINATED, {"at_source": "cloud"}),
    "gcp": (MachineState.STOPPED, S.STOPPED, {"at_source": "cloud"}),
    # still allocated and billed (STOPPING): stopped through the API, dated by that operation
    "azure": (MachineState.STOPPING, S.STOPPED, {"at_source": "cloud"}),
    # a preemptible VM STOPPED with no stop operation; undated: the machine's last word
    "yandex": (
        MachineState.PREEMPTED,
        S.STOPPED,
        {"read_as": "preempted", "at_source": "heartbeat"},
    ),
    "sbercloud": (
        MachineState.PREEMPTED,
        S.STOPPED,
        {"read_as": "preempted", "at_source": "cloud"},
    ),
}
HALTS = (S.STOPPED, S.PREEMPTED, S.TERMINATED)


class Host(threading.Thread):
    """This host as the one machine the selftest launches: once the cloud has it, its agent
    runs here over a state dir of its own, as the startup data would have started it; when
    the agent powers the machine off, the cloud is told its guest shut down."""

    def __init__(self, cloud: Harness, sshd_dir: Path, home: Path, state: Path, app: App):
        super().__init__(daemon=True)
        self.cloud, self.sshd_dir, self.state, self.app = cloud, sshd_dir, state, app
        self.jobs_dir = home / ".provisioner" / "jobs"
        self.done = threading.Event()
        self.agent: subprocess.Popen[bytes] | None = None
        self.agent_py = state.parent / "lib" / "agent.py"
        self.halted: MachineState | None = None  # what the cloud says right after
        self.halted_at: datetime | None = None  # when its OS shut down
        self.mounted = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # said by stop(): the test fails with it, not by timing out
            self.error = e

    def _run(self) -> None:
        while not self.done.is_set() and not self._launched():
            time.sleep(0.1)
        if self.done.is_set():
            return
        self._install(unwrap(received(self.cloud)))
        halt = self.state / "halted"
        self.agent = subprocess.Popen(
            [
                *(
                    sys.executable,
                    str(self.agent_py),
                    "--state-dir",
                    str(self.state),
                    "--interval",
                    "1",
                ),
                *("--shutdown-cmd", shlex.join(["touch", str(halt)])),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        while not self.done.is_set() and not halt.exists():
            time.sleep(0.2)
        if halt.exists():  # the guest's power-off, as its cloud answers it
            provider = self.cloud.provider()
            [inst] = [i for i in provider.list_managed() if i.state is MachineState.RUNNING]
            self.halted_at = datetime.now(UTC).replace(microsecond=0)
            self.cloud.guest_shutdown(inst, self.halted_at)
            self.halted = provider.get(inst.ref).state
        self.agent.terminate()

    def _launched(self) -> bool:
        provider = self.cloud.provider()
        return any(i.state is MachineState.RUNNING for i in provider.list_managed())

    def _install(self, data: str) -> None:
        """What the startup data does here: the guard's config, the pull key, the volume."""
        guard = data.split("guard.json <<'PV_GUARD_EOF'\n", 1)[1].split("\nPV_GUARD_EOF", 1)[0]
        self.agent_py = shipped(data, self.state.parent / "lib")
        self.state.mkdir(parents=True, exist_ok=True)
        user = providers.spec(self.cloud.name).ssh_user
        doc = guard.replace(startup.STATE_DIR, str(self.state))
        (self.state / "guard.json").write_text(
            doc.replace(f'"/home/{user}/.provisioner/jobs"', f'"{self.jobs_dir}"')
        )
        # the pull key's line, as the startup data writes it, its command pointed here
        public = keys.published_pull_key(self.app)
        assert public is not None
        here = f"{sys.executable} {self.agent_py} --report --state-dir {self.state}"
        line = startup.pull_line(public).replace(f"{startup.AGENT_BIN} --report", here)
        with (self.sshd_dir / "authorized_keys").open("a") as f:
            f.write(line + "\n")
        # its volume mounted where the experiment wants it, as the startup data's mount script
        # does (the job waits for it: provisioner-job refuses to run without its volumes)
        Path(selftest.MOUNT).mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "selftest", selftest.MOUNT], check=True)
        self.mounted = True

    def stop(self) -> None:
        self.done.set()
        self.join(30)
        if self.agent is not None and self.agent.poll() is None:
            self.agent.kill()
        if self.mounted:
            subprocess.run(["umount", selftest.MOUNT], check=False)
        if self.error is not None:
            raise AssertionError(f"the machine failed: {self.error!r}") from self.error


@pytest.fixture(params=CLOUDS)
def cloud(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[Harness]:
    with open_harness(request.param, monkeypatch, tmp_path) as harness:
        harness.emu.public_address = "127.0.0.1"  # type: ignore[attr-defined]
        yield harness


def _priced(cloud: Harness, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The cloud's price list, where its emulator starts without one (each cloud's own tests
    read these: tests/test_<cloud>.py); the settings' prices for SberCloud, whose API has none."""
    emu: Any = cloud.emu  # type: ignore[attr-defined]
    if cloud.name == "gcp":
        monkeypatch.setenv(API_KEY_ENV, emu.billing_api_key)
    elif cloud.name == "azure":
        emu.prices = list(PRICE_ROWS)
    elif cloud.name == "yandex":
        emu.skus = billing_fixture()
    elif cloud.name == "sbercloud":
        return {"sbercloud": {"pi2.2xlarge.4": {"price": "95", "spot_price": "30"}}}
    return {}


@pytest.fixture
def cloud_app(home: Path, cloud: Harness, monkeypatch: pytest.MonkeyPatch) -> Iterator[App]:
    prices = _priced(cloud, monkeypatch)
    # the wall clock, as on a machine
    app = App(make_settings(home, clouds={cloud.name: {}}, prices=prices))
    app.use_provider(cloud.name, cloud.provider())
    catalog.refresh(app.settings, cloud.name, app.provider(cloud.name).fetch_offers())
    yield app
    app.close()


def test_selftest_checks_every_step_and_leaves_nothing(
    cloud: Harness, sshd, user_key, machine_home, cloud_app: App, tmp_path: Path
) -> None:
    host = Host(cloud, sshd[1], machine_home, tmp_path / "agent", cloud_app)
    host.start()
    try:
        result = selftest.run(
            cloud_app, cloud.name, job_seconds=2, timeout=timedelta(minutes=1), poll=1.0
        )
    finally:
        host.stop()
    steps = {c.step: c for c in result.checks}
    assert all(c.ok for c in result.checks), [(c.step, c.detail) for c in result.checks]
    assert list(steps) == [
        "leftovers", "credentials", "launch", "reachable", "agent", "job end", "own stop",
        "billing tag", "cleanup",
    ]  # fmt: skip
    assert "on-finish" in steps["own stop"].detail
    assert result.left == [] and result.cost
    assert cloud.machines() == [] and cloud.provider().volumes.ours() == []

    cloud_state, status, read = AFTER[cloud.name]
    assert host.halted is cloud_state  # the machine powered itself off; its cloud says so
    with cloud_app.db.session() as s:
        m = s.scalars(select(Machine).where(Machine.name == result.name)).one()
        halts = s.scalars(
            select(Event.kind)
            .where(Event.machine_id == m.id, Event.kind.in_(HALTS))
            .order_by(Event.id)
        ).all()
        [stop] = s.scalars(
            select(Event).where(Event.machine_id == m.id, Event.kind == status)
        ).all()
        [compute] = s.scalars(
            select(UsageInterval).where(
                UsageInterval.machine_id == m.id, UsageInterval.kind == "compute"
            )
        ).all()
    # a guard's stop, never a preemption (no relaunch, nobody told their machine was taken)
    assert halts[0] == status and S.PREEMPTED not in halts
    assert stop.reason == "on-finish"
    assert stop.detail.items() >= read.items()
    assert stop.detail["by"] == "the machine's guard"
    assert compute.ended_at == stop.at  # billed to the stop, as dated
    assert host.halted_at is not None
    if cloud.name == "azure":  # powered off, still billed: provisioner deallocated it, dated by
        # ARM's clock (logical in the emulator: tests/contract/test_guest_shutdown.py compares)
        assert "ended_billing" in stop.detail
        deallocated = cloud.emu.requests_to("POST", "/deallocate")  # type: ignore[attr-defined]
        assert len(deallocated) == 1
    elif read["at_source"] == "cloud":
        assert stop.at == host.halted_at  # the cloud's own time of the power-off
