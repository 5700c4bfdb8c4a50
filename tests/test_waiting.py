"""Waiting for capacity (`up --retry-until-up`, `lifecycle.on_no_capacity`) on the sandbox with a
simulated clock: every zone full → the intent is queued as `waiting` (no bill, no budget
committed); the foreground `up` or the scheduler's pass tries it again with backoff and launches
it once a zone has room, telling the owner; the deadline, a policy or a budget ends the wait
(failed, owner told); `down` cancels it; Ctrl-C says it stays queued; `status` shows the wait."""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal

import pytest
from sqlalchemy import select

from provisioner import budget, machines
from provisioner.app import App
from provisioner.dashboard import make_app
from provisioner.errors import ConfigError, OperationFailed, UserError
from provisioner.jobs import waiting as waiting_pass
from provisioner.machines import launch, waiting
from provisioner.models import Event, Machine, UsageInterval
from provisioner.spec import Experiment, load_experiment
from tests.conftest import make_settings, sandbox_experiment, write_settings, write_yaml
from tests.test_cli import answered_both_ways
from tests.test_crash import run_job
from tests.test_dashboard import call
from tests.test_mail import smtp_server  # noqa: F401  (fixture)

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

ZONES = ("sandbox-us-1a", "sandbox-us-1b", "sandbox-us-1c", "sandbox-eu-1a", "sandbox-ru-1a")
FULL = {z: 0 for z in ZONES}
SIX_HOURS = timedelta(hours=6)


@pytest.fixture
def wapp(home, clock, db_url, smtp_server, tmp_path):  # noqa: F811
    """An App whose every sandbox zone is full, mailing the test's SMTP server; policies from
    ``tmp_path/policies`` (write them with :func:`set_policy`)."""
    (tmp_path / "policies").mkdir()
    a = App(
        make_settings(
            home,
            state_url=db_url,
            policies=[str(tmp_path / "policies")],
            smtp=smtp_server.smtp.model_dump(),
        ),
        clock,
    )
    a.provider("sandbox").inject(capacity=FULL)
    yield a
    a.close()


def set_policy(app: App, path, data: dict) -> None:
    write_yaml(path, data)
    app.__dict__.pop("policies", None)  # an App reads its policies once


def experiment(name: str = "exp") -> Experiment:
    return Experiment.model_validate(sandbox_experiment(name))


def interrupted(seconds: float) -> None:
    raise KeyboardInterrupt  # Ctrl-C while the foreground waits for the next try


def queue(app: App, name: str = "exp", wait: timedelta = SIX_HOURS) -> Machine:
    """`up --retry-until-up` interrupted during its first wait: the intent stays queued."""
    with pytest.raises(KeyboardInterrupt):
        waiting.up_until_up(app, experiment(name), wait=wait, sleep=interrupted)
    return machines.find(app, name)


def kinds(app: App, m: Machine) -> list[str]:
    with app.db.session() as s:
        return [
            e.kind
            for e in s.scalars(select(Event).where(Event.machine_id == m.id).order_by(Event.id))
        ]


def status(app: App, m: Machine) -> str:
    with app.db.session() as s:
        return str(s.get(Machine, m.id).status)  # type: ignore[union-attr]


