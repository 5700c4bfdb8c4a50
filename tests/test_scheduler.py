"""The scheduler on the sandbox cloud with a simulated clock: idle machines stopped out of hours
(weekday nights, holidays), busy and kept ones left alone, max lifetime, preempted spot machines
relaunched within policy with backoff, orphans listed, and one leader per pass — also between
two real processes sharing one SQLite file."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from providers.base import TAG_MACHINE, TAG_MANAGED_BY, TAG_MANAGED_BY_VALUE, LaunchRequest
from provisioner import machines, startup
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.errors import ConfigError
from provisioner.jobs import daemon, lease, metrics, reconcile, recover, sweep
from provisioner.jobs.passes import describe
from provisioner.models import Event, Heartbeat, Machine, UsageInterval
from provisioner.spec import Experiment
from provisioner.state import named_machine
from tests.conftest import (
    ROOT,
    TEST_START,
    make_settings,
    run_cli,
    sandbox_experiment,
    write_settings,
)
from tests.test_mail import smtp_server  # noqa: F401  (fixture)

BERLIN_NIGHTS = """
name: nights
applies_to: {projects: ["demo"]}
off_hours:
  timezone: Europe/Berlin
  windows: [{days: mon-fri, start: "20:00", end: "08:00"}]
  holidays: DE
