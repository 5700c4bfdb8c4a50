"""Offers: shipped with the package as CSV files (so ``plan`` works offline), replaced per cloud by
``provisioner catalog refresh`` (written to the data directory), completed by price overrides
from settings."""

from __future__ import annotations

import csv
import marshal
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields, replace
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
            get = _columns(path, header)
            test = keep({name: i for i, name in enumerate(header)}) if keep else None
            for row in rows:
                if test is None or test(row):
                    yield _offer(path, rows.line_num, row, get)
        except IndexError:  # a row shorter than the header (checked only when it fails: hot path)
            raise _short(path, rows.line_num, row, header) from None
        except (UnicodeDecodeError, csv.Error) as e:
            raise _unreadable(path, rows.line_num, e) from None


Columns = list[tuple[str, int | None, Callable[[str], Any]]]


def _columns(path: Path, header: list[str]) -> Columns:
    """(column, its position in ``header``, its conversion) for each field of an offer."""
    index = {name: i for i, name in enumerate(header)}
    missing = [c for c in COLUMNS if c not in index and c not in _OPTIONAL]
    if missing:
        raise CatalogError(f"{path}:1: catalog without column(s) {', '.join(missing)}")
    return [(c, index.get(c), _CONVERT.get(c, str)) for c in COLUMNS]


def _offer(path: Path, line: int, row: list[str], get: Columns) -> Offer:
    try:
        values: dict[str, Any] = {c: conv(row[i]) if i is not None else "" for c, i, conv in get}
    except (InvalidOperation, ValueError):
        raise _bad_value(path, line, row, get) from None
    return Offer(**values)


def _short(path: Path, line: int, row: list[str], header: list[str] | None) -> CatalogError:
    return CatalogError(f"{path}:{line}: {len(row)} fields, the header has {len(header or [])}")


def _unreadable(path: Path, line: int, e: Exception) -> CatalogError:
    line = line + 1 if isinstance(e, UnicodeDecodeError) else line
    return CatalogError(
        f"{path}:{line}: not a catalog (CSV text in UTF-8): {type(e).__name__}: {str(e)[:80]}"
    )


def _bad_value(path: Path, line: int, row: list[str], get: Columns) -> CatalogError:
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
        keep = _Keep(settings, cloud, gpu_family, gpu_count, offers)
        refreshed = gpu_family is not None and path == refreshed_path(settings, cloud)
        for o in _read_indexed(path, keep) if refreshed else _read(path, keep):
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


class _Keep:
    """The raw-row test for one cloud's file: inside the places settings enable (one answer
    per place), of ``gpu_family`` and ``gpu_count`` (other rows counted on ``offers``).
    Called with the header's column positions, it gives the test of a row (:data:`Keep`)."""

    def __init__(
        self,
        settings: Settings,
        cloud: str,
        gpu_family: str | None,
        gpu_count: int | None,
        offers: Offers,
    ) -> None:
        self.options = settings.cloud(cloud) or providers.spec(cloud).options()
        self.cloud, self.family, self.count, self.offers = cloud, gpu_family, gpu_count, offers
        self.places: dict[tuple[str, str], bool] = {}

    def allowed(self, region: str, zone: str) -> bool:
        place = (region, zone)
        allowed = self.places.get(place)
        if allowed is None:
            allowed = self.places[place] = self.options.allows(region, zone)
        return allowed

    def skip(self, reason: str, n: int, example: str) -> None:
        self.offers.skipped[reason] += n
        self.offers.examples.setdefault(reason, f"{self.cloud}/{example}")

    def __call__(self, at: dict[str, int]) -> Callable[[list[str]], bool]:
        region, zone, gpu, itype = at["region"], at["zone"], at["gpu"], at["instance_type"]
        count = at["gpu_count"]
        gpu_family, gpu_count, places = self.family, self.count, self.places
        families: dict[str, str] = {}

        def keep(row: list[str]) -> bool:
            allowed = places.get((row[region], row[zone]))
            if allowed is None:
                allowed = self.allowed(row[region], row[zone])
            if not allowed:
                return False
            if gpu_family is None:
                return True
            fam = families.get(row[gpu])
            if fam is None:
                fam = families[row[gpu]] = gpus.family(row[gpu])
            if fam != gpu_family:
                self.skip(OTHER_GPU, 1, f"{row[zone] or row[region]} {row[itype]}")
                return False
            if gpu_count is not None and _int(row[count]) != gpu_count:
                self.skip(OTHER_COUNT, 1, f"{row[zone] or row[region]} {row[itype]}")
                return False
            return True

        return keep