def test_retry_until_up_waits_with_backoff_and_launches_when_a_zone_has_room(
    wapp,
    smtp_server,  # noqa: F811
):
    sandbox = wapp.provider("sandbox")
    slept: list[float] = []
    lines: list[str] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 3:
            sandbox.inject(capacity={**FULL, "sandbox-us-1b": 1})  # room again, in one zone
        wapp.clock.advance(timedelta(seconds=seconds))

    start = wapp.clock.now()
    r = waiting.up_until_up(wapp, experiment(), wait=SIX_HOURS, progress=lines.append, sleep=sleep)
    m = r.machine
    assert (m.status, m.zone) == ("running", "sandbox-us-1b")
    assert slept == [60, 120, 240]  # 1, 2, 4 minutes between rounds
    assert m.launched_at == start + timedelta(minutes=7)
    rounds = [line for line in lines if ": round " in line]
    assert len(rounds) == 3 and "round 1: no capacity in 5 candidates tried" in rounds[0]
    assert "sandbox/sandbox-eu-1a" in rounds[0] and "gives up at 15:00 UTC" in rounds[0]
    assert len(sandbox.list_managed()) == 1
    ev = kinds(wapp, m)
    assert ev.count("waiting") == 3 and ev.count("wait-try") == 3
    assert ev[-3:] == ["launch-attempt", "launched", "wait-ended"]
    # the owner hears of it once, with where and how to reach it
    [(to, msg)] = smtp_server.inbox.messages
    assert to == ["ana@example.com"]
    assert msg["Subject"] == "provisioner: exp launched after waiting for capacity"
    body = msg.get_content()
    assert "sandbox sandbox-us-1b after waiting for capacity since 09:00 UTC (4 rounds)" in body
    assert "provisioner ssh exp" in body


def test_a_waiting_intent_bills_nothing_and_commits_no_budget(wapp, tmp_path):
    set_policy(
        wapp,
        tmp_path / "policies" / "b.yaml",
        {"name": "b", "applies_to": {"projects": ["demo"]}, "budget": {"amount": "500 USD"}},
    )
    [policy] = wapp.policies
    m = queue(wapp)
    assert status(wapp, m) == "waiting"
    st = budget.status(wapp, policy, wapp.clock.now())
    assert st is not None and st.committed.amount == Decimal(0) and st.spent.amount == 0
    with wapp.db.session() as s:
        assert s.scalars(select(UsageInterval)).all() == []
    # a plain intent being launched does count (what a try makes it again, under the lock)
    with wapp.db.session() as s:
        s.add(
            Machine(
                id="x" * 12,
                name="other",
                project="demo",
                owner="ana@example.com",
                status="requested",
                spec={},
                created_at=wapp.clock.now(),
                disk_gb=50,
                rate=Decimal("0.15"),
                currency="USD",
            )
        )
    st = budget.status(wapp, policy, wapp.clock.now())
    assert st is not None and st.committed.amount > 0


def test_the_scheduler_tries_when_due_and_launches_when_capacity_returns(
    wapp,
    smtp_server,  # noqa: F811
):
    m = queue(wapp)
    # the dashboard shows the wait, on the fleet page and the machine's
    wsgi = make_app(wapp)
    line = "waiting for capacity since 09:00 UTC, next try 09:01 UTC, gives up at 15:00 UTC"
    fleet = call(wsgi, "/")[2]
    # the row: its state and next try in one short line; the whole wait on the machine's page
    assert ">waiting</span>" in fleet and "next try for capacity" in fleet and line not in fleet
    page = call(wsgi, f"/machine/{m.id}")[2]
    assert f'<p id="machine-waiting">{line}</p>' in page and "<td>waiting for capacity</td>" in page
    wapp.clock.advance(timedelta(seconds=30))
    p = waiting_pass.run(wapp)
    assert (p.checked, p.actions) == (1, [])  # the next try is due a minute after the first
    wapp.clock.advance(timedelta(seconds=31))
    [a] = waiting_pass.run(wapp).actions
    assert (a.action, a.done, a.error) == ("launch", True, None)
    assert "try 2" in a.why and "no capacity; next try 09:03 UTC" in a.why
    assert status(wapp, m) == "waiting" and smtp_server.inbox.messages == []
    wapp.provider("sandbox").inject(capacity={})
    wapp.clock.advance(timedelta(minutes=1))
    assert waiting_pass.run(wapp).actions == []  # backing off: 2 minutes after try 2
    wapp.clock.advance(timedelta(minutes=1))
    [a] = waiting_pass.run(wapp).actions
    assert a.done and "launched on sandbox sandbox-us-1a" in a.why
    assert machines.find(wapp, "exp").status == "running"
    [(to, msg)] = smtp_server.inbox.messages
    assert to == ["ana@example.com"] and "launched after waiting" in msg["Subject"]
    assert waiting_pass.run(wapp).checked == 0  # nothing waits any more


