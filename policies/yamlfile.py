"""YAML documents that remember where every key came from, so every error names the file, the
line and the field. Shared by policy files (here) and the application's experiment and settings
files (``provisioner`` imports it; this layer imports nothing from there)."""

from __future__ import annotations

import os
import re
import stat
import types as types_module
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from policies.problems import DocumentError, Problem

__all__ = ["DocumentError", "Problem", "load_document", "problems_from"]

if TYPE_CHECKING:  # pydantic is imported when something is validated, not for --help
    from pydantic import BaseModel, ValidationError


M = TypeVar("M", bound="BaseModel")
Loc = tuple[Any, ...]


class Lines:
    """Maps a path of keys/indexes to the 1-based line it starts on; ``problems`` holds what the
    document's shape already shows (duplicate keys), reported together with validation."""

    def __init__(self) -> None:
        self.lines: dict[Loc, int] = {}
        self.problems: list[Problem] = []

    def walk(self, root: yaml.Node, file: str) -> None:
        """Record every key's line; iterative (a deep document is refused before this, but the
        walk must not depend on that) and linear, since aliases are refused."""
        stack: list[tuple[yaml.Node, Loc]] = [(root, ())]
        while stack:
            node, loc = stack.pop()
            self.lines.setdefault(loc, node.start_mark.line + 1)
            if isinstance(node, yaml.MappingNode):
                seen: set[Any] = set()
                for key, value in node.value:
                    k = key.value if isinstance(key, yaml.ScalarNode) else None
                    if k is None:
                        continue  # a complex key: the constructor reports it
                    if k in seen:
                        field = ".".join(str(x) for x in (*loc, k))
                        self.problems.append(
                            Problem(file, key.start_mark.line + 1, field, "duplicate key")
                        )
                    seen.add(k)
                    self.lines[(*loc, k)] = key.start_mark.line + 1
                    stack.append((value, (*loc, k)))
            elif isinstance(node, yaml.SequenceNode):
                stack.extend((item, (*loc, i)) for i, item in enumerate(node.value))

    def line_for(self, loc: Loc) -> int | None:
        loc = tuple(loc)
        while loc:
            if loc in self.lines:
                return self.lines[loc]
            loc = loc[:-1]
        return self.lines.get(())


MAX_BYTES = 1024 * 1024  # an experiment, policy or settings file is a few kilobytes
MAX_DEPTH = 64  # levels of nesting; real files use five or six


def _parser() -> tuple[Any, ...]:
    """libyaml's parser (~5x faster) when PyYAML has it, else PyYAML's own."""
    if yaml.__with_libyaml__:
        from yaml._yaml import CParser

        return (CParser,)
    return (yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser)  # pragma: no cover


class _Resolver(yaml.resolver.Resolver):
    """YAML 1.2's booleans (https://yaml.org/spec/1.2.2/#1032-tag-resolution): only true and
    false. YAML 1.1's yes/no/on/off stay words, so a policy named ``off`` or the holidays of
    Norway (``country: NO``) are strings, not False; a boolean field still takes them (pydantic
    reads yes/no/on/off as booleans)."""


_BOOL = "tag:yaml.org,2002:bool"
_Resolver.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in rules if tag != _BOOL]
    for first, rules in yaml.resolver.Resolver.yaml_implicit_resolvers.items()
}
_Resolver.add_implicit_resolver(
    _BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)

_Base: Any = type(
    "_Base",
    (yaml.composer.Composer, *_parser(), yaml.constructor.SafeConstructor, _Resolver),
    {},
)


