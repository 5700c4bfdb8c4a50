"""The team's state enforces its rules (issue 33, point 2): a member connected with plain SQL,
or through a CLI whose own checks a local file widened, cannot launch as someone else, change
someone else's machine, raise a cap, grant themselves ``act_as``, create another member's
token, rewrite the ledger or write on a shifted clock. Real PostgreSQL login roles (a random
suffix each: roles are cluster-wide), dropped at the end."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
import yaml

from provisioner.state import Database
from provisioner.team_sql import grant_member
from tests.conftest import MEMBERS_ENV, PG_URL, sandbox_experiment, write_settings
from tests.conftest import write_yaml as write_yaml_file

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

psycopg = pytest.importorskip("psycopg")
REFUSED = "42501"  # insufficient_privilege: every refusal below

ALICE, BOB, LEAD, SCHED = "alice@lab.org", "bob@lab.org", "lead@lab.org", "sched@lab.org"

#: the state marked made for tests (the CLI's clock is the test's, not the server's)
SIMULATED = (
    "INSERT INTO state_meta (key, value) VALUES ('clock', 'simulated') ON CONFLICT DO NOTHING"
)


@dataclass
class Team:
    schema: str
    roles: dict[str, str]  # who → role name

    def url(self, who: str | None = None) -> str:
        base = PG_URL if who is None else _with_user(PG_URL, self.roles[who])
        return f"{base}?options=-csearch_path%3D{self.schema}&application_name={self.schema}"

    def sql(self, who: str | None = None) -> psycopg.Connection:
        return psycopg.connect(self.url(who), autocommit=True)


def _with_user(url: str, user: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).set(username=user).render_as_string(hide_password=False)


@pytest.fixture
def team(postgres_problem: str | None) -> Iterator[Team]:
    """A migrated team state in a schema of its own: alice, bob and lead are members (lead may
    act for alice), a scheduler role; each granted its kind's privileges by the admin (the
    superuser that migrated it)."""
    if postgres_problem:
        pytest.skip(postgres_problem)
    suffix = uuid.uuid4().hex[:8]
    schema = f"t_{suffix}"
    roles = {who: f"{who}_{suffix}" for who in ("alice", "bob", "lead", "sched", "stranger")}
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
        for role in roles.values():
            conn.execute(f'CREATE ROLE "{role}" LOGIN')
    t = Team(schema, roles)
    try:
        db = Database(t.url())
        db.migrate()
        db.dispose()
        with t.sql() as conn:
            members = [("alice", ALICE, "member"), ("bob", BOB, "member")]
            members += [("lead", LEAD, "member"), ("sched", SCHED, "scheduler")]
            for who, email, kind in members:
                conn.execute(
                    "INSERT INTO team_members (role, email, kind, version) VALUES (%s, %s, %s, 1)",
                    (roles[who], email, kind),
                )
                grant_member(conn, roles[who], kind)
            grant_member(conn, roles["stranger"])  # privileges, but not in the member map
            conn.execute(
                "INSERT INTO team_grants (version, actor_glob, owner_glob, project_glob)"
                " VALUES (1, 'lead@*', 'alice@lab.org', 'de?o')"
            )
        yield t
    finally:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = %s",
                (schema,),
            )
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
            for role in roles.values():
                conn.execute(f'DROP OWNED BY "{role}"')
                conn.execute(f'DROP ROLE "{role}"')


def machine(conn: psycopg.Connection, name: str, owner: str, *, at: str = "now()") -> str:
    mid = uuid.uuid4().hex
    conn.execute(
        "INSERT INTO machines (id, name, project, owner, status, spec, created_at)"
        f" VALUES (%s, %s, 'demo', %s, 'running', '{{}}', {at})",
        (mid, name, owner),
    )
    return mid


def refused(conn: psycopg.Connection, sql: str, params: tuple = ()) -> str:
    """The message of the database's refusal of ``sql`` (fails the test when it is done)."""
    with pytest.raises(psycopg.Error) as e:
        conn.execute(sql, params)
    assert e.value.sqlstate == REFUSED, e.value
    return str(e.value)


