#!/usr/bin/env python3
"""The on-machine agent: GPU utilisation heartbeats to the scheduler's endpoint (with the SSH
sessions open, for autostop), and the cloud's preemption notice passed on to the job and to the
scheduler.

Standalone on purpose: it imports only the standard library (and NVML through nvidia-ml-py,
lazily), so the startup script can copy this one file onto a fresh machine and run it with any
python3 >= 3.8. It must never hurt the workload: every error is caught, logged and retried with
backoff; without NVML (no driver, no GPU) it reports "no gpu" instead of failing.

Each heartbeat is signed, so neither a listener on the network nor a replay can pass for the
machine: the key is the SHA-256 of the machine's token (what the scheduler stores), the
signature covers the route, the machine id, the time in milliseconds (the scheduler refuses one
older than its window, or not newer than the last on that route) and the body.

Preemption notices (``--cloud``): each cloud's documented notice is polled on its metadata
service (see :data:`WATCHERS`); once per notice the job is told (``--on-notice-file``: a signal
to its processes, or a command) and the notice is posted, signed, to ``/v1/notice``.

The guard (:mod:`provisioner.agent_guard`, installed beside this file): with or without an
endpoint, every ``--interval`` seconds the agent samples the GPUs, the SSH sessions and the
supervisor's jobs into its state dir and enforces the machine's own ``guard.json`` (autostop,
on_finish, max_lifetime) by shutting the machine down itself. ``--report`` prints what it kept,
for the scheduler's pull over SSH.
"""

from __future__ import annotations

import argparse
import contextlib
import email.utils
import hashlib
import hmac
import json
import os
import random
import re
import signal as signals
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone

UTC = timezone.utc  # noqa: UP017 (datetime.UTC is 3.11+; the machine may have 3.8)

MAX_BACKOFF_SECONDS = 300.0

try:  # in the package; on the machine, agent_guard.py sits beside this file (Python puts the
    # script's real directory, symlinks resolved, first on the path)
    from provisioner import agent_guard
    from provisioner.agent_guard import GPUReader, count_ssh, say, ssh_sessions
except ImportError:  # pragma: no cover (the machine)
    import agent_guard  # type: ignore[no-redef,import-not-found]
    from agent_guard import GPUReader, count_ssh, say, ssh_sessions  # type: ignore[no-redef]

__all__ = ["GPUReader", "count_ssh", "ssh_sessions"]  # what the guard samples with, here too


SCHEME = "PV1-HMAC-SHA256"


def signing_key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


HEARTBEAT, NOTICE = "/v1/heartbeat", "/v1/notice"  # the routes an agent posts to


def signature(key: str, machine: str, at_ms: int, body: bytes, route: str = HEARTBEAT) -> str:
    digest = hashlib.sha256(body).hexdigest()
    message = f"POST {route}\n{machine}\n{at_ms}\n{digest}".encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def authorization(key: str, machine: str, at_ms: int, body: bytes, route: str = HEARTBEAT) -> str:
    sig = signature(key, machine, at_ms, body, route)
    return f"{SCHEME} machine={machine}, time={at_ms}, signature={sig}"


class Clock:
    """Milliseconds that always grow, so no two heartbeats carry the same time."""

    def __init__(self, now=time.time) -> None:
        self.now = now
        self.last = 0

    def ms(self) -> int:
        self.last = max(self.last + 1, int(self.now() * 1000))
        return self.last


