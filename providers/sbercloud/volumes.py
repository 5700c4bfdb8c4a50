"""Volumes on SberCloud (Huawei EVS through ``huaweicloudsdkevs``), attached and detached with the
ECS calls (``AttachServerVolume``/``DetachServerVolume``); every change is a job, polled.

Facts this relies on (Huawei EVS/ECS API references, as published by Open Telekom Cloud in
opentelekomcloud-docs/elastic-volume-service and .../elastic-cloud-server, and the SDK models):
  * Create is idempotent by ``X-Client-Token`` ("请求的幂等标识", huaweicloudsdkevs
    CreateVolumeRequest): the request's token goes there. ``create_for_volume_id: "true"`` in
    the metadata makes the answer carry the new volume's id (CreateVolumeOption.metadata).
  * "Disks and the server you attach the disks to must be in the same AZ" (EVS FAQ, "Can I
    Attach a Disk to a Server in a Different AZ?"); a disk not ``available`` is refused,
    Ecs.0103 "The disk can be attached to a server only when it exists and is in the Available
    state" (ECS error codes). Both are InvalidRequest here.
  * An attached disk is not deleted: EVS.1046 "volume status must be available, error,
    error_extending, error_restoring, error_rollbacking when delete volume!" (EVS error codes).
  * DeleteServers with ``delete_volume`` true deletes "the data disks attached to an ECS"
    (ECS "Deleting ECSs"), and the adapter sends it so nothing of a machine bills on: so
    :meth:`Volumes.keep` detaches our volumes (tag ``managed-by=provisioner``) first.
  * The device: on KVM servers a VBD disk's serial "is the first 20 digits of a disk UUID", seen
    as ``/dev/disk/by-id/virtio-<serial>`` (ECS FAQ, "How Do I Obtain My Disk Name in the ECS OS
    Using the Device Identifier Provided on the Console?").
Labels become tags EVS accepts (:func:`.tags.volume_tags`: 36/43 characters of digits, letters,
``-`` and ``_``, at most 10; else EVS.1061/EVS.1062).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from providers.base import (
    TAG_MANAGED_BY,
    TAG_MANAGED_BY_VALUE,
    InstanceRef,
    InvalidRequest,
    NotFound,
    Throttled,
    Volume,
    VolumeRef,
    VolumeRequest,
    VolumeService,
    VolumeState,
)
from providers.retry import wait_until
from providers.sbercloud import errors, tags

if TYPE_CHECKING:
    from providers.sbercloud.adapter import SberCloudProvider

T = TypeVar("T")

# EVS disk states (EVS API reference, "EVS Disk Status"): the moving ones read as where they go
_STATES = {
    "creating": VolumeState.CREATING,
    "downloading": VolumeState.CREATING,
    "available": VolumeState.AVAILABLE,
    "in-use": VolumeState.IN_USE,
    "attaching": VolumeState.IN_USE,
    "detaching": VolumeState.IN_USE,
    "deleting": VolumeState.DELETING,
}
SERIAL_CHARS = 20  # a VBD disk's serial: the first 20 characters of its id


class Volumes(VolumeService):
    """The volume calls of one SberCloud adapter (its region's EVS endpoint)."""

    def __init__(self, cloud: SberCloudProvider) -> None:
        self.cloud = cloud
        o = cloud.options
        self.endpoint: str = o.evs_endpoint or f"https://evs.{cloud.region}.hc.sbercloud.ru"
        self._client: Any = None

    def create(self, request: VolumeRequest) -> Volume:
        from huaweicloudsdkevs.v2 import model as e

        option = e.CreateVolumeOption(
            availability_zone=request.zone,
            name=request.name,
            size=request.size_gb,
            volume_type=self.cloud.options.volume_type,
            tags=tags.volume_tags(request.labels),
            metadata={"create_for_volume_id": "true"},
        )
        create = e.CreateVolumeRequest(
            x_client_token=request.token, body=e.CreateVolumeRequestBody(volume=option)
        )
        where = f"create volume {request.name} in {request.zone}"
        created = self._evs(where, lambda c: c.create_volume(create))
        job = self._wait(created.job_id, where)  # None: still running at the deadline
        volume_id = next(iter(created.volume_ids or []), None) or (
            job.entities.volume_id if job is not None and job.entities else None
        )
        if not volume_id:
            raise Throttled(f"sbercloud: {where}: no volume id yet (job {created.job_id})")
        return self.get(VolumeRef(id=volume_id, region=self.cloud.region, zone=request.zone))

    def get(self, ref: VolumeRef) -> Volume:
        return self._to_volume(self._show(ref.id))

    def ours(self, regions: Sequence[str] | None = None) -> list[Volume]:
        """Every page (``offset`` counts volumes) of the project's volumes, ours kept."""
        if regions is not None and self.cloud.region not in regions:
            return []
        return [
            self._to_volume(v)
            for v in self._volumes()
            if (v.tags or {}).get(TAG_MANAGED_BY) == TAG_MANAGED_BY_VALUE
        ]

    def attach(self, volume: VolumeRef, instance: InstanceRef, index: int = 0) -> None:
        """ECS AttachServerVolume, then its job. Already attached there: nothing to do."""
        from huaweicloudsdkecs.v2 import model as m

        if instance.id in _servers(self._show(volume.id)):
            return
        where = f"attach volume {volume.id} to server {instance.id}"
        body = m.AttachServerVolumeRequestBody(
            volume_attachment=m.AttachServerVolumeOption(volume_id=volume.id)
        )
        try:
            job = self.cloud._call(
                where,
                lambda c: c.attach_server_volume(
                    m.AttachServerVolumeRequest(server_id=instance.id, body=body)
                ),
            )
        except InvalidRequest:
            # a retried call whose first answer was lost finds the disk attaching or attached
            if instance.id in _servers(self._settled(volume.id)):
                return
            raise
        self.cloud._finish(job.job_id, where)

    def detach(self, volume: VolumeRef, instance: InstanceRef) -> None:
        """ECS DetachServerVolume when attached to that server; else nothing to do."""
        from huaweicloudsdkecs.v2 import model as m

        try:
            if instance.id not in _servers(self._show(volume.id)):
                return
            where = f"detach volume {volume.id} from server {instance.id}"
            try:
                job = self.cloud._call(
                    where,
                    lambda c: c.detach_server_volume(
                        m.DetachServerVolumeRequest(server_id=instance.id, volume_id=volume.id)
                    ),
                )
            except InvalidRequest:
                # as for attach: a retry after a lost answer finds it detaching or detached
                if instance.id not in _servers(self._settled(volume.id)):
                    return
                raise
            self.cloud._finish(job.job_id, where)
        except NotFound:
            return

    def delete(self, ref: VolumeRef) -> None:
        from huaweicloudsdkevs.v2 import model as e

        where = f"delete volume {ref.id}"
        try:
            job = self._evs(
                where, lambda c: c.delete_volume(e.DeleteVolumeRequest(volume_id=ref.id))
            )
        except NotFound:
            return
        except InvalidRequest as refused:
            # a retry after a lost answer finds it deleting (EVS.1046): the first call's job runs
            try:
                if self._show(ref.id).status != "deleting":
                    raise refused from None
            except NotFound:
                pass
            return
        if self._wait(job.job_id, where) is None:
            raise Throttled(
                f"sbercloud: {where}: job {job.job_id} still running", code="JobTimeout"
            )

    def device(self, volume: Volume, index: int, machine_type: str = "") -> str:
        return f"/dev/disk/by-id/virtio-{volume.id[:SERIAL_CHARS]}"

    def keep(self, server: Any) -> None:
        """Detach our volumes from a server (its ECS detail) about to be deleted with its data
        disks. Its disks are read off the server (``os-extended-volumes:volumes_attached``,
        ``bootIndex`` "0" the boot disk, "-1" the others: ServerExtendVolumeAttachment), so a
        server with none costs no EVS call."""
        ref = InstanceRef(id=server.id, region=self.cloud.region)
        for disk in server.os_extended_volumesvolumes_attached or []:
            if disk.boot_index == "0" or not disk.id:
                continue
            try:
                volume = self._show(disk.id)
            except NotFound:
                continue
            if (volume.tags or {}).get(TAG_MANAGED_BY) == TAG_MANAGED_BY_VALUE:
                self.detach(VolumeRef(id=disk.id, region=self.cloud.region), ref)

    # --- helpers -------------------------------------------------------------------------

    def _evs(self, where: str, fn: Callable[[Any], T]) -> T:
        def attempt() -> T:
            if self._client is None:
                from huaweicloudsdkevs.v2 import EvsClient

                self._client = self.cloud._build(EvsClient, self.endpoint)
            return fn(self._client)

        return self.cloud.call(attempt, where)

    def _wait(self, job_id: str, where: str) -> Any:
        """Poll an EVS job: the job on SUCCESS, None while still running at the deadline; a
        FAIL raises its error."""
        from huaweicloudsdkevs.v2 import model as e

        job, finished = wait_until(
            lambda: self._evs(where, lambda c: c.show_job(e.ShowJobRequest(job_id=job_id))),
            lambda j: j.status in ("SUCCESS", "FAIL"),
            timeout=self.cloud.options.operation_timeout_seconds,
            interval=self.cloud.options.poll_seconds,
        )
        if job.status == "FAIL":
            reason = job.fail_reason or "no reason given"
            raise errors.by_code(
                None, job.error_code, f"job {job_id} failed: {reason}", where=where
            )
        return job if finished else None

    def _settled(self, volume_id: str) -> Any:
        """The volume once no attach or detach is under way (within the job deadline)."""
        volume, _ = wait_until(
            lambda: self._show(volume_id),
            lambda v: v.status not in ("attaching", "detaching"),
            timeout=self.cloud.options.operation_timeout_seconds,
            interval=self.cloud.options.poll_seconds,
        )
        return volume

    def _show(self, volume_id: str) -> Any:
        from huaweicloudsdkevs.v2 import model as e

        return self._evs(
            f"get volume {volume_id}",
            lambda c: c.show_volume(e.ShowVolumeRequest(volume_id=volume_id)),
        ).volume

    def _volumes(self) -> list[Any]:
        from huaweicloudsdkevs.v2 import model as e

        limit = self.cloud.options.page_size
        out: list[Any] = []
        while True:
            request = e.ListVolumesRequest(limit=limit, offset=len(out))
            page = self._evs("list volumes", partial(_list, request))
            rows = page.volumes or []
            out.extend(rows)
            if len(rows) < limit or len(out) >= (page.count or 0):
                return out

    def _to_volume(self, v: Any) -> Volume:
        status = (v.status or "").lower()
        attached = _servers(v)
        # busy states (backing-up, extending, …) read as attached or not
        state = _STATES.get(status, VolumeState.IN_USE if attached else VolumeState.AVAILABLE)
        if status.startswith("error"):
            state = VolumeState.ERROR
        return Volume(
            id=v.id,
            name=v.name or "",
            region=self.cloud.region,
            zone=v.availability_zone or "",
            size_gb=v.size or 0,
            state=state,
            labels=dict(v.tags or {}),
            attached_to=attached[0] if attached else None,
            created_at=_time(v.created_at),
        )


def _time(value: str | None) -> datetime | None:
    """EVS ``created_at``, e.g. 2016-05-25T02:42:10.856332: UTC without an offset."""
    try:
        parsed = datetime.fromisoformat(value or "")
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _list(request: Any, client: Any) -> Any:
    return client.list_volumes(request)


def _servers(volume: Any) -> list[str]:
    """The servers a volume is attached to (EVS ``attachments``)."""
    return [a.server_id for a in volume.attachments or [] if a.server_id]
