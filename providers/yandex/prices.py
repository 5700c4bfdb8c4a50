"""Yandex Compute GPU platforms, their allowed shapes, the instance-type encoding, and the
SKU arithmetic that turns billing unit rates into per-shape hourly offers.

Instance type encoding (the shipped catalog uses it): ``<platform_id>/<gpus>g-<vcpus>c-<ramGB>gb``,
e.g. ``gpu-standard-v3/8g-224c-952gb`` or ``standard-v3-t4/1g-8c-32gb``. RAM is in GB as the
console shows it (GiB: the API takes ``memory`` in bytes = GB × 2³⁰).

Pure data and arithmetic: no SDK import here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from providers.base import InvalidRequest, Offer

REGION = "ru-central1"
GIB = 1 << 30
_STREET_PRICE = 1  # yandex.cloud.billing.v1.PricingVersionType.STREET_PRICE
_A, _B, _D, _E = (f"{REGION}-{z}" for z in "abde")


@dataclass(frozen=True)
class Skus:
    """Billing SKU names of one platform's three meters, regular and preemptible.
    ``None`` where the name is not published (those offers carry no price)."""

    gpu: str | None
    cpu: str | None
    ram: str | None
    gpu_preemptible: str | None
    cpu_preemptible: str | None
    ram_preemptible: str | None


@dataclass(frozen=True)
class Platform:
    id: str
    gpu: str  # normalised GPU name
    gpu_memory_gb: int
    shapes: tuple[tuple[int, int, int], ...]  # (gpus, vcpus, ram GB)
    zones: tuple[str, ...]
    skus: Skus


_UNKNOWN_SKUS = Skus(None, None, None, None, None, None)

# Shapes and zones: Yandex docs "GPUs" and "platforms" pages (RU_CLOUDS.md §1.1-1.2).
# SKU names: yandex-cloud/docs pricing templates (§1.5). The T4 platform bills vCPU and RAM at
# the Ice Lake (standard v3) meters. Gen2, V4 and T4i prices are hard-coded in the docs, not
# templated, so their SKU names are unknown: their offers come out unpriced.
PLATFORMS: dict[str, Platform] = {
    p.id: p
    for p in (
        Platform(
            "gpu-standard-v1",
            "V100",
            32,
            ((1, 8, 96), (2, 16, 192), (4, 32, 384)),
            (_A, _B),
            Skus(
                "compute.vm.gpu.gpu-standard",
                "compute.vm.cpu.c100",
                "compute.vm.ram",
                "compute.vm.gpu.gpu-standard.preemptible",
                "compute.vm.cpu.c100.preemptible",
                "compute.vm.ram.preemptible",
            ),
        ),
        Platform(
            "gpu-standard-v2",
            "V100",
            32,
            ((1, 8, 48), (2, 16, 96), (4, 32, 192), (8, 64, 384)),
            (_A, _B),
            Skus(
                "compute.vm.gpu.gpu-standard.v2",
                "compute.vm.cpu.c100.v2",
                "compute.vm.ram.v2",
                "compute.vm.gpu.gpu-standard.preemptible.v2",
                "compute.vm.cpu.c100.preemptible.v2",
                "compute.vm.ram.preemptible.v2",
            ),
        ),
        Platform(
            "gpu-standard-v3",
            "A100-80GB",
            80,
            ((1, 28, 119), (2, 56, 238), (4, 112, 476), (8, 224, 952)),
            (_A, _B),
            Skus(
                "compute.vm.gpu.gpu-standard.v3",
                "compute.vm.cpu.c100.gpu-standard.v3",
                "compute.vm.ram.gpu-standard.v3",
                "compute.vm.gpu.gpu-standard.preemptible.v3",
                "compute.vm.cpu.c100.gpu-standard.preemptible.v3",
                "compute.vm.ram.gpu-standard.preemptible.v3",
            ),
        ),
        # Yandex does not name the chip of "Gen2" (80 GB), "V4" (141 GB) or "T4i": they keep
        # Yandex's own names, never H100/H200, so a spec asking for H100 never lands on a guess.
        Platform(
            "gpu-standard-v3i",
            "YC-GEN2",
            80,
            ((1, 18, 144), (2, 36, 288), (4, 72, 576), (8, 180, 1440)),
            (_D,),
            _UNKNOWN_SKUS,
        ),
        Platform(
            "gpu-standard-v4",
            "YC-V4",
            141,
            ((1, 22, 220), (2, 44, 440), (4, 88, 880), (8, 180, 1800)),
            (_D, _E),
            _UNKNOWN_SKUS,
        ),
        Platform(
            "standard-v3-t4",
            "T4",
            16,
            ((1, 4, 16), (1, 8, 32), (1, 16, 64), (1, 32, 128)),
            (_A, _B, _D),
            Skus(
                "compute.vm.gpu.standard.v3-t4",
                "compute.vm.cpu.c100.v3",
                "compute.vm.ram.v3",
                "compute.vm.gpu.standard.v3-t4.preemptible",
                "compute.vm.cpu.c100.preemptible.v3",
                "compute.vm.ram.preemptible.v3",
            ),
        ),
        Platform(
            "standard-v3-t4i",
            "T4I",
            24,
            ((1, 4, 16), (1, 8, 32), (1, 16, 64), (1, 32, 128)),
            (_D,),
            _UNKNOWN_SKUS,
        ),
    )
}


@dataclass(frozen=True)
class Shape:
    platform_id: str
    gpus: int
    vcpus: int
    ram_gb: int

    @property
    def instance_type(self) -> str:
        return f"{self.platform_id}/{self.gpus}g-{self.vcpus}c-{self.ram_gb}gb"

    @property
    def memory_bytes(self) -> int:
        return self.ram_gb * GIB


_TYPE = re.compile(r"(?P<platform>[a-z][a-z0-9-]*)/(?P<g>\d+)g-(?P<c>\d+)c-(?P<r>\d+)gb")


def parse_instance_type(instance_type: str) -> Shape:
    """Parse and validate against the known platforms. A platform this table does not know is
    passed through (Yandex adds platforms; the API is the judge), a bad shape of a known one is
    refused before any call."""
    m = _TYPE.fullmatch(instance_type)
    if not m:
        raise InvalidRequest(
            f"yandex: instance type {instance_type!r} is not <platform>/<gpus>g-<vcpus>c-<ram>gb",
            code="BAD_INSTANCE_TYPE",
        )
    shape = Shape(m["platform"], int(m["g"]), int(m["c"]), int(m["r"]))
    platform = PLATFORMS.get(shape.platform_id)
    if platform and (shape.gpus, shape.vcpus, shape.ram_gb) not in platform.shapes:
        allowed = ", ".join(Shape(platform.id, *s).instance_type for s in platform.shapes)
        raise InvalidRequest(
            f"yandex: {instance_type} is not an allowed shape of {platform.id} ({allowed})",
            code="BAD_INSTANCE_TYPE",
        )
    return shape


def shape_price(
    platform: Platform, shape: tuple[int, int, int], rates: Mapping[str, Decimal], *, spot: bool
) -> Decimal | None:
    """GPUs × GPU rate + vCPUs × vCPU rate + GB × RAM rate, or None if a meter has no rate."""
    s = platform.skus
    names = (
        (s.gpu_preemptible, s.cpu_preemptible, s.ram_preemptible) if spot else (s.gpu, s.cpu, s.ram)
    )
    if any(n is None or n not in rates for n in names):
        return None
    gpu, cpu, ram = (rates[n] for n in names)  # type: ignore[index]
    gpus, vcpus, ram_gb = shape
    return (gpus * gpu + vcpus * cpu + ram_gb * ram).quantize(Decimal("0.0001"))


def current_rates(skus: Iterable[Any], currency: str, now: datetime) -> dict[str, Decimal]:
    """SKU name → unit price of its street-price version in force at ``now`` (the first rate
    tier: GPU hours, core hours and GB hours start pricing at zero). ``skus`` are
    ``yandex.cloud.billing.v1.Sku`` messages."""
    rates: dict[str, Decimal] = {}
    for sku in skus:
        price = _street_price(sku, currency, now)
        if price is not None:
            rates[sku.name] = price
    return rates


def _street_price(sku: Any, currency: str, now: datetime) -> Decimal | None:
    """One SKU's first-tier unit price in ``currency``, of its street-price version in force."""
    versions = [
        v
        for v in sku.pricing_versions
        if v.type == _STREET_PRICE and v.effective_time.ToDatetime(UTC) <= now
    ]
    if not versions:
        return None
    version = max(versions, key=lambda v: v.effective_time.ToDatetime(UTC))
    tiers = [r for e in version.pricing_expressions for r in e.rates if r.currency == currency]
    if not tiers:
        return None
    first = min(tiers, key=lambda r: Decimal(r.start_pricing_quantity or "0"))
    return Decimal(first.unit_price)


