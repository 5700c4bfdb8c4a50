"""GPU flavors of the ECS flavor list → catalog offers.

A flavor is a GPU flavor when ``os_extra_specs["ecs:performancetype"] == "gpu"``. Its GPU model and
count come from the first of these that is present, newest encoding first:

1. ``info:gpus`` — JSON list of ``{"name", "memory_mb", "count"}``;
2. ``pci_passthrough:alias`` — ``"nvidia-t4:1"`` (model after the vendor prefix, then count);
3. ``pci_passthrough:gpu_specs`` — ``"t4:direct_graphics:1"`` (model, mode, count);
4. the flavor family (name before the first dot), from Huawei/OTC's published specifications
   (opentelekomcloud-docs/elastic-cloud-server ``gpu-accelerated_ecss.rst``): the count is
   vCPUs ÷ vCPUs per GPU of that family.

cloud.ru Advanced publishes no machine-readable prices, so offers carry ``price=None``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from decimal import Decimal
from pathlib import Path
from typing import Any

from providers.base import Offer

SOURCE = "cloud.ru Advanced flavor list; no public price — set prices.sbercloud in settings"

# family → (normalised GPU, GB per GPU, vCPUs per GPU)
FAMILIES: dict[str, tuple[str, int, int]] = {
    "pi2": ("T4", 16, 8),
    "g6": ("T4", 16, 40),
    "p2s": ("V100", 32, 8),
    "p2v": ("V100", 16, 8),
    "p3": ("A100-80GB", 80, 8),
    "p3v": ("A100-80GB", 80, 12),
    "p5s": ("H100", 80, 20),
}
_MEMORY_GB = {"T4": 16, "V100": 32, "A100": 40, "A100-80GB": 80, "H100": 80, "L4": 24, "A10G": 24}


def normalise_gpu(raw: str, memory_gb: int | None = None) -> str:
    s = raw.lower()
    if "h100" in s:
        return "H100"
    if "a100" in s:
        return "A100-80GB" if "80g" in s or (memory_gb or 0) >= 80 else "A100"
    if "v100" in s:
        return "V100"
    if "a10g" in s:
        return "A10G"
    if re.search(r"(^|[^a-z0-9])t4($|[^a-z0-9])", s):
        return "T4"
    if re.search(r"(^|[^a-z0-9])l4($|[^a-z0-9])", s):
        return "L4"
    return re.sub(r"^nvidia[-_ ]", "", s).upper()


def gpu_of(name: str, vcpus: int, specs: dict[str, Any]) -> tuple[str, int, int] | None:
    """(normalised GPU, count, GB per GPU) of a flavor, or None when it cannot be told."""
    found = _from_info(specs.get("info:gpus")) or _from_pci(specs)
    if found:
        return found
    family = FAMILIES.get(name.split(".", 1)[0])
    if family and vcpus >= family[2]:
        gpu, mem, per_gpu = family
        return gpu, vcpus // per_gpu, mem
    return None


def _from_info(info: str | None) -> tuple[str, int, int] | None:
    """From the ``info:gpus`` extra spec (JSON: name, memory_mb and count of each GPU)."""
    if not info:
        return None
    try:
        gpus = json.loads(info)
        first = gpus[0]
        mem = int(first.get("memory_mb") or 0) // 1024
        gpu = normalise_gpu(first["name"], mem)
        return gpu, sum(int(g.get("count", 1)) for g in gpus), mem or _MEMORY_GB.get(gpu, 0)
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def _from_pci(specs: dict[str, Any]) -> tuple[str, int, int] | None:
    """From a PCI passthrough extra spec (``nvidia-<gpu>:<count>`` or ``<gpu>:…:<count>``)."""
    for key, pattern in (
        ("pci_passthrough:alias", r"(?:nvidia-)?([^:,]+):(\d+)"),
        ("pci_passthrough:gpu_specs", r"([^:,]+):[^:,]+:(\d+)"),
    ):
        if (value := specs.get(key)) and (m := re.match(pattern, value.strip())):
            gpu = normalise_gpu(m.group(1))
            return gpu, int(m.group(2)), _MEMORY_GB.get(gpu, 0)
    return None


def offers(flavors: Iterable[Any], region: str, zone: str) -> list[Offer]:
    """Offers for ``zone`` from the SDK's ``Flavor`` objects."""
    from huaweicloudsdkecs.v2.model import FlavorExtraSpec

    out = []
    for f in flavors:
        extra = f.os_extra_specs
        specs = {
            wire: getattr(extra, attr)
            for attr, wire in FlavorExtraSpec.attribute_map.items()
            if extra is not None and getattr(extra, attr) is not None
        }
        if specs.get("ecs:performancetype") != "gpu":
            continue
        vcpus = int(f.vcpus)
        found = gpu_of(f.id, vcpus, specs)
        if found is None:
            continue
        gpu, count, mem = found
        out.append(
            Offer(
                cloud="sbercloud",
                region=region,
                zone=zone,
                instance_type=f.id,
                gpu=gpu,
                gpu_count=count,
                gpu_memory_gb=mem,
                vcpus=vcpus,
                memory_gb=Decimal(int(f.ram)) / 1024,
                price=None,
                spot_price=None,
                currency="RUB",
                source=SOURCE,
            )
        )
    return out


# --- the shipped catalog, from reference price files ---------------------------------------


# cloud.ru Advanced publishes no GPU prices (RU_CLOUDS.md §2.3): flavors listed, prices empty.
SBER_FLAVORS = [  # flavor, gpu, count, gpu memory, vcpus, ram
    *[
        (f"p3.{s}xlarge.8", "A100-80GB", n, 80, 8 * n, 64 * n)
        for s, n in (("2", 1), ("4", 2), ("8", 4), ("16", 8))
    ],
    *[
        (f"p5s.{s}xlarge.12", "H100", n, 80, 20 * n, 240 * n)
        for s, n in (("5", 1), ("10", 2), ("20", 4), ("40", 8))
    ],
    *[
        (f"p2s.{s}xlarge.8", "V100", n, 32, 8 * n, 64 * n)
        for s, n in (("2", 1), ("4", 2), ("8", 4), ("16", 8))
    ],
    *[
        (f"p2v.{s}xlarge.8", "V100", n, 16, 8 * n, 64 * n)
        for s, n in (("2", 1), ("4", 2), ("8", 4), ("16", 8))
    ],
    *[(f"pi2.{s}xlarge.4", "T4", n, 16, 8 * n, 32 * n) for s, n in (("2", 1), ("4", 2), ("8", 4))],
]


def catalog_rows(_: Path) -> list[dict[str, Any]]:
    """The shipped catalog's rows (built by provisioner/data/catalog/build.py)."""
    src = (
        "Huawei/OTC ECS GPU flavor spec (opentelekomcloud-docs elastic-cloud-server "
        "gpu-accelerated_ecss.rst); "
        "availability on cloud.ru Advanced not confirmed; "
        "no public price — set prices.sbercloud in settings"
    )
    rows = [
        dict(
            cloud="sbercloud",
            region="ru-moscow-1",
            zone=f"ru-moscow-1{z}",
            instance_type=f,
            gpu=g,
            gpu_count=n,
            gpu_memory_gb=m,
            vcpus=c,
            memory_gb=r,
            price="",
            spot_price="",
            currency="RUB",
            accelerator="",
            source=src,
        )
        for f, g, n, m, c, r in SBER_FLAVORS
        for z in "abc"
    ]
    return rows
