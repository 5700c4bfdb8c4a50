"""Identity (issue 26, point 1): who launched a machine is known (the OS user on SQLite, the
database role on PostgreSQL), an experiment's owner must be them unless a policy grants
``act_as``, every event records its actor, each owner can be capped, and personal tokens let
the dashboard know its users (stored hashed; a proxy's header believed only from allowlisted
addresses)."""

from __future__ import annotations

import json
import sqlite3
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from provisioner import identity, machines, tokens
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.dashboard import Dashboard
from provisioner.errors import ProvisionerError, UserError
from provisioner.models import Event, Machine, Token
from provisioner.spec import Experiment
from tests.conftest import (
    MEMBERS_ENV,
    PG_URL,
    TEST_OWNER,
    TEST_START,
    make_settings,
    sandbox_experiment,
    write_settings,
    write_yaml,
)
from tests.test_dashboard import call

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

#: the state marked made for tests (the CLI's clock is the test's, not the server's)
SIMULATED = (
    "INSERT INTO state_meta (key, value) VALUES ('clock', 'simulated') ON CONFLICT DO NOTHING"
)


def experiment(name: str, owner: str | None = TEST_OWNER, **res: object) -> Experiment:
    data = sandbox_experiment(name, **res)
    if owner is None:
        data.pop("owner")
    else:
        data["owner"] = owner
    return Experiment.model_validate(data)


def rows(app: App, model: type) -> list:
    with app.db.session() as s:
        return list(s.scalars(select(model)))


def policy_file(tmp_path: Path, **rule: object) -> str:
    return str(write_yaml(tmp_path / "team.yaml", {"name": "team", **rule}))


# --- the actor ------------------------------------------------------------------------------


def test_the_actor_on_sqlite_is_the_os_user_as_settings_map_it(home, monkeypatch):
    monkeypatch.delenv(MEMBERS_ENV)
    app = App(make_settings(home))
    assert app.actor == f"{identity.os_user()}@localhost"
    app.close()
    mapped = App(make_settings(home, identity={"members": {identity.os_user(): "me@lab.org"}}))
    assert mapped.actor == "me@lab.org"
    mapped.close()
    other = App(make_settings(home, identity={"domain": "lab.org"}))
    assert other.actor == f"{identity.os_user()}@lab.org"
    other.close()


def test_every_event_of_a_launch_records_its_actor_and_events_shows_it(home, tmp_path, cli):
    cfg = write_settings(home)
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("exp"))
    r = cli("--config", str(cfg), "up", str(spec), "--detach")
    assert r.code == 0, r.err
    r = cli("--config", str(cfg), "events", "exp", "-o", "json")
    assert r.code == 0, r.err
    got = json.loads(r.out)
    assert [e["event"] for e in got][:2] == ["requested", "launch-attempt"]
    assert {e["actor"] for e in got} == {TEST_OWNER}
    r = cli("--config", str(cfg), "events", "exp")
    assert "BY" in r.out.splitlines()[0] and TEST_OWNER in r.out


def test_a_file_without_owner_belongs_to_who_runs_it(home, tmp_path, cli):
    cfg = write_settings(home)
    data = sandbox_experiment("mine")
    del data["owner"]
    r = cli("--config", str(cfg), "up", str(write_yaml(tmp_path / "e.yaml", data)), "-d")
    assert r.code == 0, r.err
    (m,) = rows(App(make_settings(home)), Machine)
    assert m.owner == TEST_OWNER


def test_the_scheduler_records_its_own_actions_as_scheduler(home, clock, tmp_path):
    from provisioner.jobs import sweep

    pol = policy_file(tmp_path, max_lifetime="1h")
    app = App(make_settings(home, policies=[pol]), clock)
    m = machines.up(app, experiment("long")).machine
    daemon = App(make_settings(home, policies=[pol]), clock)
    daemon.actor = identity.SCHEDULER
    clock.advance(timedelta(hours=2))
    result = sweep.run(daemon)
    assert [a.machine for a in result.actions] == ["long"], result.actions
    with app.db.session() as s:
        evs = list(s.scalars(select(Event).where(Event.machine_id == m.id).order_by(Event.id)))
    assert evs[0].actor == TEST_OWNER
    assert evs[-1].kind == "stopped" and evs[-1].actor == "scheduler", [
        (e.kind, e.actor) for e in evs
    ]


# --- owner against the actor ----------------------------------------------------------------


