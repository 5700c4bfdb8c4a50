"""Cancel (issue #34, point 3) on the sandbox: `cancel NAME JOB|--all` sends TERM to the job's
processes, KILL after the grace, records the end as ``cancelled`` (by whom), keeps its output,
and the ``run`` cancelled gets its ``on_finish`` as any end of it."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from provisioner import machines
from provisioner.errors import UserError
from provisioner.machines import joblogs, jobs
from provisioner.spec import load_experiment
from provisioner.workflows import job_control
from tests.conftest import run_cli, sandbox_experiment, write_settings, write_yaml
from tests.test_job_logs import _wait_output
from tests.test_job_run import _events, _experiment


def _pid(app, m, job: str) -> int:
    home = app.provider("sandbox").machine_dir(m.instance_id)
    return int((home / "jobs" / job / "pid").read_text())


def _gone(pgid: int) -> bool:
    """No live process of the group (a zombie no one reaps in a container is dead)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return False
    return True


def test_cancel_the_run_terms_it_records_who_and_on_finish_stops_the_machine(app, tmp_path):
    run = "trap 'echo got TERM; exit 0' TERM; echo started; while :; do sleep 0.1; done"
    m = machines.up(app, load_experiment(_experiment(tmp_path, run=run))).machine
    _wait_output(app, m, "run", "started")

    done = job_control.cancel(app, "job", ["run"], grace=30)
    assert [(j.id, j.end, j.code) for j in done.jobs] == [("run", "cancelled", 143)]
    [ended] = _events(app, m.id, "job-finished")
    assert ended.reason == "cancelled"
    assert ended.detail == {"job": "run", "exit_code": None, "cancelled_by": app.actor}
    # on_finish (stop, the default with a run) acted as for any end of the run
    [stopped] = _events(app, m.id, "stopped")
    assert stopped.reason == "on-finish"
    assert stopped.detail["why"] == "run cancelled; on_finish: stop"
    assert jobs.named(app, "job").status == "stopped"
    # the job had its TERM (its trap ran), and its output is kept with the state
    [kept] = joblogs.kept(app, m, "run")
    assert kept.reason == "cancelled" and kept.text.startswith(b"started\n")
    assert kept.text.endswith(b"got TERM\n")
    assert jobs.jobs_of(app, jobs.named(app, "job"))["run"].text.startswith("cancelled at")


def test_a_job_that_ignores_term_is_killed_after_the_grace_and_the_machine_keeps_running(
    app, tmp_path
):
    exp = _experiment(tmp_path, run="sleep 600", lifecycle={"on_finish": "keep"})
    m = machines.up(app, load_experiment(exp)).machine
    job = jobs.exec_job(app, "job", "trap '' TERM; echo deaf; sleep 600")
    _wait_output(app, m, job, "deaf")
    pid = _pid(app, m, job)

    done = job_control.cancel(app, "job", [job], grace=0.2)
    assert [j.id for j in done.jobs] == [job] and done.actions[0].action == "record"
    assert _gone(pid)  # the KILL after the grace: no process of the job is left
    assert jobs.jobs_of(app, m)[job].reason == "cancelled"
    assert jobs.jobs_of(app, m)["run"].running  # only the job named
    assert jobs.named(app, "job").status == "running"  # an exec job's end stops nothing
    # cancelling a job that ended says so and changes nothing
    again = job_control.cancel(app, "job", [job], grace=0.2)
    assert again.jobs == [] and len(_events(app, m.id, "job-finished")) == 1


def test_cancel_on_the_command_line(home, tmp_path):
    cfg = write_settings(home)
    path = _experiment(tmp_path, name="cq", run="sleep 600", lifecycle={"on_finish": "keep"})
    assert run_cli("--config", str(cfg), "up", str(path), "--detach").returncode == 0
    for command in ("sleep 600", "sleep 700"):
        assert run_cli("--config", str(cfg), "exec", "cq", "--", command).returncode == 0

    neither = run_cli("--config", str(cfg), "cancel", "cq")
    assert neither.returncode == 2 and "name the jobs to cancel, or --all" in neither.stderr
    missing = run_cli("--config", str(cfg), "cancel", "cq", "exec-9")
    assert missing.returncode == 2 and "no job 'exec-9' (its jobs: run, exec-1, exec-2)" in (
        missing.stderr
    )
    one = run_cli("--config", str(cfg), "cancel", "cq", "exec-2", "--grace", "1")
    assert one.returncode == 0 and one.stdout == "cq: job exec-2 cancelled\n", one.stderr
    logs = run_cli("--config", str(cfg), "logs", "cq", "--job", "exec-2")
    assert logs.returncode == 143 and "job exec-2: cancelled" in logs.stderr

    every = run_cli("--config", str(cfg), "cancel", "cq", "--all", "--grace", "1")
    assert every.returncode == 0, every.stderr
    assert every.stdout.splitlines() == [
        "cq: job run cancelled",
        "cq: job exec-1 cancelled",
    ]  # on_finish: keep — the machine keeps running
    st = run_cli("--config", str(cfg), "status", "cq")
    assert "running" in st.stdout and "job run     cancelled at" in st.stdout

    assert run_cli("--config", str(cfg), "stop", "cq").returncode == 0
    stopped = run_cli("--config", str(cfg), "cancel", "cq", "--all")
    assert stopped.returncode == 2 and "cq is stopped: its jobs ended with it" in stopped.stderr


def test_cancel_names_a_machine_that_exists(app):
    with pytest.raises(UserError, match="no machine named 'nope'"):
        job_control.cancel(app, "nope", None)


