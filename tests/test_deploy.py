"""The deployment files in configs/deploy/ run as shipped, as far as a container allows.

- Each systemd unit passes ``systemd-analyze verify`` and ``security --offline``; then its
  ``ExecStart=`` runs as written under ``bwrap`` with the unit's sandboxing emulated (root file
  system read-only but the ``StateDirectory=``, ``ProtectHome=`` hiding /home and /root, a
  private /tmp, the unit's ``User=``, the environment systemd and the unit give, nothing else).
  No PID 1 runs here, so what the kernel enforces for systemd alone (system call filter, address
  families, namespaces, …) is checked by ``systemd-analyze`` only: every directive is either
  emulated or named in ``KERNEL_ONLY``, so a new one is never taken on trust unnoticed.
- The crontab line runs with ``sh -c`` in the environment cron gives, as an ordinary user who
  can write nothing but their home.
- The CronJob validates against the Kubernetes schema (offline, ``kubernetes-validate``), and
  its container's command runs as the pod spec writes it: its user, its environment, a
  read-only root with the emptyDirs and the Secret mounted where it says.

Each runs the sandbox cloud, on SQLite and on PostgreSQL, with a launched machine the sweep
stops; nothing needs credentials.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, TEST_START
from tests.sshd import NO_SSHD, SSHD, free_port, run_sshd
from tests.unitbox import Unit, as_user, bwrap, code_mounts, environment, system_user

DEPLOY = ROOT / "configs" / "deploy"
UNITS = ("provisioner-sweep.service", "provisioner-scheduler.service")
#: the installed console script: where the units and the pod expect `provisioner`, this one is
#: mounted (the package as `pip install` would put it, from the tree under test)
CONSOLE_SCRIPT = Path(sys.executable).with_name("provisioner")
#: Added to every sandboxed environment, for the test only: the tree under test first (as
#: pyproject's pythonpath does for pytest; an editable install points there anyway), and the
#: test's clock (house rule: no wall clock).
TEST_ENV = {"PYTHONPATH": str(ROOT)}
LATER = TEST_START + timedelta(hours=1)
#: A policy under which the launched machine, silent, is idle out of hours at any time: the sweep
#: must stop it, which proves it read the state and acted on the cloud.
NIGHTS = "name: nights\noff_hours: {timezone: UTC, weekends: mon-sun}\n"
NIGHTS += "idle: {unknown_counts_as_idle: true}\n"
EXPERIMENT = "name: exp\nproject: demo\nresources:\n  gpu: T4:1\n  market: spot\n"
EXPERIMENT += "  clouds: [sandbox]\n  disk_gb: 50\n"

needs_bwrap = pytest.mark.skipif(not shutil.which("bwrap"), reason="bubblewrap not installed")
needs_systemd = pytest.mark.skipif(
    not shutil.which("systemd-analyze"), reason="systemd-analyze not installed"
)


# --- unit files ------------------------------------------------------------------------------


EMULATED = {
    "Type", "User", "Group", "StateDirectory", "StateDirectoryMode", "Environment",
    "EnvironmentFile", "ExecStart", "UMask", "ProtectSystem", "ProtectHome", "PrivateTmp",
    "PrivateDevices", "NoNewPrivileges", "CapabilityBoundingSet", "AmbientCapabilities",
    "ReadWritePaths", "ExecReload", "KillSignal", "Restart", "RestartSec", "TimeoutStopSec",
}  # fmt: skip
#: ... and those the kernel enforces for systemd only (seccomp, namespaces, /proc options):
#: `systemd-analyze verify` parses them and `security` scores them; no container runs them.
KERNEL_ONLY = {
    "RestrictSUIDSGID", "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
    "ProtectControlGroups", "ProtectClock", "ProtectHostname", "ProtectProc", "RestrictNamespaces",
    "RestrictRealtime", "LockPersonality", "RestrictAddressFamilies", "SystemCallArchitectures",
    "SystemCallFilter", "RemoveIPC", "PrivateMounts",
}  # fmt: skip


@pytest.mark.parametrize("name", UNITS)
def test_each_unit_is_sandboxed_with_its_own_writable_state_directory(name):
    unit = Unit(DEPLOY / name)
    assert unit.keys() <= EMULATED | KERNEL_ONLY, unit.keys() - EMULATED - KERNEL_ONLY
    assert unit.get("ProtectSystem") == "strict" and unit.get("ProtectHome") == "true"
    assert unit.get("PrivateTmp") == unit.get("NoNewPrivileges") == "true"
    assert unit.all("CapabilityBoundingSet") == [""]  # no capability at all
    assert unit.get("StateDirectory") == "provisioner"
    env = environment(unit)
    assert env["PROVISIONER_HOME"] == env["HOME"] == "/var/lib/provisioner"
    assert not unit.all("ReadWritePaths")  # the state dir is writable by StateDirectory= alone


@needs_systemd
def test_systemd_analyze_verifies_the_units_and_scores_their_exposure_low(tmp_path):
    """Verified as shipped, then with ExecStart's binary pointing at this venv's console script:
    `verify` checks the binary exists, and the package is not installed in /usr/local here."""
    shipped, runnable = tmp_path / "shipped", tmp_path / "runnable"
    names = [*UNITS, "provisioner-sweep.timer"]
    for d in (shipped, runnable):
        d.mkdir()
        for name in names:
            text = (DEPLOY / name).read_text()
            if d is runnable:
                text = text.replace("/usr/local/bin/provisioner", str(CONSOLE_SCRIPT))
            (d / name).write_text(text)
    run = [
        "systemd-analyze",
        "verify",
        "--man=no",
        *(str(runnable / n) for n in names),
    ]
    r = subprocess.run(run, capture_output=True, text=True, env={**os.environ, "TZ": "UTC"})
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr  # an unknown key only warns
    r = subprocess.run(
        [*run[:3], *(str(shipped / n) for n in names)], capture_output=True, text=True
    )
    complaints = {line for line in r.stderr.splitlines() if line.strip()}
    assert complaints == {
        f"{n}: Command /usr/local/bin/provisioner is not executable: No such file or directory"
        for n in UNITS
        if not Path("/usr/local/bin/provisioner").exists()
    }  # as shipped, nothing is wrong but the binary this machine lacks
    for name in UNITS:
        r = subprocess.run(
            ["systemd-analyze", "security", "--offline=yes", "--threshold=20", name],
            capture_output=True,
            text=True,
            cwd=runnable,
        )
        score = next(line for line in r.stdout.splitlines() if "Overall exposure" in line)
        assert r.returncode == 0, score  # 2.0 at most of systemd's 10 ("OK")
    r = subprocess.run(
        [
            *("systemd-analyze", "calendar", "--iterations=3", "--base-time=2026-11-02 09:01 UTC"),
            *Unit(DEPLOY / "provisioner-sweep.timer").all("OnCalendar", "Timer"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "TZ": "UTC"},
    )
    assert [line.split(": ", 1)[1] for line in r.stdout.splitlines() if "UTC" in line] == [
        "Mon 2026-11-02 09:05:00 UTC",
        "Mon 2026-11-02 09:10:00 UTC",
        "Mon 2026-11-02 09:15:00 UTC",
    ], r.stdout + r.stderr


# --- the units run --------------------------------------------------------------------------


def settings_yaml(db_url: str | None, **extra: object) -> str:
    data: dict = {"clouds": {"sandbox": {"latency_seconds": 0}}}
    data["policies"] = ["/etc/provisioner/nights.yaml"]
    if db_url:
        data["state_url"] = db_url
    data.update(extra)
    return yaml.safe_dump(data)


def etc_dir(tmp_path: Path, db_url: str | None, mode: int = 0o644, **extra: object) -> Path:
    etc = tmp_path / "etc-provisioner"
    etc.mkdir()
    (etc / "settings.yaml").write_text(settings_yaml(db_url, **extra))
    (etc / "nights.yaml").write_text(NIGHTS)
    (etc / "exp.yaml").write_text(EXPERIMENT)
    for f in etc.iterdir():
        f.chmod(mode)
    return etc


class Service:
    """A unit's ExecStart (or another command line, as an admin's ``systemd-run`` under the
    same settings would) in the unit's emulated sandbox; its state dir is ``state``."""

    def __init__(self, name: str, tmp_path: Path, etc: Path) -> None:
        self.unit = Unit(DEPLOY / name)
        self.etc = etc
        home = f"/var/lib/{self.unit.get('StateDirectory')}"
        self.user = system_user(self.unit.get("User"), home)
        self.state = tmp_path / "state"
        self.state.mkdir()
        if os.getuid() == 0:  # StateDirectory=: made and given to User= before the start
            os.chown(self.state, self.user.pw_uid, self.user.pw_gid)
            for f in etc.iterdir():  # installed as the unit's comment says: root's, its group's
                os.chown(f, 0, self.user.pw_gid)
                f.chmod(0o640)
        self.state.chmod(int(self.unit.get("StateDirectoryMode", "0755"), 8))
        self.argv0 = shlex.split(self.unit.get("ExecStart"))[0]

    def argv(self, command: list[str] | None = None, *, own_pids: bool = True) -> list[str]:
        u = self.unit
        mounts = [("/proc", "proc", ""), ("/dev", "dev", "")]  # PrivateDevices=: a minimal /dev
        mounts.append((f"/var/lib/{u.get('StateDirectory')}", "bind", str(self.state)))
        mounts.append(("/etc/provisioner", "ro-bind", str(self.etc)))
        mounts.append((self.argv0, "ro-bind", str(CONSOLE_SCRIPT)))
        if u.get("PrivateTmp") == "true":
            mounts += [("/tmp", "tmpfs", ""), ("/var/tmp", "tmpfs", "")]
        hide = ("/home", "/root", "/run/user") if u.get("ProtectHome") == "true" else ()
        assert u.get("ProtectSystem") == "strict"  # the only mode emulated: all but these ro
        box = bwrap([*mounts, *code_mounts()], hide=hide, own_pids=own_pids)
        line = command or shlex.split(u.get("ExecStart"))
        umask = ["sh", "-c", f'umask {u.get("UMask", "0022")} && exec "$@"', "sh"]
        return [*box, *as_user(self.user.pw_uid, self.user.pw_gid), *umask, *line]

    def env(self, at: datetime = LATER) -> dict[str, str]:
        """What systemd gives a system service with User= (systemd.exec(5), "Environment
        Variables in Spawned Processes"), then the unit's own, then the test's."""
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin",
            "USER": self.user.pw_name,
            "LOGNAME": self.user.pw_name,
            "HOME": self.user.pw_dir,
            "SHELL": self.user.pw_shell,
            "INVOCATION_ID": uuid.uuid4().hex,
            "STATE_DIRECTORY": f"/var/lib/{self.unit.get('StateDirectory')}",
        }
        clock = {"PROVISIONER_CLOCK": at.isoformat()}
        return {**env, **environment(self.unit, self.etc), **TEST_ENV, **clock}

    def run(
        self, command: list[str] | None = None, at: datetime = LATER
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.argv(command), capture_output=True, text=True, env=self.env(at),
            timeout=180,
        )  # fmt: skip


