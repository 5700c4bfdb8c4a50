"""YAML documents that remember where every key came from, so every error names the file, the
line and the field. Shared by policy files (here) and the application's experiment and settings
files (``provisioner`` imports it; this layer imports nothing from there)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

if TYPE_CHECKING:  # pydantic is imported when something is validated, not for --help
    from pydantic import BaseModel, ValidationError


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


M = TypeVar("M", bound="BaseModel")
Loc = tuple[Any, ...]


class Lines:
    """Maps a path of keys/indexes to the 1-based line it starts on; ``problems`` holds what the
    document's shape already shows (duplicate keys), reported together with validation."""

    def __init__(self) -> None:
        self.lines: dict[Loc, int] = {}
        self.problems: list[Problem] = []

    def walk(self, node: yaml.Node, loc: Loc, problems: list[Problem], file: str) -> None:
        self.lines[loc] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key, value in node.value:
                k = key.value
                if k in seen:
                    field = ".".join(str(x) for x in (*loc, k))
                    problems.append(Problem(file, key.start_mark.line + 1, field, "duplicate key"))
                seen.add(k)
                self.lines[(*loc, k)] = key.start_mark.line + 1
                self.walk(value, (*loc, k), problems, file)
                self.lines[(*loc, k)] = key.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.walk(item, (*loc, i), problems, file)

    def line_for(self, loc: Loc) -> int | None:
        loc = tuple(loc)
        while loc:
            if loc in self.lines:
                return self.lines[loc]
            loc = loc[:-1]
        return self.lines.get(())


def load_document(path: str | Path, text: str | None = None) -> tuple[Any, Lines]:
    """Parse ``path`` (or ``text`` named as ``path``); syntax errors become DocumentError."""
    file = str(path)
    if text is None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise DocumentError([Problem(file, None, None, "file not found")]) from None
        except (OSError, UnicodeDecodeError) as e:
            raise DocumentError([Problem(file, None, None, f"cannot read: {e}")]) from None
    lines = Lines()
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        raise DocumentError(
            [Problem(file, line, None, f"invalid YAML: {e.problem or e}")]
        ) from None
    except yaml.YAMLError as e:
        raise DocumentError([Problem(file, None, None, f"invalid YAML: {e}")]) from None
    if node is not None:
        lines.walk(node, (), lines.problems, file)
    return data, lines


def validate(model: type[M], data: Any, lines: Lines, file: str, *, what: str = "file") -> M:
    """Validate ``data`` against ``model``; every pydantic error becomes a Problem with a line,
    reported together with the document's own problems."""
    if data is None:
        raise DocumentError([Problem(file, 1, None, f"empty {what}")])
    if not isinstance(data, dict):
        raise DocumentError(
            [Problem(file, lines.line_for(()), None, f"a {what} must be a mapping of keys")]
        )
    from pydantic import ValidationError

    try:
        result = model.model_validate(data)
    except ValidationError as e:
        raise DocumentError(lines.problems + problems_from(e, lines, file, data)) from None
    if lines.problems:
        raise DocumentError(lines.problems)
    return result


def problems_from(
    e: ValidationError, lines: Lines, file: str, data: Any = None, prefix: Loc = ()
) -> list[Problem]:
    """``prefix``: where the validated part sits in the document (a list item, say)."""
    problems = []
    for err in e.errors(include_url=False):
        loc = (*prefix, *_user_loc(err["loc"], _at(data, prefix)))
        field = ".".join(str(x) for x in loc) or None
        msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling)"
        problems.append(Problem(file, lines.line_for(loc), field, msg))
    return problems


def _user_loc(loc: tuple[Any, ...], data: Any) -> tuple[Any, ...]:
    """The path as the user wrote it: drop what pydantic inserts for union members and
    validators (``function-after[...]``, ``str``), which are not keys of the document."""
    out: list[Any] = []
    cur = data
    for i, x in enumerate(loc):
        present = (isinstance(cur, dict) and x in cur) or (
            isinstance(cur, list) and isinstance(x, int) and 0 <= x < len(cur)
        )
        if present:
            out.append(x)
            cur = cur[x]
        elif i == len(loc) - 1 or not _looks_internal(x):
            out.append(x)  # a missing or unknown field: the user's name, kept as written
            cur = None
    return tuple(out)


def _at(data: Any, loc: Loc) -> Any:
    for x in loc:
        data = data[x]
    return data


def _looks_internal(x: Any) -> bool:
    return isinstance(x, str) and ("[" in x or x in {"str", "int", "float", "dict", "list", "bool"})
