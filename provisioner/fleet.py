"""The fleet as ``provisioner status`` lists it: each machine shown, what it has cost (compute
and disk at its launch-time rates, across its relaunches after preemption), why a failed or
stopped one is so, and which agents see fewer GPUs than their machine has.

Read with plain SQL on a DB-API connection (:mod:`sqlite3`, or psycopg under SQLAlchemy) and
drawn with the standard library, so `status` over a SQLite state needs neither SQLAlchemy nor
the ORM nor pydantic: those are ~70 % of its time at 1,000 machines (bench/bench_status.py).
The Typer command and the console entry point (:mod:`provisioner.entry`) both draw with it; a
test compares what the two write."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

from provisioner.clock import zoned
from provisioner.console import (
    err,
    no_machines,
    out,
    plural,
    print_json,
    say,
    text_table,
    write,
)
from provisioner.money import Money, Tally
from provisioner.schema import ACTIVE_EXCLUDED, ADDRESS_BILLED, EventKind, MachineStatus, epoch_us

#: The columns read of each machine: those :func:`machine_json` and the table show.
COLUMNS = (
    "id", "name", "project", "owner", "status", "cloud", "region", "zone", "instance_type",
    "gpu", "gpu_count", "market", "instance_id", "public_ip", "rate", "currency", "disk_rate",
    "address_rate", "created_at", "launched_at", "terminated_at", "disk_gb", "address_billed",
)  # fmt: skip
S = MachineStatus
_CHUNK = 500  # ids per IN (…): SQLite before 3.32 takes 999 parameters


@dataclass(slots=True)
class Row:
    """A machine as listed: its recorded columns, what it has cost per currency across its
    launches, how many launches, and why it failed or is kept stopped (None: nothing to say)."""

    id: str
    name: str
    project: str
    owner: str
    status: MachineStatus
    cloud: str | None
    region: str | None
    zone: str | None
    instance_type: str | None
    gpu: str | None
    gpu_count: int | None
    market: str | None
    instance_id: str | None
    public_ip: str | None
    rate: Decimal | None
    currency: str | None
    disk_rate: Decimal | None
    address_rate: Decimal | None
    created_at: datetime
    launched_at: datetime | None
    terminated_at: datetime | None
    disk_gb: int | None
    address_billed: str | None
    spent: dict[str, Decimal] = field(default_factory=dict)
    launches: int = 1
    why: str | None = None


@dataclass
class Fleet:
    rows: list[Row]
    warnings: dict[str, str]  # machine name: what is wrong that the table cannot show


class Sql:
    """One DB-API connection and its dialect: statements are written with ``?`` (sqlite3's
    style) and PostgreSQL's functions are named where they differ; values come back as the
    ORM's types give them (aware UTC datetimes, exact decimals, parsed JSON)."""

    def __init__(self, conn: Any, postgres: bool) -> None:
        self.conn, self.postgres = conn, postgres
        self.least, self.greatest = ("LEAST", "GREATEST") if postgres else ("MIN", "MAX")

    @classmethod
    def on(cls, session: Any) -> Sql:
        """The DB-API connection under a SQLAlchemy session (its transaction)."""
        conn = session.connection()
        return cls(conn.connection.driver_connection, conn.dialect.name == "postgresql")

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        cur = self.conn.cursor()
        try:
            cur.execute(sql.replace("?", "%s") if self.postgres else sql, tuple(params))
            return cur.fetchall()
        finally:
            cur.close()

    def at(self, when: datetime) -> Any:
        """A time as a parameter: SQLAlchemy keeps SQLite's as naive UTC text."""
        if self.postgres:
            return when
        return when.astimezone(UTC).replace(tzinfo=None).strftime("%Y-%m-%d %H:%M:%S.%f")


#: said by `status` and `policy diff` on a team's PostgreSQL state without team rules yet
NOT_APPLIED = "team rules not applied yet: an admin runs provisioner policy apply"


