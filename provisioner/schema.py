"""The state schema's revisions, read from the migration files themselves, and its vocabulary:
the standard library only (and libpq, for a state on PostgreSQL), so a command can tell
whether a database is current (and whether it holds any machine) before loading SQLAlchemy."""

from __future__ import annotations

import enum
import re
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import sqlite3

MIGRATIONS = Path(__file__).parent / "migrations"


class MachineStatus(enum.StrEnum):
    """Where a machine is in its life. The cloud-side states are providers' ``MachineState``;
    ``requested`` (the intent is written, nothing launched yet), ``waiting`` (every candidate
    lacked capacity and the intent waits for some: nothing launched, nothing committed) and
    ``failed`` (no candidate launched, or ``down`` before any did) are provisioner's own. A
    ``StrEnum``: the database, the fleet's plain SQL and JSON hold the value itself."""

    REQUESTED = "requested"
    WAITING = "waiting"
    PENDING = "pending"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    PREEMPTED = "preempted"
    TERMINATED = "terminated"
    FAILED = "failed"


S = MachineStatus
#: What the cloud can report of a launched machine (reconcile records whatever it sees).
_CLOUD_SIDE = frozenset({S.PENDING, S.RUNNING, S.STOPPING, S.STOPPED, S.PREEMPTED, S.TERMINATED})
#: The legal moves, from → to. A machine is born ``requested``; only an intent fails; nothing
#: leaves ``terminated`` or ``failed`` (a relaunch is a new row, its name reused). A waiting
#: intent's try makes it ``requested`` again (counted by budgets while it launches, resumed
#: after a crash like any intent), and the try ends launched, waiting again, or failed.
TRANSITIONS: dict[MachineStatus, frozenset[MachineStatus]] = {
    S.REQUESTED: frozenset({S.PENDING, S.RUNNING, S.WAITING, S.FAILED}),
    S.WAITING: frozenset({S.REQUESTED, S.FAILED}),
    **{s: _CLOUD_SIDE - {s} for s in _CLOUD_SIDE - {S.TERMINATED}},
    S.TERMINATED: frozenset(),
    S.FAILED: frozenset(),
}
#: Intents: nothing of them is recorded as launched (no instance, no cloud, no bill).
INTENTS = frozenset({S.REQUESTED, S.WAITING})
#: Statuses a machine is done with: not shown by default; its name may be reused.
ACTIVE_EXCLUDED = (S.TERMINATED.value, S.FAILED.value)
#: Statuses in which the cloud charges for compute, and for the boot disk.
COMPUTE_BILLED = frozenset({S.PENDING, S.RUNNING, S.STOPPING})
DISK_BILLED = COMPUTE_BILLED | {S.STOPPED, S.PREEMPTED}
#: Statuses in which a public IPv4 address bills, by how its cloud bills it (``machines.
#: address_billed``): ``running``, released at stop (AWS auto-assigned, GCP ephemeral, Yandex
#: dynamic); ``held``, kept by a stopped machine until it is deleted (Azure static, an EIP).
ADDRESS_BILLED = {"running": COMPUTE_BILLED, "held": DISK_BILLED}


class IllegalTransition(RuntimeError):
    """A writer asked for a move :data:`TRANSITIONS` does not allow: a bug, never user input."""


def check_transition(old: str | None, new: str) -> MachineStatus:
    """``new`` as a :class:`MachineStatus` if a machine may move there from ``old`` (None: a
    new row, which starts ``requested``); else :class:`IllegalTransition`."""
    return check_move(MachineStatus, old, new)


class VolumeStatus(enum.StrEnum):
    """Where a network disk of a project is (``volumes.status``; ``volume ls`` shows ``in-use``
    only while a live machine holds it, whatever is stored)."""

    CREATING = "creating"  # the intent, written with its token before the cloud is asked
    AVAILABLE = "available"  # the cloud made it; attached to no machine yet
    IN_USE = "in-use"  # attached to a machine (the latest that mounted it)
    DELETED = "deleted"  # gone from the cloud; its name may be reused


V = VolumeStatus
#: A volume is born ``creating``; an intent whose launch failed is deleted again; nothing comes
#: back from ``deleted`` (a volume of the same name is a new row).
VOLUME_TRANSITIONS: dict[VolumeStatus, frozenset[VolumeStatus]] = {
    V.CREATING: frozenset({V.AVAILABLE, V.DELETED}),
    V.AVAILABLE: frozenset({V.IN_USE, V.DELETED}),
    V.IN_USE: frozenset({V.DELETED}),
    V.DELETED: frozenset(),
}


