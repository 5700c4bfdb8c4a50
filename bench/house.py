"""The house's shape, measured: the walk of one `up` through provisioner's modules, and the
functions that are hard to read (cyclomatic complexity ≥ 11 by radon, length ≥ 60 lines) and
the product modules over 600 lines.

    .venv/bin/python bench/house.py            # needs `pip install radon`

The walk runs `provisioner up --no-wait configs/examples/quickstart.yaml` in this process on a
fresh home (the sandbox cloud) under a profile hook and reduces every Python call in
provisioner/, providers/ and policies/ to the sequence of modules it runs in (consecutive calls
in one module folded into one step). Only the work's own modules count (provisioner's from
the catalog up, and
the cloud adapters; not the helpers every layer calls: money, clock, state, models, settings).
"Visited" counts distinct modules; "returns" counts steps that enter a module the walk had
already left: a walk that reads top to bottom returns rarely.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("provisioner", "providers", "policies")


def _module(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    if rel.parts[0] not in PACKAGES or rel.suffix != ".py" or "migrations" in rel.parts:
        return None
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def up_walk() -> tuple[int, int, list[str]]:
    home = tempfile.mkdtemp(prefix="walk-")
    os.environ["PROVISIONER_HOME"] = home
    sys.path.insert(0, str(ROOT))
    from provisioner.cli.main import main

    steps: list[str] = []

    def hook(frame, event, arg):  # type: ignore[no-untyped-def]
        # function calls only: module and class bodies (no CO_OPTIMIZED flag) run on import
        if event == "call" and frame.f_code.co_flags & inspect.CO_OPTIMIZED:
            mod = _module(frame.f_code.co_filename)
            if mod and (not steps or steps[-1] != mod):
                steps.append(mod)

    sys.setprofile(hook)
    try:
        sys.argv = [
            "provisioner",
            "up",
            "--no-wait",
            str(ROOT / "configs/examples/quickstart.yaml"),
        ]
        main()
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
    # the work's own modules: provisioner's from the catalog up (tests/test_layers.py's order),
    # and the cloud adapters; the helpers every layer uses (money, clock, state, models,
    # settings, the registry) are not steps of the walk
    sys.path.insert(0, str(ROOT))
    from tests.test_layers import ORDER

    work = set(ORDER[ORDER.index("provisioner.catalog") :])
    steps = [s for s in steps if s in work or (s.count(".") >= 2 and s.startswith("providers."))]
    steps = [s for i, s in enumerate(steps) if i == 0 or steps[i - 1] != s]
    seen: set[str] = set()
    returns = 0
    for s in steps:
        if s in seen:
            returns += 1
        seen.add(s)
    return len(seen), returns, steps


def complexity() -> tuple[int, int, list[tuple[str, int]]]:
    """radon's own count (`radon cc -n C`): functions and methods, closures not counted apart."""
    import json

    radon = Path(sys.executable).with_name("radon")
    files = [
        str(f)
        for pkg in PACKAGES
        for f in sorted((ROOT / pkg).rglob("*.py"))
        if "migrations" not in f.parts
    ]
    report = json.loads(
        subprocess.run(
            [radon, "cc", "-j", *files], capture_output=True, text=True, check=True
        ).stdout
    )
    cc11 = long60 = 0
    big: list[tuple[str, int]] = []
    for f, blocks in report.items():
        n = Path(f).read_text(encoding="utf-8").count("\n")
        if n > 600:
            big.append((str(Path(f).relative_to(ROOT)), n))
        for b in blocks:
            if b["type"] in ("function", "method"):
                cc11 += b["complexity"] >= 11
                long60 += (b["endline"] - b["lineno"] + 1) >= 60
    return cc11, long60, big


if __name__ == "__main__":
    if sys.argv[1:] == ["--walk-child"]:
        visited, returns, steps = up_walk()
        print(f"up walk: {visited} modules visited, {returns} returns to a module already left")
        print("  " + " > ".join(steps[:400]))
        sys.exit(0)
    out = subprocess.run(
        [sys.executable, __file__, "--walk-child"], capture_output=True, text=True, check=False
    )
    walk = [ln for ln in out.stdout.splitlines() if ln.startswith("up walk")]
    print(walk[0] if walk else out.stderr[-2000:])
    cc11, long60, big = complexity()
    print(f"functions with cyclomatic complexity >= 11: {cc11}; >= 60 lines: {long60}")
    print("product modules over 600 lines: " + (", ".join(f"{p} ({n})" for p, n in big) or "none"))
