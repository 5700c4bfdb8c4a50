"""Read-only queries on PostgreSQL through libpq itself — the library psycopg ships and
SQLAlchemy's driver calls — loaded with :mod:`ctypes`: ~0.01 s of start-up where importing
psycopg costs ~0.15 s on a 2-core machine (bench/bench_status.py). libpq reads the URL, the
PG* variables, ~/.pgpass, SSL and authentication exactly as for psycopg. For ``status``
(:mod:`provisioner.entry`): anything unusual — no libpq found, a value of a type not read
here — is :class:`Error` or None, and the full way (SQLAlchemy) answers.

Only what :class:`provisioner.fleet.Sql` uses: ``execute``/``cursor``, ``fetchone``/``fetchall``,
``%s`` placeholders. Values come back as psycopg gives them: int, Decimal, aware datetimes,
parsed JSON, str."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Sequence
from datetime import date, datetime
from decimal import Decimal
from functools import cache
from pathlib import Path
from typing import Any

_OK = (1, 2)  # PGRES_COMMAND_OK, PGRES_TUPLES_OK
_TYPES = {bool: 16, int: 20, Decimal: 1700, datetime: 1184, date: 1082}  # OIDs (pg_type.dat)


class Error(Exception):
    """libpq refused or failed: the full way says why, in words."""


#: How each type's text form reads, by OID (PostgreSQL's src/include/catalog/pg_type.dat);
#: any other type is kept as text.
_READ: dict[int, Any] = {
    16: lambda v: v == b"t",
    20: int,
    21: int,
    23: int,
    26: int,
    700: float,
    701: float,
    1700: lambda v: Decimal(v.decode()),
    1082: lambda v: date.fromisoformat(v.decode()),
    1114: lambda v: datetime.fromisoformat(v.decode()),
    1184: lambda v: datetime.fromisoformat(v.decode()),
    114: json.loads,
    3802: json.loads,
}


@cache
def _lib() -> Any:
    """libpq, as psycopg-binary bundles it, else the system's; None if neither loads."""
    import sys

    candidates = [  # beside the psycopg_binary package (a Linux wheel's bundled libraries)
        str(lib)
        for d in sys.path
        if d  # not the working directory: a library is loaded from where it is installed
        for lib in sorted(Path(d).glob("psycopg_binary.libs/libpq-*.so*"))
    ]
    candidates += ["libpq.so.5", "libpq.5.dylib"]
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        p, i, s, u = ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint
        for fn, res, args in (
            ("PQconnectdb", p, [s]),
            ("PQstatus", i, [p]),
            ("PQfinish", None, [p]),
            ("PQexec", p, [p, s]),
            ("PQexecParams", p, [p, s, i, ctypes.POINTER(u), ctypes.POINTER(s), p, p, i]),
            ("PQresultStatus", i, [p]),
            ("PQntuples", i, [p]),
            ("PQnfields", i, [p]),
            ("PQftype", u, [p, i]),
            ("PQgetisnull", i, [p, i, i]),
            ("PQgetvalue", s, [p, i, i]),
            ("PQclear", None, [p]),
        ):  # fmt: skip
            f = getattr(lib, fn)
            f.restype, f.argtypes = res, args
        return lib
    return None


#: the defaults of settings' database timeouts (:class:`provisioner.settings.DatabaseSettings`):
#: this fast path reads before settings are
CONNECT_TIMEOUT = 5
STATEMENT_TIMEOUT = 60


def connect(url: str, connect_timeout: int | None = None) -> Connection:
    """A connection for reading, in one read-only transaction (as a session's reads are),
    with ISO times in UTC and UTF-8 text; :class:`Error` if it cannot be had."""
    lib = _lib()
    if lib is None:
        raise Error("no libpq")
    if "connect_timeout=" not in url:  # a server that accepts and never answers: not a hang
        wait = connect_timeout or CONNECT_TIMEOUT
        url += ("&" if "?" in url else "?") + f"connect_timeout={wait}"
    handle = lib.PQconnectdb(url.encode())
    if not handle:
        raise Error("out of memory")
    conn = Connection(lib, handle)
    if lib.PQstatus(handle) != 0:  # CONNECTION_OK
        conn.close()
        raise Error("cannot connect")
    try:
        conn.execute(
            "SET client_encoding TO 'UTF8'; SET DateStyle TO 'ISO'; SET TimeZone TO 'UTC';"
            f" SET statement_timeout TO {STATEMENT_TIMEOUT * 1000}; BEGIN READ ONLY"
        )
    except Error:
        conn.close()
        raise
    return conn


class Connection:
    def __init__(self, lib: Any, handle: int) -> None:
        self.lib, self.handle = lib, handle

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor:
        cur = Cursor(self)
        cur.execute(sql, params)
        return cur

    def cursor(self) -> Cursor:
        return Cursor(self)

    def close(self) -> None:
        if self.handle:
            self.lib.PQfinish(self.handle)  # the read-only transaction ends with it
            self.handle = 0


class Cursor:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.rows: list[tuple[Any, ...]] = []

    def execute(self, sql: str, params: Sequence[Any] = ()) -> None:
        lib, handle = self.conn.lib, self.conn.handle
        if not handle:
            raise Error("the connection is closed")
        if params:
            parts = sql.split("%s")
            if len(parts) != len(params) + 1:
                raise Error("placeholders and parameters differ in number")
            sql = parts[0] + "".join(f"${i}{p}" for i, p in enumerate(parts[1:], 1))
            n = len(params)
            types = (ctypes.c_uint * n)(*(_TYPES.get(type(v), 0) for v in params))
            values = (ctypes.c_char_p * n)(*(_param(v) for v in params))
            res = lib.PQexecParams(handle, sql.encode(), n, types, values, None, None, 0)
        else:
            res = lib.PQexec(handle, sql.encode())
        if not res:
            raise Error("no result")
        try:
            if lib.PQresultStatus(res) not in _OK:
                raise Error("the query failed")
            self.rows = _rows(lib, res)
        finally:
            lib.PQclear(res)

    def fetchall(self) -> list[tuple[Any, ...]]:
        rows, self.rows = self.rows, []
        return rows

    def fetchone(self) -> tuple[Any, ...] | None:
        return self.rows.pop(0) if self.rows else None

    def close(self) -> None:
        self.rows = []


def _param(v: Any) -> bytes | None:
    """A parameter's text form, as PostgreSQL reads it for the type :data:`_TYPES` names."""
    if v is None:
        return None
    if isinstance(v, bool):
        return b"t" if v else b"f"
    if isinstance(v, datetime | date):
        return v.isoformat().encode()
    return str(v).encode()


def _rows(lib: Any, res: int) -> list[tuple[Any, ...]]:
    """Every row, read column by column: one libpq call a value (NULL and '' both come back
    empty: only those are asked which they are)."""
    rows = range(lib.PQntuples(res))
    get, isnull = lib.PQgetvalue, lib.PQgetisnull
    columns = []
    for f in range(lib.PQnfields(res)):
        read = _READ.get(lib.PQftype(res, f))
        values = [get(res, r, f) for r in rows]
        columns.append(
            [
                None if not v and isnull(res, r, f) else v.decode() if read is None else read(v)
                for r, v in zip(rows, values, strict=True)
            ]
        )
    return list(zip(*columns, strict=True)) if columns else [() for _ in rows]
