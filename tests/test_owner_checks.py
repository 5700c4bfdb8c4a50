"""Every operation on a machine checks its owner (issue 33, point 3): as a member who is not the
owner and holds no ``act_as`` over them, ``stop``, ``start``, ``down``, ``exec``, ``logs``,
``ssh``, ``sync``, ``autostop``, ``keep`` and ``volume rm`` exit 2 in the dashboard's own words
and do nothing; ``--all`` and the ssh config pick only the member's own machines and say how
many of others' they left out; with ``act_as`` granted each is allowed; the scheduler passes.

On SQLite the actor is the OS user running the suite, mapped to ana@example.com (conftest); the
machine ``hers`` is launched by alice herself (the app's actor set to her)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select

from provisioner import identity, machines, permits
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.errors import UserError
from provisioner.models import Event, Machine, Volume
from provisioner.settings import load_settings
from provisioner.spec import Experiment
from tests.conftest import TEST_OWNER, TEST_START, sandbox_experiment, write_settings, write_yaml

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

ALICE = "alice@example.com"
WORDS = (
    f"refused: {TEST_OWNER} is not the owner of this machine ({ALICE}) and no policy grants "
    "act_as over them"
)
VOLUME_WORDS = (
    f"refused: {TEST_OWNER} is not the owner of this volume ({ALICE}) and no policy grants "
    "act_as over them"
)
GRANT = {"name": "leads", "applies_to": {"projects": ["demo"]}, "act_as": {TEST_OWNER: [ALICE]}}


def launch(cfg: Path, name: str, owner: str, **extra: object) -> None:
    """``name`` launched by ``owner`` themself (reserved: it can stop)."""
    app = App(load_settings(cfg), ManualClock(TEST_START))
    app.actor = owner
    data = sandbox_experiment(name, market="reserved") | {"owner": owner, **extra}
    machines.up(app, Experiment.model_validate(data))
    app.close()


@pytest.fixture
def hers(home: Path, tmp_path: Path) -> tuple[Path, Path]:
    """alice's running ``hers`` (with her volume ``ckpt`` and a workdir) and ana's own
    ``mine``; the settings without a grant, and with a policy granting ana act_as alice."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.sh").write_text("echo hi\n")
    pdir = tmp_path / "policies"
    pdir.mkdir()
    write_yaml(pdir / "leads.yaml", GRANT)
    granted = write_settings(home, policies=[str(pdir)]).rename(tmp_path / "granted.yaml")
    plain = write_settings(home)
    launch(plain, "hers", ALICE, volumes=[{"name": "ckpt", "size_gb": 10, "path": "/data"}])
    launch(plain, "mine", TEST_OWNER)
    with App(load_settings(plain)).db.session() as s:  # the workdir `sync` would copy
        m = s.scalars(select(Machine).where(Machine.name == "hers")).one()
        m.spec = {**m.spec, "workdir": str(work)}
    return plain, granted


def seen(cfg: Path) -> tuple[str, int, int]:
    """hers's status, how many events the state holds, and whether its volume is still there."""
    app = App(load_settings(cfg))
    with app.db.session() as s:
        status = s.scalars(select(Machine.status).where(Machine.name == "hers")).one()
        events = s.scalar(select(func.count()).select_from(Event))
        volumes = s.scalar(
            select(func.count()).select_from(Volume).where(Volume.deleted_at.is_(None))
        )
    app.close()
    return status, events or 0, volumes or 0


COMMANDS = [
    ("stop", "hers"),
    ("start", "hers"),
    ("down", "hers"),
    ("down", "hers", "--yes", "-o", "json"),
    ("exec", "hers", "--", "touch", "{marker}"),
    ("logs", "hers"),
    ("logs", "hers", "--job", "exec-1", "-f"),
    ("ssh", "hers", "--", "true"),
    ("sync", "hers"),
    ("autostop", "hers", "30m"),
    ("autostop", "hers", "--cancel"),
    ("keep", "hers", "--until", "23:00"),
    ("keep", "hers", "--cancel"),
]


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(c[:3]) for c in COMMANDS])
def test_a_member_without_act_as_is_refused_on_anothers_machine_and_nothing_is_done(
    hers, cli, tmp_path, argv
):
    plain, _ = hers
    marker = tmp_path / "ran-on-her-machine"
    before = seen(plain)
    r = cli("--config", str(plain), *(a.format(marker=marker) for a in argv))
    assert r.code == 2, r
    if "json" in argv:
        assert f'"error": "hers: {WORDS}"' in r.out and '"exit_code": 2' in r.out
    else:
        assert r.err == f"error: hers: {WORDS}\n"
    assert seen(plain) == before == ("running", before[1], 1)  # no event, nothing changed
    assert not marker.exists()  # exec ran nothing on her machine


