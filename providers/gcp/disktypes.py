"""Which disk types a Compute Engine machine series takes, for its boot disk and its volumes.

Compute Engine decides per machine series (compute_v1.AttachedDiskInitializeParams.disk_type:
"The disk type you specify must be compatible with the instance's machine series"):

- A3 Ultra (``a3-ultragpu``, H200), A4 (``a4-highgpu``, B200) and A4X take Hyperdisk only, boot
  and data disks alike, no Persistent Disk (Compute Engine, "Accelerator-optimized machine
  family", the supported disk types of A4X, A4 and A3 Ultra: Hyperdisk Balanced, Hyperdisk
  Extreme, Hyperdisk ML; "About Google Cloud Hyperdisk", Machine series support; Vertex AI
  DiskSpec.bootDiskType: "for A3U machines, the default value is hyperdisk-balanced"; NVIDIA/aicr
  #2338: "pd-balanced disk type cannot be used by a4x-highgpu-4g machine type").
- A3 High and A3 Mega (H100) take both: pd-balanced and Hyperdisk Balanced (the same pages;
  skypilot-org/skypilot#5351 launches A3 with either).
- N1 (with GPUs), A2 and G2 take Persistent Disk; the Hyperdisk machine-series table lists no
  Hyperdisk Balanced for N1, N1+GPU and A2, and we found none documented for G2 either, so a
  Hyperdisk Balanced volume is not offered to them ("If a machine series doesn't support
  Hyperdisk, use Persistent Disk", "About Google Cloud Hyperdisk").

A volume is made of the type its first machine's series takes (:func:`volume_type`); a
volume that exists already is attachable only to series that take its type (:func:`refusal`),
otherwise attachDisk ends UNSUPPORTED_OPERATION "[pd-balanced, c4-standard-16] features are not
compatible for creating instance." (astronomer/astronomer#2463) after the machine is up.
"""

from __future__ import annotations

PD_BALANCED = "pd-balanced"
HYPERDISK_BALANCED = "hyperdisk-balanced"
HYPERDISK_ONLY = ("a3-ultragpu", "a4-highgpu", "a4x-highgpu")
BOTH = ("a3-highgpu", "a3-megagpu", "a3-edgegpu")
DOC = "Compute Engine docs, 'Accelerator-optimized machine family' / 'About Google Cloud Hyperdisk'"


def series(machine_type: str) -> str:
    """``a3-ultragpu-8g`` → ``a3-ultragpu``; ``n1-standard-8`` → ``n1-standard``."""
    return "-".join(machine_type.split("-")[:2])


def takes(machine_type: str) -> tuple[str, ...]:
    """The disk types we use that ``machine_type``'s series accepts, preferred first."""
    s = series(machine_type)
    if s in HYPERDISK_ONLY:
        return (HYPERDISK_BALANCED,)
    if s in BOTH:
        return (PD_BALANCED, HYPERDISK_BALANCED)
    return (PD_BALANCED,)


def volume_type(machine_type: str) -> str:
    """The type a new volume for ``machine_type`` is made of (a boot disk too)."""
    return takes(machine_type)[0]


def refusal(machine_type: str, disk_type: str) -> str | None:
    """Why a ``disk_type`` volume cannot attach to ``machine_type``, or None."""
    if disk_type in takes(machine_type):
        return None
    only = " or ".join(takes(machine_type))
    return f"{series(machine_type)} takes {only} disks, not {disk_type} ({DOC})"
