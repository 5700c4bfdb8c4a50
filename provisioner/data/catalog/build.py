"""Rebuild the shipped catalog CSVs from the reference price files (run by maintainers, not at
run time): ``python provisioner/data/catalog/build.py ../shared/reference/pricing``.

Every row keeps where its price came from. Unknown prices stay empty — never invented.
"""

from __future__ import annotations

import csv
import sys
from decimal import Decimal
from pathlib import Path

from providers.gcp.prices import SHAPES as GCP_SHAPES
from providers.gpus import GPUS, family

HERE = Path(__file__).parent
COLUMNS = [
    "cloud",
    "region",
    "zone",
    "instance_type",
    "gpu",
    "gpu_count",
    "gpu_memory_gb",
    "vcpus",
    "memory_gb",
    "price",
    "spot_price",
    "currency",
    "accelerator",
    "source",
]
GPU_MEMORY = {n: g.memory_gb for n, g in GPUS.items()} | {"H100-MEGA": 80}
SKYPILOT = "SkyPilot catalog v8 ({path} @ {commit}), copied 2026-11-30"


def _dec(v: str) -> str:
    return str(Decimal(v).normalize()) if v not in ("", None) else ""


def _num(v: str) -> str:
    d = Decimal(v)
    return str(int(d)) if d == d.to_integral_value() else str(d.normalize())