def team_rules_missing(sql: Sql) -> bool:
    """Whether a team's PostgreSQL state has no team rules yet (provisioner.team)."""
    return sql.postgres and not sql.all("SELECT 1 FROM team_rules LIMIT 1")


def _time(v: Any) -> datetime | None:
    """A stored time as :class:`provisioner.models.UTCDateTime` reads it: aware, in UTC."""
    if v is None:
        return None
    if isinstance(v, str):
        v = datetime.fromisoformat(v)
    return v.replace(tzinfo=UTC) if v.tzinfo is None else v.astimezone(UTC)


def _json(v: Any) -> Any:
    return json.loads(v) if isinstance(v, str | bytes) else v


def _decimal(v: Any) -> Decimal | None:
    return None if v is None else Decimal(v)


def _row(r: Sequence[Any]) -> Row:
    v = dict(zip(COLUMNS, r, strict=True))
    v["status"] = MachineStatus(v["status"])
    for k in ("rate", "disk_rate", "address_rate"):
        v[k] = _decimal(v[k])
    for k in ("created_at", "launched_at", "terminated_at"):
        v[k] = _time(v[k])
    return Row(**v)


def shown_condition(all_: bool) -> str:
    """Which machines a listing shows: all, or those not done with (:data:`ACTIVE_EXCLUDED`).
    A volume's ledger row (``market`` volume, never live) is no machine: ``volume ls`` lists
    volumes."""
    if all_:
        return "(market IS NULL OR market != 'volume')"
    return f"status NOT IN ({', '.join(repr(s) for s in ACTIVE_EXCLUDED)})"


def read(sql: Sql, *, all_: bool, now: datetime, seen_since: datetime) -> Fleet:
    """The machines shown, oldest first, with their costs up to ``now``; warnings about the
    agents heard since ``seen_since`` that see too few GPUs, and stopped machines' notes. A
    handful of queries whatever the number of machines (and one per 500 earlier launches of
    theirs no longer shown)."""
    shown = shown_condition(all_)
    where = f" WHERE {shown}" if shown else ""
    rows = [
        _row(r)
        for r in sql.all(
            f"SELECT {', '.join(COLUMNS)} FROM machines{where} ORDER BY created_at, name"
        )
    ]
    if not rows:
        return Fleet([], {})
    _add_costs(sql, rows, f"SELECT id FROM machines{where}", now)
    held = (S.STOPPED, S.PREEMPTED)
    _add_why(sql, rows, now)
    warnings = gpus_not_seen(sql, seen_since)
    warnings.update({m.name: m.why for m in rows if m.why and m.status in held})
    return Fleet(rows, warnings)


def _add_costs(sql: Sql, rows: list[Row], machines: str, now: datetime) -> None:
    """Each machine's launches (itself and those it replaced after preemptions) and what they
    all have cost up to ``now``; ``machines``: a SELECT of the shown machines' ids."""
    chains = launches(sql, [m.id for m in rows])
    ids = {m.id for m in rows}
    earlier = sorted({mid for c in chains.values() for mid in c[1:]} - ids)
    cost = costs(sql, machines, now)
    cost.update(costs_of(sql, earlier, now))
    for m in rows:
        for mid in chains[m.id]:
            for c, v in cost.get(mid, {}).items():
                m.spent[c] = m.spent.get(c, 0) + v
        m.launches = len(chains[m.id])


def _add_why(sql: Sql, rows: list[Row], now: datetime) -> None:
    """Why each machine is stopped, preempted, failed or waiting, when it is news."""
    held = (S.STOPPED, S.PREEMPTED)
    notes = stopped_notes(sql) if any(m.status in held for m in rows) else {}
    failed = _failed_events(sql) if any(m.status == S.FAILED for m in rows) else {}
    waits = waiting_notes(sql, now) if any(m.status == S.WAITING for m in rows) else {}
    for m in rows:
        m.why = failure(failed.get(m.id, [])) if m.status == S.FAILED else notes.get(m.id)
        m.why = waits.get(m.id, m.why)


