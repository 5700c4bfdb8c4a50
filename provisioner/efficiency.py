"""A team lead's two questions of the ledger: how much of the GPU time paid for was busy
(:func:`gpu_efficiency`, per machine, owner, project and budget), and which spend is unusual
against its own recent days (:func:`unusual_spend`). Both are said with their method
(:data:`EFFICIENCY_METHOD`, :data:`UNUSUAL_METHOD`) wherever they are shown."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from functools import lru_cache
from statistics import median
from typing import TYPE_CHECKING, Any

from sqlalchemy import Text, cast, func, select

from provisioner import idle, ledger
from provisioner.ledger import Period, Scope
from provisioner.models import Heartbeat, Machine, UsageInterval, epoch_us
from provisioner.money import US_PER_HOUR, Money, Rates
from provisioner.schema import UsageKind

if TYPE_CHECKING:
    from provisioner.app import App

#: A heartbeat speaks for its GPUs until the next one, at most this many agent periods on.
SAMPLE_CAP = 2
EFFICIENCY_METHOD = (
    "busy GPU-hours ÷ paid GPU-hours (compute hours × GPUs): a GPU is busy while the latest "
    "heartbeat shows it at or above its idle threshold (5 % by default), each heartbeat "
    "counting until the next, 2 agent periods at most; paid time without a heartbeat is "
    "unknown — neither busy nor idle (heartbeats are kept a day, so older time is unknown)"
)
#: How many days before the latest full day spend is compared with, and the least amount (in
#: the report's currency) worth a flag.
UNUSUAL_DAYS = 14
UNUSUAL_FLOOR = Decimal(10)
UNUSUAL_METHOD = (
    "the latest full day's spend against the 14 days before it: unusual at or above their "
    "median + 3 × MAD (median absolute deviation), or 2 × the median when the MAD is 0, and "
    "above 10 in the report's currency"
)
_CHUNK = 500  # machine ids per heartbeat query


@dataclass
class GpuTime:
    """GPU-microseconds paid, busy and without a heartbeat (unknown)."""

    paid_us: int = 0
    busy_us: int = 0
    unknown_us: int = 0

    def add(self, other: GpuTime) -> None:
        self.paid_us += other.paid_us
        self.busy_us += other.busy_us
        self.unknown_us += other.unknown_us

    @property
    def ratio(self) -> Decimal | None:
        """Busy ÷ paid (exact to Decimal's 28 digits); None when no GPU time was paid."""
        return Decimal(self.busy_us) / Decimal(self.paid_us) if self.paid_us else None

    def hours(self, us: int) -> Decimal:
        return Decimal(us) / US_PER_HOUR

    def as_json(self, key: str) -> dict[str, Any]:
        r = self.ratio
        return {
            "key": key,
            "busy_ratio": None if r is None else str(r.quantize(Decimal("0.001"))),
            "paid_gpu_hours": _h(self.paid_us),
            "busy_gpu_hours": _h(self.busy_us),
            "unknown_gpu_hours": _h(self.unknown_us),
        }


def _h(us: int) -> str:
    return str((Decimal(us) / US_PER_HOUR).quantize(Decimal("0.01")))


@dataclass
class Efficiency:
    """GPU time per machine (by name), owner, project and budget (by policy name)."""

    total: GpuTime = field(default_factory=GpuTime)
    machines: dict[str, GpuTime] = field(default_factory=dict)
    owners: dict[str, GpuTime] = field(default_factory=dict)
    projects: dict[str, GpuTime] = field(default_factory=dict)
    budgets: dict[str, GpuTime] = field(default_factory=dict)
    pairs: dict[tuple[str, str], GpuTime] = field(default_factory=dict)  # (project, owner)
    method: str = EFFICIENCY_METHOD

    def as_json(self) -> dict[str, Any]:
        def rows(d: dict[str, GpuTime]) -> list[dict[str, Any]]:
            return [t.as_json(k) for k, t in sorted(d.items())]

        return {
            **{k: v for k, v in self.total.as_json("").items() if k != "key"},
            "method": self.method,
            "by_machine": rows(self.machines),
            "by_owner": rows(self.owners),
            "by_project": rows(self.projects),
            "by_budget": rows(self.budgets),
        }


@dataclass(frozen=True)
class _Paid:
    machine: Machine
    cards: int
    spans: list[tuple[int, int]]  # compute time in the period, microseconds, in order


def gpu_efficiency(app: App, start: datetime, end: datetime, scope: Scope = Scope()) -> Efficiency:
    """Busy and paid GPU time in [start, end) of the machines in ``scope`` (see
    :data:`EFFICIENCY_METHOD`). Pass ``min(period end, now)`` as ``end``."""
    lo, hi = epoch_us(start), epoch_us(end)
    cap = SAMPLE_CAP * app.settings.scheduler.agent_interval_seconds * 1_000_000
    out = Efficiency()
    with app.db.session() as s:
        paid = _paid(s, lo, hi, scope)
        samples = _samples(app, s, list(paid), lo - cap, hi)
        for mid, p in paid.items():
            below = idle.threshold(idle.idle_rules(app.policies, p.machine))[0]
            t = _machine_time(p, samples.get(mid, []), below, cap, hi)
            _add(out, app, p.machine, t)
    return out


def _paid(s: Any, lo: int, hi: int, scope: Scope) -> dict[str, _Paid]:
    """Each GPU machine's compute spans clamped to [lo, hi), by machine id."""
    iv = UsageInterval
    q = (
        select(Machine, iv.start_us, iv.end_us)
        .join(iv, iv.machine_id == Machine.id)
        .where(
            iv.kind == UsageKind.COMPUTE,
            iv.start_us < hi,
            func.coalesce(iv.end_us, hi) > lo,
            *scope.clauses(),
        )
        .order_by(iv.machine_id, iv.start_us)
    )
    admits = scope.admitter()
    out: dict[str, _Paid] = {}
    for m, a, b in s.execute(q):
        cards = m.gpu_count or (1 if m.gpu else 0)
        if not cards or not admits(m.project, m.owner):
            continue
        span = (max(a, lo), min(hi if b is None else b, hi))
        if span[1] > span[0]:
            out.setdefault(m.id, _Paid(m, cards, [])).spans.append(span)
    return out


Sample = tuple[int, float | None, str]  # microseconds, the busiest GPU's %, the GPUs as JSON


def _samples(app: App, s: Any, ids: list[str], lo: int, hi: int) -> dict[str, list[Sample]]:
    """Each machine's heartbeats in [lo, hi), in order: times as integer microseconds by the
    database, the GPUs as their JSON text (parsed only when the busiest GPU alone cannot say
    how many are busy), through the connection: no ORM objects, the report's hot loop."""
    out: dict[str, list[Sample]] = {}
    col, us = idle.epoch_us_sql(app)
    since, until = _at(lo), _at(hi)
    gpus = cast(Heartbeat.gpus, Text)  # the text: PostgreSQL's driver would parse JSON
    for i in range(0, len(ids), _CHUNK):
        q = (
            select(Heartbeat.machine_id, us, Heartbeat.max_util, gpus)
            .where(Heartbeat.machine_id.in_(ids[i : i + _CHUNK]), col >= since, col < until)
            .order_by(Heartbeat.machine_id, col)
        )
        for mid, at, top, text in s.connection().execute(q):
            out.setdefault(mid, []).append((int(at), top, text))
    return out


def _busy(sample: Sample, below: float, cards: int) -> int | None:
    """How many of the machine's ``cards`` a heartbeat shows at or above ``below`` %; None
    when it saw no GPU."""
    _, top, text = sample
    if top is None:
        return None
    if top < below:
        return 0
    return 1 if cards == 1 else _count(text, below, cards)


@lru_cache(maxsize=4096)
def _count(text: str, below: float, cards: int) -> int:
    """The GPUs of a heartbeat's JSON at or above ``below`` %, ``cards`` at most: agents
    repeat the same whole percents, so most texts were counted before."""
    return min(cards, sum(float(g["util"]) >= below for g in json.loads(text)))


def _at(us: int) -> datetime:
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=us)


