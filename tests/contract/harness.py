"""One harness protocol: what the contract suite (tests/contract/test_contract.py) needs from a
cloud, so every behaviour is asserted the same way on the sandbox and on each real SDK against
its wire-level emulator (tests/emulators/).

Each cloud has one harness class in tests/contract/<cloud>.py. It wraps that emulator's own
fault API — it adds no behaviour of its own — and it is built from the fixture code the
per-cloud file used (which now imports it from there).

Where a cloud cannot do something its spec declares (``providers.spec.Capabilities``: spot
machines that cannot be stopped, a console stop that reads as a preemption), the contract test
skips that parameter with the reason the spec gives. What only the test bench lacks (no
long-running operation on AWS RunInstances, no wire on the sandbox) the harness names in
:attr:`Harness.cannot`. Neither passes silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from providers.base import (
    TAG_MACHINE,
    TAG_MANAGED_BY,
    TAG_MANAGED_BY_VALUE,
    TAG_OWNER,
    TAG_PROJECT,
    Instance,
    InstanceRef,
    LaunchRequest,
    Provider,
)

#: What a harness may be unable to stage (keys of :attr:`Harness.cannot`); what the cloud itself
#: lacks is a capability of its spec (``Capabilities.why_not`` says why).
ABILITIES = (
    "lose_response",  # the cloud has a wire on which an answer can be lost
    "slow_operations",  # launch/stop are long-running operations the adapter waits for
    "idempotency_keys",  # each create/stop carries a key we can read off the wire
    "pages",  # listing comes in pages
    "credentials",  # the cloud needs credentials at all
)


def t4_request(
    key: str, place: tuple[str, str], instance_type: str, spot: bool, **fields: Any
) -> LaunchRequest:
    """A one-T4 launch of ``instance_type`` at ``place`` (region, zone) for machine ``m-<key>``;
    ``fields`` override (a cloud's disk size, its accelerator name, a preemption action…)."""
    region, zone = place
    base: dict[str, Any] = {
        "name": f"exp-{key}",
        "token": f"tok-{key}",
        "region": region,
        "zone": zone,
        "instance_type": instance_type,
        "gpu": "T4",
        "gpu_count": 1,
        "spot": spot,
        "disk_gb": 100,
        "labels": labels(f"m-{key}"),
    }
    return LaunchRequest(**{**base, **fields})


def labels(machine: str) -> dict[str, str]:
    """Our tags, with values that are valid verbatim on every cloud (so what comes back can be
    compared with what was sent)."""
    return {
        TAG_MANAGED_BY: TAG_MANAGED_BY_VALUE,
        TAG_MACHINE: machine,
        TAG_PROJECT: "vision",
        TAG_OWNER: "ana-example-com",
    }


@runtime_checkable
class Harness(Protocol):
    """One cloud under test, its emulator reset for this test."""

    name: str  # the registry name: sandbox, aws, gcp, azure, yandex, sbercloud
    #: (region, zone) places of the cloud's catalog to launch in; ``places[0]`` and
    #: ``places[1]`` share a region; more places may be in another region.
    places: tuple[tuple[str, str], ...]
    #: A region of this cloud where the harness never launches (listing it finds nothing).
    empty_region: str
    #: ability → the cloud fact that rules it out (see :data:`ABILITIES`).
    cannot: Mapping[str, str]
    #: The cloud's own error code the adapter keeps in ``.code`` for each injected fault:
    #: capacity, quota, auth, throttled, not_found (None: only that some code is kept).
    codes: Mapping[str, str | None]
    #: What ``check()`` must name when no credentials are found (where to put them).
    credential_hint: str

    @property
    def ok_hint(self) -> str:
        """What ``check()`` must name when the credentials work (the account, project…)."""

    # --- the adapter ------------------------------------------------------------------------

    def provider(self, **options: Any) -> Provider:
        """A configured adapter talking to the emulator (``options`` override the harness's:
        ``retry_attempts``, …). Built after :meth:`remove_credentials` it has none."""

    def launch_request(
        self, key: str = "1", *, spot: bool = False, place: int = 0, **fields: Any
    ) -> LaunchRequest:
        """A valid request of this cloud's catalog (a T4 type where the cloud has one):
        token ``tok-<key>``, name ``exp-<key>``, machine id ``m-<key>``, our :func:`labels`."""

    # --- faults -----------------------------------------------------------------------------

    def exhaust_capacity(self, zone: str) -> None:
        """Launches in ``zone`` fail for lack of stock (the cloud's own error for it)."""

    def exhaust_quota(self, region: str) -> None:
        """Launches in ``region`` break a regional quota."""

    def deny_auth(self) -> None:
        """The cloud refuses the credentials in use from now on (revoked, rotated)."""

    def throttle(self, n: int) -> None:
        """The next ``n`` create calls are refused with the cloud's rate-limit answer."""

    def lose_next_response(self, call: str = "create") -> None:
        """The next ``call`` ("create" or "stop") is carried out by the cloud, but its answer
        never reaches the client."""

    def slow_operations(self, n: int) -> None:
        """Long-running operations started from now take ``n`` more polls to finish."""

    def cap_page_size(self, n: int) -> None:
        """Listings come at most ``n`` machines a page (for providers built from now on)."""

    # --- the world outside ------------------------------------------------------------------

    def preempt(self, instance: Instance) -> None:
        """The cloud takes a spot machine back, per its ``preemption_action``."""

    def stop_from_outside(self, instance: Instance) -> None:
        """A person stops the machine in the console (not through provisioner)."""

    def delete_from_outside(self, instance: Instance) -> None:
        """Someone deletes the machine elsewhere, and the cloud no longer knows it."""

    def guest_shutdown(self, instance: Instance, at: datetime) -> None:
        """The machine's OS shuts itself down (the guard's ``shutdown -h now``) at ``at``, and
        the cloud does what it does with that (its emulator's ``guest_shutdown``, cited
        there): stopped, terminated, or stopped but still allocated and billed. A cloud that
        records no time for it ignores ``at``."""

    def add_foreign_machine(self, tags: Mapping[str, str] | None = None) -> None:
        """A machine made outside provisioner, with ``tags`` (None: none at all)."""

    def unknown_ref(self) -> InstanceRef:
        """A well-formed reference to a machine the cloud has never heard of."""

    def remove_credentials(self, monkeypatch: Any, tmp_path: Any) -> None:
        """No credentials anywhere the SDK looks (environment, files, metadata service)."""

    # --- what the cloud saw -----------------------------------------------------------------

    def machines(self) -> list[str]:
        """Ids of every live machine in the cloud (ours and foreign; not deleted ones)."""

    def boot_disk(self, instance: Instance) -> str:
        """The id or name of the boot disk the cloud has attached to ``instance`` now."""

    def calls(self) -> int:
        """How many API requests the cloud received in all."""

    def create_calls(self) -> int:
        """How many create requests the cloud received (refused ones included)."""

    def keys(self, call: str = "create") -> list[str]:
        """The idempotency key each ``call`` ("create"/"stop") request carried, in order: the
        client token / request id / idempotency-key, or what makes that call idempotent on
        this cloud (the VM name of an ARM PUT, the instance id of a stop)."""

    def operation_polls(self) -> int:
        """How many times an operation's status was read."""

    def list_pages(self) -> int:
        """How many listing requests asked for a page after the first."""

    def secrets(self) -> list[str]:
        """Credential values in use that must never appear in a message."""
