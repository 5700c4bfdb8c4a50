"""The command line: thin commands that parse, call one application function, and render.

Tables for people, ``--output json`` for scripts. Exit codes: 0 done, 1 an operation failed,
2 bad input or refused (policy, budget). This module holds what every command shares; the
commands live in its submodules and :mod:`provisioner.cli.main` runs them.

Commands import the application's modules inside their bodies: ``provisioner --help`` must not
pay for SQLAlchemy, the policies or a cloud SDK.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from datetime import date, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from enum import StrEnum
from typing import Any

import typer

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


def width() -> int:
    """Columns to draw in: $COLUMNS, else the terminal's; wide when piped (a log keeps all)."""
    return shutil.get_terminal_size((200, 24)).columns


class _Console:
    """rich's Console, made on first use: importing rich.console costs ~20 ms that `--help`
    and a usage error never need."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._console: Any = None

    def __getattr__(self, name: str) -> Any:
        if self._console is None:
            from rich.console import Console

            self._console = Console(width=width(), **self._options)
        return getattr(self._console, name)


out: Any = _Console()
err: Any = _Console(stderr=True)


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


def get_app(ctx: typer.Context, clock: Any = None) -> Any:
    """The application for this command (settings loaded, database opened lazily)."""
    from provisioner.app import App  # pydantic settings, the provider registry: not for --help
    from provisioner.clock import clock_from_env  # as above
    from provisioner.settings import load_settings  # as above

    root = ctx.find_root()
    config = (root.obj or {}).get("config")
    return App(load_settings(config), clock or clock_from_env())


def amount(d: Decimal) -> str:
    """An amount for JSON: plain decimal text, to 9 places at most (a computed spend carries
    28 digits, no invoice more than 6), trailing zeros dropped, never ``1E+2``."""
    if d.as_tuple().exponent < -9:  # type: ignore[operator]
        d = d.quantize(Decimal("1E-9"), ROUND_HALF_EVEN)
    text = f"{d.normalize():f}"
    return "0" if text in ("-0", "0") else text


def number(d: Decimal | float | int | None) -> int | float | None:
    """A quantity (GB, hours) as a JSON number: an int when whole."""
    if d is None:
        return None
    return int(d) if d == int(d) else float(d)


def _json_default(o: Any) -> Any:
    from provisioner.money import Money  # exact amounts: small, but not for --help

    if isinstance(o, datetime | date):
        return o.isoformat()  # ISO 8601, with its T
    if isinstance(o, Decimal):
        return amount(o)
    if isinstance(o, Money):
        return {"amount": amount(o.amount), "currency": o.currency}
    if isinstance(o, timedelta):
        return o.total_seconds()
    return str(o)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=_json_default) + "\n")


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 candidate``, ``3 candidates``."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def text_table(
    columns: Sequence[tuple[str, str, int]],
    rows: Sequence[Sequence[str]],
    max_width: int | None = None,
) -> str:
    """A plain table as ``kubectl get`` draws one: ``columns`` are (header, align ``<`` or
    ``>``, priority); when the widest cells do not fit ``max_width``, the columns of the
    highest priority number go first (0: always kept), so the cells left are never cut.
    Plain text, so 10,000 rows draw in milliseconds."""
    max_width = max_width or width()
    keep = list(range(len(columns)))
    widths = [max([len(columns[i][0]), *(len(r[i]) for r in rows)]) for i in range(len(columns))]
    for prio in sorted({c[2] for c in columns if c[2] > 0}, reverse=True):
        if sum(widths[i] for i in keep) + 2 * (len(keep) - 1) <= max_width:
            break
        keep = [i for i in keep if columns[i][2] != prio]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cells[i].ljust(widths[i]) if columns[i][1] == "<" else cells[i].rjust(widths[i])
            for i in keep
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line([c[0].upper() for c in columns]), *(line(r) for r in rows)])


def write(text: str) -> None:
    """Plain text as it is (a table of 10,000 rows: no markup to parse, no wrapping), where
    ``out`` writes, without making ``out`` (rich's console: ~20 ms to import)."""
    sys.stdout.write(text + "\n")


def json_requested(argv: Sequence[str]) -> bool:
    """Whether the command line asks for ``-o json`` (so an error comes as JSON too)."""
    for i, a in enumerate(argv):
        if a in ("-o", "--output") and i + 1 < len(argv) and argv[i + 1] == "json":
            return True
        if a in ("-ojson", "--output=json"):
            return True
    return False
