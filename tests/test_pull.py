"""The pull (issue #32, point 3): idle known without a public endpoint. The scheduler reads each
machine's agent report over SSH with the team's pull key, restricted on the machine to that one
command, and `provisioner sweep` stops a machine idle out of hours with no
``scheduler.endpoint_url`` set (a team running the sweep from cron behind NAT).

An AWS machine (moto behind the wire-level emulator) whose public address the emulator reads as
127.0.0.1, where a real sshd listens (as tests/test_remote_jobs.py). Its authorized_keys holds
the pull key's line as the startup data writes it (``restrict,command="…"``), the forced command
pointing at :data:`REPORT_FIXTURE`: until the agent's own ``--report`` lands (h-agent), a small
script prints a report of the contract's shape from a prepared state dir (the lead switches
the line to ``provisioner-agent --report --state-dir D`` at merge, under ``faketime`` for the
test's clock). Test knobs, not product behaviour: ``$PROVISIONER_SSH_COMMAND`` adds
``-p PORT -l USER``."""

from __future__ import annotations

import getpass
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select

from provisioner import catalog, heartbeats, keys, machines, startup
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.machines import jobs, pull
from provisioner.machines.record import record_event
from provisioner.models import Event, Heartbeat, Machine
from provisioner.spec import load_experiment
from tests.conftest import run_cli, sandbox_experiment, write_settings, write_yaml
from tests.emulators.aws import AwsEmulator, aws_emulator
from tests.sshd import NO_SSHD, SSHD, free_port, run_sshd

pytestmark = [
    pytest.mark.slow,  # moto, a real sshd and the CLI end to end
    pytest.mark.skipif(SSHD is None or shutil.which("ssh") is None, reason=NO_SSHD),
]

LAUNCH = datetime(2026, 11, 2, 18, 0, tzinfo=UTC)  # a Monday, 18:00 UTC
NIGHT = datetime(2026, 11, 2, 21, 0, tzinfo=UTC)  # the same evening, out of hours
POLICY = """
name: nights
off_hours: {timezone: UTC, windows: [{days: mon-fri, start: "20:00", end: "08:00"}]}
idle: {gpu_util_below: 10, for_minutes: 30}
"""

#: The report as the contract has it, from a state dir: ``now`` (the machine's clock, the
#: test's), ``samples.jsonl``, ``jobs.json``, ``guard.json``, ``stop.json``; ``raw`` printed as
#: is instead (a machine answering nonsense). ``--since`` read from $SSH_ORIGINAL_COMMAND.
REPORT_FIXTURE = """\
import json, os, re, sys
d = sys.argv[sys.argv.index("--state-dir") + 1]
def read(name, default=None):
    p = os.path.join(d, name)
    return json.load(open(p)) if os.path.exists(p) else default
if os.path.exists(os.path.join(d, "raw")):
    sys.stdout.buffer.write(open(os.path.join(d, "raw"), "rb").read())
    sys.exit(0)
asked = os.environ.get("SSH_ORIGINAL_COMMAND", "")
m = re.fullmatch(r"--report --since (\\d{4}-\\d\\d-\\d\\dT\\d\\d:\\d\\d:\\d\\dZ)", asked)
since = m.group(1) if m else ""
samples = []
if os.path.exists(os.path.join(d, "samples.jsonl")):
    for line in open(os.path.join(d, "samples.jsonl")):
        s = json.loads(line)
        if s["at"] > since:
            samples.append(s)
guard = read("guard.json")
print(json.dumps({"v": 1, "machine": guard["machine"], "at": open(os.path.join(d, "now")).read(),
                  "boot": "b1", "samples": samples, "jobs": read("jobs.json", {}),
                  "guard": guard, "stop": read("stop.json")}))
with open(os.path.join(d, "asked.log"), "a") as f:
    f.write(asked + "\\n")
"""