class DeliveryStatus(enum.StrEnum):
    """Where one notice to one channel is (``deliveries.status``)."""

    PENDING = "pending"  # queued, not tried yet
    SENT = "sent"  # the channel took it
    RETRYING = "retrying"  # a try failed in a way worth another, at ``next_at``
    FAILED = "failed"  # refused, given up after its tries, or superseded by a later notice


D = DeliveryStatus
#: A notice is queued ``pending``; a mail sent elsewhere is recorded as it went (sent,
#: retrying or failed). Sent and failed are ends.
DELIVERY_TRANSITIONS: dict[DeliveryStatus, frozenset[DeliveryStatus]] = {
    D.PENDING: frozenset({D.SENT, D.RETRYING, D.FAILED}),
    D.RETRYING: frozenset({D.SENT, D.FAILED}),
    D.SENT: frozenset(),
    D.FAILED: frozenset(),
}
#: Deliveries still to be tried (at their ``next_at``), and those not delivered (yet).
DELIVERY_DUE = (D.PENDING, D.RETRYING)
UNDELIVERED = (D.FAILED, D.RETRYING)
#: What each vocabulary's rows are born as (None: any of its values).
_BORN: dict[type[enum.StrEnum], frozenset[Any] | None] = {
    MachineStatus: frozenset({S.REQUESTED}),
    VolumeStatus: frozenset({V.CREATING}),
    DeliveryStatus: None,
}
_TABLES: dict[type[enum.StrEnum], dict[Any, frozenset[Any]]] = {
    MachineStatus: TRANSITIONS,
    VolumeStatus: VOLUME_TRANSITIONS,
    DeliveryStatus: DELIVERY_TRANSITIONS,
}


_E = TypeVar("_E", bound=enum.StrEnum)


def check_move(vocabulary: type[_E], old: str | None, new: str) -> _E:
    """``new`` as a member of ``vocabulary`` if a row may move there from ``old`` (None: a new
    row), by the vocabulary's transition table; else :class:`IllegalTransition`."""
    to = vocabulary(new)
    born = _BORN[vocabulary]
    allowed = _TABLES[vocabulary][vocabulary(old)] if old else (born or frozenset(vocabulary))
    if to not in allowed:
        what = vocabulary.__name__.removesuffix("Status").lower()
        raise IllegalTransition(f"a {what} cannot move from {old or 'nothing'} to {to}")
    return to


class EventKind(enum.StrEnum):
    """What an event of a machine records (``events.kind``): every kind any writer writes.
    Each :class:`MachineStatus` is also a kind: a move recorded without a kind of its own."""

    REQUESTED = "requested"  # the intent is written (detail: the spec's path)
    WAITING = "waiting"  # every candidate lacked capacity: waits (detail: since, next_try, until)
    PENDING = "pending"  # the cloud reports it booting
    RUNNING = "running"  # the cloud reports it running (reconcile saw it)
    STOPPING = "stopping"  # the cloud reports it stopping
    STOPPED = "stopped"  # stopped (by provisioner, the scheduler, or seen stopped)
    PREEMPTED = "preempted"  # the cloud took the spot machine back
    TERMINATED = "terminated"  # gone (reason: down, preempted, a policy…)
    FAILED = "failed"  # an intent that never launched
    LAUNCHED = "launched"  # a candidate launched (detail: the attempt, instance, key)
    ADOPTED = "adopted"  # a launch found after a lost answer or a crash, taken as launched
    LAUNCH_ATTEMPT = "launch-attempt"  # a candidate about to be asked (detail: LaunchAttempt)
    LAUNCH_FAILED = "launch-failed"  # a candidate refused (reason: the failure class)
    LAUNCH_UNKNOWN = "launch-unknown"  # a launch with no clear answer the cloud could not settle
    DUPLICATE = "duplicate"  # a second instance of one launch found (and removed)
    BOOTED = "booted"  # a pending machine seen running
    STARTED = "started"  # started again in place (after a stop or a preemption)
    CANCEL_REQUESTED = "cancel-requested"  # `down` while another process launches it
    CANCELLED = "cancelled"  # an intent `down` ended before anything launched
    WAIT_TRY = "wait-try"  # a waiting intent tries its candidates again
    WAIT_ENDED = "wait-ended"  # a waiting intent launched
    WAIT_GAVE_UP = "wait-gave-up"  # a wait reached its `until` and failed
    WAIT_REFUSED = "wait-refused"  # a wait refused (a budget, a policy) and failed
    JOB_STARTED = "job-started"  # a job started (detail: job, command)
    JOB_FINISHED = "job-finished"  # a job ended (reason: exited | killed | cancelled…)
    JOB_QUEUED = "job-queued"  # a job waits for the GPUs it asks (detail: job, command, gpus)
    JOB_FAILED = "job-failed"  # the `run` could not be started (detail: error)
    RUN_DUE = "run-due"  # started again in place: its `run` starts anew
    AUTOSTOP_SET = "autostop-set"  # `autostop` set by a user
    AUTOSTOP_CANCELLED = "autostop-cancelled"  # `autostop --cancel`
    KEPT = "kept"  # `keep` until a time: the scheduler leaves it
    KEEP_CANCELLED = "keep-cancelled"  # `keep --cancel`
    STOP_WARNING = "stop-warning"  # its owner was told the scheduler will stop it
    PREEMPTION_NOTICE = "preemption-notice"  # the cloud announced it will take it back
    GUARD_STOP = "guard-stop"  # the machine's own guard stopped it (detail: stop.json)
    RELAUNCHED = "relaunched"  # a preempted machine was replaced (detail: the new machine)
    RECOVERED = "recovered"  # on the replacement: which machine it replaces
    RELAUNCH_REFUSED = "relaunch-refused"  # a relaunch refused (a budget, a policy): kept
    RELAUNCH_GAVE_UP = "relaunch-gave-up"  # relaunching stopped after its tries
    RECOVER_FAILED = "recover-failed"  # one relaunch try failed (detail: attempt, error)
    REPLACEMENT_ENDED = "replacement-ended"  # its replacement ended before it ran
    KEPT_FOR_RELAUNCH = "kept-for-relaunch"  # its disk kept for the replacement
    VOLUME_ATTACHED = "volume-attached"  # a volume attached (detail: volume, id)
    VOLUME_MOVED = "volume-moved"  # a volume taken from a preempted machine it replaced


