"""The entry point: every command registered on the Typer app, one run, errors as exit codes."""

from __future__ import annotations

import sys

import typer
from rich.markup import escape

from provisioner.cli import app, catalog, err, machines, report, scheduler  # noqa: F401  (commands)
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
    except Exception as e:  # click usage errors arrive here in non-standalone mode
        import click

        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(2 if isinstance(e, click.UsageError) else e.exit_code)
        raise
