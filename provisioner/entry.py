"""The console entry point. ``provisioner status`` — the command a team runs most, often a new
user's first — is answered here, when it can be, without Typer, SQLAlchemy or the ORM (~0.6 s of
start-up on a 2-core machine, ~3/4 of `status` over 1,000 machines: bench/bench_status.py): a
state at the current schema, SQLite (sqlite3) or PostgreSQL (libpq, as psycopg calls it:
:mod:`provisioner.pq`), whose machines every cloud lists as recorded, so reconciling would
write nothing. Settings are read with pydantic only when a file or variable asks for it or a
cloud is to be asked. It reads and draws with :mod:`provisioner.fleet`, as the Typer command
does. Anything else — a state to migrate, a server that refuses, a machine the clouds moved, a
cloud that cannot be asked — goes to the Typer app (:mod:`provisioner.cli.main`), which
reconciles and gives the same answer, or the error with its file, line or variable."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from provisioner.location import HEARTBEAT_GRACE_SECONDS, plain_database_url
from provisioner.schema import EventKind as K
from provisioner.schema import MachineStatus as S
from provisioner.schema import current_postgres, current_sqlite, holds_none, made_simulated

if TYPE_CHECKING:
    from provisioner.fleet import Sql
    from provisioner.settings import Settings


FAST_CONNECT = 3  # seconds


def main() -> None:
    if _status(sys.argv[1:]):
        sys.exit(0)
    from provisioner.cli.main import main as typer_main

    typer_main()


def _status_options(argv: list[str]) -> tuple[str | None, bool, bool, bool] | None:
    """(config, --all, -o json, refresh) of ``[-c FILE] status [-a] [-o table|json]
    [--[no-]refresh]``, each option at most once; None for any other command line (Click
    parses it)."""
    config, i = None, 0
    if argv[:1] in (["-c"], ["--config"]) and len(argv) > 1:
        config, i = argv[1], 2
    elif argv[:1] and argv[0].startswith("--config="):
        config, i = argv[0].partition("=")[2], 1
    if argv[i : i + 1] != ["status"]:
        return None
    given: dict[str, str] = {}
    rest = iter(argv[i + 1 :])
    for a in rest:
        if a in ("-a", "--all"):
            key, value = "all", a
        elif a in ("--refresh", "--no-refresh"):
            key, value = "refresh", a
        elif a in ("-o", "--output"):
            key, value = "output", next(rest, "")
        elif a.startswith("--output="):
            key, value = "output", a.partition("=")[2]
        else:
            return None
        if key in given:
            return None
        given[key] = value
    if given.get("output", "table") not in ("table", "json"):
        return None
    return (
        config,
        "all" in given,
        given.get("output") == "json",
        given.get("refresh") != "--no-refresh",
    )


def _status(argv: list[str]) -> bool:
    """Whether this was ``status`` of the whole fleet, now answered."""
    options = _status_options(argv)
    if options is None:
        return False
    config, all_, as_json, refresh = options
    from provisioner.clock import clock_from_env
    from provisioner.errors import ProvisionerError

    try:
        clock = clock_from_env()
    except ProvisionerError:  # the Typer app says what is wrong with it
        return False
    opened = _open_state(config)
    if opened is None:
        return False  # settings to report, a state to migrate, a server to explain
    conn, postgres, settings = opened
    note, may_refresh = _clock_note(conn, clock)
    if holds_none(conn, all_):  # one query, and nothing more to load
        hint = postgres and not as_json and _no_team_rules(conn)
        conn.close()
        _say_note(note)
        _show_none(as_json, all_)
        _hint(hint)
        return True
    from provisioner.fleet import Sql, read, show, team_rules_missing

    try:
        sql = Sql(conn, postgres=postgres)
        if refresh and may_refresh and not _quiet(sql, settings, config, clock):
            return False  # the clouds or a job moved something: the full way writes it
        now = clock.now()
        grace = settings.scheduler.heartbeat_grace_seconds if settings else HEARTBEAT_GRACE_SECONDS
        fleet = read(sql, all_=all_, now=now, seen_since=now - timedelta(seconds=grace))
        hint = not as_json and team_rules_missing(sql)
    except Exception as e:
        if not _expected(e):
            raise  # a bug: shown, not hidden behind the slow path
        return False  # the Typer app explains
    finally:
        conn.close()
    _say_note(note)
    show(fleet, as_json=as_json, all_=all_)
    _hint(hint)
    return True


def _open_state(config: str | None) -> tuple[Any, bool, Any] | None:
    """The state's connection as the fast path reads it (libpq or sqlite3), whether it is
    PostgreSQL, and the settings when they had to be read; None: leave it to the full way."""
    from provisioner.errors import ConfigError, ProvisionerError

    url, settings = plain_database_url(config), None
    if url is None:  # a file or variable to validate
        try:
            settings = _settings(config)
        except (ConfigError, ProvisionerError, OSError):
            return None  # the Typer app reports it, as for any command
        url = settings.database_url
    postgres = not url.startswith("sqlite")
    # a server slow to answer is left to the full way, which waits database.connect_timeout
    # seconds and says why: here at most FAST_CONNECT seconds, so a mute one costs not twice
    wait = min(
        settings.database.connect_timeout_seconds if settings else FAST_CONNECT, FAST_CONNECT
    )
    conn = current_postgres(url, wait) if postgres else current_sqlite(url)
    return None if conn is None else (conn, postgres, settings)


def _quiet(sql: Any, settings: Any, config: str | None, clock: Any) -> bool:
    """Whether nothing moved that the full way must write: the clouds agree with the state
    (reconciling writes), and no job is to be asked about or a run to be started."""
    return _as_recorded(sql, lambda: settings or _settings(config), clock.now) and _jobs_quiet(sql)


def _show_none(as_json: bool, all_: bool) -> None:
    from provisioner.console import no_machines, print_json, say

    if as_json:
        print_json([])
    else:
        say(no_machines(all_))


def _no_team_rules(conn: Any) -> bool:
    from provisioner.fleet import Sql, team_rules_missing

    try:
        return team_rules_missing(Sql(conn, postgres=True))
    except Exception as e:
        if not _expected(e):
            raise
        return False  # the hint is not worth a failure


def _hint(said: bool) -> None:
    """A team's PostgreSQL state without team rules yet: said, as the full way says it."""
    if said:
        from provisioner.console import err
        from provisioner.fleet import NOT_APPLIED

        err.print(f"[yellow]hint:[/] {NOT_APPLIED}", soft_wrap=True, highlight=False)


