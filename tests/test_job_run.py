"""The experiment runs its job (issue #24, points 1, 2, 3, 7) on the sandbox: the workdir copied,
``setup`` once, ``run`` detached with ``env``; ``logs`` and ``exec``; the job's end an event with
its exit code, and ``lifecycle.on_finish`` ending the billing there."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from provisioner import machines
from provisioner.jobs import finish
from provisioner.jobs import reconcile as reconcile_job
from provisioner.machines import jobs
from provisioner.models import Event, Machine, UsageInterval
from provisioner.spec import load_experiment
from tests.conftest import (
    EXAMPLES,
    make_settings,
    run_cli,
    sandbox_experiment,
    write_settings,
    write_yaml,
)

ROOT_README = Path(__file__).resolve().parents[1] / "README.md"


def _workdir(tmp_path: Path) -> Path:
    work = tmp_path / "project"
    (work / "data").mkdir(parents=True)
    (work / "train.sh").write_text('echo "lr=$LR from $(pwd | xargs basename)"\n')
    (work / "model.ckpt").write_text("big\n")
    (work / "data" / "set.bin").write_text("big\n")
    (work / "notes.txt").write_text("kept\n")
    (work / ".gitignore").write_text("# not copied\n*.ckpt\ndata/\n")
    return work


def _experiment(tmp_path: Path, name: str = "job", **fields: object) -> Path:
    spec = sandbox_experiment(name)
    spec.update(fields)
    return write_yaml(tmp_path / f"{name}.yaml", spec)


def _wait_ended(app, name: str, job: str = "run") -> jobs.Job:
    """Until the job's end is recorded (the real process takes its own time; the clock does
    not move meanwhile)."""
    for _ in range(600):
        m = jobs.named(app, name)
        if m.status not in ("running", "pending"):
            jobs.check_ended(app, m)
        else:
            finish.check(app, [name])
        j = jobs.jobs_of(app, jobs.named(app, name))[job]
        if not j.running:
            return j
        time.sleep(0.05)
    raise AssertionError(f"{name}: job {job} never ended")


def _events(app, machine_id: str, kind: str) -> list[Event]:
    with app.db.session() as s:
        return list(
            s.scalars(
                select(Event)
                .where(Event.machine_id == machine_id, Event.kind == kind)
                .order_by(Event.id)
            )
        )


def test_run_exits_and_the_machine_stops_billing_ends_at_the_job_end(app, clock, tmp_path):
    work = _workdir(tmp_path)
    path = _experiment(
        tmp_path,
        workdir="project",
        setup="echo setup >> ../setup-ran; echo setting up",
        run="sh train.sh; ls; cat notes.txt",
        env={"LR": "0.001"},
    )
    exp = load_experiment(path)
    assert exp.workdir == str(work) and exp.on_finish == "stop"  # default with a run
    m = machines.up(app, exp).machine
    assert [e.detail for e in _events(app, m.id, "job-started")] == [
        {"job": "run", "command": "sh train.sh; ls; cat notes.txt"}
    ]
    clock.advance(timedelta(hours=2))
    job = _wait_ended(app, "job")
    assert job.exit_code == 0
    out = jobs.output(app, m, "run").decode()
    assert "setting up" in out and "lr=0.001 from workdir" in out  # env applied, in the copy
    listed = out.split("lr=0.001 from workdir\n", 1)[1].split("kept")[0].split()
    assert listed == ["notes.txt", "train.sh"]  # .gitignore'd model.ckpt and data/ not copied
    stopped = _events(app, m.id, "stopped")
    assert [(e.reason, e.detail["exit_code"]) for e in stopped] == [("on-finish", 0)]
    finished = _events(app, m.id, "job-finished")
    assert [e.detail for e in finished] == [{"job": "run", "exit_code": 0}]
    with app.db.session() as s:
        assert s.get(Machine, m.id).status == "stopped"
        compute = s.scalars(
            select(UsageInterval).where(
                UsageInterval.machine_id == m.id, UsageInterval.kind == "compute"
            )
        ).one()
        assert compute.ended_at == clock.now() == compute.started_at + timedelta(hours=2)


def test_keep_a_failing_run_then_exec_and_a_restart_after_preemption(app, clock, tmp_path):
    path = _experiment(
        tmp_path,
        setup="echo once >> ../setup-ran",
        run='echo "run with $MODE"; exit 3',
        env={"MODE": "fast"},
        lifecycle={"on_finish": "keep"},
    )
    exp = load_experiment(path)
    m = machines.up(app, exp).machine
    assert _wait_ended(app, "job").exit_code == 3
    assert [e.detail for e in _events(app, m.id, "job-finished")] == [
        {"job": "run", "exit_code": 3}
    ]
    assert jobs.named(app, "job").status == "running"  # keep: left running
    assert not _events(app, m.id, "stopped")
    assert jobs.output(app, m, "run") == b"run with fast\n"

    first = jobs.exec_job(app, "job", "echo exec $MODE; exit 5")
    second = jobs.exec_job(app, "job", "echo again")
    assert (first, second) == ("exec-1", "exec-2")
    assert _wait_ended(app, "job", "exec-1").exit_code == 5
    assert jobs.output(app, m, "exec-1") == b"exec fast\n"
    assert jobs.named(app, "job").status == "running"  # an exec job's end stops nothing
    from provisioner.dashboard import make_app
    from tests.test_dashboard import call

    page = call(make_app(app, listen="127.0.0.1:8765"), "/machine/job")[2]
    assert "job run: exited 3 at" in page and "job exec-1: exited 5 at" in page

    sandbox = app.provider("sandbox")
    clock.advance(timedelta(minutes=5))
    sandbox.preempt(machines.ref(m))
    machines.reconcile(app)
    clock.advance(timedelta(minutes=5))
    machines.restart(app, jobs.named(app, "job"))
    # the run had ended (exit 3) before the preemption: it is not run again (issue #34, 5)
    assert len(_events(app, m.id, "job-started")) == 3  # run, exec-1, exec-2
    assert not _events(app, m.id, "run-due") and not jobs.run_due(app, jobs.named(app, "job"))
    assert jobs.jobs_of(app, jobs.named(app, "job"))["run"].exit_code == 3
    setup_ran = Path(sandbox.machine_dir(m.instance_id)) / "setup-ran"
    assert setup_ran.read_text() == "once\n"  # setup once per machine


def test_on_finish_terminate_through_the_reconcile_pass(app, tmp_path):
    exp = load_experiment(
        _experiment(tmp_path, run="echo bye", lifecycle={"on_finish": "terminate"})
    )
    m = machines.up(app, exp).machine
    for _ in range(600):
        if jobs.state(app, m, "run").exit_code is not None:
            break
        time.sleep(0.05)
    done = reconcile_job.run(app)
    assert [(a.action, a.reason, a.done) for a in done.actions] == [
        ("terminate", "on-finish", True)
    ]
    [ended] = _events(app, m.id, "terminated")
    assert ended.reason == "on-finish" and ended.detail["exit_code"] == 0
    assert jobs.named(app, "job").status == "terminated"


def test_stopping_the_machine_kills_its_job(app, tmp_path):
    exp = load_experiment(_experiment(tmp_path, run="echo started; sleep 600"))
    m = machines.up(app, exp).machine
    assert jobs.state(app, m, "run").running
    machines.stop(app, "job")
    st = jobs.state(app, m, "run")
    assert not st.running and st.exit_code is None
    [ended] = jobs.check_ended(app, jobs.named(app, "job"))
    assert ended.reason == "killed" and ended.exit_code is None


# ---- through the CLI ---------------------------------------------------------------------------


@pytest.mark.slow  # a CLI run end to end: README command and CI, not the quick loop
def test_up_follows_the_run_logs_exec_and_status(home, tmp_path):
    cfg = write_settings(home)
    _workdir(tmp_path)
    path = _experiment(
        tmp_path,
        name="cli",
        workdir="project",
        run="sh train.sh; echo failing; exit 3",
        env={"LR": "0.5"},
        lifecycle={"on_finish": "keep"},
    )
    up = run_cli("--config", str(cfg), "up", str(path))
    assert up.returncode == 1, up.stderr  # the run failed
    assert "lr=0.5 from workdir\nfailing\n" in up.stdout
    assert "run exited 3: cli is running (on_finish: keep)" in up.stdout

    logs = run_cli("--config", str(cfg), "logs", "cli", "--tail", "1")
    assert logs.returncode == 3 and logs.stdout == "failing\n"  # the job's own exit code
    assert "job run: exited 3" in logs.stderr

    ex = run_cli("--config", str(cfg), "exec", "cli", "--", "sh", "-c", "echo lr is $LR")
    assert ex.returncode == 0 and ex.stdout.strip() == "exec-1", ex.stderr
    followed = run_cli("--config", str(cfg), "logs", "cli", "--job", "exec-1", "-f")
    assert followed.returncode == 0 and followed.stdout == "lr is 0.5\n"
    assert "job exec-1: exited 0" in followed.stderr
    missing = run_cli("--config", str(cfg), "logs", "cli", "--job", "exec-9")
    assert missing.returncode == 2 and "no job 'exec-9'" in missing.stderr

    st = run_cli("--config", str(cfg), "status", "cli")
    assert "job run     exited 3 at" in st.stdout and "job exec-1  exited 0 at" in st.stdout
    detail = json.loads(run_cli("--config", str(cfg), "status", "cli", "-o", "json").stdout)
    assert [(j["job"], j["exit_code"]) for j in detail["jobs"]] == [("run", 3), ("exec-1", 0)]


@pytest.mark.slow  # a CLI run end to end: README command and CI, not the quick loop
def test_up_detach_returns_at_once_and_logs_follow_to_the_stop(home, tmp_path):
    cfg = write_settings(home)
    path = _experiment(tmp_path, name="det", run="sleep 1; echo finished")
    up = run_cli("--config", str(cfg), "up", str(path), "--detach")
    assert up.returncode == 0 and "job run started" in up.stdout
    assert "finished" not in up.stdout
    logs = run_cli("--config", str(cfg), "logs", "det", "-f")
    assert logs.returncode == 0 and logs.stdout == "finished\n"
    st = json.loads(run_cli("--config", str(cfg), "status", "det", "-o", "json").stdout)
    assert st["status"] == "stopped"  # on_finish: stop, by default with a run
    assert [e["reason"] for e in st["events"] if e["event"] == "stopped"] == ["on-finish"]


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [
        ("env", {"lr": "1"}, "env.lr"),
        ("workdir", "no-such-dir", "workdir"),
        ("lifecycle", {"on_finish": "halt"}, "lifecycle.on_finish"),
    ],
)
def test_bad_job_fields_are_exit_2_with_line(home, tmp_path, field, value, where):
    spec = sandbox_experiment("bad")
    spec["run"] = "echo hi"
    spec[field] = value
    path = write_yaml(tmp_path / "bad.yaml", spec)
    r = run_cli("plan", str(path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = 1 + next(
        i for i, t in enumerate(path.read_text().splitlines()) if t.startswith(f"{field}:")
    )
    assert f"{path}:" in r.stderr and where in r.stderr, r.stderr
    assert any(f"{path}:{n}: {where}" in r.stderr for n in (line, line + 1)), r.stderr


@pytest.mark.slow  # a CLI run end to end: README command and CI, not the quick loop
def test_the_readme_first_command_shows_the_loop_and_ends(home):
    assert ".venv/bin/provisioner up configs/examples/quickstart.yaml" in ROOT_README.read_text()
    cfg = write_settings(home)
    up = run_cli("--config", str(cfg), "up", str(EXAMPLES / "quickstart.yaml"), timeout=60)
    assert up.returncode == 0, up.stderr
    assert "step 3/3\ndone\n" in up.stdout
    assert "run exited 0: quickstart stopped, compute billing ended" in up.stdout


def test_a_git_workdir_is_copied_as_git_ls_files_lists_it(app, tmp_path):
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("no git on this machine")
    work = _workdir(tmp_path)
    (work / "untracked.txt").write_text("new\n")
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    subprocess.run(["git", "-C", str(work), "add", "train.sh", ".gitignore"], check=True)
    files, how = jobs.workdir_files(app, str(work))
    assert how == "git ls-files"
    assert files == [".gitignore", "notes.txt", "train.sh", "untracked.txt"]
    exp = load_experiment(_experiment(tmp_path, workdir="project", run="ls -A"))
    m = machines.up(app, exp).machine
    _wait_ended(app, "job")
    assert jobs.output(app, m, "run").decode().split() == files


def test_a_relaunch_after_preemption_runs_the_job_again(app, clock, tmp_path):
    from provisioner.jobs import recover

    exp = load_experiment(
        _experiment(
            tmp_path,
            setup="echo setup",
            run="echo working; sleep 600",
            lifecycle={"on_preemption": "relaunch"},
        )
    )
    old = machines.up(app, exp).machine
    clock.advance(timedelta(hours=1))
    sandbox = app.provider("sandbox")
    sandbox.preempt(machines.ref(old))
    assert not jobs.state(app, old, "run").running  # killed with the machine
    sandbox.inject(capacity={old.zone: 0})  # no room in place: a new machine
    clock.advance(timedelta(minutes=5))
    reconcile_job.run(app)
    [done] = recover.run(app).actions
    assert (done.action, done.done) == ("relaunch", True), done
    new = jobs.named(app, "job")
    assert new.id != old.id
    assert [e.detail["job"] for e in _events(app, new.id, "job-started")] == ["run"]
    for _ in range(600):
        if b"working" in jobs.output(app, new, "run"):
            break
        time.sleep(0.05)
    assert jobs.output(app, new, "run") == b"setup\nworking\n"  # setup again on a new machine
    assert jobs.state(app, new, "run").running
    machines.down(app, "job")
    assert not jobs.state(app, new, "run").running  # down kills it


@pytest.mark.slow  # two CLI processes
def test_up_again_starts_a_run_an_interrupted_up_never_started(home, clock, tmp_path, monkeypatch):
    from providers.sandbox.adapter import SandboxProvider
    from provisioner.app import App

    cfg = write_settings(home)
    path = _experiment(tmp_path, name="again", run="echo the job")
    app = App(make_settings(home), clock)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the `up` dies between the launch and the job

    monkeypatch.setattr(SandboxProvider, "start_job", killed)
    with pytest.raises(KeyboardInterrupt):
        machines.up(app, load_experiment(path))
    m = jobs.named(app, "again")
    assert m.status == "running" and jobs.jobs_of(app, m) == {}
    app.close()

    # a new process: the sandbox's start_job is patched in this one
    up = run_cli("--config", str(cfg), "up", str(path), fresh=True)
    assert up.returncode == 0, up.stderr
    assert "its run had not started: started now" in up.stdout
    assert "the job\n" in up.stdout and "run exited 0: again stopped" in up.stdout
    again = run_cli("--config", str(cfg), "up", str(path), fresh=True)  # nothing more to start
    assert again.returncode == 0 and "the job" not in again.stdout


def test_sync_copies_the_workdir_again_to_a_sandbox_machine(app, tmp_path):
    work = _workdir(tmp_path)
    exp = load_experiment(_experiment(tmp_path, workdir="project", run="true"))
    m = machines.up(app, exp).machine
    copy = Path(app.provider("sandbox").machine_dir(m.instance_id)) / "workdir"
    assert (copy / "train.sh").exists() and not (copy / "data").exists()
    (work / "eval.sh").write_text("echo eval\n")
    (work / "data" / "more.bin").write_text("big\n")
    assert jobs.sync(app, "job") == (4, ".gitignore (simple patterns)", str(work))
    assert (copy / "eval.sh").read_text() == "echo eval\n" and not (copy / "data").exists()
