"""EBS device names for the AWS emulator: what AttachVolume accepts, and where the guest of
each instance family then sees the volume (moto keeps neither rule).

- A device name must be one EC2 takes for an EBS volume: a whole disk, ``/dev/sd[b-z]`` or
  ``/dev/xvd[b-z]`` ("Device names on Linux instances", EC2 User Guide, Available / Recommended
  for EBS volumes). Anything else (a partition, ``/dev/xvdeo``) is refused with
  "InvalidParameterValue: Value (/dev/sdk1) for parameter device is invalid. /dev/sdk1 is not a
  valid EBS device name." (base2genomics/batchit#15, sous-chefs/aws#134, kubernetes#42293).
- A name another volume of the instance holds is refused: "InvalidParameterValue: Invalid value
  '/dev/sdf' for unixDevice. Attachment point /dev/sdf is already in use" (nanovms/ops#1189).
- The guest: on an instance built on the Nitro System "EBS volumes are exposed as NVMe block
  devices", named by discovery order, with the volume id as the NVMe serial ("Amazon EBS and
  NVMe", EC2 User Guide), which udev links as ``/dev/disk/by-id/nvme-Amazon_Elastic_Block_
  Store_vol…``; the name given to AttachVolume is not what the guest sees. On a Xen instance
  the kernel's blkfront driver shows ``/dev/sdf`` as ``/dev/xvdf`` ("if you specify a device
  name of /dev/sdh, your device could be renamed /dev/xvdh", "Device names on Linux instances")
  and there is no NVMe link. The Xen families, from the same guide's "Instances built on the
  Nitro System" (what it does not list): P3 (not p3dn), P2, G3, C4, D2, H1, I3, M4, R4, T2, X1,
  X1e and the previous generation.
"""

from __future__ import annotations

import re
from typing import Any

VALID = re.compile(r"/dev/(sd|xvd)[b-z]")
XEN = frozenset({"p3", "p2", "g3", "g3s", "c4", "d2", "h1", "i3", "m4", "r4", "t2", "x1", "x1e"})
PREVIOUS_GENERATION = frozenset({"c1", "c3", "g2", "i2", "m1", "m2", "m3", "r3", "t1", "cc2"})


def refusal(device: str, instance: Any) -> tuple[str, str] | None:
    """(code, message) EC2 answers AttachVolume with for ``device`` on moto's ``instance``, or
    None when the name is taken."""
    if not VALID.fullmatch(device):
        return (
            "InvalidParameterValue",
            f"Value ({device}) for parameter device is invalid. {device} is not a valid EBS "
            "device name.",
        )
    held = getattr(instance, "block_device_mapping", {}) or {}
    if device in held:
        return (
            "InvalidParameterValue",
            f"Invalid value '{device}' for unixDevice. Attachment point {device} is already in use",
        )
    return None


def is_xen(instance_type: str) -> bool:
    family = instance_type.partition(".")[0]
    return family in XEN or family in PREVIOUS_GENERATION


def guest_path(instance_type: str, device: str, volume_id: str) -> str:
    """Where the guest of ``instance_type`` finds the volume attached as ``device``."""
    if is_xen(instance_type):
        return "/dev/xvd" + device.removeprefix("/dev/sd").removeprefix("/dev/xvd")
    return "/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_" + volume_id.replace("-", "")