def test_launching_for_another_owner_is_refused_with_exit_2_and_nothing_written(
    home, tmp_path, cli
):
    cfg = write_settings(home)
    data = sandbox_experiment("theirs") | {"owner": "bob@example.com"}
    r = cli("--config", str(cfg), "up", str(write_yaml(tmp_path / "e.yaml", data)))
    assert r.code == 2
    assert r.err.strip().splitlines() == [
        f"error: theirs: owner bob@example.com is not you ({TEST_OWNER}); launching for someone "
        f"else needs a policy's act_as (e.g. act_as: {{{TEST_OWNER}: ['*']}}), or leave owner "
        "out of the file"
    ]
    assert "Traceback" not in r.err
    assert rows(App(make_settings(home)), Machine) == []


def test_act_as_granted_by_a_policy_launches_for_that_owner_only(home, tmp_path, clock):
    pol = policy_file(
        tmp_path,
        applies_to={"projects": ["demo"]},
        act_as={TEST_OWNER: ["*@example.com"]},
    )
    app = App(make_settings(home, policies=[pol]), clock)
    m = machines.up(app, experiment("for-bob", owner="bob@example.com")).machine
    assert m.owner == "bob@example.com"
    assert {e.actor for e in rows(app, Event)} == {TEST_OWNER}  # who did it, not for whom
    with pytest.raises(UserError, match=r"owner eve@elsewhere\.org is not you"):
        machines.up(app, experiment("for-eve", owner="eve@elsewhere.org"))
    other = sandbox_experiment("vision-bob") | {"project": "vision", "owner": "bob@example.com"}
    with pytest.raises(UserError, match="is not you"):  # the grant holds in its scope only
        machines.up(app, Experiment.model_validate(other))
    assert [r.name for r in rows(app, Machine)] == ["for-bob"]


def test_act_as_is_checked_in_the_policy_schema(tmp_path):
    from policies import loader
    from provisioner.errors import ConfigError

    bad = write_yaml(tmp_path / "p.yaml", {"name": "x", "act_as": ["lead@x.org"]})
    with pytest.raises(ConfigError, match=r"p.yaml:\d+: act_as"):
        loader.load([str(bad)])
    ok = write_yaml(tmp_path / "q.yaml", {"name": "x", "act_as": {"lead@x.org": "*"}})
    assert loader.load([str(ok)])[0].act_as == {"lead@x.org": ["*"]}


# --- PostgreSQL: the database role ----------------------------------------------------------


@pytest.fixture
def alice_url(db_url):
    """The test's schema reached as the role ``alice`` (created once, LOGIN, granted the
    schema's tables after the first migration)."""
    if db_url is None:
        pytest.skip("PostgreSQL only")
    import psycopg

    schema = db_url.split("search_path%3D")[1].split("&")[0]
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(
            "DO $$ BEGIN CREATE ROLE alice LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$"
        )
        conn.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO alice')
    yield db_url.replace("postgresql://postgres@", "postgresql://alice@", 1), schema


def _grant(schema: str) -> None:
    """alice joins the team as a member (its state checks a member's writes: 0015); the
    tests' clock is not the server's, so the state is marked a simulated one."""
    import psycopg

    from provisioner.team_sql import grant_member

    with psycopg.connect(PG_URL, autocommit=True, options=f"-csearch_path={schema}") as conn:
        conn.execute(
            "INSERT INTO team_members (role, email, kind, version)"
            " VALUES ('alice', 'alice@example.com', 'member', 1)"
        )
        conn.execute(SIMULATED)
        grant_member(conn, "alice")


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_on_postgresql_the_actor_is_the_database_role(home, db_url, alice_url, clock):
    url, schema = alice_url
    members = {"alice": "alice@example.com", "postgres": TEST_OWNER}
    admin = App(make_settings(home, state_url=db_url, identity={"members": members}), clock)
    admin.db  # noqa: B018  (migrated by the schema's owner)
    _grant(schema)
    app = App(make_settings(home, state_url=url, identity={"members": members}), clock)
    assert identity.database_role(app.db) == "alice"
    assert app.actor == "alice@example.com"
    with pytest.raises(UserError, match=r"owner ana@example.com is not you \(alice@example"):
        machines.up(app, experiment("hers"))
    data = sandbox_experiment("hers")
    del data["owner"]
    hers = Experiment.model_validate(data, context={"actor": lambda: app.actor})
    m = machines.up(app, hers).machine
    assert m.owner == "alice@example.com"
    assert {e.actor for e in rows(admin, Event)} == {"alice@example.com"}
    admin.close()
    app.close()