#: an event of a machine (%s) by an actor (%s) at an instant ({})
EVENT = (
    "INSERT INTO events (machine_id, at, kind, detail, actor)"
    " VALUES (%s, {}, 'stopped', '{{}}', %s)"
)


def count(conn: psycopg.Connection, sql: str, params: tuple = ()) -> int:
    row = conn.execute(sql, params).fetchone()
    assert row is not None
    return int(row[0])


# --- plain SQL ------------------------------------------------------------------------------


def test_a_member_cannot_launch_as_someone_else_but_launches_as_themselves(team):
    with team.sql("bob") as bob:
        why = refused(
            bob,
            "INSERT INTO machines (id, name, project, owner, status, spec, created_at)"
            " VALUES ('x1', 'hers', 'demo', %s, 'requested', '{}', now())",
            (ALICE,),
        )
        assert f"{BOB} may not act for {ALICE} on project demo" in why
        mine = machine(bob, "mine", BOB)
        bob.execute("UPDATE machines SET status = 'stopped' WHERE id = %s", (mine,))
    with team.sql() as admin:
        assert count(admin, "SELECT count(*) FROM machines WHERE owner = %s", (ALICE,)) == 0
        assert count(admin, "SELECT count(*) FROM machines WHERE status = 'stopped'") == 1


def test_a_member_cannot_change_someone_elses_machine_nor_give_theirs_away(team):
    with team.sql() as admin:
        hers = machine(admin, "hers", ALICE)
    with team.sql("bob") as bob:
        mine = machine(bob, "mine", BOB)
        assert count(bob, "SELECT count(*) FROM machines") == 2  # looking is open to members
        why = refused(bob, "UPDATE machines SET status = 'stopped' WHERE id = %s", (hers,))
        assert f"may not act for {ALICE}" in why
        refused(bob, "UPDATE machines SET owner = %s WHERE id = %s", (BOB, hers))
        refused(bob, "UPDATE machines SET owner = %s WHERE id = %s", (ALICE, mine))
        refused(bob, "DELETE FROM machines WHERE id = %s", (hers,))
    with team.sql() as admin:
        row = admin.execute("SELECT status, owner FROM machines WHERE id = %s", (hers,)).fetchone()
        assert row == ("running", ALICE)


def test_an_act_as_grant_lets_its_holder_act_for_its_owner_on_its_projects_only(team):
    with team.sql() as admin:
        hers = machine(admin, "hers", ALICE)
        bobs = machine(admin, "bobs", BOB)
    with team.sql("lead") as lead:
        lead.execute("UPDATE machines SET status = 'stopped' WHERE id = %s", (hers,))
        refused(lead, "UPDATE machines SET status = 'stopped' WHERE id = %s", (bobs,))
        refused(lead, "UPDATE machines SET project = 'other' WHERE id = %s", (hers,))
    with team.sql("sched") as sched:  # the scheduler acts on every machine
        sched.execute("UPDATE machines SET status = 'stopped' WHERE id = %s", (bobs,))


def test_a_member_cannot_grant_themselves_act_as_raise_a_cap_or_join_as_admin(team):
    with team.sql("bob") as bob:
        refused(
            bob,
            "INSERT INTO team_grants (version, actor_glob, owner_glob, project_glob)"
            " VALUES (2, %s, '*', '*')",
            (BOB,),
        )
        refused(
            bob,
            "INSERT INTO team_rules (applied_at, applied_by, role, digest, document)"
            " VALUES (now(), %s, current_user, 'x', '{\"per_owner\": {\"max_machines\": 99}}')",
            (BOB,),
        )
        refused(bob, "UPDATE team_members SET kind = 'admin' WHERE role = current_user")
        refused(bob, "UPDATE team_members SET email = %s WHERE role = current_user", (ALICE,))
        refused(bob, "DELETE FROM team_grants")
        refused(
            bob,
            SIMULATED,
        )
        assert count(bob, "SELECT count(*) FROM team_grants") == 1  # the rules are readable
    with team.sql() as admin:  # the team's rules are append-only, even for an admin role
        admin.execute(
            "INSERT INTO team_rules (applied_at, applied_by, role, digest, document)"
            " VALUES (now(), 'admin@lab.org', current_user, 'x', '{}')"
        )
        admin.execute(
            "INSERT INTO team_members (role, email, kind, version) VALUES (%s, %s, 'admin', 1)",
            (team.roles["stranger"], "root@lab.org"),
        )
        grant_member(admin, team.roles["stranger"], "admin")
    with team.sql("stranger") as root:
        refused(root, "UPDATE team_rules SET document = '{}'")
        root.execute(  # an admin role applies a new version and its grants
            "INSERT INTO team_grants (version, actor_glob, owner_glob, project_glob)"
            " VALUES (2, %s, '*', '*')",
            (BOB,),
        )


