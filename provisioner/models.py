"""Every table of the state database, in one module: Alembic's environment imports it, so
autogenerate sees the whole schema (tests/test_state.py checks it matches the migrations).

Amounts are stored as exact decimal text and times as UTC.
"""

from __future__ import annotations

import enum
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, TypeVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship, validates
from sqlalchemy.sql import operators

from provisioner.schema import (  # noqa: F401  (re-exported)
    ACTIVE_EXCLUDED,
    EPOCH,
    DeliveryStatus,
    EventKind,
    MachineStatus,
    NoticeKind,
    UsageKind,
    VolumeStatus,
    check_move,
    check_transition,
    epoch_us,
)


class DecimalText(TypeDecorator[Decimal]):
    """Exact decimals on every backend (SQLite has no decimal type)."""

    impl = String(40)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> str | None:
        return None if value is None else str(Decimal(value))

    def process_result_value(self, value: Any, dialect: Any) -> Decimal | None:
        return None if value is None else Decimal(value)


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in, aware UTC datetimes out, whatever the backend keeps."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the state database")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


#: The operators whose right side is a pattern: LIKE and what SQLAlchemy builds on it.
_PATTERNS = {
    getattr(operators, f"{neg}{op}_op")
    for op in ("like", "ilike", "startswith", "endswith", "contains")
    for neg in ("", "not_")
}


class _Vocabulary(TypeDecorator[Any]):
    """A value of :attr:`vocabulary` (a ``StrEnum`` of :mod:`provisioner.schema`) kept as its
    text: a write of anything else fails (``ValueError``), a read gives the member."""

    impl = String(16)
    cache_ok = True
    vocabulary: type[enum.StrEnum]

    def process_bind_param(self, value: Any, dialect: Any) -> str | None:
        return None if value is None else self.vocabulary(value).value

    def process_result_value(self, value: Any, dialect: Any) -> Any:
        return None if value is None else self.vocabulary(value)

    def coerce_compared_value(self, op: Any, value: Any) -> Any:
        """A pattern (``kind LIKE 'launch-%'``) is text, not a value of the vocabulary."""
        return String() if op in _PATTERNS else self


class StatusText(_Vocabulary):
    """A :class:`MachineStatus` kept as its value (the column stays ``VARCHAR(16)``)."""

    cache_ok = True  # not inherited: SQLAlchemy reads it from each class's own body
    vocabulary = MachineStatus


class VolumeStatusText(_Vocabulary):
    cache_ok = True  # not inherited: SQLAlchemy reads it from each class's own body
    vocabulary = VolumeStatus


class DeliveryStatusText(_Vocabulary):
    cache_ok = True  # not inherited: SQLAlchemy reads it from each class's own body
    vocabulary = DeliveryStatus


class UsageKindText(_Vocabulary):
    impl = String(8)
    cache_ok = True  # not inherited: SQLAlchemy reads it from each class's own body
    vocabulary = UsageKind


class NoticeKindText(_Vocabulary):
    cache_ok = True  # not inherited: SQLAlchemy reads it from each class's own body
    vocabulary = NoticeKind


class EventKindText(_Vocabulary):
    """An :class:`EventKind` (``VARCHAR(32)``). Only members are written; a kind an older
    version wrote and this one no longer knows reads back as its text, so history still
    shows."""

    impl = String(32)
    cache_ok = True  # not inherited: SQLAlchemy reads it from each class's own body
    vocabulary = EventKind

    def process_result_value(self, value: Any, dialect: Any) -> Any:
        return EventKind(value) if value in EventKind.__members__.values() else value


_E = TypeVar("_E", bound=enum.StrEnum)


def _moved(row: Base, vocabulary: type[_E], status: str) -> _E:
    """``row``'s new ``status`` if its transition table allows the move (every writer goes
    through it); a row being built (no status yet: a new intent, or a test's fixture) may
    start anywhere."""
    old = row.__dict__.get("status")
    if old is None or old == status:  # not a move
        return vocabulary(status)
    return check_move(vocabulary, old, status)


def new_id() -> str:
    return uuid.uuid4().hex


