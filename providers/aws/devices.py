"""Where an instance's guest sees an attached EBS volume: NVMe on Nitro, ``/dev/xvd?`` on Xen.

Which one a type is, EC2 says in DescribeInstanceTypes: ``EbsInfo.NvmeSupport``
("required" | "supported" | "unsupported") and ``Hypervisor`` ("nitro" | "xen"; absent for
bare metal, which is NVMe too). This table is that answer for the families we launch:

- Nitro (and bare metal): "EBS volumes are exposed as NVMe block devices on instances built on
  the Nitro System" (EC2 User Guide, "Amazon EBS and NVMe"). The guest's name (/dev/nvme1n1…)
  follows discovery order, so we wait for the udev link named from the volume id instead
  ("NVMe EBS volumes have the EBS volume ID set as the serial number"): see
  :data:`providers.aws.volumes.BY_ID`. DescribeInstanceTypes (moto's snapshot of it,
  ``moto/ec2/resources/instance_types.json.gz``) answers ``NvmeSupport: required`` for every
  g4dn, g5, g6, gr6, p4d, p4de, p5 and p5en type in our catalog; ``tests/test_volume_devices``
  holds the catalog to it.
- Xen: the device name given to AttachVolume shows in the guest with the ``xvd`` prefix:
  "Depending on the block device driver of the kernel, the device could be attached with a
  different name than you specified. For example, if you specify a device name of /dev/sdh, your
  device could be renamed /dev/xvdh" (EC2 User Guide, "Device names on Linux instances"), and
  no NVMe link exists. P3 (not p3dn) is a Xen family ("Instances built on the Nitro System"
  lists p3dn.24xlarge, not p3.2xlarge/8xlarge/16xlarge; DescribeInstanceTypes answers
  ``Hypervisor: xen``, ``NvmeSupport: unsupported`` for them). The other Xen families (C4, D2,
  G3, H1, I3, M4, P2, R4, T2, X1, X1e and the previous generation) are listed for a catalog that
  grows.
"""

from __future__ import annotations

# The device names AttachVolume is given: "Recommended for EBS volumes ... /dev/sd[f-p]"
# (EC2 User Guide, "Device names on Linux instances"): the index-th volume gets /dev/sdf, …
DEVICE_LETTERS = "fghijklmnop"
# udev's link for an NVMe EBS volume: disk/by-id/nvme-$model_$serial ("Amazon Elastic Block
# Store", the volume id without its dash)
BY_ID = "/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_"
XEN_FAMILIES = frozenset(
    {"p3", "p2", "g3", "g3s", "c4", "d2", "h1", "i3", "m4", "r4", "t2", "x1", "x1e"}
    | {"c1", "c3", "cc2", "cr1", "g2", "hi1", "hs1", "i2", "m1", "m2", "m3", "r3", "t1"}
)


def family(instance_type: str) -> str:
    """``p3.2xlarge`` → ``p3``; ``p3dn.24xlarge`` → ``p3dn`` (a Nitro type)."""
    return instance_type.partition(".")[0].lower()


def is_xen(instance_type: str) -> bool:
    return family(instance_type) in XEN_FAMILIES


def attach_name(index: int) -> str:
    """The device name AttachVolume is given for the ``index``-th volume (``/dev/sdf``…)."""
    return f"/dev/sd{DEVICE_LETTERS[index]}"


def guest_path(instance_type: str, volume_id: str, index: int) -> str:
    """The path the guest of ``instance_type`` sees the ``index``-th volume at: the NVMe by-id
    link on Nitro; ``/dev/xvdf``, ``/dev/xvdg``… on Xen."""
    if is_xen(instance_type):
        return f"/dev/xvd{DEVICE_LETTERS[index]}"
    return BY_ID + volume_id.replace("-", "")
