"""EBS volumes for the AWS adapter: CreateVolume, DescribeVolumes, Attach/Detach/DeleteVolume.

A volume is gp3 in one AZ, tagged with our labels and with the intent's token
(``provisioner-token``): DescribeVolumes by that tag finds a volume already made before a
second CreateVolume is sent (which carries the token as ``ClientToken`` too). Only volumes
carrying the token tag are listed, so a machine's root volume (tagged with our labels at
RunInstances) is never taken for one.

A volume attached after launch outlives its instance: "By default, when you attach a non-root
EBS volume to an instance, its DeleteOnTermination attribute is set to false. Therefore, the
default is to preserve these volumes" (EC2 User Guide, "Preserve data when an instance is
terminated"; the table there: "Data volume | After launch | Console and CLI | Preserve").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from providers.aws import devices
from providers.aws.devices import DEVICE_LETTERS
from providers.aws.network import tag_list
from providers.base import (
    TAG_MANAGED_BY,
    TAG_MANAGED_BY_VALUE,
    InstanceRef,
    InvalidRequest,
    MachineState,
    NotFound,
    Throttled,
    Volume,
    VolumeRef,
    VolumeRequest,
    VolumeService,
    VolumeState,
)
from providers.retry import wait_until

if TYPE_CHECKING:
    from providers.aws.adapter import AWSProvider

TAG_TOKEN = "provisioner-token"  # the same key the adapter tags instances with
VOLUME_TYPE = "gp3"
_STATES = {
    "creating": VolumeState.CREATING,
    "available": VolumeState.AVAILABLE,
    "in-use": VolumeState.IN_USE,
    "deleting": VolumeState.DELETING,
    "deleted": VolumeState.DELETING,
    "error": VolumeState.ERROR,
}
_ATTACHED = ("attaching", "attached", "busy")  # VolumeAttachmentState, botocore's ec2 model
WAIT_SECONDS = 300  # a volume is available or attached, an instance booted, within minutes


class EbsVolumes(VolumeService):
    """The volume half of :class:`~providers.aws.adapter.AWSProvider`."""

    def __init__(self, provider: AWSProvider) -> None:
        self.p = provider

    def create(self, request: VolumeRequest) -> Volume:
        ec2 = self.p._client("ec2", request.region)
        zone = self.p._zone_name(request.region, request.zone)
        tags = {**request.labels, "Name": request.name, TAG_TOKEN: request.token}

        def attempt() -> dict[str, Any]:
            found = ec2.describe_volumes(
                Filters=[{"Name": f"tag:{TAG_TOKEN}", "Values": [request.token]}]
            )["Volumes"]
            for raw in found:
                if raw["State"] in ("deleting", "deleted", "error"):
                    continue
                if raw.get("AvailabilityZone") != zone or raw.get("Size") != request.size_gb:
                    raise InvalidRequest(
                        f"aws: token {request.token} already made {raw['VolumeId']} "
                        f"({raw.get('Size')} GB in {raw.get('AvailabilityZone')}) for different "
                        "parameters",
                        code="IdempotentParameterMismatch",
                    )
                return dict(raw)
            return dict(
                ec2.create_volume(
                    AvailabilityZone=zone,
                    Size=request.size_gb,
                    VolumeType=VOLUME_TYPE,
                    ClientToken=request.token,
                    TagSpecifications=[{"ResourceType": "volume", "Tags": tag_list(tags)}],
                )
            )

        raw = self.p.call(attempt, f"create volume {request.name} in {zone}")
        if raw["State"] == "creating":  # attachable once available
            raw = self._await(request.region, raw["VolumeId"], ("available", "in-use"))
        return self._volume(raw, request.region)

    def get(self, ref: VolumeRef) -> Volume:
        return self._volume(self._describe(ref.region, ref.id), ref.region)

    def ours(self, regions: Sequence[str] | None = None) -> list[Volume]:
        filters = [
            {"Name": f"tag:{TAG_MANAGED_BY}", "Values": [TAG_MANAGED_BY_VALUE]},
            {"Name": "tag-key", "Values": [TAG_TOKEN]},
        ]
        found: list[Volume] = []
        for region in regions or self.p.regions:
            ec2 = self.p._client("ec2", region)

            def fetch(ec2: Any = ec2) -> list[dict[str, Any]]:
                pages = ec2.get_paginator("describe_volumes").paginate(Filters=filters)
                return [raw for page in pages for raw in page["Volumes"]]

            raws = self.p.call(fetch, "list volumes")
            found.extend(self._volume(raw, region) for raw in raws if raw["State"] != "deleted")
        return found

    def attach(self, volume: VolumeRef, instance: InstanceRef, index: int) -> None:
        raw = self._describe(volume.region, volume.id)
        if _attached_to(raw) == instance.id:
            return
        if not 0 <= index < len(DEVICE_LETTERS):
            raise InvalidRequest(
                f"aws: volume index {index} is past /dev/sdp", code="InvalidParameterValue"
            )
        self._await_instance(instance)
        ec2 = self.p._client("ec2", volume.region)
        device = devices.attach_name(index)
        # EC2 refuses another AZ (InvalidVolume.ZoneMismatch) and a volume attached elsewhere
        # (VolumeInUse): both come back as InvalidRequest through errors.by_code.
        self.p.call(
            lambda: ec2.attach_volume(VolumeId=volume.id, InstanceId=instance.id, Device=device),
            f"attach {volume.id} to {instance.id}",
        )
        self._await(volume.region, volume.id, ("in-use",))

    def detach(self, volume: VolumeRef, instance: InstanceRef) -> None:
        try:
            raw = self._describe(volume.region, volume.id)
        except NotFound:
            return
        if _attached_to(raw) != instance.id:
            return
        ec2 = self.p._client("ec2", volume.region)
        try:
            self.p.call(
                lambda: ec2.detach_volume(VolumeId=volume.id, InstanceId=instance.id),
                f"detach {volume.id} from {instance.id}",
            )
        except InvalidRequest as exc:
            # detached meanwhile: "IncorrectState ... is in the 'available' state"
            if exc.code not in ("IncorrectState", "InvalidAttachment.NotFound"):
                raise
        self._await(volume.region, volume.id, ("available",))

    def delete(self, ref: VolumeRef) -> None:
        ec2 = self.p._client("ec2", ref.region)
        try:
            self.p.call(lambda: ec2.delete_volume(VolumeId=ref.id), f"delete {ref.id}")
        except NotFound:
            return

    @staticmethod
    def device(volume: Volume, index: int, machine_type: str = "") -> str:
        """Where the guest sees it: NVMe by-id link on Nitro, /dev/xvd? on Xen
        (:mod:`providers.aws.devices`)."""
        return devices.guest_path(machine_type, volume.id, index)

    # --- helpers ----------------------------------------------------------------------------

    def _describe(self, region: str, volume_id: str) -> dict[str, Any]:
        ec2 = self.p._client("ec2", region)
        found = self.p.call(
            lambda: ec2.describe_volumes(VolumeIds=[volume_id])["Volumes"],
            f"describe {volume_id}",
        )
        if not found or found[0]["State"] == "deleted":
            raise NotFound(
                f"aws: volume {volume_id} not found in {region}", code="InvalidVolume.NotFound"
            )
        return dict(found[0])

    def _await_instance(self, ref: InstanceRef) -> None:
        """EC2 attaches only to a running or stopped instance ("IncorrectState: Instance 'i-…'
        is not 'running'." right after RunInstances, ansible-collections/amazon.aws#497): wait
        out its boot (or its stop); any other state is left to AttachVolume to answer."""
        moving = (MachineState.PENDING, MachineState.STOPPING)
        instance, done = wait_until(
            lambda: self.p.get(ref),
            lambda i: i.state not in moving,
            timeout=WAIT_SECONDS,
            interval=self.p.options.poll_seconds,
        )
        if not done:
            raise Throttled(
                f"aws: {ref.id} still {instance.state} after {WAIT_SECONDS} s: volumes attach "
                "only to a running or stopped instance",
                code="IncorrectState",
            )

    def _await(self, region: str, volume_id: str, states: tuple[str, ...]) -> dict[str, Any]:
        raw, done = wait_until(
            lambda: self._describe(region, volume_id),
            lambda raw: raw["State"] in states,
            timeout=WAIT_SECONDS,
            interval=self.p.options.poll_seconds,
        )
        if not done:
            raise Throttled(
                f"aws: volume {volume_id} still {raw['State']} after {WAIT_SECONDS} s",
                code="VolumeTimeout",
            )
        return raw

    def _volume(self, raw: Mapping[str, Any], region: str) -> Volume:
        tags = {t["Key"]: t["Value"] for t in raw.get("Tags", [])}
        name = raw.get("AvailabilityZone", "")
        zone = raw.get("AvailabilityZoneId") or self.p._zones(region).get(name, name)
        return Volume(
            id=raw["VolumeId"],
            name=tags.get("Name", ""),
            region=region,
            zone=zone,
            size_gb=int(raw.get("Size") or 0),
            state=_STATES.get(raw["State"], VolumeState.ERROR),
            labels={k: v for k, v in tags.items() if k not in ("Name", TAG_TOKEN)},
            attached_to=_attached_to(raw),
            created_at=raw.get("CreateTime"),
        )


def _attached_to(raw: Mapping[str, Any]) -> str | None:
    for attachment in raw.get("Attachments") or []:
        if attachment.get("State") in _ATTACHED:
            return str(attachment["InstanceId"])
    return None
