"""A mistake located in a file: what every error about a YAML document carries. Apart from the
YAML reader, so that raising and showing one (``provisioner --help`` included) costs no YAML."""

from __future__ import annotations

from dataclasses import dataclass


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


class DocumentError(Exception):
    """One or more problems in YAML files, each with file, line and field. Exit code 2."""

    exit_code = 2

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))
