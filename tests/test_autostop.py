"""Autostop at any hour: a running machine whose GPUs were idle, with no job running and no SSH
session open, for its autostop duration is stopped by the sweep — at noon on a weekday as at
03:00 on a Sunday; a running job, an open SSH session, silence or ``--cancel`` keep it; a
policy's ``max_autostop`` caps it. The agent counts SSH sessions in the kernel's socket tables
and the endpoint stores them on the heartbeat."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from provisioner import agent, endpoint, heartbeats, machines
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.dashboard import make_app
from provisioner.errors import ConfigError, UserError
from provisioner.jobs import autostop, outlook, sweep
from provisioner.models import Event, Heartbeat, Machine
from provisioner.spec import Experiment
from tests.conftest import (
    TEST_START,
    make_settings,
    run_cli,
    sandbox_experiment,
    write_settings,
    write_yaml,
)
from tests.test_dashboard import call
from tests.test_scheduler import BERLIN_NIGHTS, events, status, up

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

LAB = """
name: lab
applies_to: {projects: ["demo"]}
"""
CAPPED = LAB + "max_autostop: 1h\n"

WED_NOON = datetime(2026, 11, 11, 11, 0, tzinfo=UTC)  # Wednesday 12:00 in Berlin: in hours
SUN_0300 = datetime(2026, 11, 15, 3, 0, tzinfo=UTC)  # Sunday 03:00 (LAB has no calendar: UTC)


@pytest.fixture
def sched(home, db_url, tmp_path):
    """make(policy_text, start) -> App on a ManualClock at ``start`` (as test_scheduler's)."""
    apps: list[App] = []

    def make(policy: str, start: datetime) -> App:
        path = tmp_path / "policy.yaml"
        path.write_text(policy)
        app = App(make_settings(home, state_url=db_url, policies=[str(path)]), ManualClock(start))
        apps.append(app)
        return app

    yield make
    for a in apps:
        a.close()


def beats(app: App, m: Machine, spans: list[tuple[int, int, float, int | None]]) -> None:
    """A heartbeat every minute for each (from minutes ago, to minutes ago, util, SSH sessions)."""
    now = app.clock.now()
    with app.db.session() as s:
        for start, end, util, ssh in spans:
            for k in range(start, end - 1, -1):
                s.add(
                    Heartbeat(
                        machine_id=m.id,
                        at=now - timedelta(minutes=k),
                        gpus=[{"index": 0, "util": util}],
                        max_util=util,
                        ssh_sessions=ssh,
                    )
                )


def job_event(app: App, m: Machine, kind: str, job: str, minutes_ago: int, **extra) -> None:
    with app.db.session() as s:
        s.add(
            Event(
                machine_id=m.id,
                at=app.clock.now() - timedelta(minutes=minutes_ago),
                kind=kind,
                reason="user",
                detail={"job": job, **extra},
            )
        )


def launched(sched, policy: str, at: datetime, autostop_: str | None = "30m", name="m1") -> tuple:
    """A machine launched a day before ``at`` with ``lifecycle.autostop``; the clock at ``at``."""
    app = sched(policy, start=at - timedelta(days=1))
    lifecycle = {"autostop": autostop_} if autostop_ else {}
    m = up(app, name, lifecycle=lifecycle)
    app.clock.set(at)
    return app, m


@pytest.mark.parametrize("at", [WED_NOON, SUN_0300], ids=["weekday-noon", "sunday-0300"])
def test_idle_31_min_is_stopped_whatever_the_hour(sched, at):
    app, m = launched(sched, LAB, at)
    beats(app, m, [(90, 32, 80.0, 0), (31, 0, 1.0, 0)])  # busy, then idle for the last 31 min
    p = sweep.run(app)
    assert [(a.machine, a.action, a.reason, a.done) for a in p.actions] == [
        ("m1", "stop", "autostop", True)
    ]
    assert p.actions[0].why == "idle 31 min ≥ autostop 30m"
    assert status(app, "m1") == "stopped"
    with app.db.session() as s:
        stopped = s.scalars(
            select(Event).where(Event.machine_id == m.id, Event.kind == "stopped")
        ).one()
    assert stopped.reason == "autostop"
    assert stopped.detail["why"] == "idle 31 min ≥ autostop 30m"
    assert stopped.detail["idle_since"] == (at - timedelta(minutes=31)).isoformat()


def test_autostop_acts_in_working_hours_where_the_off_hours_rule_does_not(sched):
    app, m = launched(sched, BERLIN_NIGHTS, WED_NOON)
    beats(app, m, [(31, 0, 1.0, None)])  # an older agent: no SSH count, no evidence of one
    p = sweep.run(app)
    assert [(a.action, a.reason) for a in p.actions] == [("stop", "autostop")]


def test_idle_29_min_is_not_stopped_and_status_says_how_long_so_far(sched):
    app, m = launched(sched, LAB, WED_NOON)
    beats(app, m, [(90, 30, 80.0, 0), (29, 0, 1.0, 0)])
    assert sweep.run(app).actions == []
    assert status(app, "m1") == "running"
    shown = autostop.show(app, machines.find(app, "m1"))
    assert shown["text"] == "30m (idle 29 min so far)"
    assert (shown["seconds"], shown["idle_seconds"]) == (1800, 29 * 60)
    said = outlook.outlook(app, [machines.find(app, "m1")])["m1"]  # sweep --dry-run, status
    assert said == (
        "nothing due: autostop 30m: idle 29 min so far; "
        "next: stop [autostop] at 2026-11-11 11:01 UTC if idle then"
    )
    page = call(make_app(app), f"/machine/{m.id}")[2]  # the dashboard's machine page says it too
    assert '<dd id="machine-autostop">30m (idle 29 min so far)</dd>' in page
    # two minutes later, still idle: due
    app.clock.set(WED_NOON + timedelta(minutes=2))
    beats(app, m, [(1, 0, 2.0, 0)])
    assert [(a.action, a.reason) for a in sweep.run(app).actions] == [("stop", "autostop")]


def test_a_running_job_keeps_it_and_a_finished_one_restarts_the_count(sched):
    app, m = launched(sched, LAB, WED_NOON)
    beats(app, m, [(60, 0, 0.0, 0)])  # GPUs idle for an hour
    job_event(app, m, "job-started", "j1", 50)
    job_event(app, m, "job-started", "j2", 45)
    job_event(app, m, "job-finished", "j1", 40, exit_code=0)
    assert sweep.run(app).actions == []  # j2 runs (a CPU job, say)
    assert autostop.show(app, m)["why_not"] == "job j2 running"
    job_event(app, m, "job-finished", "j2", 10, exit_code=1)
    assert sweep.run(app).actions == []  # idle only since j2 ended, 10 min ago
    assert autostop.show(app, m)["text"] == "30m (idle 10 min so far)"
    app.clock.set(WED_NOON + timedelta(minutes=21))
    beats(app, m, [(21, 0, 0.0, 0)])
    p = sweep.run(app)
    assert [(a.action, a.why) for a in p.actions] == [("stop", "idle 31 min ≥ autostop 30m")]


def test_an_open_ssh_session_keeps_it(sched):
    app, m = launched(sched, LAB, WED_NOON)
    beats(app, m, [(60, 1, 0.0, 0), (0, 0, 0.0, 1)])  # someone logged in a moment ago
    assert sweep.run(app).actions == []
    assert autostop.show(app, m)["why_not"] == "1 SSH session(s) open"
    assert status(app, "m1") == "running"


def test_busy_gpus_keep_it(sched):
    app, m = launched(sched, LAB, WED_NOON)
    beats(app, m, [(60, 0, 40.0, 0)])
    assert sweep.run(app).actions == []
    assert autostop.show(app, m)["why_not"] == "GPUs busy (40% ≥ 5%)"


def test_no_heartbeat_is_not_idle_unless_the_policy_counts_silence(sched):
    app, m = launched(sched, LAB, WED_NOON)
    assert sweep.run(app).actions == []  # no agent has ever spoken: unknown, not idle
    assert autostop.show(app, m)["why_not"] == "no recent heartbeat (not counted as idle)"
    # the policy counts silence as idle (its off-hours rule is asleep at noon: autostop acts)
    silent = BERLIN_NIGHTS.replace("unknown_counts_as_idle: false", "unknown_counts_as_idle: true")
    app2, m2 = launched(sched, silent, WED_NOON, name="m2")
    beats(app2, m2, [(90, 45, 1.0, 0)])  # then silent for 45 minutes
    p = sweep.run(app2)
    # one state, so m1 (no agent ever) falls under the new policy too: silence counts for both
    assert sorted((a.machine, a.action, a.reason) for a in p.actions) == [
        ("m1", "stop", "autostop"),
        ("m2", "stop", "autostop"),
    ]


def test_cancel_and_set_from_the_command(sched):
    app, m = launched(sched, LAB, WED_NOON)
    beats(app, m, [(60, 0, 0.0, 0)])
    _, st, had = autostop.cancel_autostop(app, "m1")
    assert had and st.duration is None
    assert sweep.run(app).actions == []  # idle for an hour, but no autostop any more
    assert status(app, "m1") == "running"
    mm, st = autostop.set_autostop(app, "m1", "45m")
    assert (mm.autostop_seconds, st.note) == (2700, "45m")
    assert [(a.action, a.why) for a in sweep.run(app).actions] == [
        ("stop", "idle 50 min ≥ autostop 45m")  # counted back as far as it needs: 45m + grace
    ]
    kinds = [k for k, _ in events(app, "m1")]
    assert kinds.index("autostop-cancelled") < kinds.index("autostop-set") < kinds.index("stopped")
    with pytest.raises(UserError, match="from 1 min to 7 days"):
        autostop.set_autostop(app, "m1", "8d")
    with pytest.raises(UserError, match="from 1 min to 7 days"):
        autostop.set_autostop(app, "m1", "30s")


def test_a_policy_caps_a_longer_or_absent_autostop(sched):
    app, m = launched(sched, CAPPED, WED_NOON, autostop_="4h")
    st = autostop.setting(app.policies, m)
    assert (st.duration, st.note) == (timedelta(hours=1), "1h (capped from 4h by policy lab)")
    beats(app, m, [(60, 0, 0.0, 0)])
    p = sweep.run(app)
    assert [(a.action, a.reason, a.why) for a in p.actions] == [
        ("stop", "autostop", "idle 1 h ≥ autostop 1h")
    ]
    app2, m2 = launched(sched, CAPPED, WED_NOON, autostop_=None, name="m2")
    assert autostop.setting(app2.policies, m2).note == "1h (policy lab's max_autostop)"
    assert autostop.cancel_autostop(app2, "m2")[1].duration == timedelta(hours=1)  # still capped
    _, st = autostop.set_autostop(app2, "m2", "20m")  # shorter than the cap: its own
    assert st.note == "20m"


def test_a_spot_machine_its_cloud_cannot_stop_is_terminated_after_a_warning(sched, monkeypatch):
    app, m = launched(sched, LAB, WED_NOON)
    monkeypatch.setattr(sweep.machines, "can_stop", lambda m: False)
    beats(app, m, [(31, 0, 1.0, 0)])
    p = sweep.run(app)
    assert [(a.action, a.reason, a.warn_minutes) for a in p.actions] == [
        ("warn", "autostop", sweep.UNSTOPPABLE_WARN_MINUTES)
    ]
    assert "cannot be stopped: terminated with its boot disk" in p.actions[0].why


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("autostop", "30s", "from 1 min to 7 days"), ("autostop", "8d", "from 1 min to 7 days")],
)
def test_the_file_bounds_autostop(field, value, message):
    data = sandbox_experiment("x")
    data["lifecycle"] = {field: value}
    with pytest.raises(ValueError, match=message):
        Experiment.model_validate(data)


