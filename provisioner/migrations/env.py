"""Alembic environment: runs on the connection handed over by ``Database.migrate``."""

from alembic import context
from sqlalchemy import create_engine

from provisioner.models import Base

config = context.config
target_metadata = Base.metadata


def run() -> None:
    conn = config.attributes.get("connection")
    if conn is None:  # plain `alembic` command line use
        url = config.attributes.get("connection_url") or config.get_main_option("sqlalchemy.url")
        if not url:
            raise SystemExit("alembic: set sqlalchemy.url (or run through provisioner)")
        engine = create_engine(url)
        with engine.begin() as conn:
            _configure(conn)
        return
    _configure(conn)


def _configure(conn) -> None:
    context.configure(connection=conn, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


run()
