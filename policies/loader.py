"""Read policy files; every mistake is reported with its file, line and field, all at once.

A file holds one policy (a mapping with ``name``) or several under ``policies:``. A directory is
read file by file (``*.yaml``, ``*.yml``, sorted). Nothing is returned unless everything loads:
the scheduler must not act on half of the rules.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from policies.schema import Policy
from policies.yamlfile import DocumentError, Lines, Problem, load_document, problems_from

PolicyError = DocumentError  # the name callers know


def load(paths: Iterable[str | Path]) -> list[Policy]:
    """Every policy in ``paths`` (files or directories), or PolicyError listing every problem."""
    policies: list[Policy] = []
    problems: list[Problem] = []
    seen: dict[str, str] = {}
    for file in _files(paths, problems):
        for policy, line in _load_file(file, problems):
            if policy.name in seen:
                problems.append(
                    Problem(
                        str(file),
                        line,
                        "name",
                        f"policy {policy.name!r} is also in {seen[policy.name]}",
                    )
                )
            seen[policy.name] = str(file)
            policies.append(policy)
    if problems:
        raise PolicyError(problems)
    return policies


def _files(paths: Iterable[str | Path], problems: list[Problem]) -> list[Path]:
    out: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            out.extend(sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml")))
        elif path.is_file():
            out.append(path)
        elif path.exists():
            problems.append(Problem(str(path), None, None, "not a regular file (a pipe or device)"))
        else:
            problems.append(Problem(str(path), None, None, "no such file or directory"))
    return out


def _policy_items(
    data: Any, lines: Lines, file: str, problems: list[Problem]
) -> tuple[Any, tuple[str, ...]] | None:
    """A policy file's policies (a list under 'policies:', or the file itself one) and where
    they are in it; None, with the problem said, when it is neither."""
    prefix: tuple[str, ...]
    if isinstance(data, dict) and "policies" in data:
        extra = sorted(set(data) - {"policies"})
        if extra:
            problems.append(
                Problem(
                    file,
                    lines.line_for((extra[0],)),
                    extra[0],
                    "unknown field (a file with 'policies:' holds only that list)",
                )
            )
        items, prefix = data["policies"], ("policies",)
        if not isinstance(items, list) or not items:
            problems.append(Problem(file, lines.line_for(prefix), "policies", "must be a list"))
            return None
    elif isinstance(data, dict):
        items, prefix = [data], ()
    else:
        problems.append(
            Problem(
                file, 1, None, "a policy file is a mapping (name: …) or a list under 'policies:'"
            )
        )
        return None
    return items, prefix


def _load_file(path: Path, problems: list[Problem]) -> list[tuple[Policy, int | None]]:
    file = str(path)
    try:
        data, lines = load_document(path)
    except DocumentError as e:
        problems.extend(e.problems)
        return []
    problems.extend(lines.problems)
    found = _policy_items(data, lines, file, problems)
    if found is None:
        return []
    items, prefix = found
    out = []
    for i, item in enumerate(items):
        loc: tuple[Any, ...] = (*prefix, i) if prefix else ()
        try:
            out.append((Policy.model_validate(item), lines.line_for(loc)))
        except ValidationError as e:
            problems.extend(problems_from(e, lines, file, data, loc, Policy))
    return out
