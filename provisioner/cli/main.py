"""The entry point: every command registered on the Typer app, one run, errors as exit codes.

Exit codes: 0 done, 1 an operation failed, 2 bad input or refused, 130 interrupted (Ctrl-C).
Under ``-o json`` an error is also a JSON object on stdout: ``{"error": ..., "exit_code": n}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import typer

from provisioner.cli import (  # noqa: F401  (commands)
    app,
    bill,
    catalog,
    dashboard,
    err,
    jobs,
    json_requested,
    machines,
    policy,
    report,
    scheduler,
    selftest,
    status,
    tokens,
    volumes,
)
from provisioner.errors import ConfigError, ProvisionerError, database_failure, state_refusal


def _short_helps(typer_app: typer.Typer) -> None:
    """Each command's first sentence as its line in the command list (Click otherwise cuts
    the docstring at ~45 characters with "...")."""
    infos: list[Any] = [*typer_app.registered_commands, *typer_app.registered_groups]
    for info in infos:
        doc = info.help or (info.callback.__doc__ if info.callback else None)
        if group := getattr(info, "typer_instance", None):
            doc = doc or group.info.help
            _short_helps(group)
        if doc and not info.short_help:
            text = " ".join(doc.split())
            info.short_help = text.split(". ")[0].rstrip(".") + "."


_short_helps(app)


def main() -> None:
    as_json = json_requested(sys.argv[1:])

    def fail(messages: list[str], code: int, *, shown: bool = False) -> None:
        if not shown:
            from rich.markup import escape  # rich only once there is something to show

            for m in messages:
                err.print(f"[red]error:[/] {escape(m)}", highlight=False, soft_wrap=True)
        if as_json:
            error = messages[0] if len(messages) == 1 else messages
            sys.stdout.write(json.dumps({"error": error, "exit_code": code}) + "\n")
        sys.exit(code)

    try:
        rc = app(standalone_mode=False)
    except ConfigError as e:
        fail([str(p) for p in e.problems], e.exit_code)
    except ProvisionerError as e:
        fail([str(e)], e.exit_code)
    except KeyboardInterrupt:  # Click < 8.2 turns Ctrl-C into Abort, Typer ≥ 0.29 into Exit(130)
        fail(["interrupted"], 130)
    except typer.Abort:  # a confirmation answered no (or Ctrl-C on older Click)
        fail(["aborted"], 130 if _interrupted() else 1)
    except SystemExit:
        raise
    except Exception as e:  # usage errors arrive here in non-standalone mode
        if (refused := state_refusal(e)) is not None:
            fail([refused], 2)  # the team's rules, as its database holds them
        if (lost := database_failure(e)) is not None:
            fail([lost], 1)  # an operation failed: the state database, not the input
        if not _is_click_error(e):
            raise
        e.show()  # type: ignore[attr-defined]  # a ClickException: its own one-line usage text
        usage = any(c.__name__ == "UsageError" for c in type(e).__mro__)
        code = 2 if usage else int(getattr(e, "exit_code", 1))
        fail([e.format_message()], code, shown=True)  # type: ignore[attr-defined]
    # Typer returns (not raises) the code of `typer.Exit(n)`, and 130 for Ctrl-C
    sys.exit(rc if isinstance(rc, int) else 0)


def _interrupted() -> bool:
    e = sys.exc_info()[1]
    return isinstance(e and (e.__cause__ or e.__context__), KeyboardInterrupt)


def _is_click_error(e: Exception) -> bool:
    """Click's exceptions, or the copies Typer ≥ 0.29 vendors as ``typer._click``: the same
    classes under another module, which an ``isinstance`` against ``click`` misses."""
    return any(c.__name__ == "ClickException" for c in type(e).__mro__)