idle: {gpu_util_below: 5, for_minutes: 30, unknown_counts_as_idle: false, action: stop}
"""

FRI_1700 = datetime(2026, 11, 6, 16, 0, tzinfo=UTC)  # Friday 17:00 in Berlin (CET)


@pytest.fixture
def sched(home, db_url, tmp_path):
    """make(policy_text, start) -> App on a ManualClock at ``start``."""
    apps: list[App] = []

    def make(policy: str = BERLIN_NIGHTS, start: datetime = FRI_1700, **settings) -> App:
        path = tmp_path / "policy.yaml"
        path.write_text(policy)
        app = App(
            make_settings(home, state_url=db_url, policies=[str(path)], **settings),
            ManualClock(start),
        )
        apps.append(app)
        return app

    yield make
    for a in apps:
        a.close()


def up(app: App, name: str, **spec) -> Machine:
    data = sandbox_experiment(name)
    data.update(spec)
    m = machines.up(app, Experiment.model_validate(data)).machine
    startup.issue_token(app, m.id)
    return m


def heartbeats(app: App, m: Machine, util: float, minutes: int, every: int = 5) -> None:
    """Record a heartbeat every ``every`` minutes for the ``minutes`` before now."""
    now = app.clock.now()
    with app.db.session() as s:
        for k in range(minutes // every, -1, -1):
            s.add(
                Heartbeat(
                    machine_id=m.id,
                    at=now - timedelta(minutes=k * every),
                    gpus=[{"index": 0, "util": util}],
                    max_util=util,
                )
            )


def status(app: App, name: str) -> str:
    """The status `status NAME` shows: the live machine of that name, else the newest."""
    with app.db.session() as s:
        m = named_machine(s, name)
        return m.status if m is not None else None


def events(app: App, name: str) -> list[tuple[str, str | None]]:
    with app.db.session() as s:
        ids = list(s.scalars(select(Machine.id).where(Machine.name == name)))
        return [
            (e.kind, e.reason)
            for e in s.scalars(select(Event).where(Event.machine_id.in_(ids)).order_by(Event.id))
        ]


def test_idle_at_21_friday_is_stopped_busy_is_kept(sched):
    app = sched()
    idle_m, busy_m = up(app, "idle-one"), up(app, "busy-one")
    app.clock.set(datetime(2026, 11, 6, 20, 0, tzinfo=UTC))  # 21:00 Berlin
    heartbeats(app, idle_m, 1.0, 60)
    heartbeats(app, busy_m, 88.0, 60)
    dry = sweep.run(app, dry_run=True)
    assert [(a.machine, a.action, a.done) for a in dry.actions] == [("idle-one", "stop", False)]
    assert status(app, "idle-one") == "running"  # a dry run changes nothing
    p = sweep.run(app)
    assert [(a.machine, a.action, a.reason, a.done) for a in p.actions] == [
        ("idle-one", "stop", "off-hours-idle", True)
    ]
    assert "off-hours window 20:00–08:00; GPUs below 5% for 30 min (nights)" in p.actions[0].why
    assert (status(app, "idle-one"), status(app, "busy-one")) == ("stopped", "running")
    assert events(app, "idle-one")[-1] == ("stopped", "off-hours-idle")
    assert sweep.run(app).actions == []  # the next pass has nothing to do


def test_idle_in_working_hours_is_kept_but_idle_at_noon_on_a_holiday_is_stopped(sched):
    app = sched(start=datetime(2026, 12, 23, 8, 0, tzinfo=UTC))
    m = up(app, "holiday")
    app.clock.set(datetime(2026, 12, 23, 11, 0, tzinfo=UTC))  # Wednesday noon in Berlin
    heartbeats(app, m, 0.0, 60)
    assert sweep.run(app).actions == []
    app.clock.set(datetime(2026, 12, 25, 11, 0, tzinfo=UTC))  # Christmas Day, noon
    heartbeats(app, m, 0.0, 60)
    p = sweep.run(app)
    assert [(a.action, a.reason) for a in p.actions] == [("stop", "off-hours-idle")]
    assert p.actions[0].why.startswith("holiday: Christmas Day")


def test_a_missed_tick_acts_on_the_next_one(sched):
    app = sched()
    m = up(app, "late")
    app.clock.set(datetime(2026, 11, 6, 18, 55, tzinfo=UTC))  # 19:55: within hours
    heartbeats(app, m, 0.0, 60)
    assert sweep.run(app).actions == []
    # the 20:00, 20:05 … ticks never ran; the first one that does, at 22:40, acts
    app.clock.set(datetime(2026, 11, 6, 21, 40, tzinfo=UTC))
    heartbeats(app, m, 0.0, 160)
    assert [a.action for a in sweep.run(app).actions] == ["stop"]


def test_kept_until_is_honoured_then_the_sweep_acts(sched):
    app = sched()
    m = up(app, "kept")
    app.clock.set(datetime(2026, 11, 6, 20, 0, tzinfo=UTC))  # 21:00 Berlin
    kept = sweep.keep(app, "kept", "23:00")
    assert kept.kept_until == datetime(2026, 11, 6, 22, 0, tzinfo=UTC)  # 23:00 CET
    heartbeats(app, m, 0.0, 60)
    p = sweep.run(app)
    assert [(a.action, a.done) for a in p.actions] == [("keep", False)]
    assert status(app, "kept") == "running"
    app.clock.set(datetime(2026, 11, 6, 22, 5, tzinfo=UTC))
    heartbeats(app, m, 0.0, 60)
    assert [a.action for a in sweep.run(app).actions] == ["stop"]
    assert ("kept", "user") in events(app, "kept")


def test_unknown_signal_follows_the_policy(sched):
    app = sched(
        BERLIN_NIGHTS.replace("unknown_counts_as_idle: false", "unknown_counts_as_idle: true")
    )
    up(app, "silent")
    app.clock.set(datetime(2026, 11, 6, 20, 0, tzinfo=UTC))  # no heartbeat at all
    p = sweep.run(app)
    assert [(a.action, a.reason) for a in p.actions] == [("stop", "off-hours-idle")]
    assert "no heartbeat (counted as idle)" in p.actions[0].why
    other = sched()  # the default: unknown is not idle
    up(other, "silent2")
    other.clock.set(datetime(2026, 11, 6, 20, 0, tzinfo=UTC))
    assert sweep.run(other).actions == []


def test_max_lifetime_terminates_whatever_the_hour_and_activity(sched):
    app = sched(BERLIN_NIGHTS + "max_lifetime: {after: 2h, action: terminate}\n")
    m = up(app, "old")
    app.clock.advance(timedelta(hours=1, minutes=59))
    heartbeats(app, m, 99.0, 60)
    assert sweep.run(app).actions == []
    app.clock.advance(timedelta(minutes=1))
    p = sweep.run(app)
    assert [(a.action, a.reason) for a in p.actions] == [("terminate", "max-lifetime")]
    assert status(app, "old") == "terminated"
    assert events(app, "old")[-1] == ("terminated", "max-lifetime")


def test_the_experiments_own_idle_rule_acts_at_any_hour(sched):
    app = sched("name: none\napplies_to: {projects: [nobody]}\n")
    m = up(app, "own", lifecycle={"idle": {"gpu_util_below": 10, "for_minutes": 20}})
    app.clock.advance(timedelta(hours=1))  # Friday 18:00: within hours, no policy applies
    heartbeats(app, m, 3.0, 30)
    p = sweep.run(app)
    assert [(a.action, a.reason) for a in p.actions] == [("stop", "idle")]
    assert "(experiment)" in p.actions[0].why


def test_a_bad_policy_stops_the_scheduler_before_anything_is_done(sched, tmp_path):
    app = sched()
    up(app, "safe")
    app.clock.set(datetime(2026, 11, 6, 20, 0, tzinfo=UTC))
    (tmp_path / "policy.yaml").write_text(
        BERLIN_NIGHTS.replace("for_minutes: 30", "for_minutes: x")
    )
    fresh = App(app.settings, app.clock)
    with pytest.raises(ConfigError, match=r"policy.yaml:\d+: idle.for_minutes"):
        sweep.run(fresh)
    fresh.close()
    assert status(app, "safe") == "running"


# --- recovery --------------------------------------------------------------------------------


def preempt(app: App, name: str) -> Machine:
    m = machines.find(app, name)
    app.provider("sandbox").preempt(machines.ref(m))
    return m


def test_preempted_spot_machine_is_relaunched_in_its_zone_first(sched):
    app = sched("name: us\nallow: {regions: ['sandbox-us']}\n")
    sandbox = app.provider("sandbox")
    sandbox.inject(capacity={"sandbox-us-1a": 0})
    lost = up(app, "spot", lifecycle={"on_preemption": "relaunch"})
    assert lost.zone == "sandbox-us-1b"
    sandbox.inject(capacity={})  # 1a has room again and sorts first: the lost zone still wins
    preempt(app, "spot")
    reconcile.run(app)
    assert status(app, "spot") == "preempted"
    forget(app, "spot")  # the cloud did not keep it: nothing to start in place
    p = recover.run(app)
    assert [(a.action, a.reason, a.done) for a in p.actions] == [("relaunch", "preempted", True)]
    new = machines.find(app, "spot")
    assert new.id != lost.id and (new.status, new.zone) == ("running", "sandbox-us-1b")
    ev = events(app, "spot")
    assert ("preempted", "preempted") in ev and ("terminated", "preempted") in ev
    assert ("relaunched", "preempted") in ev and ("recovered", "recovered") in ev
    assert recover.run(app).actions == []  # recovered once


def test_relaunch_stays_within_policy_and_backs_off(sched):
    app = sched("name: us\nallow: {regions: ['sandbox-us']}\n")
    sandbox = app.provider("sandbox")
    up(app, "spot")
    preempt(app, "spot")
    reconcile.run(app)
    full = {z: 0 for z in ("sandbox-us-1a", "sandbox-us-1b", "sandbox-us-1c")}
    sandbox.inject(capacity=full)  # only sandbox-eu has room, and the policy forbids it
    p = recover.run(app)
    assert p.actions[0].error and not p.actions[0].done
    assert all(i.region == "sandbox-us" for i in sandbox.list_managed())
    assert events(app, "spot")[-1] == ("recover-failed", "preempted")
    app.clock.advance(timedelta(seconds=30))
    assert recover.run(app).actions == []  # backing off
    app.clock.advance(timedelta(seconds=31))
    assert recover.run(app).actions[0].error  # second attempt, still full
    app.clock.advance(timedelta(seconds=90))
    assert recover.run(app).actions == []  # the wait doubled to 2 minutes
    sandbox.inject(capacity={})
    app.clock.advance(timedelta(seconds=31))
    p = recover.run(app)
    # room again: the preempted machine, kept with its disk, is started in place
    assert (p.actions[0].action, p.actions[0].done, status(app, "spot")) == (
        "start",
        True,
        "running",
    )
    assert machines.find(app, "spot").region == "sandbox-us"


def test_on_preemption_terminate_and_leave(sched):
    app = sched("name: any\n")
    up(app, "gone", lifecycle={"on_preemption": "terminate"})
    up(app, "stays", lifecycle={"on_preemption": "leave"})
    preempt(app, "gone")
    preempt(app, "stays")
    reconcile.run(app)
    p = recover.run(app)
    assert [(a.machine, a.action) for a in p.actions] == [("gone", "terminate")]
    assert (status(app, "gone"), status(app, "stays")) == ("terminated", "preempted")


# --- reconcile, lease ------------------------------------------------------------------------


def test_reconcile_lists_orphans(sched):
    app = sched("name: any\n")
    up(app, "known")
    sandbox = app.provider("sandbox")
    sandbox.create_unmanaged("by-hand")  # not ours: not an orphan either
    stray = sandbox.launch(
        LaunchRequest(
            name="stray",
            token="stray-1",
            region="sandbox-us",
            zone="sandbox-us-1c",
            instance_type="sbx-t4-1",
            gpu="T4",
            gpu_count=1,
            spot=False,
            labels={TAG_MANAGED_BY: TAG_MANAGED_BY_VALUE, TAG_MACHINE: "deadbeef"},
        )
    )
    p = reconcile.run(app)
    assert [o["id"] for o in p.orphans] == [stray.id]


def test_one_leader_per_pass(sched):
    app = sched()
    up(app, "m1")
    app.clock.set(datetime(2026, 11, 6, 20, 0, tzinfo=UTC))
    assert lease.acquire(app, "sweep", app.clock.now(), holder="other")
    p = sweep.run(app, holder="me")
    assert not p.leader and "other" in p.note and p.actions == []
    lease.release(app, "sweep", holder="other")
    assert sweep.run(app, holder="me").leader
    # a leader that died: its lease runs out and another takes over
    assert lease.acquire(app, "sweep", app.clock.now(), holder="dead")
    assert not lease.acquire(app, "sweep", app.clock.now(), holder="me")
    later = app.clock.now() + timedelta(seconds=app.settings.scheduler.lease_seconds + 1)
    assert lease.acquire(app, "sweep", later, holder="me")


def test_metrics_count_scheduler_actions(sched):
    app = sched()
    m = up(app, "counted")
    app.clock.set(datetime(2026, 11, 6, 20, 0, tzinfo=UTC))
    heartbeats(app, m, 0.0, 60)
    text = metrics.Metrics(app).render()[0].decode()
    assert 'provisioner_machine_activity{signal="idle"} 1.0' in text
    sweep.run(app)
    text = metrics.Metrics(app).render()[0].decode()
    assert (
        'provisioner_scheduler_actions_total{action="stopped",reason="off-hours-idle"} 1.0' in text
    )
    assert 'provisioner_machines{cloud="sandbox",state="stopped"} 1.0' in text


# --- the CLI and two processes ---------------------------------------------------------------

ALWAYS_OFF = """
name: always-off
off_hours: {timezone: UTC, weekends: mon-sun}
idle: {unknown_counts_as_idle: true}
"""


@pytest.mark.slow  # two scheduler processes racing
def test_two_scheduler_processes_stop_each_machine_once(home, tmp_path, db_url):
    """Real processes, one state database, one sandbox cloud: the machines (launched two days
    ago, silent since) are stopped once each, whichever process leads each pass, and every
    second is counted once."""
    (tmp_path / "p.yaml").write_text(ALWAYS_OFF)
    cfg = write_settings(home, policies=[str(tmp_path / "p.yaml")], state_url=db_url)
    start = datetime.now(UTC) - timedelta(days=2)
    settings = make_settings(home, policies=[str(tmp_path / "p.yaml")], state_url=db_url)
    app = App(settings, ManualClock(start))
    names = [f"m{i:02d}" for i in range(24)]
    for n in names:
        up(app, n)
    app.close()
    cmd = [sys.executable, "-m", "provisioner", "--config", str(cfg), "sweep", "--output", "json"]
    script = f"import subprocess\nfor _ in range(3): subprocess.run({cmd!r}, check=True)\n"
    procs = [
        subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    app = App(settings, ManualClock(datetime.now(UTC)))
    with app.db.session() as s:
        stops = list(s.scalars(select(Event.machine_id).where(Event.kind == "stopped")))
        stopped = set(s.scalars(select(Machine.name).where(Machine.status == "stopped")))
        compute = list(s.scalars(select(UsageInterval).where(UsageInterval.kind == "compute")))
    app.close()
    assert stopped == set(names)
    assert len(stops) == len(names)  # once each
    assert len(compute) == len(names) and all(iv.ended_at for iv in compute)  # counted once
    reported: list[str] = []
    for out in outputs:
        text, pos = out.decode(), 0
        while pos < len(text.rstrip()):
            doc, pos = json.JSONDecoder().raw_decode(text, pos)
            pos += 1
            for p in doc["passes"]:
                reported += [a["machine"] for a in p["actions"]]
    assert sorted(reported) == sorted(names)  # each reported by the one process that acted


def test_cli_keep_and_sweep_dry_run(home, tmp_path):
    (tmp_path / "p.yaml").write_text(ALWAYS_OFF)
    cfg = write_settings(home, policies=[str(tmp_path / "p.yaml")])
    app = App(
        make_settings(home, policies=[str(tmp_path / "p.yaml")]),
        ManualClock(TEST_START - timedelta(days=1)),
    )
    up(app, "a1")
    up(app, "a2")
    app.close()
    r = run_cli("--config", str(cfg), "keep", "a2", "--until", "2026-11-20T00:00")
    assert r.returncode == 0, r.stderr
    r = run_cli("--config", str(cfg), "sweep", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "a1: stop [off-hours-idle]" in r.stdout and "(dry run)" in r.stdout
    assert "a2: left alone [kept]" in r.stdout
    r = run_cli("--config", str(cfg), "status", "--output", "json", "--no-refresh")
    assert {m["name"]: m["status"] for m in json.loads(r.stdout)} == {
        "a1": "running",
        "a2": "running",
    }
    r = run_cli("--config", str(cfg), "keep", "nope", "--until", "23:00")
    assert r.returncode == 2 and "no machine named 'nope'" in r.stderr


def test_deploy_examples_run_the_sweep():
    deploy = ROOT / "configs" / "deploy"
    assert "provisioner sweep" in (deploy / "crontab").read_text()
    assert "provisioner sweep" in (deploy / "provisioner-sweep.service").read_text()
    assert "OnCalendar" in (deploy / "provisioner-sweep.timer").read_text()
    import yaml

    job = yaml.safe_load((deploy / "cronjob.yaml").read_text())
    assert job["kind"] == "CronJob" and job["spec"]["concurrencyPolicy"] == "Forbid"
    container = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][-1] == "sweep" or "sweep" in container["args"]


@pytest.mark.slow  # the scheduler as a real process
def test_scheduler_run_serves_health_metrics_and_the_dashboard_and_stops_on_sigterm(home, tmp_path):
    import signal
    import socket
    import time
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (tmp_path / "p.yaml").write_text(BERLIN_NIGHTS)
    cfg = write_settings(
        home,
        policies=[str(tmp_path / "p.yaml")],
        scheduler={"listen": f"127.0.0.1:{port}", "sweep_interval_seconds": 10},
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "provisioner", "--config", str(cfg), "scheduler", "run"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(300):  # until it listens (imports, migrations)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    assert json.loads(r.read()) == {"ok": True}
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()[1].decode()
                time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert "provisioner_idle_machines 0.0" in r.read().decode()
        # the team dashboard on the same port (loopback: no token asked)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as r:
            page = r.read().decode()
            assert r.status == 200 and "Fleet" in page and "No live machines match." in page
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()
    assert "job sweep failed" not in stderr.decode()


def test_scheduler_run_refuses_to_start_with_a_bad_policy(home, tmp_path):
    (tmp_path / "p.yaml").write_text(BERLIN_NIGHTS.replace("Europe/Berlin", "Europe/Nowhere"))
    cfg = write_settings(home, policies=[str(tmp_path / "p.yaml")])
    r = run_cli("--config", str(cfg), "scheduler", "run", timeout=60)
    assert r.returncode == 2
    assert "p.yaml:5: off_hours.timezone: unknown IANA timezone 'Europe/Nowhere'" in r.stderr


WARNED = """
name: warned
off_hours: {timezone: UTC, weekends: mon-sun}
idle: {unknown_counts_as_idle: true, warn_minutes: 10}
"""


def test_owner_is_warned_before_an_idle_stop(home, tmp_path, smtp_server, db_url):  # noqa: F811
    (tmp_path / "p.yaml").write_text(WARNED)
    settings = make_settings(
        home,
        policies=[str(tmp_path / "p.yaml")],
        state_url=db_url,
        smtp=smtp_server.smtp.model_dump(),
    )
    clock = ManualClock(datetime(2026, 11, 7, 10, 0, tzinfo=UTC))
    app = App(settings, clock)
    up(app, "quiet")
    clock.advance(timedelta(hours=1))
    assert sweep.run(app, dry_run=True).actions[0].action == "warn"
    assert smtp_server.inbox.messages == []  # a dry run mails nobody

    first = sweep.run(app).actions
    assert [(a.action, a.done) for a in first] == [("warn", True)]
    ((to, msg),) = smtp_server.inbox.messages
    assert to == ["ana@example.com"] and "will be stopped at 11:10 UTC" in msg["Subject"]
    assert "provisioner keep quiet --until" in msg.get_body().get_content()

    clock.advance(timedelta(minutes=5))
    assert [a.action for a in sweep.run(app).actions] == ["warn"]
    assert len(smtp_server.inbox.messages) == 1  # warned once
    assert status(app, "quiet") == "running"

    clock.advance(timedelta(minutes=6))
    assert [(a.action, a.done) for a in sweep.run(app).actions] == [("stop", True)]
    assert status(app, "quiet") == "stopped"
    kinds = [k for k, _ in events(app, "quiet")]
    assert kinds.index("stop-warning") < kinds.index("stopped")
    app.close()


def test_one_machine_whose_rule_cannot_be_evaluated_does_not_stop_the_sweep(sched, caplog):
    """A machine recorded with an idle window too long for a date (accepted before numbers
    were bounded) cannot be assessed: it is logged and shown, and every other machine is
    still acted on, by the same pass."""
    app = sched("name: none\napplies_to: {projects: [nobody]}\n")
    broken = up(app, "broken", lifecycle={"idle": {"for_minutes": 30}})
    with app.db.session() as s:  # as an older provisioner wrote it
        row = s.get(Machine, broken.id)
        row.spec = {**row.spec, "lifecycle": {"idle": {"for_minutes": 99999999999999999999}}}
    up(app, "old", lifecycle={"max_lifetime": "2h"})
    quiet = up(app, "quiet", lifecycle={"idle": {"gpu_util_below": 10, "for_minutes": 20}})
    app.clock.advance(timedelta(hours=2))
    heartbeats(app, quiet, 1.0, 30)
    heartbeats(app, broken, 1.0, 30)

    with caplog.at_level(logging.WARNING, logger="provisioner.scheduler"):
        p = sweep.run(app)
        daemon.log_outcome("sweep", p)  # as `scheduler run` logs each pass

    got = {a.machine: (a.action, a.reason, a.done) for a in p.actions}
    assert got == {
        "broken": ("skip", "error", False),
        "old": ("stop", "max-lifetime", True),
        "quiet": ("stop", "idle", True),
    }
    [skipped] = [a for a in p.actions if a.machine == "broken"]
    assert "for_minutes" in (skipped.error or "")
    assert len([r for r in caplog.records if "broken" in r.getMessage()]) == 1  # logged once
    assert (status(app, "broken"), status(app, "old"), status(app, "quiet")) == (
        "running",
        "stopped",
        "stopped",
    )


def test_a_pass_longer_than_the_lease_keeps_it(sched, monkeypatch):
    """Acting takes longer than the lease (900 s): the pass renews it before each batch, so a
    second scheduler arriving after the first lease would have run out still does not act."""
    app = sched()
    for n in range(4):
        up(app, f"idle-{n}")
    app.clock.set(datetime(2026, 11, 6, 20, 0, tzinfo=UTC))  # 21:00 Berlin, no heartbeats
    for n in range(4):
        with app.db.session() as s:
            m = s.scalars(select(Machine).where(Machine.name == f"idle-{n}")).one()
        heartbeats(app, m, 1.0, 60)
    ttl = timedelta(seconds=app.settings.scheduler.lease_seconds)
    started = app.clock.now()
    monkeypatch.setattr(sweep, "BATCH", 2)
    sandbox = app.provider("sandbox")
    real_stop_many = sandbox.stop_many
    others = []

    def slow_stop_many(refs):
        app.clock.advance(ttl * 2 / 3)  # each batch takes two thirds of the lease
        if app.clock.now() > started + ttl:  # the first lease would have run out by now
            others.append(sweep.run(app, holder="second-scheduler"))
        return real_stop_many(refs)

    monkeypatch.setattr(sandbox, "stop_many", slow_stop_many)
    p = sweep.run(app, holder="first-scheduler")

    assert app.clock.now() - started > ttl
    assert sorted((a.machine, a.done) for a in p.actions) == [(f"idle-{n}", True) for n in range(4)]
    assert [(o.leader, o.actions) for o in others] == [(False, [])]
    assert "first-scheduler" in others[0].note
    assert all(status(app, f"idle-{n}") == "stopped" for n in range(4))
    for n in range(4):  # each stopped once: one event each
        assert events(app, f"idle-{n}").count(("stopped", "off-hours-idle")) == 1


def _preempted(app: App, names: list[str], **spec) -> None:
    """Machines preempted, recorded so, and then gone from the cloud: each is relaunched (a
    new machine), not started again in place."""
    for name in names:
        up(app, name, lifecycle={"on_preemption": "relaunch"}, **spec)
        preempt(app, name)
    reconcile.run(app)
    assert [status(app, n) for n in names] == ["preempted"] * len(names)
    for name in names:
        forget(app, name)


def forget(app: App, name: str) -> None:
    """The sandbox no longer has the machine (ended outside provisioner, not yet reconciled)."""
    app.provider("sandbox").terminate(machines.ref(machines.find(app, name)))


def test_a_recover_pass_longer_than_the_lease_keeps_it(sched, monkeypatch):
    """Relaunching takes minutes per machine: four relaunches of two thirds of the lease each
    outlive it twice over, and the pass renews it before each machine, so a second scheduler
    arriving meanwhile is refused every time and nothing is relaunched twice."""
    app = sched("name: any\n")
    names = [f"spot-{n}" for n in range(4)]
    _preempted(app, names)
    ttl = timedelta(seconds=app.settings.scheduler.lease_seconds)
    started = app.clock.now()
    real_up = machines.up
    others = []

    def slow_up(*args, **kwargs):
        monkeypatch.setattr(machines, "up", real_up)  # the second scheduler's would be quick
        app.clock.advance(ttl * 2 / 3)
        if app.clock.now() > started + ttl:  # the first lease would have run out by now
            others.append(recover.run(app, holder="second-scheduler"))
            assert not lease.acquire(app, "recover", app.clock.now(), holder="third")
        monkeypatch.setattr(machines, "up", slow_up)
        return real_up(*args, **kwargs)

    monkeypatch.setattr(machines, "up", slow_up)
    p = recover.run(app, holder="first-scheduler")

    assert app.clock.now() - started > 2 * ttl
    assert sorted((a.machine, a.action, a.done) for a in p.actions) == [
        (n, "relaunch", True) for n in names
    ]
    assert p.note == ""
    assert len(others) == 3 and all(not o.leader and o.actions == [] for o in others)
    assert all("first-scheduler" in o.note for o in others)
    for n in names:  # relaunched once each
        assert status(app, n) == "running"
        assert events(app, n).count(("relaunched", "preempted")) == 1


def test_a_pass_whose_lease_was_taken_stops_before_the_next_machine(sched, monkeypatch, caplog):
    """The first relaunch outlives the lease and another scheduler takes it meanwhile: the
    pass finds it taken when it would renew it, relaunches no other machine, and says so;
    the scheduler now holding the lease relaunches the rest, each once."""
    app = sched("name: any\n")
    names = [f"spot-{n}" for n in range(3)]
    _preempted(app, names)
    ttl = timedelta(seconds=app.settings.scheduler.lease_seconds)
    real_up = machines.up
    launched = []

    def stalled_up(app_, experiment, **kwargs):
        launched.append(experiment.name)
        if len(launched) == 1:
            app.clock.advance(ttl + timedelta(seconds=1))
            assert lease.acquire(app, "recover", app.clock.now(), holder="thief")
        return real_up(app_, experiment, **kwargs)

    monkeypatch.setattr(machines, "up", stalled_up)
    p = recover.run(app, holder="first-scheduler")

    assert len(launched) == 1
    [done] = [a for a in p.actions if a.done]
    rest = [a for a in p.actions if not a.done]
    assert len(rest) == 2 and all("lost its lease" in (a.error or "") for a in rest)
    assert "thief" in p.note and "took it" in p.note
    assert p.note in describe(p)  # shown by `provisioner sweep`
    with caplog.at_level(logging.INFO, logger="provisioner.scheduler"):
        daemon.log_outcome("recover", p)  # and logged by `scheduler run`, once
    assert [r.levelname for r in caplog.records if "thief" in r.getMessage()] == ["WARNING"]
    assert sorted(status(app, n) for n in names) == ["preempted", "preempted", "running"]

    monkeypatch.setattr(machines, "up", real_up)
    q = recover.run(app, holder="thief")
    assert sorted(a.machine for a in q.actions if a.done) == sorted(a.machine for a in rest)
    assert done.machine not in {a.machine for a in q.actions}
    for n in names:
        assert status(app, n) == "running"
        assert events(app, n).count(("relaunched", "preempted")) == 1


def test_reconcile_records_nothing_after_its_lease_was_taken(sched, monkeypatch):
    """The cloud's list call outlives the lease and another scheduler takes it: the pass
    records nothing of what the list said (the new leader's pass does) and says why."""
    app = sched("name: any\n")
    up(app, "spot")
    preempt(app, "spot")
    sandbox = app.provider("sandbox")
    real_list = sandbox.list_managed
    ttl = timedelta(seconds=app.settings.scheduler.lease_seconds)

    def slow_list(*args, **kwargs):
        app.clock.advance(ttl + timedelta(seconds=1))
        assert lease.acquire(app, "reconcile", app.clock.now(), holder="thief")
        return real_list(*args, **kwargs)

    monkeypatch.setattr(sandbox, "list_managed", slow_list)
    p = reconcile.run(app, holder="first-scheduler")
    assert p.leader and p.actions == [] and "thief" in p.note
    assert status(app, "spot") == "running"
    monkeypatch.setattr(sandbox, "list_managed", real_list)
    q = reconcile.run(app, holder="thief")
    assert [(a.machine, a.reason) for a in q.actions] == [("spot", "preempted")]
    assert status(app, "spot") == "preempted"


def test_a_failed_recovery_is_logged_once(sched, monkeypatch, caplog):
    """A terminate that fails is on the pass's action, and `scheduler run` logs it: once."""
    from providers.base import ProviderError

    app = sched("name: any\n")
    up(app, "gone", lifecycle={"on_preemption": "terminate"})
    preempt(app, "gone")
    reconcile.run(app)

    def refuse(ref):
        raise ProviderError("the cloud said no")

    monkeypatch.setattr(app.provider("sandbox"), "terminate", refuse)
    with caplog.at_level(logging.INFO, logger="provisioner.scheduler"):
        daemon._guarded("recover", lambda: recover.run(app))()
    said = [r for r in caplog.records if "gone" in r.getMessage()]
    assert len(said) == 1 and "the cloud said no" in said[0].getMessage()
    assert said[0].levelname == "WARNING"


def test_sweep_commits_once_per_batch(sched):
    """Stopping machines costs one batch call to the cloud and one transaction, not a few per
    machine: counted as sandbox API calls and as COMMITs on the state database."""
    from sqlalchemy import event as sa_event

    app = sched()
    ms = [up(app, f"idle-{n}") for n in range(6)]
    app.clock.set(datetime(2026, 11, 6, 20, 0, tzinfo=UTC))
    for m in ms:
        heartbeats(app, m, 1.0, 60)
    sandbox = app.provider("sandbox")
    calls = sandbox.api_calls
    writes: list[str] = []  # per durable commit: the first statement that wrote
    pending: dict[int, str] = {}

    def wrote(conn, cursor, statement, *args):
        if statement.lstrip().split()[0].upper() in ("INSERT", "UPDATE", "DELETE"):
            pending.setdefault(id(conn), statement.split()[0])

    sa_event.listen(app.db.engine, "before_cursor_execute", wrote)

    def committed(conn):
        if id(conn) in pending:
            writes.append(pending.pop(id(conn)))

    sa_event.listen(app.db.engine, "commit", committed)
    p = sweep.run(app)
    assert sum(a.done for a in p.actions) == 6
    assert sandbox.api_calls - calls == 2  # the list call, and one stop call for all six
    # the lease row made, taken and released (a quick pass need not renew it); the batch of
    # six stops; heartbeats pruned — none of it per machine
    assert len(writes) == 5
    with app.db.session() as s:  # the batch closed each compute interval, kept the disks'
        ivs = list(
            s.scalars(select(UsageInterval).where(UsageInterval.machine_id.in_([m.id for m in ms])))
        )
    compute = [iv.ended_at for iv in ivs if iv.kind == "compute"]
    assert compute == [app.clock.now()] * 6
    disks = [iv.ended_at for iv in ivs if iv.kind == "disk"]
    assert disks == [None] * len(disks)
