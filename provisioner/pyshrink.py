"""Python source as lean as it runs: what the startup data carries of the agent (docs/LIMITS.md:
EC2 takes 16 KB of user data, the user's script included). Removed: comments (not a first-line
``#!``), docstrings, blank lines, the annotations of functions and of the assignments inside
them, indentation past one space a level, and line breaks inside brackets. Every token that runs
is kept as written: a result whose syntax tree is not the source's (annotations and docstrings
aside) is never returned (the source is)."""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Callable, Collection, Iterator
from typing import Any

_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
_BODIES = (ast.Module, ast.ClassDef, *_FUNCS)


def shrink(source: str, drop: Collection[str] = ()) -> str:
    """``source`` without what does not run (see the module), nor the top-level classes and
    functions named in ``drop`` (with their decorators): the same program, checked; anything
    else returns ``source`` unchanged."""
    try:
        out = _lay_out(_strip(source, drop))
        if _program(out) == _program(source, drop):
            return out
    except (SyntaxError, tokenize.TokenError, ValueError, IndexError):
        pass
    return source


def _strip(source: str, drop: Collection[str]) -> str:
    """Docstrings, annotations and what ``drop`` names cut out of the text (by the syntax
    tree's positions)."""
    raw = source.encode()  # ast's columns count UTF-8 bytes, not characters
    starts = [0]
    for line in raw.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))

    def at(line: int, col: int) -> int:
        return starts[line - 1] + col

    cuts: dict[int, tuple[int, bytes]] = {}  # start: (end, replacement)
    tree = ast.parse(source)
    for node in _dropped(tree, drop):
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        cuts[at(first, 0)] = (_end(node, at), b"")
    for node in ast.walk(tree):
        if isinstance(node, _BODIES) and (doc := _docstring(node)) is not None:
            assert doc.end_lineno is not None and doc.end_col_offset is not None
            end = at(doc.end_lineno, doc.end_col_offset)
            cuts[at(doc.lineno, doc.col_offset)] = (end, b"" if len(node.body) > 1 else b'""')
        if not isinstance(node, _FUNCS):
            continue
        a = node.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is not None and (ann := arg.annotation) is not None:
                name_end = at(arg.lineno, arg.col_offset) + len(arg.arg.encode())
                cuts[name_end] = (_end(ann, at), b"")
        if node.returns is not None:
            arrow = raw.rindex(b"->", 0, at(node.returns.lineno, node.returns.col_offset))
            cuts[len(raw[:arrow].rstrip())] = (_end(node.returns, at), b"")
        for stmt in _statements(node.body):
            if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                cuts[_end(stmt.target, at)] = (_end(stmt.annotation, at), b"")
    out, pos = [], 0
    for start in sorted(cuts):
        end, replacement = cuts[start]
        if start < pos:  # inside what is dropped
            if end > pos:
                raise ValueError("overlapping cuts")
            continue
        out += [raw[pos:start], replacement]
        pos = end
    out.append(raw[pos:])
    return b"".join(out).decode()


def _end(node: Any, at: Callable[[int, int], int]) -> int:
    return at(node.end_lineno, node.end_col_offset)


def _lay_out(text: str) -> str:
    """``text`` token by token: one space of indentation a level, no comment, no blank line, a
    statement split over lines (inside brackets) on one, a space only between two tokens that
    would otherwise run together."""
    lines = text.splitlines(keepends=True)
    toks = list(tokenize.generate_tokens(io.StringIO(text).readline))
    out: list[str] = []
    level, line_start, prev_kind = 0, True, tokenize.NEWLINE
    # 3.12 and later: an f-string is a run of tokens (which may nest), copied whole
    fstring_start = getattr(tokenize, "FSTRING_START", None)
    fstring_end = getattr(tokenize, "FSTRING_END", None)
    i = 0
    while i < len(toks):
        tok = toks[i]
        kind, start, end = tok.type, tok.start, tok.end
        i += 1
        if kind == tokenize.COMMENT:
            if start == (1, 0) and tok.string.startswith("#!"):
                out.append(tok.string + "\n")
            continue
        if kind in (tokenize.NL, tokenize.ENDMARKER):
            continue
        if kind == tokenize.INDENT:
            level += 1
            continue
        if kind == tokenize.DEDENT:
            level -= 1
            continue
        if kind == tokenize.NEWLINE:
            out.append("\n")
            line_start = True
            continue
        if kind == fstring_start:  # copied whole, from its start to its own end
            depth = 1
            while depth:
                depth += {fstring_start: 1, fstring_end: -1}.get(toks[i].type, 0)
                i += 1
            end = toks[i - 1].end
        piece = _slice(lines, start, end)
        if line_start:
            out.append(" " * level)
        elif (out[-1][-1:] in _WORD | {'"', "'"} and piece[:1] in _WORD) or (
            prev_kind == tokenize.NUMBER and piece[:1] == "."
        ):
            out.append(" ")  # only where two tokens would run together
        out.append(piece)
        line_start, prev_kind = False, kind
    return "".join(out)


def _slice(lines: list[str], start: tuple[int, int], end: tuple[int, int]) -> str:
    if start[0] == end[0]:
        return lines[start[0] - 1][start[1] : end[1]]
    middle = lines[start[0] : end[0] - 1]
    return "".join([lines[start[0] - 1][start[1] :], *middle, lines[end[0] - 1][: end[1]]])


def _docstring(node: ast.AST) -> ast.Expr | None:
    body = getattr(node, "body", None)
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return first
    return None


def _statements(body: list[Any]) -> Iterator[Any]:
    """The statements of a function's body, nested blocks included, not nested classes' or
    functions' (those are walked on their own)."""
    for stmt in body:
        yield stmt
        if not isinstance(stmt, (ast.ClassDef, *_FUNCS)):
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                yield from _statements(
                    [s for s in getattr(stmt, field, []) if isinstance(s, ast.AST)]
                )


def _dropped(tree: ast.Module, drop: Collection[str]) -> list[Any]:
    kinds = (ast.ClassDef, *_FUNCS)
    return [n for n in tree.body if isinstance(n, kinds) and n.name in drop]


def _program(source: str, drop: Collection[str] = ()) -> str:
    """The program as it runs: without docstrings, nor annotations of functions and of the
    assignments inside them, nor what ``drop`` names (what :func:`_strip` removes)."""
    tree = ast.parse(source)
    gone = _dropped(tree, drop)
    tree.body = [n for n in tree.body if n not in gone]
    for node in list(ast.walk(tree)):
        if isinstance(node, _BODIES) and _docstring(node) is not None:
            if len(node.body) > 1:
                del node.body[0]
            else:
                node.body[0].value.value = ""  # type: ignore[attr-defined]
        if not isinstance(node, _FUNCS):
            continue
        a = node.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is not None:
                arg.annotation = None
        node.returns = None
        _plain_assignments(node.body)
    return ast.dump(tree)


def _plain_assignments(body: list[Any]) -> None:
    for i, stmt in enumerate(body):
        if isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            body[i] = ast.Assign(targets=[stmt.target], value=stmt.value, type_comment=None)
        elif not isinstance(stmt, (ast.ClassDef, *_FUNCS)):
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                inner = getattr(stmt, field, None)
                if isinstance(inner, list):
                    _plain_assignments(inner)
