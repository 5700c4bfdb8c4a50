"""State: machines, their events and usage intervals (SQLAlchemy 2; Alembic migrations).

SQLite in WAL mode by default (file created 0600); any SQLAlchemy URL works, PostgreSQL for teams.
Amounts are stored as exact decimal text and times as UTC.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    create_engine,
    event,
    select,
    text,
)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    mapped_column,
    relationship,
    sessionmaker,
)

ACTIVE_EXCLUDED = ("terminated", "failed")  # a name may be reused once its machine is one of these
SCHEMA_REVISION = "0003"  # the newest migration; tests/test_state.py checks it is Alembic's head


class DecimalText(TypeDecorator[Decimal]):
    """Exact decimals on every backend (SQLite has no decimal type)."""

    impl = String(40)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> str | None:
        return None if value is None else str(Decimal(value))

    def process_result_value(self, value: Any, dialect: Any) -> Decimal | None:
        return None if value is None else Decimal(value)


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in, aware UTC datetimes out, whatever the backend keeps."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the state database")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def new_id() -> str:
    return uuid.uuid4().hex


class Base(DeclarativeBase):
    pass


class Machine(Base):
    """One experiment's machine, from intent to termination. ``status`` is the machine state
    vocabulary plus ``requested`` (intent written, not launched yet) and ``failed``."""

    __tablename__ = "machines"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(64))
    project: Mapped[str] = mapped_column(String(64), index=True)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    spec_path: Mapped[str | None] = mapped_column(Text)
    cloud: Mapped[str | None] = mapped_column(String(16))
    region: Mapped[str | None] = mapped_column(String(64))
    zone: Mapped[str | None] = mapped_column(String(64))
    instance_type: Mapped[str | None] = mapped_column(String(64))
    gpu: Mapped[str | None] = mapped_column(String(16))
    gpu_count: Mapped[int | None] = mapped_column(Integer)
    market: Mapped[str | None] = mapped_column(String(8))  # spot | reserved
    instance_id: Mapped[str | None] = mapped_column(String(128))
    resource_name: Mapped[str | None] = mapped_column(String(64))
    rate: Mapped[Decimal | None] = mapped_column(DecimalText)  # per hour, fixed at launch
    currency: Mapped[str | None] = mapped_column(String(3))
    disk_gb: Mapped[int | None] = mapped_column(Integer)
    disk_rate: Mapped[Decimal | None] = mapped_column(DecimalText)  # per hour, fixed at launch
    public_ip: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    launched_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    terminated_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # scheduler (0002): sha256 of the agent's heartbeat token; `provisioner keep NAME --until`
    agent_token_hash: Mapped[str | None] = mapped_column(String(64), unique=True, index=True)
    kept_until: Mapped[datetime | None] = mapped_column(UTCDateTime)

    events: Mapped[list[Event]] = relationship(
        back_populates="machine", order_by="Event.id", cascade="all, delete-orphan"
    )

    __table_args__ = (
        # one live machine per name: a second concurrent `up` of the same name fails to insert
        Index(
            "uq_machines_live_name",
            "name",
            unique=True,
            sqlite_where=text("status NOT IN ('terminated', 'failed')"),
            postgresql_where=text("status NOT IN ('terminated', 'failed')"),
        ),
    )

    @property
    def is_live(self) -> bool:
        return self.status not in ACTIVE_EXCLUDED


class Event(Base):
    __tablename__ = "events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    machine_id: Mapped[str] = mapped_column(ForeignKey("machines.id"), index=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    kind: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str | None] = mapped_column(String(64))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)

    machine: Mapped[Machine] = relationship(back_populates="events")

    __table_args__ = (Index("ix_events_reason_at", "reason", "at"),)  # scheduler stops, budget


class UsageInterval(Base):
    """A span of billing at one rate: ``compute`` while the machine runs, ``disk`` while it
    exists. Open intervals have no end. (machine, kind, start) is unique: re-recording a
    transition never double-counts."""

    __tablename__ = "usage_intervals"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    machine_id: Mapped[str] = mapped_column(ForeignKey("machines.id"), index=True)
    kind: Mapped[str] = mapped_column(String(8))  # compute | disk
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    rate: Mapped[Decimal] = mapped_column(DecimalText)  # per hour
    currency: Mapped[str] = mapped_column(String(3))

    __table_args__ = (
        UniqueConstraint("machine_id", "kind", "started_at", name="uq_usage_machine_kind_start"),
        Index("ix_usage_period", "started_at", "ended_at"),
    )


# --- the database ---------------------------------------------------------------------------


class Database:
    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = _engine(url)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)

    def migrate(self) -> None:
        """Bring the schema to the newest Alembic revision. Idempotent, and safe when several
        processes start at once on a new database: one migrates, the others wait and find it
        done (a file lock beside a SQLite file; an advisory lock on PostgreSQL). A database
        already at ``SCHEMA_REVISION`` costs one query, not Alembic's start-up (~90 ms)."""
        if self._revision() == SCHEMA_REVISION:
            return
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
        cfg.attributes["connection_url"] = self.url
        with self._migration_lock(), self.engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(7270011)"))
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    def _revision(self) -> str | None:
        try:
            with self.engine.connect() as conn:
                return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except DBAPIError:  # a new database: no version table yet
            return None

    @contextmanager
    def _migration_lock(self) -> Iterator[None]:
        path = self.engine.url.database if self.engine.dialect.name == "sqlite" else None
        if not path or path == ":memory:":
            yield
            return
        import fcntl

        fd = os.open(f"{path}.migrate-lock", os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A unit of work: committed on success, rolled back on error."""
        with self.sessions() as s:
            try:
                yield s
                s.commit()
            except BaseException:
                s.rollback()
                raise

    def dispose(self) -> None:
        self.engine.dispose()


def _engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[1] if "///" in url else ""
        if path and path != ":memory:":
            p = Path(path)
            p.parent.mkdir(parents=True, exist_ok=True)
            if not p.exists():  # state holds project names and addresses: private to its owner
                fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o600)
                os.close(fd)
        engine = create_engine(url, connect_args={"timeout": 30}, json_serializer=_dumps)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return create_engine(url, pool_pre_ping=True, json_serializer=_dumps)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=str, sort_keys=True)


def live_machine(s: Session, name: str) -> Machine | None:
    return s.scalars(
        select(Machine).where(Machine.name == name, Machine.status.not_in(ACTIVE_EXCLUDED))
    ).first()
