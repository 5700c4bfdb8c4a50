"""The GCP harness: the real google-cloud-compute REST transport against the local Compute
Engine emulator (tests/emulators/gcp.py)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from providers.base import Instance, InstanceRef, LaunchRequest
from providers.gcp.adapter import GCPProvider
from tests.contract.harness import t4_request
from tests.emulators.gcp import GCPEmulator

NO_CREDENTIAL_VARS = ("GOOGLE_APPLICATION_CREDENTIALS", "GCE_METADATA_HOST", "GOOGLE_CLOUD_PROJECT")


def make_provider(emu: GCPEmulator, **options: object) -> GCPProvider:
    return GCPProvider(
        {
            "project": emu.project,
            "endpoint": emu.endpoint,
            "pricing_endpoint": emu.endpoint,
            "anonymous": True,
            "retry_base_seconds": 0.001,
            "retry_max_seconds": 0.01,
            **options,
        }
    )


def remove_credentials(monkeypatch: Any, tmp_path: Any) -> None:
    """No application-default credentials, no gcloud config, no metadata server probe."""
    for var in NO_CREDENTIAL_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")


class GCPHarness:
    name = "gcp"
    places = (
        ("us-central1", "us-central1-a"),
        ("us-central1", "us-central1-b"),
        ("europe-west4", "europe-west4-a"),
    )
    empty_region = "us-east4"
    codes = {
        "capacity": "ZONE_RESOURCE_POOL_EXHAUSTED",
        "quota": "quotaExceeded",
        # a refused token is retried once through a refresh, which anonymous credentials (the
        # emulator's) cannot do: google-auth's InvalidOperation, not the API's authError
        "auth": None,
        "throttled": "rateLimitExceeded",
        "not_found": "notFound",
    }
    credential_hint = "gcloud auth application-default login"
    ok_hint = "test-project"
    cannot: dict[str, str] = {}

    def __init__(self, emu: GCPEmulator) -> None:
        self.emu = emu
        self._anonymous = True

    def provider(self, **options: Any) -> GCPProvider:
        return make_provider(self.emu, anonymous=self._anonymous, **options)

    def launch_request(
        self, key: str = "1", *, spot: bool = False, place: int = 0, **fields: Any
    ) -> LaunchRequest:
        return t4_request(
            key,
            self.places[place],
            "n1-standard-4",
            spot,
            **{"accelerator": "nvidia-tesla-t4", **fields},
        )

    def exhaust_capacity(self, zone: str) -> None:
        self.emu.exhaust(zone)

    def exhaust_quota(self, region: str) -> None:
        self.emu.exceed_quota("NVIDIA_T4_GPUS", region=region)

    def deny_auth(self) -> None:
        self.emu.deny_auth()

    def throttle(self, n: int) -> None:
        self.emu.throttle(n, call="POST /instances")

    def lose_next_response(self, call: str = "create") -> None:
        self.emu.lose_responses(1, call={"create": "POST /instances", "stop": "POST /stop"}[call])

    def slow_operations(self, n: int) -> None:
        self.emu.slow_operations(n)

    def cap_page_size(self, n: int) -> None:
        self.emu.max_page_size = n

    def preempt(self, instance: Instance) -> None:
        self.emu.preempt(instance.zone, instance.name)

    def stop_from_outside(self, instance: Instance) -> None:
        self.emu.console_stop(instance.zone, instance.name)

    def guest_shutdown(self, instance: Instance, at: datetime) -> None:
        self.emu.guest_shutdown(instance.zone, instance.name, at=at)

    def delete_from_outside(self, instance: Instance) -> None:
        self.emu.console_delete(instance.zone, instance.name)

    def add_foreign_machine(self, tags: Mapping[str, str] | None = None) -> None:
        n = len(self.emu.instances)
        self.emu.add_instance("us-central1-a", f"foreign-{n}", labels=dict(tags or {}))

    def unknown_ref(self) -> InstanceRef:
        return InstanceRef(
            id="never-was", region="us-central1", zone="us-central1-a", name="never-was"
        )

    def remove_credentials(self, monkeypatch: Any, tmp_path: Any) -> None:
        remove_credentials(monkeypatch, tmp_path)
        self._anonymous = False

    def machines(self) -> list[str]:
        return [i["id"] for i in self.emu.instances.values()]

    def boot_disk(self, instance: Instance) -> str:
        disks = self.emu.instances[(instance.zone, instance.name)]["disks"]
        return str(next(d["source"] for d in disks if d.get("boot")))

    def calls(self) -> int:
        return len(self.emu.requests)

    def _inserts(self) -> list:
        return [r for r in self.emu.calls("POST", "/instances")]

    def create_calls(self) -> int:
        return len(self._inserts())

    def keys(self, call: str = "create") -> list[str]:
        sent = self._inserts() if call == "create" else self.emu.calls("POST", "/stop")
        return [r.query.get("requestId", "") for r in sent]

    def operation_polls(self) -> int:
        return sum(
            1
            for r in self.emu.requests
            if "/operations/" in r.path and (r.method == "GET" or r.path.endswith("/wait"))
        )

    def list_pages(self) -> int:
        listing = [r for r in self.emu.requests if r.path.endswith("/aggregated/instances")]
        return sum(1 for r in listing if "pageToken" in r.query)

    def secrets(self) -> list[str]:
        return []


@contextmanager
def harness(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[GCPHarness]:
    with GCPEmulator() as emulator:
        yield GCPHarness(emulator)
