"""The heartbeat endpoint's own outages: spans in which it refused connections (over its
per-address or overall cap) or was not running. A heartbeat lost then is the scheduler's
doing, not the machine's, so silence overlapping an outage is never counted as idle, whatever
``unknown_counts_as_idle`` says (:func:`overlapping`).

The endpoint tells :class:`Recorder` of each refusal on its I/O thread (in memory, no I/O);
:meth:`Recorder.flush` writes the spans (before each sweep and every few seconds under the
daemon). A saturation ends :data:`QUIET` after its last refusal. Whether the endpoint runs is
kept as the time it was last seen running (a ``scheduler_leases`` row, :data:`ALIVE`): a
start after a stop or a crash records the span between as ``down``, and while no endpoint
runs, the span since it was last seen counts as one too.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sqlalchemy import or_, select

from provisioner.models import EndpointOutage, Lease

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from provisioner.app import App

log = logging.getLogger("provisioner.scheduler")

QUIET = timedelta(seconds=60)  # a saturation is over this long after its last refusal
FLUSH_SECONDS = 15  # the daemon writes refusals and its liveness this often
STALE = timedelta(seconds=4 * FLUSH_SECONDS)  # not seen running for longer: down
ALIVE = "endpoint.alive"  # the scheduler_leases row: when an endpoint was last seen running


@dataclass
class _Span:
    first: datetime
    last: datetime
    refused: int = 1
    row: int | None = None  # its row, once written


class Recorder:
    """One running endpoint's refusals and liveness."""

    def __init__(self, app: App, holder: str) -> None:
        self.app = app
        self.holder = holder
        self._lock = threading.Lock()
        self._open: dict[str, _Span] = {}  # reason → the refusals of that reason

    def refused(self, why: str) -> None:
        """A connection refused (``address-limit``/``connection-limit``): cheap, no I/O."""
        now = self.app.clock.now()
        with self._lock:
            span = self._open.get(why)
            if span is None:
                self._open[why] = _Span(now, now)
            else:
                span.last, span.refused = now, span.refused + 1

    def started(self) -> EndpointOutage | None:
        """The endpoint runs: the span since one was last seen running is recorded as
        ``down`` (none before the first start); the new ``down`` row or None."""
        now = self.app.clock.now()
        with self.app.db.session() as s:
            row = s.get(Lease, ALIVE)
            down = None
            if row is not None and row.expires_at < now:
                down = EndpointOutage(
                    started_at=row.expires_at,
                    ended_at=now,
                    reason="down",
                    holder=self.holder,
                    refused=0,
                )
                s.add(down)
            self._alive(s, row, now)
            return down

    def flush(self) -> None:
        """Write the refusals so far and that the endpoint runs."""
        now = self.app.clock.now()
        with self._lock:
            spans = {why: replace(span) for why, span in self._open.items()}
        ids: dict[str, int] = {}
        with self.app.db.session() as s:
            for why, sp in spans.items():
                row = s.get(EndpointOutage, sp.row) if sp.row is not None else None
                if row is None:
                    row = EndpointOutage(started_at=sp.first, reason=why, holder=self.holder)
                    s.add(row)
                    log.warning(
                        "the endpoint refuses connections (%s) since %s: silence does not "
                        "count as idle meanwhile",
                        why,
                        f"{sp.first:%Y-%m-%d %H:%M:%S} UTC",
                    )
                row.refused = sp.refused
                row.ended_at = sp.last if now - sp.last > QUIET else None
                if row.ended_at is not None:
                    log.warning("the endpoint refused %d connections (%s)", sp.refused, why)
                s.flush()
                ids[why] = row.id
            self._alive(s, s.get(Lease, ALIVE), now)
        with self._lock:
            for why, sp in spans.items():
                span = self._open.get(why)
                if span is None:
                    continue
                if span.last == sp.last and now - sp.last > QUIET:  # over, and nothing since
                    del self._open[why]
                else:
                    span.row = ids[why]

    def stopped(self) -> None:
        """The endpoint stops: its refusals written, and when it was last running."""
        self.flush()

    def _alive(self, s: Session, row: Lease | None, now: datetime) -> None:
        if row is None:
            s.add(Lease(name=ALIVE, holder=self.holder, expires_at=now))
        else:
            row.holder, row.expires_at = self.holder, max(row.expires_at, now)


def overlapping(app: App, start: datetime, end: datetime) -> list[tuple[datetime, datetime]]:
    """The endpoint's outages that overlap [start, end] (an open one ends at ``end``), and the
    span since an endpoint was last seen running when none runs now."""
    with app.db.session() as s:
        rows = s.execute(
            select(EndpointOutage.started_at, EndpointOutage.ended_at).where(
                EndpointOutage.started_at <= end,
                or_(EndpointOutage.ended_at.is_(None), EndpointOutage.ended_at >= start),
            )
        ).all()
        alive = s.get(Lease, ALIVE)
    out = [(a, b or end) for a, b in rows]
    if alive is not None and alive.expires_at < end - STALE:
        out.append((max(alive.expires_at, start), end))
    return out


def overlaps(spans: list[tuple[datetime, datetime]], start: datetime, end: datetime) -> bool:
    return any(a <= end and b >= start for a, b in spans)
