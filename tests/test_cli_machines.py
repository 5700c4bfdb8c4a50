"""The CLI around machines as a person meets it: a machine's detail and events, why one failed,
spend across relaunches, Ctrl-C during `up`, a changed spec under a used name, several machines
at once, keep and the sweep's reasons, the scheduler's log, the catalog's sources."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from policies.duration import format_duration
from provisioner import machines
from provisioner.app import App
from provisioner.clock import CLOCK_ENV, ManualClock
from provisioner.jobs import reconcile, recover
from provisioner.settings import load_settings
from provisioner.spec import Experiment
from tests.conftest import (
    ROOT,
    TEST_START,
    run_cli,
    sandbox_experiment,
    write_settings,
    write_yaml,
)

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

# Monday 2 Nov 2026, 09:00 UTC = 10:00 in Berlin: within hours until 20:00 there
BERLIN = """
name: nights
applies_to: {projects: ["demo"]}
off_hours:
  timezone: Europe/Berlin
  windows: [{days: mon-fri, start: "20:00", end: "08:00"}]
idle: {gpu_util_below: 5, for_minutes: 30, action: stop}
"""


def launch(cfg: Path, name: str, at=TEST_START, **spec) -> App:
    a = App(load_settings(cfg), ManualClock(at))
    data = sandbox_experiment(name)
    data.update(spec)
    machines.up(a, Experiment.model_validate(data))
    return a


def test_format_duration_reads_as_people_write():
    assert [
        format_duration(timedelta(seconds=s)) for s in (42, 12 * 60, 200 * 60, 7 * 3600, 50 * 3600)
    ] == ["42 s", "12 min", "3 h 20 min", "7 h", "2 d 2 h"]


def test_status_name_shows_the_machine_its_cost_next_action_and_events(cli, home, tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_text(BERLIN)
    cfg = write_settings(home, policies=[str(policy)])
    launch(cfg, "exp", lifecycle={"max_lifetime": "547m"}).close()
    r = cli("--config", str(cfg), "status", "exp", "--no-refresh")
    assert r.code == 0, r.err
    text = r.out
    for line in (
        "spec     T4:1 spot, disk 50 GB, clouds sandbox",
        "offer    sandbox sandbox-us-1a  sbx-t4-1  1×T4 spot",
        "rate     0.15 USD/h compute + 0.01 USD/h disk (fixed at launch)",
        "idle     no heartbeat: no agent (scheduler.endpoint_url is not set)",
    ):
        assert line in text, text
    # the next scheduled action: in hours until 20:00 Berlin, lifetime ends at 18:07 UTC
    assert "next     nothing due: lifetime ends in 9 h 7 min (stop, experiment)" in text
    assert "in hours until 20:00 Europe/Berlin (nights)" in text
    assert "launch-attempt" in text and "launched" in text
    # `events` lists the same, for one name or for all
    ev = json.loads(cli("--config", str(cfg), "events", "exp", "-o", "json").out)
    assert [e["event"] for e in ev] == ["requested", "launch-attempt", "launched"]
    r = cli("--config", str(cfg), "events", "nosuch")
    assert r.code == 2 and "no machine named 'nosuch'" in r.err
    # JSON detail: the same facts, typed
    d = json.loads(cli("--config", str(cfg), "status", "exp", "--no-refresh", "-o", "json").out)
    assert d["launches"] == 1 and d["next"].startswith("nothing due")
    assert d["spec"]["resources"]["disk_gb"] == 50


def test_status_all_says_why_a_machine_failed(cli, home, tmp_path):
    cfg = write_settings(
        home, sandbox={"quota_gpus": {"sandbox-us": 0, "sandbox-eu": 0, "sandbox-ru": 0}}
    )
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("nogo"))
    r = cli("--config", str(cfg), "up", str(spec))
    assert r.code == 1
    r = cli("--config", str(cfg), "status", "-a")
    assert " failed " in r.out
    assert "nogo failed: no candidate launched (3 attempts: quota 3); last: " in r.out, r.out
    (m,) = json.loads(cli("--config", str(cfg), "status", "-a", "-o", "json").out)
    assert m["status"] == "failed" and m["why"].startswith("no candidate launched")


def test_spent_does_not_restart_at_zero_after_a_recovery(cli, home, monkeypatch):
    cfg = write_settings(home)
    a = launch(cfg, "spot", lifecycle={"on_preemption": "relaunch"})
    lost = machines.find(a, "spot")
    a.clock.advance(timedelta(hours=2))
    a.provider("sandbox").preempt(machines.ref(lost))
    reconcile.run(a)
    a.provider("sandbox").terminate(machines.ref(lost))  # the cloud kept nothing: relaunched
    assert [x.done for x in recover.run(a).actions] == [True]
    new = machines.find(a, "spot")
    a.clock.advance(timedelta(hours=1))
    at = a.clock.now()
    a.close()
    monkeypatch.setenv(CLOCK_ENV, at.isoformat())
    (m,) = json.loads(cli("--config", str(cfg), "status", "--no-refresh", "-o", "json").out)
    assert m["id"] == new.id and m["launches"] == 2
    (spent,) = m["spent"]
    # 2 h of the lost machine (compute and disk) and 1 h of the new one, at 0.15 USD/h compute
    assert Decimal(spent["amount"]) > Decimal("0.15") * 3
    assert Decimal(spent["amount"]) < Decimal("0.15") * 3 + Decimal("0.05")
    r = cli("--config", str(cfg), "status", "spot", "--no-refresh")
    assert "across 2 launches (relaunched after preemption)" in r.out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_DEFAULT_SIGINT_THEN_EXEC = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def _interrupt_when(args: list[str], marker: str, env: dict[str, str]) -> tuple[int, str]:
    """Run the CLI, send SIGINT once ``marker`` shows on stderr, return (code, stderr).

    The child starts with SIGINT at its default, as a terminal's foreground job has it: a suite
    started in the background of a non-interactive shell ignores SIGINT, children inherit that,
    and a CLI that ignores Ctrl-C (as it should then) would never answer. Whatever happens, the
    child is gone when this returns. The default is restored by a small Python that then execs
    the CLI, not by ``preexec_fn``: that forces a plain fork of this worker, whose gRPC (loaded by
    the Yandex and GCP tests in the same worker) aborts in the forked child (seen in CI:
    "epoll_wait error: Bad file descriptor", SIGABRT)."""
    log = Path(env["PROVISIONER_HOME"]) / "stderr.txt"
    with log.open("w") as f:
        p = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _DEFAULT_SIGINT_THEN_EXEC,
                sys.executable,
                "-m",
                "provisioner",
                *args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=f,
            cwd=ROOT,
            env={**os.environ, CLOCK_ENV: TEST_START.isoformat(), **env},
        )
        try:
            deadline = time.monotonic() + 60
            while marker not in log.read_text() and p.poll() is None:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            p.send_signal(signal.SIGINT)
            code = p.wait(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    return code, log.read_text()


@pytest.mark.slow  # a real `up` process interrupted
def test_ctrl_c_during_up_says_what_it_left_and_exits_130(home, tmp_path):
    env = {"PROVISIONER_HOME": str(home)}
    # waiting for SSH: a machine that bills
    cfg = write_settings(home, sandbox={"public_ip": "127.0.0.1", "ssh_port": _closed_port()})
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("exp"))
    code, err = _interrupt_when(["--config", str(cfg), "up", str(spec)], "waiting for SSH", env)
    assert code == 130 and "Traceback" not in err, err
    assert "interrupted: exp is running on sandbox sandbox-us-1a" in err
    assert "`provisioner down exp`" in err
    # during the launch call itself: the intent is recorded, `up` again resumes it
    cfg = write_settings(home, sandbox={"latency_seconds": 3})
    spec2 = write_yaml(tmp_path / "slow.yaml", sandbox_experiment("slow"))
    code, err = _interrupt_when(["--config", str(cfg), "up", str(spec2)], "trying sandbox/", env)
    assert code == 130 and "Traceback" not in err, err
    assert "interrupted: slow is requested" in err and f"`provisioner up {spec2}`" in err
    # while it waits for capacity: the intent stays queued, and `down` cancels it
    zones = ("sandbox-us-1a", "sandbox-us-1b", "sandbox-us-1c", "sandbox-eu-1a", "sandbox-ru-1a")
    cfg = write_settings(home, sandbox={"capacity": dict.fromkeys(zones, 0)})
    spec3 = write_yaml(tmp_path / "full.yaml", sandbox_experiment("full"))
    argv = ["--config", str(cfg), "up", str(spec3), "--retry-until-up", "--timeout", "3h"]
    code, err = _interrupt_when(argv, "round 1:", env)
    assert code == 130 and "Traceback" not in err, err
    assert "interrupted: full stays queued (waiting for capacity until 12:00 UTC)" in err
    assert "the scheduler keeps trying" in err and "cancel with `provisioner down full`" in err


def test_down_of_an_unfinished_up_says_it_was_never_launched(cli, home, tmp_path):
    cfg = write_settings(home)
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("half"))
    r = run_cli("--config", str(cfg), "up", str(spec), env={"PROVISIONER_CRASH_AT": "after-intent"})
    assert r.returncode == -signal.SIGKILL
    r = cli("--config", str(cfg), "down", "half")
    assert r.code == 0
    assert "half was never launched (an unfinished `up`)" in r.out and "terminated" not in r.out


def test_up_of_a_changed_spec_says_what_differs_and_exits_2(cli, home, tmp_path):
    cfg = write_settings(home)
    launch(cfg, "exp").close()
    same = write_yaml(tmp_path / "same.yaml", sandbox_experiment("exp"))
    r = cli("--config", str(cfg), "up", str(same))
    assert r.code == 0 and "exp already exists (running on sandbox); nothing launched" in r.out
    edited = write_yaml(tmp_path / "edited.yaml", sandbox_experiment("exp", gpu="A100:1"))
    r = cli("--config", str(cfg), "up", str(edited))
    assert r.code == 2
    assert "resources.gpu.type: T4 → A100" in r.err
    assert f"`provisioner down exp` then `provisioner up {edited}`" in r.err
    d = json.loads(cli("--config", str(cfg), "up", str(edited), "-o", "json").out)
    assert d["already"] is True and d["differences"] == ["resources.gpu.type: T4 → A100"]


def test_several_machines_at_once_with_confirmation(cli, home, monkeypatch):
    cfg = write_settings(home)
    for name, project in (("aa", "demo"), ("bb", "demo"), ("cc", "other")):
        data = sandbox_experiment(name)
        data["project"] = project
        a = App(load_settings(cfg), ManualClock(TEST_START))
        machines.up(a, Experiment.model_validate(data))
        a.close()
    # no terminal, no --yes: refused, nothing done
    r = cli("--config", str(cfg), "stop", "--all")
    assert r.code == 2 and "add --yes" in r.err
    r = cli("--config", str(cfg), "stop", "a", "b")
    assert r.code == 2 and "add --yes" in r.err
    st = json.loads(cli("--config", str(cfg), "status", "--no-refresh", "-o", "json").out)
    assert {m["status"] for m in st} == {"running"}
    # --project P --yes: only that project's
    r = cli("--config", str(cfg), "stop", "--project", "demo", "--yes", "-o", "json")
    assert r.code == 0 and [x["name"] for x in json.loads(r.out)] == ["aa", "bb"]
    st = json.loads(cli("--config", str(cfg), "status", "--no-refresh", "-o", "json").out)
    assert {m["name"]: m["status"] for m in st} == {
        "aa": "stopped",
        "bb": "stopped",
        "cc": "running",
    }
    # names: each one's outcome; an unknown name fails alone (exit 1: partly done)
    r = cli("--config", str(cfg), "start", "aa", "nosuch", "--yes")
    assert r.code == 1 and "aa started" in r.out and "nosuch: no machine named" in r.err
    # a confirmation on a terminal: "n" does nothing
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("typer.confirm", lambda *a, **k: False)
    r = cli("--config", str(cfg), "down", "--all")
    assert r.code == 1 and "aborted" in r.err
    r = cli("--config", str(cfg), "down", "--all", "-y")
    assert r.code == 0 and [ln.split()[0] for ln in r.out.splitlines()] == ["aa", "bb", "cc"]
    r = cli("--config", str(cfg), "down")
    assert r.code == 2 and "name the machines to down, or use --all or --project P" in r.err


def test_keep_answers_in_the_policy_zone_cancels_and_refuses_a_stopped_machine(cli, home, tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_text(BERLIN)
    cfg = write_settings(home, policies=[str(policy)])
    launch(cfg, "exp").close()
    # kept for good is no keep: a date years ahead is refused, the machine left as it was
    r = cli("--config", str(cfg), "keep", "exp", "--until", "9999-12-31")
    assert r.code == 2 and "at most 31 days ahead" in r.err and r.err.count("\n") == 1
    r = cli("--config", str(cfg), "keep", "exp", "--until", "23:00")
    assert r.code == 0, r.err
    # 23:00 in Berlin (CET) is 22:00 UTC; the answer is in the zone it was asked in
    assert "exp is kept until 2026-11-02 23:00 Europe/Berlin (22:00 UTC, in 13 h)" in r.out
    r = cli("--config", str(cfg), "sweep", "--dry-run")
    assert "exp: left alone [kept] — kept until 2026-11-02 22:00 UTC" in r.out
    r = cli("--config", str(cfg), "keep", "exp", "--cancel")
    assert r.code == 0 and "no longer kept" in r.out
    r = cli("--config", str(cfg), "sweep", "--dry-run")
    assert "sweep: 1 machine checked (dry run)" in r.out
    assert "exp: nothing due: in hours until 20:00 Europe/Berlin (nights)" in r.out
    assert cli("--config", str(cfg), "stop", "exp").code == 0
    r = cli("--config", str(cfg), "keep", "exp", "--until", "23:00")
    assert r.code == 2 and "exp is stopped: there is nothing to keep running" in r.err
    r = cli("--config", str(cfg), "keep", "exp")
    assert r.code == 2 and "--until" in r.err


def test_sweep_dry_run_says_when_a_lifetime_ends(cli, home):
    cfg = write_settings(home)
    launch(cfg, "short", lifecycle={"max_lifetime": "2h"}).close()
    at = TEST_START + timedelta(hours=1, minutes=53)
    os.environ[CLOCK_ENV] = at.isoformat()  # the fixture's monkeypatch restores it
    r = cli("--config", str(cfg), "sweep", "--dry-run")
    assert "short: nothing due: lifetime ends in 7 min (stop, experiment)" in r.out, r.out
    os.environ[CLOCK_ENV] = (at + timedelta(minutes=8)).isoformat()
    r = cli("--config", str(cfg), "sweep", "--dry-run")
    assert "short: stop [max-lifetime] — up 2 h 1 min, max lifetime 2 h (experiment)" in r.out


@pytest.mark.slow  # the scheduler as a real process
def test_scheduler_logs_actions_not_ticks(home):
    cfg = write_settings(home, scheduler={"listen": f"127.0.0.1:{_closed_port()}"})
    log = home.parent / "scheduler.log"
    with log.open("w") as f:
        p = subprocess.Popen(
            [sys.executable, "-m", "provisioner", "--config", str(cfg), "scheduler", "run"],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, CLOCK_ENV: TEST_START.isoformat()},
        )
        deadline = time.monotonic() + 60
        # every job runs once at start; the lease rows show when they have
        while "/metrics" not in log.read_text() or not _leases(home, 3):
            assert time.monotonic() < deadline and p.poll() is None, log.read_text()
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    text = log.read_text()
    assert "Running job" not in text and "executed successfully" not in text, text
    assert "Traceback" not in text


def _leases(home: Path, n: int) -> bool:
    import sqlite3

    try:
        with sqlite3.connect(home / "state.db") as db:
            return db.execute("SELECT count(*) FROM scheduler_leases").fetchone()[0] >= n
    except sqlite3.Error:
        return False


def test_log_outcome_says_actions_and_failures_only(caplog):
    from provisioner.jobs.daemon import log_outcome
    from provisioner.jobs.passes import Action, Pass

    p = Pass("sweep", checked=3)
    p.actions = [
        Action("kept", "keep", "kept", "kept until 23:00 UTC"),
        Action("a", "stop", "idle", "GPUs below 5% for 30 min", done=True),
        Action("b", "stop", "idle", "GPUs below 5% for 30 min", error="cloud said no"),
    ]
    with caplog.at_level(logging.INFO, logger="provisioner.scheduler"):
        log_outcome("sweep", p)
        log_outcome("sweep", Pass("sweep", checked=10))  # a quiet pass says nothing
    assert [(r.levelname, r.getMessage().split(" [")[0]) for r in caplog.records] == [
        ("INFO", "sweep: a: stop"),
        ("WARNING", "sweep: b: stop"),
    ]


def test_plan_says_1_candidate(cli, home, tmp_path):
    cfg = write_settings(home)
    spec = write_yaml(
        tmp_path / "one.yaml",
        sandbox_experiment("one", gpu="T4:4", regions=["sandbox-eu"], market="reserved"),
    )
    r = cli("--config", str(cfg), "plan", str(spec))
    assert "one: T4:4 reserved — 1 candidate, cheapest first" in r.out, r.out


def test_catalog_lists_the_sandbox_only_when_settings_name_it(cli, home):
    default = cli("catalog", "--gpu", "T4", "-o", "json")
    assert default.code == 0 and "sandbox" not in {x["cloud"] for x in json.loads(default.out)}
    cfg = write_settings(home)  # names the sandbox
    named = json.loads(cli("--config", str(cfg), "catalog", "--gpu", "T4", "-o", "json").out)
    assert {x["cloud"] for x in named} == {"sandbox"}


def test_catalog_refresh_says_what_credentials_a_source_needs(cli, home, monkeypatch):
    monkeypatch.delenv("PROVISIONER_GCP_API_KEY", raising=False)
    cfg = write_settings(home, clouds={"gcp": {"project": "p"}})
    r = cli("--config", str(cfg), "catalog", "refresh", "--cloud", "gcp")
    assert r.code == 1
    assert "gcp: reading the Cloud Billing Catalog API; needs an API key in" in r.err
    assert "gcp: price refresh needs credentials" in r.err
    r = cli("--config", str(cfg), "catalog", "refresh", "--cloud", "sandbox")
    assert r.code == 2 and "sandbox has no price source to refresh" in r.err
    r = cli("--config", str(cfg), "catalog", "refresh", "--cloud", "oracle")
    assert r.code == 2 and "no such cloud" in r.err


def test_readme_documents_the_scheduler_settings_and_refresh_sources():
    readme = (ROOT / "README.md").read_text()
    for key in (
        "scheduler.listen",
        "scheduler.endpoint_url",
        "sweep_interval_seconds",
        "recover_interval_seconds",
        "reconcile_interval_seconds",
        "PROVISIONER_GCP_API_KEY",
        "provisioner status NAME",
        "provisioner events",
    ):
        assert key in readme, key


def test_a_settings_error_is_said_once_not_once_per_zone(home, monkeypatch):
    """Yandex without a folder: the first candidate says so and blocks the cloud; the other
    zones and shapes are skipped, not tried and refused one by one."""
    from provisioner.errors import OperationFailed
    from tests.conftest import make_settings

    monkeypatch.delenv("YC_FOLDER_ID", raising=False)
    a = App(make_settings(home, clouds={"yandex": {}}), ManualClock(TEST_START))
    data = sandbox_experiment("v100", gpu="V100:1", market="reserved", clouds=["yandex"])
    said: list[str] = []
    with pytest.raises(OperationFailed) as e:
        machines.up(a, Experiment.model_validate(data), progress=said.append)
    a.close()
    assert sum("no folder set" in s for s in said) == 1, said
    assert "on any of 1 candidate tried" in str(e.value) and "settings" in str(e.value)


def test_status_asks_the_database_the_same_few_queries_for_any_number_of_machines(
    cli, home, monkeypatch
):
    """Costs for every machine in one query, not one per machine; an empty state costs the
    schema check and one query. Counted where statements leave: SQLAlchemy's engines and the
    fleet's plain SQL on their DB-API connections."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from provisioner.fleet import Sql

    cfg = write_settings(home)
    statements: list[str] = []

    def count(conn, cursor, statement, *args) -> None:
        statements.append(statement)

    plain = Sql.all
    monkeypatch.setattr(Sql, "all", lambda sql, q, p=(): statements.append(q) or plain(sql, q, p))
    event.listen(Engine, "before_cursor_execute", count)
    try:
        assert cli("--config", str(cfg), "status").code == 0  # creates the schema
        statements.clear()
        assert cli("--config", str(cfg), "status").code == 0
        empty = len(statements)
        for n in (2, 20):
            a = App(load_settings(cfg), ManualClock(TEST_START))
            for i in range(n - len(names_in_state(a))):
                data = sandbox_experiment(f"m{n}-{i}")
                machines.up(a, Experiment.model_validate(data))
            a.close()
            statements.clear()
            r = cli("--config", str(cfg), "status", "--no-refresh", "-o", "json")
            assert len(json.loads(r.out)) == n
            if n == 2:
                few = len(statements)
    finally:
        event.remove(Engine, "before_cursor_execute", count)
    assert empty <= 2, statements  # the schema's revision, the machines
    assert len(statements) == few <= 5, statements  # + recoveries, costs, latest heartbeats
    costs = [q for q in statements if "usage_intervals" in q]
    assert len(costs) == 1 and "GROUP BY" in costs[0], costs  # every machine's, summed by SQL


