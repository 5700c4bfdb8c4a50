"""The machine's own guard: what ``provisioner-agent`` samples, keeps and acts on, on the machine,
with no scheduler, no endpoint and no laptop (the design: issue #32, "The guard design").

Its state dir (``--state-dir``, 0755, files 0644, no secrets):

- ``guard.json`` (written by the startup data): the machine's rules: ``autostop_s``, ``idle``
  (``gpu_util_below``, ``gpus_only``), ``on_finish`` (``job``, ``action``), ``max_lifetime_at``,
  ``max_lifetime_action``, ``jobs_dir`` (the supervisor's jobs, see templates/provisioner-job.sh);
- ``samples.jsonl``: one sample a line (GPUs, SSH sessions, jobs running), about the last 24 h;
- ``stop.json``: written just BEFORE the guard powers the machine off: why, what, and each job
  the stop ended (a stop that ends a running job names it: never silent).

Idle means no job running, no SSH session, and every GPU below the threshold — unless
``gpus_only``, when only the GPUs count. The guard acts once per boot: after a stop and a start
by hand, a job that ended in an earlier boot does not stop the machine again.

Standard library only, Python >= 3.8 (it runs on the rented machine, beside ``agent.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Any

UTC = timezone.utc  # noqa: UP017 (datetime.UTC is 3.11+; the machine may have 3.8)

STATE_DIR = "/var/lib/provisioner/agent"
GUARD, SAMPLES, STOP = "guard.json", "samples.jsonl", "stop.json"
KEEP_SECONDS = 24 * 3600  # samples.jsonl holds about this much
SHUTDOWN_CMD = "shutdown -h now"
CLOCK_ENV = "PROVISIONER_CLOCK"  # an ISO instant: the clock starts there (tests, the sandbox)


# --- time ------------------------------------------------------------------------------------


def iso(when: datetime) -> str:
    """``2026-12-07T17:42:59.123Z``: UTC, milliseconds (two samples a second stay apart)."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


_ISO = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d{1,6})?(Z|[+-]00:?00)$")


def parse_iso(text: object) -> datetime | None:
    """A UTC ISO 8601 instant (``Z`` or ``+00:00``, optional fraction); None otherwise."""
    m = _ISO.match(text) if isinstance(text, str) else None
    if not m:
        return None
    try:
        at = datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC)
    except ValueError:
        return None
    frac = m.group(2)
    return at + timedelta(microseconds=int((frac[1:] + "000000")[:6])) if frac else at


def clock_from_env(env=os.environ, wall=time.time):
    """``now()`` as epoch seconds: the wall clock, or one shifted to start at
    ``PROVISIONER_CLOCK`` (the provisioner's own test clock, so a sandbox machine's agent lives
    on the same time as the scheduler that reads it)."""
    start = parse_iso(env.get(CLOCK_ENV, "").strip())
    if start is None:
        return wall
    shift = start.timestamp() - wall()
    return lambda: wall() + shift


# --- the machine ------------------------------------------------------------------------------


class GPUReader:
    """Reads every GPU through NVML; returns ([], reason) when it cannot."""

    def __init__(self) -> None:
        self._nvml: Any = None  # the pynvml module once loaded

    def read(self):  # -> tuple[list[dict], str | None]
        try:
            if self._nvml is None:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            nv = self._nvml
            gpus = []
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                util = nv.nvmlDeviceGetUtilizationRates(h)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                gpus.append(
                    {
                        "index": i,
                        "util": float(util.gpu),
                        "mem_used_mb": round(mem.used / 2**20),
                        "mem_total_mb": round(mem.total / 2**20),
                    }
                )
            return gpus, (None if gpus else "no gpu: NVML sees no device")
        except Exception as e:  # no nvidia-ml-py, no driver, a GPU fell off the bus…
            self._nvml = None
            return [], f"no gpu: {type(e).__name__}: {e}"[:200]


SSH_PORT = 22
TCP_ESTABLISHED = "01"  # the kernel's TCP state numbers: include/net/tcp_states.h


