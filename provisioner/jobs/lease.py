"""Two schedulers on one database never act twice: each pass first takes a lease (a table row,
``UPDATE … WHERE expired OR mine``, the same on SQLite and PostgreSQL); the other skips the pass.
A pass keeps it while it acts (:meth:`Held.each` renews it between machines and batches) and
stops acting once it finds it taken: :func:`run_pass` runs every job that acts on machines.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Protocol, TypeVar

from sqlalchemy import or_, update
from sqlalchemy.exc import IntegrityError

from provisioner.app import App
from provisioner.jobs.passes import Pass
from provisioner.models import Lease

HOLDER = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
T = TypeVar("T")


class Undone(Protocol):
    """An action a pass decided on: it says why it was not done."""

    error: str | None


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


def holder_of(app: App, job: str) -> str:
    with app.db.session() as s:
        lease = s.get(Lease, job)
        return lease.holder if lease else "?"


class Held:
    """The lease of one pass; false when another scheduler holds it (or took it midway)."""

    def __init__(
        self, app: App, job: str, holder: str, now: datetime, held: bool, dry_run: bool
    ) -> None:
        self.app, self.job, self.holder, self.held, self.dry_run = app, job, holder, held, dry_run
        self.ttl = timedelta(seconds=app.settings.scheduler.lease_seconds)
        self.renewed = now
        self.lost = ""  # why the pass stopped acting, once another scheduler took the lease

    def __bool__(self) -> bool:
        return self.held

    def renew(self) -> bool:
        """Before acting again: extend the lease from now, so a pass longer than the lease
        keeps it. False once it is lost (it ran out and another scheduler took it): act no
        more. Renewed only once a third of the term has passed since the last renewal: each
        action still starts with two thirds of the term ahead (nobody can have taken it), and
        a pass over many quick machines writes no row per machine."""
        if self.dry_run or not self.held:
            return self.held
        now = self.app.clock.now()
        if now - self.renewed < self.ttl / 3:
            return True
        with self.app.db.session() as s:  # still ours (even if it ran out): nobody acted
            kept = s.execute(  # type: ignore[attr-defined]  # an UPDATE's result: CursorResult
                update(Lease)
                .where(Lease.name == self.job, Lease.holder == self.holder)
                .values(expires_at=now + self.ttl)
            ).rowcount
        if kept == 1:
            self.renewed = now
            return True
        self.held = False
        self.lost = (
            f"stopped acting at {now:%Y-%m-%d %H:%M:%S} UTC: the lease ran out and another "
            f"scheduler ({holder_of(self.app, self.job)}) took it; its passes act on the rest"
        )
        return False  # the pass's note says so (the daemon logs it, the CLI shows it)

    def each(
        self, work: Iterable[T], actions: Callable[[T], Iterable[Undone]] | None = None
    ) -> Iterator[T]:
        """``work`` (machines, batches), the lease renewed before each piece; once it is
        lost, the rest is not done, and ``actions(piece)`` say so."""
        for piece in work:
            if self.renew():
                yield piece
            elif actions is not None:
                for a in actions(piece):
                    a.error = "not done: this scheduler lost its lease; the next pass acts"


@contextmanager
def leading(app: App, job: str, now: datetime, holder: str, dry_run: bool) -> Iterator[Held]:
    """Hold the lease for one pass. A dry run changes nothing, so it needs none."""
    if dry_run:
        yield Held(app, job, holder, now, True, True)
        return
    lease = Held(app, job, holder, now, acquire(app, job, now, holder), False)
    if not lease:
        yield lease
        return
    try:
        yield lease
    finally:
        if lease.held:
            release(app, job, holder)


def run_pass(
    app: App,
    job: str,
    now: datetime,
    body: Callable[[Held], Pass],
    *,
    holder: str = HOLDER,
    dry_run: bool = False,
) -> Pass:
    """One pass of ``job`` under its lease: skipped while another scheduler holds it; else
    ``body`` acts, keeping the lease through :meth:`Held.each`. A pass that lost the lease
    midway says so in its note."""
    with leading(app, job, now, holder, dry_run) as lease:
        if not lease:
            return not_leader(job, app, dry_run)
        result = body(lease)
        if lease.lost:
            result.note = lease.lost
        return result


def not_leader(job: str, app: App, dry_run: bool) -> Pass:
    who = holder_of(app, job)
    return Pass(job, leader=False, dry_run=dry_run, note=f"another scheduler ({who}) runs it")