class Base(DeclarativeBase):
    pass


class Machine(Base):
    """One experiment's machine, from intent to termination. ``status`` moves only as
    :data:`provisioner.schema.TRANSITIONS` allows (checked on every assignment)."""

    __tablename__ = "machines"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(64))
    project: Mapped[str] = mapped_column(String(64), index=True)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    status: Mapped[MachineStatus] = mapped_column(StatusText, index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    spec_path: Mapped[str | None] = mapped_column(Text)
    cloud: Mapped[str | None] = mapped_column(String(16))
    region: Mapped[str | None] = mapped_column(String(64))
    zone: Mapped[str | None] = mapped_column(String(64))
    instance_type: Mapped[str | None] = mapped_column(String(64))
    gpu: Mapped[str | None] = mapped_column(String(16))
    gpu_count: Mapped[int | None] = mapped_column(Integer)
    market: Mapped[str | None] = mapped_column(String(8))  # spot | reserved
    instance_id: Mapped[str | None] = mapped_column(String(128))
    resource_name: Mapped[str | None] = mapped_column(String(64))
    rate: Mapped[Decimal | None] = mapped_column(DecimalText)  # per hour, fixed at launch
    currency: Mapped[str | None] = mapped_column(String(3))
    disk_gb: Mapped[int | None] = mapped_column(Integer)
    disk_rate: Mapped[Decimal | None] = mapped_column(DecimalText)  # per hour, fixed at launch
    public_ip: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    launched_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    terminated_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # scheduler (0002): sha256 of the agent's heartbeat token; `provisioner keep NAME --until`
    agent_token_hash: Mapped[str | None] = mapped_column(String(64), unique=True, index=True)
    kept_until: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # 0007: `lifecycle.autostop` / `provisioner autostop NAME 30m`; None: no autostop of its own
    autostop_seconds: Mapped[int | None] = mapped_column(Integer)
    # 0008: its public IPv4 per hour, fixed at launch (None: none, or its price is unknown), and
    # while the cloud bills it: "running" (released at stop) or "held" (until deleted)
    address_rate: Mapped[Decimal | None] = mapped_column(DecimalText)
    address_billed: Mapped[str | None] = mapped_column(String(8))

    events: Mapped[list[Event]] = relationship(
        back_populates="machine", order_by="Event.id", cascade="all, delete-orphan"
    )

    __table_args__ = (
        # one live machine per name: a second concurrent `up` of the same name fails to insert
        Index(
            "uq_machines_live_name",
            "name",
            unique=True,
            sqlite_where=text(f"status NOT IN {ACTIVE_EXCLUDED!r}"),
            postgresql_where=text(f"status NOT IN {ACTIVE_EXCLUDED!r}"),
        ),
    )

    @property
    def is_live(self) -> bool:
        return self.status not in ACTIVE_EXCLUDED

    @validates("status")
    def _move(self, _key: str, status: str) -> MachineStatus:
        return _moved(self, MachineStatus, status)


class Event(Base):
    __tablename__ = "events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    machine_id: Mapped[str] = mapped_column(ForeignKey("machines.id"), index=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    kind: Mapped[EventKind] = mapped_column(EventKindText)
    reason: Mapped[str | None] = mapped_column(String(64))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # 0008: who caused it, an e-mail or "scheduler" (provisioner.identity); filled on insert
    actor: Mapped[str | None] = mapped_column(String(128))

    machine: Mapped[Machine] = relationship(back_populates="events")

    @validates("kind")
    def _known(self, _key: str, kind: str) -> EventKind:
        return EventKind(kind)  # a kind no reader knows fails where it is written

    __table_args__ = (Index("ix_events_reason_at", "reason", "at"),)  # scheduler stops, budget


USAGE_INDEXES = {
    "ix_usage_machine_rate": ("machine_id", "kind", "currency", "rate", "start_us", "end_us"),
    "ix_usage_rate_start": ("currency", "rate", "start_us", "end_us", "kind", "machine_id"),
    "ix_usage_rate_end": ("currency", "rate", "end_us", "start_us", "kind", "machine_id"),
}


class UsageInterval(Base):
    """A span of billing at one rate: ``compute`` while the machine runs, ``disk`` while it
    exists. Open intervals have no end. (machine, kind, start) is unique: re-recording a
    transition never double-counts. ``start_us``/``end_us`` (0005) repeat the times as integer
    microseconds since 1970, kept in step on assignment: reports clamp and sum them in SQL
    exactly, and SQLite compares integers far faster than its text timestamps."""

    __tablename__ = "usage_intervals"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    machine_id: Mapped[str] = mapped_column(ForeignKey("machines.id"), index=True)
    kind: Mapped[UsageKind] = mapped_column(UsageKindText)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    rate: Mapped[Decimal] = mapped_column(DecimalText)  # per hour
    currency: Mapped[str] = mapped_column(String(3))
    start_us: Mapped[int] = mapped_column(BigInteger)
    end_us: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        UniqueConstraint("machine_id", "kind", "started_at", name="uq_usage_machine_kind_start"),
        Index("ix_usage_period", "started_at", "ended_at"),
        # (0004) never two open intervals of one kind: a second concurrent start fails to insert
        Index(
            "uq_usage_one_open",
            "machine_id",
            "kind",
            unique=True,
            sqlite_where=text("ended_at IS NULL"),
            postgresql_where=text("ended_at IS NULL"),
        ),
        # reports (0005): indexes that cover their queries, so SQLite reads them in order
        # instead of sorting a million rows (see ledger.tally, ledger.day_tally)
        *(Index(name, *cols) for name, cols in USAGE_INDEXES.items()),
    )

    @validates("started_at", "ended_at")
    def _keep_us(self, key: str, value: datetime | None) -> datetime | None:
        us = None if value is None else epoch_us(value)
        if key == "started_at":
            self.start_us = us  # type: ignore[assignment]
        else:
            self.end_us = us
        return value


