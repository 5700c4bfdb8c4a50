"""GCP prices from the Cloud Billing Catalog API, turned into :class:`~providers.base.Offer` rows.

The catalog lists Compute Engine SKUs (service ``6F81-5844-456A``), each a unit price per region:
per vCPU-hour and per GiB-hour of a machine series ("A2 Instance Core running in Americas"), and
per GPU-hour ("Nvidia Tesla A100 GPU running in Americas"); spot prices are the ``Preemptible``
usage type. A machine's hourly price is built the simple way:

    host  = vCPUs × <series> Core SKU + GiB × <series> Ram SKU
    price = host + GPU SKU × GPU count

which holds for every shape listed in :data:`SHAPES`: a2-highgpu and a2-megagpu (A100),
a2-ultragpu (A100-80GB), a3-highgpu and a3-megagpu (H100), a3-ultragpu (H200), g2-standard (L4),
and n1-standard-4/8/16 hosts with attachable T4/V100 GPUs.
a3-highgpu-1g/2g/4g are sold as Spot (or flex-start) only, so they get no on-demand price.
The SKUs name regions, not zones: offers go to the zones of those regions known to have the GPU
(:data:`GPU_ZONES`, from the acceleratorTypes lists behind SkyPilot's GCP catalog, 2026-11).
The API key comes from ``PROVISIONER_GCP_API_KEY`` and travels in the ``X-Goog-Api-Key`` header,
so it never appears in a URL, a log line or an error message.
"""

from __future__ import annotations

import csv
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from providers import reference
from providers.base import AuthError, InvalidRequest, Offer, Throttled, paginate
from providers.gpus import GPUS
from providers.reference import dec, num
from providers.retry import call_with_retry

if TYPE_CHECKING:
    from providers.gcp import GCPOptions

BILLING_ENDPOINT = "https://cloudbilling.googleapis.com"
COMPUTE_SERVICE = "6F81-5844-456A"
API_KEY_ENV = "PROVISIONER_GCP_API_KEY"

# Words of the SKU description that name a machine series' vCPU/RAM SKUs.
SERIES_SKU = {
    "a2": "A2 Instance",
    "a3": "A3 Instance",  # A3 High and A3 Mega hosts
    "a3-ultra": "A3 Ultra Instance",
    "g2": "G2 Instance",
    "n1": "N1 Predefined Instance",
}
# Words of the SKU description that name one GPU (so "A100 GPU" is not "A100 80GB GPU").
GPU_SKU = {
    "A100": "A100 GPU",
    "A100-80GB": "A100 80GB GPU",
    "H100": "H100 80GB GPU",
    # the GPUs of A3 Mega and A3 Ultra have SKUs of their own: "Nvidia H100 80GB Mega GPU
    # running in <place>", "H200 141GB GPU running in <place>" (newer SKUs drop "Nvidia")
    "H100-MEGA": "H100 80GB Mega GPU",
    "H200": "H200 141GB GPU",
    "L4": "L4 GPU",
    "T4": "T4 GPU",
    "V100": "V100 GPU",
}
ACCELERATOR = {"T4": "nvidia-tesla-t4", "V100": "nvidia-tesla-v100"}
N1_HOSTS = {1: (4, 8), 2: (8, 16), 4: (16,), 8: (16,)}  # GPUs -> n1-standard vCPUs
# Unit prices we must not mix in: commitments are another usageType; these are other products.
_EXCLUDED_WORDS = ("custom", "premium", "sole tenancy", "reserved", "commitment", "dws", "calendar")
_PLACES = Decimal("0.00001")


@dataclass(frozen=True)
class Shape:
    instance_type: str
    gpu: str
    gpu_count: int
    vcpus: int
    memory_gb: int
    spot_only: bool = False  # a3-highgpu with fewer than 8 GPUs: Spot (or flex-start) only
    sku_series: str = ""  # the SERIES_SKU key of its host SKUs, when not its family
    sku_gpu: str = ""  # the GPU_SKU key of its GPU SKU, when not its GPU
    zones: tuple[str, ...] = ()  # where the machine type exists, when not every zone of its GPU

    @property
    def series(self) -> str:
        return self.sku_series or self.instance_type.split("-", 1)[0]

    @property
    def gpu_sku(self) -> str:
        return self.sku_gpu or self.gpu

    @property
    def where(self) -> list[str]:
        return list(self.zones) or GPU_ZONES[self.gpu]

    @property
    def accelerator(self) -> str:
        return ACCELERATOR.get(self.gpu, "")


