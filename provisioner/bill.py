"""``provisioner bill``: the ledger set beside each cloud's own bill.

Each cloud's billing source (``providers/<cloud>/billing.py``) returns billed line items tagged
with our machine id; here they meet the ledger's spend per machine and day. A row's difference
(billed − ledger) is split exactly into its reasons, which add up to it:

- ``tax``, ``credit`` (credits, refunds, discounts): lines of the bill that are not usage;
- ``unpriced``: billed pieces of our machines the ledger does not price (a public IPv4
  address, egress);
- ``untagged``: usage that carries no machine tag, or one the ledger does not know;
- ``not_billed_yet``: ledger spend on days after the bill is complete (each cloud's lag);
- ``drift``: what is left, billed usage of our machines against the ledger on billed days —
  a price that moved since launch, or usage the ledger did not see.

Drift of a price (issue #25, point 2): where the billed unit price of an instance type differs
from today's catalog by more than :data:`DRIFT_PCT`, the row is listed and
``provisioner catalog refresh`` fixes it. The last fetch of each cloud is kept as a small JSON
file in the home (:func:`last_fetch`) for the dashboard's spend page.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

from sqlalchemy import or_, select

import providers
from providers.base import AuthError, ProviderError
from providers.billing import KINDS, Bill, BillingUnsupported
from provisioner.app import App
from provisioner.errors import OperationFailed, UserError
from provisioner.ledger import Period, midnight
from provisioner.ledger.periods import SECONDS_PER_HOUR
from provisioner.models import Machine, UsageInterval
from provisioner.money import CENT, Money, allocate
from provisioner.schema import UsageKind

DRIFT_PCT = Decimal(2)
UNIT_STEP = Decimal("0.0001")  # unit prices per hour: to 1/100 of a cent
BY = ("machine", "project", "day")
REASONS = ("credit", "tax", "unpriced", "drift", "not_billed_yet", "untagged")
UNTAGGED = "(untagged)"
_DAY = timedelta(days=1)


@dataclass
class Line:
    """One row: a machine, project or day, in one currency."""

    key: str
    currency: str
    ledger: Decimal = Decimal(0)
    billed: Decimal = Decimal(0)
    reasons: dict[str, Decimal] = field(default_factory=lambda: defaultdict(Decimal))

    @property
    def difference(self) -> Decimal:
        return self.billed - self.ledger


@dataclass(frozen=True)
class Drift:
    """A billed unit price off today's catalog by more than :data:`DRIFT_PCT`."""

    machine: str
    region: str
    instance_type: str
    market: str
    currency: str
    catalog: Decimal
    billed: Decimal  # per hour
    hours: Decimal
    launched_at: Decimal | None  # the ledger's rate, fixed at launch

    @property
    def pct(self) -> Decimal:
        return (self.billed - self.catalog) / self.catalog * 100

    @property
    def unit_price(self) -> Money:
        """The billed price per hour as shown: to 1/100 of a cent, half up (a unit price, not
        an amount: cents would hide the drift)."""
        return Money(self.billed.quantize(UNIT_STEP, ROUND_HALF_UP), self.currency)


@dataclass
class CloudBill:
    cloud: str
    source: str
    lag: str
    through: date | None
    lines: list[Line]
    drift: list[Drift]
    notes: list[str]


@dataclass
class BillReport:
    period: Period
    by: str
    clouds: list[CloudBill]
    unsupported: dict[str, str]  # cloud → why it has no billing source here
    skipped: dict[str, str] = field(default_factory=dict)  # cloud → its missing credentials

    def as_json(self) -> dict[str, Any]:
        return {
            "period": self.period.label,
            "by": self.by,
            "clouds": [_cloud_json(c) for c in self.clouds],
            "unsupported": self.unsupported,
            "skipped": self.skipped,
        }


