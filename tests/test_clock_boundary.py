"""The clock is the clock: ``PROVISIONER_CLOCK`` moves time for what-ifs and tests, never for a
real state. On a state made on the real clock, a command on a shifted clock that would write the
state or act on a cloud is refused in one line (exit 2) and leaves every table and the cloud as
they were; ``plan``, ``report``, ``status`` and ``events`` look, and write nothing. A state made
on a shifted clock is a simulated one, where everything runs (as the tests do), and says so."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import inspect, select, text

from providers.base import InstanceRef
from provisioner.app import App
from provisioner.clock import CLOCK_ENV, Clock, ShiftedClock
from provisioner.models import Event, Machine
from provisioner.realclock import RealClockOnly
from provisioner.schema import MIGRATIONS, EventKind
from provisioner.settings import load_settings
from provisioner.state import Database
from tests.conftest import TEST_START, run_cli, sandbox_experiment, write_settings, write_yaml

REAL = {CLOCK_ENV: ""}  # the wall clock: how a person runs provisioner
SHIFTED = {CLOCK_ENV: "2020-01-15T10:00:00+00:00"}  # the attack of issue 33


def state_rows(url: str) -> dict[str, list[tuple]]:
    """Every row of every table of the state (alembic_version included)."""
    db = Database(url)
    try:
        with db.engine.connect() as conn:
            return {
                t: sorted(map(repr, conn.execute(text(f'SELECT * FROM "{t}"'))))
                for t in inspect(conn).get_table_names()
            }
    finally:
        db.dispose()


def cloud_machines(home: Path) -> list[tuple]:
    """The sandbox cloud's instances, as it holds them."""
    with sqlite3.connect(home / "sandbox.db") as conn:
        return sorted(conn.execute("SELECT * FROM machines"))


def clock_row(url: str) -> list[tuple]:
    db = Database(url)
    try:
        with db.engine.connect() as conn:
            return list(conn.execute(text("SELECT key, value FROM state_meta")))
    finally:
        db.dispose()


@pytest.fixture
def real(home: Path, tmp_path: Path, db_url: str | None):
    """A real state (made on the wall clock) holding one running sandbox machine, `exp`,
    launched on the wall clock; and a second experiment, `xp`, never launched."""
    cfg = write_settings(home, state_url=db_url)
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("exp"))
    other = write_yaml(tmp_path / "x.yaml", sandbox_experiment("xp"))
    up = run_cli("--config", str(cfg), "up", str(spec), env=REAL)
    assert up.returncode == 0, up.stderr
    url = load_settings(str(cfg)).database_url
    assert clock_row(url) == []  # made on the real clock: a real state
    return cfg, url, other


#: (the command as the refusal names it, its arguments)
REFUSED = [
    ("up", ["{x}"]),
    ("sweep", []),
    ("stop", ["exp"]),
    ("start", ["exp"]),
    ("down", ["exp", "--yes"]),
    ("token create", []),
    ("token revoke", ["1"]),
    ("keep", ["exp", "--until", "2020-01-15T12:00:00+00:00"]),
    ("autostop", ["exp", "30m"]),
    ("exec", ["exp", "true"]),
    ("sync", ["exp"]),
    ("logs", ["exp"]),
    ("gc", ["--terminate", "--yes"]),
    ("bill", []),
    ("volume rm", ["data", "--yes"]),
    ("catalog refresh", ["--cloud", "sandbox"]),
    ("selftest", ["--cloud", "sandbox"]),
    ("scheduler run", []),
    ("dashboard", []),
]


def test_a_shifted_clock_on_a_real_state_writes_nothing_and_acts_on_no_cloud(real, home):
    cfg, url, other = real
    before, cloud = state_rows(url), cloud_machines(home)
    for name, args in REFUSED:
        argv = [*name.split(), *(a.format(x=other) for a in args)]
        r = run_cli("--config", str(cfg), *argv, env=SHIFTED)
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, (argv, r.stderr)
        assert f"`{name}` writes the state and acts on a cloud on the real clock" in r.stderr
        assert "unset PROVISIONER_CLOCK" in r.stderr
        assert r.stdout == ""
        assert state_rows(url) == before, argv
        assert cloud_machines(home) == cloud, argv
    # the same commands on the real clock are not refused by it
    r = run_cli("--config", str(cfg), "stop", "exp", env=REAL)
    assert r.returncode == 0, r.stderr


