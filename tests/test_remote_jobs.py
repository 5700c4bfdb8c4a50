"""The experiment's job on a CLOUD machine over SSH (issue #24, points 1–3 and 8, the cloud path):
an AWS machine (moto behind the wire-level emulator) whose public address the emulator reads
as 127.0.0.1, where a real sshd listens; the job runner reaches it with OpenSSH and rsync as a
user's machine would be reached, with the key ``up`` chose from ``~/.ssh``.

Test knobs, not product behaviour: ``$PROVISIONER_SSH_COMMAND`` adds ``-p PORT -l USER`` (the
sshd's port, the user it admits, as a user would with a non-standard port), and
``$PROVISIONER_REMOTE_HOME`` keeps the "machine's" home in the test's folder."""

from __future__ import annotations

import base64
import contextlib
import getpass
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from providers.userdata import decoded, parts
from provisioner import catalog, machines
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.jobs import finish, recover
from provisioner.machines import jobs
from provisioner.models import Event, Machine
from provisioner.spec import load_experiment
from provisioner.startup import SUPERVISOR_PATH, supervisor_script
from tests.conftest import make_settings, run_cli, sandbox_experiment, write_settings, write_yaml
from tests.emulators.aws import AwsEmulator, aws_emulator
from tests.sshd import NO_SSHD, SSHD, free_port, run_sshd

pytestmark = [
    pytest.mark.slow,  # moto, a real sshd, rsync and the CLI end to end
    pytest.mark.skipif(
        SSHD is None or shutil.which("ssh") is None or shutil.which("rsync") is None,
        reason=NO_SSHD + "; rsync",
    ),
]

NOW = datetime(2026, 11, 2, 9, 0, tzinfo=UTC)


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    yield from run_sshd(tmp_path)


@pytest.fixture
def emu(monkeypatch: pytest.MonkeyPatch) -> Iterator[AwsEmulator]:
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    with aws_emulator() as e:
        e.public_address = "127.0.0.1"
        yield e


@pytest.fixture
def machine_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The cloud machine's home (where its jobs and workdir live)."""
    h = tmp_path / "machine-home"
    h.mkdir()
    monkeypatch.setenv("PROVISIONER_REMOTE_HOME", str(h))
    yield h
    for pid in (h / ".provisioner" / "jobs").glob("*/pid"):  # a job left running: ended
        with contextlib.suppress(OSError, ValueError):
            os.killpg(int(pid.read_text()), signal.SIGKILL)


@pytest.fixture
def user_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sshd) -> Path:
    """The user's own ~/.ssh/id_ed25519, the only key the sshd admits."""
    port, d = sshd
    home = tmp_path / "user"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    key = home / ".ssh" / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    (d / "authorized_keys").write_text(key.with_suffix(".pub").read_text())
    monkeypatch.setenv("PROVISIONER_SSH_COMMAND", f"ssh -p {port} -l {getpass.getuser()}")
    return key


def _app(home: Path, emu: AwsEmulator) -> tuple[App, dict]:
    options = {"endpoint": emu.endpoint_url, "retry_base_seconds": 0.001}
    app = App(make_settings(home, clouds={"aws": options}), ManualClock(NOW))
    catalog.refresh(app.settings, "aws", app.provider("aws").fetch_offers())
    return app, options


def _workdir(tmp_path: Path) -> Path:
    work = tmp_path / "project"
    (work / "data").mkdir(parents=True)
    (work / "train.sh").write_text('echo "greeting=$GREETING in $(basename "$(pwd)")"\n')
    (work / "model.ckpt").write_text("big\n")
    (work / "data" / "set.bin").write_text("big\n")
    (work / ".gitignore").write_text("*.ckpt\ndata/\n")
    return work


def _spec(tmp_path: Path, name: str, market: str = "spot", **fields: object) -> Path:
    spec = sandbox_experiment(name, gpu="T4:1", clouds=["aws"], market=market)
    spec.update(fields)
    return write_yaml(tmp_path / f"{name}.yaml", spec)


def _until(what, timeout_polls: int = 400):
    for _ in range(timeout_polls):
        got = what()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("never happened")


def _events(app: App, machine_id: str, kind: str) -> list[Event]:
    with app.db.session() as s:
        return list(
            s.scalars(
                select(Event)
                .where(Event.machine_id == machine_id, Event.kind == kind)
                .order_by(Event.id)
            )
        )


