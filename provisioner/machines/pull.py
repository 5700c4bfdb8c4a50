"""The pull: each live machine's agent report read by the scheduler, so idle is known without a
public endpoint (a team behind NAT running ``provisioner sweep`` from cron).

Every machine gets the team's pull key (:func:`provisioner.keys.pull_public_key`) in its
authorized_keys, restricted to one forced command, ``provisioner-agent --report``. Each
reconcile pass runs, for every running machine that has it, ``ssh -i <pull key> … --since
<newest sample held>`` (bounded parallel, :data:`REPORT_SECONDS` each); a cloud that reads the
report itself (``Provider.machine_report``: the sandbox, from the machine's own folder) is
asked that way. The report's samples are stored as heartbeats marked ``pulled`` and its job
states as the ``job-finished`` events :func:`provisioner.machines.jobs.jobs_of` reads, so the
idle evidence, autostop and ``on_finish`` work unchanged.

A machine is untrusted: its answer is read up to :data:`MAX_REPORT_BYTES`, then validated
field by field (types, sizes, times within :data:`MAX_SKEW` of the scheduler's clock, the
machine's own id); a bad answer is one line of the pass and nothing of it is stored. A
machine that does not answer is "could not ask": nothing is stored, so its idle stays unknown
(never idle). Machines whose heartbeats reach the endpoint (within :func:`fresh_within`) are
not pulled.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import subprocess
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func, or_, select

from providers.base import Provider, ProviderError
from provisioner import idle, keys
from provisioner.app import App
from provisioner.errors import OperationFailed
from provisioner.machines import jobs
from provisioner.machines.record import record_event, ref
from provisioner.machines.remote import Remote
from provisioner.models import Event, Heartbeat, Machine
from provisioner.schema import LAUNCHES, EventKind
from provisioner.schema import MachineStatus as S

REPORT_SECONDS = 15.0  # one machine's answer, connection included
WORKERS = 8  # machines asked at once
MAX_REPORT_BYTES = 4 * 1024 * 1024  # a day of 30 s samples of 8 GPUs is ~1 MB
MAX_SAMPLES = 10_000  # a day at one sample each 9 s
MAX_GPUS = 64
MAX_JOBS = 256
MAX_TEXT = 500
MAX_SKEW = timedelta(minutes=5)  # the machine's clock against ours (as a signed heartbeat)
KEEP = timedelta(days=1)  # heartbeats kept (the sweep prunes older): older samples are dropped
GUARD_STOP = EventKind.GUARD_STOP  # the event of a stop the machine's own guard made (stop.json)
LAUNCH_EVENTS = LAUNCHES
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,6})?(Z|\+00:00)")
REASONS = ("autostop", "on-finish", "max-lifetime")
ACTIONS = ("stop", "terminate")


class BadReport(ValueError):
    pass


@dataclass(frozen=True)
class Sample:
    at: datetime
    gpus: list[dict[str, Any]]
    gpu_error: str | None
    ssh: int | None
    jobs_running: list[str]


@dataclass(frozen=True)
class Report:
    machine: str
    at: datetime
    samples: list[Sample]
    jobs: dict[str, str]  # running | exit N | lost
    stop: dict[str, Any] | None


@dataclass
class PullResult:
    """What one pull did: machines asked, SSH connections made, samples stored, machines left
    to the endpoint, and one line per machine that could not be read (or whose answer was
    refused), plus one line when this host lacks the pull key's private half."""

    asked: int = 0
    ssh_calls: int = 0
    samples: int = 0
    fresh: int = 0
    read: dict[str, int] = field(default_factory=dict)  # machine name: samples stored
    job_ends: list[tuple[str, str, str]] = field(default_factory=list)  # (machine, job, how)
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # (machine, kind, why)

    @property
    def lines(self) -> list[str]:
        return [f"{name}: pull [{kind}] — {why}" for name, kind, why in self.problems]


# --- validating an answer ------------------------------------------------------------------