def statuses(run, *argv: str) -> dict[str, str]:
    r = run([*argv, "status", "--output", "json", "--no-refresh"])
    assert r.returncode == 0, r.stderr
    return {m["name"]: m["status"] for m in json.loads(r.stdout)}


@needs_bwrap
def test_the_sweep_unit_runs_as_shipped_in_its_sandbox(tmp_path, db_url):
    svc = Service("provisioner-sweep.service", tmp_path, etc_dir(tmp_path, db_url))
    up = svc.run([svc.argv0, "up", "/etc/provisioner/exp.yaml"], at=TEST_START)
    assert up.returncode == 0, up.stderr
    r = svc.run()  # ExecStart= as written
    assert r.returncode == 0, r.stderr
    assert "exp: stop [off-hours-idle]" in r.stdout, r.stdout
    assert statuses(svc.run, svc.argv0) == {"exp": "stopped"}
    # its state in the state dir (SQLite) or the database, all it wrote owned by its user
    made = {p.relative_to(svc.state).as_posix() for p in svc.state.rglob("*")}
    assert "sandbox.db" in made and ("state.db" in made) == (not db_url)
    machines = svc.state / "machines"  # the sandbox cloud's machines: their disks, not its files
    for p in svc.state.rglob("*"):
        assert p.stat().st_uid == svc.user.pw_uid
        if machines not in p.parents:  # (a machine's agent keeps its samples 0644, as on a cloud)
            assert p.is_dir() or p.stat().st_mode & 0o077 == 0  # UMask=0077


