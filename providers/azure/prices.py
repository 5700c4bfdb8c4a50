"""Azure GPU sizes and their public prices (the Retail Prices API, no authentication)."""

from __future__ import annotations

import csv
import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from providers import reference
from providers.base import InvalidRequest, Offer, Throttled, paginate
from providers.reference import dec, num
from providers.retry import call_with_retry

if TYPE_CHECKING:
    from providers.azure import AzureOptions


@dataclass(frozen=True)
class Size:
    gpu: str
    gpu_count: int
    gpu_memory_gb: int
    vcpus: int
    memory_gb: int


# Microsoft's size pages (learn.microsoft.com/azure/virtual-machines/sizes/gpu-accelerated/*).
# NC H100 v5 carries H100 NVL (94 GB); ND H100 v5 the 80 GB SXM part. NCv3 (V100) is retired.
SIZES: dict[str, Size] = {
    "Standard_NC24ads_A100_v4": Size("A100-80GB", 1, 80, 24, 220),
    "Standard_NC48ads_A100_v4": Size("A100-80GB", 2, 80, 48, 440),
    "Standard_NC96ads_A100_v4": Size("A100-80GB", 4, 80, 96, 880),
    "Standard_ND96asr_v4": Size("A100", 8, 40, 96, 900),
    "Standard_ND96amsr_A100_v4": Size("A100-80GB", 8, 80, 96, 1900),
    "Standard_NC40ads_H100_v5": Size("H100", 1, 94, 40, 320),
    "Standard_NC80adis_H100_v5": Size("H100", 2, 94, 80, 640),
    "Standard_ND96isr_H100_v5": Size("H100", 8, 80, 96, 1900),
    "Standard_NC4as_T4_v3": Size("T4", 1, 16, 4, 28),
    "Standard_NC8as_T4_v3": Size("T4", 1, 16, 8, 56),
    "Standard_NC16as_T4_v3": Size("T4", 1, 16, 16, 110),
    "Standard_NC64as_T4_v3": Size("T4", 4, 16, 64, 440),
}


def fetch_offers(regions: Iterable[str], options: AzureOptions) -> list[Offer]:
    """One Offer per (region, size) that has a Linux pay-as-you-go or Spot price.

    Queries are per region and size, the API's documented filter shape; Windows and the retired
    "Low Priority" rows are skipped, a skuName ending in " Spot" is the spot price.
    """
    endpoint = options.pricing_endpoint.rstrip("/")
    timeout = options.timeout_seconds
    source = f"Azure Retail Prices API ({endpoint}), {datetime.now(UTC):%Y-%m-%d}"
    offers = []
    for region in regions:
        for sku, size in SIZES.items():
            query = (
                f"serviceName eq 'Virtual Machines' and armRegionName eq '{region}' "
                f"and armSkuName eq '{sku}' and priceType eq 'Consumption'"
            )
            url = f"{endpoint}/api/retail/prices?$filter={quote(query)}"
            price = spot = None
            for item in _items(url, timeout, options):
                kind = _kind(item)
                if kind == "regular":
                    price = Decimal(str(item["retailPrice"]))
                elif kind == "spot":
                    spot = Decimal(str(item["retailPrice"]))
            if price is None and spot is None:
                continue
            offers.append(
                Offer(
                    cloud="azure",
                    region=region,
                    zone="",
                    instance_type=sku,
                    gpu=size.gpu,
                    gpu_count=size.gpu_count,
                    gpu_memory_gb=size.gpu_memory_gb,
                    vcpus=size.vcpus,
                    memory_gb=Decimal(size.memory_gb),
                    price=price,
                    spot_price=spot,
                    currency="USD",
                    source=source,
                )
            )
    return offers


def _kind(item: Mapping[str, Any]) -> str | None:
    """ "regular", "spot", or None for rows that are not a Linux hourly VM price."""
    if (
        item.get("unitOfMeasure") != "1 Hour"
        or "Windows" in item.get("productName", "")
        or item.get("isPrimaryMeterRegion") is False
    ):
        return None
    sku_name = item.get("skuName", "")
    if sku_name.endswith(" Low Priority"):
        return None
    return "spot" if sku_name.endswith(" Spot") else "regular"


def _items(url: str, timeout: float, options: AzureOptions) -> Iterator[dict]:
    def page(next_url: str | None) -> tuple[list[dict], str | None]:
        got = call_with_retry(partial(_get_json, next_url or url, timeout), options)
        return got.get("Items", []), got.get("NextPageLink")

    return paginate(page, url)


def _get_json(url: str, timeout: float) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as err:
        kind = Throttled if err.code == 429 or err.code >= 500 else InvalidRequest
        raise kind(f"azure prices: HTTP {err.code} from {url}", code=str(err.code)) from err
    except urllib.error.URLError as err:
        raise Throttled(f"azure prices: {err.reason}", code="URLError") from err


# --- the shipped catalog, from reference price files ---------------------------------------


def catalog_rows(ref: Path) -> list[dict[str, Any]]:
    """The shipped catalog's rows (built by provisioner/data/catalog/build.py)."""
    src = (
        "SkyPilot catalog v8 fork coopslarhette/skypilot-catalog (azure/vms.csv @ 20291d7e), "
        "copied " + reference.COPIED
    )
    rows: list[dict[str, Any]] = []
    for r in csv.DictReader((ref / "azure_gpu_vms.csv").open()):
        gpu, count, note = r["AcceleratorName"], int(Decimal(r["AcceleratorCount"])), ""
        if r["InstanceType"] == "Standard_ND96isr_H100_v5":
            count, note = 8, "; GPU count corrected 12->8 (the VM has 8 H100)"
        mem = reference.GPU_MEMORY[gpu]
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
                vcpus=num(r["vCPUs"]),
                memory_gb=num(r["MemoryGiB"]),
                price=dec(r["Price"]),
                spot_price=dec(spot),
                currency="USD",
                accelerator="",
                source=src + note,
                as_of=reference.COPIED,
            )
        )
    return rows