# --- the queue: jobs ask for GPUs and wait their turn ----------------------------------------


def _devices(app, m, job: str) -> str:
    _wait_output(app, m, job, "gpus=")
    return jobs.output(app, m, job).decode().split("gpus=", 1)[1].split()[0]


def _four(tmp_path, name: str = "job", **fields: object):
    """An experiment on a sandbox machine with 4 GPUs."""
    spec = sandbox_experiment(name, gpu="T4:4") | fields
    return write_yaml(tmp_path / f"{name}.yaml", spec)


SHOW = 'echo "gpus=${CUDA_VISIBLE_DEVICES:-none}"; sleep 600'


def test_jobs_wait_for_the_gpus_they_ask_first_come_first_served(app, tmp_path):
    from provisioner.machines import gpuqueue

    exp = load_experiment(_four(tmp_path))  # no run: the GPUs are free
    m = machines.up(app, exp).machine
    assert gpuqueue.total(m) == 4
    assert gpuqueue.submit(app, "job", SHOW, 2) == ("exec-1", True)
    assert gpuqueue.submit(app, "job", SHOW, 3) == ("exec-2", False)  # 2 free: it waits
    assert gpuqueue.submit(app, "job", SHOW, 1) == ("exec-3", False)  # behind exec-2
    assert gpuqueue.submit(app, "job", SHOW, 0) == ("exec-4", True)  # asks none: never waits
    assert _devices(app, m, "exec-1") == "0,1" and _devices(app, m, "exec-4") == "none"
    [queued] = _events(app, m.id, "job-queued")[:1]
    assert queued.detail == {"job": "exec-2", "command": SHOW, "gpus": 3}
    assert [(r.job, r.state, r.gpus) for r in gpuqueue.listing(app, "job")] == [
        ("exec-1", "running", "0,1"),
        ("exec-4", "running", "-"),
        ("exec-2", "queued", "3 (asked)"),
        ("exec-3", "queued", "1 (asked)"),
    ]
    with pytest.raises(UserError, match="job has 4 GPUs: a job cannot ask for 5"):
        gpuqueue.submit(app, "job", SHOW, 5)

    # exec-1's end frees its GPUs: exec-2 then exec-3 start, in their order
    done = job_control.cancel(app, "job", ["exec-1"], grace=5)
    assert [a.why for a in done.actions if a.reason == "queued"] == [
        "job exec-2 started: its GPUs are free",
        "job exec-3 started: its GPUs are free",
    ]
    assert _devices(app, m, "exec-2") == "0,1,2" and _devices(app, m, "exec-3") == "3"
    assert gpuqueue.queued(app, m) == []
    machines.down(app, "job")


def test_the_run_holds_every_gpu_and_a_queued_job_starts_when_it_ends(app, tmp_path):
    from provisioner.machines import gpuqueue

    exp = _four(tmp_path, run="sleep 600", lifecycle={"on_finish": "keep"})
    m = machines.up(app, load_experiment(exp)).machine
    assert gpuqueue.submit(app, "job", SHOW, 1) == ("exec-1", False)
    assert gpuqueue.listing(app, "job")[0].gpus == "all"
    dropped = gpuqueue.submit(app, "job", SHOW, 4)[0]
    assert job_control.cancel(app, "job", [dropped]).dropped == [dropped]  # never started
    job_control.cancel(app, "job", ["run"], grace=5)  # on_finish: keep; the GPUs are free
    assert _devices(app, m, "exec-1") == "0"
    assert [e.detail["job"] for e in _events(app, m.id, "job-started")] == ["run", "exec-1"]
    machines.down(app, "job")


def test_queue_and_exec_gpus_on_the_command_line(home, tmp_path):
    cfg = write_settings(home)
    path = _four(tmp_path, "gq")
    assert run_cli("--config", str(cfg), "up", str(path), "--detach").returncode == 0
    first = run_cli("--config", str(cfg), "exec", "gq", "--gpus", "4", "--", "sleep 600")
    assert first.returncode == 0 and first.stdout == "exec-1\n"
    second = run_cli("--config", str(cfg), "exec", "gq", "--gpus", "2", "--", "sleep 1")
    assert second.returncode == 0 and second.stdout == "exec-2\n"
    assert "queued exec-2 on gq: it starts when 2 GPUs are free" in second.stderr
    waits = run_cli("--config", str(cfg), "logs", "gq", "--job", "exec-2")
    assert waits.returncode == 2 and "job exec-2 is queued: it starts when 2 GPUs" in waits.stderr
    listed = run_cli("--config", str(cfg), "queue", "gq")
    assert listed.returncode == 0
    assert [line.split()[:3] for line in listed.stdout.splitlines()] == [
        ["JOB", "STATE", "GPUS"],
        ["exec-1", "running", "0,1,2,3"],
        ["exec-2", "queued", "2"],
    ], listed.stdout
    as_json = run_cli("--config", str(cfg), "queue", "gq", "-o", "json")
    assert [j["state"] for j in json.loads(as_json.stdout)["jobs"]] == ["running", "queued"]
    too_many = run_cli("--config", str(cfg), "exec", "gq", "--gpus", "8", "--", "true")
    assert too_many.returncode == 2 and "gq has 4 GPUs" in too_many.stderr
    every = run_cli("--config", str(cfg), "cancel", "gq", "--all", "--grace", "1")
    assert every.stdout.splitlines() == [
        "gq: job exec-2 cancelled (it was queued)",
        "gq: job exec-1 cancelled",
    ]
    assert run_cli("--config", str(cfg), "down", "gq").returncode == 0
