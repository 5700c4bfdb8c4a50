"""The state schema's revisions, read from the migration files themselves, and its vocabulary:
the standard library only (and libpq, for a state on PostgreSQL), so a command can tell
whether a database is current (and whether it holds any machine) before loading SQLAlchemy."""

from __future__ import annotations

import enum
import re
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import sqlite3

MIGRATIONS = Path(__file__).parent / "migrations"


class MachineStatus(enum.StrEnum):
    """Where a machine is in its life. The cloud-side states are providers' ``MachineState``;
    ``requested`` (the intent is written, nothing launched yet), ``waiting`` (every candidate
    lacked capacity and the intent waits for some: nothing launched, nothing committed) and
    ``failed`` (no candidate launched, or ``down`` before any did) are provisioner's own. A
    ``StrEnum``: the database, the fleet's plain SQL and JSON hold the value itself."""

    REQUESTED = "requested"
    WAITING = "waiting"
    PENDING = "pending"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    PREEMPTED = "preempted"
    TERMINATED = "terminated"
    FAILED = "failed"


S = MachineStatus
#: What the cloud can report of a launched machine (reconcile records whatever it sees).
_CLOUD_SIDE = frozenset({S.PENDING, S.RUNNING, S.STOPPING, S.STOPPED, S.PREEMPTED, S.TERMINATED})
#: The legal moves, from → to. A machine is born ``requested``; only an intent fails; nothing
#: leaves ``terminated`` or ``failed`` (a relaunch is a new row, its name reused). A waiting
#: intent's try makes it ``requested`` again (counted by budgets while it launches, resumed
#: after a crash like any intent), and the try ends launched, waiting again, or failed.
TRANSITIONS: dict[MachineStatus, frozenset[MachineStatus]] = {
    S.REQUESTED: frozenset({S.PENDING, S.RUNNING, S.WAITING, S.FAILED}),
    S.WAITING: frozenset({S.REQUESTED, S.FAILED}),
    **{s: _CLOUD_SIDE - {s} for s in _CLOUD_SIDE - {S.TERMINATED}},
    S.TERMINATED: frozenset(),
    S.FAILED: frozenset(),
}
#: Intents: nothing of them is recorded as launched (no instance, no cloud, no bill).
INTENTS = frozenset({S.REQUESTED, S.WAITING})
#: Statuses a machine is done with: not shown by default; its name may be reused.
ACTIVE_EXCLUDED = (S.TERMINATED.value, S.FAILED.value)
#: Statuses in which the cloud charges for compute, and for the boot disk.
COMPUTE_BILLED = frozenset({S.PENDING, S.RUNNING, S.STOPPING})
DISK_BILLED = COMPUTE_BILLED | {S.STOPPED, S.PREEMPTED}
#: Statuses in which a public IPv4 address bills, by how its cloud bills it (``machines.
#: address_billed``): ``running``, released at stop (AWS auto-assigned, GCP ephemeral, Yandex
#: dynamic); ``held``, kept by a stopped machine until it is deleted (Azure static, an EIP).
ADDRESS_BILLED = {"running": COMPUTE_BILLED, "held": DISK_BILLED}


class IllegalTransition(RuntimeError):
    """A writer asked for a move :data:`TRANSITIONS` does not allow: a bug, never user input."""


def check_transition(old: str | None, new: str) -> MachineStatus:
    """``new`` as a :class:`MachineStatus` if a machine may move there from ``old`` (None: a
    new row, which starts ``requested``); else :class:`IllegalTransition`."""
    to = MachineStatus(new)
    if to not in (TRANSITIONS[MachineStatus(old)] if old else {S.REQUESTED}):
        raise IllegalTransition(f"a machine cannot move from {old or 'nothing'} to {to}")
    return to


class AttemptOutcome(enum.StrEnum):
    """How one candidate of an ``up`` ended: launched, the failure class that blocked its zone,
    region or cloud, or skipped because an earlier failure already blocked it."""

    LAUNCHED = "launched"
    CAPACITY = "capacity"
    QUOTA = "quota"
    AUTH = "auth"
    SETTINGS = "settings"
    INVALID = "invalid"
    ERROR = "error"
    SKIPPED = "skipped"


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def epoch_us(at: datetime) -> int:
    """Microseconds since 1970 (UTC): how the ledger's SQL compares and sums times."""
    return (at - EPOCH) // timedelta(microseconds=1)