class _Loader(_Base):
    """A safe loader (our composer and constructor on the parser's events) that refuses what
    only an attack needs: aliases (``*a``, whose expansion is exponential: "billion laughs")
    and nesting deeper than :data:`MAX_DEPTH` (which would exhaust the stack)."""

    def __init__(self, text: str) -> None:
        for base in _parser():
            if base is yaml.scanner.Scanner or base is yaml.parser.Parser:
                base.__init__(self)  # pragma: no cover
            else:
                base.__init__(self, text)
        yaml.constructor.SafeConstructor.__init__(self)
        _Resolver.__init__(self)
        yaml.composer.Composer.__init__(self)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.get_event()
            raise yaml.composer.ComposerError(
                None,
                None,
                f"aliases (*{event.anchor}) are not allowed here; write the value out",
                event.start_mark,
            )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"nested more than {MAX_DEPTH} levels deep",
                    self.peek_event().start_mark,
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def read_text(path: str | Path, what: str = "file") -> str:
    """The text of a YAML input file, at most :data:`MAX_BYTES`; DocumentError otherwise."""
    file = str(path)
    try:
        # O_NONBLOCK: opening a FIFO nobody writes to returns at once instead of hanging; the
        # descriptor's own type is checked (not the path's, which could be swapped meanwhile)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with open(fd, "rb") as f:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError
            if not stat.S_ISREG(mode):
                reason = f"not a regular file (a pipe or device), not a {what}"
                raise DocumentError([Problem(file, None, None, reason)])
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise DocumentError([Problem(file, None, None, "file not found")]) from None
    except IsADirectoryError:
        raise DocumentError([Problem(file, None, None, f"is a directory, not a {what}")]) from None
    except OSError as e:
        raise DocumentError([Problem(file, None, None, f"cannot read: {e.strerror}")]) from None
    if len(raw) > MAX_BYTES:
        raise DocumentError(
            [
                Problem(
                    file, None, None, f"larger than {MAX_BYTES >> 20} MiB, the limit for a {what}"
                )
            ]
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DocumentError(
            [Problem(file, None, None, f"not UTF-8 text (byte {e.start})")]
        ) from None


def load_document(path: str | Path, text: str | None = None) -> tuple[Any, Lines]:
    """Parse ``path`` (or ``text`` named as ``path``) once: the node tree gives the lines, the
    same tree the data. Syntax errors, aliases, deep nesting and oversized files become
    DocumentError."""
    file = str(path)
    if text is None:
        text = read_text(path)
    elif len(text) > MAX_BYTES:
        raise DocumentError(
            [Problem(file, None, None, f"larger than {MAX_BYTES >> 20} MiB, the limit for a file")]
        )
    lines = Lines()
    node, data = _parse(text, file)
    if node is not None:
        lines.walk(node, file)
    return data, lines


def _parse(text: str, file: str) -> tuple[Any, Any]:
    """The node tree of ``text`` and the data built from it (None, None for an empty one);
    invalid YAML is a DocumentError with its line."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        return node, None if node is None else loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else None
        raise DocumentError(
            [Problem(file, line, None, f"invalid YAML: {e.problem or e}")]
        ) from None
    except yaml.YAMLError as e:  # a ReaderError (a control character): its first line
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DocumentError([Problem(file, None, None, f"invalid YAML: {reason}")]) from None
    finally:
        loader.dispose()


def validate(
    model: type[M],
    data: Any,
    lines: Lines,
    file: str,
    *,
    what: str = "file",
    context: dict[str, Any] | None = None,
) -> M:
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
        result = model.model_validate(data, context=context)
    except ValidationError as e:
        raise DocumentError(
            lines.problems + problems_from(e, lines, file, data, model=model)
        ) from None
    if lines.problems:
        raise DocumentError(lines.problems)
    return result


def problems_from(
    e: ValidationError,
    lines: Lines,
    file: str,
    data: Any = None,
    prefix: Loc = (),
    model: type[BaseModel] | None = None,
) -> list[Problem]:
    """One problem per mistake, in the user's words: the path as written (no pydantic
    internals such as ``function-after[_order(), CustomPeriod]``), one message per field where
    a union tried several shapes, and "did you mean" for a misspelt key or choice.
    ``prefix``: where the validated part sits in the document (a list item, say); ``model``:
    what was validated there (for the keys a misspelt one may have meant)."""
    part = _at(data, prefix)
    errors = [(_user_loc(err["loc"], part), err) for err in e.errors(include_url=False)]
    union_locs = {loc for loc, err in errors if len(loc) < len(err["loc"])}
    problems: list[Problem] = []
    seen: set[tuple[Loc, str]] = set()
    for loc, err in errors:
        if _other_branch(loc, err, union_locs, part):
            continue
        msg = _message(err, model, loc)
        full = (*prefix, *loc)
        if (full, msg) in seen:
            continue
        seen.add((full, msg))
        field = ".".join(str(x) for x in full) or None
        problems.append(Problem(file, lines.line_for(full), field, msg))
    return problems


_SHAPE_ERRORS = {"model_type", "model_attributes_type", "dict_type", "literal_error"}


def _other_branch(loc: Loc, err: Any, union_locs: set[Loc], data: Any) -> bool:
    """Whether ``err`` is about a union member the value was plainly not meant as: a
    mapping's errors are those of the mapping member, a word's those of the words."""
    at = next((u for u in union_locs if loc[: len(u)] == u), None)
    if at is None:
        return False
    try:
        value = _at(data, at)
    except (KeyError, IndexError, TypeError):
        return False
    if isinstance(value, dict):
        return err["type"] in _SHAPE_ERRORS and loc == at
    return err["type"] in {"model_type", "model_attributes_type", "dict_type"}


def _message(err: Any, model: type[BaseModel] | None, loc: Loc) -> str:
    import difflib

    kind = err["type"]
    if kind == "extra_forbidden":
        known = _fields_at(model, loc[:-1]) if model else []
        near = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
        if near:
            return f"unknown field; did you mean {near[0]!r}?"
        return f"unknown field (known: {', '.join(known)})" if known else "unknown field"
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
        near = difflib.get_close_matches(str(err.get("input")), choices, n=1, cutoff=0.6)
        said = f"{err.get('input')!r} is not one of {', '.join(choices)}"
        return f"{said}; did you mean {near[0]!r}?" if near else said
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "should be a mapping of keys (key: value)"
    if kind in ("list_type", "tuple_type", "set_type", "frozen_set_type"):
        value = err.get("input")
        if isinstance(value, str | int | float):
            return f"should be a list, e.g. [{value}], not a single value"
        return "should be a list"
    msg: str = err["msg"]
    return msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")


def _fields_at(model: type[BaseModel], loc: Loc) -> list[str]:
    """The keys a mapping at ``loc`` in ``model`` may have (models of every union member)."""
    from pydantic import BaseModel

    types: list[Any] = [model]
    for x in loc:
        types = _step(types, x)
    out: list[str] = []
    for t in _members(types):
        if isinstance(t, type) and issubclass(t, BaseModel):
            out.extend(k for k in t.model_fields if k not in out)
    return out


def _step(types: list[Any], key: Any) -> list[Any]:
    """The types of the value at ``key`` in a value of one of ``types``: a model's field, a
    collection's item (``key`` an index or a dict key)."""
    from pydantic import BaseModel

    nxt: list[Any] = []
    for t in _members(types):
        if isinstance(t, type) and issubclass(t, BaseModel):
            f = t.model_fields.get(str(key))
            if f is not None:
                nxt.append(f.annotation)
        elif typing.get_origin(t) in (list, tuple, dict, set, frozenset):
            nxt.extend(typing.get_args(t)[-1:])
    return nxt