def bill(app: App, period_text: str | None, cloud: str | None, by: str) -> BillReport:
    """The bill of ``cloud`` (every enabled cloud with a billing source when None) for the
    period, reconciled with the ledger. A named cloud without a source is a UserError."""
    if by not in BY:
        raise UserError(f"--by: {by!r} is not one of {', '.join(BY)}")
    now = app.clock.now()
    try:
        period = Period.parse(period_text) if period_text else Period.month(now)
    except ValueError as e:
        raise UserError(f"--period: {e}") from None
    fetched, unsupported, skipped = _fetch_all(app, _clouds(app, cloud), period, now)
    if cloud and (cloud in unsupported or cloud in skipped):
        raise UserError(unsupported.get(cloud) or skipped[cloud])
    out = []
    for got in fetched:  # every bill checked (_fetch) before anything is stored
        cb = reconcile(app, period, got, by)
        _remember(app, period, cb)
        out.append(cb)
    return BillReport(period, by, out, unsupported, skipped)


def _fetch_all(
    app: App, names: list[str], period: Period, now: datetime
) -> tuple[list[Bill], dict[str, str], dict[str, str]]:
    """Each cloud's bill; the clouds with no billing source, and those without credentials
    (skipped: with every cloud enabled, one without credentials stops no other), with why."""
    fetched, unsupported, skipped = [], {}, {}
    for name in names:
        try:
            fetched.append(_fetch(app, name, period, now))
        except BillingUnsupported as e:
            unsupported[name] = str(e)
        except Uncredentialed as e:
            skipped[name] = str(e)
    return fetched, unsupported, skipped


def _clouds(app: App, cloud: str | None) -> list[str]:
    """``--cloud``'s cloud, else every enabled one but the sandbox."""
    if cloud and cloud not in providers.ALL:
        raise UserError(f"--cloud: unknown cloud {cloud!r} (one of {', '.join(providers.ALL)})")
    return [cloud] if cloud else [c for c in app.settings.enabled_clouds if c != "sandbox"]


def _fetch(app: App, name: str, period: Period, now: datetime) -> Bill:
    """Cloud ``name``'s bill of ``period`` up to tomorrow; BillingUnsupported: it has none to
    read (a simulated cloud, no source, or none configured)."""
    if providers.spec(name).simulated:
        raise BillingUnsupported(f"{name}: a simulated cloud sends no bill")
    fetch = providers.billing_source(name)
    start, end = period.start.date(), min(period.end, now + _DAY).date()
    end = max(end, start + _DAY)
    provider = app.provider(name)
    if missing := provider.missing_setup():  # judged without a call
        raise Uncredentialed(missing)
    try:  # BillingUnsupported, e.g. GCP without its export table named: goes up
        got = fetch(provider, start, end)
    except AuthError as e:
        raise Uncredentialed(str(e)) from None
    except ProviderError as e:
        raise OperationFailed(f"{name}: reading the bill failed: {e}") from None
    except MALFORMED as e:  # a field missing, not a number, not a date: the reader's
        raise _malformed(name, f"{type(e).__name__}: {e}") from None
    check(got, start, end)
    return got


#: what a bill reader raises on an answer it cannot read (a key or a group missing, text
#: where a number or a date goes, a number Decimal cannot hold)
MALFORMED = (KeyError, IndexError, TypeError, ValueError, AttributeError, ArithmeticError)
MAX_AMOUNT = Decimal(10) ** 12  # one day's line of one thing: no bill holds more
MAX_HOURS = Decimal(10) ** 6


class Uncredentialed(Exception):
    """A cloud whose bill cannot be asked for: no credentials, or refused ones."""


def _malformed(cloud: str, why: str) -> OperationFailed:
    why = " ".join(why.split())
    why = why if len(why) <= 120 else why[:119] + "…"
    return OperationFailed(f"{cloud}: the bill's answer is malformed ({why}); nothing was stored")


def check(got: Bill, start: date, end: date) -> None:
    """Every field of every billed line as the ledger needs it, else one line naming the first
    that is not: a finite amount within reason, a currency code, a day of the period asked
    [start, end), a known kind, usage hours finite and not negative."""
    for i in got.items:
        if why := _bad_field(i, start, end):
            where = f"the line of {getattr(i, 'day', '?')} {getattr(i, 'what', '')!r}"
            raise _malformed(got.cloud, f"{where}: {why}")


