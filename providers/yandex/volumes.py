"""Volumes on Yandex Cloud: Compute network disks (DiskService) attached with
InstanceService.AttachDisk/DetachDisk, every change an operation polled as the adapter's others.

Facts this relies on (yandex-cloud/docs; the SDK's compute/v1 protos):
  * "Disks can only be attached to one VM at a time. The disk and VM must be located in the same
    availability zone" and "If previously created disks were connected to the VM, they will be
    disabled when the VM is deleted. Disk data is preserved" (en/compute/concepts/disk.md).
    We attach with ``auto_delete`` false: "Specifies whether the disk will be auto-deleted when
    the instance is deleted" (AttachedDiskSpec).
  * A disk that is attached is not deleted: FAILED_PRECONDITION 'Disk "<id>" has an invalid
    state for this operation: attached to instance' (seen live,
    yandex-cloud/terraform-provider-yandex#222): InvalidRequest here.
  * The device: ``device_name`` is the "serial number of your choice that is reflected into the
    /dev/disk/by-id/ tree", matching ``[a-z][a-z0-9-_]{,19}`` (AttachedDiskSpec; Compute API
    reference, Instance/attachDisk). A volume name (up to 50 characters) does not fit, so the
    device name is the disk id (20 characters, a letter first), and the machine sees
    ``/dev/disk/by-id/virtio-<disk id>``, the form "Partitioning and mounting an empty disk"
    shows for network disks (en/compute/operations/vm-control/vm-attach-disk.md: "Network
    disks have links in ``virtio-<disk_ID>`` format").
  * Idempotency: a disk has no client token. Create carries the ``Idempotency-Key`` every
    Yandex service honours ("checks whether an operation with this UUID has already been
    created. If so, the server returns the Operation object",
    en/api-design-guide/concepts/idempotency.md), a UUIDv5 of the token; and, since how long a
    key is kept is not written down, the folder is first searched for a disk of that name
    carrying our token label. (Whether Yandex refuses a second disk of a name is not written
    down either: a disk of that name made for something else is left alone, and Create
    decides.)
  * ListDisks filters on a few fields only (its ``filter`` doc): labels are checked here.
"""

from __future__ import annotations

import uuid
from datetime import UTC
from typing import TYPE_CHECKING, Any

from providers.base import (
    TAG_MANAGED_BY,
    TAG_MANAGED_BY_VALUE,
    InstanceRef,
    NotFound,
    Volume,
    VolumeRef,
    VolumeRequest,
    VolumeService,
    VolumeState,
)
from providers.yandex.labels import idempotency_key, sanitise_label, sanitise_labels
from providers.yandex.prices import REGION

if TYPE_CHECKING:
    from collections.abc import Sequence

    from providers.yandex.adapter import YandexProvider

#: The label that ties a disk to the token it was created for (a UUIDv5 of it).
TOKEN_LABEL = "provisioner-volume-token"
_STATES = {
    "CREATING": VolumeState.CREATING,
    "READY": VolumeState.AVAILABLE,
    "ERROR": VolumeState.ERROR,
    "DELETING": VolumeState.DELETING,
}