def _members(types: list[Any]) -> list[Any]:
    """Unions and ``Annotated`` unwrapped: the types a value may be."""
    out: list[Any] = []
    stack = list(types)
    while stack:
        t = stack.pop()
        origin = typing.get_origin(t)
        if origin is typing.Annotated:
            stack.append(typing.get_args(t)[0])
        elif origin is typing.Union or isinstance(t, types_module.UnionType):
            stack.extend(typing.get_args(t))
        else:
            out.append(t)
    return out


def _user_loc(loc: tuple[Any, ...], data: Any) -> tuple[Any, ...]:
    """The path as the user wrote it: drop what pydantic inserts for union members and
    validators (``function-after[...]``, ``literal[...]``, ``str``), which are not keys of the
    document."""
    out: list[Any] = []
    cur = data
    for x in loc:
        present = (isinstance(cur, dict) and x in cur) or (
            isinstance(cur, list) and isinstance(x, int) and 0 <= x < len(cur)
        )
        if present:
            out.append(x)
            cur = cur[x]
        elif not _looks_internal(x):
            out.append(x)  # a missing or unknown field: the user's name, kept as written
            cur = None
    return tuple(out)


def _at(data: Any, loc: Loc) -> Any:
    for x in loc:
        data = data[x]
    return data


def _looks_internal(x: Any) -> bool:
    return isinstance(x, str) and (
        "[" in x or x in {"str", "int", "float", "dict", "list", "bool", "date", "decimal"}
    )