def test_a_bad_max_autostop_names_the_policy_file_and_line(home, tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(LAB + "max_autostop: 9d\n")
    app = App(make_settings(home, policies=[str(path)]), ManualClock(WED_NOON))
    try:
        with pytest.raises(ConfigError) as e:
            app.policies  # noqa: B018
        text = str(e.value)
        assert f"{path}:4" in text and "max_autostop" in text and "1 min to 7 days" in text
    finally:
        app.close()


@pytest.mark.slow  # a CLI run end to end: README command and CI, not the quick loop
def test_cli_autostop_set_show_cancel_and_status(home, tmp_path):
    (tmp_path / "p.yaml").write_text(CAPPED)
    cfg = write_settings(home, policies=[str(tmp_path / "p.yaml")])
    clock = ManualClock(WED_NOON - timedelta(days=1))
    app = App(make_settings(home, policies=[str(tmp_path / "p.yaml")]), clock)
    m = up(app, "c1")
    clock.set(WED_NOON)
    beats(app, m, [(12, 0, 0.0, 0)])
    app.close()
    base = ("--config", str(cfg))
    r = run_cli(*base, "autostop", "c1", "30m", now=WED_NOON)
    assert r.returncode == 0, r.stderr
    assert "c1: autostop set; autostop: 30m (idle 12 min so far)" in r.stdout
    r = run_cli(*base, "autostop", "c1", "3h", now=WED_NOON)
    assert "autostop: 1h (capped from 3h by policy lab) (idle 12 min so far)" in r.stdout
    r = run_cli(*base, "status", "c1", now=WED_NOON)
    assert r.returncode == 0, r.stderr
    assert "autostop  1h (capped from 3h by policy lab) (idle 12 min so far)" in r.stdout
    r = run_cli(*base, "status", "c1", "--output", "json", now=WED_NOON)
    shown = json.loads(r.stdout)["autostop"]
    assert (shown["autostop"], shown["own"], shown["capped_by"]) == ("1h", "3h", "lab")
    assert shown["idle_seconds"] // 60 == 12  # the CLI's clock starts at WED_NOON and runs on
    r = run_cli(*base, "autostop", "c1", "--cancel", now=WED_NOON)
    assert "its autostop is cancelled; autostop: 1h (policy lab's max_autostop)" in r.stdout
    r = run_cli(*base, "autostop", "c1", "2 weeks", now=WED_NOON)
    assert r.returncode == 2 and "autostop '2 weeks'" in r.stderr and "Traceback" not in r.stderr


# --- the agent's SSH count and the endpoint ----------------------------------------------------

# /proc/net/tcp as the kernel writes it (Documentation/networking/proc_net_tcp.rst): local and
# remote address as hex IP:port, st 01 = ESTABLISHED, 0A = LISTEN
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
   1: 0100007F:A8AD 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1
   2: 0A00000F:0016 0A000001:D2F0 01 00000000:00000000 02:000A7D4C 00000000     0        0 3 2
   3: 0A00000F:0016 0A000001:D2F4 06 00000000:00000000 03:00001770 00000000     0        0 0 3
   4: 0A00000F:9C40 0A000001:0016 01 00000000:00000000 02:000A7D4C 00000000     0        0 4 2
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue
   0: 00000000000000000000000000000000:0016 00000000000000000000000000000000:0000 0A 00000000
   1: 0000000000000000FFFF00000A00000F:0016 0000000000000000FFFF00000A000001:D300 01 00000000
"""


def test_the_agent_counts_established_connections_to_port_22(tmp_path):
    # listening (0A) and TIME_WAIT (06) sockets are not sessions; nor is our own connection
    # out to another machine's port 22 (remote 0016)
    assert agent.count_ssh(TCP) == 1
    assert agent.count_ssh(TCP6) == 1
    (tmp_path / "tcp").write_text(TCP)
    (tmp_path / "tcp6").write_text(TCP6)
    assert agent.ssh_sessions((str(tmp_path / "tcp"), str(tmp_path / "tcp6"))) == 2
    assert agent.ssh_sessions((str(tmp_path / "tcp"), str(tmp_path / "none"))) == 1
    assert agent.ssh_sessions((str(tmp_path / "none"),)) is None  # not Linux: no count


def test_the_endpoint_stores_the_ssh_count_and_refuses_a_bad_one(agent_app):
    m = machines.up(agent_app, Experiment.model_validate(sandbox_experiment("e1"))).machine
    body = {"gpus": [{"index": 0, "util": 3.0}], "ssh_sessions": 2}
    parsed = heartbeats.parse_heartbeat(json.dumps(body).encode())
    assert parsed["ssh_sessions"] == 2
    heartbeats.record_heartbeat(agent_app, m.id, parsed)
    old = heartbeats.parse_heartbeat(json.dumps({"gpus": []}).encode())  # an older agent
    heartbeats.record_heartbeat(agent_app, m.id, old)
    with agent_app.db.session() as s:
        assert list(s.scalars(select(Heartbeat.ssh_sessions).order_by(Heartbeat.id))) == [2, None]
    for bad in (-1, "2", True, 1.5):
        with pytest.raises(heartbeats.BadHeartbeat, match="ssh_sessions"):
            heartbeats.parse_heartbeat(json.dumps({"gpus": [], "ssh_sessions": bad}).encode())


def test_plan_and_up_say_the_policy_caps_the_files_autostop(cli, home, tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_text(CAPPED)
    cfg = write_settings(home, policies=[str(policy)])
    data = sandbox_experiment("capped")
    data["lifecycle"] = {"autostop": "4h"}
    spec = write_yaml(tmp_path / "capped.yaml", data)
    r = cli("--config", str(cfg), "plan", str(spec))
    assert r.code == 0, r.err
    assert "policy lab: max_autostop 1h: lifecycle.autostop 4h" in " ".join(r.out.split())
    r = cli("--config", str(cfg), "up", str(spec), "--no-wait")
    assert r.code == 0, r.err
    said = " ".join(r.out.split())
    assert "enforced by: autostop 1h (capped from 4h by policy lab): on the machine" in said
    r = cli("--config", str(cfg), "autostop", "capped", "-o", "json")
    shown = json.loads(r.out)
    assert (shown["machine"], shown["autostop"], shown["own"]) == ("capped", "1h", "4h")


def test_heartbeats_are_kept_as_long_as_the_longest_autostop_needs(sched):
    app, m = launched(sched, LAB, WED_NOON, autostop_="2d")
    beats(app, m, [(30 * 60, 30 * 60, 0.0, 0), (0, 0, 0.0, 0)])  # 30 h ago, and now
    sweep.run(app)
    with app.db.session() as s:
        assert len(list(s.scalars(select(Heartbeat.id)))) == 2  # a day is not enough for 2d
    autostop.cancel_autostop(app, "m1")
    sweep.run(app)
    with app.db.session() as s:
        assert len(list(s.scalars(select(Heartbeat.id)))) == 1  # a day again


def test_the_agent_posts_its_ssh_count_and_the_endpoint_keeps_it(agent_app, tmp_path, monkeypatch):
    from tests.test_heartbeat import launch, token_in, user_data

    m = launch(agent_app, "e2")
    token_file = tmp_path / "token"
    token_file.write_text(token_in(user_data(agent_app, m)) + "\n")
    tables = (tmp_path / "tcp", tmp_path / "tcp6")
    tables[0].write_text(TCP)
    tables[1].write_text(TCP6)
    real = agent.ssh_sessions
    monkeypatch.setattr(agent, "ssh_sessions", lambda: real(tuple(map(str, tables))))
    sleeps: list[float] = []
    with endpoint.Endpoint(agent_app, port=0) as ep:
        agent.run(
            ep.url,
            m.id,
            str(token_file),
            30,
            sleep=sleeps.append,
            stop=lambda: len(sleeps) >= 1,
            now=lambda: TEST_START.timestamp(),
        )
    with agent_app.db.session() as s:
        assert list(s.scalars(select(Heartbeat.ssh_sessions))) == [2]