def ssh_sessions(paths=("/proc/net/tcp", "/proc/net/tcp6")):  # -> int | None
    """Established TCP connections to local port 22, counted in the kernel's socket tables
    (``/proc/net/tcp`` and ``tcp6``: local address ``HEX:PORT`` in hex, state ``01``). None
    when neither table can be read (not Linux)."""
    count, read = 0, False
    for path in paths:
        try:
            with open(path, encoding="ascii") as f:
                count += count_ssh(f.read())
            read = True
        except OSError:
            continue
    return count if read else None


def count_ssh(table: str, port: int = SSH_PORT) -> int:
    """The established connections to local ``port`` in one ``/proc/net/tcp*`` table."""
    n = 0
    for line in table.splitlines()[1:]:  # the first line names the columns
        fields = line.split()
        if len(fields) < 4 or ":" not in fields[1]:
            continue
        try:
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
        except ValueError:
            continue
        if local_port == port and fields[3] == TCP_ESTABLISHED:
            n += 1
    return n


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    except OSError:
        return False
    return True


def say(msg: str) -> None:
    """The agent's log: its stderr (the service's journal)."""
    print(msg, file=sys.stderr, flush=True)


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def job_states(jobs_dir: str | None, boot: str, alive=pid_alive) -> dict:
    """Each job the supervisor started: ``running``, ``exit N`` or ``lost`` (ended without a
    code: the machine stopped under it) — what ``provisioner-job state ID`` answers."""
    out: dict = {}
    if not jobs_dir:
        return out
    try:
        names = sorted(os.listdir(jobs_dir))
    except OSError:
        return out
    for name in names:
        d = os.path.join(jobs_dir, name)
        pid = read_text(os.path.join(d, "pid"))
        if not pid:
            continue  # not started (or not a job), or its pid being written this instant
        code = read_text(os.path.join(d, "exit"))
        if code is not None:
            out[name] = f"exit {code}"
        elif pid.isdigit() and read_text(os.path.join(d, "boot")) == boot and alive(int(pid)):
            out[name] = "running"
        else:
            out[name] = "lost"
    return out


def ended_this_boot(jobs_dir: str | None, job: str, boot: str) -> bool:
    """The job wrote its exit code and it started in this boot (not a run of an earlier boot,
    so a machine started again by hand is not stopped again for an old end)."""
    if not jobs_dir:
        return False
    d = os.path.join(jobs_dir, job)
    return (
        read_text(os.path.join(d, "exit")) is not None
        and read_text(os.path.join(d, "boot")) == boot
    )


# --- files -----------------------------------------------------------------------------------