def parse_time(v: Any, what: str) -> datetime:
    if not isinstance(v, str) or not TIME.fullmatch(v):
        raise BadReport(f"{what} is not an ISO 8601 UTC time")
    try:
        return datetime.fromisoformat(v.replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        raise BadReport(f"{what} is not an ISO 8601 UTC time") from None


def _text(v: Any, what: str, most: int = MAX_TEXT) -> str:
    if not isinstance(v, str) or len(v) > most:
        raise BadReport(f"{what} must be a string of at most {most} characters")
    return v


def _count(v: Any, what: str, most: int = 2**31) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < most:
        raise BadReport(f"{what} must be a count")
    return v


def _number(v: Any, what: str, most: float) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= most:
        raise BadReport(f"{what} must be a number from 0 to {most:g}")
    return float(v)


def _job_id(v: Any) -> str:
    if not isinstance(v, str) or not JOB_ID.fullmatch(v):
        raise BadReport("a job id is not a job's name")
    return v


def _job_state(v: Any) -> str:
    if v in ("running", "lost"):
        return str(v)
    if isinstance(v, str) and re.fullmatch(r"exit -?\d{1,3}", v) and abs(int(v[5:])) <= 255:
        return v
    raise BadReport('a job state must be "running", "exit N" or "lost"')


def _sample(d: Any) -> Sample:
    if not isinstance(d, dict):
        raise BadReport("a sample is not an object")
    at = parse_time(d.get("at"), "a sample's at")
    raw = d.get("gpus")
    if not isinstance(raw, list) or len(raw) > MAX_GPUS:
        raise BadReport(f"a sample's gpus must be a list of at most {MAX_GPUS}")
    gpus = []
    for i, g in enumerate(raw):
        if not isinstance(g, dict):
            raise BadReport("each GPU is an object")
        mem = g.get("mem_used_mb")
        gpus.append(
            {
                "index": _count(g.get("index", i), "a GPU's index", MAX_GPUS),
                "util": _number(g.get("util"), "a GPU's util", 100),
                "mem_used_mb": None if mem is None else _number(mem, "mem_used_mb", 2**40),
                "mem_total_mb": None,
            }
        )
    error = d.get("gpu_error")
    ssh = d.get("ssh")
    running = d.get("jobs_running", [])
    if not isinstance(running, list) or len(running) > MAX_JOBS:
        raise BadReport("a sample's jobs_running must be a list of job ids")
    return Sample(
        at,
        gpus,
        None if error is None else _text(error, "gpu_error"),
        None if ssh is None else _count(ssh, "ssh"),
        [_job_id(j) for j in running],
    )


def _stop(d: Any) -> dict[str, Any] | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise BadReport("stop is not an object")
    if d.get("reason") not in REASONS or d.get("action") not in ACTIONS:
        raise BadReport(
            f"stop's reason must be one of {', '.join(REASONS)}, its action stop or terminate"
        )
    ended = d.get("jobs_ended") or {}
    if not isinstance(ended, dict) or len(ended) > MAX_JOBS:
        raise BadReport("stop's jobs_ended must be an object of jobs")
    return {
        "at": parse_time(d.get("at"), "stop's at").isoformat(),
        "reason": d["reason"],
        "action": d["action"],
        "detail": _text(d.get("detail", ""), "stop's detail"),
        "jobs_ended": {_job_id(k): _text(v, "how a job ended", 200) for k, v in ended.items()},
    }


def parse_report(raw: bytes, machine_id: str, now: datetime) -> Report:
    """The agent's ``--report`` answer of machine ``machine_id``, validated; anything else
    raises :class:`BadReport` saying what was wrong (one line)."""
    d = _report_object(raw, machine_id)
    at = parse_time(d.get("at"), "its at")
    if abs(at - now) > MAX_SKEW:
        raise BadReport(
            f"its clock is {int((at - now).total_seconds())} s off ours (at most "
            f"{int(MAX_SKEW.total_seconds())} s)"
        )
    if d.get("boot") is not None:
        _text(d["boot"], "boot", 128)
    samples = _samples(d.get("samples"), at)
    raw_jobs = d.get("jobs")
    if not isinstance(raw_jobs, dict) or len(raw_jobs) > MAX_JOBS:
        raise BadReport(f"jobs must be an object of at most {MAX_JOBS} jobs")
    if d.get("guard") is not None and not isinstance(d["guard"], dict):
        raise BadReport("guard is not an object")
    return Report(
        machine_id,
        at,
        samples,
        {_job_id(k): _job_state(v) for k, v in raw_jobs.items()},
        _stop(d.get("stop")),
    )


def _samples(raw_samples: Any, at: datetime) -> list[Sample]:
    """The report's samples, oldest first, none newer than the report (``at``)."""
    if not isinstance(raw_samples, list) or len(raw_samples) > MAX_SAMPLES:
        raise BadReport(f"samples must be a list of at most {MAX_SAMPLES}")
    samples = sorted((_sample(x) for x in raw_samples), key=lambda x: x.at)
    if samples and samples[-1].at > at + timedelta(seconds=5):
        raise BadReport("a sample is newer than the report")
    return samples


def _report_object(raw: bytes, machine_id: str) -> dict[str, Any]:
    """The report's JSON object, of version 1 and of machine ``machine_id``."""
    if len(raw) > MAX_REPORT_BYTES:
        raise BadReport(f"over {MAX_REPORT_BYTES // (1024 * 1024)} MB")
    try:
        d = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BadReport("not JSON") from None
    if not isinstance(d, dict):
        raise BadReport("not a JSON object")
    if d.get("v") != 1:
        raise BadReport(f"version {str(d.get('v'))[:20]!r}, this scheduler reads 1")
    if d.get("machine") != machine_id:
        raise BadReport(f"it answers as another machine ({str(d.get('machine'))[:40]!r})")
    return d


# --- asking ----------------------------------------------------------------------------------


def since_text(at: datetime) -> str:
    """The ``--since`` a machine is sent: whole seconds, floored (a sample at that second is
    sent again and dropped here)."""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def ssh_argv(app: App, m: Machine, key: Path, since: datetime) -> list[str]:
    """``ssh`` as jobs reach the machine (user, port, $PROVISIONER_SSH_COMMAND, host key per
    machine), with the pull key alone, no pty, no forwarding; the remote command is
    ``--report --since ISO``, the one form the agent's forced command takes from
    ``SSH_ORIGINAL_COMMAND`` (anything else it refuses)."""
    remote = Remote(app, m)
    return [
        *remote.ssh_argv(key),
        *("-o", "ClearAllForwardings=yes", "-T"),
        "--",  # what follows is no option of ssh's (getopt would read `--report` as one)
        remote.target,
        f"--report --since {since_text(since)}",
    ]


def run_bounded(argv: list[str], timeout: float, most: int) -> tuple[int, bytes, str]:
    """(exit code, stdout, last stderr line) of ``argv``, its output read up to ``most`` + 1
    bytes (more: stopped there) and its time bounded; exit 255 on a timeout."""
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    out, err = bytearray(), bytearray()
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    timed_out = False
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for k, _ in sel.select(left):
                chunk = os.read(k.fd, 65536)
                if not chunk:
                    sel.unregister(k.fileobj)
                    continue
                k.data.extend(chunk)
                if len(out) > most:
                    return 0, bytes(out), ""  # the caller refuses it for its size
                del err[:-4096]
    finally:
        sel.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    if timed_out:
        return 255, b"", f"no answer within {timeout:g} s"
    lines = err.decode(errors="replace").strip().splitlines()
    return proc.returncode, bytes(out), lines[-1] if lines else ""


@dataclass
class _Asked:
    m: Machine
    raw: bytes | None = None
    ssh: bool = False
    problem: tuple[str, str] | None = None  # (kind, why)


def _ask(app: App, m: Machine, key: Path | None, since: datetime) -> _Asked:
    provider = app.provider(m.cloud or "")
    reader = getattr(provider, "machine_report", None)
    if reader is not None:
        try:
            raw = reader(ref(m))
        except ProviderError as e:
            return _Asked(m, problem=("could not ask", f"could not read its report: {e}"))
        if isinstance(raw, bytes):
            return _Asked(m, raw)
    if key is None or not m.public_ip or keys.simulated(m.public_ip):
        return _Asked(m)  # not read here: said once for all (no key), or no real address
    try:
        code, out, why = run_bounded(ssh_argv(app, m, key, since), REPORT_SECONDS, MAX_REPORT_BYTES)
    except OSError as e:
        return _Asked(m, ssh=True, problem=("could not ask", f"cannot run ssh: {e.strerror}"))
    if code != 0:
        kind = "could not ask" if code == 255 else "refused"
        return _Asked(
            m, ssh=True, problem=(kind, f"could not ask over SSH ({why or f'exit {code}'})")
        )
    return _Asked(m, out, ssh=True)


# --- which machines --------------------------------------------------------------------------


def fresh_within(app: App) -> timedelta:
    """A machine heard from the endpoint this recently is not pulled: two agent periods."""
    return timedelta(seconds=2 * app.settings.scheduler.agent_interval_seconds)


def _guarded(app: App, ms: list[Machine]) -> list[Machine]:
    """Of the running machines with an address, those launched with the pull key (their
    launch event names its fingerprint), or whose cloud reads the report itself."""
    ids = [m.id for m in ms]
    with app.db.session() as s:
        rows = s.execute(
            select(Event.machine_id, Event.detail).where(
                Event.machine_id.in_(ids), Event.kind.in_(LAUNCH_EVENTS)
            )
        ).all()
    with_key = {mid for mid, d in rows if isinstance(d, dict) and d.get(keys.PULL_DETAIL)}
    return [m for m in ms if m.id in with_key or reads_itself(app.provider(m.cloud or ""))]


def reads_itself(provider: Provider) -> bool:
    """The cloud's adapter reads a machine's report itself (the sandbox: from the machine's
    folder), overriding ``Provider.machine_report`` (whose default, None, means: over SSH)."""
    mine = getattr(type(provider), "machine_report", None)
    return mine is not None and mine is not getattr(Provider, "machine_report", None)


def _newest(app: App, ids: list[str], endpoint_only: bool) -> dict[str, datetime]:
    h = Heartbeat
    q = select(h.machine_id, func.max(h.at)).where(h.machine_id.in_(ids))
    if endpoint_only:
        q = q.where(or_(h.pulled.is_(None), h.pulled.is_(False)))
    with app.db.session() as s:
        return dict(s.execute(q.group_by(h.machine_id)).all())


def _running(app: App) -> list[Machine]:
    with app.db.session() as s:
        return list(
            s.scalars(
                select(Machine).where(Machine.status == S.RUNNING, Machine.public_ip.is_not(None))
            )
        )


#: When this process last asked each machine, per app (see :func:`pull_all`).
_ASKED: weakref.WeakKeyDictionary[App, dict[str, datetime]] = weakref.WeakKeyDictionary()


def pull_all(app: App, machines: Iterable[Machine] | None = None) -> PullResult:
    """Read the report of each of ``machines`` (default: every running one) that has a guard
    and no fresh heartbeat from the endpoint, and record what it says. Called by the reconcile
    pass and by the sweep pass (which judges idle on the samples: pulled only by a reconcile
    every 10 minutes, they would be older than the heartbeat grace); a machine asked by this
    process within :func:`fresh_within` is not asked again."""
    result = PullResult()
    now = app.clock.now()
    try:  # the first pass that finds no pull key published makes it (as `up` does)
        keys.pull_public_key(app)
    except OperationFailed as e:
        result.problems.append(("this host", "no key", f"no team pull key: {e}"))
    todo = _to_ask(app, machines, now, result)
    if not todo:
        return result
    newest = _newest(app, [m.id for m in todo], endpoint_only=False)
    key = _private_key(app, result)
    up = idle.running_since(app, [m.id for m in todo])  # nothing held: since it came up
    since = {m.id: max(newest.get(m.id) or up.get(m.id) or now, now - KEEP) for m in todo}
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        answers = list(pool.map(lambda m: _ask(app, m, key, since[m.id]), todo))
    for a in answers:
        _take(app, a, since[a.m.id], result)
    return result


def _to_ask(
    app: App, machines: Iterable[Machine] | None, now: datetime, result: PullResult
) -> list[Machine]:
    """Of ``machines`` (default: every running one), the running ones with a guard and an
    address that the endpoint has not heard from lately (counted in ``result.fresh``) and
    this process has not asked lately; marked as asked now."""
    ms = _candidates(app, machines)
    if not ms:
        return []
    recent = fresh_within(app)
    endpoint = _newest(app, [m.id for m in ms], endpoint_only=True)
    todo = [m for m in ms if not (m.id in endpoint and now - endpoint[m.id] <= recent)]
    result.fresh = len(ms) - len(todo)
    return _not_asked(app, todo, now, recent)


def _candidates(app: App, machines: Iterable[Machine] | None) -> list[Machine]:
    """Of ``machines`` (default: every running one), the running ones with an address and a
    guard."""
    ms = [m for m in (_running(app) if machines is None else machines) if m.status == S.RUNNING]
    return _guarded(app, [m for m in ms if m.public_ip])


def _not_asked(app: App, ms: list[Machine], now: datetime, recent: timedelta) -> list[Machine]:
    """Those of ``ms`` not asked already by this process within ``recent`` (two agent periods:
    the sweep after the reconcile of one `provisioner sweep`), marked as asked now: one SSH
    call per machine per run."""
    asked = _ASKED.setdefault(app, {})
    todo = [m for m in ms if not (m.id in asked and timedelta(0) <= now - asked[m.id] < recent)]
    asked.update({m.id: now for m in todo})
    return todo


def _private_key(app: App, result: PullResult) -> Path | None:
    """The private half of the team's pull key; None, said in ``result``, when this host has
    not got it though one is published."""
    key = keys.pull_private(app)
    if key is None and keys.published_pull_key(app) is not None:
        path = keys.pull_path(app)
        result.problems.append(
            (
                "this host",
                "no key",
                f"no private half of the team's pull key ({path}): machines are not read "
                "over SSH here; copy it from the host that made it (0600)",
            )
        )
    return key


def _take(app: App, a: Any, since: datetime, result: PullResult) -> None:
    """One machine's answer: its problem, or its report parsed and stored."""
    result.ssh_calls += a.ssh
    if a.problem is not None:
        result.problems.append((a.m.name, *a.problem))
        return
    if a.raw is None:
        return
    result.asked += 1
    try:
        report = parse_report(a.raw, a.m.id, app.clock.now())
    except BadReport as e:
        result.problems.append((a.m.name, "refused", f"report refused: {e}"))
        return
    _store(app, a.m, report, since, result)


# --- recording -------------------------------------------------------------------------------


def _store(app: App, m: Machine, report: Report, since: datetime, result: PullResult) -> None:
    """The report's new samples as pulled heartbeats, its job ends as events (under the
    machine's jobs lock, as :func:`jobs.check_ended`: one of them records an end)."""
    new = _store_samples(app, m, report, since)
    result.samples += new
    result.read[m.name] = new
    with app.db.lock(f"jobs-{m.id}"):
        running = {j for j, job in jobs.jobs_of(app, m).items() if job.running}
        ends: dict[str, tuple[str, int | None, str]] = {}
        if report.stop is not None and _new_stop(app, m, report.stop):
            record_event(app, m.id, GUARD_STOP, reason=report.stop["reason"], detail=report.stop)
            for j, how in report.stop["jobs_ended"].items():
                ends[j] = ("killed", None, f"the machine's guard ({report.stop['reason']}): {how}")
        _job_ends(report, ends)
        for j, (reason, code, how) in ends.items():
            if j in running:
                detail = {"job": j, "exit_code": code, "seen": "pulled", "how": how}
                record_event(app, m.id, jobs.FINISHED, reason=reason, detail=detail)
                result.job_ends.append((m.name, j, how))


def _store_samples(app: App, m: Machine, report: Report, since: datetime) -> int:
    """The report's samples after ``since`` (and within the day kept) as the machine's
    heartbeats, marked pulled; how many."""
    new = [x for x in report.samples if since < x.at and x.at >= report.at - KEEP]
    with app.db.session() as s:
        for x in new:
            top = max((g["util"] for g in x.gpus), default=None)
            s.add(
                Heartbeat(
                    machine_id=m.id,
                    at=x.at,
                    gpus=x.gpus,
                    max_util=top,
                    ssh_sessions=x.ssh,
                    pulled=True,
                )
            )
    return len(new)


def _job_ends(report: Report, ends: dict[str, tuple[str, int | None, str]]) -> None:
    """The jobs the report says ended (and its guard did not end), into ``ends``: how each
    ended (killed or exited), its exit code, and the words."""
    for j, st in report.jobs.items():
        if j in ends or st == "running":
            continue
        if st == "lost":
            ends[j] = ("killed", None, "ended with its machine's boot")
        else:
            ends[j] = ("exited", int(st[5:]), st)


def _new_stop(app: App, m: Machine, stop: dict[str, Any]) -> bool:
    with app.db.session() as s:
        known = s.scalars(
            select(Event.detail).where(Event.machine_id == m.id, Event.kind == GUARD_STOP)
        )
        return not any(isinstance(d, dict) and d.get("at") == stop["at"] for d in known)
