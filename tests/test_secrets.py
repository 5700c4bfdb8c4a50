"""Secrets come from the environment and go nowhere: not to output, state, events or files."""

from __future__ import annotations

import sqlite3
import stat

import pytest

from tests.conftest import EXAMPLES, run_cli, write_settings

pytestmark = pytest.mark.slow  # every command of the CLI, each in its own process

CANARY = "CANARY-7f3a9c-do-not-print"
SECRET_ENV = {
    "AWS_SECRET_ACCESS_KEY": CANARY,
    "AWS_SESSION_TOKEN": CANARY,
    "AZURE_CLIENT_SECRET": CANARY,
    "YC_TOKEN": CANARY,
    "YC_IAM_TOKEN": CANARY,
    "SBERCLOUD_SECRET_KEY": CANARY,
    "HUAWEICLOUD_SDK_SK": CANARY,
    "PROVISIONER_SMTP_PASSWORD": CANARY,
    "PROVISIONER_DASHBOARD_TOKEN": CANARY,
    "PROVISIONER_GCP_API_KEY": CANARY,
}


def test_canary_credentials_never_leak(home):
    cfg = write_settings(home)
    outputs = []
    for args in (
        ["plan", str(EXAMPLES / "experiment.yaml")],
        ["plan", str(EXAMPLES / "experiment.yaml"), "-o", "json"],
        ["up", str(EXAMPLES / "quickstart.yaml")],
        ["status"],
        ["status", "-o", "json"],
        ["stop", "quickstart"],
        ["start", "quickstart"],
        ["check"],
        ["check", "-o", "json"],
        ["catalog"],
        ["down", "quickstart"],
        ["status", "--all", "-o", "json"],
    ):
        r = run_cli("--config", str(cfg), *args, env=SECRET_ENV)
        assert r.returncode == 0, (args, r.stderr)
        outputs.append(r.stdout + r.stderr)
    assert all(CANARY not in o for o in outputs)
    files = [p for p in home.rglob("*") if p.is_file()]
    assert files
    for p in files:
        assert CANARY.encode() not in p.read_bytes(), p
    for db in (home / "state.db", home / "sandbox.db"):
        dump = "\n".join(sqlite3.connect(db).iterdump())
        assert CANARY not in dump and "quickstart" in dump


def test_state_and_sandbox_files_are_private(home):
    cfg = write_settings(home)
    assert run_cli("--config", str(cfg), "status").returncode == 0
    assert run_cli("--config", str(cfg), "check").returncode == 0  # opens the sandbox cloud
    files = sorted(home.glob("state.db*")) + sorted(home.glob("sandbox.db*"))
    assert home / "state.db" in files and home / "sandbox.db" in files
    for f in files:  # the WAL and shared-memory files hold the same data
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, (f, oct(f.stat().st_mode))
