"""The state database: engine, sessions and Alembic migrations (the tables are in
:mod:`provisioner.models`).

SQLite in WAL mode by default (file created 0600); any SQLAlchemy URL works, PostgreSQL for teams.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, inspect, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, InvalidRequestError
from sqlalchemy.orm import Session, sessionmaker

from provisioner import acting
from provisioner.errors import OperationFailed, UserError
from provisioner.models import ACTIVE_EXCLUDED, Event, Machine
from provisioner.schema import (
    MIGRATIONS,
    SIMULATED,
    STATE_CLOCK,
    STATE_CLOCK_SQL,
    _revisions,
    schema_head,
)
from provisioner.settings import DatabaseSettings


class DatabaseUnusable(UserError):
    """The state database cannot be opened or is not ours to migrate: what it is, what to do."""


class Database:
    def __init__(self, url: str, timeouts: DatabaseSettings | None = None) -> None:
        self.url = url
        self.engine = _engine(url, timeouts or DatabaseSettings())
        self.sessions = sessionmaker(self.engine, expire_on_commit=False, info={})
        event.listen(self.sessions, "before_flush", _stamp_actor)
        self._refusal: dict[str, UserError] = {}  # why this process may not write, by cause
        self._simulated: bool | None = None
        event.listen(
            self.engine, "before_cursor_execute", functools.partial(_refuse_writes, self._refusal)
        )

    def refuse_writes(self, why: str | UserError | None, cause: str = "member") -> None:
        """From now on every write (INSERT, UPDATE, DELETE, DDL, GRANT…) of this process is
        refused with ``why`` (a :class:`UserError`, or that error itself) for ``cause`` (a
        role no team member, a what-if's clock); None: allowed again for that cause. Reads
        stay open."""
        if why is None:
            self._refusal.pop(cause, None)
        else:
            self._refusal[cause] = why if isinstance(why, UserError) else UserError(why)

    @property
    def actor(self) -> str | None:
        """Who causes what this process writes (the App sets it): every new event records it."""
        actor: str | None = self.sessions.kw["info"].get("actor")
        return actor

    @actor.setter
    def actor(self, who: str | None) -> None:
        self.sessions.kw["info"]["actor"] = who

    def migrate(self, *, simulated: bool = False) -> None:
        """Bring the schema to the newest Alembic revision. Idempotent, and safe when several
        processes start at once on a new database: one migrates, the others wait and find it
        done (a file lock beside a SQLite file; an advisory lock on PostgreSQL). A database
        already at :func:`schema_head` costs one query, not Alembic's start-up (~90 ms).
        A database that cannot be read, or one a newer provisioner migrated, is left as it is:
        :class:`DatabaseUnusable`.

        ``simulated``: this process runs on a simulated clock; a state this call makes (there
        was no schema at all) is marked as made on one (:mod:`provisioner.realclock`). A state
        that exists, at any revision, is never marked."""
        revision = self.revision()
        if revision == schema_head():
            return
        if revision is not None and revision not in _revisions()[0]:
            raise DatabaseUnusable(
                f"the state database ({self.where}) is at schema revision {revision}, which "
                f"this provisioner does not know (its newest is {schema_head()}): a newer "
                "version wrote it; upgrade provisioner"
            )
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        cfg.attributes["connection_url"] = self.url
        with self._migration_lock(), self.engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(7270011)"))
            cfg.attributes["connection"] = conn
            made = simulated and not inspect(conn).has_table("alembic_version")
            command.upgrade(cfg, "head")
            if made:  # in the migration's transaction: a state is made marked, or not at all
                conn.execute(
                    text("INSERT INTO state_meta (key, value) VALUES (:k, :v)"),
                    {"k": STATE_CLOCK, "v": SIMULATED},
                )

    @property
    def simulated(self) -> bool:
        """Whether this state was made on a simulated clock (:meth:`migrate`): read once."""
        if self._simulated is None:
            try:
                with self.engine.connect() as conn:
                    self._simulated = conn.execute(text(STATE_CLOCK_SQL)).scalar() == SIMULATED
            except DBAPIError:  # not readable (not migrated, not granted): a real state
                self._simulated = False
        return self._simulated

    def revision(self) -> str | None:
        """The schema's revision; None for a new database (no version table yet)."""
        try:  # one query: asking first whether the table exists would be a second
            with self.engine.connect() as conn:
                return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except DBAPIError as e:
            # PostgreSQL's undefined_table (42P01), SQLite's "no such table"
            if getattr(e.orig, "sqlstate", None) == "42P01" or "no such table" in str(e.orig):
                return None
            raise self._unusable(e) from None

    @property
    def where(self) -> str:
        """The database, for a message: never its password."""
        return self.engine.url.render_as_string(hide_password=True)

    def _unusable(self, e: DBAPIError) -> DatabaseUnusable:
        reason = str(e.orig).strip().splitlines()[0] if e.orig else type(e).__name__
        if self.engine.dialect.name == "sqlite":
            todo = (
                "move it aside (a new one is created) or restore a backup"
                if "not a database" in reason or "malformed" in reason
                else "check that the file and its directory are readable and writable"
            )
        else:
            todo = "check state_url in settings and that the server runs and lets you in"
        return DatabaseUnusable(f"cannot use the state database ({self.where}): {reason}; {todo}")

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
    def session(self, *, snapshot: bool = False) -> Iterator[Session]:
        """A unit of work: committed on success, rolled back on error. ``snapshot``: every
        read sees the database as of its first one (PostgreSQL's REPEATABLE READ; on SQLite
        an explicit read transaction) — for sums over several queries while others write, e.g.
        a budget's live machines and launching intents, which a launch moves between."""
        with self.sessions() as s:
            if snapshot and self.engine.dialect.name == "postgresql":
                s.connection(execution_options={"isolation_level": "REPEATABLE READ"})
            elif snapshot:  # pysqlite runs a SELECT outside any transaction unless one is begun
                s.execute(text("BEGIN"))
            try:
                yield s
                s.commit()
            except BaseException as e:
                try:
                    s.rollback()
                except InvalidRequestError:  # e.g. Ctrl-C inside commit(): the first error tells
                    raise e from None
                raise

    @contextmanager
    def lock(self, name: str, *, timeout: float = 600) -> Iterator[None]:
        """Hold the named lock (one holder across threads, processes and, on PostgreSQL,
        hosts) for the block; waits up to ``timeout`` seconds, then raises :class:`LockBusy`.
        Released when the holder dies, however it dies: a ``flock`` on a file beside a SQLite
        file (held by the open file, which the kernel closes), a session-level advisory lock on
        PostgreSQL (held by the connection). ``up`` serialises its limit checks and intent write
        under ``intents``, and holds ``intent-<id>`` while it launches one intent."""
        deadline = time.monotonic() + timeout
        if self.engine.dialect.name == "postgresql":
            with self._advisory_lock(name, deadline):
                yield
            return
        path = self.engine.url.database if self.engine.dialect.name == "sqlite" else None
        if not path or path == ":memory:":  # one process owns such a database
            with _local_lock(f"{self.url}|{name}"):
                yield
            return
        with _file_lock(f"{path}.{name}.lock", name, deadline):
            yield

    @contextmanager
    def _advisory_lock(self, name: str, deadline: float) -> Iterator[None]:
        key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big", signed=True)
        args = {"c": _LOCK_CLASS, "k": key}
        with self.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            while not conn.execute(text("SELECT pg_try_advisory_lock(:c, :k)"), args).scalar():
                _wait_or_give_up(name, deadline)
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:c, :k)"), args)

    def dispose(self) -> None:
        self.engine.dispose()