def test_a_member_cannot_create_another_members_token_and_sees_only_their_own(team):
    insert = (
        'INSERT INTO tokens (id, "user", salt, hash, created_at, created_by)'
        " VALUES (%s, %s, 's', 'h', now(), %s)"
    )
    with team.sql() as admin:
        admin.execute(insert, ("a1", ALICE, "admin@lab.org"))
    with team.sql("bob") as bob:
        why = refused(bob, insert, ("b1", ALICE, BOB))
        assert f"may not create a token of {ALICE}" in why
        refused(bob, insert, ("b2", BOB, ALICE))  # nor sign it as someone else
        bob.execute(insert, ("b3", BOB, BOB))
        assert [r[0] for r in bob.execute("SELECT id FROM tokens")] == ["b3"]
        refused(bob, "UPDATE tokens SET hash = 'mine' WHERE id = 'b3'")  # only its revocation
        bob.execute("UPDATE tokens SET revoked_at = now() WHERE id = 'b3'")
        refused(bob, "DELETE FROM tokens")
    with team.sql("sched") as sched:  # the dashboard's role verifies everyone's tokens
        assert count(sched, "SELECT count(*) FROM tokens") == 2


def test_nobody_but_the_owner_rewrites_the_ledger(team):
    with team.sql() as admin:
        hers = machine(admin, "hers", ALICE)
    with team.sql("bob") as bob:
        mine = machine(bob, "mine", BOB)
        interval = (
            "INSERT INTO usage_intervals (machine_id, kind, started_at, ended_at, rate, currency,"
            " start_us, end_us) VALUES (%s, 'compute', now() - interval '1 minute', {}, '1.5',"
            " 'USD', 0, {}) RETURNING id"
        )
        closed = bob.execute(interval.format("now()", "1"), (mine,)).fetchone()[0]
        open_ = bob.execute(interval.format("NULL", "NULL"), (mine,)).fetchone()[0]
        refused(bob, interval.format("NULL", "NULL"), (hers,))
        later = "UPDATE usage_intervals SET ended_at = ended_at + interval '1s' WHERE id = %s"
        why = refused(bob, later, (closed,))
        assert "a closed usage interval is the ledger" in why
        refused(bob, "UPDATE usage_intervals SET rate = '0' WHERE id = %s", (open_,))
        refused(bob, "DELETE FROM usage_intervals WHERE id = %s", (closed,))
        close = "UPDATE usage_intervals SET ended_at = now(), end_us = 2 WHERE id = %s"
        bob.execute(close, (open_,))
        refused(bob, "UPDATE usage_intervals SET ended_at = NULL WHERE id = %s", (open_,))
        event = EVENT.format("now()")
        bob.execute(event, (mine, BOB))
        why = refused(bob, event, (mine, ALICE))
        assert f"names {ALICE} as its actor" in why
        refused(bob, event, (hers, BOB))
        refused(bob, "UPDATE events SET kind = 'started'")
        refused(bob, "DELETE FROM events")
    with team.sql("sched") as sched:
        refused(sched, "UPDATE usage_intervals SET ended_at = now() WHERE id = %s", (closed,))
        refused(sched, "DELETE FROM events")
        sched.execute("UPDATE events SET detail = '{\"note\": 1}'")  # a refusal's numbers
        refused(sched, "UPDATE events SET at = now() - interval '1 day'")
    with team.sql() as admin:
        assert count(admin, "SELECT count(*) FROM usage_intervals") == 2
        assert count(admin, "SELECT count(*) FROM events WHERE actor = %s", (BOB,)) == 1


