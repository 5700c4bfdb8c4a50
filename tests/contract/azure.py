"""The Azure harness: the unmodified azure-mgmt-compute / azure-mgmt-network SDKs against the local
ARM emulator (tests/emulators/azure.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from providers.azure.adapter import AzureProvider
from providers.base import Instance, InstanceRef, LaunchRequest
from tests.contract.harness import t4_request
from tests.emulators.azure import TOKEN, AzureEmulator

SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBaVpdKzFzm8BSV3cWXoexq0jBn8Uv3dX2eQ0wq3 ana@laptop"


class StaticCredential:
    """A TokenCredential with a fixed token: what the emulator accepts."""

    def __init__(self, token: str = TOKEN) -> None:
        self.token = token

    def get_token(self, *scopes: str, **kwargs: object):
        from azure.core.credentials import AccessToken

        return AccessToken(self.token, int(time.time()) + 3600)


def make_provider(emu: AzureEmulator, credential=None, **options: object) -> AzureProvider:
    opts = {
        "subscription_id": emu.subscription_id,
        "endpoint": emu.base_url,
        "pricing_endpoint": emu.base_url,
        "regions": ["eastus", "westus2"],
        "retry_base_seconds": 0.001,
        "retry_max_seconds": 0.002,
        "poll_seconds": 0.001,
        **options,
    }
    return AzureProvider(opts, credential=credential or StaticCredential())


def scrub_credentials(monkeypatch: Any, tmp_path: Any) -> None:
    """No AZURE_* / managed-identity variables, and no az / azd on the PATH."""
    for var in list(os.environ):
        if var.startswith(("AZURE_", "MSI_", "IDENTITY_")):
            monkeypatch.delenv(var)
    monkeypatch.setenv("PATH", str(tmp_path))


class AzureHarness:
    name = "azure"
    places = (("eastus", "1"), ("eastus", "2"), ("westus2", "1"))
    empty_region = "centralus"
    codes = {
        "capacity": "ZonalAllocationFailed",
        "quota": "OperationNotAllowed",
        "auth": "InvalidAuthenticationToken",
        "throttled": "TooManyRequests",
        "not_found": "ResourceNotFound",
    }
    credential_hint = "az login"
    ok_hint = "resource group provisioner"
    cannot: dict[str, str] = {}

    def __init__(self, emu: AzureEmulator) -> None:
        self.emu = emu
        self._credentials = True

    def provider(self, **options: Any) -> AzureProvider:
        if self._credentials:
            return make_provider(self.emu, **options)
        opts = {"subscription_id": self.emu.subscription_id, "endpoint": self.emu.base_url}
        return AzureProvider({**opts, **options})

    def launch_request(
        self, key: str = "1", *, spot: bool = False, place: int = 0, **fields: Any
    ) -> LaunchRequest:
        # Azure refuses a Linux VM with no way to log in: a key always
        extra = {"disk_gb": 128, "ssh_public_key": SSH_KEY, **fields}
        return t4_request(key, self.places[place], "Standard_NC4as_T4_v3", spot, **extra)

    def exhaust_capacity(self, zone: str) -> None:
        region = next(r for r, z in self.places if z == zone)
        self.emu.fail_capacity(region, zone, code="ZonalAllocationFailed")

    def exhaust_quota(self, region: str) -> None:
        self.emu.fail_quota(region, family="standardNCASv3_T4Family")

    def deny_auth(self) -> None:
        self.emu.token = "a-token-issued-after-the-revocation"  # ours is refused from now on

    def throttle(self, n: int) -> None:
        self.emu.throttle(n, method="PUT", path_contains="/virtualMachines/")

    def lose_next_response(self, call: str = "create") -> None:
        if call == "create":
            self.emu.lose_responses(1, method="PUT", path_contains="/virtualMachines/")
        else:
            self.emu.lose_responses(1, method="POST", path_contains="/deallocate")

    def slow_operations(self, n: int) -> None:
        self.emu.slow_operations(polls=n)

    def cap_page_size(self, n: int) -> None:
        self.emu.page_size = n

    def preempt(self, instance: Instance) -> None:
        self.emu.evict(instance.name)

    def stop_from_outside(self, instance: Instance) -> None:
        self.emu.console_stop(instance.name)

    def guest_shutdown(self, instance: Instance, at: datetime) -> None:
        self.emu.guest_shutdown(instance.name)  # Azure dates no power-off from inside

    def delete_from_outside(self, instance: Instance) -> None:
        self.emu.console_delete(instance.name)

    def add_foreign_machine(self, tags: Mapping[str, str] | None = None) -> None:
        self.emu.add_vm(f"foreign-{len(self.emu.vms)}", tags=dict(tags or {}))

    def unknown_ref(self) -> InstanceRef:
        return InstanceRef(id="", region="eastus", zone="1", name="never-was")

    def remove_credentials(self, monkeypatch: Any, tmp_path: Any) -> None:
        scrub_credentials(monkeypatch, tmp_path)
        self._credentials = False

    def machines(self) -> list[str]:
        return [vm.body["id"] for vm in self.emu.vms.values()]

    def boot_disk(self, instance: Instance) -> str:
        os_disk = self.emu.vm(instance.name)["properties"]["storageProfile"]["osDisk"]
        return str(os_disk["managedDisk"]["id"])

    def calls(self) -> int:
        return len(self.emu.requests)

    def _vm_puts(self) -> list:
        return self.emu.requests_to("PUT", "/virtualMachines/")

    def create_calls(self) -> int:
        return len(self._vm_puts())

    def keys(self, call: str = "create") -> list[str]:
        # ARM's idempotency is the resource name: a PUT (create-only) or POST to the same VM
        if call == "create":
            return [r.path.rsplit("/", 1)[-1] for r in self._vm_puts()]
        return [r.path.rsplit("/", 2)[-2] for r in self.emu.requests_to("POST", "/deallocate")]

    def operation_polls(self) -> int:
        return len(self.emu.requests_to("GET", "/operations/"))

    def list_pages(self) -> int:
        listing = self.emu.requests_to("GET", "/providers/Microsoft.Compute/virtualMachines")
        return sum(1 for r in listing if "$skiptoken" in r.query)

    def secrets(self) -> list[str]:
        return [TOKEN]


@contextmanager
def harness(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[AzureHarness]:
    with AzureEmulator() as emulator:
        yield AzureHarness(emulator)