#: the first word of a statement that changes the state (anything else only reads or locks)
_WRITES = frozenset(
    {"INSERT", "UPDATE", "DELETE", "REPLACE", "UPSERT", "MERGE", "TRUNCATE"}
    | {"CREATE", "DROP", "ALTER", "GRANT", "REVOKE", "COPY"}
)


def _refuse_writes(
    refusal: dict[str, UserError], _conn: Any, _cursor: Any, statement: str, *_: Any
) -> None:
    """A statement that writes, refused when the Database says so (a module function holding
    the refusal, not the Database: see :func:`_stamp_actor`)."""
    if refusal and statement.lstrip().split(None, 1)[0].upper() in _WRITES:
        raise next(iter(refusal.values()))


def _stamp_actor(session: Session, _ctx: Any, _instances: Any) -> None:
    """Each new event records the session's actor (a module function: a listener bound to
    the Database would keep it, its engine and a SQLite file's WAL alive past its use)."""
    actor = acting.current() or session.info.get("actor")
    if actor is None:
        return
    for obj in session.new:
        if isinstance(obj, Event) and obj.actor is None:
            obj.actor = actor


class LockBusy(OperationFailed):
    """Another process held a lock for longer than the wait allowed."""


_LOCK_CLASS = 7270014  # advisory lock key space of provisioner's named locks
_local_locks: dict[str, threading.Lock] = {}
_local_guard = threading.Lock()


