"""Which disk type a cloud makes a volume of for a machine family, and which families refuse a
volume that exists already. Tables only (no SDK): the planner asks before anything is
launched, so ``plan`` can turn a machine down with the reason instead of a machine that bills
while its disk cannot attach.

- GCP: per machine series (:mod:`providers.gcp.disktypes`: A3 Ultra and A4 take Hyperdisk only;
  N1, A2, G2 Persistent Disk; A3 High/Mega both).
- AWS: every family we offer takes gp3 EBS; only the guest's device name differs (Xen/Nitro,
  :mod:`providers.aws.devices`), which the mount script follows.
- Azure: volumes are Standard SSD (``StandardSSD_LRS``): "Like standard HDDs, standard SSDs are
  available on all Azure VMs"; only Premium SSD is limited ("Premium SSDs can only be used with
  VM series that are premium storage-compatible", the 's' sizes) (Azure docs, "Azure managed
  disk types"). Every size in our catalog is an 's' size anyway. The device is the LUN link
  (``/dev/disk/azure/scsi1/lun<N>``) of a SCSI disk controller, the default where a VM does not
  ask for NVMe (``storageProfile.diskControllerType``; the adapter does not set it).
- Yandex: volumes are ``network-ssd`` (settings ``disk_type``), seen as
  ``/dev/disk/by-id/virtio-<disk id>``; the Compute Cloud docs we searched state no platform
  restriction for network disks on the GPU platforms we offer.
- SberCloud (Huawei ECS): EVS disks attached as VBD show ``/dev/disk/by-id/virtio-<serial>``
  on KVM flavors (the P-series we offer); the ECS/EVS docs we searched state no flavor
  restriction for attaching them.
"""

from __future__ import annotations

DEFAULTS = {"gcp": "pd-balanced"}  # what a volume recorded before types were kept was made of


def volume_type(cloud: str, machine_type: str) -> str:
    """The disk type a new volume for ``machine_type`` is made of; "" for the adapter's one."""
    if cloud == "gcp":
        from providers.gcp import disktypes

        return disktypes.volume_type(machine_type)
    return ""


def refusal(cloud: str, machine_type: str, disk_type: str) -> str | None:
    """Why a volume of ``disk_type`` ("" : made before types were kept, the cloud's default
    then) cannot attach to a ``machine_type`` machine, or None."""
    disk_type = disk_type or DEFAULTS.get(cloud, "")
    if cloud == "gcp" and disk_type:
        from providers.gcp import disktypes

        return disktypes.refusal(machine_type, disk_type)
    return None
