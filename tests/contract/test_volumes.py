"""The volume contract: network disks that outlive machines (providers/base.py,
``VolumeService``, the adapter's ``volumes``), asserted the same way on every cloud through its
harness (tests/contract/harness.py) and the cloud's real SDK against its emulator.

A cloud whose adapter has no volume service (``volumes`` is None) skips, saying so; every cloud
of the registry has one today.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import providers
from providers.base import (
    TAG_MANAGED_BY,
    TAG_MANAGED_BY_VALUE,
    TAG_OWNER,
    TAG_PROJECT,
    Instance,
    InvalidRequest,
    MachineState,
    NotFound,
    Provider,
    Volume,
    VolumeRequest,
    VolumeState,
)
from tests.contract.harness import Harness
from tests.contract.test_contract import CLOUDS, open_harness

#: (test, cloud) → the adapter bug that makes it fail today (as test_contract.KNOWN_BUGS).
KNOWN_BUGS: dict[tuple[str, str], str] = {}
SIZE_GB = 10  # at or above every cloud's smallest network disk (GCP pd-balanced, EVS: 10 GB)


@pytest.fixture(params=CLOUDS)
def cloud(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[Harness]:
    bug = KNOWN_BUGS.get((request.node.originalname, request.param))
    if bug:
        request.applymarker(pytest.mark.xfail(strict=True, reason=bug))
    with open_harness(request.param, monkeypatch, tmp_path) as harness:
        if not providers.has_volumes(harness.name):
            pytest.skip(f"{harness.name}: its adapter has no volume service")
        yield harness


def volume_labels(project: str = "vision") -> dict[str, str]:
    return {
        TAG_MANAGED_BY: TAG_MANAGED_BY_VALUE,
        TAG_PROJECT: project,
        TAG_OWNER: "ana-example-com",
    }


def volume_request(
    cloud: Harness, key: str = "1", *, place: int = 0, labels: dict[str, str] | None = None
) -> VolumeRequest:
    """Volume ``vol-<key>`` with token ``vtok-<key>`` at ``cloud.places[place]``."""
    region, zone = cloud.places[place]
    return VolumeRequest(
        name=f"vol-{key}",
        token=f"vtok-{key}",
        region=region,
        zone=zone,
        size_gb=SIZE_GB,
        labels=volume_labels() if labels is None else labels,
    )


def launch(cloud: Harness, provider: Provider, key: str, place: int = 0) -> Instance:
    inst = provider.launch(cloud.launch_request(key, place=place))
    assert inst.state in (MachineState.PENDING, MachineState.RUNNING)
    return inst


def volume_or_gone(provider: Provider, volume: Volume) -> Volume | None:
    try:
        return provider.volumes.get(volume.ref)
    except NotFound:
        return None


# --- create, get, list --------------------------------------------------------------------


def test_create_is_idempotent_by_token_and_get_reads_the_volume(cloud: Harness) -> None:
    request = volume_request(cloud)
    made = cloud.provider().volumes.create(request)
    again = cloud.provider().volumes.create(request)  # a new process, the same intent

    assert again.id == made.id
    assert made.state in (VolumeState.CREATING, VolumeState.AVAILABLE)
    got = cloud.provider().volumes.get(made.ref)
    assert got.id == made.id and got.state is VolumeState.AVAILABLE
    assert (got.name, got.region, got.zone) == (request.name, request.region, request.zone)
    assert got.size_gb == SIZE_GB and got.attached_to is None
    assert dict(got.labels).items() >= dict(request.labels).items()
    assert [v.id for v in cloud.provider().volumes.ours()] == [made.id]  # one volume, not two


def test_list_volumes_finds_only_ours_in_each_region_with_one_call_a_region(
    cloud: Harness,
) -> None:
    provider = cloud.provider()
    ours = [
        provider.volumes.create(volume_request(cloud, "1")),
        provider.volumes.create(volume_request(cloud, "2", place=1)),
    ]
    # another region, where the cloud has one for this adapter (Yandex has one region, a
    # SberCloud adapter serves the one of its endpoint): both places are then in the same one
    far = [n for n, (region, _) in enumerate(cloud.places) if region != cloud.places[0][0]]
    if far:
        ours.append(provider.volumes.create(volume_request(cloud, "3", place=far[0])))
    foreign = {TAG_MANAGED_BY: "terraform", TAG_PROJECT: "vision"}
    provider.volumes.create(volume_request(cloud, "4", labels=foreign))
    provider.volumes.create(volume_request(cloud, "5", labels={}))
    launch(cloud, provider, "1")  # its boot disk carries our tags on some clouds: not a volume

    listed = provider.volumes.ours()
    assert sorted(v.id for v in listed) == sorted(v.id for v in ours)
    assert all(v.labels[TAG_MANAGED_BY] == TAG_MANAGED_BY_VALUE for v in listed)
    for region in {r for r, _ in cloud.places}:
        here = provider.volumes.ours(regions=[region])
        assert sorted(v.id for v in here) == sorted(v.id for v in ours if v.region == region)
    assert provider.volumes.ours(regions=[cloud.empty_region]) == []

    before = cloud.calls()
    provider.volumes.ours(regions=[cloud.places[0][0]])
    assert cloud.calls() - before == 1  # one page, one request


# --- attach rules -------------------------------------------------------------------------


def test_attach_is_idempotent_and_the_cloud_refuses_another_zone_or_a_second_machine(
    cloud: Harness,
) -> None:
    provider = cloud.provider()
    first = launch(cloud, provider, "1")
    second = launch(cloud, provider, "2")  # same zone as the first
    elsewhere = launch(cloud, provider, "3", place=1)  # same region, another zone
    volume = provider.volumes.create(volume_request(cloud))

    provider.volumes.attach(volume.ref, first.ref, 0)
    got = provider.volumes.get(volume.ref)
    assert (got.state, got.attached_to) == (VolumeState.IN_USE, first.id)
    provider.volumes.attach(volume.ref, first.ref, 0)  # again: no-op
    assert provider.volumes.get(volume.ref).attached_to == first.id

    # The adapters create single-attach disks only (EBS multi-attach needs io1/io2 with
    # MultiAttachEnabled; GCP shares READ_ONLY disks only; Azure needs maxShares > 1): a cloud
    # whose adapter makes a shareable one says why here and skips this step.
    with pytest.raises(InvalidRequest):
        provider.volumes.attach(volume.ref, second.ref, 1)
    assert provider.volumes.get(volume.ref).attached_to == first.id

    loose = provider.volumes.create(volume_request(cloud, "2"))
    with pytest.raises(InvalidRequest):
        provider.volumes.attach(loose.ref, elsewhere.ref, 0)  # the volume's zone is not its zone
    got = provider.volumes.get(loose.ref)
    assert (got.state, got.attached_to) == (VolumeState.AVAILABLE, None)


def test_an_attached_volume_cannot_be_deleted(cloud: Harness) -> None:
    provider = cloud.provider()
    machine = launch(cloud, provider, "1")
    volume = provider.volumes.create(volume_request(cloud))
    provider.volumes.attach(volume.ref, machine.ref, 0)
    with pytest.raises(InvalidRequest):
        provider.volumes.delete(volume.ref)
    got = provider.volumes.get(volume.ref)
    assert (got.state, got.attached_to) == (VolumeState.IN_USE, machine.id)


# --- a volume outlives its machine --------------------------------------------------------


def test_a_volume_outlives_its_machine_moves_on_and_is_deleted_once(cloud: Harness) -> None:
    provider = cloud.provider()
    first = launch(cloud, provider, "1")
    volume = provider.volumes.create(volume_request(cloud))
    provider.volumes.attach(volume.ref, first.ref, 0)

    provider.terminate(first.ref)
    got = provider.volumes.get(volume.ref)
    assert (got.state, got.attached_to) == (VolumeState.AVAILABLE, None)  # the data is kept
    provider.volumes.detach(volume.ref, first.ref)  # from a machine that is gone: no error

    second = launch(cloud, provider, "2")
    provider.volumes.attach(volume.ref, second.ref, 0)
    assert provider.volumes.get(volume.ref).attached_to == second.id
    provider.volumes.detach(volume.ref, second.ref)
    provider.volumes.detach(volume.ref, second.ref)  # idempotent
    got = provider.volumes.get(volume.ref)
    assert (got.state, got.attached_to) == (VolumeState.AVAILABLE, None)
    assert provider.get(second.ref).state in (MachineState.PENDING, MachineState.RUNNING)

    provider.volumes.delete(volume.ref)
    provider.volumes.delete(volume.ref)  # idempotent
    assert volume_or_gone(provider, volume) is None
    with pytest.raises(NotFound):
        provider.volumes.get(volume.ref)
    assert provider.volumes.ours() == []


def test_detaching_a_volume_attached_elsewhere_leaves_it_there(cloud: Harness) -> None:
    provider = cloud.provider()
    first, second = launch(cloud, provider, "1"), launch(cloud, provider, "2")
    volume = provider.volumes.create(volume_request(cloud))
    provider.volumes.attach(volume.ref, first.ref, 0)
    provider.volumes.detach(volume.ref, second.ref)  # not attached there: nothing to do
    assert provider.volumes.get(volume.ref).attached_to == first.id


# --- the device the machine sees ----------------------------------------------------------


def test_the_device_path_is_known_before_the_attach_and_names_the_volume_or_its_slot(
    cloud: Harness,
) -> None:
    provider = cloud.provider()
    one = provider.volumes.create(volume_request(cloud, "1"))
    two = provider.volumes.create(volume_request(cloud, "2"))
    before = cloud.calls()
    first, second = provider.volumes.device(one, 0), provider.volumes.device(two, 1)
    assert cloud.calls() == before  # no request: the startup script is written before attach

    assert first != second
    for volume, path in ((one, first), (two, second)):
        assert path.startswith("/dev/disk/") and " " not in path
        # the volume's id (EVS: a VBD disk's serial, its first 20 characters) or its name
        names = (volume.id, volume.id.replace("-", ""), volume.id[:20], volume.name)
        if not any(n and n in path for n in names):  # named by its slot (Azure's LUN)
            assert provider.volumes.device(volume, 5) != path