def launches(sql: Sql, ids: Iterable[str]) -> dict[str, list[str]]:
    """Each machine and those it replaced after preemptions, newest first: one query for the
    recoveries of every machine."""
    replaces = {
        mid: (_json(d) or {}).get("replaces")
        for mid, d in sql.all(
            "SELECT machine_id, detail FROM events WHERE kind = ?", [EventKind.RECOVERED.value]
        )
    }
    out = {}
    for mid in ids:
        chain = [mid]
        while (prev := replaces.get(chain[-1])) and prev not in chain:
            chain.append(prev)
        out[mid] = chain
    return out


def costs(
    sql: Sql, machines: str, now: datetime, params: Sequence[Any] = ()
) -> dict[str, dict[str, Decimal]]:
    """What each machine of ``machines`` (a SELECT of ids, or placeholders for ``params``)
    has cost up to ``now``, per currency, in one query: the database sums each (machine,
    currency, rate)'s microseconds (an open interval runs to ``now``), each sum priced once
    (:class:`provisioner.money.Tally`). A currency it cost nothing in is left out."""
    hi = epoch_us(now)
    tally = Tally()
    for mid, currency, rate, us in sql.all(
        f"SELECT machine_id, currency, rate, sum(hi - lo) FROM (SELECT machine_id, currency,"
        f" rate, {sql.greatest}(start_us, 0) AS lo, {sql.least}(coalesce(end_us, ?), ?) AS hi"
        " FROM usage_intervals WHERE start_us < ?"
        " AND (end_us IS NULL OR (end_us > 0 AND end_us > start_us))"
        f" AND machine_id IN ({machines})) u"
        " GROUP BY machine_id, currency, rate HAVING sum(hi - lo) > 0",
        [hi, hi, hi, *params],
    ):
        tally.add(mid, currency, rate, int(us))
    return {mid: {c: v for c, v in a.items() if v} for mid, a in tally.amounts().items()}


def costs_of(sql: Sql, ids: Sequence[str], now: datetime) -> dict[str, dict[str, Decimal]]:
    """:func:`costs` of the machines ``ids``, a query per 500 of them."""
    out = {}
    for chunk in range(0, len(ids), _CHUNK):
        part = ids[chunk : chunk + _CHUNK]
        out.update(costs(sql, ", ".join("?" * len(part)), now, part))
    return out


def stopped_notes(sql: Sql) -> dict[str, str]:
    """Why stopped machines are stopped, when it is news: a preempted machine whose relaunch
    was refused (or given up after refusals), kept with its disk. One query, each one's latest
    event; by machine id."""
    stopped = f"SELECT id FROM machines WHERE status IN ('{S.STOPPED}', '{S.PREEMPTED}')"
    rows = sql.all(
        "SELECT e.machine_id, e.detail FROM events e JOIN (SELECT max(id) AS eid FROM events"
        f" WHERE machine_id IN ({stopped}) GROUP BY machine_id) latest ON latest.eid = e.id"
        " WHERE e.kind IN (?, ?)",
        [EventKind.RELAUNCH_REFUSED.value, EventKind.RELAUNCH_GAVE_UP.value],
    )
    return {
        mid: "preempted and not relaunched, kept stopped with its disk: "
        + (_json(detail) or {}).get("refused", "")
        for mid, detail in rows
        if (_json(detail) or {}).get("refused")
    }


def waiting_notes(sql: Sql, now: datetime) -> dict[str, str]:
    """Each waiting machine's :func:`waiting_line`, from its latest ``waiting`` event: one
    query; by machine id."""
    rows = sql.all(
        "SELECT e.machine_id, e.detail FROM events e JOIN (SELECT max(id) AS eid FROM events"
        " WHERE kind = ? AND machine_id IN (SELECT id FROM machines"
        f" WHERE status = '{S.WAITING}') GROUP BY machine_id) latest ON latest.eid = e.id",
        [EventKind.WAITING.value],
    )
    return {mid: waiting_line(_json(detail) or {}, now) for mid, detail in rows}


