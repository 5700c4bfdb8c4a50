"""The console entry point. ``provisioner status`` — the command a team runs most, often a new
user's first — is answered here when it can be without Typer, pydantic settings, SQLAlchemy or
the ORM (~0.7 s of start-up on a 2-core machine, ~70 % of `status` over 1,000 machines;
bench/bench_status.py): a SQLite state at the current schema, no settings file or variable to
validate, and either nothing to ask the clouds or only the sandbox, which finds every machine as
recorded (so reconciling would write nothing). It reads and draws with :mod:`provisioner.fleet`,
as the Typer command does. Anything else, and anything unusual here, goes to the Typer app
(:mod:`provisioner.cli.main`), which gives the same answer, or the error with its file, line or
variable."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from provisioner.location import HEARTBEAT_GRACE_SECONDS, plain_settings
from provisioner.schema import current_sqlite, known_empty


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

    try:
        clock = clock_from_env()
    except Exception:  # UserError: the Typer app says what is wrong with it
        return False
    plain = plain_settings(config)
    if plain is None:  # a file or variable to validate: only an empty state is answered here
        from provisioner.settings import load_settings

        try:
            url = load_settings(config).database_url
        except Exception:
            return False  # the Typer app reports it, as for any command
    else:
        url, home = plain
    if known_empty(url, all_):  # one query, and nothing more to load
        from provisioner.console import no_machines, print_json, say

        if as_json:
            print_json([])
        else:
            say(no_machines(all_))
        return True
    if plain is None:
        return False
    conn = current_sqlite(url)
    if conn is None:
        return False
    from provisioner.fleet import Sql, read, show

    try:
        if refresh and not _as_recorded(Sql(conn, postgres=False), home, clock.now):
            return False  # the clouds moved something: reconciling writes it (SQLAlchemy)
        now = clock.now()
        fleet = read(Sql(conn, postgres=False), all_=all_, now=now, seen_since=now - GRACE)
    except Exception:
        return False  # a state it cannot read: the Typer app explains, or repairs
    finally:
        conn.close()
    show(fleet, as_json=as_json, all_=all_)
    return True


GRACE = timedelta(seconds=HEARTBEAT_GRACE_SECONDS)  # scheduler.heartbeat_grace_seconds


def _as_recorded(sql: Any, home: Path, now: Any) -> bool:
    """Whether every machine that reconciling would ask about is on the sandbox cloud and found
    there as recorded (:func:`provisioner.schema.observed`, the rule of
    :func:`provisioner.lifecycle.reconcile`): one list call, as reconciling makes, and nothing
    it would write. False for any other cloud (its SDK and settings are for the Typer app),
    and for any failure to ask (which the Typer app reports)."""
    from provisioner.schema import observed

    asked = sql.all(
        "SELECT cloud, region, instance_id, status, public_ip FROM machines"
        " WHERE status NOT IN ('requested', 'terminated', 'failed')"
    )
    if not asked:
        return True
    if {cloud for cloud, *_ in asked} != {"sandbox"}:
        return False
    import providers

    try:
        sandbox = providers.create("sandbox", {"db_path": str(home / "sandbox.db")}, clock=now)
        try:
            listed = {i.id: i for i in sandbox.list_managed(sorted({r for _, r, *_ in asked if r}))}
        finally:
            sandbox.close()  # type: ignore[attr-defined]
    except Exception:
        return False
    for _, _, instance_id, status, public_ip in asked:
        inst = listed.get(instance_id or "")
        if inst is None or observed(inst, public_ip) != (status, public_ip):
            return False
    return True