def build_offers(
    rates: Mapping[str, Decimal], source: str, zones: Iterable[str] | None = None
) -> list[Offer]:
    """One offer per allowed shape per zone where the platform is sold (of ``zones`` if given)."""
    wanted = set(zones) if zones is not None else None
    offers = []
    for platform in PLATFORMS.values():
        for zone in (z for z in platform.zones if wanted is None or z in wanted):
            for shape in platform.shapes:
                offers.append(
                    Offer(
                        cloud="yandex",
                        region=REGION,
                        zone=zone,
                        instance_type=Shape(platform.id, *shape).instance_type,
                        gpu=platform.gpu,
                        gpu_count=shape[0],
                        gpu_memory_gb=platform.gpu_memory_gb,
                        vcpus=shape[1],
                        memory_gb=Decimal(shape[2]),
                        price=shape_price(platform, shape, rates, spot=False),
                        spot_price=shape_price(platform, shape, rates, spot=True),
                        currency="RUB",
                        source=source,
                    )
                )
    return offers


# --- the shipped catalog, from reference price files ---------------------------------------


# Yandex Cloud (RU_CLOUDS.md §1): per-GPU + per-vCPU + per-GB rates, RUB/h incl. VAT.
# (regular gpu, vcpu, ram), (preemptible gpu, vcpu, ram), gpu, memory, zones, shapes, source
# (source, the date its rates took effect: the rows' as_of, the VAT % its prices include)
YC_2022 = (
    "Yandex Cloud docs presets.yaml sku|RUB|compute.vm.* (rates from 2022-04-13, VAT 20%)",
    "2022-04-13",
    20,
)
# The T4i rates' page is undated; its prices include 20 % VAT, which ended on 2026-01-01 (425-FZ),
# so they were in force no later than 2025-12-31: the rows carry that date, the latest it can
# be, so `plan` calls them stale rather than passing them as fresh.
YC_T4I = (
    "Yandex Cloud docs ru/_pricing/compute/rub-instance-resources.md @0a247371 (undated; "
    "VAT 20%, so in force no later than 2025-12-31)",
    "2025-12-31",
    20,
)
YC_2026 = (
    "Yandex Cloud docs ru/_pricing/compute/rub-from-23-01-2026.md (VAT 22%)",
    "2026-01-23",
    22,
)
# Russia's VAT is 22 % since 2026-01-01 (Federal law 425-FZ of 2025-11-28, amending Tax Code
# art. 164). Rates published with 20 % VAT are re-based to 22 %: that part is a fact; the base
# price under it is the old one (a third-party list built from the Billing API,
# kbespalov/cloudfinops prices/yandex-cloud/iaas/compute/gpu.yaml @7935541b, shows V100/A100/T4
# about 8 % higher again from 2026-05-01), so those rows keep their old date and `plan` says so.
VAT = 22
VAT_NOTE = (
    "; re-based from 20% to 22% VAT (425-FZ, from 2026-01-01): the base price is the old one, "
    "not current - run `provisioner catalog refresh --cloud yandex`"
)
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
        YC_T4I,
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


def catalog_rows(_: Path) -> list[dict[str, Any]]:
    """The shipped catalog's rows (built by provisioner/data/catalog/build.py)."""
    rows: list[dict[str, Any]] = []
    for platform, (reg, pre, gpu, mem, zones, shapes, (src, as_of, vat)) in YANDEX.items():
        note = VAT_NOTE if vat != VAT else ""
        for gpus, cpus, ram in shapes:

            def hourly(
                r: tuple[str, str, str],
                gpus: int = gpus,
                cpus: int = cpus,
                ram: int = ram,
                vat: int = vat,
            ) -> str:
                total = gpus * Decimal(r[0]) + cpus * Decimal(r[1]) + ram * Decimal(r[2])
                if vat != VAT:
                    total = (total / (100 + vat) * (100 + VAT)).quantize(Decimal("0.01"))
                return str(total)

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
                        source=src + "; GPUs×GPU + vCPU×vCPU + GB×RAM rate" + note,
                        as_of=as_of,
                    )
                )
    return rows
