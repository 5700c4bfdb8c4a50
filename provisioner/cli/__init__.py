"""The command line: thin commands that parse, call one application function, and render.

Tables for people, ``--output json`` for scripts. Exit codes: 0 done, 1 an operation failed,
2 bad input or refused (policy, budget). This module holds what every command shares; the
commands live in its submodules and :mod:`provisioner.cli.main` runs them.

Commands import the application's modules inside their bodies: ``provisioner --help`` must not
pay for SQLAlchemy, the policies or a cloud SDK.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any

import typer

from provisioner.console import (  # noqa: F401  (what every command shares)
    amount,
    err,
    number,
    out,
    plural,
    print_json,
    say,
    text_table,
    width,
    write,
)

app = typer.Typer(
    name="provisioner",
    help="Rent GPUs across AWS, GCP, Azure, Yandex Cloud and SberCloud without wasting money.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # plain help: Typer's rich help imports rich's markdown and pretty-printer (~60 ms), shows
    # `<bool>` on flags and keeps the docstrings' line breaks mid-sentence
    rich_markup_mode=None,
)


class Output(StrEnum):
    table = "table"
    json = "json"


OUTPUT = typer.Option(Output.table, "--output", "-o", help="table for people, json for scripts")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("gpu-provisioner")
        except PackageNotFoundError:  # run from a source tree that was never installed
            v = "unknown (not installed)"
        typer.echo(f"provisioner {v}")
        raise typer.Exit()


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
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_version, help="print the version and exit"
    ),
) -> None:
    ctx.obj = {"config": config}


#: The commands a simulated clock (PROVISIONER_CLOCK) may run on a real state: they only look
#: (``status`` then shows the state as recorded). Every other command writes the state or acts
#: on a cloud and is refused there in one line (:mod:`provisioner.realclock`): a new command
#: is refused until it is listed here.
WHAT_IFS = frozenset(
    {"plan", "report", "status", "events", "catalog", "check", "ssh-config", "token list"}
    | {"volume ls", "policy log", "policy diff", "policy show"}
)


def get_app(ctx: typer.Context, clock: Any = None) -> Any:
    """The application for this command (settings loaded, database opened lazily). On a
    simulated clock, a command not in :data:`WHAT_IFS` is refused at once over a real state
    (:mod:`provisioner.realclock`); a state not there yet is made, a simulated one, when the
    command first opens it."""
    from provisioner.app import App  # pydantic settings, the provider registry: not for --help
    from provisioner.clock import clock_from_env  # as above
    from provisioner.settings import load_settings  # as above

    root = ctx.find_root()
    config = (root.obj or {}).get("config")
    application = App(load_settings(config), clock or clock_from_env())
    application.command = command_name(ctx)
    application.acts = application.command not in WHAT_IFS
    if application.clock.simulated:
        from provisioner.realclock import refuse_early  # as above

        try:
            refuse_early(application)
        except BaseException:
            application.close()
            raise
    return application


def command_name(ctx: typer.Context) -> str:
    """The command as typed, without the program: ``up``, ``token create``."""
    names: list[str] = []
    at: Any = ctx
    while at.parent is not None:
        names.append(at.info_name or "")
        at = at.parent
    return " ".join(reversed(names))


def json_requested(argv: Sequence[str]) -> bool:
    """Whether the command line asks for ``-o json`` (so an error comes as JSON too)."""
    for i, a in enumerate(argv):
        if a in ("-o", "--output") and i + 1 < len(argv) and argv[i + 1] == "json":
            return True
        if a in ("-ojson", "--output=json"):
            return True
    return False
