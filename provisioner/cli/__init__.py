"""The command line: thin commands that parse, call one application function, and render.

Tables for people, ``--output json`` for scripts. Exit codes: 0 done, 1 an operation failed,
2 bad input or refused (policy, budget). This module holds what every command shares; the
commands live in its submodules and :mod:`provisioner.cli.main` runs them.

Commands import the application's modules inside their bodies: ``provisioner --help`` must not
pay for SQLAlchemy, the policies or a cloud SDK.
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from typing import Any

import typer
from rich.console import Console

app = typer.Typer(
    name="provisioner",
    help="Rent GPUs across AWS, GCP, Azure, Yandex Cloud and SberCloud without wasting money.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # plain help: Typer's rich help imports rich's markdown and pretty-printer (~60 ms)
    rich_markup_mode=None,
)
# Wide when piped: a table cut to 80 columns is useless in a log or a CI artifact.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


class Output(StrEnum):
    table = "table"
    json = "json"


OUTPUT = typer.Option(Output.table, "--output", "-o", help="table for people, json for scripts")


@app.callback()
def _root(
    ctx: typer.Context,
    config: str = typer.Option(
        None,
        "--config",
        "-c",
        envvar="PROVISIONER_CONFIG",
        help="settings file (default: the user config directory)",
    ),
) -> None:
    ctx.obj = {"config": config}


def get_app(ctx: typer.Context, clock: Any = None) -> Any:
    """The application for this command (settings loaded, database opened lazily)."""
    from provisioner.app import App  # pydantic settings, the provider registry: not for --help
    from provisioner.clock import clock_from_env  # as above
    from provisioner.settings import load_settings  # as above

    root = ctx.find_root()
    config = (root.obj or {}).get("config")
    return App(load_settings(config), clock or clock_from_env())


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
