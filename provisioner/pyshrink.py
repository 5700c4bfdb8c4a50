"""Python source without its comments and docstrings: what the startup data carries of the
agent (docs/LIMITS.md: EC2 takes 16 KB of user data). The code is untouched, token for token;
a result that would not parse to the same program is never returned (the source is)."""

from __future__ import annotations

import ast
import io
import tokenize


def shrink(source: str) -> str:
    """``source`` with comments (not a first-line ``#!``) and docstrings removed (a docstring
    becomes ``""``, so every body keeps a statement). The same program, checked: anything
    else returns ``source`` unchanged."""
    try:
        out = _shrink(source)
        if _program(out) == _program(source):
            return out
    except (SyntaxError, tokenize.TokenError, ValueError):
        pass
    return source


def _shrink(source: str) -> str:
    lines = source.splitlines(keepends=True)
    drop: set[int] = set()  # 0-based lines to remove entirely
    # docstrings, last first so earlier positions stay valid
    for line, col, end_line, end_col in sorted(_docstrings(source), reverse=True):
        first, last = lines[line - 1], lines[end_line - 1]
        # ast's columns count UTF-8 bytes, not characters (a "—" in a docstring is three)
        lines[line - 1] = (first.encode()[:col] + b'""' + last.encode()[end_col:]).decode()
        drop.update(range(line, end_line))  # the docstring's other lines
    text = "".join(ln for i, ln in enumerate(lines) if i not in drop)
    lines = text.splitlines(keepends=True)
    code_lines: set[int] = set()
    comments: list[tuple[int, int]] = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            if not (tok.start[0] == 1 and tok.string.startswith("#!")):
                comments.append(tok.start)
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    empty: set[int] = set()
    for row, col in comments:
        kept = lines[row - 1][:col].rstrip()
        lines[row - 1] = kept + "\n" if kept else ""
        if row not in code_lines:
            empty.add(row - 1)
    return "".join(ln for i, ln in enumerate(lines) if i not in empty)


def _docstrings(source: str) -> list[tuple[int, int, int, int]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                e = body[0]
                assert e.end_lineno is not None and e.end_col_offset is not None
                found.append((e.lineno, e.col_offset, e.end_lineno, e.end_col_offset))
    return found


def _program(source: str) -> str:
    """The program without its docstrings' text: what must not change."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                body[0].value.value = ""
    return ast.dump(tree)
