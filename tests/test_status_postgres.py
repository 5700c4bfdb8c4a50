"""`status` of a team's PostgreSQL state answered as quickly as a laptop's SQLite one: psycopg
and plain SQL, no SQLAlchemy, the same answer as the Typer command (bench/bench_status.py
times both). Each test runs on SQLite and on PostgreSQL (``db_url``)."""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal

import pytest

from tests.conftest import TEST_START, run_cli, sandbox_experiment, write_yaml
from tests.test_cli import answered_both_ways, modules_loaded_by

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

STATE = ("sqlalchemy", "alembic", "provisioner.state", "provisioner.models")


@pytest.fixture
def state_url(db_url, monkeypatch):
    """The state where `status` finds it: PROVISIONER_STATE_URL (a schema of its own on the
    PostgreSQL server), or the home's SQLite file."""
    if db_url:
        monkeypatch.setenv("PROVISIONER_STATE_URL", db_url)
    return db_url


@pytest.mark.slow  # ~10 fresh interpreters
def test_status_loads_no_sqlalchemy_while_the_clouds_agree(home, state_url):
    """A state at the current schema is read with the database's own driver; a state to
    create, or a machine the sandbox preempted, goes the full way, which writes it."""
    import providers
    from providers.base import InstanceRef

    assert modules_loaded_by("status", prefixes=STATE)  # a new state: created and migrated
    assert modules_loaded_by("status", prefixes=STATE) == []
    assert run_cli("status", "-o", "json").stdout.strip() == "[]"
    spec = write_yaml(home.parent / "exp.yaml", sandbox_experiment("one"))
    assert run_cli("up", str(spec)).returncode == 0
    assert modules_loaded_by("status", prefixes=STATE) == []
    assert modules_loaded_by("status", "--all", "-o", "json", prefixes=STATE) == []
    [machine] = json.loads(run_cli("status", "-o", "json").stdout)
    assert (machine["name"], machine["status"]) == ("one", "running")
    sandbox = providers.create("sandbox", {"db_path": str(home / "sandbox.db")})
    sandbox.preempt(  # type: ignore[attr-defined]
        InstanceRef(machine["instance_id"], machine["region"], machine["zone"])
    )
    sandbox.close()  # type: ignore[attr-defined]
    assert "provisioner.models" in modules_loaded_by("status", prefixes=STATE)
    [machine] = json.loads(run_cli("status", "-o", "json").stdout)
    assert machine["status"] == "preempted"  # recorded: the next status reads it as it is
    assert modules_loaded_by("status", prefixes=STATE) == []


def test_status_says_what_the_full_command_says(cli, home, state_url, monkeypatch):
    """Running, stopped, terminated and failed machines, costs at one instant, the failure's
    reason: the quick answer is the Typer command's, byte for byte, table and JSON."""
    import providers
    from provisioner.clock import ShiftedClock

    for n in ("m-a", "m-b", "m-c", "m-d"):
        assert cli("up", str(write_yaml(home.parent / f"{n}.yml", sandbox_experiment(n)))).code == 0
    assert cli("stop", "m-b").code == 0
    assert cli("down", "m-c").code == 0
    sandbox = providers.create("sandbox", {"db_path": str(home / "sandbox.db")})
    sandbox.inject(auth_fail=True)  # type: ignore[attr-defined]
    assert cli("up", str(write_yaml(home.parent / "e.yml", sandbox_experiment("m-e")))).code != 0
    sandbox.inject(auth_fail=False)  # type: ignore[attr-defined]
    sandbox.close()  # type: ignore[attr-defined]
    later = TEST_START + timedelta(hours=5, seconds=7, microseconds=1)
    monkeypatch.setattr(ShiftedClock, "now", lambda self: later)
    answers = {
        argv: answered_both_ways(cli, monkeypatch, *argv)
        for argv in [
            ("status",),
            ("status", "--all"),
            ("status", "-o", "json"),
            ("status", "-a", "--no-refresh", "-o", "json"),
            ("status", "--no-refresh"),
        ]
    }
    shown = {
        r["name"]: r for r in json.loads(answers["status", "-a", "--no-refresh", "-o", "json"].out)
    }
    assert {n: r["status"] for n, r in shown.items()} == {
        "m-a": "running",
        "m-b": "stopped",
        "m-c": "terminated",
        "m-d": "running",
        "m-e": "failed",
    }
    assert shown["m-a"]["spent"] and shown["m-e"]["why"]
    assert "m-c" not in answers["status",].out and "m-c" in answers["status", "--all"].out


def test_libpq_reads_values_as_psycopg_does(db_url):
    """provisioner.pq gives each type the value psycopg gives (what the full way reads):
    integers, exact decimals, aware and naive times, JSON, booleans, text, NULL, parameters."""
    if not db_url:
        pytest.skip("PostgreSQL only")
    import psycopg

    from provisioner import pq

    query = (
        "SELECT 1::int4, 9007199254740993::int8, 3.10::numeric, (SELECT sum(2::int8)),"
        " '2026-11-02 09:00:00.5+02'::timestamptz, '2026-11-02 09:00'::timestamp,"
        """ '{"a": [1, "é"]}'::json, '{"b": null}'::jsonb, true, 'naïve ''q''', NULL::text,"""
        " %s::int8 + 1, %s::text, %s::timestamptz"
    )
    params = (2**40, "m-1", TEST_START)
    conn = pq.connect(db_url)
    try:
        ours = conn.execute(query, params).fetchall()
    finally:
        conn.close()
    with psycopg.connect(db_url) as c:
        theirs = c.execute(query, params).fetchall()
    assert ours == theirs
    assert ours[0][2] == Decimal("3.10") and ours[0][4].utcoffset() == timedelta(0)
    assert len(ours[0]) == 14 and ours[0][10] is None and ours[0][11] == 2**40 + 1
    conn = pq.connect(db_url)
    with pytest.raises(pq.Error):  # the full way explains
        conn.execute("SELECT * FROM no_such_table")
    conn.close()


@pytest.mark.slow  # ~10 fresh interpreters
def test_status_with_a_job_to_ask_about_goes_the_full_way(home, state_url):
    """The full way asks a machine about its jobs the events say still run (and records their
    end, with ``on_finish``): the quick answer, which would not, steps aside while one does;
    once its end is recorded `status` is quick again."""
    spec = write_yaml(home.parent / "exp.yaml", sandbox_experiment("one"))
    assert run_cli("up", str(spec)).returncode == 0
    assert modules_loaded_by("status", prefixes=STATE) == []
    ex = run_cli("exec", "one", "--", "true")
    assert ex.returncode == 0 and ex.stdout.strip() == "exec-1", ex.stderr
    assert "provisioner.models" in modules_loaded_by("status", prefixes=STATE)
    assert modules_loaded_by("status", "--no-refresh", prefixes=STATE) == []  # asks nobody
    followed = run_cli("logs", "one", "--job", "exec-1", "-f")
    assert followed.returncode == 0 and "job exec-1: exited 0" in followed.stderr
    run_cli("status")  # records the end, if following did not
    assert modules_loaded_by("status", prefixes=STATE) == []
