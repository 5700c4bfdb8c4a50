"""One contract suite: every behaviour of the adapter contract (providers/base.py), asserted the
same way on the sandbox and on each real cloud SDK against its wire-level emulator.

Each test takes the ``cloud`` fixture: a :class:`~tests.contract.harness.Harness` for one of the
six clouds. Where a cloud cannot do what a test needs, the test skips that cloud with the reason
its spec's capabilities give (or, for what only the test bench lacks, its harness's
``Harness.cannot``); an adapter bug is an ``xfail(strict=True)`` naming
the bug (:data:`KNOWN_BUGS`), so its fix shows up as an unexpected pass.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

import providers
from providers.base import (
    TAG_MACHINE,
    TAG_MANAGED_BY,
    AuthError,
    CapacityError,
    InstanceRef,
    InvalidRequest,
    MachineState,
    NotFound,
    Provider,
    QuotaError,
    Throttled,
)
from providers.spec import Capabilities
from tests.contract.harness import Harness

CLOUDS = providers.REGISTRY  # a cloud without a harness fails here, loudly
LIVE = (MachineState.PENDING, MachineState.RUNNING)

#: (test, cloud) → the adapter bug that makes it fail today.
KNOWN_BUGS: dict[tuple[str, str], str] = {}


def open_harness(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> AbstractContextManager[Harness]:
    """``tests/contract/<cloud>.py``'s ``harness``: every registered cloud has one."""
    module = importlib.import_module(f"tests.contract.{name}")
    opened: AbstractContextManager[Harness] = module.harness(monkeypatch, tmp_path)
    return opened


