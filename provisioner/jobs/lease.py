"""Two schedulers on one database never act twice: each pass first takes a lease (a table row,
``UPDATE … WHERE expired OR mine``, the same on SQLite and PostgreSQL); the other skips the pass.
A pass renews it before each batch it acts on (:meth:`Held.renew`), so it cannot outlive it.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

from sqlalchemy import or_, update
from sqlalchemy.exc import IntegrityError

from provisioner.app import App
from provisioner.jobs.passes import Pass
from provisioner.models import Lease

HOLDER = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def acquire(app: App, job: str, now: datetime, holder: str = HOLDER) -> bool:
    """Take (or renew) the lease for ``job``; False while another holder's lease runs."""
    ttl = timedelta(seconds=app.settings.scheduler.lease_seconds)
    try:
        with app.db.session() as s:
            if s.get(Lease, job) is None:
                s.add(Lease(name=job, holder="", expires_at=EPOCH))
    except IntegrityError:  # another scheduler inserted it first: fine, it exists
        pass
    with app.db.session() as s:
        current = s.get(Lease, job)
        takeable = [holder] + ([current.holder] if current and _dead_here(current.holder) else [])
        won = s.execute(  # type: ignore[attr-defined]  # an UPDATE's result is a CursorResult
            update(Lease)
            .where(Lease.name == job, or_(Lease.expires_at < now, Lease.holder.in_(takeable)))
            .values(holder=holder, expires_at=now + ttl)
        ).rowcount
    return won == 1


def _dead_here(holder: str) -> bool:
    """A holder that was a process on this host which no longer runs (killed mid-pass): its
    lease need not be waited out."""
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def release(app: App, job: str, holder: str = HOLDER) -> None:
    with app.db.session() as s:
        s.execute(
            update(Lease).where(Lease.name == job, Lease.holder == holder).values(expires_at=EPOCH)
        )


class Held:
    """The lease of one pass; false when another scheduler holds it."""

    def __init__(self, app: App, job: str, holder: str, held: bool, dry_run: bool) -> None:
        self.app, self.job, self.holder, self.held, self.dry_run = app, job, holder, held, dry_run

    def __bool__(self) -> bool:
        return self.held

    def renew(self) -> bool:
        """Extend the lease from now before acting again: a pass longer than the lease keeps
        it. False when it was lost (it expired and another scheduler took it): act no more."""
        if self.dry_run or not self.held:
            return self.held
        self.held = acquire(self.app, self.job, self.app.clock.now(), self.holder)
        return self.held


@contextmanager
def leading(app: App, job: str, now: datetime, holder: str, dry_run: bool) -> Iterator[Held]:
    """Hold the lease for one pass. A dry run changes nothing, so it needs none."""
    if dry_run:
        yield Held(app, job, holder, True, True)
        return
    lease = Held(app, job, holder, acquire(app, job, now, holder), False)
    if not lease:
        yield lease
        return
    try:
        yield lease
    finally:
        if lease.held:
            release(app, job, holder)


def not_leader(job: str, app: App, dry_run: bool) -> Pass:
    with app.db.session() as s:
        lease = s.get(Lease, job)
        who = lease.holder if lease else "?"
    return Pass(job, leader=False, dry_run=dry_run, note=f"another scheduler ({who}) runs it")
