"""The Yandex harness: the real ``yandexcloud`` SDK over TLS against the local gRPC emulator
(tests/emulators/yandex.py)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from providers.base import Instance, InstanceRef, LaunchRequest
from providers.yandex.adapter import YandexProvider
from tests.contract.harness import t4_request
from tests.emulators.tls import self_signed_localhost
from tests.emulators.yandex import FOLDER, IAM_TOKEN, YandexEmulator

YC_ENV = (
    "YC_IAM_TOKEN",
    "YC_TOKEN",
    "YC_SERVICE_ACCOUNT_KEY_FILE",
    "YC_FOLDER_ID",
    "YC_METADATA_ADDR",
)
Tls = tuple[bytes, bytes, Path]  # certificate PEM, key PEM, the certificate's file
_tls: Tls | None = None
_tls_lock = threading.Lock()


def tls_material() -> Tls:
    """One self-signed localhost certificate for the run, its PEM in a temporary file."""
    global _tls
    with _tls_lock:
        if _tls is None:
            cert, key = self_signed_localhost()
            folder = Path(tempfile.mkdtemp(prefix="yc-tls-"))
            atexit.register(shutil.rmtree, folder, True)
            (folder / "localhost.pem").write_bytes(cert)
            _tls = (cert, key, folder / "localhost.pem")
        return _tls


def yc_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Only the emulator's IAM token in the environment."""
    for name in YC_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("YC_IAM_TOKEN", IAM_TOKEN)
    return monkeypatch


@contextmanager
def running_emulator() -> Iterator[YandexEmulator]:
    cert, key, _ = tls_material()
    emulator = YandexEmulator(cert, key).start()
    try:
        yield emulator
    finally:
        emulator.stop()
    assert emulator.rejected == [], "the adapter sent a request the API would refuse"


def make_provider(emu: YandexEmulator, **options: Any) -> YandexProvider:
    base = {
        "folder_id": FOLDER,
        "endpoint": emu.endpoint,
        "root_certificates_file": str(tls_material()[2]),
        "poll_seconds": 0,
        "retry_base_seconds": 0.001,
        "retry_max_seconds": 0.002,
    }
    return YandexProvider(base | options)


class YandexHarness:
    name = "yandex"
    places = (("ru-central1", "ru-central1-a"), ("ru-central1", "ru-central1-b"))
    empty_region = "kz1"
    codes = {
        "capacity": "RESOURCE_EXHAUSTED",
        "quota": "RESOURCE_EXHAUSTED",
        "auth": "UNAUTHENTICATED",
        "throttled": "RESOURCE_EXHAUSTED",
        "not_found": "NOT_FOUND",
    }
    credential_hint = "YC_SERVICE_ACCOUNT_KEY_FILE"
    ok_hint = FOLDER
    cannot: dict[str, str] = {}

    def __init__(self, emu: YandexEmulator) -> None:
        self.emu = emu

    def provider(self, **options: Any) -> YandexProvider:
        return make_provider(self.emu, **options)

    def launch_request(
        self, key: str = "1", *, spot: bool = False, place: int = 0, **fields: Any
    ) -> LaunchRequest:
        return t4_request(key, self.places[place], "standard-v3-t4/1g-8c-32gb", spot, **fields)

    def exhaust_capacity(self, zone: str) -> None:
        self.emu.capacity_exhausted.add(zone)

    def exhaust_quota(self, region: str) -> None:
        # Yandex's GPU quota is 0 by default; Create is then refused with the GPU-devices text
        self.emu.quota_exceeded = "compute.instanceGpus.count"

    def deny_auth(self) -> None:
        self.emu.tokens.clear()  # the IAM token was revoked

    def throttle(self, n: int) -> None:
        # RESOURCE_EXHAUSTED "The limit on maximum number of active operations has exceeded."
        self.emu.throttle(n, methods={"InstanceService.Create"})

    def lose_next_response(self, call: str = "create") -> None:
        method = {"create": "InstanceService.Create", "stop": "InstanceService.Stop"}[call]
        self.emu.lose_responses(method, 1)

    def slow_operations(self, n: int) -> None:
        self.emu.slow_polls = n

    def cap_page_size(self, n: int) -> None:
        self.emu.page_size_cap = n

    def preempt(self, instance: Instance) -> None:
        self.emu.preempt(instance.id)

    def stop_from_outside(self, instance: Instance) -> None:
        self.emu.console_stop(instance.id)

    def guest_shutdown(self, instance: Instance, at: datetime) -> None:
        self.emu.guest_shutdown(instance.id)  # Yandex dates no power-off from inside

    def delete_from_outside(self, instance: Instance) -> None:
        self.emu.console_delete(instance.id)

    def add_foreign_machine(self, tags: Mapping[str, str] | None = None) -> None:
        self.emu.add_instance(f"foreign-{len(self.emu.instances)}", labels=dict(tags or {}))

    def unknown_ref(self) -> InstanceRef:
        return InstanceRef(id="fhm00000000000000999", region="ru-central1", zone="ru-central1-a")

    def remove_credentials(self, monkeypatch: Any, tmp_path: Any) -> None:
        for name in YC_ENV:
            monkeypatch.delenv(name, raising=False)

    def machines(self) -> list[str]:
        return list(self.emu.instances)

    def boot_disk(self, instance: Instance) -> str:
        return str(self.emu.instances[instance.id].boot_disk.disk_id)

    def calls(self) -> int:
        return len(self.emu.requests)

    def create_calls(self) -> int:
        return len(self.emu.calls("InstanceService.Create"))

    def keys(self, call: str = "create") -> list[str]:
        method = {"create": "InstanceService.Create", "stop": "InstanceService.Stop"}[call]
        return [c.metadata.get("idempotency-key", "") for c in self.emu.calls(method)]

    def operation_polls(self) -> int:
        return len(self.emu.calls("OperationService.Get"))

    def list_pages(self) -> int:
        return sum(1 for c in self.emu.calls("InstanceService.List") if c.request.page_token)

    def secrets(self) -> list[str]:
        return [IAM_TOKEN]


@contextmanager
def harness(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[YandexHarness]:
    yc_env(monkeypatch)
    with running_emulator() as emulator:
        yield YandexHarness(emulator)