@needs_bwrap
@pytest.mark.skipif(SSHD is None, reason=NO_SSHD)
@pytest.mark.skipif(
    os.getuid() != 0, reason="the unit's user is made (and the sshd admits) as root"
)
def test_ssh_from_the_sweep_unit_keeps_its_files_in_the_state_dir(tmp_path):
    """The sweep reaches machines over SSH (job ends, the pull) with ssh's options as
    provisioner.machines.remote gives them: a key and known_hosts in its home. Under the unit's
    sandbox that home is the state dir, ssh's only writable place; here a real sshd on loopback
    is the machine."""
    sshd = run_sshd(tmp_path)
    port, d = next(sshd)
    try:
        svc = Service("provisioner-sweep.service", tmp_path, etc_dir(tmp_path, None))
        (svc.state / "keys").mkdir()
        shutil.copy(d / "user", svc.state / "keys" / "id_ed25519")
        for p in (svc.state / "keys", svc.state / "keys" / "id_ed25519"):
            os.chown(p, svc.user.pw_uid, svc.user.pw_gid)
        home = svc.env()["PROVISIONER_HOME"]
        ssh = ["ssh", "-i", f"{home}/keys/id_ed25519", "-o", "IdentitiesOnly=yes"]
        ssh += ["-o", f"Port={port}", "-o", "ConnectTimeout=15", "-o", "BatchMode=yes"]
        ssh += ["-o", f"UserKnownHostsFile={home}/known_hosts", "-o", "HostKeyAlias=pv-m1"]
        first = svc.run([*ssh, "-o", "StrictHostKeyChecking=accept-new", "root@127.0.0.1", "id"])
        assert first.returncode == 0 and "uid=0(root)" in first.stdout, first.stderr
        assert (svc.state / "known_hosts").stat().st_uid == svc.user.pw_uid
        again = svc.run([*ssh, "-o", "StrictHostKeyChecking=yes", "root@127.0.0.1", "id"])
        assert again.returncode == 0, again.stderr  # the host key was kept, and is checked
    finally:
        sshd.close()


