"""Heartbeats and preemption notices as the on-machine agent sends them: parsed (anything
else refused), kept for a live machine, pruned, and each machine's latest read back (for
``/metrics``). The signed endpoint that receives them is :mod:`provisioner.endpoint`; what
they say about idleness, :mod:`provisioner.idle`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, func, select

from provisioner.models import ACTIVE_EXCLUDED, Event, Heartbeat, Machine
from provisioner.schema import EventKind

if TYPE_CHECKING:
    from provisioner.app import App

log = logging.getLogger("provisioner.idle")


class BadHeartbeat(ValueError):
    pass


def parse_body(raw: bytes) -> list[dict[str, Any]]:
    """The GPUs of a heartbeat body ``{"gpus": [{"index", "util", "mem_used_mb",
    "mem_total_mb"}], "note": "..."}``; anything else is refused."""
    try:
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BadHeartbeat("body is not JSON (or nested too deep)") from None
    if not isinstance(body, dict) or not isinstance(body.get("gpus"), list):
        raise BadHeartbeat('body must be {"gpus": [...]}')
    if len(body["gpus"]) > 64:
        raise BadHeartbeat("more GPUs than a machine has")
    gpus: list[dict[str, Any]] = []
    for g in body["gpus"]:
        gpus.append(_gpu(g, len(gpus)))
    return gpus


def _gpu(g: Any, position: int) -> dict[str, Any]:
    """One GPU of a heartbeat body, checked (its index defaults to its ``position``)."""
    if not isinstance(g, dict):
        raise BadHeartbeat("each GPU is an object")
    util = g.get("util")
    if isinstance(util, bool) or not isinstance(util, int | float) or not 0 <= util <= 100:
        raise BadHeartbeat("util must be a percent")
    index = g.get("index", position)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 64:
        raise BadHeartbeat("index must be a GPU number")
    return {
        "index": index,
        "util": float(util),
        "mem_used_mb": _num(g.get("mem_used_mb")),
        "mem_total_mb": _num(g.get("mem_total_mb")),
    }


def parse_heartbeat(raw: bytes) -> dict[str, Any]:
    """A heartbeat body: its GPUs (:func:`parse_body`) and ``ssh_sessions``, the established
    SSH connections the agent counted. An older agent sends none: None, which autostop reads
    as no evidence of a session (it cannot block a stop it never reported)."""
    gpus = parse_body(raw)
    sessions = json.loads(raw).get("ssh_sessions")
    if sessions is not None and (
        isinstance(sessions, bool) or not isinstance(sessions, int) or not 0 <= sessions < 2**31
    ):
        raise BadHeartbeat("ssh_sessions must be a count")
    return {"gpus": gpus, "ssh_sessions": sessions}


def record_heartbeat(app: App, machine_id: str, body: dict[str, Any]) -> Machine | None:
    """:func:`record` of a parsed :func:`parse_heartbeat` body."""
    return record(app, machine_id, body["gpus"], ssh_sessions=body["ssh_sessions"])


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _live(s: Any, machine_id: str) -> Machine | None:
    return s.scalars(
        select(Machine).where(Machine.id == machine_id, Machine.status.not_in(ACTIVE_EXCLUDED))
    ).first()


def record(
    app: App, machine_id: str, gpus: list[dict[str, Any]], ssh_sessions: int | None = None
) -> Machine | None:
    """Store one heartbeat of ``machine_id``; None when it is no longer live."""
    with app.db.session() as s:
        m = _live(s, machine_id)
        if m is None:
            return None
        top = max((g["util"] for g in gpus), default=None)
        at = app.clock.now()
        s.add(Heartbeat(machine_id=m.id, at=at, gpus=gpus, max_util=top, ssh_sessions=ssh_sessions))
        return m


NOTICE_EVENT = EventKind.PREEMPTION_NOTICE


def parse_notice(raw: bytes) -> dict[str, Any]:
    """A notice body ``{"cloud", "event_id", "action", "not_before", "seen_at"}`` (times as
    ``YYYY-MM-DDTHH:MM:SSZ`` or null); anything else is refused."""
    try:
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BadHeartbeat("body is not JSON (or nested too deep)") from None
    if not isinstance(body, dict):
        raise BadHeartbeat("body must be an object")
    out: dict[str, Any] = {}
    for field, most in (("cloud", 32), ("event_id", 128), ("action", 32)):
        v = body.get(field)
        if not isinstance(v, str) or not 0 < len(v) <= most:
            raise BadHeartbeat(f"{field} must be a string of at most {most} characters")
        out[field] = v
    for field in ("not_before", "seen_at"):
        v = body.get(field)
        if v is not None:
            try:
                when = datetime.strptime(str(v), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
            except ValueError:
                raise BadHeartbeat(f"{field} must be YYYY-MM-DDTHH:MM:SSZ or null") from None
            v = when.isoformat()
        out[field] = v
    return out


def record_notice(app: App, machine_id: str, notice: dict[str, Any]) -> Machine | None:
    """Record a preemption notice of ``machine_id`` as a ``preemption-notice`` event with the
    cloud's time (``not_before``, when the cloud gives one), once per notice: the agent posts
    again after a lost answer. None when the machine is no longer live."""
    with app.db.session() as s:
        m = _live(s, machine_id)
        if m is None:
            return None
        known = s.scalars(
            select(Event.detail).where(Event.machine_id == m.id, Event.kind == NOTICE_EVENT)
        )
        if not any(d.get("event_id") == notice["event_id"] for d in known):
            s.add(
                Event(
                    machine_id=m.id,
                    at=app.clock.now(),
                    kind=NOTICE_EVENT,
                    reason=notice["action"],
                    detail=notice,
                )
            )
            log.warning(
                "%s: %s preemption notice (%s, not before %s)",
                m.name,
                notice["cloud"],
                notice["action"],
                notice["not_before"] or "unknown",
            )
        return m


def prune(app: App, older_than: datetime) -> int:
    with app.db.session() as s:
        result = s.execute(delete(Heartbeat).where(Heartbeat.at < older_than))
        return int(getattr(result, "rowcount", 0) or 0)  # a DML result (CursorResult)


def latest_heartbeats(app: App, since: datetime) -> list[tuple[Machine, Heartbeat]]:
    """Each live machine with its latest heartbeat after ``since``: one query."""
    with app.db.session() as s:
        latest = (
            select(Heartbeat.machine_id, func.max(Heartbeat.id).label("hid"))
            .where(Heartbeat.at >= since)
            .group_by(Heartbeat.machine_id)
            .subquery()
        )
        rows = s.execute(
            select(Machine, Heartbeat)
            .join(latest, latest.c.machine_id == Machine.id)
            .join(Heartbeat, Heartbeat.id == latest.c.hid)
            .where(Machine.status.not_in(ACTIVE_EXCLUDED))
        )
        return [(m, hb) for m, hb in rows]


def iter_latest_gpus(app: App, since: datetime) -> Iterator[tuple[Machine, dict[str, Any]]]:
    """Each live machine's GPUs from its latest heartbeat after ``since`` (for /metrics)."""
    for m, hb in latest_heartbeats(app, since):
        for g in hb.gpus:
            yield m, g
