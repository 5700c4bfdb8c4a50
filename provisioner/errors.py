"""Errors the CLI turns into clean messages and exit codes (no tracebacks for user mistakes)."""

from __future__ import annotations

from dataclasses import dataclass


class ProvisionerError(Exception):
    """Base for errors shown to the user as one message."""

    exit_code = 1


class UserError(ProvisionerError):
    """Bad input, unknown names, refused by policy or budget: exit code 2."""

    exit_code = 2


@dataclass(frozen=True)
class Problem:
    file: str
    line: int | None
    field: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return (
            f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"
        )


class ConfigError(UserError):
    """One or more problems in a YAML file, each with file, line and field."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


class OperationFailed(ProvisionerError):
    """A cloud operation could not be completed (every candidate failed, provider error…)."""