def test_a_shifted_client_clock_writes_nothing_unless_the_state_is_simulated(team):
    with team.sql("bob") as bob:
        why = refused(
            bob,
            "INSERT INTO machines (id, name, project, owner, status, spec, created_at)"
            " VALUES ('old', 'old', 'demo', %s, 'requested', '{}', '2020-01-15 10:00+00')",
            (BOB,),
        )
        assert "created_at 2020-01-15" in why
        mine = machine(bob, "mine", BOB)
        event = EVENT
        refused(bob, event.format("'2020-01-15 10:00+00'"), (mine, BOB))
        why = refused(bob, event.format("now() + interval '1 day'"), (mine, BOB))
        assert "after the server's clock" in why
        refused(
            bob,
            "INSERT INTO usage_intervals (machine_id, kind, started_at, rate, currency, start_us)"
            " VALUES (%s, 'compute', '2020-01-15 10:00+00', '99', 'USD', 0)",
            (mine,),
        )
        why = refused(  # nor moves the floor of those checks
            bob, "UPDATE machines SET created_at = '2020-01-01 00:00+00' WHERE id = %s", (mine,)
        )
        assert "when it was made is history" in why
        # a past instant after the machine was made stays possible: a stop observed late
        bob.execute(event.format("now() - interval '5 minutes'"), (mine, BOB))
    with team.sql() as admin:
        admin.execute(SIMULATED)
    with team.sql("bob") as bob:
        machine(bob, "test-clock", BOB, at="'2020-01-15 10:00+00'")


def test_a_role_outside_the_member_map_sees_and_writes_nothing(team):
    with team.sql() as admin:
        machine(admin, "hers", ALICE)
    with team.sql("stranger") as stranger:
        assert count(stranger, "SELECT count(*) FROM machines") == 0
        refused(
            stranger,
            "INSERT INTO machines (id, name, project, owner, status, spec, created_at)"
            " VALUES ('s1', 's', 'demo', 'stranger@lab.org', 'requested', '{}', now())",
        )


GLOBS = [
    ("a@b.org", "*@b.org"),
    ("axb", "a.b"),
    ("a.b", "a?b"),
    ("c", "[!ab]"),
    ("b", "[c-a]"),
    ("a[b", "a[b"),
    ("]", "[]]"),
    ("]", "[!]]"),
    ("a+b", "a+b"),
    ("a\\b", "a\\b"),
    ("ab", "[*]"),
    ("-", "[a-]"),
    ("a", "[^]"),
    ("^", "[^]"),
    ("é@x", "?@x"),
    ("a\nb", "a*b"),
    ("{x}", "{x}"),
    ("a|c", "a|b"),
    ("", "*"),
    ("B", "[a-z]"),
    ("x", "[!]"),
    ("lead@lab.org", "lead@*"),
    ("leader@lab.org", "lead@*"),
]


def test_the_databases_globs_match_as_fnmatch_does(team):
    with team.sql() as conn:
        for value, glob in GLOBS:
            got = conn.execute("SELECT prov_glob(%s, %s)", (value, glob)).fetchone()
            assert got is not None and got[0] is fnmatchcase(value, glob), (value, glob)


# --- through the CLI ------------------------------------------------------------------------


def _settings_for(home: Path, url: str, name: str) -> Path:
    path = write_settings(home, state_url=url)
    return path.rename(path.with_name(name))