class Volumes(VolumeService):
    """The volume calls of one Yandex adapter."""

    def __init__(self, cloud: YandexProvider) -> None:
        self.cloud = cloud

    def create(self, request: VolumeRequest) -> Volume:
        from yandex.cloud.compute.v1 import disk_pb2
        from yandex.cloud.compute.v1.disk_service_pb2 import CreateDiskRequest
        from yandex.cloud.compute.v1.disk_service_pb2_grpc import DiskServiceStub

        folder_id = self.cloud._require_folder()
        token = sanitise_label(idempotency_key(request.token), key=False)
        for disk in self._disks(folder_id, f'name = "{request.name}"'):
            if disk.name == request.name and disk.labels.get(TOKEN_LABEL) == token:
                return self._to_volume(disk)  # made for this token already
        what = f"create disk {request.name} in {request.zone}"
        operation = self.cloud._rpc(
            DiskServiceStub,
            "Create",
            CreateDiskRequest(
                folder_id=folder_id,
                name=request.name,
                labels={**sanitise_labels(request.labels), TOKEN_LABEL: token},
                type_id=self.cloud.options.disk_type,
                zone_id=request.zone,
                size=request.size_gb << 30,
            ),
            what,
            zone=request.zone,
            metadata=[("idempotency-key", idempotency_key(request.token))],
        )
        done = self.cloud._wait(operation, what, request.zone)
        disk = disk_pb2.Disk()
        done.response.Unpack(disk)
        return self._to_volume(disk)

    def get(self, ref: VolumeRef) -> Volume:
        return self._to_volume(self._get_raw(ref.id))

    def ours(self, regions: Sequence[str] | None = None) -> list[Volume]:
        """Every page of the folder's disks, ours kept (label ``managed-by=provisioner``): boot
        disks and other people's disks are in the same list."""
        if regions is not None and REGION not in regions:
            return []
        folder_id = self.cloud._require_folder()
        return [
            self._to_volume(d)
            for d in self._disks(folder_id)
            if d.labels.get(TAG_MANAGED_BY) == TAG_MANAGED_BY_VALUE
        ]

    def attach(self, volume: VolumeRef, instance: InstanceRef, index: int = 0) -> None:
        """AttachDisk READ_WRITE, device name the disk id, kept when the instance is deleted.
        Already attached there: nothing to do. Yandex's refusals (another zone, attached to
        another machine) come back as FAILED_PRECONDITION: InvalidRequest."""
        from yandex.cloud.compute.v1 import instance_service_pb2 as svc
        from yandex.cloud.compute.v1.instance_service_pb2_grpc import InstanceServiceStub

        if instance.id in self._get_raw(volume.id).instance_ids:
            return
        what = f"attach disk {volume.id} to instance {instance.id}"
        spec = svc.AttachedDiskSpec(
            mode=svc.AttachedDiskSpec.READ_WRITE,
            device_name=volume.id,
            auto_delete=False,
            disk_id=volume.id,
        )
        self._operation(
            InstanceServiceStub,
            "AttachDisk",
            svc.AttachInstanceDiskRequest(instance_id=instance.id, attached_disk_spec=spec),
            what,
            instance.zone or volume.zone,
        )

    def detach(self, volume: VolumeRef, instance: InstanceRef) -> None:
        """DetachDisk when the disk is attached to that instance; else (attached elsewhere, to
        nothing, or the instance is gone) nothing to do."""
        from yandex.cloud.compute.v1.instance_service_pb2 import DetachInstanceDiskRequest
        from yandex.cloud.compute.v1.instance_service_pb2_grpc import InstanceServiceStub

        try:
            if instance.id not in self._get_raw(volume.id).instance_ids:
                return
            self._operation(
                InstanceServiceStub,
                "DetachDisk",
                DetachInstanceDiskRequest(instance_id=instance.id, disk_id=volume.id),
                f"detach disk {volume.id} from instance {instance.id}",
                instance.zone or volume.zone,
            )
        except NotFound:
            return

    def delete(self, ref: VolumeRef) -> None:
        from yandex.cloud.compute.v1.disk_service_pb2 import DeleteDiskRequest
        from yandex.cloud.compute.v1.disk_service_pb2_grpc import DiskServiceStub

        try:
            self._operation(
                DiskServiceStub,
                "Delete",
                DeleteDiskRequest(disk_id=ref.id),
                f"delete disk {ref.id}",
                ref.zone,
            )
        except NotFound:
            return

    def device(self, volume: Volume, index: int, machine_type: str = "") -> str:
        return f"/dev/disk/by-id/virtio-{volume.id}"

    # --- helpers -------------------------------------------------------------------------

    def _operation(self, stub: Any, method: str, request: Any, what: str, zone: str) -> None:
        """One change, its key reused across the call's own retries, waited for."""
        operation = self.cloud._rpc(
            stub,
            method,
            request,
            what,
            zone=zone,
            metadata=[("idempotency-key", str(uuid.uuid4()))],
        )
        self.cloud._wait(operation, what, zone)

    def _get_raw(self, disk_id: str) -> Any:
        from yandex.cloud.compute.v1.disk_service_pb2 import GetDiskRequest
        from yandex.cloud.compute.v1.disk_service_pb2_grpc import DiskServiceStub

        return self.cloud._rpc(
            DiskServiceStub, "Get", GetDiskRequest(disk_id=disk_id), f"get disk {disk_id}"
        )

    def _disks(self, folder_id: str, where: str = "") -> Any:
        from yandex.cloud.compute.v1.disk_service_pb2 import ListDisksRequest
        from yandex.cloud.compute.v1.disk_service_pb2_grpc import DiskServiceStub

        return self.cloud._pages(
            lambda token: self.cloud._rpc(
                DiskServiceStub,
                "List",
                ListDisksRequest(
                    folder_id=folder_id, page_size=1000, page_token=token, filter=where
                ),
                f"list disks in folder {folder_id}",
            ),
            "disks",
        )

    def _to_volume(self, disk: Any) -> Volume:
        status = disk.Status.Name(disk.status)
        state = _STATES.get(status, VolumeState.CREATING)
        attached = disk.instance_ids[0] if disk.instance_ids else None
        if state is VolumeState.AVAILABLE and attached:
            state = VolumeState.IN_USE
        return Volume(
            id=disk.id,
            name=disk.name,
            region=disk.zone_id.rsplit("-", 1)[0],
            zone=disk.zone_id,
            size_gb=disk.size >> 30,
            state=state,
            labels=dict(disk.labels),
            attached_to=attached,
            created_at=disk.created_at.ToDatetime(UTC) if disk.HasField("created_at") else None,
        )