_MACHINE_ZONES_TEXT = {
    "a2-megagpu-16g": (
        "asia-southeast1-a asia-southeast1-c europe-west4-a europe-west4-b us-central1-a "
        "us-central1-b us-central1-c us-central1-f"
    ),
    "a3-megagpu-8g": (
        "asia-east1-c asia-northeast1-b asia-southeast1-b asia-southeast1-c "
        "australia-southeast1-c europe-north1-c europe-west1-b europe-west1-c europe-west3-c "
        "europe-west4-b europe-west4-c us-central1-a us-central1-b us-central1-c us-east4-a "
        "us-east4-b us-east4-c us-east5-a us-west1-a us-west1-b us-west4-a"
    ),
    "a3-ultragpu-8g": (
        "asia-south1-b asia-south2-c europe-west1-b europe-west4-a us-central1-b us-east4-b "
        "us-east5-a us-south1-b us-west1-c"
    ),
}
_MACHINE_ZONES = {name: tuple(text.split()) for name, text in _MACHINE_ZONES_TEXT.items()}


def _shapes() -> list[Shape]:
    shapes = []
    for n in (1, 2, 4, 8):
        shapes.append(Shape(f"a2-highgpu-{n}g", "A100", n, 12 * n, 85 * n))
        shapes.append(Shape(f"a2-ultragpu-{n}g", "A100-80GB", n, 12 * n, 170 * n))
        shapes.append(Shape(f"a3-highgpu-{n}g", "H100", n, 26 * n, 234 * n, spot_only=n < 8))
    # The one shape each of A2 Mega, A3 Mega and A3 Ultra: vCPUs, GiB and the zones listing the
    # machine type (fewer than its GPU's) as `gcloud compute machine-types list` is recorded in
    # SkyPilot's catalog v8 (gcp/vms.csv @ 006059e0). A3 Ultra hosts bill as "A3 Ultra Instance
    # Core/Ram" (so named in GCP billing exports), not as A3 High/Mega's "A3 Instance".
    shapes.append(
        Shape("a2-megagpu-16g", "A100", 16, 96, 1360, zones=_MACHINE_ZONES["a2-megagpu-16g"])
    )
    shapes.append(
        Shape(
            "a3-megagpu-8g",
            "H100",
            8,
            208,
            1872,
            sku_gpu="H100-MEGA",
            zones=_MACHINE_ZONES["a3-megagpu-8g"],
        )
    )
    shapes.append(
        Shape(
            "a3-ultragpu-8g",
            "H200",
            8,
            224,
            2952,
            sku_series="a3-ultra",
            zones=_MACHINE_ZONES["a3-ultragpu-8g"],
        )
    )
    for vcpus, gpus in ((4, 1), (8, 1), (12, 1), (16, 1), (32, 1), (24, 2), (48, 4), (96, 8)):
        shapes.append(Shape(f"g2-standard-{vcpus}", "L4", gpus, vcpus, 4 * vcpus))
    # n1 hosts for attachable GPUs, paired as in the shipped catalog (SkyPilot's pairing).
    for gpu, counts in (("T4", (1, 2, 4)), ("V100", (1, 2, 4, 8))):
        for n in counts:
            for vcpus in N1_HOSTS[n]:
                shapes.append(Shape(f"n1-standard-{vcpus}", gpu, n, vcpus, vcpus * 15 // 4))
    return shapes


SHAPES: list[Shape] = _shapes()

_ZONES_TEXT = {
    "A100": (
        "asia-northeast1-a asia-northeast1-c asia-northeast3-a asia-northeast3-b "
        "asia-southeast1-a asia-southeast1-b asia-southeast1-c europe-west4-a europe-west4-b "
        "me-west1-a me-west1-c us-central1-a us-central1-b us-central1-c us-central1-f "
        "us-east1-b us-west1-b us-west3-b us-west4-b"
    ),
    "A100-80GB": (
        "asia-southeast1-c europe-west4-a us-central1-a us-central1-c us-east4-c us-east5-a "
        "us-east5-b"
    ),
    "H100": (
        "asia-east1-c asia-northeast1-b asia-northeast3-a asia-northeast3-c asia-south1-c "
        "asia-south2-b asia-southeast1-b asia-southeast1-c australia-southeast1-c "
        "europe-north1-c europe-west1-b europe-west1-c europe-west2-b europe-west3-a "
        "europe-west3-c europe-west4-b europe-west4-c europe-west9-c northamerica-northeast2-c "
        "us-central1-a us-central1-b us-central1-c us-east4-a us-east4-b us-east4-c us-east5-a "
        "us-west1-a us-west1-b us-west4-a"
    ),
    "L4": (
        "asia-east1-a asia-east1-b asia-east1-c asia-northeast1-a asia-northeast1-b "
        "asia-northeast1-c asia-northeast3-a asia-northeast3-b asia-south1-a asia-south1-b "
        "asia-south1-c asia-southeast1-a asia-southeast1-b asia-southeast1-c europe-west1-b "
        "europe-west1-c europe-west2-a europe-west2-b europe-west3-a europe-west3-b "
        "europe-west4-a europe-west4-b europe-west4-c europe-west6-b europe-west6-c "
        "me-central2-a me-central2-c northamerica-northeast1-b northamerica-northeast1-c "
        "northamerica-northeast2-a northamerica-northeast2-b us-central1-a us-central1-b "
        "us-central1-c us-east1-b us-east1-c us-east1-d us-east4-a us-east4-c us-west1-a "
        "us-west1-b us-west1-c us-west4-a us-west4-c"
    ),
    "T4": (
        "asia-east1-a asia-east1-c asia-east2-a asia-east2-c asia-northeast1-a "
        "asia-northeast1-c asia-northeast3-b asia-northeast3-c asia-south1-a asia-south1-b "
        "asia-southeast1-a asia-southeast1-b asia-southeast1-c asia-southeast2-a "
        "asia-southeast2-b australia-southeast1-a australia-southeast1-c europe-central2-b "
        "europe-central2-c europe-west1-b europe-west1-c europe-west1-d europe-west2-a "
        "europe-west2-b europe-west3-b europe-west4-a europe-west4-b europe-west4-c me-west1-b "
        "me-west1-c northamerica-northeast1-c southamerica-east1-a southamerica-east1-b "
        "southamerica-east1-c us-central1-a us-central1-b us-central1-c us-central1-f "
        "us-east1-b us-east1-c us-east1-d us-east4-a us-east4-b us-east4-c us-west1-a "
        "us-west1-b us-west2-b us-west2-c us-west3-b us-west4-a us-west4-b"
    ),
    "V100": (
        "asia-east1-c europe-west4-a europe-west4-b europe-west4-c us-central1-a us-central1-b "
        "us-central1-c us-central1-f us-east1-b us-east1-c us-west1-a us-west1-b"
    ),
}
GPU_ZONES: dict[str, list[str]] = {gpu: text.split() for gpu, text in _ZONES_TEXT.items()}


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def fetch_offers(options: GCPOptions) -> list[Offer]:
    """All offers of :data:`SHAPES` priced from the live catalog. Restricted to the configured
    ``zones`` or ``regions`` when the options set them."""
    key = os.environ.get(API_KEY_ENV)
    if not key:
        raise AuthError(
            f"gcp: catalog refresh needs a Cloud Billing API key in {API_KEY_ENV}",
            code="noApiKey",
        )
    endpoint = (options.pricing_endpoint or BILLING_ENDPOINT).rstrip("/")
    skus = fetch_skus(endpoint, key, options)
    fetched = datetime.now(UTC).date().isoformat()
    return build_offers(skus, _zone_filter(options), source=f"{_source()} fetched {fetched}")


def fetch_skus(endpoint: str, key: str, options: GCPOptions) -> list[dict[str, Any]]:
    """Every Compute Engine SKU, following ``nextPageToken`` to the end."""

    def page(token: str | None) -> tuple[list[dict[str, Any]], str | None]:
        query = {"pageSize": "5000", "currencyCode": "USD"}
        if token:
            query["pageToken"] = token
        url = f"{endpoint}/v1/services/{COMPUTE_SERVICE}/skus?{urllib.parse.urlencode(query)}"
        got = call_with_retry(partial(_get_json, url, key), options)
        return got.get("skus", []), got.get("nextPageToken")

    return list(paginate(page))


def build_offers(
    skus: Iterable[Mapping[str, Any]], zones: set[str] | None = None, source: str = ""
) -> list[Offer]:
    """Offers for every shape and zone where the SKUs price the host and its GPUs."""
    rates = _unit_rates(skus)
    offers = []
    for shape in SHAPES:
        for zone in shape.where:
            if zones is not None and zone not in zones:
                continue
            region = region_of(zone)
            price = None if shape.spot_only else _price(rates, shape, region, "OnDemand")
            spot = _price(rates, shape, region, "Preemptible")
            if price is None and spot is None:
                continue
            offers.append(
                Offer(
                    cloud="gcp",
                    region=region,
                    zone=zone,
                    instance_type=shape.instance_type,
                    gpu=shape.gpu,
                    gpu_count=shape.gpu_count,
                    gpu_memory_gb=GPUS[shape.gpu].memory_gb,
                    vcpus=shape.vcpus,
                    memory_gb=Decimal(shape.memory_gb),
                    price=price,
                    spot_price=spot,
                    currency="USD",
                    accelerator=shape.accelerator,
                    source=source or _source(),
                )
            )
    return offers


def _source() -> str:
    return f"GCP Cloud Billing Catalog API services/{COMPUTE_SERVICE}/skus (host vCPU+RAM + GPU)"


def _zone_filter(options: GCPOptions) -> set[str] | None:
    if options.zones:
        return set(options.zones)
    if options.regions:
        regions = set(options.regions)
        return {z for shape in SHAPES for z in shape.where if region_of(z) in regions}
    return None


# (kind, name, usage type, region) -> USD per unit-hour; kind is "core", "ram" or "gpu".
_Rates = dict[tuple[str, str, str, str], Decimal]


def _unit_rates(skus: Iterable[Mapping[str, Any]]) -> _Rates:
    rates: _Rates = {}
    for sku in skus:
        category = sku.get("category", {})
        usage = category.get("usageType")
        description = sku.get("description", "")
        if category.get("resourceFamily") != "Compute" or usage not in ("OnDemand", "Preemptible"):
            continue
        if any(word in description.lower() for word in _EXCLUDED_WORDS):
            continue
        entry = _classify_sku(category.get("resourceGroup", ""), description)
        if entry is None:
            continue
        unit = _unit_price(sku)
        if unit is None:
            continue
        for region in sku.get("serviceRegions", []):
            rates.setdefault((*entry, usage, region), unit)
    return rates


def _classify_sku(group: str, description: str) -> tuple[str, str] | None:
    if group == "GPU":
        return _gpu_sku(description)
    if group not in ("CPU", "RAM", "N1Standard"):
        return None
    return _series_sku(group, description)


def _gpu_sku(description: str) -> tuple[str, str] | None:
    for gpu, words in GPU_SKU.items():
        if words in description:
            return "gpu", gpu
    return None


def _series_sku(group: str, description: str) -> tuple[str, str] | None:
    """A machine series' core or RAM SKU (N1's are in the N1Standard group, told by "Core" or
    "Ram" in the description)."""
    for series, words in SERIES_SKU.items():
        if words in description:
            if group == "CPU" or (group == "N1Standard" and "Core" in description):
                return "core", series
            if group == "RAM" or (group == "N1Standard" and "Ram" in description):
                return "ram", series
    return None


def _unit_price(sku: Mapping[str, Any]) -> Decimal | None:
    """USD per hour of the first tier (compute SKUs have one)."""
    try:
        expression = sku["pricingInfo"][0]["pricingExpression"]
        rate = expression["tieredRates"][0]["unitPrice"]
    except (KeyError, IndexError):
        return None
    if rate.get("currencyCode", "USD") != "USD" or expression.get("usageUnit", "h") not in (
        "h",
        "GiBy.h",
    ):
        return None
    return Decimal(str(rate.get("units") or 0)) + Decimal(int(rate.get("nanos") or 0)) / 10**9


def _price(rates: _Rates, shape: Shape, region: str, usage: str) -> Decimal | None:
    core = rates.get(("core", shape.series, usage, region))
    ram = rates.get(("ram", shape.series, usage, region))
    gpu = rates.get(("gpu", shape.gpu_sku, usage, region))
    if core is None or ram is None or gpu is None:
        return None
    total = core * shape.vcpus + ram * shape.memory_gb + gpu * shape.gpu_count
    return total.quantize(_PLACES, rounding=ROUND_HALF_UP)


def _get_json(url: str, key: str) -> dict[str, Any]:
    request = urllib.request.Request(
        url, headers={"X-Goog-Api-Key": key, "Accept": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        raise _billing_error(exc.code, exc.read()) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        message = f"gcp: billing catalog unreachable ({getattr(exc, 'reason', exc)})"
        raise Throttled(message, code="unreachable") from None


def _billing_error(status: int, body: bytes) -> Exception:
    try:
        error = json.loads(body)["error"]
        message, code = error.get("message", ""), error.get("status") or str(status)
        for detail in error.get("details", []):
            code = detail.get("reason", code)
    except (ValueError, KeyError, TypeError, AttributeError):
        message, code = body[:200].decode("utf-8", "replace"), str(status)
    text = f"gcp: billing catalog answered HTTP {status}: {message}"
    if status == 429 or status >= 500:
        return Throttled(text, code=code)
    if status in (401, 403) or "API_KEY" in code or "API key" in message:
        return AuthError(text, code=code)
    return InvalidRequest(text, code=code)


# --- the shipped catalog, from reference price files ---------------------------------------


CATALOG_HOSTS = {  # (gpu, count) -> host types (SkyPilot's _ACC_INSTANCE_TYPE_DICTS)
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
CATALOG_N1_HOSTS = {
    1: ["n1-standard-4", "n1-standard-8"],
    2: ["n1-standard-8", "n1-standard-16"],
    4: ["n1-standard-16"],
    8: ["n1-standard-16"],
}
CATALOG_ACCEL = {"T4": "nvidia-tesla-t4", "V100": "nvidia-tesla-v100"}


def catalog_rows(ref: Path) -> list[dict[str, Any]]:
    """The shipped catalog's rows (built by provisioner/data/catalog/build.py)."""
    src = reference.SKYPILOT.format(path="gcp/vms.csv", commit="006059e0") + "; price = host + GPUs"
    hosts = {
        (r["InstanceType"], r["AvailabilityZone"]): r
        for name in ("gcp_gpu_hosts.csv", "gcp_n1_hosts.csv")
        for r in csv.DictReader((ref / name).open())
    }
    rows: list[dict[str, Any]] = []

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
                gpu_memory_gb=reference.GPU_MEMORY[gpu],
                vcpus=num(h["vCPUs"]),
                memory_gb=num(h["MemoryGiB"]),
                price=dec(str(price or "")),
                spot_price=dec(str(spot or "")),
                currency="USD",
                accelerator=accel,
                source=src,
                as_of=reference.COPIED,
            )
        )

    for g in csv.DictReader((ref / "gcp_gpu_vms.csv").open()):
        gpu, count = g["AcceleratorName"], int(Decimal(g["AcceleratorCount"]))
        if gpu in CATALOG_ACCEL:
            types, accel = CATALOG_N1_HOSTS.get(count, []), CATALOG_ACCEL[gpu]
        else:
            types, accel = CATALOG_HOSTS.get((gpu, count), []), ""
        for t in types:
            h = hosts.get((t, g["AvailabilityZone"]))
            if h:
                add([], g, h, gpu, count, accel)
    return rows
