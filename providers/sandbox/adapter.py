"""The sandbox cloud: a simulated cloud behind the same contract as the real adapters.

It keeps its machines in a SQLite file of its own (``db_path``), so several processes see one
cloud. Launch latency, per-zone capacity, GPU quota per region, throttling, auth failure and
spot preemption are injectable from options (settings) or at run time (:meth:`inject`,
:meth:`preempt`). Its regions, types and prices are its own: it never pretends to be a real cloud.

Options: :class:`providers.sandbox.SandboxOptions`. Its clock is the application's.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from functools import cached_property
from pathlib import Path
from typing import Any

from providers.base import (
    TAG_MACHINE,
    TAG_MANAGED_BY,
    TAG_MANAGED_BY_VALUE,
    AuthError,
    CapacityError,
    Instance,
    InstanceRef,
    LaunchRequest,
    MachineState,
    NotFound,
    Provider,
    ProviderError,
    QuotaError,
    Throttled,
    VolumeRequest,
    port_open,
)
from providers.sandbox import SPEC, SandboxOptions
from providers.sandbox.jobs import SandboxJobs
from providers.sandbox.volumes import SandboxVolumes
from providers.sandbox.volumes import release as release_volumes

_SCHEMA = """
CREATE TABLE IF NOT EXISTS machines (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, token TEXT NOT NULL UNIQUE,
    region TEXT NOT NULL, zone TEXT NOT NULL, instance_type TEXT NOT NULL,
    gpu TEXT NOT NULL, gpu_count INTEGER NOT NULL, spot INTEGER NOT NULL,
    preemption_action TEXT NOT NULL, state TEXT NOT NULL, reason TEXT,
    labels TEXT NOT NULL, user_data TEXT, created_at TEXT NOT NULL, public_ip TEXT NOT NULL,
    stopped_at TEXT
);
CREATE TABLE IF NOT EXISTS volumes (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, token TEXT NOT NULL UNIQUE,
    region TEXT NOT NULL, zone TEXT NOT NULL, size_gb INTEGER NOT NULL,
    state TEXT NOT NULL, labels TEXT NOT NULL, attached_to TEXT, device_index INTEGER,
    created_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS faults (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS calls (n INTEGER NOT NULL);
"""
_OCCUPYING = ("pending", "running", "stopping")
_UPSERT_FAULT = (
    "INSERT INTO faults VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value"
)


class SandboxProvider(SandboxJobs, Provider):
    spec = SPEC
    options: SandboxOptions

    def __init__(self, options: Any = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.db_path = Path(self.options.db_path or "sandbox.db")
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._procs: dict[Path, subprocess.Popen[bytes]] = {}  # jobs this process started
        with self._db() as db:
            if not db.execute("SELECT 1 FROM calls").fetchone():
                db.execute("INSERT INTO calls VALUES (0)")

    @cached_property
    def volumes(self) -> SandboxVolumes:
        return SandboxVolumes(self)

    # -- plumbing --------------------------------------------------------------------------

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """One transaction on the adapter's one connection (opened on first use, 0600 like the
        state: a new connection per call cost more than the call)."""
        with self._lock:
            if self._conn is None:
                if not self.db_path.exists():
                    os.close(os.open(self.db_path, os.O_CREAT | os.O_WRONLY, 0o600))
                conn = sqlite3.connect(
                    self.db_path, timeout=30, isolation_level=None, check_same_thread=False
                )
                conn.row_factory = sqlite3.Row
                conn.execute("PRAGMA journal_mode=WAL")
                conn.executescript(_SCHEMA)
                columns = {r["name"] for r in conn.execute("PRAGMA table_info(machines)")}
                if "stopped_at" not in columns:  # a sandbox file from before it kept the time
                    conn.execute("ALTER TABLE machines ADD COLUMN stopped_at TEXT")
                self._conn = conn
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _fault(self, db: sqlite3.Connection, key: str) -> Any:
        row = db.execute("SELECT value FROM faults WHERE key = ?", (key,)).fetchone()
        return json.loads(row["value"]) if row else getattr(self.options, key)

    def inject(self, **faults: Any) -> None:
        """Set faults at run time, shared by every process using this sandbox
        (``capacity={"sandbox-us-1a": 0}``, ``throttle=3``, ``auth_fail=True``…)."""
        with self._db() as db:
            for key, value in faults.items():
                db.execute(
                    _UPSERT_FAULT,
                    (key, json.dumps(value)),
                )

    @property
    def api_calls(self) -> int:
        """How many API calls this sandbox has served (for tests and benchmarks)."""
        with self._db() as db:
            return int(db.execute("SELECT n FROM calls").fetchone()["n"])

    def _call(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        def attempt() -> Any:
            refused: ProviderError | None = None
            with self._db() as db:  # one transaction: counted, and committed when refused
                db.execute("UPDATE calls SET n = n + 1")
                left = int(self._fault(db, "throttle") or 0)
                if self._fault(db, "auth_fail"):
                    refused = AuthError(
                        "sandbox: credentials refused (injected)", code="SandboxAuth"
                    )
                elif left > 0:
                    db.execute(_UPSERT_FAULT, ("throttle", json.dumps(left - 1)))
                    refused = Throttled(
                        "sandbox: request rate exceeded (injected)", code="SandboxThrottled"
                    )
                else:
                    db.execute("SAVEPOINT act")
                    try:
                        return fn(db)
                    except ProviderError as e:  # refused by the cloud: counted all the same
                        db.execute("ROLLBACK TO act")
                        refused = e
            raise refused

        return self.call(attempt)

    def _now(self) -> datetime:
        return self.clock()

    def _instance(self, db: sqlite3.Connection, row: sqlite3.Row) -> Instance:
        row = self._maybe_preempt(db, row)
        state = (
            MachineState.PREEMPTED if row["reason"] == "preempted" else MachineState(row["state"])
        )
        return Instance(
            id=row["id"],
            name=row["name"],
            region=row["region"],
            zone=row["zone"],
            instance_type=row["instance_type"],
            state=state,
            spot=bool(row["spot"]),
            labels=json.loads(row["labels"]),
            public_ip=row["public_ip"],
            private_ip=None,
            launched_at=datetime.fromisoformat(row["created_at"]),
            state_reason=row["reason"],
            # the instant this cloud stopped, took or deleted it, kept in its own table
            stopped_at=datetime.fromisoformat(row["stopped_at"]) if row["stopped_at"] else None,
        )

    def _maybe_preempt(self, db: sqlite3.Connection, row: sqlite3.Row) -> sqlite3.Row:
        after = self._fault(db, "preempt_after_seconds")
        if after is None or not row["spot"] or row["state"] != "running":
            return row
        due = datetime.fromisoformat(row["created_at"]) + timedelta(seconds=float(after))
        if self._now() < due:
            return row
        return self._preempt_row(db, row, at=due)  # taken when due, whenever it is looked at

    def _preempt_row(
        self, db: sqlite3.Connection, row: sqlite3.Row, at: datetime | None = None
    ) -> sqlite3.Row:
        state = "terminated" if row["preemption_action"] == "terminate" else "stopped"
        db.execute(
            "UPDATE machines SET state = ?, reason = 'preempted', stopped_at = ? WHERE id = ?",
            (state, (at or self._now()).isoformat(), row["id"]),
        )
        if state == "terminated":
            release_volumes(db, row["id"])
        self._kill_jobs(row["id"])
        return db.execute("SELECT * FROM machines WHERE id = ?", (row["id"],)).fetchone()

    def _check_capacity(self, db: sqlite3.Connection, zone: str, instance_type: str) -> None:
        """A launch, or the start of a stopped machine, in a zone whose injected capacity is
        used up: a capacity error (a stopped machine holds no capacity, as on the clouds)."""
        cap = (self._fault(db, "capacity") or {}).get(zone)
        if cap is None:
            return
        used = db.execute(
            f"SELECT COUNT(*) FROM machines WHERE zone = ? AND state IN {_OCCUPYING}", (zone,)
        ).fetchone()[0]
        if used >= int(cap):
            raise CapacityError(
                f"sandbox: zone {zone} has no {instance_type} capacity",
                code="SandboxZoneExhausted",
            )

    def _row(self, db: sqlite3.Connection, ref: InstanceRef) -> sqlite3.Row:
        row = db.execute("SELECT * FROM machines WHERE id = ?", (ref.id,)).fetchone()
        if row is None:
            raise NotFound(f"sandbox: no machine {ref.id}", code="SandboxNotFound")
        return row

    # -- contract --------------------------------------------------------------------------

    @property
    def ssh_user(self) -> str:
        return self.options.ssh_user or self.spec.ssh_user

    @property
    def ssh_port(self) -> int:
        return self.options.ssh_port

    def accepts_ssh(self, instance: Instance, timeout: float = 3) -> bool:
        """A simulated machine answers at once; one pointed at a real host is asked."""
        if self.options.public_ip is None:
            return instance.state is MachineState.RUNNING
        return port_open(self.options.public_ip, self.options.ssh_port, timeout)

    def probe(self) -> str:
        """One call, as a real cloud's check makes one: an injected refusal shows here too."""
        self._call(lambda db: None)
        return "simulated cloud, no credentials needed"

    def launch(self, request: LaunchRequest) -> Instance:
        made: list[str] = []

        def create(db: sqlite3.Connection) -> Instance:
            row = db.execute("SELECT * FROM machines WHERE token = ?", (request.token,)).fetchone()
            if row is not None:  # the same intent again: the same machine
                return self._instance(db, row)
            self._check_capacity(db, request.zone, request.instance_type)
            quota = (self._fault(db, "quota_gpus") or {}).get(request.region)
            if quota is not None:
                used = db.execute(
                    "SELECT COALESCE(SUM(gpu_count), 0) FROM machines"
                    f" WHERE region = ? AND state IN {_OCCUPYING}",
                    (request.region,),
                ).fetchone()[0]
                if used + request.gpu_count > int(quota):
                    raise QuotaError(
                        f"sandbox: GPU quota of {quota} in {request.region} exceeded",
                        code="SandboxGpuQuota",
                    )
            iid = "sbx-" + secrets.token_hex(6)
            made.append(iid)
            # TEST-NET-2, never routable, unless settings point its machines at a real host
            ip = self.options.public_ip or f"198.51.100.{secrets.randbelow(250) + 2}"
            db.execute(
                "INSERT INTO machines VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    iid,
                    request.name,
                    request.token,
                    request.region,
                    request.zone,
                    request.instance_type,
                    request.gpu,
                    request.gpu_count,
                    int(request.spot),
                    request.preemption_action,
                    "running",
                    None,
                    json.dumps(dict(request.labels)),
                    request.user_data,
                    self._now().isoformat(),
                    ip,
                    None,
                ),
            )
            return self._instance(
                db, db.execute("SELECT * FROM machines WHERE id = ?", (iid,)).fetchone()
            )

        latency = self.options.latency_seconds
        if latency:
            time.sleep(latency)
        instance = self._call(create)
        if made and request.guard is not None:  # it boots: its agent starts
            self._start_guard(instance.id, request.guard)
        return instance

    def get(self, ref: InstanceRef) -> Instance:
        return self._call(lambda db: self._instance(db, self._row(db, ref)))

    def list_managed(
        self, regions: Sequence[str] | None = None, machine_id: str | None = None
    ) -> list[Instance]:
        def query(db: sqlite3.Connection) -> list[Instance]:
            out = []
            for row in db.execute(
                "SELECT * FROM machines WHERE state != 'terminated' ORDER BY created_at"
            ):
                labels = json.loads(row["labels"])
                if labels.get(TAG_MANAGED_BY) != TAG_MANAGED_BY_VALUE:
                    continue
                if machine_id and labels.get(TAG_MACHINE) != machine_id:
                    continue
                if regions and row["region"] not in regions:
                    continue
                out.append(self._instance(db, row))
            return out

        return self._call(query)

    def _set_state(self, ref: InstanceRef, state: str, *, allowed_from: tuple[str, ...]) -> bool:
        """Whether it moved (False: it was not in a state it moves from)."""

        def update(db: sqlite3.Connection) -> bool:
            row = self._row(db, ref)
            if row["state"] == "terminated" and state != "terminated":
                raise NotFound(f"sandbox: machine {ref.id} is terminated", code="SandboxNotFound")
            if row["state"] in allowed_from:
                halted = state != "running"
                if not halted:  # a start takes a place in its zone again
                    self._check_capacity(db, row["zone"], row["instance_type"])
                db.execute(
                    "UPDATE machines SET state = ?, reason = ?, stopped_at = ? WHERE id = ?",
                    (
                        state,
                        "user" if halted else None,
                        self._now().isoformat() if halted else None,
                        ref.id,
                    ),
                )
                if state == "terminated":
                    release_volumes(db, ref.id)
                if halted:
                    self._kill_jobs(ref.id)
                return True
            return False

        return bool(self._call(update))

    def stop(self, ref: InstanceRef) -> None:
        self._set_state(ref, "stopped", allowed_from=("pending", "running", "stopping"))

    def stop_many(self, refs: Sequence[InstanceRef]) -> dict[InstanceRef, ProviderError | None]:
        """One call for all of them, as a cloud's batch call."""
        return self._set_states(refs, "stopped", ("pending", "running", "stopping"))

    def terminate_many(
        self, refs: Sequence[InstanceRef]
    ) -> dict[InstanceRef, ProviderError | None]:
        return self._set_states(refs, "terminated", (*_OCCUPYING, "stopped"))

    def _set_states(
        self, refs: Sequence[InstanceRef], state: str, allowed_from: tuple[str, ...]
    ) -> dict[InstanceRef, ProviderError | None]:
        def update(db: sqlite3.Connection) -> dict[InstanceRef, ProviderError | None]:
            out: dict[InstanceRef, ProviderError | None] = {}
            for ref in dict.fromkeys(refs):
                row = db.execute("SELECT state FROM machines WHERE id = ?", (ref.id,)).fetchone()
                if row is None or (row["state"] == "terminated" and state != "terminated"):
                    out[ref] = (
                        None
                        if state == "terminated"
                        else NotFound(f"sandbox: no machine {ref.id}", code="SandboxNotFound")
                    )
                    continue
                if row["state"] in allowed_from:
                    db.execute(
                        "UPDATE machines SET state = ?, reason = 'user', stopped_at = ?"
                        " WHERE id = ?",
                        (state, self._now().isoformat(), ref.id),
                    )
                    if state == "terminated":
                        release_volumes(db, ref.id)
                    self._kill_jobs(ref.id)
                out[ref] = None
            return out

        try:
            return self._call(update)
        except ProviderError as e:  # the call itself refused: every machine's error
            return dict.fromkeys(dict.fromkeys(refs), e)

    def start(self, ref: InstanceRef) -> None:
        if self._set_state(ref, "running", allowed_from=("stopped",)):  # it boots again
            self._start_guard(ref.id)

    def terminate(self, ref: InstanceRef) -> None:
        with contextlib.suppress(NotFound):  # already gone: terminate is idempotent
            self._set_state(ref, "terminated", allowed_from=(*_OCCUPYING, "stopped"))

    # -- simulation hooks ------------------------------------------------------------------

    def preempt(self, ref: InstanceRef) -> None:
        """Take a spot machine back, as the cloud would."""

        def take(db: sqlite3.Connection) -> None:
            row = self._row(db, ref)
            if not row["spot"]:
                raise ValueError(f"sandbox: {ref.id} is not a spot machine")
            self._preempt_row(db, row)

        with self._db() as db:
            take(db)

    def create_unmanaged_volume(self, name: str, zone: str = "sandbox-us-1a") -> str:
        """A volume carrying our tag that no state row knows (for gc tests)."""
        return self.volumes.create(
            VolumeRequest(
                name=name,
                token="manual-" + secrets.token_hex(6),
                region=zone.rsplit("-", 1)[0],
                zone=zone,
                size_gb=10,
                labels={TAG_MANAGED_BY: TAG_MANAGED_BY_VALUE},
            )
        ).id

    def create_unmanaged(self, name: str, zone: str = "sandbox-us-1a") -> str:
        """A machine someone made by hand, without our tags (for list_managed tests)."""
        iid = "sbx-" + secrets.token_hex(6)
        with self._db() as db:
            db.execute(
                "INSERT INTO machines VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    iid,
                    name,
                    "manual-" + iid,
                    zone.rsplit("-", 1)[0],
                    zone,
                    "sbx-t4-1",
                    "T4",
                    1,
                    0,
                    "stop",
                    "running",
                    None,
                    "{}",
                    None,
                    self._now().isoformat(),
                    "198.51.100.1",
                    None,
                ),
            )
        return iid
