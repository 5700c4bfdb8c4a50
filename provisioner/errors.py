"""Errors the CLI turns into clean messages and exit codes (no tracebacks for user mistakes)."""

from __future__ import annotations

import sys

from policies.problems import DocumentError, Problem

__all__ = [
    "ConfigError",
    "OperationFailed",
    "Problem",
    "ProvisionerError",
    "UserError",
    "database_failure",
    "state_refusal",
]


class ProvisionerError(Exception):
    """Base for errors shown to the user as one message."""

    exit_code = 1


class UserError(ProvisionerError):
    """Bad input, unknown names, refused by policy or budget: exit code 2."""

    exit_code = 2


# A mistake in a YAML file (experiment, settings, policy): exit code 2, every problem located.
ConfigError = DocumentError


class OperationFailed(ProvisionerError):
    """A cloud operation could not be completed (every candidate failed, provider error…)."""


def database_failure(e: BaseException) -> str | None:
    """One line for the state database failing under a command (its server gone or
    restarting, the SQLite file locked by another process past its busy timeout, the
    disk full); None for any other error, a bug to show. SQLAlchemy is not imported for it:
    when it is not loaded, no database error can have been raised."""
    exc = sys.modules.get("sqlalchemy.exc")
    if exc is None or not isinstance(e, exc.OperationalError | exc.InterfaceError):
        return None
    orig = getattr(e, "orig", None)
    lines = str(orig or "").strip().splitlines()
    reason = lines[0].strip() if lines else type(orig or e).__name__
    if "database is locked" in reason:
        return (
            "the state database is locked: another provisioner process has been writing to it "
            "for longer than database.busy_timeout_seconds (30 s unless settings say); nothing "
            "was changed, try again when it is done"
        )
    return (
        f"the state database failed: {reason}; check that its server runs and state_url in "
        "settings, then run the command again"
    )


#: SQLSTATE insufficient_privilege: a grant, a row-level security policy or one of the team's
#: checks (migration 0015) refused the write
REFUSED = "42501"


def state_refusal(e: BaseException) -> str | None:
    """One line for the team's state refusing what this role asked (PostgreSQL's privileges,
    row-level security or the team's own checks: SQLSTATE 42501), for exit 2; None for any
    other error."""
    exc = sys.modules.get("sqlalchemy.exc")
    orig = getattr(e, "orig", None) if exc is not None and isinstance(e, exc.DBAPIError) else e
    if getattr(orig, "sqlstate", None) != REFUSED:
        return None
    lines = str(orig).strip().splitlines()
    reason = (lines[0].strip() if lines else "insufficient privilege").removeprefix("not allowed: ")
    return f"the team's state refused: {reason}"
