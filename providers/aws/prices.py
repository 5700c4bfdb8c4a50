"""EC2 GPU offers from AWS's public price sources.

On-demand: the Price List API (``pricing.get_products``, one TERM_MATCH query per region and
instance type: Linux, shared tenancy, no pre-installed software, used capacity). Spot: the latest
``describe_spot_price_history`` entry per AZ. Which AZs sell a type: instance type offerings.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from providers import reference
from providers.base import Offer
from providers.gpus import GPUS
from providers.reference import dec, num

# instance type → (normalised GPU, GPUs per instance)
GPU_TYPES: dict[str, tuple[str, int]] = {
    "p4d.24xlarge": ("A100", 8),
    "p4de.24xlarge": ("A100-80GB", 8),
    "p5.48xlarge": ("H100", 8),
    "p5.4xlarge": ("H100", 1),
    "g4dn.xlarge": ("T4", 1),
    "g4dn.2xlarge": ("T4", 1),
    "g4dn.4xlarge": ("T4", 1),
    "g4dn.8xlarge": ("T4", 1),
    "g4dn.16xlarge": ("T4", 1),
    "g4dn.12xlarge": ("T4", 4),
    "g4dn.metal": ("T4", 8),
    "g5.xlarge": ("A10G", 1),
    "g5.2xlarge": ("A10G", 1),
    "g5.4xlarge": ("A10G", 1),
    "g5.8xlarge": ("A10G", 1),
    "g5.16xlarge": ("A10G", 1),
    "g5.12xlarge": ("A10G", 4),
    "g5.24xlarge": ("A10G", 4),
    "g5.48xlarge": ("A10G", 8),
    "g6.xlarge": ("L4", 1),
    "g6.2xlarge": ("L4", 1),
    "g6.4xlarge": ("L4", 1),
    "g6.8xlarge": ("L4", 1),
    "g6.16xlarge": ("L4", 1),
    "g6.12xlarge": ("L4", 4),
    "g6.24xlarge": ("L4", 4),
    "g6.48xlarge": ("L4", 8),
    "p3.2xlarge": ("V100", 1),
    "p3.8xlarge": ("V100", 4),
    "p3.16xlarge": ("V100", 8),
}
PRICE_FILTERS: dict[str, str] = {
    "operatingSystem": "Linux",
    "tenancy": "Shared",
    "preInstalledSw": "NA",
    "capacitystatus": "Used",
}
SPOT_PRODUCT = "Linux/UNIX"

Call = Callable[[Callable[[], Any], str], Any]  # (fn, what) → fn() with retry + error mapping


def fetch_offers(
    regions: Iterable[str],
    ec2_for: Callable[[str], Any],
    zone_ids_for: Callable[[str], dict[str, str]],
    pricing: Any,
    call: Call,
) -> list[Offer]:
    """One offer per (instance type, AZ id) where the type is sold on demand."""
    source = f"AWS Price List API + spot price history, fetched {datetime.now(UTC):%Y-%m-%d}"
    offers: list[Offer] = []
    for region in regions:
        ec2 = ec2_for(region)
        zones = _zones_by_type(ec2, call)
        spot = _latest_spot(ec2, sorted(zones), zone_ids_for(region), call)
        for itype in sorted(zones):
            product = _on_demand(pricing, region, itype, call)
            if product is None:
                continue  # not sold on demand here: no specs, no price → no offer
            attrs, price = product
            gpu, count = GPU_TYPES[itype]
            offers.extend(
                Offer(
                    cloud="aws",
                    region=region,
                    zone=zone,
                    instance_type=itype,
                    gpu=gpu,
                    gpu_count=count,
                    gpu_memory_gb=GPUS[gpu].memory_gb,
                    vcpus=int(attrs["vcpu"]),
                    memory_gb=_quantity(attrs["memory"]),
                    price=price,
                    spot_price=spot.get((itype, zone)),
                    currency="USD",
                    source=source,
                )
                for zone in sorted(zones[itype])
            )
    return offers


def _zones_by_type(ec2: Any, call: Call) -> dict[str, set[str]]:
    def fetch() -> dict[str, set[str]]:
        found: dict[str, set[str]] = {}
        pages = ec2.get_paginator("describe_instance_type_offerings").paginate(
            LocationType="availability-zone-id",
            Filters=[{"Name": "instance-type", "Values": sorted(GPU_TYPES)}],
        )
        for page in pages:
            for row in page["InstanceTypeOfferings"]:
                if row["InstanceType"] in GPU_TYPES:
                    found.setdefault(row["InstanceType"], set()).add(row["Location"])
        return found

    return call(fetch, "describe instance type offerings")


def _latest_spot(
    ec2: Any, types: list[str], zone_ids: dict[str, str], call: Call
) -> dict[tuple[str, str], Decimal]:
    """{(instance type, AZ id): the latest Linux spot price}."""
    if not types:
        return {}

    def fetch() -> dict[tuple[str, str], Decimal]:
        latest: dict[tuple[str, str], tuple[datetime, Decimal]] = {}
        pages = ec2.get_paginator("describe_spot_price_history").paginate(
            InstanceTypes=types, ProductDescriptions=[SPOT_PRODUCT], StartTime=datetime.now(UTC)
        )
        for page in pages:
            for row in page["SpotPriceHistory"]:
                if not row.get("ProductDescription", "").startswith(SPOT_PRODUCT):
                    continue
                zone = row.get("AvailabilityZoneId") or zone_ids.get(row["AvailabilityZone"])
                key = (row["InstanceType"], zone or row["AvailabilityZone"])
                seen = latest.get(key)
                if seen is None or row["Timestamp"] > seen[0]:
                    latest[key] = (row["Timestamp"], _plain(Decimal(row["SpotPrice"])))
        return {key: price for key, (_, price) in latest.items()}

    return call(fetch, "describe spot price history")


def _on_demand(
    pricing: Any, region: str, itype: str, call: Call
) -> tuple[dict[str, str], Decimal] | None:
    """(product attributes, USD per hour) of the Linux on-demand product, or None."""
    filters = [
        {"Type": "TERM_MATCH", "Field": field, "Value": value}
        for field, value in {"instanceType": itype, "regionCode": region, **PRICE_FILTERS}.items()
    ]

    def fetch() -> list[str]:
        pages = pricing.get_paginator("get_products").paginate(
            ServiceCode="AmazonEC2", Filters=filters, FormatVersion="aws_v1"
        )
        return [item for page in pages for item in page["PriceList"]]

    for raw in call(fetch, f"price list for {itype} in {region}"):
        item = json.loads(raw) if isinstance(raw, str) else raw
        attrs = item["product"]["attributes"]
        if attrs.get("marketoption", "OnDemand") != "OnDemand":
            continue  # capacity blocks and the like
        if attrs.get("licenseModel", "No License required") != "No License required":
            continue
        price = _hourly_usd(item.get("terms", {}).get("OnDemand", {}))
        if price is not None:
            return attrs, price
    return None


def _hourly_usd(terms: dict[str, Any]) -> Decimal | None:
    for term in terms.values():
        for dim in term.get("priceDimensions", {}).values():
            if dim.get("unit") != "Hrs":
                continue
            try:
                price = Decimal(dim["pricePerUnit"]["USD"])
            except (KeyError, InvalidOperation):
                continue
            if price > 0:
                return _plain(price)
    return None


def _quantity(text: str) -> Decimal:
    """'1,152 GiB' → Decimal('1152')."""
    return _plain(Decimal(text.split()[0].replace(",", "")))


def _plain(value: Decimal) -> Decimal:
    """Drop trailing zeros without going to exponent form ('32.7726000000' → 32.7726)."""
    return value.quantize(Decimal(1)) if value == value.to_integral_value() else value.normalize()


# --- the shipped catalog, from reference price files ---------------------------------------


def catalog_rows(ref: Path) -> list[dict[str, Any]]:
    """The shipped catalog's rows (built by provisioner/data/catalog/build.py)."""
    src = reference.SKYPILOT.format(path="aws/vms.csv", commit="00148f2a")
    rows: list[dict[str, Any]] = []
    for r in csv.DictReader((ref / "aws_gpu_vms.csv").open()):
        count = Decimal(r["AcceleratorCount"])
        if count < 1 or (r["AcceleratorName"] == "H200" and not r["Price"]):
            continue  # fractional L4 slices (g6f/gr6f) are not whole GPUs
        gpu = r["AcceleratorName"]
        mem_gb = reference.GPU_MEMORY[gpu]  # nominal, as users ask for it (A10G = 24 GB)
        rows.append(
            dict(
                cloud="aws",
                region=r["Region"],
                zone=r["AvailabilityZone"],
                instance_type=r["InstanceType"],
                gpu=gpu,
                gpu_count=int(count),
                gpu_memory_gb=mem_gb,
                vcpus=num(r["vCPUs"]),
                memory_gb=num(r["MemoryGiB"]),
                price=dec(r["Price"]),
                spot_price=dec(r["SpotPrice"]),
                currency="USD",
                accelerator="",
                source=src + "; zone is the AZ id",
                as_of=reference.COPIED,
            )
        )
    return rows
