"""The team's rules live in the team's state (issue 33, point 1): an admin applies the policies
and the member map to the PostgreSQL state (`policy apply`), versioned with who applied what
(`policy log`, `policy show`, `policy diff`); a member's own policy files and identity settings
then only narrow what they do. On SQLite the files stay the rules.

The PostgreSQL tests log in as real roles (``alice_<sfx>``, ``bob_<sfx>``, …) made for the test
and dropped after it."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from policies.schema import Policy
from provisioner import team, tokens
from provisioner.app import App
from provisioner.errors import UserError
from tests.conftest import MEMBERS_ENV, PG_URL, _settings, sandbox_experiment, write_yaml

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

DOMAIN = "team.org"


class Team:
    """The test's schema, its roles and a settings file per role."""

    def __init__(self, home: Path, tmp: Path, db_url: str, sfx: str) -> None:
        self.home, self.tmp, self.db_url, self.sfx = home, tmp, db_url, sfx
        self.schema = db_url.split("search_path%3D")[1].split("&")[0]

    def role(self, name: str) -> str:
        return f"{name}_{self.sfx}"

    def email(self, name: str) -> str:
        return f"{name}@{DOMAIN}"

    def url(self, name: str) -> str:
        if name == "postgres":
            return self.db_url
        return self.db_url.replace("postgresql://postgres@", f"postgresql://{self.role(name)}@", 1)

    def members(self) -> dict[str, str]:
        return {self.role(n): self.email(n) for n in ("alice", "bob", "lead")}

    def config(self, name: str, policies: list[str] | None = None, **identity: object) -> str:
        """``name``'s settings file: their own role's URL, their policy files and identity."""
        s = _settings(
            self.home,
            state_url=self.url(name),
            policies=policies or [],
            identity={"domain": DOMAIN, **identity},
        )
        path = self.tmp / f"settings-{name}.yaml"
        return str(write_yaml(path, s.model_dump(mode="json")))

    def admin_config(self, name: str = "postgres", **rule: object) -> str:
        """The admin's files: the team policy (per owner one machine; lead acts for anyone)
        and the member map, lead an admin."""
        pol = {
            "name": "team",
            "per_owner": {"max_machines": 1},
            "act_as": {self.email("lead"): ["*"]},
            **rule,
        }
        path = write_yaml(self.tmp / f"team-{name}.yaml", pol)
        return self.config(name, [str(path)], members=self.members(), admins=[self.role("lead")])

    def policy(self, file: str, **rule: object) -> str:
        return str(write_yaml(self.tmp / file, rule))

    def spec(self, name: str, owner: str | None) -> str:
        data = sandbox_experiment(name)
        if owner is None:
            del data["owner"]
        else:
            data["owner"] = owner
        return str(write_yaml(self.tmp / f"{name}.yaml", data))


def _sql(*statements: str) -> None:
    import psycopg

    with psycopg.connect(PG_URL, autocommit=True) as conn:
        for st in statements:
            conn.execute(st)


@pytest.fixture
def crew(home, tmp_path, db_url, cli, monkeypatch):
    """A team state migrated by its owner (postgres), with login roles alice, bob, lead and
    carol (suffixed) granted its schema's tables (the state's own row-level checks come
    later and restrict them)."""
    if db_url is None:
        pytest.skip("PostgreSQL only")
    monkeypatch.delenv(MEMBERS_ENV)
    t = Team(home, tmp_path, db_url, uuid.uuid4().hex[:6])
    roles = [t.role(n) for n in ("alice", "bob", "lead", "carol")]
    assert cli("--config", t.config("postgres"), "policy", "log").code == 0  # migrates
    for r in roles:
        _sql(
            f'CREATE ROLE "{r}" LOGIN',
            f'GRANT USAGE ON SCHEMA "{t.schema}" TO "{r}"',
            f'GRANT ALL ON ALL TABLES IN SCHEMA "{t.schema}" TO "{r}"',
            f'GRANT ALL ON ALL SEQUENCES IN SCHEMA "{t.schema}" TO "{r}"',
        )
    yield t
    for r in roles:
        _sql(
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{r}'",
            f'DROP OWNED BY "{r}"',
            f'DROP ROLE "{r}"',
        )


