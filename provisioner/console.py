"""What commands write: plain tables and JSON with the standard library, and rich's console
(made on first use) for styled lines. Outside the Typer package, so a command answered without
Typer (``status``: :mod:`provisioner.entry`) writes exactly what the Typer command would."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any

from provisioner.money import Money, amount_text

amount = amount_text  # the one amount → JSON text (provisioner.money)


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


def number(d: Decimal | float | int | None) -> int | float | None:
    """A quantity (GB, hours) as a JSON number: an int when whole."""
    if d is None:
        return None
    return int(d) if d == int(d) else float(d)


def _json_default(o: Any) -> Any:
    if isinstance(o, datetime | date):
        return o.isoformat()  # ISO 8601, with its T
    if isinstance(o, Decimal):
        return amount(o)
    if isinstance(o, Money):
        return o.as_json()
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


def no_machines(all_: bool) -> str:
    """What `status` says of an empty fleet."""
    return "no machines" + ("" if all_ else " (use --all to include terminated ones)")


def say(text: str) -> None:
    """``out.print(text, soft_wrap=True)`` for a text without markup: written as it is when
    the output is no terminal (what rich writes then, tested), without importing rich."""
    if sys.stdout.isatty() or "FORCE_COLOR" in os.environ or "TTY_COMPATIBLE" in os.environ:
        out.print(text, soft_wrap=True)
    else:
        write(text)