# --- the scheduler (0002) ------------------------------------------------------------------


class Heartbeat(Base):
    """One report of a machine's agent: each GPU's utilisation and memory."""

    __tablename__ = "heartbeats"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    machine_id: Mapped[str] = mapped_column(ForeignKey("machines.id"))
    at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)  # the scheduler's clock
    gpus: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    max_util: Mapped[float | None] = mapped_column(Float)  # None: the agent saw no GPU
    ssh_sessions: Mapped[int | None] = mapped_column(Integer)  # 0007; None: an older agent
    pulled: Mapped[bool | None] = mapped_column(Boolean)  # 0013; read over SSH, not posted

    __table_args__ = (Index("ix_heartbeats_machine_at", "machine_id", "at"),)


class SignedMark(Base):
    """The newest signed ``time`` an agent's route accepted from a machine: a request not
    newer is a replay (409), also after the scheduler restarts (0008)."""

    __tablename__ = "signed_marks"

    route: Mapped[str] = mapped_column(String(32), primary_key=True)
    machine_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    at_ms: Mapped[int] = mapped_column(BigInteger)


class Lease(Base):
    """Who leads one scheduler job, until when (see :mod:`provisioner.jobs.lease`)."""

    __tablename__ = "scheduler_leases"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)


class EndpointOutage(Base):
    """A span in which the heartbeat endpoint refused connections (``address-limit``,
    ``connection-limit``) or was not running (``down``): heartbeats may have been lost, so
    silence then is never counted as idle (0008). ``ended_at`` None: still going on."""

    __tablename__ = "endpoint_outages"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime, index=True)
    reason: Mapped[str] = mapped_column(String(32))
    holder: Mapped[str] = mapped_column(String(128))
    refused: Mapped[int] = mapped_column(Integer, default=0)


# --- budgets (0003) -------------------------------------------------------------------------


class Notice(Base):
    """A budget alert (``actual``/``forecast`` at a threshold), an ``exhausted`` mark or a
    scheduled ``report`` (at its due time) — each recorded once per policy and period."""

    __tablename__ = "budget_notices"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    policy: Mapped[str] = mapped_column(String(128))
    kind: Mapped[NoticeKind] = mapped_column(NoticeKindText)
    period_start: Mapped[datetime] = mapped_column(UTCDateTime)
    mark: Mapped[str] = mapped_column(String(40))
    at: Mapped[datetime] = mapped_column(UTCDateTime)
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)

    __table_args__ = (
        UniqueConstraint("policy", "kind", "period_start", "mark", name="uq_budget_notice"),
    )