def _bad_field(i: Any, start: date, end: date) -> str | None:
    """What is wrong with one billed line's fields (None: nothing)."""
    amount, hours = getattr(i, "amount", None), getattr(i, "usage_hours", None)
    checks = (
        (_finite(amount, MAX_AMOUNT, signed=True), f"amount {amount!s} is not an amount"),
        (isinstance(i.currency, str) and re.fullmatch(r"[A-Z]{3}", i.currency) is not None,
         f"currency {i.currency!r} is not a code"),
        (isinstance(i.day, date) and start <= i.day < end, f"day {i.day} is not in {start}…{end}"),
        (i.kind in KINDS, f"kind {i.kind!r} is not one of the ledger's"),
        (hours is None or _finite(hours, MAX_HOURS, signed=False),
         f"usage hours {hours!s} are not hours"),
    )  # fmt: skip
    return next((why for ok, why in checks if not ok), None)


def _finite(value: Any, bound: Decimal, *, signed: bool) -> bool:
    """A Decimal, finite, below ``bound`` in size (and not negative unless ``signed``)."""
    if not isinstance(value, Decimal) or not value.is_finite():
        return False
    return abs(value) < bound if signed else 0 <= value < bound


# --- the ledger beside the bill ------------------------------------------------------------


def reconcile(app: App, period: Period, got: Bill, by: str) -> CloudBill:
    now = app.clock.now()
    through = got.through(now.date())
    machines, intervals = _ledger_rows(app, period, got.cloud)
    lines = _Lines(by)
    # the ledger, per machine and day, up to now
    billed_hours: dict[str, Decimal] = defaultdict(Decimal)  # machine → compute hours billed
    for iv in intervals:
        _ledger(lines, machines[iv.machine_id], iv, period, now, through, billed_hours)
    # the bill
    usage: dict[tuple[str, str], list[Any]] = defaultdict(list)  # (machine, type) → items
    by_instance = {m.instance_id: m for m in machines.values() if m.instance_id}
    for item in got.items:
        owner = _owner(machines, by_instance, item)
        _billed(lines.line(owner, item.machine, item.day, item.currency), item, owner, through)
        if owner is not None and item.kind == "compute" and _drifts(item, through):
            usage[(owner.id, item.instance_type or owner.instance_type or "")].append(item)
    drift = _drift(app, got.cloud, machines, usage, billed_hours)
    ordered = sorted(lines.lines.values(), key=lambda ln: (ln.currency, ln.key == UNTAGGED, ln.key))
    return CloudBill(got.cloud, got.source, got.lag, through, ordered, drift, got.notes)


def _ledger_rows(
    app: App, period: Period, cloud: str
) -> tuple[dict[str, Machine], list[UsageInterval]]:
    """The cloud's machines by id, and their usage intervals that overlap ``period``: plain
    objects, out of the session."""
    with app.db.session() as s:
        machines = {m.id: m for m in s.scalars(select(Machine).where(Machine.cloud == cloud))}
        intervals = list(
            s.scalars(
                select(UsageInterval).where(
                    UsageInterval.machine_id.in_(list(machines)),
                    UsageInterval.started_at < period.end,
                    or_(UsageInterval.ended_at.is_(None), UsageInterval.ended_at > period.start),
                )
            )
        )
        s.expunge_all()  # plain objects from here: the session commits (and expires) on exit
    return machines, intervals


class _Lines:
    """The report's lines by key (``by``: day, machine or project) and currency."""

    def __init__(self, by: str) -> None:
        self.by = by
        self.lines: dict[tuple[str, str], Line] = {}

    def line(self, m: Machine | None, tag: str | None, day: date, currency: str) -> Line:
        key = self.key_of(m, tag, day)
        return self.lines.setdefault((key, currency), Line(key, currency))

    def key_of(self, m: Machine | None, tag: str | None, day: date) -> str:
        if self.by == "day":
            return day.isoformat()
        if m is None:
            return UNTAGGED if tag is None else f"{tag} (not in the ledger)"
        return m.name if self.by == "machine" else m.project


