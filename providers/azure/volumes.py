"""Managed disks for the Azure adapter: disks create/get/list/delete through azure-mgmt-compute,
attached and detached by updating the VM's ``storageProfile.dataDisks``.

A volume is a StandardSSD_LRS managed disk named ``request.name`` in the adapter's resource
group, pinned to ``request.zone`` (a zonal disk attaches only to a VM in that zone), tagged with
our labels. ARM's idempotency is the name: the PUT is create-only (``If-None-Match: *``), and
an existing disk with our labels is the same intent. It is attached as LUN ``index`` with
``deleteOption: Detach``, so deleting the VM leaves it ("Detach. If this value is used, the
managed disk is retained after VM gets deleted", azure-mgmt-compute DiskDeleteOptionTypes).
The guest sees it by its LUN: "When the Azure Linux agent is installed on a VM, the agent uses
Udev rules to construct a set of symbolic links under the /dev/disk/azure path ... to identify
disks that are attached to the VM, along with the disk type and disk LUNs" (learn.microsoft.com,
"Troubleshoot Linux VM device name changes"); a data disk's link is
``/dev/disk/azure/scsi1/lun<LUN>`` (as Kubernetes' Azure disk attacher reads it,
Azure/acs-engine#2906: "/dev/disk/azure/scsi1/lun0").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from providers.azure import arm_tags
from providers.base import (
    TAG_MANAGED_BY,
    TAG_MANAGED_BY_VALUE,
    InstanceRef,
    InvalidRequest,
    NotFound,
    Volume,
    VolumeRef,
    VolumeRequest,
    VolumeService,
    VolumeState,
)

if TYPE_CHECKING:
    from providers.azure.adapter import AzureProvider

DISK_SKU = "StandardSSD_LRS"
# Disk.properties.diskState: "Unattached, Attached, Reserved, Frozen, ActiveSAS,
# ActiveSASFrozen, ReadyToUpload, ActiveUpload" (azure-mgmt-compute DiskState)
_DISK_ID = re.compile(r"/resourceGroups/([^/]+)/providers/Microsoft\.Compute/disks/([^/]+)$", re.I)


class ManagedDisks(VolumeService):
    """The volume half of :class:`~providers.azure.adapter.AzureProvider`."""

    def __init__(self, provider: AzureProvider) -> None:
        self.p = provider

    def create(self, request: VolumeRequest) -> Volume:
        from azure.core.exceptions import HttpResponseError
        from azure.mgmt.compute import models

        compute, _ = self.p._clients()
        rg, name = self.p.resource_group, request.name
        zone = request.zone.removeprefix(f"{request.region}-")
        body = models.Disk(
            location=request.region,
            zones=[zone] if zone else None,
            tags=arm_tags(request.labels),
            sku=models.DiskSku(name=DISK_SKU),
            properties=models.DiskProperties(
                creation_data=models.CreationData(create_option="Empty"),
                disk_size_gb=request.size_gb,
            ),
        )

        def begin(**kwargs: Any) -> Any:
            try:
                # disks' create takes no match_condition: the header itself, create-only
                return compute.disks.begin_create_or_update(
                    rg, name, body, headers={"If-None-Match": "*"}, **kwargs
                )
            except HttpResponseError as err:
                if err.status_code == 412:
                    return None  # the name is taken: ours from an earlier attempt, or not
                raise

        self.p._wait(begin)
        disk = self.p.call(lambda: compute.disks.get(rg, name))
        if not dict(disk.tags or {}).items() >= dict(request.labels).items():
            raise InvalidRequest(
                f"azure: a disk named {name} already exists in {rg} and is not this volume",
                code="Conflict",
            )
        return self._volume(disk)

    def get(self, ref: VolumeRef) -> Volume:
        compute, _ = self.p._clients()
        rg, name = self._locate(ref)
        return self._volume(self.p.call(lambda: compute.disks.get(rg, name)))

    def ours(self, regions: Sequence[str] | None = None) -> list[Volume]:
        compute, _ = self.p._clients()
        wanted = set(regions or self.p.regions)
        try:
            # ARM cannot filter disks by tag in this call: the group's disks, filtered here.
            disks = self.p.call(
                lambda: list(compute.disks.list_by_resource_group(self.p.resource_group))
            )
        except NotFound:
            return []
        return [
            self._volume(d)
            for d in disks
            if (d.tags or {}).get(TAG_MANAGED_BY) == TAG_MANAGED_BY_VALUE and d.location in wanted
        ]

    def attach(self, volume: VolumeRef, instance: InstanceRef, index: int) -> None:
        from azure.mgmt.compute import models

        compute, _ = self.p._clients()
        disk = self.p.call(lambda: compute.disks.get(*self._locate(volume)))
        rg, name = self.p._locate(instance)
        vm = self.p.call(lambda: compute.virtual_machines.get(rg, name))
        data_disks = list(vm.storage_profile.data_disks or [])
        if any(_same(d, disk.id) for d in data_disks):
            return
        # Azure refuses a disk of another zone and one attached to another VM: InvalidRequest.
        data_disks.append(
            models.DataDisk(
                lun=index,
                create_option="Attach",
                managed_disk=models.ManagedDiskParameters(id=disk.id),
                delete_option="Detach",
            )
        )
        vm.storage_profile.data_disks = data_disks
        self.p._wait(partial(compute.virtual_machines.begin_create_or_update, rg, name, vm))

    def detach(self, volume: VolumeRef, instance: InstanceRef) -> None:
        compute, _ = self.p._clients()
        rg, name = self.p._locate(instance)
        try:
            vm = self.p.call(lambda: compute.virtual_machines.get(rg, name))
        except NotFound:
            return
        disk_id = self._disk_id(volume)
        data_disks = list(vm.storage_profile.data_disks or [])
        kept = [d for d in data_disks if not _same(d, disk_id)]
        if len(kept) == len(data_disks):
            return
        vm.storage_profile.data_disks = kept
        self.p._wait(partial(compute.virtual_machines.begin_create_or_update, rg, name, vm))

    def delete(self, ref: VolumeRef) -> None:
        compute, _ = self.p._clients()
        try:
            self.p._wait(partial(compute.disks.begin_delete, *self._locate(ref)))
        except NotFound:
            return

    def device(self, volume: Volume, index: int, machine_type: str = "") -> str:
        return f"/dev/disk/azure/scsi1/lun{index}"

    # --- helpers ----------------------------------------------------------------------------

    def _locate(self, ref: VolumeRef) -> tuple[str, str]:
        m = _DISK_ID.search(ref.id)
        return (m[1], m[2]) if m else (self.p.resource_group, ref.name or ref.id)

    def _disk_id(self, ref: VolumeRef) -> str:
        rg, name = self._locate(ref)
        subscription = self.p._subscription_id()
        return (
            f"/subscriptions/{subscription}/resourceGroups/{rg}/providers/Microsoft.Compute/"
            f"disks/{name}"
        )

    def _volume(self, disk: Any) -> Volume:
        from providers.azure.instances import _utc

        props = disk.properties
        return Volume(
            id=disk.id,
            name=disk.name,
            region=disk.location,
            zone=(disk.zones or [""])[0],
            size_gb=int(props.disk_size_gb or 0) if props else 0,
            state=_state(disk),
            labels=dict(disk.tags or {}),
            attached_to=disk.managed_by or None,
            created_at=_utc(props.time_created) if props else None,
        )


def _state(disk: Any) -> VolumeState:
    """A disk's state: in use while a VM holds it, else by its provisioning and disk state."""
    props = disk.properties
    state_word = _word(getattr(props, "disk_state", None))
    if disk.managed_by:
        return VolumeState.IN_USE
    if _word(getattr(props, "provisioning_state", None)) in ("Creating", "Updating"):
        return VolumeState.CREATING
    if state_word in ("Unattached", ""):
        return VolumeState.AVAILABLE
    return VolumeState.IN_USE if state_word == "Attached" else VolumeState.ERROR


def _word(value: Any) -> str:
    """An SDK enum member or a plain string, as the string ARM sent."""
    return str(getattr(value, "value", value) or "")


def _same(data_disk: Any, disk_id: str) -> bool:
    """ARM ids compare without regard to case (resource group names are case-insensitive)."""
    managed = data_disk.managed_disk
    return bool(managed and (managed.id or "").lower() == disk_id.lower())
