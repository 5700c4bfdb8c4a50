"""A preempted machine's relaunch tries, read from its events since its last preemption: the
scheduler's recovery counts them, ``status``, the summary and the budget forecast read whether
the machine is held (a refusal stands or the tries gave up) or still to be relaunched."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select

from provisioner.models import Event
from provisioner.schema import EventKind as K

BACKOFF = timedelta(minutes=1)  # after the first failed try; doubled per try …
BACKOFF_MAX = timedelta(hours=1)  # … up to this
MAX_ATTEMPTS = 10  # then: given up (about 4 h after the preemption), the machine stays held


def backoff(attempts: int) -> timedelta:
    """The wait after ``attempts`` failed tries before the next: 1, 2, 4 … 60 minutes."""
    return min(BACKOFF * 2 ** max(attempts - 1, 0), BACKOFF_MAX)


@dataclass
class Tries:
    """A lost machine's relaunch tries since its last preemption, read from its events."""

    attempts: int = 0
    last: datetime | None = None  # when the latest try failed or was refused
    refusal: Event | None = None  # the standing `relaunch-refused` (no other try since)
    gave_up: Event | None = None
    # the replacement launched while the preempted machine keeps its disk (a `relaunched` event
    # with `kept`), until it runs; its status is read by recovery (None: none launched)
    replaced_by: str | None = None
    replacement: str | None = None

    @property
    def next_try(self) -> datetime | None:
        """When the next try is due; None: given up (or none failed yet: at once)."""
        if self.gave_up is not None or self.last is None:
            return None
        return self.last + backoff(self.attempts)


def tries(events: Sequence[Event]) -> Tries:
    """The tries in one machine's ``events`` (oldest first) since it was last preempted."""
    t = Tries()
    for e in events:
        if e.kind == K.PREEMPTED:
            t = Tries()
        _count(t, e)
        _replacement(t, e)
        if _clears_refusal(e):
            t.refusal = None  # relaunched, started or ended by hand: nothing is held any more
    return t


def _count(t: Tries, e: Event) -> None:
    """A try's end in ``t``: a failed recovery, a refused relaunch (with the tries and the
    last try it says), giving up."""
    d = e.detail or {}
    if e.kind == K.RECOVER_FAILED:
        t.attempts, t.last, t.refusal = t.attempts + 1, utc(e.at), None
    elif e.kind == K.RELAUNCH_REFUSED:
        t.attempts += int(d.get("attempts", 1))
        t.last = utc(datetime.fromisoformat(d["last_try"])) if "last_try" in d else utc(e.at)
        t.refusal = e
    elif e.kind == K.RELAUNCH_GAVE_UP:
        t.gave_up = e


def _replacement(t: Tries, e: Event) -> None:
    """The machine kept preempted while its replacement runs: that replacement (a relaunch
    that kept it), or none once the replacement ended."""
    d = e.detail or {}
    if e.kind == K.REPLACEMENT_ENDED:
        t.replaced_by = None
    elif e.kind == K.RELAUNCHED and d.get("kept"):
        t.replaced_by = str(d.get("machine"))


def _clears_refusal(e: Event) -> bool:
    """A relaunch, a start (also in place after a preemption) or an end by hand."""
    return e.kind in (K.RELAUNCHED, K.STARTED) or (
        e.kind == K.TERMINATED and e.reason not in ("preempted", "relaunch-refused")
    )


def utc(at: datetime) -> datetime:
    """SQLite gives back naive UTC date-times."""
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def events(s: Any, machine_id: str) -> list[Event]:
    """One machine's events, oldest first."""
    return list(s.scalars(select(Event).where(Event.machine_id == machine_id).order_by(Event.id)))