def iso(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


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


class Fleet:
    """One AWS machine launched with no endpoint, its sshd admitting only the pull key's
    restricted line, and its agent's state dir."""

    def __init__(self, app: App, cfg: Path, m: Machine, state: Path, port: int, sshd_dir: Path):
        self.app, self.cfg, self.m, self.state = app, cfg, m, state
        self.port, self.sshd_dir = port, sshd_dir

    def samples(self, start: datetime, end: datetime, util: float, step: int = 30) -> None:
        lines, at = [], start
        while at <= end:
            lines.append(
                {
                    "at": iso(at),
                    "gpus": [{"index": 0, "util": util, "mem_used_mb": 100}],
                    "gpu_error": None,
                    "ssh": 0,
                    "jobs_running": [],
                }
            )
            at += timedelta(seconds=step)
        with (self.state / "samples.jsonl").open("a") as f:
            f.writelines(json.dumps(x) + "\n" for x in lines)

    def clock(self, at: datetime) -> None:
        self.app.clock.set(at)  # type: ignore[attr-defined]
        (self.state / "now").write_text(iso(at))

    def pulled(self) -> int:
        with self.app.db.session() as s:
            return int(
                s.scalar(
                    select(func.count())
                    .select_from(Heartbeat)
                    .where(Heartbeat.machine_id == self.m.id, Heartbeat.pulled.is_(True))
                )
                or 0
            )

    def status(self) -> str:
        with self.app.db.session() as s:
            row = s.get(Machine, self.m.id)
            assert row is not None
            return str(row.status)

    def sweep(self, at: datetime) -> subprocess.CompletedProcess[str]:
        return run_cli("--config", str(self.cfg), "sweep", now=at)


@pytest.fixture
def fleet(emu, sshd, home, tmp_path, monkeypatch) -> Iterator[Fleet]:
    port, d = sshd
    user = tmp_path / "user"
    (user / ".ssh").mkdir(parents=True, mode=0o700)
    monkeypatch.setenv("HOME", str(user))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.setenv("PROVISIONER_SSH_COMMAND", f"ssh -p {port} -l {getpass.getuser()}")
    (tmp_path / "nights.yaml").write_text(POLICY)
    options = {"endpoint": emu.endpoint_url, "retry_base_seconds": 0.001}
    policies = [str(tmp_path / "nights.yaml")]
    cfg = write_settings(home, clouds={"aws": options}, policies=policies)
    from tests.conftest import make_settings

    app = App(make_settings(home, clouds={"aws": options}, policies=policies), ManualClock(LAUNCH))
    assert app.settings.scheduler.endpoint_url is None  # behind NAT: nothing reaches us
    catalog.refresh(app.settings, "aws", app.provider("aws").fetch_offers())
    spec = write_yaml(
        tmp_path / "box.yaml",
        sandbox_experiment("box", gpu="T4:1", clouds=["aws"], market="reserved"),
    )
    m = machines.up(app, load_experiment(spec)).machine
    machines.reconcile(app)
    with app.db.session() as s:
        m = s.get(Machine, m.id)
    assert m is not None and m.status == "running" and m.public_ip == "127.0.0.1"

    # the machine: its agent's state dir, and the pull key's line as the startup data writes it
    state = tmp_path / "agent-state"
    state.mkdir()
    (state / "guard.json").write_text(json.dumps({"v": 1, "machine": m.id}))
    script = tmp_path / "report.py"
    script.write_text(REPORT_FIXTURE)
    published = keys.published_pull_key(app)
    assert published is not None
    line = startup.pull_line(published)
    assert line.startswith(
        'restrict,command="/usr/local/bin/provisioner-agent --report" ssh-ed25519 '
    )
    here = f"{sys.executable} {script} --report --state-dir {state}"
    (d / "authorized_keys").write_text(line.replace(startup.AGENT_BIN + " --report", here) + "\n")
    f = Fleet(app, cfg, m, state, port, d)
    f.clock(LAUNCH)
    yield f
    app.close()


def test_up_publishes_one_team_pull_key_and_records_it_on_the_machine(fleet):
    app, m = fleet.app, fleet.m
    path = keys.pull_path(app)
    assert path.stat().st_mode & 0o777 == 0o600
    published = keys.published_pull_key(app)
    assert published == path.with_name("pull_ed25519.pub").read_text().strip()
    assert keys.pull_public_key(app) == published  # made once, then read
    with app.db.session() as s:
        launched = s.scalars(
            select(Event.detail).where(Event.machine_id == m.id, Event.kind == "launched")
        ).one()
    assert launched[keys.PULL_DETAIL] == keys.fingerprint(published)
    assert published.split()[1] not in json.dumps(launched)  # a fingerprint, not the key


def test_sweep_with_no_endpoint_stops_a_machine_its_pulled_samples_show_idle_out_of_hours(
    fleet, emu
):
    """(a) Out-of-hours idle stop behind NAT: no endpoint, `provisioner sweep` alone."""
    fleet.samples(LAUNCH + timedelta(minutes=1), NIGHT, util=3)
    fleet.clock(NIGHT)
    r = fleet.sweep(NIGHT)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "box: stop [off-hours-idle]" in r.stdout, r.stdout
    assert fleet.status() == "stopped"
    state = emu.client("ec2").describe_instances(InstanceIds=[fleet.m.instance_id])
    assert state["Reservations"][0]["Instances"][0]["State"]["Name"] == "stopped"
    assert fleet.pulled() == 179 * 2 + 1  # every sample from 18:01 to 21:00, once
    # one SSH call, asking from the machine's launch (nothing held yet)
    asked = (fleet.state / "asked.log").read_text().splitlines()
    assert asked == [f"--report --since {iso(LAUNCH)}"]


def test_busy_samples_keep_the_machine_and_each_pass_asks_only_for_what_is_new(fleet):
    fleet.samples(LAUNCH + timedelta(minutes=1), NIGHT - timedelta(minutes=20), util=3)
    fleet.samples(NIGHT - timedelta(minutes=19, seconds=30), NIGHT, util=85)
    fleet.clock(NIGHT)
    r = fleet.sweep(NIGHT)
    assert r.returncode == 0, r.stderr
    assert "stop [off-hours-idle]" not in r.stdout
    assert fleet.status() == "running"
    held = fleet.pulled()
    assert held == 359

    # the next pass: one SSH call per machine, for the samples since the newest held
    later = NIGHT + timedelta(minutes=5)
    fleet.samples(NIGHT + timedelta(seconds=30), later, util=85)
    fleet.clock(later)
    result = pull.pull_all(fleet.app)
    assert (result.ssh_calls, result.samples, result.problems) == (1, 10, [])
    assert fleet.pulled() == held + 10
    asked = (fleet.state / "asked.log").read_text().splitlines()
    assert asked[-1] == f"--report --since {iso(NIGHT)}"


def test_a_job_end_in_the_report_is_the_job_event_on_finish_reads(fleet):
    record_event(fleet.app, fleet.m.id, jobs.STARTED, detail={"job": "run", "command": "train"})
    (fleet.state / "jobs.json").write_text(json.dumps({"run": "exit 3", "exec-1": "running"}))
    fleet.samples(LAUNCH, LAUNCH + timedelta(minutes=2), util=90)
    fleet.clock(LAUNCH + timedelta(minutes=2))
    result = pull.pull_all(fleet.app)
    assert result.job_ends == [("box", "run", "exit 3")]
    run = jobs.jobs_of(fleet.app, fleet.m)["run"]
    assert (run.running, run.exit_code, run.reason) == (False, 3, "exited")
    fleet.clock(LAUNCH + timedelta(minutes=4))
    again = pull.pull_all(fleet.app)
    assert (again.ssh_calls, again.job_ends) == (1, [])  # recorded once


def test_a_guard_stop_names_the_job_it_ended(fleet):
    record_event(fleet.app, fleet.m.id, jobs.STARTED, detail={"job": "run", "command": "train"})
    at = LAUNCH + timedelta(minutes=3)
    stop = {
        "at": iso(at),
        "reason": "max-lifetime",
        "action": "stop",
        "detail": "max_lifetime 3m reached",
        "jobs_ended": {"run": "SIGTERM"},
    }
    (fleet.state / "stop.json").write_text(json.dumps(stop))
    (fleet.state / "jobs.json").write_text(json.dumps({"run": "running"}))
    fleet.clock(at)
    result = pull.pull_all(fleet.app)
    assert [(n, j) for n, j, _ in result.job_ends] == [("box", "run")]
    run = jobs.jobs_of(fleet.app, fleet.m)["run"]
    assert (run.running, run.reason) == (False, "killed")
    with fleet.app.db.session() as s:
        [guard] = s.scalars(
            select(Event).where(Event.machine_id == fleet.m.id, Event.kind == pull.GUARD_STOP)
        ).all()
    assert guard.reason == "max-lifetime" and guard.detail["jobs_ended"] == {"run": "SIGTERM"}


def test_the_pull_key_reads_the_report_and_nothing_else(fleet):
    """(b) `ssh … id` gets the report (the forced command), a pty and port forwarding are
    refused."""
    argv = pull.ssh_argv(fleet.app, fleet.m, keys.pull_path(fleet.app), NIGHT)[:-3]
    target = pull.Remote(fleet.app, fleet.m).target
    fleet.clock(LAUNCH + timedelta(minutes=1))
    done = subprocess.run([*argv, target, "id"], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["machine"] == fleet.m.id and "uid=" not in done.stdout.decode()

    # a pty: refused (OpenSSH gives up: nothing interactive, nothing run)
    plain = pull.Remote(fleet.app, fleet.m).ssh_argv(keys.pull_path(fleet.app))  # no -T, and
    # no ClearAllForwardings: this client asks for them
    done = subprocess.run([*plain, "-tt", target, "id"], capture_output=True, timeout=60)
    assert b"PTY allocation request failed" in done.stderr, done.stderr
    assert b"uid=" not in done.stdout

    # remote forwarding: refused at once
    done = subprocess.run(
        [
            *plain,
            "-o",
            "ExitOnForwardFailure=yes",
            "-N",
            "-R",
            f"{free_port()}:127.0.0.1:22",
            target,
        ],
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 255 and b"forwarding failed" in done.stderr, done.stderr

    # local forwarding to the sshd itself: the channel is refused, no byte of its banner comes
    lport = free_port()
    fwd = subprocess.Popen(
        [*plain, "-N", "-L", f"{lport}:127.0.0.1:{fleet.port}", target],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        got = b""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", lport), timeout=5) as c:
                    c.settimeout(5)
                    got = c.recv(64)
                break
            except ConnectionRefusedError:  # the listener is not up yet
                time.sleep(0.1)
            except (TimeoutError, ConnectionResetError):
                break
        else:
            raise AssertionError("ssh -L never listened")
        assert not got.startswith(b"SSH-"), got
    finally:
        fwd.kill()
        fwd.wait()


def test_a_malformed_or_huge_report_is_one_line_and_nothing_stored(fleet):
    """(c)"""

    def report(at: datetime, **fields: object) -> bytes:
        doc = {"v": 1, "machine": fleet.m.id, "at": iso(at), "samples": [], "jobs": {}}
        return json.dumps({**doc, **fields}).encode()

    bad_util = [{"at": iso(NIGHT), "gpus": [{"index": 0, "util": 250}]}]
    cases = [
        (lambda at: b"not json{", "not JSON"),
        (lambda at: b" " * (pull.MAX_REPORT_BYTES + 10) + b"{}", "over 4 MB"),
        (lambda at: report(at, machine="m-other"), "it answers as another machine ('m-other')"),
        (lambda at: report(at, samples=bad_util), "a GPU's util must be a number from 0 to 100"),
        (
            lambda at: report(at, jobs={"run": "done"}),
            'a job state must be "running", "exit N" or "lost"',
        ),
        (
            lambda at: report(at + timedelta(hours=2)),
            "its clock is 7200 s off ours (at most 300 s)",
        ),
        (
            lambda at: report(at, samples=[{"at": "yesterday", "gpus": []}]),
            "a sample's at is not an ISO 8601 UTC time",
        ),
    ]
    at = NIGHT
    for raw, said in cases:
        at += pull.fresh_within(fleet.app)  # asked again: a pass later
        fleet.clock(at)
        (fleet.state / "raw").write_bytes(raw(at))
        result = pull.pull_all(fleet.app)
        assert result.lines == [f"box: pull [refused] — report refused: {said}"], result.lines
    assert fleet.pulled() == 0

    # through the sweep: one line, no traceback, the machine left running (idle not known)
    (fleet.state / "raw").write_bytes(b"[1, 2")
    r = fleet.sweep(at)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert [ln for ln in r.stdout.splitlines() if "report refused" in ln] == [
        "  box: pull [refused] — report refused: not JSON"
    ]
    assert fleet.status() == "running"


def test_a_machine_that_does_not_answer_is_could_not_ask_never_idle(fleet, monkeypatch):
    """(d)"""
    fleet.samples(LAUNCH + timedelta(minutes=1), NIGHT, util=3)  # idle, were it asked
    fleet.clock(NIGHT)
    monkeypatch.setenv("PROVISIONER_SSH_COMMAND", f"ssh -p {free_port()} -l {getpass.getuser()}")
    r = fleet.sweep(NIGHT)
    assert r.returncode == 0, r.stderr
    [line] = [ln for ln in r.stdout.splitlines() if "pull [" in ln]
    assert line.startswith("  box: pull [could not ask] — could not ask over SSH (")
    assert "Connection refused" in line
    assert "stop [off-hours-idle]" not in r.stdout
    assert fleet.status() == "running" and fleet.pulled() == 0


def test_machines_heard_from_the_endpoint_are_not_pulled(fleet):
    fleet.clock(NIGHT)
    heartbeats.record(fleet.app, fleet.m.id, [{"index": 0, "util": 50.0}], ssh_sessions=0)
    result = pull.pull_all(fleet.app)
    assert (result.fresh, result.ssh_calls) == (1, 0)
    assert not (fleet.state / "asked.log").exists()
    # silent past two agent periods: pulled again
    fleet.clock(
        NIGHT + timedelta(seconds=2 * fleet.app.settings.scheduler.agent_interval_seconds + 1)
    )
    result = pull.pull_all(fleet.app)
    assert (result.fresh, result.ssh_calls) == (0, 1)


def test_a_host_without_the_private_half_says_so_once_and_goes_on(fleet):
    path = keys.pull_path(fleet.app)
    path.rename(path.with_name("elsewhere"))
    fleet.clock(NIGHT)
    result = pull.pull_all(fleet.app)
    assert result.ssh_calls == 0
    [line] = result.lines
    assert line.startswith("this host: pull [no key] — no private half of the team's pull key (")
    r = fleet.sweep(NIGHT)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert sum("no private half" in ln for ln in r.stdout.splitlines()) == 1
    assert keys.published_pull_key(fleet.app) is not None  # never replaced by another pair


def test_a_reconcile_and_a_sweep_in_one_run_ask_each_machine_once(fleet):
    """`provisioner sweep` runs reconcile, then the sweep (h-sweep): one SSH call per machine
    per run, and the sweep judges on the samples the reconcile pulled."""
    from provisioner.jobs import reconcile, sweep

    fleet.samples(LAUNCH + timedelta(minutes=1), NIGHT, util=3)
    fleet.clock(NIGHT)
    reconciled = reconcile.run(fleet.app)
    assert reconciled.pulls == []
    swept = sweep.run(fleet.app)
    assert [(a.machine, a.action, a.reason) for a in swept.actions] == [
        ("box", "stop", "off-hours-idle")
    ]
    assert len((fleet.state / "asked.log").read_text().splitlines()) == 1