def test_the_deadline_ends_the_wait_failed_and_tells_the_owner(
    wapp,
    smtp_server,  # noqa: F811
):
    m = queue(wapp, wait=timedelta(minutes=10))
    for _ in range(4):  # tries at 1, 3, 7 min; the next would be after the deadline
        wapp.clock.advance(timedelta(minutes=4))
        waiting_pass.run(wapp)
    assert status(wapp, m) == "failed" and kinds(wapp, m)[-1] == "wait-gave-up"
    assert wapp.provider("sandbox").list_managed() == []
    [(to, msg)] = smtp_server.inbox.messages
    assert to == ["ana@example.com"]
    assert msg["Subject"] == "provisioner: exp not launched: no capacity until 09:10 UTC"
    assert "Nothing of it bills" in msg.get_content()
    # the foreground says so too, and `status --all` says why it failed
    # (now 09:16: tries at 16, 17, 19, 23 and 31 minutes past; the next would be the deadline)
    gave_up = "gave up waiting for capacity at 09:36 UTC: no capacity in 5 rounds since 09:16"
    with pytest.raises(OperationFailed, match=gave_up):
        waiting.up_until_up(
            wapp,
            experiment("fg"),
            wait=timedelta(minutes=20),
            sleep=lambda s: wapp.clock.advance(timedelta(seconds=s)),
        )
    [row] = [r for r in machines_listed(wapp) if r.name == "fg"]
    assert row.status == "failed" and row.why.startswith("gave up waiting for capacity")


def machines_listed(app: App):
    from provisioner.views.status import read_fleet

    return read_fleet(app, all_=True).rows


def test_a_budget_or_policy_that_now_refuses_ends_the_wait(
    wapp,
    tmp_path,
    smtp_server,  # noqa: F811
):
    m = queue(wapp, "by-budget")
    set_policy(
        wapp,
        tmp_path / "policies" / "b.yaml",
        {"name": "tight", "applies_to": {"projects": ["demo"]}, "budget": {"amount": "1 USD"}},
    )
    wapp.provider("sandbox").inject(capacity={})  # room, but the budget no longer allows it
    wapp.clock.advance(timedelta(minutes=1))
    [a] = waiting_pass.run(wapp).actions
    assert a.done and "refused by budget tight" in a.why
    assert status(wapp, m) == "failed" and wapp.provider("sandbox").list_managed() == []
    with wapp.db.session() as s:
        ended = s.scalars(select(Event).where(Event.machine_id == m.id)).all()[-1]
    assert (ended.kind, ended.reason) == ("wait-refused", "budget")
    [(_, msg)] = smtp_server.inbox.messages
    assert msg["Subject"] == "provisioner: by-budget not launched: refused by budget"
    assert "refused by budget tight (2026-11): 1.00 USD budget" in msg.get_content()

    (tmp_path / "policies" / "b.yaml").unlink()
    wapp.__dict__.pop("policies", None)
    wapp.provider("sandbox").inject(capacity=FULL)
    m = queue(wapp, "by-policy")
    set_policy(
        wapp,
        tmp_path / "policies" / "p.yaml",
        {"name": "a100s", "applies_to": {"projects": ["demo"]}, "allow": {"gpus": ["A100"]}},
    )
    wapp.clock.advance(timedelta(minutes=1))
    with pytest.raises(UserError, match="the wait for capacity ended: refused by policy"):
        waiting.follow(wapp, m.id, sleep=lambda s: None)
    assert status(wapp, m) == "failed"


def test_down_cancels_a_waiting_intent_and_nothing_is_tried_after(wapp):
    m = queue(wapp)
    done, changed = machines.down(wapp, "exp")
    assert changed and done.status == "failed" and kinds(wapp, m)[-1] == "cancelled"
    wapp.provider("sandbox").inject(capacity={})
    wapp.clock.advance(timedelta(minutes=5))
    assert waiting_pass.run(wapp).checked == 0
    assert wapp.provider("sandbox").list_managed() == []
    assert machines.up(wapp, experiment()).machine.status == "running"  # the name is free


