"""The AWS harness: unmodified boto3 against moto in server mode behind the fault-injecting proxy
(tests/emulators/aws.py). Zones are AZ ids, as in the catalog; moto maps us-east-1a → use1-az6,
us-east-1b → use1-az1, us-east-1c → use1-az2, us-east-1d → use1-az4.

moto takes ~1 s to start, so one emulator serves the whole run (:func:`shared_emulator`), reset
before each test."""

from __future__ import annotations

import atexit
import socket
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from providers.aws.adapter import AWSProvider
from providers.base import Instance, InstanceRef, LaunchRequest
from tests.contract.harness import t4_request
from tests.emulators.aws import AwsEmulator, start_aws_emulator

SECRET = "aws-emulator-secret-0001"
CREDENTIAL_VARS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
)
_shared: AwsEmulator | None = None
_shared_lock = threading.Lock()


def shared_emulator() -> AwsEmulator:
    """The run's one moto + proxy, started on first use and stopped at exit."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = start_aws_emulator()
            atexit.register(_shared.stop)
        return _shared


def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials in the environment (boto3's default chain), nothing else."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")


@contextmanager
def clean_emulator(monkeypatch: pytest.MonkeyPatch) -> Iterator[AwsEmulator]:
    """The shared emulator, emptied, with fake credentials; checks it never failed itself."""
    emulator = shared_emulator()
    aws_env(monkeypatch)
    emulator.reset()
    yield emulator
    emulator.wait_idle()
    assert emulator.errors == []  # the emulator itself never failed


def make_provider(emu: AwsEmulator, **options: object) -> AWSProvider:
    return AWSProvider(
        {
            "endpoint": emu.endpoint_url,
            "retry_base_seconds": 0.001,
            "retry_max_seconds": 0.01,
            "poll_seconds": 0.01,
            **options,
        }
    )


def region_of(zone: str) -> str:
    return {"use1": "us-east-1", "usw2": "us-west-2"}.get(zone.split("-")[0], zone[:-1])


class AwsHarness:
    name = "aws"
    places = (("us-east-1", "use1-az6"), ("us-east-1", "use1-az1"), ("us-west-2", "usw2-az1"))
    empty_region = "eu-west-1"
    codes = {
        "capacity": "InsufficientInstanceCapacity",
        "quota": "VcpuLimitExceeded",
        "auth": "AuthFailure",
        "throttled": "RequestLimitExceeded",
        "not_found": "InvalidInstanceID.NotFound",
    }
    credential_hint = "AWS_PROFILE"
    ok_hint = "123456789012"  # moto's account
    cannot = {
        "slow_operations": "aws: RunInstances/StopInstances answer at once (pending/stopping); "
        "EC2 has no operation object to wait for",
    }

    def __init__(self, emu: AwsEmulator) -> None:
        self.emu = emu
        self._requests: dict[str, LaunchRequest] = {}

    def provider(self, **options: Any) -> AWSProvider:
        return make_provider(self.emu, **options)

    def launch_request(
        self, key: str = "1", *, spot: bool = False, place: int = 0, **fields: Any
    ) -> LaunchRequest:
        request = t4_request(key, self.places[place], "g4dn.xlarge", spot, **fields)
        self._requests[request.name] = request
        return request

    def exhaust_capacity(self, zone: str) -> None:
        self.emu.faults.no_capacity(zone)

    def exhaust_quota(self, region: str) -> None:
        self.emu.faults.quota_exceeded(region, "VcpuLimitExceeded")

    def deny_auth(self) -> None:
        self.emu.faults.reject_credentials()

    def throttle(self, n: int) -> None:
        self.emu.faults.throttle(n, action="RunInstances")

    def lose_next_response(self, call: str = "create") -> None:
        self.emu.faults.drop_response({"create": "RunInstances", "stop": "StopInstances"}[call])

    def slow_operations(self, n: int) -> None:
        raise AssertionError(self.cannot["slow_operations"])

    def cap_page_size(self, n: int) -> None:
        self.emu.faults.cap_page_size(n)

    def preempt(self, instance: Instance) -> None:
        # the adapter launches one-time + terminate: EC2 terminates it when taking it back
        self.emu.preempt(instance.id, instance.region, action="terminate")

    def stop_from_outside(self, instance: Instance) -> None:
        self.emu.client("ec2", instance.region).stop_instances(InstanceIds=[instance.id])

    def guest_shutdown(self, instance: Instance, at: datetime) -> None:
        self.emu.guest_shutdown(instance.id, instance.region, at=at)

    def delete_from_outside(self, instance: Instance) -> None:
        self.emu.forget(instance.id, instance.region)

    def add_foreign_machine(self, tags: Mapping[str, str] | None = None) -> None:
        args: dict[str, Any] = {
            "ImageId": self.emu.ubuntu_ami("us-east-1"),
            "InstanceType": "g4dn.xlarge",
            "MinCount": 1,
            "MaxCount": 1,
        }
        if tags:
            tag_list = [{"Key": k, "Value": v} for k, v in tags.items()]
            args["TagSpecifications"] = [{"ResourceType": "instance", "Tags": tag_list}]
        self.emu.client("ec2").run_instances(**args)

    def unknown_ref(self) -> InstanceRef:
        return InstanceRef(id="i-0123456789abcdef0", region="us-east-1", zone="use1-az6")

    def remove_credentials(self, monkeypatch: Any, tmp_path: Any) -> None:
        for var in CREDENTIAL_VARS:
            monkeypatch.delenv(var, raising=False)
        with socket.socket() as s:  # a loopback port nobody listens on: the IMDS probe is refused
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{port}")

    def machines(self) -> list[str]:
        found = []
        for region in ("us-east-1", "us-west-2"):
            pages = self.emu.client("ec2", region).get_paginator("describe_instances").paginate()
            found += [
                i["InstanceId"]
                for page in pages
                for r in page["Reservations"]
                for i in r["Instances"]
                if i["State"]["Name"] != "terminated"
            ]
        return found

    def boot_disk(self, instance: Instance) -> str:
        ec2 = self.emu.client("ec2", instance.region)
        [reservation] = ec2.describe_instances(InstanceIds=[instance.id])["Reservations"]
        [found] = reservation["Instances"]
        root = found.get("RootDeviceName")
        return str(
            next(
                m["Ebs"]["VolumeId"]
                for m in found["BlockDeviceMappings"]
                if m["DeviceName"] == root or root is None
            )
        )

    def calls(self) -> int:
        return len(self.emu.requests)

    def create_calls(self) -> int:
        return len(self.emu.calls("RunInstances"))

    def keys(self, call: str = "create") -> list[str]:
        if call == "create":
            return [c.params.get("ClientToken", "") for c in self.emu.calls("RunInstances")]
        return [c.params.get("InstanceId.1", "") for c in self.emu.calls("StopInstances")]

    def operation_polls(self) -> int:
        return 0

    def list_pages(self) -> int:
        return sum(
            1
            for r in self.emu.calls("DescribeInstances")
            if "NextToken" in r.params and "Filter.1.Name" in r.params
        )

    def secrets(self) -> list[str]:
        return [SECRET]


@contextmanager
def harness(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[AwsHarness]:
    with clean_emulator(monkeypatch) as emu:
        yield AwsHarness(emu)
