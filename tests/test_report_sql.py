"""The report in the database: SQL clamps and groups the usage, and the report it gives is, byte
for byte, the one the row-by-row algorithm gave (kept here as the oracle) on random usage, on
SQLite and PostgreSQL; every rounded table adds up to its rounded total (hypothesis)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import NamedTuple
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import String, delete, insert, or_, select, type_coerce

from provisioner import budget, ledger, render, reports
from provisioner.app import App
from provisioner.ledger import Period, Scope, midnight
from provisioner.ledger import sums as ledger_sums
from provisioner.models import Machine, UsageInterval, epoch_us
from provisioner.money import CENT, Tally, allocate
from tests.conftest import make_settings

# --- the row-by-row algorithm the report used before (the oracle) ---------------------------

_US = timedelta(microseconds=1)


class Usage(NamedTuple):
    machine: str
    project: str
    owner: str
    cloud: str | None
    gpu: str | None
    gpu_count: int | None
    kind: str
    currency: str
    rate: str
    lo: datetime
    hi: datetime

    def days(self, tz: str) -> Iterator[tuple[date, int]]:
        zone, lo = ZoneInfo(tz), self.lo
        while lo < self.hi:
            day = lo.astimezone(zone).date()
            nxt = min(midnight(day + timedelta(days=1), tz), self.hi)
            yield day, (nxt - lo) // _US
            lo = nxt


def scan(s, start, end, scope, kinds=None) -> Iterator[Usage]:
    q = (
        select(
            Machine.name,
            Machine.project,
            Machine.owner,
            Machine.cloud,
            Machine.gpu,
            Machine.gpu_count,
            UsageInterval.kind,
            UsageInterval.currency,
            type_coerce(UsageInterval.rate, String),
            UsageInterval.started_at,
            UsageInterval.ended_at,
        )
        .join(Machine, Machine.id == UsageInterval.machine_id)
        .where(
            UsageInterval.started_at < end,
            or_(UsageInterval.ended_at.is_(None), UsageInterval.ended_at > start),
            *scope.clauses(),
        )
    )
    if kinds is not None:
        q = q.where(UsageInterval.kind.in_(kinds))
    admits = scope.admitter()
    for r in s.execute(q):
        if not admits(r[1], r[2]):
            continue
        lo, hi = max(r[9], start), end if r[10] is None else min(r[10], end)
        if hi > lo:
            yield Usage(*r[:9], lo, hi)


def oracle_tally(s, start, end, by, scope=Scope(), *, kinds=None) -> Tally:
    t = Tally()
    for u in scan(s, start, end, scope, kinds):
        t.add(tuple(getattr(u, f) for f in by), u.currency, u.rate, (u.hi - u.lo) // _US)
    return t


def oracle_day_tally(
    s, start, end, days: Sequence[date], by=(), scope=Scope(), *, tz="UTC", kinds=None
) -> Tally:
    t = Tally()
    for u in scan(s, start, end, scope, kinds):
        key = tuple(getattr(u, f) for f in by)
        for d, us in u.days(tz):
            t.add((*key, d), u.currency, u.rate, us)
    return t


# --- random usage --------------------------------------------------------------------------

RATES = [("USD", "0.15"), ("USD", "3.6"), ("USD", "29.00"), ("RUB", "47.50"), ("RUB", "1045")]
GPUS = [("T4", 1), ("A100", 8), ("H100", 8), (None, None)]


def populate(app, seed: int, around: Period, n: int = 400) -> None:
    """``n`` intervals on a few dozen machines, some crossing the period's edges, some open,
    some of no length, some relaunched under a name already used."""
    rnd = random.Random(seed)
    span = around.end - around.start
    machines, intervals = [], []
    for i in range(rnd.randrange(5, 30)):
        cur, rate = rnd.choice(RATES)
        gpu, count = rnd.choice(GPUS)
        machines.append(
            {
                "id": f"m{seed}-{i}",
                "name": f"exp-{rnd.randrange(0, 20)}",
                "project": rnd.choice(["nlp", "nlp-big", "vision", "demo"]),
                "owner": rnd.choice(["ana@example.com", "bo@example.com", "cy@other.org"]),
                "status": "terminated",
                "spec": {},
                "cloud": rnd.choice(["aws", "gcp", "sandbox", None]),
                "gpu": gpu,
                "gpu_count": count,
                "rate": Decimal(rate),
                "currency": cur,
                "created_at": around.start,
            }
        )
    still_open: set[tuple[str, str]] = set()
    for k in range(n):
        m = rnd.choice(machines)
        kind = rnd.choice(["compute", "disk"])
        start = around.start - span / 4 + span * rnd.random() * 1.5
        start = start.replace(microsecond=rnd.randrange(0, 10**6))
        length = rnd.choice([timedelta(0), timedelta(minutes=rnd.randrange(1, 60 * 80))])
        end = None if rnd.random() < 0.05 else start + length
        if end is None and (m["id"], kind) in still_open:  # the ledger keeps one open a kind
            end = start + length
        if end is None:
            still_open.add((m["id"], kind))
        rate = m["rate"] if kind == "compute" else Decimal(rnd.choice(["0.0068", "0.011"]))
        intervals.append(
            {
                "machine_id": m["id"],
                "kind": kind,
                "started_at": start + timedelta(microseconds=k),  # (machine, kind, start) unique
                "ended_at": end,
                "start_us": epoch_us(start + timedelta(microseconds=k)),
                "end_us": None if end is None else epoch_us(end),
                "rate": rate,
                "currency": m["currency"],
            }
        )
    with app.db.engine.begin() as conn:
        conn.execute(delete(UsageInterval.__table__))
        conn.execute(delete(Machine.__table__))
        conn.execute(insert(Machine.__table__), machines)
        conn.execute(insert(UsageInterval.__table__), intervals)


def outputs(r: reports.Report) -> list[str]:
    return [
        render.text(r),
        render.csv(r),
        render.html(r, None),
        json.dumps(r.as_json(), default=str, sort_keys=True),
    ]


CASES = [
    # (period, tz, by, scope, now): UTC; a Berlin October (the clocks go back: a 25-hour day);
    # a month still running; globs and a budget-like test only Python can make
    ("2026-11", "UTC", "project", Scope(), datetime(2026, 12, 1, 3, tzinfo=UTC)),
    ("2026-10", "Europe/Berlin", "owner", Scope(), datetime(2026, 11, 2, tzinfo=UTC)),
    ("2026-11", "UTC", "machine", Scope(), datetime(2026, 11, 17, 13, 5, tzinfo=UTC)),
    ("2026-11", "Asia/Kolkata", "gpu", Scope(project="nlp*"), datetime(2026, 12, 2, tzinfo=UTC)),
    (
        "2026-W46",
        "UTC",
        "cloud",
        Scope(owner="*@example.com", covers=lambda p, o: p != "demo"),
        datetime(2026, 12, 1, tzinfo=UTC),
    ),
]


def replace_sums(monkeypatch, **fns) -> None:
    """The ledger's sums replaced where callers reach them: the package's names and, for the
    ledger's own calls between its parts, the sums module's."""
    for name, fn in fns.items():
        for where in (ledger, ledger_sums):
            monkeypatch.setattr(where, name, fn)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("seed", [1, 2])
def test_report_in_sql_is_byte_for_byte_the_row_by_row_one(app, monkeypatch, case, seed):
    label, tz, by, scope, now = CASES[case]
    period = Period.parse(label, tz)
    populate(app, seed * 10 + case, period)
    kw = {"by": by, "now": now, "title": "t"}
    new = [outputs(reports.build(app, period, scope, language=lang, **kw)) for lang in ("en", "ru")]
    replace_sums(monkeypatch, tally=oracle_tally, day_tally=oracle_day_tally)
    old = [outputs(reports.build(app, period, scope, language=lang, **kw)) for lang in ("en", "ru")]
    for a, b in zip(new, old, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.replace(", ", ",\n").splitlines() == y.replace(", ", ",\n").splitlines()
    assert new == old
    assert "$" in new[0][0] and len(new[0][1].splitlines()) > 3  # there was spend to compare


BUDGETS = [
    {"name": "nlp", "applies_to": {"projects": ["nlp*"]}, "budget": {"amount": "900 USD"}},
    {
        "name": "ours",
        "applies_to": {"owners": ["*@example.com"]},
        "budget": {"amount": "50000 RUB"},
    },
    {  # its month starts at a Berlin midnight: another period than the UTC report's
        "name": "berlin",
        "applies_to": {"projects": ["vision"]},
        "budget": {"amount": "700 USD"},
        "off_hours": {
            "timezone": "Europe/Berlin",
            "windows": [{"days": "mon-fri", "start": "19:00", "end": "07:00"}],
        },
    },
]


@pytest.mark.parametrize("seed", [1, 2])
def test_a_report_lends_its_sums_to_the_budgets_it_covers(app, monkeypatch, seed):
    """The spend page's budget standings, taken from its report's sums where the report covers
    them (a budget's own report; every budget of the report's period when it shows every
    machine), are the standings the ledger gives — without another pass per budget."""
    from policies.schema import Policy
    from provisioner.dashboard import pages

    app.__dict__["policies"] = [Policy.model_validate(p) for p in BUDGETS]
    now = datetime(2026, 11, 17, 13, 5, tzinfo=UTC)
    populate(app, seed, Period.parse("2026-11"))
    passes: list[Scope] = []
    tally = ledger.tally
    replace_sums(monkeypatch, tally=lambda s, *a, **k: passes.append(a[3]) or tally(s, *a, **k))
    want = [st.as_json() for st in pages.standings(app, now)]
    assert len(passes) == 3 and want[0]["spent"] != want[1]["spent"]

    passes.clear()
    everything = reports.build(app, Period.month(now), now=now)
    assert len(passes) == 1
    assert [st.as_json() for st in pages.standings(app, now, everything)] == want
    assert len(passes) == 2  # only the Berlin month needed a pass of its own

    for i, policy in enumerate(app.policies):
        passes.clear()
        own = reports.build(
            app,
            budget.period_of(policy, now),
            budget.scope_of(policy),
            budget_policy=policy,
            now=now,
        )
        assert own.budget is not None and own.budget.as_json() == want[i]
        assert len(passes) == 1  # the report's sums are the budget's
        assert pages.standings(app, now, own)[i] is own.budget


@pytest.mark.parametrize("tz", ["UTC", "Europe/Berlin"])
def test_spend_by_day_in_sql_equals_the_row_by_row_split(app, tz):
    period = Period.parse("2026-10", tz)
    populate(app, 7, period)
    start, end = period.start + timedelta(hours=5), period.end - timedelta(hours=30)
    with app.db.session() as s:
        got = ledger.spend_by(s, start, end, ["project", "kind", "day"], tz=tz)
        days = [d for d in period.days() if midnight(d, tz) < end]
        want = oracle_day_tally(s, start, end, days, ("project", "kind"), tz=tz).amounts()
    assert got == want and len(got) > 20


# --- rounded tables add up -----------------------------------------------------------------

amounts = st.decimals(min_value=0, max_value=10**6, places=6, allow_nan=False)


@given(st.lists(amounts, max_size=40))
def test_shared_out_cents_add_up_and_stay_within_a_cent(parts):
    shown = allocate(parts)
    total = sum(parts, Decimal(0)).quantize(CENT, ROUND_HALF_UP)
    assert sum(shown, Decimal(0)) == total
    assert all(
        abs(a - p) < CENT and a == a.quantize(CENT) for a, p in zip(shown, parts, strict=True)
    )


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 10**6), by=st.sampled_from(["project", "owner", "machine", "gpu"]))
def test_every_rounded_table_adds_up_to_its_rounded_total(home, clock, seed, by):
    app = App(make_settings(home), clock)
    try:
        nov = Period.parse("2026-11")
        populate(app, seed, nov, n=60)
        r = reports.build(app, nov, by=by, now=datetime(2026, 12, 1, tzinfo=UTC))
    finally:
        app.close()
    total = r.shown_total.amount
    assert sum(ln.shown.amount for ln in r.lines) == total
    others = r.other_machines[1].amount if r.other_machines else 0
    assert sum(m.shown.amount for m in r.top_machines) + others == total
    assert sum(m.amount for m in r.daily_shown) == total
    assert sum(m.amount for m in r.shown_by_kind.values()) == total
    for ln in r.lines:
        assert sum(m.amount for m in ln.shown_by_kind.values()) == ln.shown.amount
    for m in r.native.monies():
        billed = [b.amount for ln in r.lines for b in ln.shown_billed if b.currency == m.currency]
        assert sum(billed) == m.rounded().amount
    # and so does what a person reads: the JSON's lines against its total
    js = r.as_json()
    assert sum(Decimal(ln["total"]["amount"]) for ln in js["lines"]) == Decimal(
        js["total"]["amount"]
    )


def test_migration_0005_keeps_the_ledger(settings, clock):
    """A ledger written before the integer times existed (revision 0003) gets them from its own
    timestamps, on SQLite and PostgreSQL, and reports the same bill after the upgrade."""
    from alembic import command

    from provisioner.state import Database
    from tests.test_state import config

    url = settings.database_url
    if url.startswith("sqlite:///"):  # the test's state starts migrated: this one starts empty
        Path(url.removeprefix("sqlite:///")).unlink()
    db = Database(url)
    with db.engine.begin() as conn:
        command.upgrade(config(db, conn), "0003")
    t0 = datetime(2026, 11, 2, 9, 0, 0, 250_001, tzinfo=UTC)
    machine = {
        "id": "m1",
        "name": "old",
        "project": "demo",
        "owner": "ana@example.com",
        "status": "running",
        "spec": {},
        "created_at": t0,
    }
    rows = [
        ("compute", t0, t0 + timedelta(hours=10, microseconds=3), "0.15"),
        ("disk", t0, None, "0.0068"),
    ]
    with db.engine.begin() as conn:
        md = sqlalchemy_tables(conn)
        conn.execute(md["machines"].insert(), [machine])
        conn.execute(
            md["usage_intervals"].insert(),
            [
                {
                    "machine_id": "m1",
                    "kind": k,
                    "started_at": a,
                    "ended_at": b,
                    "rate": r,
                    "currency": "USD",
                }
                for k, a, b, r in rows
            ],
        )
    db.migrate()
    with db.engine.connect() as conn:
        got = conn.execute(
            select(UsageInterval.kind, UsageInterval.start_us, UsageInterval.end_us).order_by(
                UsageInterval.kind
            )
        ).all()
    db.dispose()
    assert got == [
        ("compute", epoch_us(t0), epoch_us(rows[0][2])),
        ("disk", epoch_us(t0), None),
    ]
    app = App(settings, clock)
    try:
        with app.db.session() as s:
            bill = ledger.total(s, t0, t0 + timedelta(hours=20))
    finally:
        app.close()
    hours = Decimal(36_000_000_003) / Decimal(3_600_000_000)
    assert bill == {"USD": Decimal("0.15") * hours + Decimal("0.0068") * 20}


def sqlalchemy_tables(conn) -> dict:
    from sqlalchemy import MetaData

    md = MetaData()
    md.reflect(conn, only=["machines", "usage_intervals"])
    return md.tables