# --- personal tokens (0008) ------------------------------------------------------------------


class TeamKey(Base):
    """A key the whole team shares, its public half published here for every ``up`` (0013):
    ``pull``, the key the scheduler reads each machine's agent report with. The private half
    stays in the scheduler's home, never here."""

    __tablename__ = "team_keys"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    public_key: Mapped[str] = mapped_column(Text)
    fingerprint: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    created_by: Mapped[str] = mapped_column(String(128))


class Token(Base):
    """A personal token of a user (``provisioner token create``): only its salted scrypt hash
    is kept, never the token. The token is ``<id>.<secret>``: the id finds the row."""

    __tablename__ = "tokens"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    user: Mapped[str] = mapped_column(String(128), index=True)
    salt: Mapped[str] = mapped_column(String(32))
    hash: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    created_by: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


# --- volumes (0006) -------------------------------------------------------------------------

#: the ``market`` of a volume's ledger row (see :class:`Volume`)
VOLUME_MARKET = "volume"


class Volume(Base):
    """A network disk of a project, by name: written as an intent (``creating``, with its
    ``token``) before the cloud is asked, created idempotently by that token, deleted only by
    ``volume rm``. Its ``rate`` (per hour) is fixed at creation.

    Billing: the ledger prices ``usage_intervals``, whose rows belong to a machine and are
    summed by the machine's project, owner and cloud (``ledger.sums``). A volume bills with no
    machine at all, so each volume has a ledger row in ``machines`` of the same id — name
    ``volume:NAME`` (no machine name has a colon), ``market`` ``volume``, status
    ``terminated`` (never live: no listing, reconcile or limit counts it) — and one
    ``volume`` interval on it from creation to deletion. Every report, budget and forecast
    then counts volumes by project, owner and cloud unchanged; the alternative, intervals
    that name a machine or a volume, would rewrite every ledger query and its indexes."""

    __tablename__ = "volumes"

    id: Mapped[str] = mapped_column(ForeignKey("machines.id"), primary_key=True)
    project: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(64))
    owner: Mapped[str] = mapped_column(String(128))
    cloud: Mapped[str] = mapped_column(String(16))
    region: Mapped[str] = mapped_column(String(64))
    zone: Mapped[str] = mapped_column(String(64))
    size_gb: Mapped[int] = mapped_column(Integer)
    token: Mapped[str] = mapped_column(String(64))
    volume_id: Mapped[str | None] = mapped_column(String(128))  # the cloud's
    # moves only as schema.VOLUME_TRANSITIONS allows (checked on every assignment)
    status: Mapped[VolumeStatus] = mapped_column(VolumeStatusText, index=True)
    attached_machine_id: Mapped[str | None] = mapped_column(ForeignKey("machines.id"))
    rate: Mapped[Decimal | None] = mapped_column(DecimalText)  # per hour, fixed at creation
    currency: Mapped[str] = mapped_column(String(3))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    __table_args__ = (
        # one live volume per project and name: a second concurrent create fails to insert
        Index(
            "uq_volumes_live_name",
            "project",
            "name",
            unique=True,
            sqlite_where=text(f"status != '{VolumeStatus.DELETED}'"),
            postgresql_where=text(f"status != '{VolumeStatus.DELETED}'"),
        ),
    )

    @validates("status")
    def _move(self, _key: str, status: str) -> VolumeStatus:
        return _moved(self, VolumeStatus, status)


# --- notify (0008) --------------------------------------------------------------------------