@pytest.fixture(params=CLOUDS)
def cloud(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[Harness]:
    bug = KNOWN_BUGS.get((request.node.originalname, request.param))
    if bug:
        request.applymarker(pytest.mark.xfail(strict=True, reason=bug))
    with open_harness(request.param, monkeypatch, tmp_path) as harness:
        assert isinstance(harness, Harness)
        yield harness


def needs(cloud: Harness, ability: str) -> None:
    """Skip this cloud, naming the cloud fact, when it cannot do ``ability``: a capability of
    its spec (the spec's reason), else what its harness cannot stage."""
    capabilities = providers.spec(cloud.name).capabilities
    if hasattr(capabilities, ability):
        if not getattr(capabilities, ability):
            pytest.skip(capabilities.why_not(ability))
    elif ability in cloud.cannot:
        pytest.skip(cloud.cannot[ability])


def test_every_ability_a_cloud_lacks_carries_its_reason() -> None:
    for name in CLOUDS:
        capabilities = providers.spec(name).capabilities
        for ability, reason in capabilities.why.items():
            assert not getattr(capabilities, ability) and reason.startswith(f"{name}: ")
    with pytest.raises(ValueError, match="stop_spot"):  # a new cloud cannot leave one out
        Capabilities(stop_spot=False, cap_spot_price=True, zones=True, batch=True)


def state_or_gone(provider: Provider, ref: InstanceRef) -> MachineState | None:
    """The machine's state, or None when the cloud answers NotFound."""
    try:
        return provider.get(ref).state
    except NotFound:
        return None


def assert_code(cloud: Harness, fault: str, err: Exception) -> None:
    """The adapter kept the cloud's own error code for ``fault``."""
    code = getattr(err, "code", None)
    assert code, f"{cloud.name}: {fault} error without the cloud's code"
    expected = cloud.codes[fault]
    assert expected is None or code == expected


def one_line_without_secrets(cloud: Harness, message: str) -> None:
    assert message and "\n" not in message
    for secret in cloud.secrets():
        assert secret not in message


# --- launch and idempotency ---------------------------------------------------------------


@pytest.mark.parametrize("spot", [False, True], ids=["on-demand", "spot"])
def test_launch_returns_a_live_instance_with_our_labels(cloud: Harness, spot: bool) -> None:
    request = cloud.launch_request(spot=spot)
    inst = cloud.provider().launch(request)

    assert inst.state in LIVE and inst.spot is spot
    assert (inst.name, inst.region, inst.zone) == (request.name, request.region, request.zone)
    assert inst.instance_type == request.instance_type
    assert dict(inst.labels).items() >= dict(request.labels).items()
    assert inst.machine_id == "m-1"
    assert cloud.machines() == [inst.id]
    got = cloud.provider().get(inst.ref)
    assert (got.id, got.spot, got.machine_id) == (inst.id, spot, "m-1")


def test_the_same_intent_twice_is_one_machine(cloud: Harness) -> None:
    first = cloud.provider().launch(cloud.launch_request())
    again = cloud.provider().launch(cloud.launch_request())  # a new process, the same intent
    assert again.id == first.id
    assert cloud.machines() == [first.id]


def test_a_lost_create_answer_then_a_retry_is_one_machine(cloud: Harness) -> None:
    needs(cloud, "lose_response")
    cloud.lose_next_response("create")
    inst = cloud.provider().launch(cloud.launch_request())  # the adapter's own retry
    assert inst.state in LIVE
    again = cloud.provider().launch(cloud.launch_request())  # the whole intent replayed
    assert again.id == inst.id
    assert cloud.machines() == [inst.id]
    keys = cloud.keys("create")  # AWS finds the first by its ClientToken and sends no second
    assert 1 <= len(keys) <= 3 and len(set(keys)) == 1  # never a create under a new key


def test_a_lost_stop_answer_is_retried_as_the_same_stop(cloud: Harness) -> None:
    needs(cloud, "lose_response")
    provider = cloud.provider()
    inst = provider.launch(cloud.launch_request())
    cloud.lose_next_response("stop")
    provider.stop(inst.ref)
    assert provider.get(inst.ref).state is MachineState.STOPPED
    keys = cloud.keys("stop")
    assert len(keys) == 2 and len(set(keys)) == 1


# --- errors -------------------------------------------------------------------------------


def test_a_zone_out_of_capacity_is_a_capacity_error_and_another_zone_works(
    cloud: Harness,
) -> None:
    provider = cloud.provider()
    zone = cloud.places[0][1]
    cloud.exhaust_capacity(zone)
    with pytest.raises(CapacityError) as err:
        provider.launch(cloud.launch_request("1", spot=True))
    assert_code(cloud, "capacity", err.value)
    assert err.value.code in str(err.value)
    assert cloud.machines() == []
    elsewhere = provider.launch(cloud.launch_request("2", spot=True, place=1))
    assert elsewhere.zone == cloud.places[1][1] and elsewhere.state in LIVE
    assert cloud.machines() == [elsewhere.id]


def test_a_quota_is_a_quota_error_scoped_to_the_region(cloud: Harness) -> None:
    cloud.exhaust_quota(cloud.places[0][0])
    with pytest.raises(QuotaError) as err:
        cloud.provider().launch(cloud.launch_request())
    assert err.value.scope == "region"
    assert_code(cloud, "quota", err.value)
    assert cloud.machines() == []


def test_refused_credentials_are_an_auth_error(cloud: Harness) -> None:
    cloud.deny_auth()
    with pytest.raises(AuthError) as err:
        cloud.provider().launch(cloud.launch_request())
    assert_code(cloud, "auth", err.value)
    one_line_without_secrets(cloud, str(err.value))
    assert cloud.machines() == []


def test_check_reports_refused_credentials(cloud: Harness) -> None:
    cloud.deny_auth()
    result = cloud.provider().check()
    assert not result.ok and result.cloud == cloud.name
    assert (cloud.codes["auth"] or "") in result.message  # the cloud's own word for it
    one_line_without_secrets(cloud, result.message)


def test_a_throttling_storm_within_the_bound_completes_with_one_machine(cloud: Harness) -> None:
    cloud.throttle(4)  # the default bound is 6 tries
    inst = cloud.provider().launch(cloud.launch_request())
    assert inst.state in LIVE
    assert cloud.create_calls() == 5  # 4 refused, then the one that went through
    assert cloud.machines() == [inst.id]


def test_throttled_creates_are_retried_under_one_key(cloud: Harness) -> None:
    needs(cloud, "idempotency_keys")
    cloud.throttle(2)
    cloud.provider().launch(cloud.launch_request())
    keys = cloud.keys("create")
    assert len(keys) == 3 and len(set(keys)) == 1


def test_throttling_past_the_bound_raises_throttled(cloud: Harness) -> None:
    cloud.throttle(100)
    with pytest.raises(Throttled) as err:
        cloud.provider(retry_attempts=3).launch(cloud.launch_request())
    assert_code(cloud, "throttled", err.value)
    assert cloud.create_calls() == 3  # exactly our bound: the SDK's own retries are off
    assert cloud.machines() == []


def test_a_slow_operation_is_waited_for(cloud: Harness) -> None:
    needs(cloud, "slow_operations")
    provider = cloud.provider()
    cloud.slow_operations(3)
    inst = provider.launch(cloud.launch_request())
    assert inst.state is MachineState.RUNNING
    assert cloud.operation_polls() >= 3
    provider.stop(inst.ref)
    assert provider.get(inst.ref).state is MachineState.STOPPED


# --- states -------------------------------------------------------------------------------


def can_stop_spot(cloud: Harness) -> bool:
    return providers.spec(cloud.name).capabilities.stop_spot


def test_a_preempted_spot_machine_reads_preempted_and_a_user_stop_stopped(cloud: Harness) -> None:
    provider = cloud.provider()
    taken = provider.launch(cloud.launch_request("1", spot=True))
    stopped_spot = provider.launch(cloud.launch_request("2", spot=True))
    stopped = provider.launch(cloud.launch_request("3"))
    console = provider.launch(cloud.launch_request("4"))

    cloud.preempt(taken)
    if can_stop_spot(cloud):
        provider.stop(stopped_spot.ref)
    else:  # what the capability says is what the cloud does: it refuses, and nothing changes
        with pytest.raises(InvalidRequest):
            provider.stop(stopped_spot.ref)
    provider.stop(stopped.ref)
    cloud.stop_from_outside(console)  # an on-demand machine stopped in the console

    got = provider.get(taken.ref)
    assert got.state is MachineState.PREEMPTED and got.state_reason
    spot_state = MachineState.STOPPED if can_stop_spot(cloud) else MachineState.RUNNING
    assert provider.get(stopped_spot.ref).state in (spot_state, MachineState.PENDING)
    assert provider.get(stopped.ref).state is MachineState.STOPPED
    assert provider.get(console.ref).state is MachineState.STOPPED
    states = {i.machine_id: i.state for i in provider.list_managed()}
    assert states["m-1"] is MachineState.PREEMPTED
    assert states["m-3"] is states["m-4"] is MachineState.STOPPED


def test_a_spot_machine_stopped_in_the_console_reads_stopped(cloud: Harness) -> None:
    needs(cloud, "console_stop_of_spot")
    provider = cloud.provider()
    inst = provider.launch(cloud.launch_request(spot=True))
    cloud.stop_from_outside(inst)
    assert provider.get(inst.ref).state is MachineState.STOPPED


def test_preemption_and_user_stops_are_told_apart_across_restarts(cloud: Harness) -> None:
    needs(cloud, "stop_spot")
    provider = cloud.provider()
    inst = provider.launch(cloud.launch_request(spot=True))
    provider.stop(inst.ref)
    provider.start(inst.ref)
    cloud.preempt(inst)  # an earlier user stop does not hide a later preemption
    assert provider.get(inst.ref).state is MachineState.PREEMPTED
    provider.start(inst.ref)
    assert provider.get(inst.ref).state in LIVE
    provider.stop(inst.ref)  # nor does an earlier preemption turn a user stop into one
    assert provider.get(inst.ref).state is MachineState.STOPPED


def test_a_preempted_machine_comes_back_with_its_disk(cloud: Harness) -> None:
    needs(cloud, "restart_preempted")
    provider = cloud.provider()
    inst = provider.launch(cloud.launch_request(spot=True, preemption_action="stop"))
    disk = cloud.boot_disk(inst)
    cloud.preempt(inst)
    assert provider.get(inst.ref).state is MachineState.PREEMPTED
    assert cloud.boot_disk(inst) == disk  # kept, stopped, with its disk
    provider.start(inst.ref)
    back = provider.get(inst.ref)
    assert back.id == inst.id and back.state in LIVE
    assert cloud.boot_disk(back) == disk
    assert cloud.machines() == [inst.id]


def test_a_preempted_machine_without_room_to_start_is_a_capacity_error(cloud: Harness) -> None:
    needs(cloud, "restart_preempted")
    provider = cloud.provider()
    inst = provider.launch(cloud.launch_request(spot=True, preemption_action="stop"))
    cloud.preempt(inst)
    cloud.exhaust_capacity(inst.zone or cloud.places[0][1])
    with pytest.raises(CapacityError) as err:
        provider.start(inst.ref)
    assert_code(cloud, "capacity", err.value)  # the cloud's own word for no stock
    got = provider.get(inst.ref)  # still there, still stopped: it can be started later
    assert got.id == inst.id and got.state is MachineState.PREEMPTED


def test_a_spot_machine_deleted_on_preemption_is_preempted_or_gone(cloud: Harness) -> None:
    needs(cloud, "delete_on_preemption")
    provider = cloud.provider()
    inst = provider.launch(cloud.launch_request(spot=True, preemption_action="terminate"))
    cloud.preempt(inst)
    # PREEMPTED, or None where the cloud forgets a deleted machine at once (GCP, Azure)
    assert state_or_gone(provider, inst.ref) in (MachineState.PREEMPTED, None)
    assert all(i.state is not MachineState.RUNNING for i in provider.list_managed())


def test_stop_start_terminate_are_idempotent(cloud: Harness) -> None:
    provider = cloud.provider()
    inst = provider.launch(cloud.launch_request())
    provider.stop(inst.ref)
    provider.stop(inst.ref)
    assert provider.get(inst.ref).state is MachineState.STOPPED
    provider.start(inst.ref)
    provider.start(inst.ref)
    assert provider.get(inst.ref).state in LIVE
    provider.terminate(inst.ref)
    provider.terminate(inst.ref)
    assert state_or_gone(provider, inst.ref) in (MachineState.TERMINATED, None)
    assert all(i.state is MachineState.TERMINATED for i in provider.list_managed())
    assert cloud.machines() == []


def test_a_machine_deleted_elsewhere_is_not_found_and_terminating_it_is_no_error(
    cloud: Harness,
) -> None:
    provider = cloud.provider()
    inst = provider.launch(cloud.launch_request())
    cloud.delete_from_outside(inst)
    with pytest.raises(NotFound) as err:
        provider.get(inst.ref)
    assert_code(cloud, "not_found", err.value)
    provider.terminate(inst.ref)
    assert [i for i in provider.list_managed() if i.state is not MachineState.TERMINATED] == []

    never = cloud.unknown_ref()
    with pytest.raises(NotFound) as err:
        provider.get(never)
    assert_code(cloud, "not_found", err.value)
    provider.terminate(never)


# --- listing ------------------------------------------------------------------------------


def test_list_managed_returns_only_our_machines(cloud: Harness) -> None:
    provider = cloud.provider()
    ours = [
        provider.launch(cloud.launch_request(str(n), place=n % len(cloud.places)))
        for n in range(len(cloud.places) + 1)
    ]
    cloud.add_foreign_machine(None)
    cloud.add_foreign_machine({TAG_MANAGED_BY: "terraform", TAG_MACHINE: "m-0"})

    listed = provider.list_managed()
    assert sorted(i.id for i in listed) == sorted(i.id for i in ours)
    assert all(i.labels[TAG_MANAGED_BY] == "provisioner" for i in listed)
    [one] = provider.list_managed(machine_id="m-1")
    assert one.id == ours[1].id and one.zone == ours[1].zone
    for region in {r for r, _ in cloud.places}:
        here = provider.list_managed(regions=[region])
        assert sorted(i.id for i in here) == sorted(i.id for i in ours if i.region == region)
    assert provider.list_managed(regions=[cloud.empty_region]) == []


def test_list_managed_reads_every_page(cloud: Harness) -> None:
    needs(cloud, "pages")
    cloud.cap_page_size(2)
    provider = cloud.provider()
    ours = [
        provider.launch(cloud.launch_request(str(n), place=n % len(cloud.places))) for n in range(5)
    ]
    cloud.add_foreign_machine(None)
    cloud.add_foreign_machine({TAG_MANAGED_BY: "terraform"})
    assert sorted(i.id for i in provider.list_managed()) == sorted(i.id for i in ours)
    assert cloud.list_pages() >= 1  # the pages after the first were asked for


# --- check --------------------------------------------------------------------------------


def test_check_without_credentials_answers_at_once_in_one_line(
    cloud: Harness, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    needs(cloud, "credentials")
    cloud.remove_credentials(monkeypatch, tmp_path)
    started = time.monotonic()
    result = cloud.provider().check()
    took = time.monotonic() - started
    assert not result.ok and result.cloud == cloud.name
    assert result.message.startswith(f"{cloud.name}: no credentials found")
    assert cloud.credential_hint in result.message
    one_line_without_secrets(cloud, result.message)
    assert cloud.calls() == 0  # nothing was sent anywhere
    assert took < 10  # no network timeout was waited out


def test_check_with_credentials_says_ok(cloud: Harness) -> None:
    result = cloud.provider().check()
    assert result.ok and result.cloud == cloud.name
    assert cloud.ok_hint in result.message
    one_line_without_secrets(cloud, result.message)


# --- batch forms --------------------------------------------------------------------------


def test_stop_many_and_terminate_many_act_on_every_machine(cloud: Harness) -> None:
    provider = cloud.provider()
    machines = [
        provider.launch(cloud.launch_request(str(n), place=n % len(cloud.places)))
        for n in range(len(cloud.places) + 1)
    ]
    refs = [m.ref for m in machines]
    assert provider.stop_many(refs) == dict.fromkeys(refs)
    assert all(provider.get(r).state is MachineState.STOPPED for r in refs)
    assert provider.stop_many(refs) == dict.fromkeys(refs)  # idempotent, like stop
    assert provider.terminate_many(refs) == dict.fromkeys(refs)
    assert all(state_or_gone(provider, r) in (MachineState.TERMINATED, None) for r in refs)
    assert provider.terminate_many(refs) == dict.fromkeys(refs)
    assert cloud.machines() == []


def test_one_missing_machine_does_not_fail_the_batch(cloud: Harness) -> None:
    provider = cloud.provider()
    gone, kept, other = (provider.launch(cloud.launch_request(str(n))) for n in range(3))
    cloud.delete_from_outside(gone)
    refs = [gone.ref, kept.ref, other.ref]

    stopped = provider.stop_many(refs)
    assert isinstance(stopped[gone.ref], NotFound)
    assert_code(cloud, "not_found", stopped[gone.ref])  # type: ignore[arg-type]
    assert (stopped[kept.ref], stopped[other.ref]) == (None, None)
    assert provider.get(kept.ref).state is provider.get(other.ref).state is MachineState.STOPPED

    never = cloud.unknown_ref()
    assert provider.terminate_many([never, *refs]) == dict.fromkeys([never, *refs])
    assert cloud.machines() == []


def test_a_machine_that_cannot_be_stopped_does_not_fail_the_batch(cloud: Harness) -> None:
    provider = cloud.provider()
    ended, kept = (provider.launch(cloud.launch_request(str(n))) for n in range(2))
    provider.terminate(ended.ref)
    result = provider.stop_many([ended.ref, kept.ref])
    assert set(result) == {ended.ref, kept.ref}
    assert result[kept.ref] is None
    assert provider.get(kept.ref).state is MachineState.STOPPED