def test_a_try_that_died_after_its_launch_is_adopted_not_launched_twice(wapp, monkeypatch):
    m = queue(wapp)
    wapp.provider("sandbox").inject(capacity={})
    wapp.clock.advance(timedelta(minutes=1))

    def die(*args, **kwargs):
        raise SystemExit("killed after the cloud launched, before the state knew")

    with monkeypatch.context() as mp:
        mp.setattr(launch, "_record", die)
        with pytest.raises(SystemExit):
            waiting.try_once(wapp, m.id)
    assert status(wapp, m) == "requested"  # budgets count it; the pass sees a try stopped
    assert len(wapp.provider("sandbox").list_managed()) == 1
    [a] = waiting_pass.run(wapp).actions
    assert "stopped midway: resumed" in a.why and "launched on sandbox" in a.why
    assert status(wapp, m) == "running"
    assert len(wapp.provider("sandbox").list_managed()) == 1
    assert "adopted" in kinds(wapp, m)


def test_on_no_capacity_in_the_file_is_a_duration(tmp_path):
    data = sandbox_experiment("exp")
    data["lifecycle"] = {"on_no_capacity": {"wait": "90m"}}
    e = load_experiment(write_yaml(tmp_path / "ok.yaml", data))
    assert e.lifecycle.on_no_capacity is not None
    assert e.lifecycle.on_no_capacity.wait == timedelta(minutes=90)
    data["lifecycle"] = {"on_no_capacity": {"wait": "0h"}}
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: lifecycle.on_no_capacity.wait"):
        load_experiment(write_yaml(tmp_path / "bad.yaml", data))


def test_the_cli_queues_says_so_on_ctrl_c_shows_the_wait_and_down_cancels(
    cli,
    home,
    monkeypatch,
):
    import providers

    sandbox = providers.create("sandbox", {"db_path": str(home / "sandbox.db")})
    sandbox.inject(capacity=FULL)  # type: ignore[attr-defined]
    sandbox.close()  # type: ignore[attr-defined]
    spec = write_yaml(home.parent / "exp.yaml", sandbox_experiment("exp"))
    r = cli("up", str(spec), "--timeout", "2h")
    assert r.code == 2 and "give both, or neither" in r.err
    r = cli("up", str(spec), "--retry-until-up", "--timeout", "soon")
    assert r.code == 2 and "--timeout 'soon'" in r.err and "Traceback" not in r.err

    def ctrl_c_on_the_wait(seconds: float) -> None:
        if seconds >= 30:  # the wait for the next try (not the cloud calls' short pauses)
            raise KeyboardInterrupt

    with monkeypatch.context() as mp:
        mp.setattr("time.sleep", ctrl_c_on_the_wait)
        r = cli("up", str(spec), "--retry-until-up", "--timeout", "2h")
    assert r.code == 130, r.err
    assert "round 1: no capacity in 5 candidates tried" in r.err
    assert (
        "interrupted: exp stays queued (waiting for capacity until 11:00 UTC); the scheduler "
        "keeps trying"
    ) in r.err
    assert "cancel with `provisioner down exp`" in r.err

    listed = answered_both_ways(cli, monkeypatch, "status")  # the fast path agrees
    assert "waiting" in listed.out
    assert "exp: waiting for capacity since 09:00 UTC, next try 09:01 UTC, gives up at 11:00" in (
        listed.out
    )
    [row] = json.loads(answered_both_ways(cli, monkeypatch, "status", "-o", "json").out)
    assert row["status"] == "waiting" and row["why"].startswith("waiting for capacity since")
    detail = cli("status", "exp")
    assert "waiting for capacity since 09:00 UTC" in detail.out
    r = cli("up", str(spec))  # no wait asked: it says it is queued, and how to follow or cancel
    assert r.code == 0 and "exp already exists (waiting for capacity)" in r.out
    assert "--retry-until-up" in r.out
    r = cli("down", "exp")
    assert r.code == 0
    assert "exp was waiting for capacity and was never launched" in r.out


