"""The state schema's revisions, read from the migration files themselves: the standard library
only, so a command can tell whether a database is current (and whether it holds any machine)
before loading SQLAlchemy."""

from __future__ import annotations

import re
from pathlib import Path

MIGRATIONS = Path(__file__).parent / "migrations"
#: Statuses a machine is done with: not shown by default; its name may be reused.
ACTIVE_EXCLUDED = ("terminated", "failed")


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


def known_empty(url: str, all_: bool) -> bool:
    """Whether a SQLite state at the current schema holds no machine to show, asked in one
    query with the standard library: SQLAlchemy and the models (~0.3 s of start-up) are for
    a state that has something to say. Anything else (another database, an older schema, an
    unreadable file) goes the full way, which migrates or explains."""
    import sqlite3

    path = url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else None
    if not path or path == ":memory:":
        return False
    where = "" if all_ else f" WHERE status NOT IN {ACTIVE_EXCLUDED!r}"
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5) as conn:
            version, machines = conn.execute(
                "SELECT (SELECT version_num FROM alembic_version),"
                f" (SELECT count(*) FROM machines{where})"
            ).fetchone()
    except sqlite3.Error:
        return False
    return version == schema_head() and machines == 0