def test_a_cloud_machine_runs_the_experiment_over_ssh_and_stops_when_it_ends(
    emu, sshd, user_key, machine_home, home, tmp_path
):
    app, options = _app(home, emu)
    work = _workdir(tmp_path)
    spec = _spec(
        tmp_path,
        "train",
        market="reserved",
        workdir=str(work),
        setup="echo set-up >> ../setup.log",
        run="sh train.sh; while [ ! -e go ]; do sleep 0.1; done; echo done; exit 3",
        env={"GREETING": "it's me"},
    )
    exp = load_experiment(spec)
    m = machines.up(app, exp).machine
    assert m.cloud == "aws" and m.status == "pending"
    assert jobs.jobs_of(app, m) == {}  # no address yet: the job is due, not failed
    assert _events(app, m.id, "job-failed") == []
    cfg = write_settings(home, clouds={"aws": options})
    r = run_cli("--config", str(cfg), "logs", "train")
    assert r.returncode == 2 and "run has not started: it starts once" in r.stderr, r.stderr

    machines.reconcile(app)  # the cloud says running, at its address
    actions = finish.check(app)
    assert [(a.machine, a.action) for a in actions] == [("train", "start-job")]
    m = jobs.named(app, "train")
    assert m.public_ip == "127.0.0.1"
    assert jobs.jobs_of(app, m)["run"].running

    # the workdir went over by rsync, less what .gitignore names
    copied = machine_home / "workdir"
    assert sorted(p.name for p in copied.iterdir()) == [".gitignore", "train.sh"]
    # the supervisor was pushed (the machine had none: the emulator ran no startup data)
    pushed = machine_home / ".provisioner" / "bin" / "provisioner-job"
    assert pushed.read_text() == supervisor_script()

    # the job is its own session: the SSH connection that started it is gone, it runs on
    pid = int((machine_home / ".provisioner" / "jobs" / "run" / "pid").read_text())
    assert os.getsid(pid) == pid
    out = _until(lambda: jobs.output(app, m, "run"))
    assert out == b"greeting=it's me in workdir\n"
    assert (machine_home / "setup.log").read_text() == "set-up\n"  # once, before the run

    # exec: another detached job with the experiment's env; `logs --job` reads it
    assert jobs.exec_job(app, "train", 'echo "exec says $GREETING"') == "exec-1"
    _until(lambda: not jobs.state(app, m, "exec-1").running)
    r = run_cli("--config", str(cfg), "logs", "train", "--job", "exec-1")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "exec says it's me\n"
    assert "job exec-1: exited 0" in r.stderr
    r = run_cli("--config", str(cfg), "logs", "train", "--tail", "1")
    assert r.returncode == 0 and r.stdout == "greeting=it's me in workdir\n", r.stderr

    # sync: the workdir again, what changed, .gitignore still honoured
    (work / "train.sh").write_text("echo v2\n")
    (work / "eval.sh").write_text("echo eval\n")
    (work / "data" / "more.bin").write_text("big\n")
    r = run_cli("--config", str(cfg), "sync", "train")
    assert r.returncode == 0, r.stderr
    assert f"copied 3 files of {work} to train" in r.stdout
    assert (copied / "train.sh").read_text() == "echo v2\n"
    assert (copied / "eval.sh").exists() and not (copied / "data").exists()

    # a machine that does not answer: "could not ask", never "ended"
    os.environ["PROVISIONER_SSH_COMMAND"] = f"ssh -p {free_port()} -l {getpass.getuser()}"
    try:
        [skip] = finish.check(app)
    finally:
        os.environ["PROVISIONER_SSH_COMMAND"] = f"ssh -p {sshd[0]} -l {getpass.getuser()}"
    assert skip.action == "skip" and "could not ask" in skip.why
    assert jobs.jobs_of(app, m)["run"].running

    # logs -f follows until the run exits; on_finish (stop, the default with a run) ends billing
    follow = subprocess.Popen(
        [*run_cli_argv(cfg), "logs", "train", "-f"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **_clock_env()},
    )
    assert follow.stdout is not None
    first = follow.stdout.readline()  # following: the job still waits for `go`
    (copied / "go").touch()
    rest, stderr = follow.communicate(timeout=120)
    stdout = first + rest
    assert follow.returncode == 3, stderr  # the job's own exit code
    assert stdout == "greeting=it's me in workdir\ndone\n"
    assert "job run: exited 3" in stderr
    m = jobs.named(app, "train")
    assert m.status == "stopped"
    [stopped] = _events(app, m.id, "stopped")
    assert stopped.reason == "on-finish" and stopped.detail["exit_code"] == 3
    state = emu.client("ec2").describe_instances(InstanceIds=[m.instance_id])
    assert state["Reservations"][0]["Instances"][0]["State"]["Name"] == "stopped"
    assert (machine_home / "setup.log").read_text() == "set-up\n"  # once

    # its output was kept with the state when it ended: read with the machine stopped
    r = run_cli("--config", str(cfg), "logs", "train")
    assert r.returncode == 3 and r.stdout == "greeting=it's me in workdir\ndone\n", r.stderr
    assert "job run: exited 3 (attempt 1, ended" in r.stderr
    app.close()