def _segments(
    samples: list[Sample], below: float, cards: int, cap: int, hi: int
) -> Iterator[tuple[int, int, int]]:
    """(from, to, busy GPUs) that each heartbeat speaks for: until the next, ``cap`` at most;
    a heartbeat without GPUs speaks for nothing."""
    for i, sample in enumerate(samples):
        at = sample[0]
        nxt = samples[i + 1][0] if i + 1 < len(samples) else hi
        if (n := _busy(sample, below, cards)) is not None:
            yield at, min(nxt, at + cap, hi), n


def _machine_time(p: _Paid, samples: list[Sample], below: float, cap: int, hi: int) -> GpuTime:
    """The machine's paid, busy and unknown GPU time: its heartbeats' segments laid over its
    compute spans (both in order and without overlaps, so one merge)."""
    paid = sum(b - a for a, b in p.spans) * p.cards
    known = busy = 0
    spans, j = p.spans, 0
    for a, b, n in _segments(samples, below, p.cards, cap, hi):
        while j < len(spans) and spans[j][1] <= a:
            j += 1
        k = j
        while k < len(spans) and spans[k][0] < b:
            overlap = min(b, spans[k][1]) - max(a, spans[k][0])
            known += overlap * p.cards
            busy += overlap * n
            k += 1
    return GpuTime(paid, busy, paid - known)


