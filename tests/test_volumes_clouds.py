"""Volumes on every real cloud where the contract suite (tests/contract/test_volumes.py) cannot
reach: an answer to the create lost on the wire must not leave a second, billed disk, and what
each cloud is sent carries the intent's key."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.contract.test_contract import open_harness
from tests.contract.test_volumes import volume_request


def _lose_aws(emu: Any) -> None:
    emu.faults.drop_response("CreateVolume")


def _lose_gcp(emu: Any) -> None:
    emu.lose_responses(1, call="POST /disks")


def _lose_azure(emu: Any) -> None:
    emu.lose_responses(1, method="PUT", path_contains="/disks/")


def _lose_yandex(emu: Any) -> None:
    emu.lose_responses("DiskService.Create", 1)


def _lose_sbercloud(emu: Any) -> None:
    emu.faults.drop_volume_responses = 1


def _yandex_keys(emu: Any) -> list[str]:
    return [c.metadata.get("idempotency-key", "") for c in emu.calls("DiskService.Create")]


def _sbercloud_keys(emu: Any) -> list[str]:
    posts = emu.received("POST", r"/cloudvolumes$")
    return [r.headers.get("X-Client-Token", "") for r in posts]


def _aws_keys(emu: Any) -> list[str]:
    return [c.params.get("ClientToken", "") for c in emu.calls("CreateVolume")]


def _gcp_keys(emu: Any) -> list[str]:
    return [r.query.get("requestId", "") for r in emu.calls("POST", "/disks")]


def _azure_keys(emu: Any) -> list[str]:
    # ARM's key is the resource name; the PUT is create-only (If-None-Match: *)
    puts = emu.requests_to("PUT", "/disks/")
    return [f"{r.path.rsplit('/', 1)[-1]} {r.headers.get('if-none-match')}" for r in puts]


LOSE: dict[str, Callable[[Any], None]] = {
    "aws": _lose_aws,
    "gcp": _lose_gcp,
    "azure": _lose_azure,
    "yandex": _lose_yandex,
    "sbercloud": _lose_sbercloud,
}
KEYS: dict[str, Callable[[Any], list[str]]] = {
    "aws": _aws_keys,
    "gcp": _gcp_keys,
    "azure": _azure_keys,
    "yandex": _yandex_keys,
    "sbercloud": _sbercloud_keys,
}


@pytest.mark.parametrize("name", sorted(LOSE))
def test_a_lost_create_answer_retried_is_one_volume_under_one_key(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with open_harness(name, monkeypatch, tmp_path) as cloud:
        emu = cloud.emu  # type: ignore[attr-defined]
        LOSE[name](emu)
        made = cloud.provider().volumes.create(volume_request(cloud))
        again = cloud.provider().volumes.create(volume_request(cloud))  # the intent replayed

        assert again.id == made.id
        assert [v.id for v in cloud.provider().volumes.ours()] == [made.id]
        keys = KEYS[name](emu)
        # AWS finds the first by its token tag and sends no second CreateVolume
        assert 1 <= len(keys) <= 3 and len(set(keys)) == 1, keys
        if name == "aws":
            assert keys == ["vtok-1"]
        if name == "azure":
            assert keys[0] == "vol-1 *"
        if name == "sbercloud":
            assert keys[0] == "vtok-1"  # EVS's X-Client-Token is the token itself


def test_aws_attaches_to_a_machine_still_booting_once_it_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """EC2 refuses AttachVolume while the instance is pending (IncorrectState); right after
    `up` launches it, it is: the adapter waits out the boot and attaches once."""
    from botocore.exceptions import ClientError

    with open_harness("aws", monkeypatch, tmp_path) as cloud:
        emu = cloud.emu  # type: ignore[attr-defined]
        provider = cloud.provider()
        volume = provider.volumes.create(volume_request(cloud))
        emu.faults.boot_describes = 3
        booting = provider.launch(cloud.launch_request("1"))
        region = volume.region
        with pytest.raises(ClientError, match="IncorrectState"):  # the rule, asked directly
            provider._client("ec2", region).attach_volume(
                VolumeId=volume.id, InstanceId=booting.id, Device="/dev/sdf"
            )
        provider.volumes.attach(volume.ref, booting.ref, 0)
        assert provider.volumes.get(volume.ref).attached_to == booting.id
        answers = [c.answer for c in emu.calls("AttachVolume")]
        assert answers == ["IncorrectState", "forwarded"]  # ours: one call, after the boot