@pytest.fixture
def fleet(team, home: Path, tmp_path: Path, cli, monkeypatch) -> tuple[Path, Path]:
    """alice's machine launched by her own CLI; bob's settings on the same sandbox cloud, with a
    local policy file granting himself act_as over everyone (which his CLI honours)."""
    with team.sql() as admin:  # the CLI's clock is the test's: a state made for tests
        admin.execute(SIMULATED)
    members = {team.roles["alice"]: ALICE, team.roles["bob"]: BOB, "postgres": "admin@lab.org"}
    monkeypatch.setenv(MEMBERS_ENV, json.dumps(members))
    spec = sandbox_experiment("hers")
    spec["owner"] = ALICE
    admin_cfg = _settings_for(home, team.url(), "admin.yaml")
    r = cli("--config", str(admin_cfg), "status")  # the admin's first run publishes the pull key
    assert r.code == 0, r.err
    alice_cfg = _settings_for(home, team.url("alice"), "alice.yaml")
    r = cli("--config", str(alice_cfg), "up", str(write_yaml_file(tmp_path / "h.yaml", spec)), "-d")
    assert r.code == 0, r.err
    widened = write_yaml_file(tmp_path / "mine.yaml", {"name": "mine", "act_as": {BOB: ["*"]}})
    bob_cfg = _settings_for(home, team.url("bob"), "bob.yaml")
    data = yaml.safe_load(bob_cfg.read_text())
    data["policies"] = [str(widened)]
    write_yaml_file(bob_cfg, data)
    return alice_cfg, bob_cfg


def _status_of(team: Team, name: str) -> str:
    with team.sql() as admin:
        row = admin.execute(
            "SELECT status FROM machines WHERE name = %s ORDER BY created_at DESC", (name,)
        ).fetchone()
    assert row is not None
    return str(row[0])


