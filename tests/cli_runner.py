"""The ``cli`` fixture: the console entry point run in this process (exit code, stdout and
stderr as a user gets them), for tests where a subprocess is not the point."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from provisioner.clock import CLOCK_ENV
from provisioner.entry import main
from tests.conftest import TEST_START


@dataclass
class Run:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    """run(*argv) -> Run, through the console entry point in this process (clock at
    TEST_START, 80 columns, stdin not a terminal)."""
    monkeypatch.setenv(CLOCK_ENV, TEST_START.isoformat())
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)

    def run(*argv: str) -> Run:
        monkeypatch.setattr(sys, "argv", ["provisioner", *argv])
        capsys.readouterr()
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        else:
            pytest.fail(f"{argv}: main() returned without an exit code")
        cap = capsys.readouterr()
        return Run(code, cap.out, cap.err)

    return run