@needs_bwrap
@pytest.mark.slow  # the scheduler's unit run as a real process
def test_the_scheduler_unit_starts_answers_reloads_and_stops_on_sigterm(tmp_path, db_url):
    port = free_port()
    listen = {"scheduler": {"listen": f"127.0.0.1:{port}", "sweep_interval_seconds": 10}}
    svc = Service("provisioner-scheduler.service", tmp_path, etc_dir(tmp_path, db_url, **listen))
    assert svc.unit.get("Type") == "exec" and svc.unit.get("Restart") == "always"
    read, write = os.pipe()
    argv = svc.argv(own_pids=False)  # its main PID in this namespace, for the signals
    proc = subprocess.Popen(
        [argv[0], "--info-fd", str(write), *argv[1:]],
        env=svc.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=(write,),
    )
    os.close(write)
    try:
        with os.fdopen(read) as info:  # the service's main PID, as systemd would know it
            main_pid = json.loads(info.read())["child-pid"]
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    assert json.loads(r.read()) == {"ok": True}
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()[1].decode()
                time.sleep(0.1)
        else:
            raise AssertionError("the scheduler never answered /healthz")
        # an edited policy, taken up on `systemctl reload` (ExecReload=, SIGHUP) or its next pass
        (svc.etc / "nights.yaml").write_text(NIGHTS.replace("idle: true", "idle: false"))
        reload = shlex.split(svc.unit.get("ExecReload").replace("$MAINPID", str(main_pid)))
        assert subprocess.run(reload).returncode == 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
            assert json.loads(r.read()) == {"ok": True}
    finally:
        os.kill(main_pid, signal.Signals[svc.unit.get("KillSignal", "SIGTERM")])
        _, stderr = proc.communicate(timeout=int(svc.unit.get("TimeoutStopSec", "90")))
    assert proc.returncode == 0, stderr.decode()
    assert "reload (" in stderr.decode() and "failed" not in stderr.decode(), stderr.decode()
    assert ("state.db" in os.listdir(svc.state)) == (not db_url)


