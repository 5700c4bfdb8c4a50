"""Offers: shipped with the package as CSV files (so ``plan`` works offline), replaced per cloud by
``provisioner catalog refresh`` (written to the data directory), completed by price overrides
from settings."""

from __future__ import annotations

import csv
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields, replace
from decimal import Decimal
from importlib import resources
from pathlib import Path
from typing import Any

import providers
from providers import gpus
from providers.base import Offer
from provisioner.settings import Settings

COLUMNS = [f.name for f in fields(Offer)]


def _shipped(cloud: str) -> Path:
    return Path(str(resources.files("provisioner") / "data" / "catalog" / f"{cloud}.csv"))


def refreshed_path(settings: Settings, cloud: str) -> Path:
    return settings.home / "catalog" / f"{cloud}.csv"


def read_csv(path: Path) -> Iterator[Offer]:
    return _read(path)


Keep = Callable[[dict[str, int]], Callable[[list[str]], bool]]


def _read(path: Path, keep: Keep | None = None) -> Iterator[Offer]:
    """The offers of one catalog file; with ``keep`` (given the header's column positions, a
    test of a raw row), only the rows it accepts. Only those are converted (Decimal, int): a
    plan reads a 100,000-row catalog for one GPU type, and converting is what costs."""
    with path.open(newline="", encoding="utf-8") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header is None:
            return
        index = {name: i for i, name in enumerate(header)}
        missing = [c for c in COLUMNS if c not in index and c not in _OPTIONAL]
        if missing:
            raise ValueError(f"{path}: catalog without column(s) {', '.join(missing)}")
        get = [(c, index.get(c), _CONVERT.get(c, str)) for c in COLUMNS]
        test = keep(index) if keep else None
        for row in rows:
            if test is None or test(row):
                values: dict[str, Any] = {
                    c: conv(row[i]) if i is not None else "" for c, i, conv in get
                }
                yield Offer(**values)


def _price(value: str) -> Decimal | None:
    return Decimal(value) if value else None


def _int(value: str) -> int:
    return int(value) if value.isdigit() else int(Decimal(value))


_CONVERT: dict[str, Callable[[str], Any]] = {
    "gpu_count": _int,
    "gpu_memory_gb": _int,
    "vcpus": _int,
    "memory_gb": Decimal,
    "price": _price,
    "spot_price": _price,
}
_OPTIONAL = {"accelerator", "source"}


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


class Offers(list[Offer]):
    """Offers loaded for a plan, with the rows left unconverted because their GPU family was
    not the one asked for: counted per reason with one example, as the planner counts the
    offers it turns down."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped: Counter[str] = Counter()
        self.examples: dict[str, str] = {}


OTHER_GPU = "other GPU type"  # the planner's reasons
OTHER_COUNT = "other GPU count"


def load(
    settings: Settings,
    clouds: Iterable[str],
    *,
    gpu_family: str | None = None,
    gpu_count: int | None = None,
) -> Offers:
    """The offers of ``clouds`` inside the regions and zones settings enable for each, priced
    from a refreshed catalog where there is one, else the shipped one, then settings. With
    ``gpu_family`` (and ``gpu_count``), rows of other GPUs are only counted, under the
    planner's reasons (``Offers.skipped``)."""
    offers = Offers()
    for cloud in clouds:
        path = source_of(settings, cloud)
        if not path.exists():
            continue
        overrides = settings.prices.get(cloud, {})
        for o in _read(path, _keep(settings, cloud, gpu_family, gpu_count, offers)):
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


def _keep(
    settings: Settings,
    cloud: str,
    gpu_family: str | None,
    gpu_count: int | None,
    offers: Offers,
) -> Keep:
    """The raw-row test for one cloud's file: inside the places settings enable (one answer
    per place), of ``gpu_family`` and ``gpu_count`` (other rows counted on ``offers``)."""
    options = settings.cloud(cloud) or providers.spec(cloud).options()
    places: dict[tuple[str, str], bool] = {}
    families: dict[str, str] = {}

    def factory(at: dict[str, int]) -> Callable[[list[str]], bool]:
        region, zone, gpu, itype = at["region"], at["zone"], at["gpu"], at["instance_type"]
        count = at["gpu_count"]

        def skip(reason: str, row: list[str]) -> bool:
            offers.skipped[reason] += 1
            offers.examples.setdefault(reason, f"{cloud}/{row[zone] or row[region]} {row[itype]}")
            return False

        def keep(row: list[str]) -> bool:
            place = (row[region], row[zone])
            allowed = places.get(place)
            if allowed is None:
                allowed = places[place] = options.allows(*place)
            if not allowed:
                return False
            if gpu_family is None:
                return True
            fam = families.get(row[gpu])
            if fam is None:
                fam = families[row[gpu]] = gpus.family(row[gpu])
            if fam != gpu_family:
                return skip(OTHER_GPU, row)
            if gpu_count is not None and _int(row[count]) != gpu_count:
                return skip(OTHER_COUNT, row)
            return True

        return keep

    return factory


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


@dataclass(frozen=True)
class AddressPrice:
    """What a machine's public IPv4 address costs per hour in one currency (None: unknown,
    priced nowhere until ``address_prices.<cloud>`` is set), and while it is billed:
    ``running`` (released at stop, as an auto-assigned or ephemeral address) or ``held``
    (kept, and billed, until the machine is deleted, as a static address or an EIP); ``free``:
    not billed (the sandbox)."""

    rate: Decimal | None
    billed: str
    source: str


def address_price(settings: Settings, cloud: str, currency: str) -> AddressPrice:
    """The public IPv4 price of ``cloud`` in ``currency`` (the machine's), from the shipped
    ``addresses.csv`` (each row cites its source) or ``address_prices`` in settings (in the
    cloud's own currency: USD for AWS, RUB for SberCloud…)."""
    with _shipped("addresses").open(newline="", encoding="utf-8") as f:
        rows = {(r["cloud"], r["currency"]): r for r in csv.DictReader(f)}
    row = rows.get((cloud, currency)) or next((r for (c, _), r in rows.items() if c == cloud), {})
    billed = row.get("billed") or "running"
    own = providers.spec(cloud).currency if cloud in providers.REGISTRY else currency
    if cloud in settings.address_prices and currency == own:  # set in the cloud's own currency
        billed = "running" if billed == "free" else billed
        return AddressPrice(settings.address_prices[cloud], billed, "settings")
    if not row.get("price_hour") or row.get("currency") != currency:
        return AddressPrice(None, billed, row.get("source") or "unknown")
    return AddressPrice(Decimal(row["price_hour"]), billed, row["source"])


def address_rate(settings: Settings, cloud: str, currency: str) -> tuple[Decimal | None, str]:
    """A machine's public IPv4 rate per hour on ``cloud`` in ``currency``, and while it bills
    (``running``, ``held``, ``free``; ``none``: the machine gets no public address, its cloud's
    ``public_ip``/``external_ip`` off). None when not billed or the price is unknown."""
    price = address_price(settings, cloud, currency)
    options = getattr(settings.clouds, cloud, None)
    if False in (getattr(options, "public_ip", True), getattr(options, "external_ip", True)):
        return None, "none"
    return price.rate, price.billed


def _disk_rows() -> dict[tuple[str, str], dict[str, str]]:
    with _shipped("disks").open(newline="", encoding="utf-8") as f:
        return {(r["cloud"], r["currency"]): r for r in csv.DictReader(f)}