def run_cli_argv(cfg: Path) -> list[str]:
    import sys

    return [sys.executable, "-m", "provisioner", "--config", str(cfg)]


def _clock_env() -> dict[str, str]:
    from provisioner.clock import CLOCK_ENV

    return {CLOCK_ENV: NOW.isoformat()}


def test_up_on_a_cloud_waits_for_ssh_runs_the_job_follows_it_and_stops_the_machine(
    emu, sshd, user_key, machine_home, home, tmp_path
):
    """The README's loop on a cloud, through the CLI: `up` says which key, waits for the
    machine to answer SSH, copies the workdir, starts `run`, shows its output as it comes, and
    stops the machine when it exits (on_finish: stop, the default with a run)."""
    _, options = _app(home, emu)
    cfg = write_settings(home, clouds={"aws": options})
    work = _workdir(tmp_path)
    spec = _spec(tmp_path, "loop", market="reserved", workdir=str(work), run="sh train.sh")
    spec.write_text(spec.read_text() + "env: {GREETING: hi}\n")
    up = run_cli("--config", str(cfg), "up", str(spec), "--wait-timeout", "120")
    assert up.returncode == 0, up.stderr
    assert "key: ~/.ssh/id_ed25519.pub" in up.stderr
    assert "copied 2 files of" in up.stderr
    assert "greeting=hi in workdir\n" in up.stdout
    assert "run exited 0: loop stopped, compute billing ended" in up.stdout.replace("\n", " ")
    status = run_cli("--config", str(cfg), "status", "loop", "--no-refresh")
    assert "stopped" in status.stdout, status.stderr


