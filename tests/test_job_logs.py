"""Exit codes and logs that last (issue #34, points 4 and 5) on the sandbox: `logs --job X` exits
with the job's code; a failed setup says setup; each job's output is kept with the state when it
ends (readable with the machine gone), one per attempt; a run that ended is not run again after
a preemption."""

from __future__ import annotations

import shutil
import time
from datetime import timedelta
from pathlib import Path

import pytest

from provisioner import machines
from provisioner.errors import UserError
from provisioner.machines import joblogs, jobs
from provisioner.spec import load_experiment
from provisioner.workflows import job_control
from tests.conftest import run_cli, write_settings
from tests.test_job_run import _events, _experiment, _wait_ended


def _wait_output(app, m, job: str, text: str) -> None:
    for _ in range(600):
        if text in jobs.output(app, m, job).decode():
            return
        time.sleep(0.05)
    raise AssertionError(f"{job} never wrote {text!r}")


def test_a_failed_setup_says_setup_and_logs_exits_with_its_code(home, tmp_path):
    cfg = write_settings(home)
    path = _experiment(tmp_path, name="su", setup="echo preparing; exit 4", run="echo never")
    up = run_cli("--config", str(cfg), "up", str(path))
    assert up.returncode == 1 and "preparing\n" in up.stdout and "never" not in up.stdout
    assert "setup exited 4: su stopped, compute billing ended" in up.stdout, up.stdout
    logs = run_cli("--config", str(cfg), "logs", "su")
    assert logs.returncode == 4 and logs.stdout == "preparing\n"
    assert "job run: setup exited 4" in logs.stderr
    st = run_cli("--config", str(cfg), "status", "su")
    assert "job run  setup exited 4 at" in st.stdout, st.stdout


def test_the_setup_failure_is_in_the_event_and_on_finish_why(app, tmp_path):
    exp = load_experiment(_experiment(tmp_path, setup="exit 5", run="echo never"))
    m = machines.up(app, exp).machine
    job = _wait_ended(app, "job")
    assert (job.exit_code, job.stage, job.said, job.code) == (5, "setup", "setup exited 5", 5)
    [ended] = _events(app, m.id, "job-finished")
    assert ended.detail == {"job": "run", "exit_code": 5, "stage": "setup"}
    [stopped] = _events(app, m.id, "stopped")
    assert stopped.detail["why"] == "setup exited 5; on_finish: stop"


def test_the_output_is_kept_with_the_state_and_read_with_the_machine_gone(home, tmp_path):
    cfg = write_settings(home)
    path = _experiment(
        tmp_path, name="gone", run="echo hello; exit 2", lifecycle={"on_finish": "terminate"}
    )
    up = run_cli("--config", str(cfg), "up", str(path))
    assert up.returncode == 1 and "run exited 2: gone terminated" in up.stdout, up.stdout
    shutil.rmtree(home / "machines")  # nothing of the machine is left
    logs = run_cli("--config", str(cfg), "logs", "gone")
    assert logs.returncode == 2 and logs.stdout == "hello\n", logs.stderr
    assert "job run: exited 2 (attempt 1, ended" in logs.stderr


def test_a_long_output_keeps_its_last_bytes_and_says_so(app, tmp_path, monkeypatch):
    monkeypatch.setattr(joblogs, "KEEP_BYTES", 8)
    exp = _experiment(tmp_path, run="echo 0123456789; echo tail", lifecycle={"on_finish": "keep"})
    m = machines.up(app, load_experiment(exp)).machine
    _wait_ended(app, "job")
    [kept] = joblogs.kept(app, m, "run")
    assert (kept.text, kept.size, kept.truncated) == (b"89\ntail\n", 16, True)
    assert joblogs.note(kept) == (
        "the last 8 of its 16 bytes, as kept with the state (at most 8 bytes are kept)"
    )
    machines.down(app, "job")
    shutil.rmtree(app.provider("sandbox").machine_dir(m.instance_id))
    read = job_control.read(app, "job", "run")
    assert (read.data, read.note, read.code) == (b"89\ntail\n", joblogs.note(kept), 0)


def test_every_attempt_keeps_its_own_log(app, clock, tmp_path):
    run = 'n=$(cat n 2>/dev/null || echo 0); n=$((n + 1)); echo $n > n; echo "attempt $n"; '
    run += "sleep 600"
    m = machines.up(app, load_experiment(_experiment(tmp_path, run=run))).machine
    _wait_output(app, m, "run", "attempt 1")
    sandbox = app.provider("sandbox")
    clock.advance(timedelta(minutes=5))
    sandbox.preempt(machines.ref(m))
    machines.reconcile(app)
    machines.restart(app, jobs.named(app, "job"))
    _wait_output(app, m, "run", "attempt 2")

    first = job_control.read(app, "job", "run", attempt=1)
    assert first.data == b"attempt 1\n" and first.code == 137  # killed with its machine
    assert first.end.startswith("killed with its machine (attempt 1, ended ")
    now = job_control.read(app, "job", "run")
    assert now.data == b"attempt 2\n" and not now.ended and now.code == 0
    assert job_control.read(app, "job", "run", attempt=2).data == b"attempt 2\n"
    with pytest.raises(UserError, match="no attempt 3 kept \\(kept: 1; the current one is 2\\)"):
        job_control.read(app, "job", "run", attempt=3)
    [killed] = _events(app, m.id, "job-finished")  # the first attempt's end, seen at the start
    assert killed.reason == "killed" and killed.detail == {"job": "run", "exit_code": None}

    job_control.cancel(app, "job", ["run"], grace=5)
    assert [(r.attempt, r.reason) for r in joblogs.kept(app, m, "run")] == [
        (1, "killed"),
        (2, "cancelled"),
    ]