def test_only_a_want_of_capacity_waits_other_failures_fail_at_once(wapp):
    sandbox = wapp.provider("sandbox")
    sandbox.inject(capacity={}, quota_gpus={"sandbox-us": 0, "sandbox-eu": 0, "sandbox-ru": 0})

    def never(seconds: float) -> None:
        pytest.fail("a quota refusal is not waited out")

    with pytest.raises(OperationFailed, match="quota"):
        waiting.up_until_up(wapp, experiment("quota"), wait=SIX_HOURS, sleep=never)
    sandbox.inject(quota_gpus={}, auth_fail=True)
    with pytest.raises(OperationFailed, match="auth"):
        waiting.up_until_up(wapp, experiment("auth"), wait=SIX_HOURS, sleep=never)
    assert [r.status for r in machines_listed(wapp)] == ["failed", "failed"]


def test_an_intent_another_process_is_trying_is_left_to_it(wapp):
    m = queue(wapp)
    wapp.clock.advance(timedelta(minutes=1))
    with wapp.db.lock(f"intent-{m.id}"):  # a foreground `up` (or `down`) holds it
        [a] = waiting_pass.run(wapp).actions
    assert "another process holds it" in a.why and a.error is None
    assert kinds(wapp, m).count("waiting") == 1  # nothing tried meanwhile


def test_up_again_of_a_queued_intent_follows_it(wapp):
    m = queue(wapp)
    wapp.provider("sandbox").inject(capacity={})
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        wapp.clock.advance(timedelta(seconds=seconds))

    r = waiting.up_until_up(wapp, experiment(), wait=SIX_HOURS, sleep=sleep)
    assert r.machine.id == m.id and r.machine.status == "running"
    assert slept == [60]  # its next try was due a minute after the first, as recorded


def test_a_down_asked_while_a_try_held_the_intent_is_finished_by_the_next_try(wapp):
    m = queue(wapp)
    machines.record_event(wapp, m.id, "cancel-requested", reason="user")  # its `down` gave up
    wapp.provider("sandbox").inject(capacity={})
    wapp.clock.advance(timedelta(minutes=1))
    [a] = waiting_pass.run(wapp).actions
    assert "taken down before it was launched" in a.why and a.error is None
    assert status(wapp, m) == "failed" and kinds(wapp, m)[-1] == "cancelled"
    assert wapp.provider("sandbox").list_managed() == []


@pytest.mark.slow  # real processes killed
@pytest.mark.parametrize("point", ["after-intent", "before-launch", "after-launch"])
def test_a_wait_pass_killed_at_each_step_of_a_try_ends_with_one_machine(
    wapp,
    home,
    db_url,
    smtp_server,  # noqa: F811
    point,
):
    m = queue(wapp)
    wapp.provider("sandbox").inject(capacity={})
    cfg = write_settings(home, state_url=db_url, smtp=smtp_server.smtp.model_dump())
    at = wapp.clock.now() + timedelta(minutes=1)
    killed = run_job(cfg, "waiting", at, crash=point)
    assert killed.returncode == -9, killed.stderr
    assert status(wapp, m) == "requested"  # the try stopped midway: counted, not waiting
    rerun = run_job(cfg, "waiting", at + timedelta(seconds=30))
    assert rerun.returncode == 0, rerun.stderr
    [action] = json.loads(rerun.stdout)["actions"]
    assert "stopped midway: resumed" in action["why"] and "launched on sandbox" in action["why"]
    assert status(wapp, m) == "running"
    assert len(wapp.provider("sandbox").list_managed()) == 1
    assert len(smtp_server.inbox.messages) == 1
    assert json.loads(run_job(cfg, "waiting", at + timedelta(minutes=1)).stdout)["checked"] == 0