# --- the crontab -----------------------------------------------------------------------------


def crontab() -> tuple[dict[str, str], str, str]:
    """(its variables, the schedule, the command) of the crontab's one job line."""
    variables, jobs = {}, []
    for line in (DEPLOY / "crontab").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, eq, value = line.partition("=")
        if eq and name.strip().isidentifier():
            variables[name.strip()] = value.strip()
        else:
            jobs.append(line.split(None, 5))
    assert len(jobs) == 1
    *when, command = jobs[0]
    return variables, " ".join(when), command


@needs_bwrap
def test_the_crontab_line_runs_as_a_user_and_logs_in_their_home(tmp_path, db_url):
    variables, when, command = crontab()
    assert when == "*/5 * * * *"
    assert "%" not in command  # cron would cut the line there (crontab(5))
    user = system_user("provisioner-cron", "/home/provisioner-cron", shell="/bin/sh")
    home = tmp_path / "cron-home"
    (home / ".config" / "provisioner").mkdir(parents=True)
    (home / ".config" / "provisioner" / "settings.yaml").write_text(
        settings_yaml(db_url, policies=[f"{user.pw_dir}/nights.yaml"])
    )
    (home / "nights.yaml").write_text(NIGHTS)
    (home / "exp.yaml").write_text(EXPERIMENT)
    (home / ".local" / "bin").mkdir(parents=True)  # where pipx puts the command
    (home / ".local" / "bin" / "provisioner").symlink_to(CONSOLE_SCRIPT)
    if os.getuid() == 0:
        for p in [home, *home.rglob("*")]:
            os.lchown(p, user.pw_uid, user.pw_gid)
    # the user can write their home, nothing else; cron's environment (crontab(5): SHELL=/bin/sh,
    # PATH=/usr/bin:/bin, HOME and LOGNAME from /etc/passwd), then the crontab's variables
    box = bwrap(
        [
            *(("/proc", "proc", ""), ("/dev", "dev", ""), ("/tmp", "tmpfs", "")),
            *((user.pw_dir, "bind", str(home)), *code_mounts()),
        ]
    )
    env = {"SHELL": "/bin/sh", "PATH": "/usr/bin:/bin", "HOME": user.pw_dir}
    env |= {"LOGNAME": user.pw_name, **variables, **TEST_ENV}

    def run(line: str, at) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*box, *as_user(user.pw_uid, user.pw_gid), "/bin/sh", "-c", line],
            capture_output=True, text=True, timeout=180,
            env={**env, "PROVISIONER_CLOCK": at.isoformat()},
        )  # fmt: skip

    up = run('"$HOME/.local/bin/provisioner" up "$HOME/exp.yaml"', TEST_START)
    assert up.returncode == 0, up.stderr
    r = run(command, LATER)
    assert r.returncode == 0 and not r.stdout and not r.stderr, r.stdout + r.stderr
    log = (home / ".local" / "state" / "provisioner" / "sweep.log").read_text()
    assert "exp: stop [off-hours-idle]" in log, log
    assert ("state.db" in os.listdir(home / ".local" / "share" / "provisioner")) == (not db_url)
    r = run(command, LATER + timedelta(minutes=5))  # the next pass appends
    assert r.returncode == 0
    again = (home / ".local" / "state" / "provisioner" / "sweep.log").read_text()
    assert again.startswith(log) and again.count("sweep: 1 machine checked") == 2, again