def _clock_note(conn: Any, clock: Any) -> tuple[str | None, bool]:
    """What the Typer ``status`` says of its clock (:func:`provisioner.realclock.status_clock`),
    and whether it may ask the clouds (never on a simulated clock over a real state:
    reconciling writes)."""
    simulated = made_simulated(conn)
    if not (simulated or clock.simulated):
        return None, True
    from provisioner import realclock

    if simulated:
        return realclock.SIMULATED_NOTE, True
    return realclock.what_if_note(clock.now()), False


def _say_note(note: str | None) -> None:
    if note:
        sys.stderr.write(f"note: {note}\n")


def _expected(e: Exception) -> bool:
    """The failures the Typer app reports in words: a state it cannot read (locked, damaged: a
    value not of its type; libpq's errors when the state is on PostgreSQL), settings to
    report, a cloud it cannot ask (its errors' module is loaded by then: not imported here, it
    costs pydantic)."""
    import sqlite3

    from provisioner.errors import ConfigError, ProvisionerError

    kinds: tuple[type[Exception], ...] = (
        sqlite3.Error,
        ValueError,
        OSError,
        ConfigError,
        ProvisionerError,
    )
    if "provisioner.pq" in sys.modules:
        kinds += (sys.modules["provisioner.pq"].Error,)
    if "providers.base" in sys.modules:
        kinds += (sys.modules["providers.base"].ProviderError,)
    return isinstance(e, kinds)