def waiting_line(detail: dict[str, Any], now: datetime, zone: ZoneInfo | None = None) -> str:
    """``waiting for capacity since X, next try Y, gives up at Z``, from a ``waiting`` event's
    detail (:mod:`provisioner.machines.waiting` writes it); times in ``zone`` (UTC)."""
    since, nxt, until = (_time(detail.get(k)) for k in ("since", "next_try", "until"))
    text = "waiting for capacity"
    if since is not None:
        text += f" since {at_text(since, now, zone)}"
    if nxt is not None:
        text += f", next try {at_text(nxt, now, zone)}"
    if until is not None:
        text += f", gives up at {at_text(until, now, zone)}"
    return text


def at_text(at: datetime, now: datetime, zone: ZoneInfo | None = None) -> str:
    """``14:05 UTC`` on ``now``'s day, else with the date; in ``zone`` (the team's,
    :attr:`provisioner.app.App.zone`) when given."""
    return zoned(at, now, zone or ZoneInfo("UTC"))


@dataclass
class _Event:
    kind: str
    reason: str | None
    detail: dict[str, Any] | None


def _failed_events(sql: Sql) -> dict[str, list[_Event]]:
    out: dict[str, list[_Event]] = {}
    for mid, kind, reason, detail in sql.all(
        "SELECT e.machine_id, e.kind, e.reason, e.detail FROM events e"
        f" JOIN machines m ON m.id = e.machine_id WHERE m.status = '{S.FAILED}' ORDER BY e.id"
    ):
        out.setdefault(mid, []).append(_Event(kind, reason, _json(detail)))
    return out


def failure(events: Sequence[Any]) -> str | None:
    """Why a machine failed, from its events (each with ``kind``, ``reason``, ``detail``):
    every launch tried and how each ended."""
    if not events:
        return None
    last = events[-1]
    if last.kind == EventKind.CANCELLED:
        return "cancelled by `down` before it was launched"
    gave_up = last.kind in (EventKind.WAIT_GAVE_UP, EventKind.WAIT_REFUSED)
    if gave_up and (last.detail or {}).get("why"):
        return str(last.detail["why"])
    tried = [e for e in events if e.kind == EventKind.LAUNCH_FAILED]
    if tried:
        return _launches_failed(tried)
    return f"{last.kind}" + (f" ({last.reason})" if last.reason else "")


def _launches_failed(tried: Sequence[Any]) -> str:
    """Every launch tried (their failure events), counted by how each ended, and the last
    one's error."""
    outcomes: dict[str, int] = {}
    for e in tried:
        outcomes[e.reason or "error"] = outcomes.get(e.reason or "error", 0) + 1
    kinds = ", ".join(f"{k} {n}" for k, n in outcomes.items())
    error = (tried[-1].detail or {}).get("error", "")
    return f"no candidate launched ({plural(len(tried), 'attempt')}: {kinds}); last: {error}"


def gpus_not_seen(sql: Sql, since: datetime) -> dict[str, str]:
    """Machines whose agent, in its latest heartbeat since ``since``, sees fewer GPUs than the
    machine was launched with — a wrong image or a missing driver shows within a heartbeat,
    not on the bill: {machine name: what to say}."""
    rows = sql.all(
        "SELECT m.name, m.gpu_count, h.gpus FROM machines m"
        " JOIN (SELECT machine_id, max(id) AS hid FROM heartbeats WHERE at >= ?"
        " GROUP BY machine_id) latest ON latest.machine_id = m.id"
        f" JOIN heartbeats h ON h.id = latest.hid WHERE m.{shown_condition(False)}",
        [sql.at(since)],
    )
    out = {}
    for name, wanted, gpus in rows:
        wanted, seen = wanted or 0, len(_json(gpus) or [])
        if seen < wanted:
            out[name] = f"the agent sees {seen} of {wanted} GPUs: driver missing or wrong image?"
    return out


# --- drawing ----------------------------------------------------------------------------------