# --- the CronJob -----------------------------------------------------------------------------


def cronjob() -> dict:
    return yaml.safe_load((DEPLOY / "cronjob.yaml").read_text())


@pytest.mark.parametrize("version", ["1.27", "newest"])  # timeZone is GA from 1.27
def test_the_cronjob_is_valid_kubernetes(version):
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    version = latest_version() if version == "newest" else version
    kubernetes_validate.validate(cronjob(), version, strict=True)
    typo = cronjob()
    typo["spec"]["jobTemplate"]["spec"]["template"]["spec"]["securityContext"]["runAsNonroot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):  # strict: an unknown field fails
        kubernetes_validate.validate(typo, version, strict=True)


@needs_bwrap
def test_the_cronjob_pod_runs_its_command_as_written(tmp_path, db_url):
    """The pod as its spec says: its user and fsGroup, a read-only root, the emptyDirs writable
    where mounted, the Secret's files read-only there, the container's env and command. The
    image is stood in for by this machine's root with the package's command on the image's
    PATH (a python image's: /usr/local/bin first)."""
    if not db_url:
        pytest.skip("the CronJob's state is PostgreSQL: a pod's SQLite file dies with it")
    pod = cronjob()["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ctx = {**pod["securityContext"], **container["securityContext"]}
    assert ctx["runAsNonRoot"] and ctx["runAsUser"] != 0 and ctx["readOnlyRootFilesystem"]
    assert not ctx["allowPrivilegeEscalation"] and ctx["capabilities"]["drop"] == ["ALL"]
    uid, gid, fs_group = ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"]
    mounts = [("/proc", "proc", ""), ("/dev", "dev", "")]
    image_path = "/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"
    command = [*container.get("command", []), *container.get("args", [])]
    mounts.append((f"/usr/local/bin/{command[0]}", "ro-bind", str(CONSOLE_SCRIPT)))
    volumes = {v["name"]: v for v in pod["volumes"]}
    for m in container["volumeMounts"]:
        volume, src = volumes[m["name"]], tmp_path / m["name"]
        if "secret" in volume:  # the Secret's keys as files: root's, group fsGroup, defaultMode
            assert volume["secret"]["secretName"] == "provisioner-settings" and m["readOnly"]
            src = etc_dir(tmp_path, db_url, mode=volume["secret"]["defaultMode"])
            for f in [src, *src.iterdir()]:
                if os.getuid() == 0:
                    os.chown(f, 0, fs_group)
        else:  # an emptyDir: new, writable by the pod's group (fsGroup)
            assert "emptyDir" in volume
            src.mkdir()
            if os.getuid() == 0:
                os.chown(src, 0, fs_group)
            src.chmod(0o2777)
        mounts.append((m["mountPath"], "ro-bind" if m.get("readOnly") else "bind", str(src)))
    env = {"PATH": image_path, "HOSTNAME": "provisioner-sweep-x1"}
    env |= {e["name"]: e["value"] for e in container["env"]}
    argv = [*bwrap([*mounts, *code_mounts()]), *as_user(uid, gid, [fs_group]), *command]

    def run(args: list[str], at) -> subprocess.CompletedProcess:
        return subprocess.run(
            args, capture_output=True, text=True, timeout=180,
            env={**env, **TEST_ENV, "PROVISIONER_CLOCK": at.isoformat()},
        )  # fmt: skip

    # a machine launched (by someone, on the shared state) before the run; the same pod's home
    # holds the sandbox cloud here, as a cloud would hold the machine
    up = run([*argv[: -len(command)], command[0], "up", "/etc/provisioner/exp.yaml"], TEST_START)
    assert up.returncode == 0, up.stderr
    r = run(argv, LATER)
    assert r.returncode == 0, r.stderr
    assert "exp: stop [off-hours-idle]" in r.stdout, r.stdout
    status = run(
        [*argv[: -len(command)], command[0], "status", "--output", "json", "--no-refresh"], LATER
    )
    assert {m["name"]: m["status"] for m in json.loads(status.stdout)} == {"exp": "stopped"}