def _local_lock(key: str) -> threading.Lock:
    with _local_guard:
        return _local_locks.setdefault(key, threading.Lock())


@contextmanager
def _file_lock(path: str, name: str, deadline: float) -> Iterator[None]:
    """``flock`` on ``path``, removed by its holder before release (no file per intent is
    left behind); a waiter that then holds a removed file tries the new one."""
    import fcntl

    while True:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    _wait_or_give_up(name, deadline)
            with contextlib.suppress(FileNotFoundError):
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


def _wait_or_give_up(name: str, deadline: float) -> None:
    if time.monotonic() >= deadline:
        raise LockBusy(f"another provisioner process still holds {name}; try again later")
    time.sleep(0.05)


def _engine(url: str, timeouts: DatabaseSettings) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[1] if "///" in url else ""
        if path and path != ":memory:":
            p = Path(path)
            if p.is_dir():
                raise DatabaseUnusable(
                    f"the state database {p} is a directory: move it aside or set state_url"
                )
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
                if not p.exists():  # state holds project names and addresses: its owner's
                    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o600)
                    os.close(fd)
            except OSError as e:
                raise DatabaseUnusable(
                    f"cannot create the state database {p}: {e.strerror}; set home or "
                    "state_url in settings to a writable place"
                ) from None
        busy = timeouts.busy_timeout_seconds
        engine = create_engine(url, connect_args={"timeout": busy}, json_serializer=_dumps)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute(f"PRAGMA busy_timeout={busy * 1000}")
            cur.close()

        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    # libpq's connect_timeout bounds the whole connection (a server that accepts it and never
    # answers included); statement_timeout, set on each new connection (the URL's own
    # ``options`` stay as they are), bounds each statement on the server
    engine = create_engine(
        url,
        pool_pre_ping=True,
        json_serializer=_dumps,
        connect_args={"connect_timeout": timeouts.connect_timeout_seconds},
    )
    statement_ms = timeouts.statement_timeout_seconds * 1000

    @event.listens_for(engine, "connect")
    def _statement_timeout(dbapi_conn: Any, _: Any) -> None:
        with dbapi_conn.cursor() as cur:
            cur.execute(f"SET statement_timeout = {statement_ms}")
        dbapi_conn.commit()

    return engine


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=str, sort_keys=True)


def machine(s: Session, machine_id: str) -> Machine:
    """The row of ``machine_id``. Rows are never deleted, so a missing one means the state
    database was changed under us: a clear error, not an AttributeError."""
    m = s.get(Machine, machine_id)
    if m is None:
        raise OperationFailed(
            f"machine {machine_id} is missing from the state database (was it edited by hand?)"
        )
    return m


def named_machine(s: Session, name: str) -> Machine | None:
    """The machine ``name`` means: the live one, else the newest of that name."""
    return (
        live_machine(s, name)
        or s.scalars(
            select(Machine).where(Machine.name == name).order_by(Machine.created_at.desc())
        ).first()
    )


def live_machine(s: Session, name: str) -> Machine | None:
    return s.scalars(
        select(Machine).where(Machine.name == name, Machine.status.not_in(ACTIVE_EXCLUDED))
    ).first()


def live_machines(s: Session) -> list[Machine]:
    """Every machine not terminated or failed (intents and waiting ones included)."""
    return list(s.scalars(select(Machine).where(Machine.status.not_in(ACTIVE_EXCLUDED))))
