"""The map cannot go stale (issue #36, point 5): docs/ARCHITECTURE.md names every module of
provisioner/, providers/ and policies/ with one line of what it holds, and names no module that
is gone. A new module fails here with the row to paste."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import ROOT

MAP = ROOT / "docs/ARCHITECTURE.md"
PACKAGES = ("provisioner", "providers", "policies")
#: folders the map names as one row: each file in them is one of a kind (a migration each)
FOLDERS = ("provisioner/migrations/versions/",)
ROW = re.compile(r"^\| `((?:provisioner|providers|policies)/[\w/.]*)` \| (.*?) \|$", re.M)


def mapped() -> dict[str, str]:
    """Each row of the map: the path it names → what it says the module holds."""
    return dict(ROW.findall(MAP.read_text()))


def modules() -> list[str]:
    out = []
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if "__pycache__" not in rel and not rel.startswith(FOLDERS):
                out.append(rel)
    return out


def first_line(path: Path) -> str:
    """The module docstring's first sentence: a start for its row, to edit."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or "TODO: what it holds"
    text = " ".join(doc.split())
    return text.split(". ")[0].rstrip(".").replace("|", "\\|")


def test_the_map_names_every_module():
    rows = mapped()
    missing = [m for m in modules() if m not in rows]
    paste = "\n".join(f"| `{m}` | {first_line(ROOT / m)} |" for m in missing)
    assert not missing, (
        f"docs/ARCHITECTURE.md, 'Every module, one line each', lacks {len(missing)} "
        f"module(s): {', '.join(missing)}. Add these rows to the table of their folder "
        f"(edit each line to say what the module holds):\n{paste}"
    )


def test_the_map_names_no_module_that_is_gone():
    gone = [
        p for p in mapped() if not (ROOT / p).exists() or (p.endswith("/") and p not in FOLDERS)
    ]
    assert not gone, f"docs/ARCHITECTURE.md names what no longer exists: {', '.join(gone)}"


def test_each_row_says_what_its_module_holds():
    empty = [p for p, what in mapped().items() if len(what.split()) < 3]
    assert not empty, f"say in a few words what these hold: {', '.join(empty)}"


def dotted(path: str) -> str:
    name = path.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def test_provisioners_rows_follow_the_layer_order():
    """The map lists provisioner/ lowest first, as tests/test_layers.py's ORDER ranks it."""
    from tests.test_layers import ORDER

    shown = [dotted(p) for p in mapped() if dotted(p) in ORDER]
    want = [m for m in ORDER if m in shown]
    wrong = [
        f"`{m}` goes just after `{want[i - 1]}`" if i else f"`{m}` goes first"
        for i, m in enumerate(want)
        if shown[i] != m
    ][:1]
    assert shown == want, f"docs/ARCHITECTURE.md: put the rows in ORDER's order: {wrong[0]}"