def _ledger(
    lines: _Lines,
    m: Machine,
    iv: UsageInterval,
    period: Period,
    now: datetime,
    through: date | None,
    billed_hours: dict[str, Decimal],
) -> None:
    """A usage interval's cost on the lines of each of its days in ``period`` up to ``now``: to
    be billed (drift when the bill has the day whole), or not billed yet; a compute interval's
    hours billed into ``billed_hours``."""
    for day in period.days():
        lo = max(iv.started_at, midnight(day), period.start)
        hi = min(iv.ended_at or now, midnight(day + _DAY), period.end, now)
        if hi <= lo:
            continue
        hours = Decimal((hi - lo) // timedelta(microseconds=1)) / 1_000_000 / SECONDS_PER_HOUR
        cost = iv.rate * hours
        ln = lines.line(m, m.id, day, iv.currency)
        ln.ledger += cost
        if through is not None and day <= through:
            ln.reasons["drift"] -= cost
            if iv.kind == UsageKind.COMPUTE:
                billed_hours[m.id] += hours
        else:
            ln.reasons["not_billed_yet"] -= cost


def _owner(
    machines: dict[str, Machine], by_instance: dict[str, Machine], item: Any
) -> Machine | None:
    """The machine a bill's item is of: by its tag, else (untagged) by its resource id."""
    owner = machines.get(item.machine) if item.machine else None
    if owner is None and item.machine is None and item.resource_id:
        owner = by_instance.get(item.resource_id)
    return owner


def _drifts(item: Any, through: date | None) -> bool:
    """Whether a bill's item is of a day the bill has whole (its difference: drift)."""
    return through is not None and item.day <= through


def _billed(ln: Line, item: Any, owner: Machine | None, through: date | None) -> None:
    """A bill's item on its line, with the reason it differs from the ledger."""
    ln.billed += item.amount
    if item.kind in ("tax",):
        ln.reasons["tax"] += item.amount
    elif item.kind in ("credit", "discount"):
        ln.reasons["credit"] += item.amount
    elif owner is None:
        ln.reasons["untagged"] += item.amount
    elif item.kind == "other":
        ln.reasons["unpriced"] += item.amount
    elif not _drifts(item, through):  # a day the bill has only in part
        ln.reasons["not_billed_yet"] += item.amount
    else:
        ln.reasons["drift"] += item.amount


def _drift(
    app: App,
    cloud: str,
    machines: dict[str, Machine],
    usage: dict[tuple[str, str], list[Any]],
    ledger_hours: dict[str, Decimal],
) -> list[Drift]:
    """Billed unit prices more than DRIFT_PCT off today's catalog. The unit price is the billed
    cost over the billed hours where the source gives usage, else over the ledger's hours."""
    from provisioner import catalog

    offers = catalog.load(app.settings, [cloud]) if usage else []
    out = []
    for (mid, itype), items in sorted(usage.items()):
        m = machines[mid]
        cost = sum((i.amount for i in items), Decimal(0))
        hours = _billed_hours(items, ledger_hours.get(mid, Decimal(0)))
        listed = _catalog_price(offers, m, itype, items[0].currency)
        if not hours or listed is None or not listed:
            continue
        unit = cost / hours
        d = Drift(
            m.name,
            m.region or "",
            itype,
            m.market or "",
            items[0].currency,
            listed,
            unit,
            hours,
            m.rate,
        )
        if abs(d.pct) > DRIFT_PCT:
            out.append(d)
    return out


def _billed_hours(items: list[Any], ledger: Decimal) -> Decimal:
    """The hours the items bill, where the source gives usage for each; else the ledger's."""
    given = [i.usage_hours for i in items]
    if all(h is not None for h in given):
        return sum((h for h in given if h is not None), Decimal(0))
    return ledger


def _catalog_price(offers: Any, m: Machine, itype: str, currency: str) -> Decimal | None:
    spot = m.market == "spot"
    prices = [
        o.spot_price if spot else o.price
        for o in offers
        if o.region == m.region
        and o.instance_type == itype
        and o.currency == currency
        and (not o.zone or not m.zone or o.zone == m.zone)
    ]
    known = [p for p in prices if p is not None]
    return min(known) if known else None


# --- rounding for people ---------------------------------------------------------------------


def rounded(lines: list[Line]) -> list[dict[str, Any]]:
    """The lines to the cent, per currency, so that the rounded lines add up to the rounded
    total (largest remainder, :func:`provisioner.money.allocate`); each line's reasons add up
    to its rounded difference where they can. Each amount is a :class:`Money` (whole cents)."""
    out: list[dict[str, Any]] = []
    for cur in sorted({ln.currency for ln in lines}):
        group = [ln for ln in lines if ln.currency == cur]
        billed = allocate([ln.billed for ln in group])
        ledger = allocate([ln.ledger for ln in group])
        for ln, b, led in zip(group, billed, ledger, strict=True):
            parts = [ln.reasons.get(r, Decimal(0)) for r in REASONS]
            shares = _signed_allocate(parts, b - led)
            out.append(
                {
                    "key": ln.key,
                    "currency": cur,
                    "billed": Money(b, cur),
                    "ledger": Money(led, cur),
                    "difference": Money(b - led, cur),
                    "reasons": {
                        r: Money(v, cur) for r, v in zip(REASONS, shares, strict=True) if v
                    },
                }
            )
    return out


def totals(rows: list[dict[str, Any]]) -> dict[str, dict[str, Money]]:
    """Per currency: the rounded lines' sums (equal to the rounded totals by construction)."""
    out: dict[str, dict[str, Money]] = {}
    for r in rows:
        cur = r["currency"]
        t = out.setdefault(cur, {k: Money.zero(cur) for k in ("billed", "ledger", "difference")})
        for k in t:
            t[k] += r[k]
    return out


def _signed_allocate(parts: list[Decimal], total: Decimal) -> list[Decimal]:
    """``parts`` (of either sign) to the cent, adding up to ``total``: each rounded half up,
    then the cents still missing (or over) moved one at a time onto the nonzero parts that
    rounding moved furthest the other way."""
    out = [p.quantize(CENT, ROUND_HALF_UP) for p in parts]
    missing = int((total - sum(out, Decimal(0))) / CENT)
    live = [i for i, p in enumerate(parts) if p]
    if not live:
        return out
    order = sorted(live, key=lambda i: parts[i] - out[i], reverse=missing > 0)
    step = CENT if missing > 0 else -CENT
    for n in range(abs(missing)):
        out[order[n % len(order)]] += step
    return out


# --- the last fetch, for the dashboard -------------------------------------------------------


def _cache(app: App) -> Path:
    return app.settings.home / "bill"


def _remember(app: App, period: Period, cb: CloudBill) -> None:
    rows = rounded(cb.lines)
    data = {
        "cloud": cb.cloud,
        "period": period.label,
        "through": cb.through.isoformat() if cb.through else None,
        "fetched_at": app.clock.now().astimezone(UTC).isoformat(),
        # whole cents, as the spend page shows them ("190.80")
        "totals": {c: {k: str(v.amount) for k, v in t.items()} for c, t in totals(rows).items()},
    }
    path = _cache(app)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f".{cb.cloud}.json.tmp"
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path / f"{cb.cloud}.json")