class UsageKind(enum.StrEnum):
    """What a usage interval bills (``usage_intervals.kind``), each at its own rate."""

    COMPUTE = "compute"  # the instance, at the machine's ``rate``
    DISK = "disk"  # its boot disk, at ``disk_rate`` (also while stopped)
    ADDRESS = "address"  # its public IPv4 address, at ``address_rate``
    VOLUME = "volume"  # a network disk, on the volume's ledger row (``models.Volume``)


class NoticeKind(enum.StrEnum):
    """What a budget notice claims, once per policy, period and mark (``budget_notices.kind``):
    the claim is how two schedulers agree that one of them tells it."""

    ACTUAL = "actual"  # spending reached a threshold (mark: the percent)
    FORECAST = "forecast"  # the period's forecast reached a threshold (mark: the percent)
    EXHAUSTED = "exhausted"  # the budget is spent: launches blocked (mark: 100)
    REPORT = "report"  # a scheduled report was due (mark: when)
    POLICY_ERROR = "policy-error"  # a policy file failed to load (mark: its digest)


class MemberKind(enum.StrEnum):
    """What a database role is in a team's state (``team_members.kind``): what it may do there
    (docs/TEAM.md, the roles × actions table)."""

    MEMBER = "member"  # acts on its own machines and those its act_as grants name
    ADMIN = "admin"  # applies the team's rules; acts on every machine
    SCHEDULER = "scheduler"  # the scheduler's (and the team dashboard's) role: every machine


#: Events that say a machine runs from then on (how long it has been running).
RUNNING_SINCE = (EventKind.LAUNCHED, EventKind.ADOPTED, EventKind.STARTED, EventKind.RUNNING)
#: Events of a launch: the attempt it was, what it was given.
LAUNCHES = (EventKind.LAUNCHED, EventKind.ADOPTED)


class AttemptOutcome(enum.StrEnum):
    """How one candidate of an ``up`` ended: launched, the failure class that blocked its zone,
    region or cloud, or skipped because an earlier failure already blocked it."""

    LAUNCHED = "launched"
    CAPACITY = "capacity"
    QUOTA = "quota"
    AUTH = "auth"
    SETTINGS = "settings"
    INVALID = "invalid"
    ERROR = "error"
    SKIPPED = "skipped"


#: state_meta's row saying a state was made on a simulated clock (provisioner.realclock), and the
#: query that reads it (also from sqlite3 and libpq, as provisioner.entry's ``status`` does)
STATE_CLOCK, SIMULATED = "clock", "simulated"
STATE_CLOCK_SQL = f"SELECT value FROM state_meta WHERE key = '{STATE_CLOCK}'"

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def epoch_us(at: datetime) -> int:
    """Microseconds since 1970 (UTC): how the ledger's SQL compares and sums times."""
    return (at - EPOCH) // timedelta(microseconds=1)