class Delivery(Base):
    """One notice to one channel (telegram, slack, webhook, email): ``sent``, ``retrying`` (at
    ``next_at``) or ``failed`` with the reason, and its attempts. ``key`` names the notice and
    channel, so a notice is queued once. ``channel`` keeps the channel's settings without any
    secret (only the names of the variables holding them)."""

    __tablename__ = "deliveries"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(255), unique=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    topic: Mapped[str] = mapped_column(String(32))
    kind: Mapped[str] = mapped_column(String(16))  # telegram | slack | webhook | email
    target: Mapped[str] = mapped_column(String(255))
    channel: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    subject: Mapped[str] = mapped_column(Text)
    text: Mapped[str] = mapped_column(Text)
    policy: Mapped[str | None] = mapped_column(String(128))
    machine: Mapped[str | None] = mapped_column(String(128))
    # moves only as schema.DELIVERY_TRANSITIONS allows (checked on every assignment)
    status: Mapped[DeliveryStatus] = mapped_column(DeliveryStatusText, index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    error: Mapped[str | None] = mapped_column(Text)
    done_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    @validates("status")
    def _move(self, _key: str, status: str) -> DeliveryStatus:
        return _moved(self, DeliveryStatus, status)


# --- team rules (0014) ----------------------------------------------------------------------


class TeamRules(Base):
    """One version of the team's rules (policies, member map) as an admin applied it: the
    newest is in force. Append-only: a change is a new version, never an edit."""

    __tablename__ = "team_rules"

    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    applied_at: Mapped[datetime] = mapped_column(UTCDateTime)
    applied_by: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(128))
    digest: Mapped[str] = mapped_column(String(64))
    document: Mapped[str] = mapped_column(Text)
    note: Mapped[str | None] = mapped_column(Text)


class TeamMember(Base):
    """A database role of the team, as the newest rules map it: its e-mail and its kind
    (``member``, ``admin``, ``scheduler``)."""

    __tablename__ = "team_members"

    role: Mapped[str] = mapped_column(String(128), primary_key=True)
    email: Mapped[str] = mapped_column(String(254))
    kind: Mapped[str] = mapped_column(String(16))
    version: Mapped[int] = mapped_column(Integer)


class TeamGrant(Base):
    """One ``act_as`` grant of the newest rules, flattened for the database's own checks:
    whoever matches ``actor_glob`` may act for an owner matching ``owner_glob`` on a project
    matching ``project_glob`` (fnmatch globs)."""

    __tablename__ = "team_grants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    version: Mapped[int] = mapped_column(Integer)
    actor_glob: Mapped[str] = mapped_column(String(254))
    owner_glob: Mapped[str] = mapped_column(String(254))
    project_glob: Mapped[str] = mapped_column(String(254))


class StateMeta(Base):
    """A fact about the state itself, set when it is made: ``clock`` is ``simulated`` for a
    state made on a shifted clock (tests, what-ifs), whose writes may then use it."""

    __tablename__ = "state_meta"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class JobLog(Base):
    """A job's output kept with the state when it ended (0016): its last ``size`` bytes at most
    :data:`provisioner.machines.joblogs.KEEP_BYTES`, one row per attempt (a ``run`` started
    again after a preemption, on the machine or its replacement)."""

    __tablename__ = "job_logs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    machine_id: Mapped[str] = mapped_column(String(64), index=True)
    job: Mapped[str] = mapped_column(String(64))
    attempt: Mapped[int] = mapped_column(Integer)
    stage: Mapped[str] = mapped_column(String(16))  # run | setup (the setup failed)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(String(32))  # exited | killed | cancelled | …
    ended_at: Mapped[datetime] = mapped_column(UTCDateTime)
    size: Mapped[int] = mapped_column(BigInteger)  # the whole output's bytes
    text: Mapped[bytes] = mapped_column(LargeBinary)  # its last bytes, within the bound
    truncated: Mapped[bool] = mapped_column(Boolean)


class WorkdirCopy(Base):
    """The workdir as ``up`` took it (0016): a gzipped tar of the files copied, within the
    workdir limits, so a relaunch (by any scheduler, on any host) restores the same files."""

    __tablename__ = "workdirs"

    machine_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    taken_at: Mapped[datetime] = mapped_column(UTCDateTime)
    source: Mapped[str] = mapped_column(Text)  # the folder it was taken from
    files: Mapped[int] = mapped_column(Integer)
    archive: Mapped[bytes] = mapped_column(LargeBinary)
