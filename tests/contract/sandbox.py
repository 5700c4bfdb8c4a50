"""The sandbox harness: the simulated cloud in its own SQLite file, with its faults set through
:meth:`SandboxProvider.inject` and :meth:`SandboxProvider.preempt` (the same hooks the App-level
tests use)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from providers.base import Instance, InstanceRef, LaunchRequest
from providers.sandbox import guard
from providers.sandbox.adapter import SandboxProvider
from provisioner.clock import ManualClock
from tests.conftest import TEST_START
from tests.contract.harness import t4_request

OPTIONS = {"latency_seconds": 0, "retry_base_seconds": 0.001, "retry_max_seconds": 0.01}


class SandboxHarness:
    name = "sandbox"
    places = (
        ("sandbox-us", "sandbox-us-1a"),
        ("sandbox-us", "sandbox-us-1b"),
        ("sandbox-eu", "sandbox-eu-1a"),
    )
    empty_region = "sandbox-ru"
    codes = {
        "capacity": "SandboxZoneExhausted",
        "quota": "SandboxGpuQuota",
        "auth": "SandboxAuth",
        "throttled": "SandboxThrottled",
        "not_found": "SandboxNotFound",
    }
    credential_hint = ""
    ok_hint = "simulated cloud"
    cannot = {
        "lose_response": "sandbox: an in-process simulated cloud, no wire to lose an answer on",
        "slow_operations": "sandbox: launch/stop finish within the call, no operations to poll",
        "idempotency_keys": "sandbox: no wire, so no request carries a key to read",
        "pages": "sandbox: list_managed is one SQLite query, no pages",
        "credentials": "sandbox: a simulated cloud needs no credentials",
    }

    def __init__(self, db_path: Path) -> None:
        self.db_path = db_path
        self.clock = ManualClock(TEST_START)
        self._admin = self.provider()  # the cloud's own side: faults, preemptions, counters

    def provider(self, **options: Any) -> SandboxProvider:
        opts = {**OPTIONS, "db_path": str(self.db_path), **options}
        return SandboxProvider(opts, clock=self.clock.now)

    def launch_request(
        self, key: str = "1", *, spot: bool = False, place: int = 0, **fields: Any
    ) -> LaunchRequest:
        return t4_request(key, self.places[place], "sbx-t4-1", spot, **{"disk_gb": 50, **fields})

    # --- faults

    def exhaust_capacity(self, zone: str) -> None:
        self._admin.inject(capacity={zone: 0})

    def exhaust_quota(self, region: str) -> None:
        self._admin.inject(quota_gpus={region: 0})

    def deny_auth(self) -> None:
        self._admin.inject(auth_fail=True)

    def throttle(self, n: int) -> None:
        self._admin.inject(throttle=n)

    def lose_next_response(self, call: str = "create") -> None:
        raise AssertionError(self.cannot["lose_response"])

    def slow_operations(self, n: int) -> None:
        raise AssertionError(self.cannot["slow_operations"])

    def cap_page_size(self, n: int) -> None:
        pass  # one query, no pages

    # --- outside

    def preempt(self, instance: Instance) -> None:
        self._admin.preempt(instance.ref)

    def stop_from_outside(self, instance: Instance) -> None:
        self.provider().stop(instance.ref)  # another process sharing the sandbox: its console

    def guest_shutdown(self, instance: Instance, at: datetime) -> None:
        guard.halt(self.db_path, instance.id, at)  # what the machine's guard runs

    def delete_from_outside(self, instance: Instance) -> None:
        with self._db() as db:
            db.execute("DELETE FROM machines WHERE id = ?", (instance.id,))

    def add_foreign_machine(self, tags: Mapping[str, str] | None = None) -> None:
        if tags is None:
            self._admin.create_unmanaged("hand-made")
            return
        n = len(self.machines())
        self.provider().launch(self.launch_request(f"foreign-{n}", labels=dict(tags)))

    def unknown_ref(self) -> InstanceRef:
        return InstanceRef(id="sbx-000000000000", region="sandbox-us", zone="sandbox-us-1a")

    def remove_credentials(self, monkeypatch: Any, tmp_path: Any) -> None:
        pass

    # --- observations

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.db_path, timeout=30)
        try:
            with conn:
                yield conn
        finally:
            conn.close()

    def machines(self) -> list[str]:
        with self._db() as db:
            rows = db.execute("SELECT id FROM machines WHERE state != 'terminated'").fetchall()
        return [r[0] for r in rows]

    def boot_disk(self, instance: Instance) -> str:
        # the sandbox simulates no disks apart from its machines: a machine's disk is its own
        with self._db() as db:
            row = db.execute("SELECT id FROM machines WHERE id = ?", (instance.id,)).fetchone()
        return f"{row[0]}-boot"

    def calls(self) -> int:
        return self._admin.api_calls

    def create_calls(self) -> int:
        return self._admin.api_calls  # every sandbox call is counted; tests launch alone

    def keys(self, call: str = "create") -> list[str]:
        raise AssertionError(self.cannot["idempotency_keys"])

    def operation_polls(self) -> int:
        return 0

    def list_pages(self) -> int:
        return 0

    def secrets(self) -> list[str]:
        return []


@contextmanager
def harness(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[SandboxHarness]:
    yield SandboxHarness(tmp_path / "sandbox.db")