def test_plan_report_status_and_events_are_what_ifs_on_a_real_state(real, home):
    cfg, url, other = real
    before, cloud = state_rows(url), cloud_machines(home)
    looks = [
        ("plan", str(other)),
        ("report",),
        ("report", "--period", "2020-01", "--by", "machine"),
        ("status",),
        ("status", "--summary"),
        ("status", "exp"),
        ("events",),
        ("catalog",),
        ("token", "list"),
        ("volume", "ls"),
        ("ssh-config",),
    ]
    for argv in looks:
        r = run_cli("--config", str(cfg), *argv, env=SHIFTED)
        assert r.returncode == 0, (argv, r.stderr)
        assert "Traceback" not in r.stderr
    assert state_rows(url) == before
    assert cloud_machines(home) == cloud
    mailed = run_cli("--config", str(cfg), "report", "--to", "cfo@example.com", env=SHIFTED)
    assert mailed.returncode == 2
    assert "`report --email` sends the report on the real clock" in mailed.stderr
    st = run_cli("--config", str(cfg), "status", "-o", "json", env=SHIFTED)
    assert "a what-if at 2020-01-15 10:00 UTC: the machines as recorded" in st.stderr
    assert "simulated" not in st.stderr  # a real state: nothing says otherwise


def test_a_write_or_act_nobody_listed_is_refused_at_the_database_and_the_cloud(real, home):
    """The App on a shifted clock over a real state may read and ask, and any write or act it
    would make is refused in the same words, before it reaches the database or the cloud."""
    cfg, url, _ = real
    before, cloud = state_rows(url), cloud_machines(home)
    app = App(load_settings(str(cfg)), ShiftedClock(TEST_START))
    app.command = "report"
    try:
        with app.db.session() as s:
            first = s.scalars(select(Event)).first()
            machine = s.get(Machine, first.machine_id) if first else None
        assert first is not None and machine is not None
        at = app.clock.now()
        with pytest.raises(RealClockOnly, match="`report` writes the state"), app.db.session() as s:
            s.add(Event(machine_id=first.machine_id, at=at, kind=EventKind.STOPPED))
        sandbox = app.provider("sandbox")
        ref = InstanceRef(machine.instance_id or "", machine.region or "", machine.zone or "")
        assert sandbox.get(ref).state == "running"  # asking is looking
        for act in (sandbox.stop, sandbox.terminate):
            with pytest.raises(RealClockOnly, match="`report` writes the state"):
                act(ref)
    finally:
        app.close()
    assert state_rows(url) == before
    assert cloud_machines(home) == cloud


def test_a_state_made_on_a_shifted_clock_is_simulated_and_says_so(home, tmp_path, db_url):
    cfg = write_settings(home, state_url=db_url)
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("exp"))
    up = run_cli("--config", str(cfg), "up", str(spec), env=SHIFTED)
    assert up.returncode == 0, up.stderr
    url = load_settings(str(cfg)).database_url
    assert clock_row(url) == [("clock", "simulated")]
    for env in (SHIFTED, REAL):  # whoever looks, on whatever clock, is told
        st = run_cli("--config", str(cfg), "status", "--no-refresh", env=env)
        assert st.returncode == 0, st.stderr
        assert "this state was made on a simulated clock (PROVISIONER_CLOCK)" in st.stderr
        assert "exp" in st.stdout
    down = run_cli("--config", str(cfg), "down", "exp", env=SHIFTED)
    assert down.returncode == 0, down.stderr
    assert clock_row(url) == [("clock", "simulated")]


def test_an_existing_real_state_is_never_marked_simulated(home, db_url):
    """A state made on the real clock stays real when a shifted clock opens it, at the newest
    schema or at an older one it then migrates."""
    cfg = write_settings(home, state_url=db_url)
    url = load_settings(str(cfg)).database_url
    db = Database(url)
    cfg_alembic = Config()
    cfg_alembic.set_main_option("script_location", str(MIGRATIONS))
    with db.engine.begin() as conn:  # a state made before state_meta existed
        cfg_alembic.attributes["connection"] = conn
        command.upgrade(cfg_alembic, "0013")
    db.dispose()
    r = run_cli("--config", str(cfg), "status", env=SHIFTED)
    assert r.returncode == 0, r.stderr
    assert clock_row(url) == []
    r = run_cli("--config", str(cfg), "sweep", env=SHIFTED)
    assert r.returncode == 2 and "`sweep` writes the state" in r.stderr
    made = App(load_settings(str(cfg)), Clock())  # the real clock still writes
    try:
        assert made.db.simulated is False
    finally:
        made.close()