def observed(inst: Any, public_ip: str | None) -> tuple[MachineStatus, str | None]:
    """A machine's status and address by its cloud's answer ``inst`` (an Instance, or None: the
    cloud no longer knows it, so it is terminated). A restarted machine may have a new address
    (AWS, GCP and Yandex give dynamic ones; `ssh` must not connect to the old); one reported
    without any keeps the recorded ``public_ip``. Unchanged from the record: nothing to write."""
    if inst is None:
        return MachineStatus.TERMINATED, public_ip
    return MachineStatus(inst.state), inst.public_ip or public_ip


@cache  # the files a process was installed with
def _revisions() -> tuple[frozenset[str], str]:
    """Every migration's revision, and the newest: the one no other revises, read from the
    version files' ``revision`` and ``down_revision`` lines (not Alembic's start-up, ~90 ms;
    tests/test_state.py checks it is Alembic's head)."""
    revisions, revised = set(), set()
    for f in (MIGRATIONS / "versions").glob("*.py"):
        src = f.read_text(encoding="utf-8")
        revisions.update(re.findall(r'^revision = "([^"]+)"', src, re.M))
        revised.update(re.findall(r'^down_revision = "([^"]+)"', src, re.M))
    (head,) = revisions - revised
    return frozenset(revisions), head


def schema_head() -> str:
    return _revisions()[1]


def current_sqlite(url: str) -> sqlite3.Connection | None:
    """A read-only connection to a SQLite state at the current schema, with the standard
    library: SQLAlchemy and the models (~0.3 s of start-up) are for a state to migrate or write
    to. None for anything else (another database, an older schema, an unreadable file): the
    full way migrates or explains."""
    import sqlite3

    path = url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else None
    if not path or path == ":memory:":
        return None
    try:
        # a URI, so read-only: the characters it gives a meaning to, escaped (RFC 3986)
        escaped = path.replace("%", "%25").replace("?", "%3F").replace("#", "%23")
        conn = sqlite3.connect(f"file:{escaped}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return None
    try:
        row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.Error:
        row = None
    if row is None or row[0] != schema_head():
        conn.close()
        return None
    return conn


def current_postgres(url: str) -> Any | None:
    """A read-only connection (:mod:`provisioner.pq`: libpq, without psycopg's or SQLAlchemy's
    start-up) to a PostgreSQL state at the current schema: the URL as settings give it, which
    libpq reads as SQLAlchemy's psycopg dialect passes it (user, password, host, port,
    database, and libpq's own options in its query, such as ``options`` or
    ``application_name``). None for anything else (SQLite, an older schema, a server that
    refuses or is not there, no libpq to load): the full way migrates or explains."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("postgresql", "postgresql+psycopg"):
        return None
    from provisioner import pq

    try:
        conn = pq.connect(f"postgresql://{rest}")
    except pq.Error:
        return None
    try:
        row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    except pq.Error:
        row = None
    if row is None or row[0] != schema_head():
        conn.close()
        return None
    return conn


def known_empty(url: str, all_: bool) -> bool:
    """Whether a SQLite state at the current schema holds no machine to show, asked in one
    query with the standard library (:func:`current_sqlite`)."""
    conn = current_sqlite(url)
    if conn is None:
        return False
    try:
        return holds_none(conn, all_)
    finally:
        conn.close()


def holds_none(conn: Any, all_: bool) -> bool:
    """Whether the state on ``conn`` (sqlite3's, or :func:`current_postgres`'s)
    holds no machine to show (any, with ``all_``)."""
    import sqlite3

    errors: tuple[type[Exception], ...] = (sqlite3.Error,)
    if not isinstance(conn, sqlite3.Connection):
        from provisioner import pq

        errors = (pq.Error,)
    where = "" if all_ else f" WHERE status NOT IN {ACTIVE_EXCLUDED!r}"
    try:
        (machines,) = conn.execute(f"SELECT count(*) FROM machines{where}").fetchone()
    except errors:
        return False
    return bool(machines == 0)
