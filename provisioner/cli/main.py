"""The entry point: every command registered on the Typer app, one run, errors as exit codes."""

from __future__ import annotations

import sys

import typer
from rich.markup import escape

from provisioner.cli import (  # noqa: F401  (commands)
    app,
    catalog,
    dashboard,
    err,
    machines,
    report,
    scheduler,
)
from provisioner.errors import ConfigError, ProvisionerError


def main() -> None:
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
    except Exception as e:  # usage errors arrive here in non-standalone mode
        if not _is_click_error(e):
            raise
        e.show()  # type: ignore[attr-defined]  # a ClickException: its own one-line usage text
        usage = any(c.__name__ == "UsageError" for c in type(e).__mro__)
        sys.exit(2 if usage else int(getattr(e, "exit_code", 1)))


def _is_click_error(e: Exception) -> bool:
    """Click's exceptions, or the copies Typer ≥ 0.29 vendors as ``typer._click``: the same
    classes under another module, which an ``isinstance`` against ``click`` misses."""
    return any(c.__name__ == "ClickException" for c in type(e).__mro__)