# --- per-owner caps -------------------------------------------------------------------------


@pytest.mark.slow  # six launches racing
def test_six_concurrent_ups_by_one_owner_under_a_per_owner_cap_of_3_leave_3(home, tmp_path, db_url):
    pol = policy_file(
        tmp_path,
        applies_to={"projects": ["demo"]},
        per_owner={"max_machines": 3},
        act_as={TEST_OWNER: ["*"]},
    )
    settings = make_settings(home, state_url=db_url, policies=[pol])
    apps = [App(settings, ManualClock(TEST_START)) for _ in range(6)]
    start = threading.Barrier(6)
    results: list[object] = [None] * 6

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = machines.up(apps[i], experiment(f"job{i}")).machine
        except ProvisionerError as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    try:
        refused = [r for r in results if isinstance(r, UserError)]
        assert len(refused) == 3, results
        assert all("per_owner.max_machines" in str(r) for r in refused), refused
        live = [m for m in rows(apps[0], Machine) if m.is_live]
        assert len(live) == 3 and {m.owner for m in live} == {TEST_OWNER}
        # the cap is each owner's: another owner still launches
        bob = machines.up(apps[0], experiment("bobs", owner="bob@example.com")).machine
        assert bob.status == "running"
    finally:
        for a in apps:
            a.close()


def test_per_owner_gpus_and_budget_cap_each_owner(home, tmp_path, clock):
    pol = policy_file(
        tmp_path,
        per_owner={"max_gpus": 4, "budget": {"amount": "120 USD"}},
        act_as={TEST_OWNER: ["*"]},
    )
    app = App(make_settings(home, policies=[pol]), clock)
    machines.up(app, experiment("first"))
    with pytest.raises(UserError) as e:
        machines.up(app, experiment("more", gpu="T4:4"))
    assert f"per_owner.max_gpus: {TEST_OWNER} already runs 1 GPUs in its scope and asks for 4" in (
        str(e.value)
    )
    # ~111.8 USD for a T4 spot from TEST_START to the month's end (test_reliability): the
    # owner's budget of 120 is committed by their first machine, not by bob's
    with pytest.raises(UserError, match=r"refused by budget team \(per owner ana@example.com\)"):
        machines.up(app, experiment("one-more"))
    assert machines.up(app, experiment("bobs", owner="bob@example.com")).machine.is_live


# --- personal tokens ------------------------------------------------------------------------


def test_a_token_is_printed_once_and_only_its_salted_hash_is_stored(home, cli):
    cfg = write_settings(home)
    r = cli("--config", str(cfg), "token", "create", "--expires", "90d", "-o", "json")
    assert r.code == 0, r.err
    issued = json.loads(r.out)
    token = issued["token"]
    assert issued["user"] == TEST_OWNER and token.startswith("pvt_")
    secret = token.split(".", 1)[1]
    db = home / "state.db"
    dumped = "\n".join(sqlite3.connect(db).iterdump())
    assert issued["id"] in dumped and secret not in dumped and token not in dumped
    for f in home.glob("state.db*"):  # the WAL too
        assert secret.encode() not in f.read_bytes()
    r = cli("--config", str(cfg), "token", "list")
    assert issued["id"] in r.out and secret not in r.out and "expires 2027-01-31" in r.out
    r = cli("--config", str(cfg), "token", "create", "--user", "bob@example.com")
    assert r.code == 2 and "bob@example.com is not you" in r.err
    r = cli("--config", str(cfg), "token", "create", "--expires", "soon")
    assert r.code == 2 and "--expires" in r.err and "Traceback" not in r.err


def test_tokens_verify_expire_and_revoke(home, clock):
    app = App(make_settings(home), clock)
    issued = tokens.create(app, TEST_OWNER, timedelta(hours=1))
    assert tokens.verify(app, issued.token).user == TEST_OWNER  # type: ignore[union-attr]
    wrong = issued.token[:-2] + ("AA" if not issued.token.endswith("AA") else "BB")
    assert tokens.verify(app, wrong) is None
    clock.advance(timedelta(hours=2))
    assert tokens.verify(app, issued.token) is None  # expired
    forever = tokens.create(app, TEST_OWNER)
    tokens.revoke(app, forever.id)
    assert tokens.verify(app, forever.token) is None
    (t, _) = sorted(rows(app, Token), key=lambda t: t.expires_at is None)
    assert t.hash != issued.token and len(t.salt) == 32