def load_json(path: str):  # -> dict | None
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def write_json(path: str, doc: dict) -> None:
    """Written whole or not at all (a reader never sees half), mode 0644."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, sort_keys=True)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


class Samples:
    """``samples.jsonl``: appended, then cut back to the last ``keep`` lines when it has grown
    a quarter past them."""

    def __init__(self, path: str, keep: int) -> None:
        self.path, self.keep = path, max(keep, 10)
        self.lines = sum(1 for _ in self._iter())

    def _iter(self):
        try:
            with open(self.path, encoding="utf-8") as f:
                yield from f
        except OSError:
            return

    def append(self, sample: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(sample, sort_keys=True) + "\n")
        with contextlib.suppress(OSError):
            os.chmod(self.path, 0o644)
        self.lines += 1
        if self.lines > self.keep + self.keep // 4:
            kept = list(self._iter())[-self.keep :]
            tmp = self.path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)
            self.lines = len(kept)

    def since(self, after: datetime | None) -> list:
        out = []
        for line in self._iter():
            try:
                s = json.loads(line)
            except ValueError:
                continue  # a line cut by a power-off
            at = parse_iso(s.get("at")) if isinstance(s, dict) else None
            if at is not None and (after is None or at > after):
                out.append(s)
        return out


OVERRIDE = "autostop.json"  # beside the jobs dir: `provisioner autostop NAME 30m` writes it


def effective(guard: dict | None):  # -> dict | None
    """``guard.json`` with the owner's later ``provisioner autostop`` applied: the login user's
    ``~/.provisioner/autostop.json`` (``{"autostop_s": N or null}``), written over SSH."""
    if not guard or not guard.get("jobs_dir"):
        return guard
    told = load_json(os.path.join(os.path.dirname(str(guard["jobs_dir"])), OVERRIDE))
    after = (told or {}).get("autostop_s", "absent")
    if after is None or (isinstance(after, int) and not isinstance(after, bool) and after > 0):
        return {**guard, "autostop_s": after}
    return guard


# --- the decision ----------------------------------------------------------------------------


def is_idle(guard: dict, sample: dict) -> bool:
    """No job running, no SSH session, every GPU below the threshold; with ``gpus_only`` the
    GPUs alone. Not known is not idle: unread SSH, or no GPU reading when only GPUs count."""
    rule = guard.get("idle") or {}
    below = _number(rule.get("gpu_util_below"), 5.0)
    gpus = sample.get("gpus") or []
    quiet = all(_number(g.get("util"), 100.0) < below for g in gpus)  # unread: busy
    if rule.get("gpus_only"):
        return bool(gpus) and quiet
    if sample.get("jobs_running") or sample.get("ssh") is None or sample.get("ssh", 0) > 0:
        return False
    return quiet  # no GPU at all: the jobs and SSH say


def _number(value: object, default: float) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok else default  # type: ignore[arg-type]


def _action(value: object, default: str = "stop") -> str:
    return value if value in ("stop", "terminate") else default


def decide(guard: dict, sample: dict, now: datetime, idle_since: datetime | None, ended: bool):
    """The stop due now, as ``(reason, action, detail)``, or None. ``idle_since``: when the
    current idle span began (None: busy now); ``ended``: ``on_finish``'s job ended this boot.
    The order when several are due: on-finish, max-lifetime, autostop."""
    finish = guard.get("on_finish")
    if isinstance(finish, dict) and finish.get("job") and ended:
        job = str(finish["job"])
        return "on-finish", _action(finish.get("action")), f"job {job} ended"
    until = parse_iso(guard.get("max_lifetime_at"))
    if until is not None and now >= until:
        detail = f"max lifetime reached at {iso(until)}"
        return "max-lifetime", _action(guard.get("max_lifetime_action")), detail
    after = guard.get("autostop_s")
    if not isinstance(after, (int, float)) or after <= 0 or idle_since is None:
        return None
    if (now - idle_since).total_seconds() >= after:
        return "autostop", "stop", f"idle since {iso(idle_since)} ({int(after)} s allowed)"
    return None


# --- the guard -------------------------------------------------------------------------------


class Guard:
    """One :meth:`tick` per interval: sample, keep, decide; at most one stop per boot (its
    ``stop.json`` written first, then the shutdown command run once, never looped on)."""

    def __init__(
        self,
        state_dir: str = STATE_DIR,
        guard_file: str | None = None,
        shutdown_cmd: str = SHUTDOWN_CMD,
        interval: float = 30.0,
        *,
        now=time.time,
        boot=boot_id,
        alive=pid_alive,
        run=None,
        log=say,
    ) -> None:
        self.state_dir = state_dir
        self.guard_file = guard_file or os.path.join(state_dir, GUARD)
        self.shutdown_cmd, self.now, self.boot, self.alive, self.log = (
            shutdown_cmd,
            now,
            boot,
            alive,
            log,
        )
        self.run = run or (lambda cmd: subprocess.run(cmd, shell=True, timeout=300).returncode)
        os.makedirs(state_dir, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(state_dir, 0o755)
        self.samples = Samples(os.path.join(state_dir, SAMPLES), int(KEEP_SECONDS / interval))
        self.idle_since: datetime | None = None
        previous = load_json(os.path.join(state_dir, STOP)) or {}
        self.acted = previous.get("boot") == self.boot()  # this boot's stop is done already

    def tick(self, gpus: list, gpu_error: str | None, ssh: int | None):  # -> dict | None
        """The sample taken, kept and judged; the stop document when this tick stopped it."""
        now = datetime.fromtimestamp(self.now(), UTC)
        guard = effective(load_json(self.guard_file)) or {}
        boot = self.boot()
        jobs = job_states(guard.get("jobs_dir"), boot, self.alive)
        sample = {
            "at": iso(now),
            "gpus": [
                {
                    "index": g.get("index"),
                    "util": g.get("util"),
                    "mem_used_mb": g.get("mem_used_mb"),
                }
                for g in gpus
            ],
            "gpu_error": gpu_error,
            "ssh": ssh,
            "jobs_running": sorted(j for j, st in jobs.items() if st == "running"),
        }
        try:
            self.samples.append(sample)
        except OSError as e:
            self.log(f"provisioner-agent: cannot keep a sample: {e}")
        if not guard or self.acted:
            return None
        self.idle_since = (self.idle_since or now) if is_idle(guard, sample) else None
        finish = guard.get("on_finish")
        job = str(finish.get("job") or "") if isinstance(finish, dict) else ""
        ended = bool(job) and ended_this_boot(guard.get("jobs_dir"), job, boot)
        due = decide(guard, sample, now, self.idle_since, ended)
        if due is None:
            return None
        return self.stop(*due, jobs=jobs, at=now, boot=boot)

    def stop(self, reason: str, action: str, detail: str, *, jobs: dict, at: datetime, boot: str):
        """``stop.json`` first (each job still running named in ``jobs_ended``), then the
        shutdown command, once."""
        ended = {j: f"killed by the {reason} stop" for j, st in jobs.items() if st == "running"}
        doc = {
            "at": iso(at),
            "reason": reason,
            "action": action,
            "detail": detail,
            "jobs_ended": ended,
            "boot": boot,
        }
        self.acted = True
        try:
            write_json(os.path.join(self.state_dir, STOP), doc)
        except OSError as e:
            self.log(f"provisioner-agent: cannot write stop.json: {e}")
        self.log(f"provisioner-agent: {reason}: {detail}; running {self.shutdown_cmd!r}")
        try:
            code = self.run(self.shutdown_cmd)
            if code:
                self.log(f"provisioner-agent: {self.shutdown_cmd!r} exited {code}")
        except Exception as e:  # no such command, a timeout: logged, not retried in a loop
            self.log(f"provisioner-agent: {self.shutdown_cmd!r} failed: {type(e).__name__}: {e}")
        return doc


# --- the report ------------------------------------------------------------------------------

_SSH_FORM = re.compile(r"^(?:\S*provisioner-agent\s+)?--report(?:\s+--since\s+(\S+))?\s*$")


def since_from_ssh(command: str | None):  # -> (ok, since text or None)
    """``SSH_ORIGINAL_COMMAND`` (what the pull key's client asked for): absent or empty, or
    ``[provisioner-agent] --report [--since ISO]`` with a valid instant; anything else refused."""
    if command is None or not command.strip():
        return True, None
    m = _SSH_FORM.match(command.strip())
    if not m:
        return False, None
    if m.group(1) is not None and parse_iso(m.group(1)) is None:
        return False, None
    return True, m.group(1)


def report(
    state_dir: str = STATE_DIR,
    guard_file: str | None = None,
    since: datetime | None = None,
    *,
    machine: str = "",
    now=time.time,
    boot=boot_id,
    alive=pid_alive,
) -> dict:
    """What ``--report`` prints: the samples after ``since``, each job's state, the guard and
    the last stop."""
    guard = effective(load_json(guard_file or os.path.join(state_dir, GUARD)))
    samples = Samples(os.path.join(state_dir, SAMPLES), 1).since(since)
    return {
        "v": 1,
        "machine": (guard or {}).get("machine") or machine,
        "at": iso(datetime.fromtimestamp(now(), UTC)),
        "boot": boot(),
        "samples": samples,
        "jobs": job_states((guard or {}).get("jobs_dir"), boot(), alive),
        "guard": guard,
        "stop": load_json(os.path.join(state_dir, STOP)),
    }
