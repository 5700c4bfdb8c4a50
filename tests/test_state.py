"""The state schema: Alembic migrations apply cleanly on SQLite and PostgreSQL, go down and up
again, and leave exactly the schema the models declare."""

from __future__ import annotations

import subprocess
import sys

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext

from provisioner.models import Base
from provisioner.state import MIGRATIONS, Database, schema_head
from tests.conftest import ROOT


def config(db: Database, conn) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = conn
    return cfg


def drift(db: Database) -> list:
    with db.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": False})
        return [
            d
            for d in compare_metadata(ctx, Base.metadata)
            if not (d[0] == "remove_table" and d[1].name == "alembic_version")
        ]


def test_migrations_match_the_models_and_go_down_and_up(settings):
    db = Database(settings.database_url)
    db.migrate()
    assert drift(db) == []
    with db.engine.begin() as conn:
        command.downgrade(config(db, conn), "base")
    with db.engine.connect() as conn:
        names = set(db.engine.dialect.get_table_names(conn))
    assert names <= {"alembic_version"}
    db.migrate()
    db.migrate()  # idempotent
    assert drift(db) == []
    db.dispose()


AUTOGENERATE = """
import sys
from alembic import command
from alembic.config import Config
from provisioner.state import MIGRATIONS, Database

db = Database(sys.argv[1])
db.migrate()
cfg = Config()
cfg.set_main_option("script_location", str(MIGRATIONS))
with db.engine.connect() as conn:
    cfg.attributes["connection"] = conn
    command.check(cfg)  # autogenerate (compare_metadata) through env.py: raises on any difference
"""


def test_alembic_autogenerate_proposes_nothing_for_a_fresh_database(settings):
    """``alembic check`` in a fresh interpreter, so autogenerate compares the migrated schema
    with only the tables migrations/env.py itself imports: every table must be among them."""
    r = subprocess.run(
        [sys.executable, "-c", AUTOGENERATE, settings.database_url],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "No new upgrade operations detected" in r.stdout + r.stderr


def test_the_fast_path_knows_the_newest_migration():
    from alembic.script import ScriptDirectory

    assert ScriptDirectory(str(MIGRATIONS)).get_heads() == [schema_head()]
