"""An Azure VM as the contract's :class:`~providers.base.Instance`: its power state mapped to
the one state vocabulary, and when it stopped (moved out of the adapter)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from providers.azure import activity
from providers.base import Instance, MachineState

if TYPE_CHECKING:
    from providers.azure.adapter import AzureProvider

_POWER = {
    "starting": MachineState.PENDING,
    "running": MachineState.RUNNING,
    "stopping": MachineState.STOPPING,
    "deallocating": MachineState.STOPPING,
    # powered off (from inside the guest, or PowerOff) but still allocated and billed until
    # deallocated (learn.microsoft.com/azure/virtual-machines/states-billing): billing goes on
    "stopped": MachineState.STOPPING,
    "deallocated": MachineState.STOPPED,
}


def to_instance(
    provider: AzureProvider,
    vm: Any,
    statuses: Any,
    private_ip: str | None = None,
    public_ip: str | None = None,
) -> Instance:
    codes = [s.code or "" for s in statuses or []]
    power = _power(codes)
    spot = _spot(vm)
    state = _state(vm, power)
    reason = ", ".join(codes) or None
    stopped_at = None
    if state is MachineState.STOPPED and power == "deallocated":
        state, reason, stopped_at = _deallocated(provider, vm, statuses, spot, reason)
    return Instance(
        id=vm.id,
        name=vm.name,
        region=vm.location,
        zone=(vm.zones or [""])[0],
        instance_type=vm.hardware_profile.vm_size if vm.hardware_profile else "",
        state=state,
        spot=spot,
        labels=dict(vm.tags or {}),
        public_ip=public_ip,
        private_ip=private_ip,
        launched_at=vm.time_created,
        state_reason=reason,
        stopped_at=_utc(stopped_at),
        halted_billing=power == "stopped",
    )


def _spot(vm: Any) -> bool:
    return str(getattr(vm.priority, "value", vm.priority) or "").lower() == "spot"


def _power(codes: list[str]) -> str | None:
    """The power state in a VM's instance view status codes ("PowerState/running"), if any."""
    return next((c.split("/", 1)[1] for c in codes if c.startswith("PowerState/")), None)


def _state(vm: Any, power: str | None) -> MachineState:
    if vm.provisioning_state == "Deleting":
        return MachineState.TERMINATED
    if power is None:
        failed = vm.provisioning_state == "Failed"
        return MachineState.TERMINATED if failed else MachineState.PENDING
    return _POWER.get(power, MachineState.PENDING)


def _deallocated(
    provider: AzureProvider, vm: Any, statuses: Any, spot: bool, reason: str | None
) -> tuple[MachineState, str | None, datetime | None]:
    """A deallocated VM's state (preempted when evicted), reason and when it stopped."""
    # When it stopped: a deallocate is a user-initiated operation whose completion the
    # ProvisioningState/succeeded status dates ("time"; MicrosoftDocs azure-docs, "States
    # and billing status of Azure VMs": a deallocate "is considered an update"); the
    # PowerState status has no time. A powered-off VM (PowerState/stopped, possibly from
    # inside the guest) has no dated record: None. An eviction is not user-initiated, so
    # for a Spot VM the Activity Log's evictSpotVM (or deallocate) eventTimestamp dates it.
    if spot:
        evicted, why, stopped_at = activity.evicted(provider, vm)
        state = MachineState.PREEMPTED if evicted else MachineState.STOPPED
        return state, ", ".join(filter(None, [reason, why])), stopped_at
    stopped_at = next(
        (
            st.time
            for st in statuses or []
            if (st.code or "").lower() == "provisioningstate/succeeded"
        ),
        None,
    )
    return MachineState.STOPPED, reason, stopped_at


def _utc(at: datetime | None) -> datetime | None:
    if at is None:
        return None
    return at.astimezone(UTC) if at.tzinfo else at.replace(tzinfo=UTC)