def test_a_token_of_no_lifetime_is_refused_not_made_forever(cli, home):
    """`--expires 0s` once made a token with no expiry (a zero read as "none")."""
    cfg = write_settings(home)
    for life in ("0s", "30s"):
        r = cli("--config", str(cfg), "token", "create", "--expires", life)
        assert r.code == 2 and "a minute or more" in r.err and r.err.count("\n") == 1, r.err
    assert cli("--config", str(cfg), "token", "list", "-o", "json").out.strip() == "[]"


# --- the dashboard --------------------------------------------------------------------------


def wide(app: App, token: str | None = None) -> Dashboard:
    return Dashboard(app, token=token, open_access=False)


def test_the_dashboard_knows_a_user_by_a_personal_token(home, clock):
    app = App(make_settings(home), clock)
    dash = wide(app)  # no shared token: only personal ones get in
    issued = tokens.create(app, TEST_OWNER)
    status, _, html = call(dash, "/", Authorization=f"Bearer {issued.token}")
    assert status == 200 and f'id="user">{TEST_OWNER}<' in html
    status, _, _ = call(dash, "/spend.csv", Authorization=f"Bearer {issued.token}x")
    assert status == 401
    # the login form takes it too; its cookie names the token and dies with it
    status, headers, _ = call(dash, "/login", "POST", body=f"token={issued.token}")
    assert status == 303
    from provisioner.dashboard.access import COOKIE

    [cookie] = [
        v.split(";")[0] for k, v in headers if k == "Set-Cookie" and v.startswith(COOKIE + "=")
    ]
    assert issued.token.split(".")[1] not in cookie
    status, _, html = call(dash, "/", Cookie=cookie)
    assert status == 200 and f'id="user">{TEST_OWNER}<' in html
    # what the database holds cannot forge a session (any member may read it)
    import hashlib
    import hmac

    (row,) = rows(app, Token)
    exp = cookie.split("=", 1)[1].split(".")[0]
    for key in (row.hash.encode(), row.salt.encode()):
        msg = f"session:{exp}:{row.id}:{row.hash}".encode()
        forged = f"{exp}.{row.id}.{hmac.new(key, msg, hashlib.sha256).hexdigest()}"
        assert call(dash, "/", Cookie=f"provisioner_session={forged}")[0] == 303
    assert (home / "dashboard-session.key").stat().st_mode & 0o777 == 0o600
    tokens.revoke(app, issued.id)
    status, _, _ = call(dash, "/", Cookie=cookie)
    assert status == 303  # to the login page


def test_the_shared_dashboard_token_still_works(home, clock):
    app = App(make_settings(home), clock)
    dash = wide(app, token="s3cret-shared")
    status, _, html = call(dash, "/", Authorization="Bearer s3cret-shared")
    assert status == 200 and 'id="user">dashboard.token<' in html


def test_a_proxy_header_counts_only_from_an_allowlisted_address(home, clock):
    settings = make_settings(
        home, identity={"trusted_proxies": ["10.0.0.5"], "members": {"bob": "bob@example.com"}}
    )
    dash = wide(App(settings, clock))
    status, _, html = call(dash, "/", remote="10.0.0.5", X_FORWARDED_USER="bob")
    assert status == 200 and 'id="user">bob@example.com<' in html
    status, _, _ = call(dash, "/spend.csv", remote="10.0.0.6", X_FORWARDED_USER="bob")
    assert status == 401
    status, _, _ = call(dash, "/spend.csv", remote="10.0.0.5", X_FORWARDED_USER="")
    assert status == 401


def test_metrics_take_a_personal_token_beside_the_metrics_token(home, clock):
    import urllib.error
    import urllib.request

    from provisioner import endpoint
    from provisioner.jobs.metrics import Metrics

    app = App(make_settings(home), clock)
    issued = tokens.create(app, TEST_OWNER)

    def scrape(url: str, token: str) -> int:
        req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    with endpoint.Endpoint(app, port=0, metrics=Metrics(app), metrics_token="scrape-me") as ep:
        assert scrape(ep.url, issued.token) == 200
        assert scrape(ep.url, issued.token + "x") == 401
        tokens.revoke(app, issued.id)
        assert scrape(ep.url, issued.token) == 401
    app.close()