@pytest.mark.parametrize("op", ["stop", "down"])
def test_the_cli_widened_by_a_local_file_is_refused_by_the_state_in_one_line(team, fleet, cli, op):
    _, bob = fleet
    r = cli("--config", str(bob), op, "hers")
    assert r.code == 2, (r.out, r.err)
    assert "Traceback" not in r.err
    lines = [line for line in r.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "the team's state refused" in lines[0], r.err
    assert f"act for {ALICE}" in lines[0]
    assert _status_of(team, "hers") == "running"
    alice, _ = fleet
    r = cli("--config", str(alice), "status", "-o", "json")  # the cloud left it running too
    assert r.code == 0, r.err
    assert [m["status"] for m in json.loads(r.out) if m["name"] == "hers"] == ["running"]


def test_the_cli_cannot_launch_for_another_or_make_their_token(team, fleet, cli, tmp_path):
    _, bob = fleet
    spec = sandbox_experiment("for-her")
    spec["owner"] = ALICE
    r = cli("--config", str(bob), "up", str(write_yaml_file(tmp_path / "f.yaml", spec)), "-d")
    assert r.code == 2, (r.out, r.err)
    assert "the team's state refused" in r.err and "Traceback" not in r.err
    with team.sql() as admin:
        assert count(admin, "SELECT count(*) FROM machines WHERE name = 'for-her'") == 0
    r = cli("--config", str(bob), "token", "create", "--user", ALICE)
    assert r.code == 2, (r.out, r.err)
    assert "the team's state refused" in r.err and "pvt_" not in r.out
    with team.sql() as admin:
        assert count(admin, 'SELECT count(*) FROM tokens WHERE "user" = %s', (ALICE,)) == 0


def test_the_cli_of_a_member_runs_their_own_machine_and_status_beside_others(
    team, fleet, cli, tmp_path
):
    _, bob = fleet
    spec = sandbox_experiment("his")
    spec["owner"] = BOB
    r = cli("--config", str(bob), "up", str(write_yaml_file(tmp_path / "b.yaml", spec)), "-d")
    assert r.code == 0, r.err
    r = cli("--config", str(bob), "stop", "his")
    assert r.code == 0, r.err
    r = cli("--config", str(bob), "status", "-a")
    assert r.code == 0, r.err
    assert "hers" in r.out and "his" in r.out
    assert _status_of(team, "his") == "stopped"
    with team.sql() as admin:
        actors = {a for (a,) in admin.execute("SELECT DISTINCT actor FROM events")}
    assert actors == {ALICE, BOB}


def test_the_cli_cannot_remove_someone_elses_volume(team, fleet, cli, tmp_path, home):
    alice, bob = fleet
    spec = sandbox_experiment("with-disk")
    spec["owner"] = ALICE
    spec["volumes"] = [{"name": "ckpt", "size_gb": 73, "path": "/data"}]
    r = cli("--config", str(alice), "up", str(write_yaml_file(tmp_path / "v.yaml", spec)), "-d")
    assert r.code == 0, r.err
    assert cli("--config", str(alice), "down", "with-disk").code == 0
    r = cli("--config", str(bob), "volume", "rm", "ckpt", "--yes")
    assert r.code == 2, (r.out, r.err)
    assert "the team's state refused" in r.err and f"act for {ALICE}" in r.err
    r = cli("--config", str(alice), "volume", "ls", "-o", "json")
    assert [v["status"] for v in json.loads(r.out)["volumes"]] == ["available"]
    assert _cloud_volumes(home) == 1  # refused before the cloud was asked to delete it


def _cloud_volumes(home: Path) -> int:
    """How many disks the sandbox cloud (its file in the shared home) still has."""
    import sqlite3

    db = sqlite3.connect(home / "sandbox.db")
    try:
        return int(db.execute("SELECT count(*) FROM volumes").fetchone()[0])
    finally:
        db.close()


def test_the_scheduler_role_sweeps_every_members_machine_with_its_grants(team, home, tmp_path):
    """The scheduler's own role stops alice's machine past its lifetime: the privileges of its
    kind cover a sweep's writes (events, the ledger, leases, notices)."""
    from datetime import timedelta

    from provisioner import identity, machines
    from provisioner.app import App
    from provisioner.clock import ManualClock
    from provisioner.jobs import sweep
    from provisioner.spec import Experiment
    from tests.conftest import TEST_START, make_settings

    with team.sql() as admin:
        admin.execute(SIMULATED)
    pol = str(write_yaml_file(tmp_path / "team.yaml", {"name": "team", "max_lifetime": "1h"}))
    members = {"members": {team.roles["alice"]: ALICE, team.roles["sched"]: SCHED}}
    clock = ManualClock(TEST_START)
    alice = App(make_settings(home, state_url=team.url("alice"), identity=members), clock)
    spec = {**sandbox_experiment("long"), "owner": ALICE}
    machines.up(alice, Experiment.model_validate(spec))
    daemon = App(
        make_settings(home, state_url=team.url("sched"), identity=members, policies=[pol]), clock
    )
    daemon.actor = identity.SCHEDULER
    clock.advance(timedelta(hours=2))
    result = sweep.run(daemon)
    assert [a.machine for a in result.actions] == ["long"], result.actions
    assert _status_of(team, "long") == "stopped"
    with team.sql() as admin:
        assert count(admin, "SELECT count(*) FROM events WHERE actor = 'scheduler'") >= 1
        open_ = "SELECT count(*) FROM usage_intervals WHERE kind = 'compute' AND ended_at IS NULL"
        assert count(admin, open_) == 0
    alice.close()
    daemon.close()


def test_the_cli_on_a_shifted_clock_writes_nothing_to_a_team_state(
    team, home, tmp_path, cli, monkeypatch
):
    """The attack of issue 33: `PROVISIONER_CLOCK=2020-… provisioner up` to dodge a budget
    and date the ledger in 2020. The state is a real one (no ``clock: simulated``)."""
    from provisioner.clock import CLOCK_ENV

    monkeypatch.setenv(MEMBERS_ENV, json.dumps({team.roles["bob"]: BOB}))
    admin = _settings_for(home, team.url(), "admin.yaml")
    assert cli("--config", str(admin), "status").code == 0  # publishes the pull key
    bob = _settings_for(home, team.url("bob"), "bob.yaml")
    monkeypatch.setenv(CLOCK_ENV, "2020-01-15T10:00:00+00:00")
    spec = {**sandbox_experiment("old"), "owner": BOB}
    r = cli("--config", str(bob), "up", str(write_yaml_file(tmp_path / "o.yaml", spec)), "-d")
    assert r.code == 2, (r.out, r.err)
    lines = [line for line in r.err.splitlines() if line.strip()]
    # refused by the CLI before anything (the clock is the clock); the database refuses the
    # same rows from plain SQL (test_a_shifted_client_clock_writes_nothing_unless_…)
    assert len(lines) == 1 and "PROVISIONER_CLOCK moves time for plan and report" in lines[0]
    with team.sql() as conn:
        assert count(conn, "SELECT count(*) FROM machines") == 0
        assert count(conn, "SELECT count(*) FROM events") == 0
