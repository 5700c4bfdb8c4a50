"""A machine's OS shut down from inside (what its guard does: ``shutdown -h now``), on every
cloud through its harness and emulator: reconcile records the stop at the cloud's own time, and
the ledger stops compute billing exactly where the cloud does — at the shutdown where it ends
billing, at provisioner's deallocation where the cloud keeps billing a powered-off VM (Azure).

What each cloud does (its emulator's ``guest_shutdown`` cites the source):

- sandbox, GCP, SberCloud: stopped, dated; compute billing ends at the shutdown.
- AWS: stopped (the default InstanceInitiatedShutdownBehavior of an on-demand instance), dated
  in its StateTransitionReason to the second; a one-time spot instance is terminated.
- Yandex: stopped, but its API dates no stop of a regular VM: billing is closed when seen.
- Azure: PowerState/stopped, still allocated and billed; reconcile deallocates it.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import select

from providers.base import Instance, MachineState
from provisioner import ledger, machines
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.models import Event, Machine, UsageInterval, new_id
from provisioner.schema import MachineStatus
from tests.conftest import make_settings
from tests.contract.harness import Harness
from tests.contract.test_contract import CLOUDS, open_harness

S = MachineStatus
#: the clouds whose API gives no time for a stop made from inside a regular machine
UNDATED = {"yandex"}
#: the clouds that keep billing a machine shut down from inside until stopped through the API
KEEPS_BILLING = {"azure"}


@pytest.fixture(params=CLOUDS)
def cloud(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[Harness]:
    with open_harness(request.param, monkeypatch, tmp_path) as harness:
        yield harness


def _recorded(app: App, cloud: str, inst: Instance, at: datetime) -> Machine:
    """The machine in the state as `up` leaves it: running since ``at``, compute billed."""
    m = Machine(
        id=new_id(),
        name="exp-1",
        project="vision",
        owner="ana@example.com",
        status=S.REQUESTED,
        spec={},
        cloud=cloud,
        region=inst.region,
        zone=inst.zone,
        instance_type=inst.instance_type,
        gpu="T4",
        gpu_count=1,
        market="reserved",
        instance_id=inst.id,
        resource_name=inst.name,
        rate=Decimal("0.50"),
        currency="USD",
        created_at=at,
        launched_at=at,
    )
    with app.db.session() as s:
        s.add(m)
        s.flush()
        ledger.record_transition(s, m, S.RUNNING, at, event="launched")
    return m


def test_a_guest_shutdown_is_billed_to_the_clouds_own_stop(cloud: Harness, home: Path) -> None:
    provider = cloud.provider()
    inst = provider.launch(cloud.launch_request())
    # the emulators date by the wall clock or their own: the test's clock brackets them all
    t0 = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
    clock = ManualClock(t0)
    app = App(make_settings(home), clock)
    app.use_provider(cloud.name, provider)
    try:
        m = _recorded(app, cloud.name, inst, t0)
        at = t0 + timedelta(minutes=10)
        cloud.guest_shutdown(inst, at)
        clock.set(datetime.now(UTC) + timedelta(hours=1))
        seen = machines.reconcile(app)
        assert [o.error for o in seen] == [None] * len(seen)

        after = provider.get(inst.ref)
        assert after.state is MachineState.STOPPED and not after.halted_billing
        with app.db.session() as s:
            row = s.get(Machine, m.id)
            assert row is not None and row.status == S.STOPPED
            [stopped] = s.scalars(
                select(Event).where(Event.machine_id == m.id, Event.kind == S.STOPPED)
            ).all()
            [compute] = s.scalars(
                select(UsageInterval).where(
                    UsageInterval.machine_id == m.id, UsageInterval.kind == "compute"
                )
            ).all()
        # no guard's report here: the event says no reason is known
        assert stopped.reason == "outside-provisioner"
        assert "no reason known" in stopped.detail["by"]
        if cloud.name in KEEPS_BILLING:
            # billed past the shutdown, to the deallocation provisioner made, as the cloud bills
            assert "ended_billing" in stopped.detail
            assert after.stopped_at is not None and after.stopped_at > at
            assert compute.ended_at == after.stopped_at == stopped.at
        elif cloud.name in UNDATED:
            assert after.stopped_at is None
            assert compute.ended_at == stopped.at == clock.now()
            assert stopped.detail["at_source"] == "noticed"
        else:
            assert after.stopped_at == at  # the cloud's own time of the shutdown
            assert compute.ended_at == stopped.at == at
            assert stopped.detail["at_source"] == "cloud"
    finally:
        app.close()


def test_an_aws_one_time_spot_instance_shut_down_from_inside_is_terminated(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with open_harness("aws", monkeypatch, tmp_path) as cloud:
        provider = cloud.provider()
        inst = provider.launch(cloud.launch_request(spot=True))
        at = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)
        cloud.guest_shutdown(inst, at)
        got = provider.get(inst.ref)
        # terminated, not preempted: no relaunch, and its time is the shutdown's
        assert got.state is MachineState.TERMINATED and got.stopped_at == at
        assert "Client.InstanceInitiatedShutdown" in (got.state_reason or "")
        assert cloud.emu.open_spot_requests() == []  # type: ignore[attr-defined]