def money_text(value: Any, currency: str | None) -> str:
    return str(Money(value, currency)) if value is not None and currency else "—"


def machine_json(m: Any) -> dict[str, Any]:
    return {
        "name": m.name,
        "id": m.id,
        "status": m.status,
        "project": m.project,
        "owner": m.owner,
        "cloud": m.cloud,
        "region": m.region,
        "zone": m.zone,
        "instance_type": m.instance_type,
        "gpu": m.gpu,
        "gpu_count": m.gpu_count,
        "market": m.market,
        "instance_id": m.instance_id,
        "public_ip": m.public_ip,
        "rate_per_hour": Money(m.rate, m.currency).as_json() if m.rate is not None else None,
        "disk_rate_per_hour": Money(m.disk_rate, m.currency).as_json()
        if m.disk_rate is not None
        else None,
        "address_rate_per_hour": Money(m.address_rate, m.currency).as_json()
        if m.address_rate is not None
        else None,
        "created_at": m.created_at,
        "launched_at": m.launched_at,
        "terminated_at": m.terminated_at,
        "not_priced": unpriced_pieces(m),
    }


def unpriced_pieces(m: Any) -> list[str]:
    """The pieces of machine ``m`` its cloud bills and the ledger holds at no price (their rate
    was unknown at launch): ``boot disk`` (a disk size, no disk rate), ``public IPv4`` (an
    address that bills, :data:`provisioner.schema.ADDRESS_BILLED`, at no known rate)."""
    if m.cloud is None or m.rate is None:  # never launched: nothing billed
        return []
    out = []
    if m.disk_rate is None and m.disk_gb:
        out.append("boot disk")
    if m.address_rate is None and m.address_billed in ADDRESS_BILLED:
        out.append("public IPv4")
    return out


_TABLE = (
    ("name", "<", 0),
    ("status", "<", 0),
    ("cloud", "<", 2),
    ("zone", "<", 4),
    ("type", "<", 5),
    ("GPUs", ">", 3),
    ("market", "<", 6),
    ("price/h", ">", 0),
    ("spent", ">", 0),
    ("address", "<", 1),
)


def show(fleet: Fleet, *, as_json: bool, all_: bool) -> None:
    """The fleet as a table for people (the columns that fit the terminal) or JSON for scripts;
    then, on stderr, what the table cannot show."""
    rows = fleet.rows
    if as_json:
        print_json([_json_row(m, fleet) for m in rows])
    elif not rows:
        say(no_machines(all_))
    else:
        write(text_table(_TABLE, [_table_row(m) for m in rows]))
        _say_why(rows)
    for n, problem in fleet.warnings.items():
        err.print(f"[yellow]warning:[/] {n}: {problem}", highlight=False, soft_wrap=True)


def _say_why(rows: list[Row]) -> None:
    """Under the table: why each failed machine failed, and what each waiting one waits for."""
    for m in rows:
        if m.why and m.status == S.FAILED:
            out.print(f"{m.name} failed: {m.why}", highlight=False, markup=False, soft_wrap=True)
        elif m.why and m.status == S.WAITING:
            out.print(f"{m.name}: {m.why}", highlight=False, markup=False, soft_wrap=True)


def _json_row(m: Row, fleet: Fleet) -> dict[str, Any]:
    return {
        **machine_json(m),
        "spent": [Money(v, c).as_json() for c, v in sorted(m.spent.items())],
        "launches": m.launches,
        "problem": fleet.warnings.get(m.name),
        "why": m.why,
    }


def _table_row(m: Row) -> list[str]:
    return [
        m.name,
        m.status,
        m.cloud or "—",
        m.zone or m.region or "—",
        m.instance_type or "—",
        f"{m.gpu_count}×{m.gpu}" if m.gpu else "—",
        m.market or "—",
        money_text(m.rate, m.currency),
        " + ".join(money_text(v, c) for c, v in sorted(m.spent.items())) or "—",
        m.public_ip or "—",
    ]
