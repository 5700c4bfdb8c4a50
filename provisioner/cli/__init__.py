"""The command line: thin commands that parse, call one application function, and render.

Tables for people, ``--output json`` for scripts. Exit codes: 0 done, 1 an operation failed,
2 bad input or refused (policy, budget).
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from provisioner.errors import ConfigError, ProvisionerError

app = typer.Typer(
    name="provisioner",
    help="Rent GPUs across AWS, GCP, Azure, Yandex Cloud and SberCloud without wasting money.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
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
    from provisioner.app import App
    from provisioner.clock import clock_from_env
    from provisioner.settings import load_settings

    root = ctx.find_root()
    config = (root.obj or {}).get("config")
    return App(load_settings(config), clock or clock_from_env())


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def main() -> None:
    from provisioner.cli import catalog, machines, report, scheduler  # noqa: F401  (register commands)

    try:
        app(standalone_mode=False)
    except ConfigError as e:
        for p in e.problems:
            err.print(f"[red]error:[/] {escape(str(p))}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except ProvisionerError as e:
        err.print(f"[red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err.print("aborted")
        sys.exit(130)
    except SystemExit:
        raise
    except Exception as e:  # click usage errors arrive here in non-standalone mode
        import click

        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(2 if isinstance(e, click.UsageError) else e.exit_code)
        raise