def last_fetch(app: App, period_label: str) -> list[dict[str, Any]]:
    """What the last ``provisioner bill`` fetched per cloud for ``period_label`` (the month the
    dashboard shows), newest first; [] when bill was never run for it."""
    path = _cache(app)
    out = []
    for f in sorted(path.glob("*.json")) if path.is_dir() else []:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if data.get("period") == period_label:
            out.append(data)
    return out


# --- JSON --------------------------------------------------------------------------------------


def _cloud_json(c: CloudBill) -> dict[str, Any]:
    rows = rounded(c.lines)
    return {
        "cloud": c.cloud,
        "source": c.source,
        "lag": c.lag,
        "through": c.through.isoformat() if c.through else None,
        "lines": [
            {
                "key": r["key"],
                "billed": r["billed"].as_json(),
                "ledger": r["ledger"].as_json(),
                "difference": r["difference"].as_json(),
                "reasons": {k: v.as_json() for k, v in r["reasons"].items()},
            }
            for r in rows
        ],
        "totals": {cur: {k: v.as_json() for k, v in t.items()} for cur, t in totals(rows).items()},
        "drift": [
            {
                "machine": d.machine,
                "region": d.region,
                "instance_type": d.instance_type,
                "market": d.market,
                "catalog": Money(d.catalog, d.currency).as_json(),
                "billed": d.unit_price.as_json(),
                "pct": str(d.pct.quantize(Decimal("0.1"))),
                "fix": "provisioner catalog refresh",
            }
            for d in c.drift
        ],
        "notes": c.notes,
    }


def fetched_on(data: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(data["fetched_at"])
