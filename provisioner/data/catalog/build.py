"""Rebuild the shipped catalog CSVs from the reference price files (run by maintainers, not at
run time): ``python provisioner/data/catalog/build.py ../shared/reference/pricing``.

Every row keeps where its price came from. Unknown prices stay empty — never invented.
"""

from __future__ import annotations

import csv
import sys
from decimal import Decimal
from pathlib import Path

import providers
from providers.gcp.prices import SHAPES as GCP_SHAPES
from providers.gpus import family

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


if __name__ == "__main__":
    ref = Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/reference/pricing")
    with CHECKS.open("w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerow(CHECK_COLUMNS)
    for name in providers.REGISTRY:  # each cloud's spec names its builder (none: hand-kept)
        build = providers.catalog_rows(name)
        if build is not None:
            write(name, build(ref))