def post(
    endpoint: str,
    machine: str,
    token: str,
    body: dict,
    at_ms: int,
    timeout: float = 10.0,
    route: str = HEARTBEAT,
) -> int:
    data = json.dumps(body).encode()
    req = urllib.request.Request(
        endpoint.rstrip("/") + route,
        data=data,
        headers={
            "Authorization": authorization(signing_key(token), machine, at_ms, data, route),
            "Content-Type": "application/json",
        },
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


# --- preemption notices ------------------------------------------------------------------------
#
# What each cloud documents, polled on its metadata service (link-local, never leaves the host):
#
# aws    IMDS ``GET /latest/meta-data/spot/instance-action``: HTTP 404 until EC2 schedules an
#        interruption, then ``{"action": "terminate"|"stop"|"hibernate", "time": "…Z"}`` about
#        two minutes ahead; check every 5 s. EC2 User Guide, "Spot Instance interruption notices"
#        https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html
#        IMDSv2 (required where ``HttpTokens`` is ``required``): ``PUT /latest/api/token`` with
#        ``X-aws-ec2-metadata-token-ttl-seconds`` (≤ 21600), then the token in
#        ``X-aws-ec2-metadata-token``; an expired or missing token gets 401. EC2 User Guide,
#        "Use IMDSv2" https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html
# gcp    ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``: ``FALSE``,
#        then ``TRUE`` once Compute Engine preempts the VM (about 30 s before it stops). Compute
#        Engine, "Create and use Spot VMs" (detecting preemption)
#        https://cloud.google.com/compute/docs/instances/create-use-spot and "Spot VMs"
#        (preemption process) https://cloud.google.com/compute/docs/instances/spot
#        (``?wait_for_change=true`` exists too; a plain poll is used so a lost connection costs
#        one interval, not a hanging request).
# azure  Scheduled Events ``GET /metadata/scheduledevents?api-version=2020-07-01`` with
#        ``Metadata: true``: ``{"DocumentIncarnation": n, "Events": [{"EventId", "EventType":
#        "Preempt", "ResourceType", "Resources", "EventStatus", "NotBefore": "Mon, 19 Sep 2016
#        18:29:47 GMT"}]}``; a Preempt is scheduled at least 30 s ahead. Microsoft Learn, "Azure
#        Metadata Service: Scheduled Events for Linux VMs"
#        https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events
# yandex none: the metadata service (GCE-compatible) lists no ``instance/preempted`` key in its
#        folders (only ``instance/maintenance-event``); a preemptible VM is told by an ACPI
#        shutdown, which systemd turns into SIGTERM for every process, with 30 s before it is
#        stopped. Yandex Cloud docs, compute/concepts/metadata/directories and
#        compute/concepts/preemptible-vm.
# sbercloud none: Huawei Cloud ECS (cloud.ru Advanced) documents a spot reclaim only as a
#        notification outside the VM (Cloud Eye event / SMN), no metadata item on the machine.
#        Huawei Cloud ECS user guide, "Purchasing a Spot Block ECS" (reclaim notification).

METADATA_URLS = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
AWS_TOKEN_TTL = 21600  # seconds, the documented maximum
SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGKILL")


def _get(url: str, headers: dict, timeout: float, method: str = "GET"):  # -> (status, text)
    req = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(65536).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, ""


def _utc(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _iso(text: object) -> str | None:
    """``2026-11-20T12:00:00Z`` as given, checked; None if it is no time."""
    at = agent_guard.parse_iso(text)
    return _utc(at) if at else None


WATCHERS: dict = {}  # cloud: its notice watcher (the others document none)


def watcher(cloud: str):  # -> the class decorator
    """Registers a cloud's notice watcher; the startup data ships the machine's cloud's alone
    (:func:`provisioner.startup.agent_sources`)."""

    def register(cls):
        WATCHERS[cloud] = cls
        return cls

    return register


@watcher("aws")
class AWSWatcher:
    """Spot ``instance-action`` through an IMDSv2 session token (kept until it nears expiry)."""

    def __init__(self, base: str, timeout: float = 2.0, now=time.monotonic) -> None:
        self.base, self.timeout, self.now = base.rstrip("/"), timeout, now
        self._token, self._until = "", 0.0

    def _session(self) -> str:
        if not self._token or self.now() >= self._until:
            status, text = _get(
                self.base + "/latest/api/token",
                {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL)},
                self.timeout,
                method="PUT",
            )
            if status != 200:
                raise RuntimeError(f"IMDSv2 token: HTTP {status}")
            self._token, self._until = text.strip(), self.now() + AWS_TOKEN_TTL - 60
        return self._token

    def poll(self):  # -> list[dict]
        url = self.base + "/latest/meta-data/spot/instance-action"
        status, text = _get(url, {"X-aws-ec2-metadata-token": self._session()}, self.timeout)
        if status == 401:  # the token expired early: one fresh session
            self._token = ""
            status, text = _get(url, {"X-aws-ec2-metadata-token": self._session()}, self.timeout)
        if status == 404:  # no interruption scheduled
            return []
        if status != 200:
            raise RuntimeError(f"spot/instance-action: HTTP {status}")
        doc = json.loads(text)
        action, when = str(doc.get("action") or "interrupt")[:32], _iso(doc.get("time"))
        return [{"id": f"aws:{action}:{when}", "action": action, "not_before": when}]


@watcher("gcp")
class GCPWatcher:
    def __init__(self, base: str, timeout: float = 2.0) -> None:
        self.base, self.timeout = base.rstrip("/"), timeout

    def poll(self):  # -> list[dict]
        url = self.base + "/computeMetadata/v1/instance/preempted"
        status, text = _get(url, {"Metadata-Flavor": "Google"}, self.timeout)
        if status != 200:
            raise RuntimeError(f"instance/preempted: HTTP {status}")
        if text.strip() != "TRUE":
            return []
        # Google gives no time: the VM stops about 30 s from now (the scheduler records when)
        return [{"id": "gcp:preempted", "action": "preempt", "not_before": None}]


@watcher("azure")
class AzureWatcher:
    # "Scheduled Events is enabled for your service the first time you make a request. You
    # should expect a delayed response in your first call of up to two minutes." (same page)
    def __init__(self, base: str, timeout: float = 120.0) -> None:
        self.base, self.timeout = base.rstrip("/"), timeout

    def poll(self):  # -> list[dict]
        url = self.base + "/metadata/scheduledevents?api-version=2020-07-01"
        status, text = _get(url, {"Metadata": "true"}, self.timeout)
        if status != 200:
            raise RuntimeError(f"scheduledevents: HTTP {status}")
        out = []
        # A VM we launch is in no availability set or scale set, so every event is its own.
        for ev in json.loads(text).get("Events") or []:
            if ev.get("EventType") != "Preempt":
                continue
            when = None
            with contextlib.suppress(TypeError, ValueError, IndexError):
                when = _utc(email.utils.parsedate_to_datetime(ev.get("NotBefore")))
            out.append(
                {
                    "id": "azure:" + str(ev.get("EventId"))[:100],
                    "action": "preempt",
                    "not_before": when,
                }
            )
        return out


def matching_pids(pattern: str, skip=()):  # -> list[int]
    """Processes whose full command line (arguments joined by spaces) matches ``pattern``, a
    regular expression searched as ``pkill -f`` does; read from /proc."""
    rx, out = re.compile(pattern), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:  # gone, or not ours to read
            continue
        if cmd and rx.search(cmd):
            out.append(int(name))
    return out


def tell_job(action: dict, notice: dict, log) -> None:
    """Send ``action["signal"]`` to the processes matching ``action["to"]``, or start
    ``action["run"]`` (a shell command, not waited for) with the notice in its environment."""
    if "run" in action:
        env = dict(os.environ)
        env.update(
            PROVISIONER_NOTICE_CLOUD=notice["cloud"],
            PROVISIONER_NOTICE_ACTION=notice["action"],
            PROVISIONER_NOTICE_NOT_BEFORE=notice["not_before"] or "",
        )
        subprocess.Popen(action["run"], shell=True, env=env, start_new_session=True)
        log(f"provisioner-agent: preemption notice: ran {action['run']!r}")
        return
    sig = getattr(signals, action["signal"])
    pids = matching_pids(action["to"], skip={os.getpid()})
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    log(f"provisioner-agent: preemption notice: {action['signal']} to {len(pids)} process(es)")


class NoticeWatcher:
    """One poll of the cloud's notice per :meth:`tick`: a new notice tells the job once and is
    posted until the scheduler has it (a refusal that will not change is dropped)."""

    def __init__(
        self,
        cloud: str,
        endpoint: str,
        machine: str,
        token_file: str,
        *,
        metadata_url: str | None = None,
        action: dict | None = None,
        now=time.time,
        log=say,
    ) -> None:
        self.cloud, self.endpoint, self.machine, self.token_file = (
            cloud,
            endpoint,
            machine,
            token_file,
        )
        self.action, self.log, self.now = action, log, now
        self.source = WATCHERS[cloud](metadata_url or METADATA_URLS[cloud])
        self.clock = Clock(now)
        self.seen: set = set()
        self.unsent: list = []
        self.failures = 0

    def tick(self) -> None:
        try:
            found = self.source.poll()
            self.failures = 0
        except Exception as e:  # no metadata service, a timeout, a malformed answer, …
            self.failures += 1
            if self.failures & (self.failures - 1) == 0:  # the 1st, 2nd, 4th, 8th, … in a row
                msg = f"notice check failed ({self.failures}): {type(e).__name__}: {e}"
                self.log("provisioner-agent: " + msg)
            found = []
        for n in found:
            if n["id"] in self.seen:
                continue
            self.seen.add(n["id"])
            seen_at = datetime.fromtimestamp(self.now(), UTC)
            notice = {
                "cloud": self.cloud,
                "event_id": n["id"],
                "action": n["action"],
                "not_before": n["not_before"],
                "seen_at": _utc(seen_at),
            }
            if self.action:
                try:
                    tell_job(self.action, notice, self.log)
                except Exception as e:
                    self.log(f"provisioner-agent: telling the job failed: {type(e).__name__}: {e}")
            self.unsent.append(notice)
        self._send()

    def _send(self) -> None:
        if not self.endpoint:  # no scheduler to tell: the job was told, that is all
            self.unsent.clear()
            return
        while self.unsent:
            try:
                with open(self.token_file, encoding="utf-8") as f:
                    token = f.read().strip()
                status = post(
                    self.endpoint,
                    self.machine,
                    token,
                    self.unsent[0],
                    self.clock.ms(),
                    timeout=5.0,
                    route=NOTICE,
                )
            except Exception as e:  # kept for the next tick
                self.log(f"provisioner-agent: notice post failed: {type(e).__name__}: {e}")
                return
            if status >= 500 or status in (408, 409, 429):
                self.log(f"provisioner-agent: notice post: HTTP {status}, will retry")
                return
            if status != 200:
                self.log(f"provisioner-agent: notice refused: HTTP {status}")
            self.unsent.pop(0)


def watch(
    watcher: NoticeWatcher, interval: float = 5.0, *, sleep=time.sleep, stop=lambda: False
) -> None:
    while not stop():
        watcher.tick()
        sleep(interval)


def load_action(path: str | None):  # -> dict | None
    """The job's notice action as provisioner wrote it: ``{"signal": "SIGTERM", "to": RE}`` or
    ``{"run": "command"}``."""
    if not path:
        return None
    with open(path, encoding="utf-8") as f:
        action = json.load(f)
    if "run" in action:
        return {"run": str(action["run"])}
    if action.get("signal") not in SIGNALS or not action.get("to"):
        raise ValueError(f"{path}: expected {{'signal': one of {SIGNALS}, 'to': pattern}}")
    re.compile(action["to"])
    return {"signal": action["signal"], "to": action["to"]}


def run(
    endpoint: str,
    machine: str,
    token_file: str,
    interval: float = 30.0,
    *,
    reader: GPUReader | None = None,
    sleep=time.sleep,
    stop=lambda: False,
    log=say,
    now=time.time,
) -> None:
    """Post a heartbeat every ``interval`` seconds until ``stop()``; never raises."""
    reader = reader or GPUReader()
    clock = Clock(now)
    failures = 0
    while not stop():
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
            gpus, note = reader.read()
            body = {"gpus": gpus}
            sessions = ssh_sessions()
            if sessions is not None:
                body["ssh_sessions"] = sessions
            if note:
                body["note"] = note
            status = post(endpoint, machine, token, body, clock.ms())
            if status != 200:
                raise RuntimeError(f"endpoint answered HTTP {status}")
            failures = 0
        except Exception as e:  # the token file is missing, the network is down, …
            failures += 1
            log(f"provisioner-agent: heartbeat failed ({failures}): {type(e).__name__}: {e}")
        wait = interval
        if failures:
            wait = min(interval * 2 ** min(failures, 10), MAX_BACKOFF_SECONDS)
            wait *= random.uniform(0.5, 1.0)
        sleep(wait)


def guard_loop(guard, interval: float, *, reader=None, sleep=time.sleep, stop=lambda: False):
    """One guard tick every ``interval`` seconds until ``stop()``; never raises."""
    reader = reader or GPUReader()
    while not stop():
        try:
            gpus, note = reader.read()
            guard.tick(gpus, note, ssh_sessions())
        except Exception as e:  # a full disk, an unreadable file, …: the next tick tries again
            guard.log(f"provisioner-agent: guard tick failed: {type(e).__name__}: {e}")
        sleep(interval)


def _boot(path, g):
    """The boot id: the kernel's, or the one in ``path`` (a sandbox machine's own boots)."""
    if not path:
        return g.boot_id
    return lambda: g.read_text(path) or "unknown"


def _report(a, g) -> int:
    ok, since = g.since_from_ssh(os.environ.get("SSH_ORIGINAL_COMMAND"))
    if not ok:
        print("provisioner-agent: only `--report [--since ISO]` is allowed", file=sys.stderr)
        return 2
    since = since or a.since
    after = g.parse_iso(since) if since else None
    if since and after is None:
        print(f"provisioner-agent: --since {since!r}: not a UTC ISO 8601 instant", file=sys.stderr)
        return 2
    now, boot = g.clock_from_env(), _boot(a.boot_file, g)
    doc = g.report(a.state_dir, a.guard_file, after, machine=a.machine or "", now=now, boot=boot)
    print(json.dumps(doc, sort_keys=True))
    return 0


def main(argv=None) -> None:
    g = agent_guard
    # the flags' meanings are comments here, not help: the startup data has EC2's 16 KB to fit
    p = argparse.ArgumentParser(prog="provisioner-agent")  # the machine's guard, its record
    p.add_argument("--endpoint")  # the scheduler's URL: GPU heartbeats
    p.add_argument("--machine")  # this machine's id (default: guard.json's)
    p.add_argument("--token-file")  # the heartbeat token (with --endpoint)
    p.add_argument("--interval", type=float, default=30.0)
    p.add_argument("--state-dir", default=g.STATE_DIR)
    p.add_argument("--guard-file")  # default: STATE_DIR/guard.json
    p.add_argument("--shutdown-cmd", default=g.SHUTDOWN_CMD)  # how the guard powers off
    p.add_argument("--boot-file")  # read the boot id here (default: the kernel's)
    p.add_argument("--report", action="store_true")  # print the report JSON and exit
    p.add_argument("--since")  # with --report: only samples after this ISO instant
    p.add_argument("--cloud", default="")  # the cloud this machine runs on
    p.add_argument("--metadata-url")  # the cloud's metadata service (default: its own)
    p.add_argument("--notice-interval", type=float, default=5.0)
    p.add_argument("--on-notice-file")  # JSON: what to do to the job on a notice
    a = p.parse_args(argv)
    a.guard_file = a.guard_file or os.path.join(a.state_dir, g.GUARD)
    if a.report:
        sys.exit(_report(a, g))
    if a.endpoint and not (a.machine and a.token_file):
        p.error("--endpoint needs --machine and --token-file")
    if a.interval <= 0:
        p.error("--interval must be more than 0")
    if a.cloud in WATCHERS:
        watcher = NoticeWatcher(
            a.cloud,
            a.endpoint or "",
            a.machine or "",
            a.token_file or "",
            metadata_url=a.metadata_url,
            action=load_action(a.on_notice_file),
        )
        args = (watcher, a.notice_interval)
        threading.Thread(target=watch, args=args, name="notices", daemon=True).start()
    elif a.cloud:
        print(f"provisioner-agent: {a.cloud} documents no preemption notice", file=sys.stderr)
    if a.endpoint:
        beats = (a.endpoint, a.machine, a.token_file, a.interval)
        threading.Thread(target=run, args=beats, name="heartbeats", daemon=True).start()
    guard = g.Guard(
        a.state_dir,
        a.guard_file,
        a.shutdown_cmd,
        a.interval,
        now=g.clock_from_env(),
        boot=_boot(a.boot_file, g),
    )
    with contextlib.suppress(KeyboardInterrupt):
        guard_loop(guard, a.interval)


if __name__ == "__main__":
    main()