def write(cloud: str, rows: list[dict]) -> None:
    """Check the rows (:func:`check`: a price that fails is emptied, never guessed), then write
    the cloud's CSV and append what was emptied, and why, to ``checks.csv``."""
    rows.sort(
        key=lambda r: (r["gpu"], int(r["gpu_count"]), r["instance_type"], r["region"], r["zone"])
    )
    flags = check(rows)
    with (HERE / f"{cloud}.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    with CHECKS.open("a", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(flags)
    print(f"{cloud}: {len(rows)} offers, {len(flags)} prices emptied (see {CHECKS.name})")


CHECKS = HERE / "checks.csv"
CHECK_COLUMNS = ["cloud", "region", "zone", "instance_type", "field", "value", "reason"]
# GCP sells a3-highgpu-1g/2g/4g as Spot or Flex-start only: no on-demand price exists.
SPOT_ONLY = {s.instance_type for s in GCP_SHAPES if s.spot_only}
# An on-demand price this far from its type's median over the regions that sell it is not
# trusted (the source has committed-use prices in some regions: GCP H100 at ~40 % of list).
OUTLIER_LOW, OUTLIER_HIGH = Decimal("0.65"), Decimal("1.8")


def check(rows: list[dict]) -> list[list[str]]:
    """Empty the prices a planner must not trust, in place; return one line per emptied price.

    - a spot-only type has no on-demand price;
    - a bigger-memory variant (A100-80GB) below its family's base (A100) per card, same region;
    - an on-demand price far from the median of its type's regions (at least 3 regions);
    - a spot price above the on-demand one.
    """
    flags: list[list[str]] = []

    def drop(r: dict, field: str, reason: str) -> None:
        flags.append(
            [r["cloud"], r["region"], r["zone"], r["instance_type"], field, r[field], reason]
        )
        r[field] = ""

    for r in rows:
        if r["cloud"] == "gcp" and r["instance_type"] in SPOT_ONLY and r["price"]:
            drop(r, "price", "GCP sells this type as Spot/Flex-start only")
    # A variant with more memory is not cheaper per card than its family's base in the same
    # region (the source has GCP A100-80GB below A100-40GB in us-central1: a discounted price).
    base_card: dict[tuple[str, str, str], Decimal] = {}
    for r in rows:
        if r["price"] and family(r["gpu"]) == r["gpu"]:
            key = (r["cloud"], r["region"], r["gpu"])
            card = Decimal(r["price"]) / int(r["gpu_count"])
            base_card[key] = min(card, base_card.get(key, card))
    for r in rows:
        fam = family(r["gpu"])
        base = base_card.get((r["cloud"], r["region"], fam))
        if r["price"] and fam != r["gpu"] and base is not None:
            card = Decimal(r["price"]) / int(r["gpu_count"])
            if card < base:
                drop(r, "price", f"{card:.4f} a card, below the {fam}'s {base:.4f} here")
    # One price per region of each (type, GPU, count, currency): an n1 host carries T4s or
    # V100s; the sandbox prices one region in RUB.
    by_shape: dict[tuple[str, ...], dict[str, Decimal]] = {}

    def shape(r: dict) -> tuple[str, ...]:
        return r["instance_type"], r["gpu"], str(r["gpu_count"]), r["currency"]

    for r in rows:
        if r["price"]:
            by_shape.setdefault(shape(r), {})[r["region"]] = Decimal(r["price"])
    for r in rows:
        regions = by_shape.get(shape(r), {})
        if not r["price"] or len(regions) < 3:
            continue
        values = sorted(regions.values())
        median = values[len(values) // 2]
        ratio = Decimal(r["price"]) / median
        if not OUTLIER_LOW <= ratio <= OUTLIER_HIGH:
            drop(
                r,
                "price",
                f"{ratio:.2f}x the median {median} of its {len(values)} regions",
            )
    for r in rows:
        if r["spot_price"] and r["price"] and Decimal(r["spot_price"]) > Decimal(r["price"]):
            drop(r, "spot_price", f"above the on-demand price {r['price']}")
    return flags


def aws(ref: Path) -> None:
    src = SKYPILOT.format(path="aws/vms.csv", commit="00148f2a")
    rows = []
    for r in csv.DictReader((ref / "aws_gpu_vms.csv").open()):
        count = Decimal(r["AcceleratorCount"])
        if count < 1 or (r["AcceleratorName"] == "H200" and not r["Price"]):
            continue  # fractional L4 slices (g6f/gr6f) are not whole GPUs
        mem_gb = GPU_MEMORY[r["AcceleratorName"]]  # nominal, as users ask for it (A10G = 24 GB)
        gpu = r["AcceleratorName"]
        rows.append(
            dict(
                cloud="aws",
                region=r["Region"],
                zone=r["AvailabilityZone"],
                instance_type=r["InstanceType"],
                gpu=gpu,
                gpu_count=int(count),
                gpu_memory_gb=mem_gb,
                vcpus=_num(r["vCPUs"]),
                memory_gb=_num(r["MemoryGiB"]),
                price=_dec(r["Price"]),
                spot_price=_dec(r["SpotPrice"]),
                currency="USD",
                accelerator="",
                source=src + "; zone is the AZ id",
            )
        )
    write("aws", rows)


GCP_HOSTS = {  # (gpu, count) -> host types (SkyPilot's _ACC_INSTANCE_TYPE_DICTS)
    **{("A100", n): [f"a2-highgpu-{n}g"] for n in (1, 2, 4, 8)},
    ("A100", 16): ["a2-megagpu-16g"],
    **{("A100-80GB", n): [f"a2-ultragpu-{n}g"] for n in (1, 2, 4, 8)},
    **{("H100", n): [f"a3-highgpu-{n}g"] for n in (1, 2, 4, 8)},
    ("H100-MEGA", 8): ["a3-megagpu-8g"],
    ("H200", 8): ["a3-ultragpu-8g"],
    ("L4", 1): [
        "g2-standard-4",
        "g2-standard-8",
        "g2-standard-12",
        "g2-standard-16",
        "g2-standard-32",
    ],
    ("L4", 2): ["g2-standard-24"],
    ("L4", 4): ["g2-standard-48"],
    ("L4", 8): ["g2-standard-96"],
}
N1_HOSTS = {
    1: ["n1-standard-4", "n1-standard-8"],
    2: ["n1-standard-8", "n1-standard-16"],
    4: ["n1-standard-16"],
    8: ["n1-standard-16"],
}
GCP_ACCEL = {"T4": "nvidia-tesla-t4", "V100": "nvidia-tesla-v100"}


def gcp(ref: Path) -> None:
    src = SKYPILOT.format(path="gcp/vms.csv", commit="006059e0") + "; price = host + GPUs"
    hosts = {
        (r["InstanceType"], r["AvailabilityZone"]): r
        for name in ("gcp_gpu_hosts.csv", "gcp_n1_hosts.csv")
        for r in csv.DictReader((ref / name).open())
    }
    rows = []

    def add(sum_of: list[str], g: dict, h: dict, gpu: str, count: int, accel: str) -> None:
        price = spot = None
        if g["Price"] and h["Price"]:
            price = Decimal(g["Price"]) + Decimal(h["Price"])
        if g["SpotPrice"] and h["SpotPrice"]:
            spot = Decimal(g["SpotPrice"]) + Decimal(h["SpotPrice"])
        family = {"A100-80GB": "A100-80GB", "H100-MEGA": "H100"}.get(gpu, gpu)
        rows.append(
            dict(
                cloud="gcp",
                region=g["Region"],
                zone=g["AvailabilityZone"],
                instance_type=h["InstanceType"],
                gpu=family,
                gpu_count=count,
                gpu_memory_gb=GPU_MEMORY[gpu],
                vcpus=_num(h["vCPUs"]),
                memory_gb=_num(h["MemoryGiB"]),
                price=_dec(str(price or "")),
                spot_price=_dec(str(spot or "")),
                currency="USD",
                accelerator=accel,
                source=src,
            )
        )

    for g in csv.DictReader((ref / "gcp_gpu_vms.csv").open()):
        gpu, count = g["AcceleratorName"], int(Decimal(g["AcceleratorCount"]))
        if gpu in GCP_ACCEL:
            types, accel = N1_HOSTS.get(count, []), GCP_ACCEL[gpu]
        else:
            types, accel = GCP_HOSTS.get((gpu, count), []), ""
        for t in types:
            h = hosts.get((t, g["AvailabilityZone"]))
            if h:
                add([], g, h, gpu, count, accel)
    write("gcp", rows)


def azure(ref: Path) -> None:
    src = (
        "SkyPilot catalog v8 fork coopslarhette/skypilot-catalog (azure/vms.csv @ 20291d7e), "
        "copied 2026-11-30"
    )
    rows = []
    for r in csv.DictReader((ref / "azure_gpu_vms.csv").open()):
        gpu, count, note = r["AcceleratorName"], int(Decimal(r["AcceleratorCount"])), ""
        if r["InstanceType"] == "Standard_ND96isr_H100_v5":
            count, note = 8, "; GPU count corrected 12->8 (the VM has 8 H100)"
        mem = GPU_MEMORY[gpu]
        if r["InstanceType"].startswith("Standard_NC") and gpu == "H100":
            mem, note = 94, note + "; H100 NVL (94 GB)"
        spot = r["SpotPrice"]
        if spot and spot == r["Price"]:
            spot, note = "", note + "; no real spot price published (source repeats on-demand)"
        rows.append(
            dict(
                cloud="azure",
                region=r["Region"],
                zone="",
                instance_type=r["InstanceType"],
                gpu=gpu,
                gpu_count=count,
                gpu_memory_gb=mem,
                vcpus=_num(r["vCPUs"]),
                memory_gb=_num(r["MemoryGiB"]),
                price=_dec(r["Price"]),
                spot_price=_dec(spot),
                currency="USD",
                accelerator="",
                source=src + note,
            )
        )
    write("azure", rows)


# Yandex Cloud (RU_CLOUDS.md §1): per-GPU + per-vCPU + per-GB rates, RUB/h incl. VAT.
# (regular gpu, vcpu, ram), (preemptible gpu, vcpu, ram), gpu, memory, zones, shapes, source
YC_2022 = "Yandex Cloud docs presets.yaml sku|RUB|compute.vm.* (rates from 2022-04-13, VAT 20%)"
YC_2026 = "Yandex Cloud docs ru/_pricing/compute/rub-from-23-01-2026.md (VAT 22%)"
YANDEX = {
    "gpu-standard-v1": (
        ("249.52", "1.12", "0.39"),
        ("62.40", "0.34", "0.12"),
        "V100",
        32,
        "ab",
        [(1, 8, 96), (2, 16, 192), (4, 32, 384)],
        YC_2022,
    ),
    "gpu-standard-v2": (
        ("249.52", "1.19", "0.31"),
        ("62.40", "0.32", "0.07"),
        "V100",
        32,
        "ab",
        [(1, 8, 48), (2, 16, 96), (4, 32, 192), (8, 64, 384)],
        YC_2022,
    ),
    "gpu-standard-v3": (
        ("371.70", "0.90", "0.28"),
        ("148.68", "0.36", "0.11"),
        "A100-80GB",
        80,
        "ab",
        [(1, 28, 119), (2, 56, 238), (4, 112, 476), (8, 224, 952)],
        YC_2022,
    ),
    "standard-v3-t4": (
        ("64.00", "1.05", "0.28"),
        ("16.00", "0.29", "0.07"),
        "T4",
        16,
        "abd",
        [(1, 4, 16), (1, 8, 32), (1, 16, 64), (1, 32, 128)],
        YC_2022,
    ),
    "standard-v3-t4i": (
        ("144.00", "1.05", "0.28"),
        ("144.00", "1.05", "0.28"),
        "T4I",
        24,
        "d",
        [(1, 4, 16), (1, 8, 32), (1, 16, 64), (1, 32, 128)],
        "Yandex Cloud docs ru/_pricing/compute/rub-instance-resources.md",
    ),
    # Yandex does not name the chip of Gen2 / V4: listed under its own names, never as A100/H100.
    "gpu-standard-v3i": (
        ("745.21", "0.90", "0.28"),
        ("745.21", "0.90", "0.28"),
        "YC-GEN2",
        80,
        "d",
        [(1, 18, 144), (2, 36, 288), (4, 72, 576), (8, 180, 1440)],
        YC_2026,
    ),
    "gpu-standard-v4": (
        ("1016.90", "0.90", "0.28"),
        ("1016.90", "0.90", "0.28"),
        "YC-V4",
        141,
        "de",
        [(1, 22, 220), (2, 44, 440), (4, 88, 880), (8, 180, 1800)],
        YC_2026,
    ),
}


def yandex(_: Path) -> None:
    rows = []
    for platform, (reg, pre, gpu, mem, zones, shapes, src) in YANDEX.items():
        for gpus, cpus, ram in shapes:

            def hourly(r: tuple[str, str, str], gpus=gpus, cpus=cpus, ram=ram) -> str:
                return str(gpus * Decimal(r[0]) + cpus * Decimal(r[1]) + ram * Decimal(r[2]))

            for z in zones:
                rows.append(
                    dict(
                        cloud="yandex",
                        region="ru-central1",
                        zone=f"ru-central1-{z}",
                        instance_type=f"{platform}/{gpus}g-{cpus}c-{ram}gb",
                        gpu=gpu,
                        gpu_count=gpus,
                        gpu_memory_gb=mem,
                        vcpus=cpus,
                        memory_gb=ram,
                        price=hourly(reg),
                        spot_price=hourly(pre),
                        currency="RUB",
                        accelerator="",
                        source=src + "; GPUs×GPU + vCPU×vCPU + GB×RAM rate",
                    )
                )
    write("yandex", rows)


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


def sbercloud(_: Path) -> None:
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
    write("sbercloud", rows)


if __name__ == "__main__":
    ref = Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/reference/pricing")
    with CHECKS.open("w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerow(CHECK_COLUMNS)
    for build in (aws, gcp, azure, yandex, sbercloud):
        build(ref)
