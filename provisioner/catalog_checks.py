"""Checks of catalog prices, each finding located by file, line and row.

``provisioner/data/catalog/build.py`` runs them on every cloud's rows and empties what they flag
(recording why in ``checks.csv``); the tests run them over the shipped CSVs, which must come out
clean. A flagged price is never guessed at: it is emptied, so the planner skips the offer unless
settings price it.

The checks, in the order they run (a price one check flags is not used by the later ones):

- ``spot-only``: GCP sells a3-highgpu-1g/2g/4g as Spot or Flex-start only: no on-demand price.
- ``variant``: a bigger-memory variant (A100-80GB) below its family's base (A100) per card in
  the same region (the source has GCP A100-80GB below A100-40GB in us-central1).
- ``band``: the on-demand price per GPU outside its GPU model's band (:data:`BANDS`). This is
  what catches a wrong price that most regions share, which a median cannot: 6 of the 9 GCP
  H200 rows are ~42 % below the other 3.
- ``outlier``: an on-demand price far from the median of its type's regions (at least 3).
- ``spot``: a spot price not materially below the on-demand one (less than :data:`SPOT_MIN_DISCOUNT`
  off): preemption risk for no discount worth having. Not "strictly below": the source rounds
  spot to 4 decimals and on-demand to 5, so 19.9795 passes as below 19.97951.

Apart from these, :func:`stale` names the rows a plan uses whose prices are older than
:data:`STALE_DAYS` (or not dated), per cloud.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date, timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path

import providers
from providers.base import Offer
from providers.gpus import family

# GCP sells these as Spot / Flex-start only (providers.gcp.prices SHAPES' spot_only; listed here
# so the checks import no cloud's module).
GCP_SPOT_ONLY = frozenset({"a3-highgpu-1g", "a3-highgpu-2g", "a3-highgpu-4g"})

# On-demand price per GPU-hour, USD, per GPU model: (low, high). Derived from the shipped AWS,
# GCP and Azure rows (SkyPilot catalog v8, 2026-11-30) that no other check flags: low = about
# 0.8 × the cheapest list price per card of that model on any of the three clouds, high = about
# 1.25 × the dearest (a small GPU on a big host: g4dn.16xlarge is $6.70 per T4). Cheapest /
# dearest per card in that data: T4 0.53 / 6.70, L4 0.70 / 4.93, A10G 1.01 / 6.31, V100
# 2.58 / 4.38, A100 2.22 / 4.33, A100-80GB 3.43 / 6.20, H100 6.88 / 15.98, H200 7.91 / 10.92.
# H200's low is not derived from its own rows (most GCP H200 rows are the suspect ones): it is
# the cheapest H100 list price per card (AWS p5.48xlarge 55.04 / 8 = 6.88), since no cloud lists
# an H200 (141 GB) below an H100 (80 GB). Other currencies (Yandex's RUB) are not banded.
BANDS: dict[str, tuple[Decimal, Decimal]] = {
    gpu: (Decimal(low), Decimal(high))
    for gpu, low, high in (
        ("T4", "0.40", "8.50"),
        ("L4", "0.55", "6.20"),
        ("A10G", "0.80", "8.00"),
        ("V100", "2.00", "5.50"),
        ("A100", "1.75", "5.50"),
        ("A100-80GB", "2.75", "7.75"),
        ("H100", "5.50", "20.00"),
        ("H200", "6.88", "13.75"),
    )
}
BAND_CURRENCY = "USD"
# What a flagged row of that model should cost instead, where a dated source says it.
BAND_NOTES = {
    "H200": "Google Cloud Billing Catalog API as of 2026-10-13 (Hugging Face dataset "
    "tanod/cloud-gpu-list-prices): a3-ultragpu-8g us-central1 10.4365 USD a card on demand"
}
# An on-demand price this far from its type's median over the regions that sell it is not
# trusted (the source has committed-use prices in some regions: GCP H100 at ~40 % of list).
OUTLIER_LOW, OUTLIER_HIGH = Decimal("0.65"), Decimal("1.8")


@dataclass(frozen=True)
class Finding:
    """One price a check does not trust: where it is, which field, and why."""

    check: str
    file: str
    line: int  # in the CSV, the header being line 1
    row: dict[str, str]
    field: str  # price | spot_price
    reason: str

    @property
    def where(self) -> str:
        r = self.row
        return f"{r['cloud']}/{r['zone'] or r['region']} {r['instance_type']}"

    def __str__(self) -> str:
        value = self.row[self.field]
        return f"{self.file}:{self.line}: {self.where}: {self.field} {value}: {self.reason}"


def check(rows: list[dict[str, str]], file: str = "") -> list[Finding]:
    """Every finding over ``rows`` (the file's rows in order: row i is on line i + 2). The rows
    are not changed; a price flagged by one check is not used by the ones after it."""
    found = _Findings(rows, file)
    for each in (_spot_only, _variants, _bands, _outliers, _spot_above):
        each(found)
    return sorted(found.findings, key=lambda f: (f.line, f.field))


class _Findings:
    """The findings over ``rows`` so far, and the prices they flagged (not used again)."""

    def __init__(self, rows: list[dict[str, str]], file: str) -> None:
        self.rows, self.file = rows, file
        self.findings: list[Finding] = []
        self.flagged: set[tuple[int, str]] = set()

    def value(self, i: int, field: str) -> Decimal | None:
        if (i, field) in self.flagged or not self.rows[i].get(field):
            return None
        try:
            return Decimal(self.rows[i][field])
        except InvalidOperation:
            return None

    def flag(self, name: str, i: int, field: str, reason: str) -> None:
        self.flagged.add((i, field))
        self.findings.append(Finding(name, self.file, i + 2, self.rows[i], field, reason))

    def card(self, i: int) -> Decimal | None:
        price, count = self.value(i, "price"), _count(self.rows[i])
        return price / count if price is not None and count else None


def _spot_only(found: _Findings) -> None:
    for i, r in enumerate(found.rows):
        if r["cloud"] == "gcp" and r["instance_type"] in GCP_SPOT_ONLY and found.value(i, "price"):
            found.flag("spot-only", i, "price", "GCP sells this type as Spot/Flex-start only")


def _variants(found: _Findings) -> None:
    rows, card = found.rows, found.card
    base_card: dict[tuple[str, str, str, str], Decimal] = {}
    for i, r in enumerate(rows):
        c = card(i)
        if c is not None and family(r["gpu"]) == r["gpu"]:
            key = (r["cloud"], r["region"], r["gpu"], r["currency"])
            base_card[key] = min(c, base_card.get(key, c))
    for i, r in enumerate(rows):
        fam, c = family(r["gpu"]), card(i)
        base = base_card.get((r["cloud"], r["region"], fam, r["currency"]))
        if c is not None and fam != r["gpu"] and base is not None and c < base:
            found.flag("variant", i, "price", f"{c:.4f} a card, below the {fam}'s {base:.4f} here")


def _bands(found: _Findings) -> None:
    for i, r in enumerate(found.rows):
        band, c = BANDS.get(r["gpu"]), found.card(i)
        if band and c is not None and r["currency"] == BAND_CURRENCY:
            low, high = band
            if not low <= c <= high:
                found.flag(
                    "band",
                    i,
                    "price",
                    f"{c:.4f} {BAND_CURRENCY} a card, outside the {r['gpu']} band {low}-{high}"
                    + (f"; {BAND_NOTES[r['gpu']]}" if r["gpu"] in BAND_NOTES else ""),
                )


def _shape(r: dict[str, str]) -> tuple[str, ...]:
    # an n1 host carries T4s or V100s; the sandbox prices one region in RUB
    return r["cloud"], r["instance_type"], r["gpu"], str(r["gpu_count"]), r["currency"]


def _outliers(found: _Findings) -> None:
    rows, value = found.rows, found.value
    by_shape: dict[tuple[str, ...], dict[str, Decimal]] = {}
    for i, r in enumerate(rows):
        p = value(i, "price")
        if p is not None:
            by_shape.setdefault(_shape(r), {})[r["region"]] = p
    for i, r in enumerate(rows):
        regions, p = by_shape.get(_shape(r), {}), value(i, "price")
        if p is None or len(regions) < 3:
            continue
        values = sorted(regions.values())
        median = values[len(values) // 2]
        ratio = p / median
        if not OUTLIER_LOW <= ratio <= OUTLIER_HIGH:
            found.flag(
                "outlier",
                i,
                "price",
                f"{ratio:.2f}x the median {median} of its {len(values)} regions",
            )


#: Spot is kept only when it is at least this much below on-demand. Below 5 % off, a machine
#: that may be taken back at two minutes' notice (AWS) or thirty seconds' (GCP, Azure) saves
#: less than one lost hour in twenty costs; the planner would still choose it as "cheapest".
#: In the shipped data the spot discounts are either >= 10 % (2,082 rows) or under 5 % (20
#: AWS rows, 14 of them the same price rounded to 4 decimals): the line falls in the gap.
SPOT_MIN_DISCOUNT = Decimal("0.05")


def _spot_above(found: _Findings) -> None:
    for i, r in enumerate(found.rows):
        spot, price = found.value(i, "spot_price"), found.value(i, "price")
        if spot is None or price is None or spot < price * (1 - SPOT_MIN_DISCOUNT):
            continue
        if spot >= price:
            what = "equal to" if spot == price else "above"
            why = f"{what} the on-demand price {r['price']}: no discount"
        else:
            off = ((price - spot) / price * 100).quantize(Decimal("0.01"))
            why = (
                f"{off}% below the on-demand price {r['price']}: less than "
                f"{SPOT_MIN_DISCOUNT * 100:.0f}% off, no discount worth a preemption"
            )
        found.flag("spot", i, "spot_price", why)


def check_file(path: Path) -> list[Finding]:
    with path.open(newline="", encoding="utf-8") as f:
        return check(list(csv.DictReader(f)), path.name)


def summary(findings: Iterable[Finding]) -> dict[str, int]:
    """Findings per check."""
    counts: dict[str, int] = {}
    for f in findings:
        counts[f.check] = counts.get(f.check, 0) + 1
    return counts


def _count(r: dict[str, str]) -> int:
    try:
        return int(Decimal(str(r["gpu_count"])))
    except InvalidOperation:
        return 0


STALE_DAYS = 90  # rows older than this: `plan` and `catalog` say to refresh


def stale(offers: Iterable[Offer], today: date) -> list[str]:
    """Per cloud, the priced offers among ``offers`` dated more than :data:`STALE_DAYS` before
    ``today`` (or not dated), in words naming ``catalog refresh``. Simulated clouds and prices
    from settings are not dated by a source: never stale."""
    limit = (today - timedelta(days=STALE_DAYS)).isoformat()
    per_cloud: dict[str, tuple[int, int, str]] = {}  # cloud: old, undated, oldest
    for o in offers:
        if not _dated_by_source(o) or (o.as_of and o.as_of >= limit):
            continue
        old, undated, oldest = per_cloud.get(o.cloud, (0, 0, ""))
        if o.as_of:
            per_cloud[o.cloud] = (old + 1, undated, min(oldest or o.as_of, o.as_of))
        else:
            per_cloud[o.cloud] = (old, undated + 1, oldest)
    return [_stale_line(cloud, *counts) for cloud, counts in sorted(per_cloud.items())]


def _dated_by_source(o: Offer) -> bool:
    """A priced offer of a real cloud, its price not from settings."""
    if (o.price is None and o.spot_price is None) or "settings" in o.source:
        return False
    return not (o.cloud in providers.REGISTRY and providers.spec(o.cloud).simulated)


def _stale_line(cloud: str, old: int, undated: int, oldest: str) -> str:
    """One cloud's stale rows in words: how many are old (and the oldest date), how many have
    no date."""
    parts = [f"{old} priced as of {oldest}, more than {STALE_DAYS} days ago"] if old else []
    parts += [f"{undated} with no date"] if undated else []
    return (
        f"{cloud}: catalog rows used: {' and '.join(parts)}; prices may have changed: "
        f"run `provisioner catalog refresh --cloud {cloud}`"
    )
