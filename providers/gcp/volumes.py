"""Persistent disks for the GCP adapter: disks.insert/get/aggregatedList/delete and
instances.attachDisk/detachDisk, awaited as zone operations like every other call.

A volume is a zonal disk named ``request.name`` of the type its first machine's series takes
(``request.disk_type``: pd-balanced, or Hyperdisk Balanced on the Hyperdisk-only A3 Ultra and
A4, :mod:`providers.gcp.disktypes`), labelled with our labels; its
insert carries a requestId derived from the intent's token (as launch does), and a 409 on our
name with our labels is the same intent adopted. It is attached READ_WRITE with
``autoDelete: false`` and the volume's name as its device name, so it outlives the instance
("Specifies whether the disk will be auto-deleted when the instance is deleted (but not when
the disk is detached from the instance)", compute_v1.AttachedDisk.auto_delete), and the guest
sees it at ``/dev/disk/by-id/google-<device name>`` ("If you specified a custom device name
when you created the disk: google-DEVICE_NAME", cloud.google.com/compute/docs/disks/
disk-symlinks).

A disk's ``users`` name instances by URL; the numeric id the contract's ``attached_to``
carries costs one instances.get per attached disk.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

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
from providers.gcp import disktypes, prices
from providers.gcp.network import last
from providers.gcp.values import labels, timestamp, utc

if TYPE_CHECKING:
    from providers.gcp.adapter import GCPProvider

DISK_TYPE = disktypes.PD_BALANCED  # without a request.disk_type: N1, A2, G2, A3 High/Mega
_NAMESPACE = uuid.UUID("0f6c1f43-8a61-4f2c-9d8e-3b1f7d2a5c90")
# compute_v1.Disk.status: "CREATING, RESTORING, FAILED, READY, DELETING, UNAVAILABLE"
_STATES = {
    "CREATING": VolumeState.CREATING,
    "RESTORING": VolumeState.CREATING,
    "READY": VolumeState.AVAILABLE,
    "DELETING": VolumeState.DELETING,
    "FAILED": VolumeState.ERROR,
    "UNAVAILABLE": VolumeState.ERROR,
}


def volume_request_id(request: VolumeRequest) -> str:
    """The same intent in the same place is one disks.insert request."""
    return str(uuid.uuid5(_NAMESPACE, f"{request.token}/{request.zone}/{request.name}"))


class PersistentDisks(VolumeService):
    """The volume half of :class:`~providers.gcp.adapter.GCPProvider`."""

    def __init__(self, provider: GCPProvider) -> None:
        self.p = provider

    def _disks(self) -> Any:
        return self.p._client("disks")

    def create(self, request: VolumeRequest) -> Volume:
        from google.cloud import compute_v1

        zone = request.zone
        insert = compute_v1.InsertDiskRequest(
            project=self.p._project(),
            zone=zone,
            disk_resource=compute_v1.Disk(
                name=request.name,
                size_gb=request.size_gb,
                type_=f"zones/{zone}/diskTypes/{request.disk_type or DISK_TYPE}",
                labels=labels(request.labels),
            ),
            request_id=volume_request_id(request),
        )
        ref = VolumeRef(id=request.name, region=request.region, zone=zone, name=request.name)
        try:
            operation = self.p.call(lambda: self._disks().insert_unary(request=insert, retry=None))
        except InvalidRequest as exc:
            if exc.code != "alreadyExists":
                raise
            existing = self.get(ref)  # ours when it carries this intent's labels
            if dict(existing.labels).items() >= labels(request.labels).items():
                return existing
            raise InvalidRequest(
                f"gcp: a disk named {request.name} already exists in {zone} and is not this volume",
                code="alreadyExists",
            ) from exc
        self.p._wait(operation, zone)
        return self.get(ref)

    def get(self, ref: VolumeRef) -> Volume:
        return self._volume(self._raw(ref))

    def ours(self, regions: Sequence[str] | None = None) -> list[Volume]:
        from google.cloud import compute_v1

        wanted = set(regions) if regions is not None else self.p._regions()
        request = compute_v1.AggregatedListDisksRequest(
            project=self.p._project(),
            filter=f'(labels.{TAG_MANAGED_BY} = "{TAG_MANAGED_BY_VALUE}")',
            max_results=500,
        )

        def every_page() -> list[Any]:
            pager = self._disks().aggregated_list(request=request, retry=None)
            return [disk for _, scoped in pager for disk in scoped.disks]

        found = self.p.call(every_page)
        return [self._volume(disk) for disk in found if prices.region_of(last(disk.zone)) in wanted]

    def attach(self, volume: VolumeRef, instance: InstanceRef, index: int) -> None:
        from google.cloud import compute_v1

        disk = self._raw(volume)
        if any(last(user) == instance.name for user in disk.users):
            return
        # The cloud refuses another zone ("Disk must be in the same zone as the instance") and
        # a READ_WRITE disk in use (RESOURCE_IN_USE_BY_ANOTHER_RESOURCE): InvalidRequest.
        attached = compute_v1.AttachedDisk(
            source=disk.self_link,
            device_name=disk.name,
            auto_delete=False,
            mode="READ_WRITE",
            type_="PERSISTENT",
        )
        self._instance_call(instance, "attach_disk_unary", attached_disk_resource=attached)

    def detach(self, volume: VolumeRef, instance: InstanceRef) -> None:
        try:
            disk = self._raw(volume)
        except NotFound:
            return
        if not any(last(user) == instance.name for user in disk.users):
            return
        try:  # the device name it was attached under, as the instance lists it
            vm = self.p.call(
                partial(self._get_instance, instance.zone, instance.name or instance.id)
            )
        except NotFound:
            return
        device = next((d.device_name for d in vm.disks if d.source == disk.self_link), None)
        if device is None:
            return
        self._instance_call(instance, "detach_disk_unary", device_name=device)

    def delete(self, ref: VolumeRef) -> None:
        zone = ref.zone
        call_id = str(uuid.uuid4())
        try:
            operation = self.p.call(
                lambda: self._disks().delete_unary(
                    request={
                        "project": self.p._project(),
                        "zone": zone,
                        "disk": ref.name or ref.id,
                        "request_id": call_id,
                    },
                    retry=None,
                )
            )
            self.p._wait(operation, zone)
        except NotFound:
            return

    def device(self, volume: Volume, index: int, machine_type: str = "") -> str:
        return f"/dev/disk/by-id/google-{volume.name}"

    # --- helpers ----------------------------------------------------------------------------

    def _raw(self, ref: VolumeRef) -> Any:
        if not ref.zone:
            raise InvalidRequest(f"gcp: volume {ref.name or ref.id} has no zone", code="noZone")
        return self.p.call(
            lambda: self._disks().get(
                project=self.p._project(), zone=ref.zone, disk=ref.name or ref.id, retry=None
            )
        )

    def _instance_call(self, instance: InstanceRef, method: str, **fields: Any) -> None:
        call_id = str(uuid.uuid4())  # one per call: a retry after a lost answer joins it
        operation = self.p.call(
            lambda: getattr(self.p._instances(), method)(
                request={
                    "project": self.p._project(),
                    "zone": instance.zone,
                    "instance": instance.name or instance.id,
                    "request_id": call_id,
                    **fields,
                },
                retry=None,
            )
        )
        self.p._wait(operation, instance.zone)

    def _attached_to(self, disk: Any) -> str | None:
        """The numeric id of the instance using the disk (its ``users`` name it by URL)."""
        zone = last(disk.zone)
        for user in disk.users:
            try:
                vm = self.p.call(partial(self._get_instance, zone, last(user)))
            except NotFound:
                continue  # deleted between the two reads
            return str(vm.id)
        return None

    def _get_instance(self, zone: str, name: str) -> Any:
        return self.p._instances().get(
            project=self.p._project(), zone=zone, instance=name, retry=None
        )

    def _volume(self, disk: Any) -> Volume:
        zone = last(disk.zone)
        attached = self._attached_to(disk) if disk.users else None
        state = _STATES.get(disk.status, VolumeState.CREATING)
        if state is VolumeState.AVAILABLE and attached:
            state = VolumeState.IN_USE
        tags: Mapping[str, str] = dict(disk.labels)
        return Volume(
            id=disk.name,
            name=disk.name,
            region=prices.region_of(zone),
            zone=zone,
            size_gb=int(disk.size_gb),
            state=state,
            labels=tags,
            attached_to=attached,
            created_at=utc(timestamp(disk.creation_timestamp)),
        )