def _add(out: Efficiency, app: App, m: Machine, t: GpuTime) -> None:
    out.total.add(t)
    for d, key in ((out.machines, m.name), (out.owners, m.owner), (out.projects, m.project)):
        d.setdefault(key, GpuTime()).add(t)
    out.pairs.setdefault((m.project, m.owner), GpuTime()).add(t)
    for policy in app.policies:
        if policy.budget is not None and policy.applies_to.matches(m.project, m.owner):
            out.budgets.setdefault(policy.name, GpuTime()).add(t)


# --- unusual spend ------------------------------------------------------------------------


@dataclass(frozen=True)
class Unusual:
    """A project's or owner's spend on ``day`` beside its previous days (the report's
    currency): ``flagged`` when at or above ``limit`` (see :data:`UNUSUAL_METHOD`)."""

    by: str  # "project" or "owner"
    key: str
    day: date
    spent: Money
    median: Money
    mad: Money
    limit: Money
    flagged: bool

    def as_json(self) -> dict[str, Any]:
        return {
            "by": self.by,
            "key": self.key,
            "day": self.day.isoformat(),
            "spent": self.spent.rounded().as_json(),
            "median": self.median.rounded().as_json(),
            "mad": self.mad.rounded().as_json(),
            "limit": self.limit.rounded().as_json(),
        }


def latest_full_day(now: datetime, tz: str) -> date:
    """The last whole local day before ``now``: today is not over, so never compared."""
    from zoneinfo import ZoneInfo

    return now.astimezone(ZoneInfo(tz)).date() - ledger.DAY


def verdict(latest: Decimal, history: list[Decimal]) -> tuple[Decimal, Decimal, Decimal, bool]:
    """(median, MAD, limit, flagged) of ``latest`` against ``history`` (:data:`UNUSUAL_METHOD`)."""
    mid = Decimal(median(history)) if history else Decimal(0)
    mad = Decimal(median([abs(x - mid) for x in history])) if history else Decimal(0)
    limit = mid + 3 * mad if mad else 2 * mid
    return mid, mad, limit, latest >= limit and latest > UNUSUAL_FLOOR


def unusual_spend(
    app: App,
    now: datetime,
    scope: Scope = Scope(),
    *,
    currency: str,
    rates: Rates,
    tz: str = "UTC",
    flagged_only: bool = True,
) -> list[Unusual]:
    """Each project's and owner's spend on the latest full day before ``now`` against its
    :data:`UNUSUAL_DAYS` before, largest first; only the flagged ones unless asked."""
    last = latest_full_day(now, tz)
    days = [last - ledger.DAY * i for i in range(UNUSUAL_DAYS, -1, -1)]
    start, end = ledger.midnight(days[0], tz), ledger.midnight(last + ledger.DAY, tz)
    out: list[Unusual] = []
    with app.db.session() as s:
        for by in ("project", "owner"):
            per = ledger.day_tally(s, start, end, days, (by,), scope, tz=tz).amounts()
            series: dict[str, dict[date, Decimal]] = {}
            for (key, day), amounts in per.items():
                series.setdefault(key, {})[day] = amounts.total(rates, currency).rounded().amount
            out.extend(_judge(by, series, days, currency, flagged_only))
    return sorted(out, key=lambda u: (-u.spent.amount, u.by, u.key))


def _judge(
    by: str, series: dict[str, dict[date, Decimal]], days: list[date], cur: str, only: bool
) -> Iterable[Unusual]:
    for key, per_day in sorted(series.items()):
        values = [per_day.get(d, Decimal(0)) for d in days]
        mid, mad, limit, flagged = verdict(values[-1], values[:-1])
        if flagged or not only:
            spent, mid_m, mad_m, limit_m = (Money(x, cur) for x in (values[-1], mid, mad, limit))
            yield Unusual(by, key or "—", days[-1], spent, mid_m, mad_m, limit_m, flagged)


@dataclass
class Answers:
    """What a report says beside its spend: GPU efficiency and unusual spend."""

    efficiency: Efficiency
    unusual: list[Unusual]

    def as_json(self) -> dict[str, Any]:
        return {
            "gpu_efficiency": self.efficiency.as_json(),
            "unusual_spend": [u.as_json() for u in self.unusual],
            "unusual_method": UNUSUAL_METHOD,
        }


def answers(app: App, period: Period, now: datetime, scope: Scope, currency: str) -> Answers:
    """The report's :class:`Answers` over ``period`` up to ``now``; unusual spend as of the
    period's last day when it is over."""
    at = min(now, period.end)
    return Answers(
        gpu_efficiency(app, period.start, period.clip(now), scope),
        unusual_spend(
            app, at, scope, currency=currency, rates=app.settings.money_rates, tz=period.tz
        ),
    )