def test_up_of_a_file_named_as_anothers_live_machine_is_refused(hers, cli, tmp_path):
    plain, _ = hers
    before = seen(plain)
    spec = write_yaml(tmp_path / "mine.yaml", sandbox_experiment("hers") | {"owner": TEST_OWNER})
    r = cli("--config", str(plain), "up", str(spec))
    assert r.code == 2 and r.err == f"error: hers: {WORDS}\n", r
    assert seen(plain) == before


def test_volume_rm_of_anothers_volume_is_refused_before_it_asks(hers, cli):
    plain, _ = hers
    before = seen(plain)
    for argv in (("volume", "rm", "ckpt"), ("volume", "rm", "ckpt", "--yes")):
        r = cli("--config", str(plain), *argv)
        assert r.code == 2 and r.err == f"error: volume ckpt: {VOLUME_WORDS}\n", r
    assert seen(plain) == before


def test_all_picks_only_ones_own_machines_and_says_how_many_it_left_out(hers, cli):
    plain, _ = hers
    r = cli("--config", str(plain), "stop", "--all", "--yes")
    assert r.code == 0, r
    assert r.out == "mine stopped\n"
    assert r.err == (
        "left out 1 machine of other owners: you may act on only yours and those a policy "
        "grants you act_as over\n"
    )
    assert seen(plain)[0] == "running"
    # named among others: hers is refused in the words, mine is done; one failure of two: 1
    r = cli("--config", str(plain), "start", "mine", "hers", "--yes")
    assert r.code == 1 and r.out == "mine started\n" and r.err == f"error: hers: {WORDS}\n"
    # the ssh config names only ana's machine
    r = cli("--config", str(plain), "ssh-config")
    assert r.code == 0 and "Host mine\n" in r.out and "Host hers" not in r.out
    assert "# left out 1 machine of other owners: you may log in to only yours" in r.out


def test_with_act_as_granted_each_operation_is_allowed_and_records_its_actor(hers, cli, tmp_path):
    _, granted = hers
    marker = tmp_path / "ran"
    launched = seen(granted)[1]  # the events of the two launches
    for argv in (
        ("keep", "hers", "--until", "23:00"),
        ("keep", "hers", "--cancel"),
        ("autostop", "hers", "30m"),
        ("autostop", "hers", "--cancel"),
        ("exec", "hers", "--", "touch", str(marker)),
        ("logs", "hers", "--job", "exec-1", "-f"),
        ("sync", "hers"),
        ("stop", "hers"),
        ("start", "hers"),
        ("down", "hers"),
        ("volume", "rm", "ckpt", "--yes"),
    ):
        r = cli("--config", str(granted), *argv)
        assert r.code == 0, (argv, r)
    assert marker.exists()
    app = App(load_settings(granted))
    with app.db.session() as s:
        m = s.scalars(select(Machine).where(Machine.name == "hers")).one()
        actors = set(
            s.scalars(select(Event.actor).where(Event.machine_id == m.id, Event.id > launched))
        )
    assert m.status == "terminated" and actors == {TEST_OWNER}
    assert seen(granted)[2] == 0  # her volume deleted
    app.close()


def test_the_check_is_below_the_cli_and_the_scheduler_passes(hers):
    plain, _ = hers
    app = App(load_settings(plain), ManualClock(TEST_START))
    with pytest.raises(permits.NotOwner) as refused:
        machines.stop(app, "hers")
    assert isinstance(refused.value, UserError) and refused.value.exit_code == 2
    assert str(refused.value) == f"hers: {WORDS}"
    assert refused.value.words("ru") == (
        f"отказано: {TEST_OWNER} не владелец машины ({ALICE}), и ни одна политика не даёт "
        "права act_as за него"
    )
    app.actor = identity.SCHEDULER  # the scheduler's own actions: a sweep, a budget stop
    m, changed = machines.stop(app, "hers", reason="idle")
    assert changed and m.status == "stopped"
    app.close()


def test_one_rule_for_launching_and_acting():
    assert identity.may_act([], TEST_OWNER, TEST_OWNER, "demo")
    assert identity.may_act([], identity.SCHEDULER, ALICE, "demo")
    assert not identity.may_act([], TEST_OWNER, ALICE, "demo")
    from policies.schema import Policy

    lead = Policy.model_validate(GRANT)
    assert identity.may_act([lead], TEST_OWNER, ALICE, "demo")
    assert not identity.may_act([lead], TEST_OWNER, ALICE, "vision")  # the policy's scope
    assert not identity.may_act([lead], TEST_OWNER, "eve@example.com", "demo")
