"""The state schema's revisions, read from the migration files themselves: the standard library
only, so a command can tell whether a database is current before loading SQLAlchemy."""

from __future__ import annotations

import re
from pathlib import Path

MIGRATIONS = Path(__file__).parent / "migrations"


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