# A refreshed catalog's index, beside it (``.aws.csv.index``): its rows by GPU name, and per GPU
# name and place the rows' count, first line and an example, valid while the file's size,
# modification time and inode are those it was made from. ``plan`` reads the index and the rows
# of the asked GPU family only (a 100,000-row catalog: ~0.3 s of CSV to ~0.05 s). ``catalog
# refresh`` makes it; after an edit by hand, the first plan does, as Python writes bytecode.
_INDEX_FORMAT = 1
_MAGIC = b"PVCATIX\n"
Places = dict[str, list[tuple[str, str, int, int, str]]]  # gpu: region, zone, rows, line, e.g.


def _read_indexed(path: Path, keep: _Keep) -> Iterator[Offer]:
    """What ``_read(path, keep)`` gives, from the index: the same offers in the same order,
    the same counts and examples of the rows turned down."""
    header, places, rows_of = _index(path)
    if not header:
        return
    get = _columns(path, header)
    wanted = [g for g in places if gpus.family(g) == keep.family]
    turned = _Turned()
    turned.other_gpus(places, wanted, keep)
    kept = _of_count(path, [r for g in wanted for r in rows_of(g)], keep, get, header, turned)
    turned.tell(keep)
    for line, row in kept:
        yield _offer(path, line, row, get)


class _Turned(dict[str, tuple[int, int, str]]):
    """Rows turned down, by reason: how many, and the line and example of the file's first."""

    def skip(self, reason: str, n: int, line: int, example: str) -> None:
        count, first, e = self.get(reason, (0, line + 1, ""))
        self[reason] = (count + n, *((line, example) if line < first else (first, e)))

    def other_gpus(self, places: Places, wanted: list[str], keep: _Keep) -> None:
        """The rows of the GPU names not ``wanted``, in allowed places, from the index."""
        for g, at_places in places.items():
            if g in wanted:
                continue
            for r, z, n, line, e in at_places:
                if keep.allowed(r, z):
                    self.skip(OTHER_GPU, n, line, e)

    def tell(self, keep: _Keep) -> None:
        """Count the rows turned down on the offers, reason by reason in the file's order."""
        for reason in sorted(self, key=lambda r: self[r][1:]):  # counted in the file's order
            keep.skip(reason, self[reason][0], self[reason][2])


def _of_count(
    path: Path,
    rows: list[tuple[int, list[str]]],
    keep: _Keep,
    get: Columns,
    header: list[str],
    turned: _Turned,
) -> list[tuple[int, list[str]]]:
    """Of ``rows``, in the file's order, those in an allowed place with the GPU count asked
    (any when none is); the others of an allowed place are ``turned`` down."""
    at = {name: i for i, name in enumerate(header)}
    region, zone, itype, count = at["region"], at["zone"], at["instance_type"], at["gpu_count"]
    kept = []
    for line, row in sorted(rows):
        if not keep.allowed(row[region], row[zone]):
            continue
        try:
            other = keep.count is not None and _int(row[count]) != keep.count
        except (InvalidOperation, ValueError):
            raise _bad_value(path, line, row, get) from None
        if other:
            turned.skip(OTHER_COUNT, 1, line, f"{row[zone] or row[region]} {row[itype]}")
        else:
            kept.append((line, row))
    return kept


def _index(
    path: Path,
) -> tuple[list[str], Places, Callable[[str], list[tuple[int, list[str]]]]]:
    """(header, places, the rows of a GPU name with their lines) of a refreshed catalog, from
    its index when it is the file's, else read from the file (and the index written)."""
    st = path.stat()
    stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
    index = path.with_name(f".{path.name}.index")
    try:
        with index.open("rb") as f:
            head = f.read(16)
            size = int.from_bytes(head[8:], "little")
            if head[:8] != _MAGIC or size > os.fstat(f.fileno()).st_size:
                raise ValueError("not an index")
            form, made_from, header, places, spans = marshal.loads(f.read(size))
        if (form, made_from) == (_INDEX_FORMAT, stamp):

            def rows_of(gpu: str) -> list[tuple[int, list[str]]]:
                start, length = spans[gpu]
                with index.open("rb") as g:
                    g.seek(16 + size + start)
                    rows: list[tuple[int, list[str]]] = marshal.loads(g.read(length))
                return rows

            return header, places, rows_of
    except (OSError, EOFError, ValueError, TypeError):  # none, or not of this format: made again
        pass
    header, places, by_gpu = _scan(path)
    _write_index(index, stamp, header, places, by_gpu)
    return header, places, by_gpu.__getitem__