# --- apply, diff, log ---------------------------------------------------------------------


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_an_admin_applies_the_rules_versioned_with_who_and_a_same_apply_changes_nothing(crew, cli):
    cfg = crew.admin_config()
    assert team.NOT_APPLIED in cli("--config", crew.config("alice"), "status").err
    r = cli("--config", cfg, "policy", "diff")
    assert r.code == 1 and team.NOT_APPLIED in r.err
    assert '+    "max_machines": 1' in r.out

    r = cli("--config", cfg, "policy", "apply", "--note", "first rules")
    assert r.code == 0, r.err
    assert "applied version 1: 3 members, 1 act_as grants" in r.out
    r = cli("--config", cfg, "policy", "apply")
    assert (r.code, r.out.strip()) == (0, "unchanged (version 1)")
    assert "team rules" not in cli("--config", crew.config("alice"), "status").err
    assert cli("--config", cfg, "policy", "diff").code == 0

    lead = crew.admin_config("lead", per_owner={"max_machines": 2})
    r = cli("--config", lead, "policy", "diff")
    assert r.code == 1
    assert '-    "max_machines": 1' in r.out and '+    "max_machines": 2' in r.out
    assert "team rules (version 1): policy team" in r.out
    r = cli("--config", lead, "policy", "apply", "--note", "two each")
    assert r.code == 0, r.err

    r = cli("--config", cfg, "policy", "log", "-o", "json")
    log = [(v["version"], v["applied_by"], v["role"], v["note"]) for v in json.loads(r.out)]
    assert log == [
        (1, f"postgres@{DOMAIN}", "postgres", "first rules"),
        (2, crew.email("lead"), crew.role("lead"), "two each"),
    ]
    r = cli("--config", cfg, "policy", "log")
    assert "two each" in r.out and crew.email("lead") in r.out
    r = cli("--config", cfg, "policy", "show", "1")
    assert r.code == 0 and '"max_machines": 1' in r.out and "by postgres@team.org" in r.out


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_only_an_admin_applies(crew, cli):
    bob = crew.admin_config("bob", act_as={crew.email("bob"): ["*"]})
    r = cli("--config", bob, "policy", "apply")
    assert r.code == 2
    assert f"{crew.role('bob')} may not apply the team's first rules" in r.err
    assert cli("--config", crew.admin_config(), "policy", "apply").code == 0
    r = cli("--config", bob, "policy", "apply")
    assert r.code == 2
    assert f"{crew.role('bob')} is not an admin of this team's rules (version 1)" in r.err
    assert len(r.err.strip().splitlines()) == 1
    r = cli("--config", crew.config("lead", [crew.policy("t.yaml", name="t")]), "policy", "apply")
    assert r.code == 2 and "leave you" in r.err  # lead would drop themselves from the admins
    r = cli("--config", crew.admin_config(), "policy", "log", "-o", "json")
    assert len(json.loads(r.out)) == 1


