"""The console entry point. ``provisioner status`` of an empty state — often a new user's first
command — is answered here with the standard library: no Typer, no rich when the output is not
a terminal, and no pydantic when no settings file or variable asks for validation (0.34 s of
CPU down to 0.04 s, `python -c pass` being 0.02 s: bench/bench_status.py). Anything else, and
anything unusual here, goes to the Typer app (:mod:`provisioner.cli.main`), which gives the
same answer, or the error with its file, line or variable."""

from __future__ import annotations

import os
import sys
from datetime import datetime

from provisioner.location import plain_database_url
from provisioner.schema import known_empty


def main() -> None:
    if _empty_status(sys.argv[1:]):
        sys.exit(0)
    from provisioner.cli.main import main as typer_main

    typer_main()


def _status_options(argv: list[str]) -> tuple[str | None, bool, bool] | None:
    """(config, --all, -o json) of ``[-c FILE] status [-a] [-o table|json] [--[no-]refresh]``,
    each option at most once; None for any other command line (Click parses it)."""
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
    return config, "all" in given, given.get("output") == "json"


def _empty_status(argv: list[str]) -> bool:
    """Whether this was ``status`` of an empty state, now answered."""
    options = _status_options(argv)
    if options is None:
        return False
    config, all_, as_json = options
    clock = os.environ.get("PROVISIONER_CLOCK", "").strip()  # as provisioner.clock reads it
    if clock:
        try:
            if datetime.fromisoformat(clock).tzinfo is None:
                return False
        except ValueError:
            return False  # the Typer app says what is wrong with it
    url = plain_database_url(config)
    if url is None:
        from provisioner.settings import load_settings  # a file or variable to validate

        try:
            url = load_settings(config).database_url
        except Exception:
            return False  # the Typer app reports it, as for any command
    if not known_empty(url, all_):
        return False
    if as_json:
        sys.stdout.write("[]\n")
        return True
    text = "no machines" + ("" if all_ else " (use --all to include terminated ones)")
    if sys.stdout.isatty() or "FORCE_COLOR" in os.environ or "TTY_COMPATIBLE" in os.environ:
        import shutil

        from rich.console import Console  # styles it for a terminal, as provisioner.cli.out

        Console(width=shutil.get_terminal_size((200, 24)).columns).print(text, soft_wrap=True)
    else:
        sys.stdout.write(text + "\n")  # what rich writes when it does not style (tested)
    return True
