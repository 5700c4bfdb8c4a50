"""The state schema: Alembic migrations apply cleanly on SQLite and PostgreSQL, go down and up
again, and leave exactly the schema the models declare."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext

import provisioner.budget
import provisioner.idle
import provisioner.scheduler
import provisioner.state
from provisioner.state import SCHEMA_REVISION, Base, Database

TABLE_MODULES = (provisioner.budget, provisioner.idle, provisioner.scheduler)  # their tables


def config(db: Database, conn) -> Config:
    cfg = Config()
    cfg.set_main_option(
        "script_location", str(Path(provisioner.budget.__file__).parent / "migrations")
    )
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


def test_the_fast_path_knows_the_newest_migration():
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(Path(provisioner.state.__file__).parent / "migrations"))
    assert script.get_heads() == [SCHEMA_REVISION]
