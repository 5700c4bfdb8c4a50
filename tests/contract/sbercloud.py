"""The SberCloud harness: the real huaweicloudsdkecs against the local ECS emulator, which checks
every request's SDK-HMAC-SHA256 signature (tests/emulators/sbercloud.py)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from providers.base import Instance, InstanceRef, LaunchRequest
from providers.sbercloud.adapter import SberCloudProvider
from tests.contract.harness import t4_request
from tests.emulators.sbercloud import PROJECT_ID, ZONES, EcsEmulator

AK, SK = "AKTESTSBERCLOUD0001", "sk-test-secret-0001"
CREDENTIAL_VARS = (
    "SBERCLOUD_ACCESS_KEY",
    "SBERCLOUD_SECRET_KEY",
    "HUAWEICLOUD_SDK_AK",
    "HUAWEICLOUD_SDK_SK",
    "SBERCLOUD_PROJECT_ID",
    "HUAWEICLOUD_SDK_PROJECT_ID",
)


def sber_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Only the emulator's AK/SK in the environment."""
    for var in CREDENTIAL_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SBERCLOUD_ACCESS_KEY", AK)
    monkeypatch.setenv("SBERCLOUD_SECRET_KEY", SK)
    return monkeypatch


def options(emu: EcsEmulator, **extra: object) -> dict:
    return {
        "endpoint": emu.endpoint,
        "iam_endpoint": f"{emu.endpoint}/v3",
        "vpc_endpoint": emu.endpoint,  # the same emulator serves the VPC API
        "evs_endpoint": emu.endpoint,  # and EVS
        "project_id": PROJECT_ID,
        "vpc_id": "vpc-0001",
        "subnet_id": "subnet-0001",
        "security_group_id": "sg-0001",
        "image": "img-ubuntu-22-gpu",
        "poll_seconds": 0.001,
        "retry_base_seconds": 0.001,
        "retry_max_seconds": 0.01,
        **extra,
    }


class SberCloudHarness:
    name = "sbercloud"
    places = (("ru-moscow-1", ZONES[0]), ("ru-moscow-1", ZONES[1]))
    empty_region = "ru-moscow-2"
    codes = {
        "capacity": "Ecs.0319",
        "quota": "Ecs.0001",
        "auth": "APIGW.0301",
        "throttled": "APIGW.0308",
        "not_found": "Ecs.0114",
    }
    credential_hint = "SBERCLOUD_ACCESS_KEY"
    cannot: dict[str, str] = {}

    def __init__(self, emu: EcsEmulator) -> None:
        self.emu = emu
        self._options: dict[str, Any] = {}
        self._requests: dict[str, LaunchRequest] = {}

    @property
    def ok_hint(self) -> str:
        return self.emu.endpoint

    def provider(self, **extra: Any) -> SberCloudProvider:
        return SberCloudProvider(options(self.emu, **{**self._options, **extra}))

    def launch_request(
        self, key: str = "1", *, spot: bool = False, place: int = 0, **fields: Any
    ) -> LaunchRequest:
        request = t4_request(
            key, self.places[place], "pi2.2xlarge.4", spot, **{"disk_gb": 80, **fields}
        )
        self._requests[request.name] = request
        return request

    def exhaust_capacity(self, zone: str) -> None:
        self.emu.sell_out(zone)

    def exhaust_quota(self, region: str) -> None:
        self.emu.faults.max_servers = 0  # one region per endpoint: the quota is the region's

    def deny_auth(self) -> None:
        self.emu.sk = "a-rotated-secret-key"  # our signatures no longer verify

    def throttle(self, n: int) -> None:
        self.emu.throttle(n)  # the create is the launch's first request

    def lose_next_response(self, call: str = "create") -> None:
        if call == "create":
            self.emu.faults.drop_create_responses = 1
        else:
            self.emu.faults.drop_action_responses = 1

    def slow_operations(self, n: int) -> None:
        self.emu.faults.job_polls = n

    def cap_page_size(self, n: int) -> None:
        self._options["page_size"] = n  # ECS pages by the client's limit (page-number offset)

    def preempt(self, instance: Instance) -> None:
        action = self._requests[instance.name].preemption_action
        self.emu.preempt(instance.id, how="stop" if action == "stop" else "delete")

    def stop_from_outside(self, instance: Instance) -> None:
        self.emu.console_stop(instance.id)

    def guest_shutdown(self, instance: Instance, at: datetime) -> None:
        self.emu.guest_shutdown(instance.id, at=at)

    def delete_from_outside(self, instance: Instance) -> None:
        self.emu.console_delete(instance.id)

    def add_foreign_machine(self, tags: Mapping[str, str] | None = None) -> None:
        self.emu.add_server(f"foreign-{len(self.emu.servers)}", tags=dict(tags or {}))

    def unknown_ref(self) -> InstanceRef:
        return InstanceRef(
            id="00000000-0000-4000-8000-000000000999", region="ru-moscow-1", zone=ZONES[0]
        )

    def remove_credentials(self, monkeypatch: Any, tmp_path: Any) -> None:
        for var in CREDENTIAL_VARS:
            monkeypatch.delenv(var, raising=False)

    def machines(self) -> list[str]:
        return [s["id"] for s in self.emu.servers.values() if s["status"] != "DELETED"]

    def boot_disk(self, instance: Instance) -> str:
        raise NotImplementedError(  # never asked: the contract suite skips it (see the spec)
            "sbercloud: the emulator keeps no volumes; Huawei releases a taken spot server"
        )

    def calls(self) -> int:
        return len(self.emu.requests)

    def _creates(self) -> list:
        return self.emu.received("POST", r"/v1\.1/[^/]+/cloudservers$")

    def create_calls(self) -> int:
        return len(self._creates())

    def keys(self, call: str = "create") -> list[str]:
        if call == "create":
            return [r.headers.get("X-Client-Token", "") for r in self._creates()]
        actions = self.emu.received("POST", r"/cloudservers/action$")
        return [
            ",".join(s["id"] for s in r.body["os-stop"]["servers"])
            for r in actions
            if "os-stop" in (r.body or {})
        ]

    def operation_polls(self) -> int:
        return len(self.emu.received("GET", r"/jobs/"))

    def list_pages(self) -> int:
        pages = self.emu.received("GET", r"/cloudservers/detail$")
        return sum(1 for r in pages if int(r.query.get("offset", "1")) > 1)

    def secrets(self) -> list[str]:
        return [SK]


@contextmanager
def harness(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[SberCloudHarness]:
    sber_env(monkeypatch)
    emulator = EcsEmulator(AK, SK).start()
    try:
        yield SberCloudHarness(emulator)
    finally:
        emulator.stop()