def names_in_state(a: App) -> list[str]:
    from sqlalchemy import select

    from provisioner.models import Machine

    with a.db.session() as s:
        return list(s.scalars(select(Machine.name)))


def test_status_shows_what_the_clouds_say_and_reads_the_fleet_again_only_then(
    cli, home, monkeypatch
):
    """The default status asks the clouds first: a new address or a preemption shows at once;
    when the clouds confirm the state, the machines are read once, not again."""
    import sqlite3

    from provisioner.fleet import Sql

    cfg = write_settings(home)
    a = launch(cfg, "one")
    one = machines.find(a, "one")
    launch(cfg, "two").close()
    reads: list[str] = []
    plain = Sql.all

    def count(sql, statement, params=()):
        if statement.startswith("SELECT id, name") and "ORDER BY created_at" in statement:
            reads.append(statement)
        return plain(sql, statement, params)

    monkeypatch.setattr(Sql, "all", count)

    def shown() -> dict[str, tuple[str, str]]:
        reads.clear()
        r = cli("--config", str(cfg), "status", "-o", "json")
        assert r.code == 0, r.err
        return {m["name"]: (m["status"], m["public_ip"]) for m in json.loads(r.out)}

    try:
        before = shown()
        assert len(reads) == 1 and before["one"][0] == "running"
        with sqlite3.connect(a.provider("sandbox").db_path) as db:  # restarted elsewhere
            db.execute(
                "UPDATE machines SET public_ip = '203.0.113.7' WHERE id = ?", (one.instance_id,)
            )
        assert shown() == {**before, "one": ("running", "203.0.113.7")} and len(reads) == 2
        a.provider("sandbox").preempt(machines.ref(one))
        assert shown()["one"][0] != "running" and len(reads) == 2
        assert shown()["two"] == before["two"] and len(reads) == 1
    finally:
        a.close()
