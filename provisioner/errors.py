"""Errors the CLI turns into clean messages and exit codes (no tracebacks for user mistakes)."""

from __future__ import annotations

from policies.problems import DocumentError, Problem

__all__ = ["ConfigError", "OperationFailed", "Problem", "ProvisionerError", "UserError"]


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