def _scan(path: Path) -> tuple[list[str], Places, dict[str, list[tuple[int, list[str]]]]]:
    """Every row of a catalog file by GPU name, with its line, and the places of each GPU."""
    counts: dict[tuple[str, str, str], list[Any]] = {}
    by_gpu: dict[str, list[tuple[int, list[str]]]] = {}
    header: list[str] = []
    with path.open(newline="", encoding="utf-8") as f:
        rows = csv.reader(f)
        try:
            header = next(rows, [])
            if not header:
                return [], {}, {}
            _columns(path, header)
            at = {name: i for i, name in enumerate(header)}
            region, zone, gpu, itype = at["region"], at["zone"], at["gpu"], at["instance_type"]
            width = len(header)
            for row in rows:
                if len(row) < width:
                    raise IndexError
                row = [sys.intern(v) for v in row]  # repeated values: stored and loaded once
                line = rows.line_num
                key = (row[gpu], row[region], row[zone])
                c = counts.get(key)
                if c is None:
                    counts[key] = [1, line, f"{row[zone] or row[region]} {row[itype]}"]
                else:
                    c[0] += 1
                by_gpu.setdefault(row[gpu], []).append((line, row))
        except IndexError:
            raise _short(path, rows.line_num, row, header) from None
        except (UnicodeDecodeError, csv.Error) as e:
            raise _unreadable(path, rows.line_num, e) from None
    return header, _places(counts), by_gpu


def _places(counts: dict[tuple[str, str, str], list[Any]]) -> Places:
    """Per GPU name, each place's rows: (region, zone, rows, first line, example)."""
    places: Places = {}
    for (g, r, z), (n, line, example) in counts.items():
        places.setdefault(g, []).append((r, z, n, line, example))
    return places


def _write_index(
    index: Path,
    stamp: tuple[int, int, int],
    header: list[str],
    places: Places,
    by_gpu: dict[str, list[tuple[int, list[str]]]],
) -> None:
    """Written whole or not at all; a directory it cannot be written to only costs speed."""
    blobs = {g: marshal.dumps(rows) for g, rows in by_gpu.items()}
    spans, at = {}, 0
    for g, blob in blobs.items():
        spans[g] = (at, len(blob))
        at += len(blob)
    try:
        fd, tmp = tempfile.mkstemp(dir=index.parent, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            meta = marshal.dumps((_INDEX_FORMAT, stamp, header, places, spans))
            f.write(_MAGIC + len(meta).to_bytes(8, "little") + meta)
            for blob in blobs.values():
                f.write(blob)
        os.replace(tmp, index)
    except OSError:
        os.unlink(tmp)


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
    _index(path)  # made here, so the first plan after a refresh does not pay for it
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
    row = _address_row(cloud, currency)
    billed = row.get("billed") or "running"
    own = providers.spec(cloud).currency if cloud in providers.REGISTRY else currency
    if cloud in settings.address_prices and currency == own:  # set in the cloud's own currency
        billed = "running" if billed == "free" else billed
        return AddressPrice(settings.address_prices[cloud], billed, "settings")
    if not row.get("price_hour") or row.get("currency") != currency:
        return AddressPrice(None, billed, row.get("source") or "unknown")
    return AddressPrice(Decimal(row["price_hour"]), billed, row["source"])


def _address_row(cloud: str, currency: str) -> dict[str, str]:
    """The shipped ``addresses.csv`` row of ``cloud`` in ``currency``, else its first row in
    any currency ({}: none)."""
    with _shipped("addresses").open(newline="", encoding="utf-8") as f:
        rows = {(r["cloud"], r["currency"]): r for r in csv.DictReader(f)}
    return rows.get((cloud, currency)) or next((r for (c, _), r in rows.items() if c == cloud), {})


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
