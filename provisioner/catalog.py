"""Offers: shipped with the package as CSV files (so ``plan`` works offline), replaced per cloud by
``provisioner catalog refresh`` (written to the data directory), completed by price overrides
from settings."""

from __future__ import annotations

import csv
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import fields, replace
from decimal import Decimal
from importlib import resources
from pathlib import Path
from typing import Any

import providers
from providers.base import Offer
from provisioner.settings import Settings

COLUMNS = [f.name for f in fields(Offer)]
_INT = {"gpu_count", "gpu_memory_gb", "vcpus"}
_DEC = {"memory_gb"}
_PRICE = {"price", "spot_price"}


def _shipped(cloud: str) -> Path:
    return Path(str(resources.files("provisioner") / "data" / "catalog" / f"{cloud}.csv"))


def refreshed_path(settings: Settings, cloud: str) -> Path:
    return settings.home / "catalog" / f"{cloud}.csv"


def read_csv(path: Path) -> Iterator[Offer]:
    with path.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            yield Offer(**{k: _convert(k, v) for k, v in row.items() if k in COLUMNS})


def _convert(key: str, value: str) -> Any:
    if key in _INT:
        return int(Decimal(value))
    if key in _DEC:
        return Decimal(value)
    if key in _PRICE:
        return Decimal(value) if value else None
    return value


def write_csv(path: Path, offers: Iterable[Offer]) -> int:
    """Write atomically: a failed refresh never leaves a half-written catalog."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    n = 0
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(COLUMNS)
            for o in offers:
                w.writerow(["" if getattr(o, c) is None else getattr(o, c) for c in COLUMNS])
                n += 1
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return n


def source_of(settings: Settings, cloud: str) -> Path:
    refreshed = refreshed_path(settings, cloud)
    return refreshed if refreshed.exists() else _shipped(cloud)


def load(settings: Settings, clouds: Iterable[str]) -> list[Offer]:
    """The offers of ``clouds`` inside the regions and zones settings enable for each, priced
    from a refreshed catalog where there is one, else the shipped one, then settings."""
    offers: list[Offer] = []
    for cloud in clouds:
        path = source_of(settings, cloud)
        options = settings.cloud(cloud) or providers.spec(cloud).options()
        if not path.exists():
            continue
        overrides = settings.prices.get(cloud, {})
        for o in read_csv(path):
            if not options.allows(o.region, o.zone):
                continue
            p = overrides.get(o.instance_type)
            if p is not None:
                o = replace(
                    o,
                    price=p.price if p.price is not None else o.price,
                    spot_price=p.spot_price if p.spot_price is not None else o.spot_price,
                    source=f"{o.source}; price from settings" if o.source else "settings",
                )
            offers.append(o)
    return offers


def refresh(settings: Settings, cloud: str, fetched: list[Offer]) -> Path:
    """Store freshly fetched offers for ``cloud``. An empty result keeps the old data; an offer
    the source lists without a price keeps the price the catalog had for it, saying so."""
    if not fetched:
        raise ValueError(f"{cloud}: the price source returned no offers; keeping the old catalog")
    old_path = source_of(settings, cloud)
    previous = (
        {(o.region, o.zone, o.instance_type): o for o in read_csv(old_path)}
        if old_path.exists()
        else {}
    )
    merged = []
    for o in fetched:
        before = previous.get((o.region, o.zone, o.instance_type))
        if o.price is None and o.spot_price is None and before and before.price is not None:
            o = replace(
                o,
                price=before.price,
                spot_price=before.spot_price,
                source=f"{o.source}; price kept from the previous catalog ({before.source})",
            )
        merged.append(o)
    path = refreshed_path(settings, cloud)
    write_csv(path, merged)
    return path


def disk_price(settings: Settings, cloud: str, currency: str) -> tuple[Decimal | None, int, str]:
    """Per GB-month price of the boot disk in ``currency`` (the machine's), the hours a month
    has for that cloud, and its source. ``None`` when unknown."""
    row = _disk_rows().get((cloud, currency), {})
    hours = int(row.get("hours_per_month") or 730)
    if cloud in settings.disk_prices:
        return settings.disk_prices[cloud], hours, "settings"
    if not row.get("price_gb_month"):
        return None, hours, "unknown"
    return Decimal(row["price_gb_month"]), hours, row["source"]


def _disk_rows() -> dict[tuple[str, str], dict[str, str]]:
    with _shipped("disks").open(newline="", encoding="utf-8") as f:
        return {(r["cloud"], r["currency"]): r for r in csv.DictReader(f)}