def observed(inst: Any, public_ip: str | None) -> tuple[MachineStatus, str | None]:
    """A machine's status and address by its cloud's answer ``inst`` (an Instance, or None: the
    cloud no longer knows it, so it is terminated). A restarted machine may have a new address
    (AWS, GCP and Yandex give dynamic ones; `ssh` must not connect to the old); one reported
    without any keeps the recorded ``public_ip``. Unchanged from the record: nothing to write."""
    if inst is None:
        return MachineStatus.TERMINATED, public_ip
    return MachineStatus(inst.state), inst.public_ip or public_ip


@cache  # the files a process was installed with
def _revisions() -> tuple[frozenset[str], str]:
    """Every migration's revision, and the newest: the one no other revises, read from the
    version files' ``revision`` and ``down_revision`` lines (not Alembic's start-up, ~90 ms;
    tests/test_state.py checks it is Alembic's head)."""
    revisions, revised = set(), set()
    for f in (MIGRATIONS / "versions").glob("*.py"):
        src = f.read_text(encoding="utf-8")
        revisions.update(re.findall(r'^revision = "([^"]+)"', src, re.M))
        revised.update(re.findall(r'^down_revision = "([^"]+)"', src, re.M))
    (head,) = revisions - revised
    return frozenset(revisions), head


def schema_head() -> str:
    return _revisions()[1]


def current_sqlite(url: str) -> sqlite3.Connection | None:
    """A read-only connection to a SQLite state at the current schema, with the standard
    library: SQLAlchemy and the models (~0.3 s of start-up) are for a state to migrate or write
    to. None for anything else (another database, an older schema, an unreadable file): the
    full way migrates or explains."""
    import sqlite3

    path = url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else None
    if not path or path == ":memory:":
        return None
    try:
        # a URI, so read-only: the characters it gives a meaning to, escaped (RFC 3986)
        escaped = path.replace("%", "%25").replace("?", "%3F").replace("#", "%23")
        conn = sqlite3.connect(f"file:{escaped}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return None
    try:
        row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.Error:
        row = None
    if row is None or row[0] != schema_head():
        conn.close()
        return None
    return conn


def current_postgres(url: str, connect_timeout: int | None = None) -> Any | None:
    """A read-only connection (:mod:`provisioner.pq`: libpq, without psycopg's or SQLAlchemy's
    start-up) to a PostgreSQL state at the current schema: the URL as settings give it, which
    libpq reads as SQLAlchemy's psycopg dialect passes it (user, password, host, port,
    database, and libpq's own options in its query, such as ``options`` or
    ``application_name``). None for anything else (SQLite, an older schema, a server that
    refuses or is not there, no libpq to load): the full way migrates or explains."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("postgresql", "postgresql+psycopg"):
        return None
    from provisioner import pq

    try:
        conn = pq.connect(f"postgresql://{rest}", connect_timeout)
    except pq.Error:
        return None
    try:
        row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    except pq.Error:
        row = None
    if row is None or row[0] != schema_head():
        conn.close()
        return None
    return conn


def known_empty(url: str, all_: bool) -> bool:
    """Whether a SQLite state at the current schema holds no machine to show, asked in one
    query with the standard library (:func:`current_sqlite`)."""
    conn = current_sqlite(url)
    if conn is None:
        return False
    try:
        return holds_none(conn, all_)
    finally:
        conn.close()


def made_simulated(conn: Any) -> bool:
    """Whether the state on ``conn`` (sqlite3's, or :func:`current_postgres`'s) was made on a
    simulated clock (:mod:`provisioner.realclock`); one that cannot say is a real one."""
    import sqlite3

    errors: tuple[type[Exception], ...] = (sqlite3.Error,)
    if not isinstance(conn, sqlite3.Connection):
        from provisioner import pq

        errors = (pq.Error,)
    try:
        row = conn.execute(STATE_CLOCK_SQL).fetchone()
    except errors:
        return False
    return row is not None and row[0] == SIMULATED


def holds_none(conn: Any, all_: bool) -> bool:
    """Whether the state on ``conn`` (sqlite3's, or :func:`current_postgres`'s)
    holds no machine to show (any, with ``all_``)."""
    import sqlite3

    errors: tuple[type[Exception], ...] = (sqlite3.Error,)
    if not isinstance(conn, sqlite3.Connection):
        from provisioner import pq

        errors = (pq.Error,)
    where = "" if all_ else f" WHERE status NOT IN {ACTIVE_EXCLUDED!r}"
    try:
        (machines,) = conn.execute(f"SELECT count(*) FROM machines{where}").fetchone()
    except errors:
        return False
    return bool(machines == 0)
