"""Offers: shipped with the package as CSV files (so ``plan`` works offline), replaced per cloud by
``provisioner catalog refresh`` (written to the data directory), completed by price overrides
from settings."""

from __future__ import annotations

import csv
import os
import re
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields, replace
from datetime import date, timedelta
from decimal import Decimal, InvalidOperation
from importlib import resources
from pathlib import Path
from typing import Any

import providers
from providers import gpus
from providers.base import Offer
from provisioner import catalog_checks
from provisioner.errors import UserError
from provisioner.money import LIMIT
from provisioner.settings import Settings

COLUMNS = [f.name for f in fields(Offer)]
STALE_DAYS = 90  # rows older than this: `plan` and `catalog` say to refresh


class CatalogError(UserError):
    """A catalog file that cannot be read as one: its path and line, one line, exit code 2."""


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
        try:
            header = next(rows, None)
            if header is None:
                return
            index = {name: i for i, name in enumerate(header)}
            missing = [c for c in COLUMNS if c not in index and c not in _OPTIONAL]
            if missing:
                raise CatalogError(f"{path}:1: catalog without column(s) {', '.join(missing)}")
            get = [(c, index.get(c), _CONVERT.get(c, str)) for c in COLUMNS]
            test = keep(index) if keep else None
            for row in rows:
                if test is None or test(row):
                    try:
                        values: dict[str, Any] = {
                            c: conv(row[i]) if i is not None else "" for c, i, conv in get
                        }
                    except (InvalidOperation, ValueError):
                        raise _bad_value(path, rows.line_num, row, get) from None
                    yield Offer(**values)
        except IndexError:  # a row shorter than the header (checked only when it fails: hot path)
            raise CatalogError(
                f"{path}:{rows.line_num}: {len(row)} fields, the header has {len(header or [])}"
            ) from None
        except (UnicodeDecodeError, csv.Error) as e:
            line = rows.line_num + 1 if isinstance(e, UnicodeDecodeError) else rows.line_num
            raise CatalogError(
                f"{path}:{line}: not a catalog (CSV text in UTF-8): {type(e).__name__}: "
                f"{str(e)[:80]}"
            ) from None


def _bad_value(
    path: Path, line: int, row: list[str], get: list[tuple[str, int | None, Callable[[str], Any]]]
) -> CatalogError:
    """The error of a row whose conversion failed: its file, line, column and value."""
    for c, i, conv in get:
        value = row[i] if i is not None else ""
        try:
            conv(value)
        except (InvalidOperation, ValueError) as e:
            ours = isinstance(e, ValueError) and not isinstance(e, InvalidOperation) and str(e)
            why = str(e) if ours else f"{value[:40]!r} is not a number"
            return CatalogError(f"{path}:{line}: column {c}: {why}")
    return CatalogError(f"{path}:{line}: a row that cannot be read")


def _price(value: str) -> Decimal | None:
    if not value:
        return None
    d = Decimal(value)
    if not (d.is_finite() and 0 <= d < LIMIT):
        raise ValueError(f"{value[:40]!r} is not a price (a number, 0 or more)")
    return d


def _int(value: str) -> int:
    return int(value) if value.isdigit() else int(Decimal(value))


def _currency(value: str) -> str:
    if value not in CURRENCIES:
        raise ValueError(
            f"{value[:40]!r} is not a currency this catalog knows ({', '.join(sorted(CURRENCIES))})"
        )
    return value


def _date(value: str) -> str:
    if value and not _ISO_DATE.fullmatch(value):
        raise ValueError(f"{value[:40]!r} is not a date (YYYY-MM-DD)")
    return value


_ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
# ISO 4217 codes of the currencies clouds price in (and neighbours): a typo such as "USd" or
# "RUR" (withdrawn in 1998) is refused rather than priced as an unknown money.
_CODES = "USD EUR GBP CHF JPY CNY KRW INR SGD HKD AUD NZD CAD BRL MXN ZAR AED SAR ILS TRY SEK NOK"
CURRENCIES = frozenset(f"{_CODES} DKK PLN CZK RUB KZT BYN UZS AMD GEL AZN KGS".split(" "))


_CONVERT: dict[str, Callable[[str], Any]] = {
    "gpu_count": _int,
    "gpu_memory_gb": _int,
    "vcpus": _int,
    "memory_gb": Decimal,
    "price": _price,
    "spot_price": _price,
    "currency": _currency,
    "as_of": _date,
}
_OPTIONAL = {"accelerator", "source", "as_of"}


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
                    as_of="",
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


def refresh(
    settings: Settings,
    cloud: str,
    fetched: list[Offer],
    as_of: str = "",
    findings: list[catalog_checks.Finding] | None = None,
) -> Path:
    """Store freshly fetched offers for ``cloud``, dated ``as_of`` (the day they were fetched)
    unless the source dates them. An empty result keeps the old data; an offer the source lists
    without a price keeps the price (and date) the catalog had for it, saying so. The prices
    :mod:`provisioner.catalog_checks` flags are emptied, as the build does, the reason in the
    row's source (and each finding appended to ``findings``)."""
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
                as_of=before.as_of,
            )
        elif not o.as_of:
            o = replace(o, as_of=as_of)
        merged.append(o)
    path = refreshed_path(settings, cloud)
    write_csv(path, _checked(merged, path.name, findings))
    return path


def _checked(
    offers: list[Offer], name: str, findings: list[catalog_checks.Finding] | None
) -> list[Offer]:
    """``offers`` with each price the checks flag emptied, saying why in its source."""
    rows = [
        {c: "" if getattr(o, c) is None else str(getattr(o, c)) for c in COLUMNS} for o in offers
    ]
    found = catalog_checks.check(rows, name)
    for f in found:
        i = f.line - 2
        o = offers[i]
        why = f"{o.source}; {f.field} {f.row[f.field]} emptied: {f.reason}"
        if f.field == "price":
            offers[i] = replace(o, price=None, source=why)
        else:
            offers[i] = replace(o, spot_price=None, source=why)
    if findings is not None:
        findings.extend(found)
    return offers


def stale(offers: Iterable[Offer], today: date) -> list[str]:
    """Per cloud, the priced offers among ``offers`` dated more than :data:`STALE_DAYS` before
    ``today`` (or not dated), in words naming ``catalog refresh``. Simulated clouds and prices
    from settings are not dated by a source: never stale."""
    limit = (today - timedelta(days=STALE_DAYS)).isoformat()
    per_cloud: dict[str, tuple[int, int, str]] = {}  # cloud: old, undated, oldest
    for o in offers:
        if (o.price is None and o.spot_price is None) or "settings" in o.source:
            continue
        if o.cloud in providers.REGISTRY and providers.spec(o.cloud).simulated:
            continue
        if o.as_of and o.as_of >= limit:
            continue
        old, undated, oldest = per_cloud.get(o.cloud, (0, 0, ""))
        if o.as_of:
            per_cloud[o.cloud] = (old + 1, undated, min(oldest or o.as_of, o.as_of))
        else:
            per_cloud[o.cloud] = (old, undated + 1, oldest)
    lines = []
    for cloud, (old, undated, oldest) in sorted(per_cloud.items()):
        parts = [f"{old} priced as of {oldest}, more than {STALE_DAYS} days ago"] if old else []
        parts += [f"{undated} with no date"] if undated else []
        lines.append(
            f"{cloud}: catalog rows used: {' and '.join(parts)}; prices may have changed: "
            f"run `provisioner catalog refresh --cloud {cloud}`"
        )
    return lines


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