def _settings(config: str | None) -> Settings:
    from provisioner.settings import load_settings

    return load_settings(config)


def _as_recorded(sql: Sql, settings: Callable[[], Settings], now: Callable[[], datetime]) -> bool:
    """Whether each cloud finds every machine that reconciling would ask it about as recorded
    (:func:`provisioner.schema.observed`, the rule of :func:`provisioner.machines.reconcile`):
    the list calls reconciling makes, one per cloud, and nothing it would write."""
    from provisioner.schema import observed

    by_cloud: dict[str, list[Any]] = {}
    for row in sql.all(
        "SELECT cloud, region, instance_id, status, public_ip FROM machines"
        f" WHERE status NOT IN ('{S.REQUESTED}', '{S.WAITING}', '{S.TERMINATED}', '{S.FAILED}')"
    ):
        by_cloud.setdefault(row[0], []).append(row)
    if not by_cloud:
        return True  # nothing to ask: no settings to read
    loaded = settings()
    for cloud, asked in by_cloud.items():
        provider = loaded.adapter(cloud, now)
        try:
            listed = {i.id: i for i in provider.list_managed(sorted({r[1] for r in asked if r[1]}))}
        finally:
            provider.close()  # the sandbox's file
        for _, _, instance_id, status, public_ip in asked:
            inst = listed.get(instance_id or "")
            if inst is None or observed(inst, public_ip) != (status, public_ip):
                return False  # to write, or to ask about directly (not listed)
    return True


#: provisioner.machines.jobs's event kinds, and its `run` job's id (not imported: it loads
#: SQLAlchemy).
_STARTED, _FINISHED, _FAILED, _DUE = (
    K.JOB_STARTED.value,
    K.JOB_FINISHED.value,
    K.JOB_FAILED.value,
    K.RUN_DUE.value,
)
_RUN = "run"


def _jobs_quiet(sql: Sql) -> bool:
    """Whether :func:`provisioner.jobs.finish.check`, which the full way runs after reconciling,
    would find nothing to do: no live machine with a job its events say still runs (started,
    no end of that job since), and no running machine whose experiment's ``run`` is due (the
    rule of :func:`provisioner.machines.jobs.run_due`: its latest ``run-due``, or no start,
    failure or end by itself of its ``run`` since)."""
    live = f"SELECT id FROM machines WHERE status IN ('{S.RUNNING}', '{S.PENDING}')"
    runs: dict[str, set[str]] = {}  # each machine's jobs started and not ended since
    mark: dict[str, str] = {}  # each machine's latest event that decides whether its run is due
    for mid, kind, reason, detail in sql.all(
        "SELECT machine_id, kind, reason, detail FROM events WHERE kind IN (?, ?, ?, ?)"
        f" AND machine_id IN ({live}) ORDER BY id",
        [_STARTED, _FINISHED, _FAILED, _DUE],
    ):
        job = (json.loads(detail) if isinstance(detail, str | bytes) else detail or {}).get("job")
        if kind == _STARTED:
            runs.setdefault(mid, set()).add(str(job))
        elif kind == _FINISHED:  # also of a job that never started (queued, then cancelled)
            runs.get(mid, set()).discard(str(job))
        ended_itself = kind == _FINISHED and reason != "killed"
        if kind == _DUE or (job == _RUN and (kind in (_STARTED, _FAILED) or ended_itself)):
            mark[mid] = kind
    if any(runs.values()):
        return False
    key = "spec->>'{}'" if sql.postgres else "json_extract(spec, '$.{}')"
    with_run = sql.all(
        f"SELECT id FROM machines WHERE status = '{S.RUNNING}' AND"
        f" ({key.format('run')} IS NOT NULL OR {key.format('setup')} IS NOT NULL)"
    )
    return all(mark.get(mid, _DUE) != _DUE for (mid,) in with_run)
