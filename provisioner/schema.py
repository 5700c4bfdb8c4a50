"""The state schema's revisions, read from the migration files themselves, and its vocabulary:
the standard library only, so a command can tell whether a database is current (and whether it
holds any machine) before loading SQLAlchemy."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import sqlite3

MIGRATIONS = Path(__file__).parent / "migrations"
#: Statuses a machine is done with: not shown by default; its name may be reused.
ACTIVE_EXCLUDED = ("terminated", "failed")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def epoch_us(at: datetime) -> int:
    """Microseconds since 1970 (UTC): how the ledger's SQL compares and sums times."""
    return (at - EPOCH) // timedelta(microseconds=1)


def observed(inst: Any, public_ip: str | None) -> tuple[str, str | None]:
    """A machine's status and address by its cloud's answer ``inst`` (an Instance, or None: the
    cloud no longer knows it, so it is terminated). A restarted machine may have a new address
    (AWS, GCP and Yandex give dynamic ones; `ssh` must not connect to the old); one reported
    without any keeps the recorded ``public_ip``. Unchanged from the record: nothing to write."""
    if inst is None:
        return "terminated", public_ip
    return str(inst.state), inst.public_ip or public_ip


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


def holds_none(conn: sqlite3.Connection, all_: bool) -> bool:
    """Whether the state on ``conn`` holds no machine to show (any, with ``all_``)."""
    import sqlite3

    where = "" if all_ else f" WHERE status NOT IN {ACTIVE_EXCLUDED!r}"
    try:
        (machines,) = conn.execute(f"SELECT count(*) FROM machines{where}").fetchone()
    except sqlite3.Error:
        return False
    return bool(machines == 0)