def test_a_detached_job_survives_its_ssh_client_being_killed(
    emu, sshd, user_key, machine_home, home, tmp_path
):
    """An `exec` started while a user's interactive SSH session is open: killing that client
    (a dropped laptop connection) leaves the job running; its output is all there."""
    app, _ = _app(home, emu)
    m = machines.up(app, load_experiment(_spec(tmp_path, "box", market="reserved"))).machine
    machines.reconcile(app)
    m = jobs.named(app, "box")
    from provisioner.machines.remote import Remote

    session = subprocess.Popen(
        [*Remote(app, m).ssh_argv(), f"x@{m.public_ip}", "sleep 300"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    job = jobs.exec_job(app, "box", "for i in 1 2 3 4 5; do echo tick $i; sleep 0.2; done")
    session.send_signal(signal.SIGKILL)
    session.wait(timeout=10)
    _until(lambda: not jobs.state(app, m, job).running)
    assert jobs.state(app, m, job).exit_code == 0
    assert jobs.output(app, m, job) == b"".join(b"tick %d\n" % i for i in range(1, 6))
    app.close()


def test_run_starts_again_after_a_preempted_machine_is_relaunched(
    emu, sshd, user_key, machine_home, home, tmp_path
):
    app, _ = _app(home, emu)
    spec = _spec(
        tmp_path,
        "spot",
        market="spot",
        run="echo started >> ../starts.log; sleep 300",
        lifecycle={"on_preemption": "relaunch"},
    )
    first = machines.up(app, load_experiment(spec)).machine
    machines.reconcile(app)
    finish.check(app)
    _until(lambda: (machine_home / "starts.log").exists())

    emu.preempt(first.instance_id, first.region)  # one-time spot: EC2 terminates it
    machines.reconcile(app)
    [done] = recover.run(app).actions
    assert done.action == "relaunch" and done.done, done
    machines.reconcile(app)  # the new machine's address
    [started] = finish.check(app)
    assert started.action == "start-job"
    second = jobs.named(app, "spot")
    assert second.id != first.id and jobs.jobs_of(app, second)["run"].running
    # it runs detached (`start` returns at once): what it wrote is there once it wrote it
    _until(lambda: (machine_home / "starts.log").read_text().count("started") > 1)
    assert (machine_home / "starts.log").read_text() == "started\nstarted\n"
    app.close()


def test_run_starts_again_when_its_machine_is_started_again_in_place(
    emu, sshd, user_key, machine_home, home, tmp_path
):
    """The restart a preempted machine gets where its cloud kept it (GCP, Azure, Yandex): a
    ``run`` killed with the machine is due again, and starts once the machine answers SSH; one
    that ended (here: cancelled, through provisioner-job's TERM) is not run again."""
    app, _ = _app(home, emu)
    spec = _spec(tmp_path, "box", market="reserved", run="echo started >> ../starts.log; sleep 300")
    m = machines.up(app, load_experiment(spec)).machine
    machines.reconcile(app)
    finish.check(app)
    _until(lambda: (machine_home / "starts.log").exists())
    app.clock.advance(timedelta(minutes=5))
    machines.stop(app, "box")
    job = machine_home / ".provisioner" / "jobs" / "run"
    os.killpg(int((job / "pid").read_text()), signal.SIGKILL)  # as the halt would: the
    (job / "boot").write_text("an earlier boot\n")  # emulated machine is this host, not rebooted

    app.clock.advance(timedelta(minutes=5))
    machines.restart(app, jobs.named(app, "box"))
    [due] = _events(app, m.id, jobs.DUE)
    assert due.reason == "preempted"
    # the second start runs detached: its output is there once it wrote it
    _until(lambda: (machine_home / "starts.log").read_text().count("started") > 1)
    assert (machine_home / "starts.log").read_text() == "started\nstarted\n"
    [killed] = _events(app, m.id, "job-finished")  # the first attempt, seen before the second
    assert killed.reason == "killed"
    assert finish.check(app) == [] or not jobs.run_due(app, m)  # started once, not again

    from provisioner.workflows import job_control

    done = job_control.cancel(app, "box", ["run"], grace=1)
    assert [(j.id, j.reason) for j in done.jobs] == [("run", "cancelled")]
    assert jobs.named(app, "box").status == "stopped"  # on_finish: stop, as for any end
    app.clock.advance(timedelta(minutes=5))
    machines.restart(app, jobs.named(app, "box"))
    assert len(_events(app, m.id, jobs.DUE)) == 1 and not jobs.run_due(app, m)
    assert (machine_home / "starts.log").read_text() == "started\nstarted\n"  # not again
    app.close()


def test_a_start_the_machine_refuses_is_an_event_and_not_retried_every_pass(
    emu, sshd, user_key, machine_home, home, tmp_path, monkeypatch
):
    app, _ = _app(home, emu)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder\n")
    monkeypatch.setenv("PROVISIONER_REMOTE_HOME", str(blocked))  # nowhere to keep a job
    m = machines.up(app, load_experiment(_spec(tmp_path, "box", run="true"))).machine
    machines.reconcile(app)
    [failed, ended] = finish.check(app)
    assert failed.action == "record" and "could not start its job" in failed.why
    # it would bill with nothing to run: on_finish (stop, with a run) acts as at a run's end —
    # here a terminate: a spot machine AWS cannot stop
    assert (ended.action, ended.done) == ("terminate", True), ended
    assert ended.why == "its run could not start; on_finish: stop"
    with app.db.session() as s:
        assert s.get(Machine, m.id).status not in ("running", "pending")
    [event] = _events(app, m.id, "job-failed")
    assert event.detail["job"] == "run"
    assert finish.check(app) == []  # the scheduler leaves it; the event says why
    assert len(_events(app, m.id, "job-failed")) == 1
    app.close()


def test_the_supervisor_comes_over_ssh_not_in_the_startup_data(emu, home, tmp_path):
    """AWS gets the agent in its user data, not the supervisor: the first SSH call pushes it
    (above), so EC2's 16 KB go to the agent and the user's own script (docs/LIMITS.md)."""
    app, _ = _app(home, emu)
    machines.up(app, load_experiment(_spec(tmp_path, "job", run="python train.py")))
    [params] = [c.params for c in emu.calls("RunInstances")]
    data = decoded(base64.b64decode(params["UserData"]))
    [script] = [text for kind, text in parts(data) if kind == "x-shellscript"]
    assert "/usr/local/bin/provisioner-agent --state-dir" in script
    assert SUPERVISOR_PATH not in script and supervisor_script() not in script
    app.close()


def test_autostop_changed_later_reaches_the_machines_own_guard(
    emu, sshd, user_key, machine_home, home, tmp_path
):
    """`provisioner autostop NAME 30m` / `--cancel` on a running cloud machine: its agent, which
    enforces the autostop itself (issue #32), reads the new one at its next tick."""
    from provisioner.agent_guard import effective
    from provisioner.jobs import autostop as auto

    app, _ = _app(home, emu)
    spec = _spec(tmp_path, "guarded", market="reserved", lifecycle={"autostop": "10m"})
    machines.up(app, load_experiment(spec))
    m = machines.wait_ready(app, "guarded", timeout=60)
    guard = {"autostop_s": 600, "jobs_dir": str(machine_home / ".provisioner" / "jobs")}
    m, st = auto.set_autostop(app, "guarded", "30m")
    assert auto.tell_machine(app, m, st) is None
    told = machine_home / ".provisioner" / "autostop.json"
    assert json.loads(told.read_text()) == {"autostop_s": 1800}
    assert effective(guard)["autostop_s"] == 1800
    m, st, _had = auto.cancel_autostop(app, "guarded")
    assert auto.tell_machine(app, m, st) is None
    assert effective(guard)["autostop_s"] is None  # cancelled: the machine no longer stops
    app.close()