# --- a member's own files narrow, never widen ----------------------------------------------


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_bobs_own_act_as_and_member_map_are_ignored(crew, cli):
    assert cli("--config", crew.admin_config(), "policy", "apply").code == 0
    own = crew.policy("bob.yaml", name="bob-own", act_as={crew.email("bob"): ["*"]})
    bob = crew.config("bob", [own], members={crew.role("bob"): crew.email("alice")})

    r = cli("--config", bob, "up", crew.spec("hers", crew.email("alice")), "--detach")
    assert r.code == 2
    assert "local act_as ignored: grants come from the team's rules (version 1)" in r.err
    assert f"owner {crew.email('alice')} is not you ({crew.email('bob')})" in r.err

    r = cli("--config", bob, "token", "create", "--user", crew.email("alice"))
    assert r.code == 2 and "is not you" in r.err
    r = cli("--config", bob, "token", "create")  # his own: as the state's map names him
    assert r.code == 0 and f"for {crew.email('bob')}" in r.out

    lead = crew.config("lead")  # the team's act_as: lead may make alice's token
    r = cli("--config", lead, "token", "create", "--user", crew.email("alice"))
    assert r.code == 0, r.err


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_the_team_cap_holds_and_a_local_policy_narrows_it(crew, cli):
    assert cli("--config", crew.admin_config(), "policy", "apply").code == 0
    wide = crew.policy("wide.yaml", name="team", per_owner={"max_machines": 5})
    bob = crew.config("bob", [wide])  # named like the team's, asks more: a narrowing at most
    assert cli("--config", bob, "up", crew.spec("one", None), "--detach").code == 0
    r = cli("--config", bob, "up", crew.spec("two", None), "--detach")
    assert r.code == 2 and "team" in r.err  # the team's per-owner cap of 1

    alice = crew.config("alice", [crew.policy("none.yaml", name="mine", max_machines=0)])
    r = cli("--config", alice, "up", crew.spec("a1", None), "--detach")
    assert r.code == 2 and "mine" in r.err
    alice = crew.config("alice")
    assert cli("--config", alice, "up", crew.spec("a1", None), "--detach").code == 0


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_role_not_in_the_member_map_reads_but_writes_nothing(crew, cli):
    assert cli("--config", crew.admin_config(), "policy", "apply").code == 0
    carol = crew.config("carol", members={crew.role("carol"): crew.email("lead")})
    assert cli("--config", carol, "policy", "log").code == 0
    r = cli("--config", carol, "token", "create")
    assert r.code == 2
    assert r.err.count("\n") == 1
    # refused by the CLI, or (row-level security hides the rules from a non-member) by the
    # database itself: either way one line naming her as no member
    assert crew.role("carol") in r.err and (
        "is not a member of this team's state" in r.err or "(not a team member)" in r.err
    ), r.err


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_long_running_process_takes_up_new_rules_without_restart(crew, clock):
    cfg = crew.admin_config(act_as={})
    from provisioner.settings import load_settings

    admin = App(load_settings(cfg), clock)
    team.apply(admin.db, admin.settings, clock.now(), admin.actor, None)
    lead = App(load_settings(crew.config("lead")), clock)
    assert lead.actor == crew.email("lead")
    with pytest.raises(UserError, match="is not you"):
        tokens.create(lead, crew.email("alice"))
    assert not lead.refresh_rules()
    team.apply(admin.db, load_settings(crew.admin_config()), clock.now(), admin.actor, None)
    assert lead.refresh_rules()
    assert tokens.create(lead, crew.email("alice")).user == crew.email("alice")
    admin.close()
    lead.close()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_the_dashboard_signs_in_by_the_states_rules_without_restart(crew, clock):
    from provisioner.dashboard import Dashboard
    from provisioner.settings import load_settings
    from tests.test_dashboard import call

    admin = App(load_settings(crew.admin_config(act_as={})), clock)
    team.apply(admin.db, admin.settings, clock.now(), admin.actor, None)
    proxied = {"trusted_proxies": ["10.0.0.5"], "members": {"bob": crew.email("lead")}}
    bobs = App(load_settings(crew.config("bob", **proxied)), clock)  # bob's own dashboard
    status, _, _ = call(
        Dashboard(bobs, token=None, open_access=False),
        "/",
        remote="10.0.0.5",
        X_FORWARDED_USER="bob",
    )
    assert status != 200  # his proxy names nobody: he is a member, not the team's service
    lead = App(load_settings(crew.config("lead", trusted_proxies=["10.0.0.5"])), clock)
    dash = Dashboard(lead, token=None, open_access=False)
    status, _, html = call(dash, "/", remote="10.0.0.5", X_FORWARDED_USER=crew.role("alice"))
    assert status == 200 and f'id="user">{crew.email("alice")}<' in html  # the state's map
    alices = tokens.create(App(load_settings(crew.config("alice")), clock), crew.email("alice"))
    assert alices.user == crew.email("alice")
    with pytest.raises(UserError, match="is not you"):
        tokens.create(lead, crew.email("bob"))
    team.apply(admin.db, load_settings(crew.admin_config()), clock.now(), admin.actor, None)
    call(dash, "/", remote="10.0.0.5", X_FORWARDED_USER=crew.role("alice"))  # a request reads v2
    assert tokens.create(lead, crew.email("bob")).user == crew.email(
        "bob"
    )  # v2: lead acts as anyone
    for a in (admin, bobs, lead):
        a.close()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_the_scheduler_role_writes_only_once_the_rules_name_it(crew, clock):
    from provisioner.models import Lease
    from provisioner.settings import load_settings

    def probe() -> Lease:  # a row only the scheduler (and an admin) writes: its lease
        return Lease(name="probe", holder="carol", expires_at=clock.now())

    admin = App(load_settings(crew.admin_config()), clock)
    team.apply(admin.db, admin.settings, clock.now(), admin.actor, None)
    sched = App(load_settings(crew.config("carol")), clock)
    sched.actor = "scheduler"  # as `scheduler run` sets it, before the state is opened
    sched.policies  # noqa: B018  (the rules in force: version 1, carol not in its map)
    with (
        pytest.raises(UserError, match=f"{crew.role('carol')} is not a member"),
        sched.db.session() as s,
    ):
        s.add(probe())
    named = load_settings(crew.admin_config())
    ident = named.identity.model_copy(update={"scheduler": crew.role("carol")})
    team.apply(admin.db, named.model_copy(update={"identity": ident}), clock.now(), "a", None)
    assert sched.refresh_rules() and sched.actor == "scheduler"  # a pass takes version 2 up
    with sched.db.session() as s:
        s.add(probe())
    admin.close()
    sched.close()