def test_a_run_that_ended_unseen_before_a_preemption_is_not_run_again(app, clock, tmp_path):
    exp = _experiment(tmp_path, run="echo done once", lifecycle={"on_finish": "keep"})
    m = machines.up(app, load_experiment(exp)).machine
    for _ in range(600):  # it ends on the machine; nobody looks before the machine is taken
        if jobs.state(app, m, "run").exit_code is not None:
            break
        time.sleep(0.05)
    clock.advance(timedelta(minutes=5))
    app.provider("sandbox").preempt(machines.ref(m))
    machines.reconcile(app)
    machines.restart(app, jobs.named(app, "job"))
    assert len(_events(app, m.id, "job-started")) == 1  # not run again
    [ended] = _events(app, m.id, "job-finished")
    assert ended.reason == "exited" and ended.detail == {"job": "run", "exit_code": 0}
    assert not jobs.run_due(app, jobs.named(app, "job"))
    assert job_control.read(app, "job", "run").data == b"done once\n"


def test_the_workdir_taken_at_up_is_what_a_restart_and_a_relaunch_restore(app, clock, tmp_path):
    from provisioner.jobs import reconcile as reconcile_job
    from provisioner.jobs import recover

    work = tmp_path / "project"
    work.mkdir()
    (work / "msg").write_text("as at up\n")
    exp = _experiment(
        tmp_path,
        workdir="project",
        run="cat msg; sleep 600",
        lifecycle={"on_preemption": "relaunch"},
    )
    old = machines.up(app, load_experiment(exp)).machine
    _wait_output(app, old, "run", "as at up")
    (work / "msg").write_text("edited on the laptop since\n")
    sandbox = app.provider("sandbox")

    clock.advance(timedelta(hours=1))
    sandbox.preempt(machines.ref(old))
    sandbox.inject(capacity={old.zone: 0})  # no room in place: a new machine
    clock.advance(timedelta(minutes=5))
    reconcile_job.run(app)
    [done] = recover.run(app).actions
    assert (done.action, done.done) == ("relaunch", True), done
    new = jobs.named(app, "job")
    assert new.id != old.id
    _wait_output(app, new, "run", "\n")
    assert jobs.output(app, new, "run") == b"as at up\n"  # not the folder as it is now
    # the first machine's attempt is kept, and read from its replacement's name
    first = job_control.read(app, "job", "run", attempt=1)
    assert first.data == b"as at up\n" and first.end.startswith("killed with its machine")
    assert job_control.read(app, "job", "run").data == b"as at up\n"
    machines.down(app, "job")


def test_sync_takes_the_workdir_again(app, tmp_path):
    from provisioner.machines import workdirs

    work = tmp_path / "project"
    work.mkdir()
    (work / "msg").write_text("one\n")
    exp = _experiment(tmp_path, workdir="project", run="sleep 600", lifecycle={"on_finish": "keep"})
    m = machines.up(app, load_experiment(exp)).machine
    kept = workdirs.kept(app, m)
    assert kept is not None and (kept.files, kept.source) == (1, str(work))
    (work / "two").write_text("two\n")
    assert jobs.sync(app, "job")[0] == 2
    again = workdirs.kept(app, m)
    assert again is not None and again.files == 2
    with workdirs.restored(again) as (folder, files):
        assert files == ["msg", "two"] and (Path(folder) / "two").read_text() == "two\n"
    machines.down(app, "job")


def test_a_run_that_ended_is_not_run_again_on_the_machine_that_replaces_its_own(
    app, clock, tmp_path
):
    from provisioner.jobs import reconcile as reconcile_job
    from provisioner.jobs import recover

    exp = _experiment(
        tmp_path,
        run="echo finished",
        lifecycle={"on_finish": "keep", "on_preemption": "relaunch"},
    )
    old = machines.up(app, load_experiment(exp)).machine
    assert _wait_ended(app, "job").exit_code == 0
    sandbox = app.provider("sandbox")
    clock.advance(timedelta(hours=1))
    sandbox.preempt(machines.ref(old))
    sandbox.inject(capacity={old.zone: 0})  # no room in place: a new machine
    clock.advance(timedelta(minutes=5))
    reconcile_job.run(app)
    [done] = recover.run(app).actions
    assert (done.action, done.done) == ("relaunch", True), done
    new = jobs.named(app, "job")
    assert new.id != old.id and _events(app, new.id, "job-started") == []  # not run again
    [ended] = _events(app, new.id, "job-finished")
    assert ended.detail == {"job": "run", "exit_code": 0, "ended_on": old.id}
    assert not jobs.run_due(app, new)
    read = job_control.read(app, "job", "run")
    assert (read.data, read.code) == (b"finished\n", 0) and read.end.startswith("exited 0")
    machines.down(app, "job")


def test_a_stop_keeps_the_output_of_jobs_still_running(app, tmp_path):
    exp = _experiment(tmp_path, run="echo working; sleep 600", lifecycle={"on_finish": "keep"})
    m = machines.up(app, load_experiment(exp)).machine
    _wait_output(app, m, "run", "working")
    machines.stop(app, "job")
    [kept] = joblogs.kept(app, m, "run")
    assert (kept.attempt, kept.reason, kept.text) == (1, "killed", b"working\n")
    shutil.rmtree(app.provider("sandbox").machine_dir(m.instance_id))  # its disk out of reach
    read = job_control.read(app, "job", "run")
    assert (read.data, read.code) == (b"working\n", 137)