# --- SQLite: the files stay the rules -------------------------------------------------------


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_on_sqlite_the_files_stay_the_rules(home, tmp_path, cli, db_url):
    s = _settings(home)
    cfg = str(write_yaml(tmp_path / "s.yaml", s.model_dump(mode="json")))
    for cmd in ("apply", "diff", "log"):
        r = cli("--config", cfg, "policy", cmd)
        assert r.code == 2 and "SQLite: one user's state — the policies stay in your files" in r.err


# --- what the database's checks read: grants flattened --------------------------------------


def _p(**rule: object) -> Policy:
    return Policy.model_validate({"name": "p", **rule})


def test_act_as_is_flattened_by_project_and_owner_scope():
    lead = "lead@x.org"
    assert team.grant_rows([_p(act_as={lead: ["*"]})]) == [(lead, "*", "*")]
    scoped = _p(applies_to={"projects": ["nlp-*", "cv"], "owners": ["*@x.org"]}, act_as={lead: "*"})
    assert team.grant_rows([scoped]) == [(lead, "*@x.org", "cv"), (lead, "*@x.org", "nlp-*")]
    one = _p(applies_to={"owners": ["*@x.org"]}, act_as={lead: ["ana@x.org", "bo@y.org"]})
    assert team.grant_rows([one]) == [(lead, "ana@x.org", "*")]  # bo@y.org is out of scope
    with pytest.raises(UserError, match="cannot be one glob"):
        team.grant_rows([_p(applies_to={"owners": ["a*"]}, act_as={lead: ["*b"]})])


def test_a_members_own_policies_only_narrow_their_own_machines():
    rules = team.Rules(
        3,
        "d",
        None,
        "a",
        "r",
        None,
        {"members": {}, "domain": "x"},  # type: ignore[arg-type]
        [_p(name="team", max_machines=4)],
    )
    local = [
        _p(name="team", max_machines=4),  # the team's own: dropped
        _p(name="team", max_machines=1),  # another under its name: renamed
        _p(name="mine", act_as={"me@x": ["*"]}, notify=[{"slack": {"webhook_env": "HOOK"}}]),
        _p(name="theirs", applies_to={"owners": ["other@x"]}, max_machines=0),  # not mine
    ]
    got = {p.name: p for p in team.combine(rules, local, "me@x")}
    assert set(got) == {"team", "team (local)", "mine"}
    assert got["team"].applies_to.owners == ["*"]
    assert got["team (local)"].applies_to.owners == ["me@x"]
    assert got["mine"].act_as == {} and got["mine"].notify == []
