"""The idle signal: heartbeats from the on-machine agent, the endpoint that receives them, and
whether a machine has been idle for a rule's window.

Agents hold a per-machine token issued at launch; only its SHA-256 is stored, and it is the key
with which the agent signs each heartbeat (the token itself never travels again). The
endpoint (:class:`HeartbeatApp`, a WSGI application served by :mod:`provisioner.web`) serves
``POST /v1/heartbeat``, ``POST /v1/notice`` (a cloud's preemption notice, signed the same way),
``GET /metrics`` (Prometheus) and ``GET /healthz``.
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import delete, func, select

from policies.schema import IdleRule, Policy, matching
from provisioner import agent, tokens
from provisioner.models import (
    ACTIVE_EXCLUDED,
    Event,
    Heartbeat,
    Machine,
    SignedMark,
    UTCDateTime,
    epoch_us,
)
from provisioner.schema import RUNNING_SINCE, EventKind
from provisioner.web import MAX_BODY, Server, WSGIApp, respond

if TYPE_CHECKING:
    from provisioner.app import App

log = logging.getLogger("provisioner.idle")

Signal = Literal["idle", "busy", "unknown", "starting"]
RUNNING_SINCE_EVENTS = RUNNING_SINCE


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
        if not isinstance(g, dict):
            raise BadHeartbeat("each GPU is an object")
        util = g.get("util")
        if isinstance(util, bool) or not isinstance(util, int | float) or not 0 <= util <= 100:
            raise BadHeartbeat("util must be a percent")
        index = g.get("index", len(gpus))
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 64:
            raise BadHeartbeat("index must be a GPU number")
        gpus.append(
            {
                "index": index,
                "util": float(util),
                "mem_used_mb": _num(g.get("mem_used_mb")),
                "mem_total_mb": _num(g.get("mem_total_mb")),
            }
        )
    return gpus


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


# --- the signal ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Beat:
    at: datetime
    max_util: float | None


@dataclass(frozen=True)
class Evidence:
    """What the verdict needs of a machine's heartbeats for one window (times in microseconds
    since 1970): the first beat at or after ``start - grace`` and the latest one, the busiest
    GPU and the beats that saw no GPU at or after ``start``, and the longest silence between
    two beats at or after ``start - grace``. The database sums these up (:func:`evidence`), so
    a sweep over a thousand machines reads a row per machine, not each heartbeat."""

    first_us: int | None
    last_us: int | None
    top: float | None
    blind: int
    gap_us: int | None

    @classmethod
    def of(
        cls, beats: list[Beat], *, now: datetime, window: timedelta, grace: timedelta
    ) -> Evidence:
        """The same, from heartbeats in hand (oldest first)."""
        lo, start = epoch_us(now - window - grace), epoch_us(now - window)
        seen = [epoch_us(b.at) for b in beats if epoch_us(b.at) >= lo]
        inside = [b.max_util for b in beats if epoch_us(b.at) >= start]
        return cls(
            seen[0] if seen else None,
            seen[-1] if seen else None,
            max((u for u in inside if u is not None), default=None),
            sum(u is None for u in inside),
            max((b - a for a, b in itertools.pairwise(seen)), default=None),
        )


def judge(
    ev: Evidence,
    *,
    now: datetime,
    running_since: datetime | None,
    below: float,
    window: timedelta,
    grace: timedelta,
) -> Signal:
    """Idle = every GPU below ``below`` percent for the whole ``window``, seen without a gap
    longer than ``grace``. Silence for longer than ``grace`` (or an agent that sees no GPU)
    is ``unknown``; a machine that has not run for the whole window yet is ``starting``."""
    start = now - window
    if running_since is not None and running_since > start:
        return "starting"
    g, now_us = grace // timedelta(microseconds=1), epoch_us(now)
    if ev.first_us is None or ev.last_us is None or ev.last_us < now_us - g:
        return "unknown"
    if ev.top is not None and ev.top >= below:
        return "busy"
    if ev.blind:
        return "unknown"
    if ev.first_us > epoch_us(start) + g or (ev.gap_us is not None and ev.gap_us > g):
        return "unknown"
    return "idle"


def classify(
    beats: list[Beat],
    *,
    now: datetime,
    running_since: datetime | None,
    below: float,
    window: timedelta,
    grace: timedelta,
) -> Signal:
    """:func:`judge` of heartbeats in hand (oldest first)."""
    ev = Evidence.of(beats, now=now, window=window, grace=grace)
    return judge(ev, now=now, running_since=running_since, below=below, window=window, grace=grace)


def beat_machine(app: App) -> Any:
    """The heartbeat's machine id to group recent heartbeats by. On SQLite an expression, not
    the column: grouping by the column, SQLite walks the (machine, time) index over the whole
    day kept, for its order, instead of reading the last minutes by the time index (a day of
    1,000 machines: 0.29 s -> 0.04 s)."""
    col = Heartbeat.__table__.c.machine_id
    return col.concat("") if app.db.engine.dialect.name == "sqlite" else col


def evidence(
    app: App,
    machine_ids: Iterable[str],
    now: datetime,
    windows: Iterable[timedelta],
    grace: timedelta,
    busy_at: float | None = None,
) -> dict[tuple[str, timedelta], Evidence]:
    """Each machine's :class:`Evidence` for each window, summed up by the database (times as
    exact integer microseconds): one query for all machines, then the silences (``lag`` over
    each machine's beats, the costly part) only of those whose verdict still turns on them.
    ``busy_at``: the highest threshold of any rule; a machine whose busiest GPU reaches it is
    busy whatever its silences, and its ``gap_us`` is left None."""
    from sqlalchemy import and_, case, literal, type_coerce

    wanted, spans = set(machine_ids), sorted(set(windows))
    if not wanted or not spans:
        return {}
    col, us = _epoch_us(app)
    since = now - spans[-1] - grace
    g, now_us = grace // timedelta(microseconds=1), epoch_us(now)
    starts = [now - w for w in spans]
    bounds = [epoch_us(start - grace) for start in starts]  # the silences: from start - grace
    at, util = Heartbeat.at, Heartbeat.max_util  # compared as stored: no arithmetic per row
    machine = beat_machine(app)
    cols: list[Any] = [machine, func.max(at)]
    for start in starts:
        cols += [
            type_coerce(func.min(case((at >= start - grace, at))), UTCDateTime),
            func.max(case((at >= start, util))),
            func.sum(case((and_(at >= start, util.is_(None)), 1), else_=0)),
        ]
    out: dict[tuple[str, timedelta], Evidence] = {}
    silent: set[str] = set()  # machines whose silences decide some window's verdict
    with app.db.session() as s:
        query = select(*cols).where(at >= since).group_by(machine)
        if len(wanted) <= 500:  # a page of the fleet: by its machines' index, not the whole
            query = query.where(Heartbeat.machine_id.in_(wanted))
        for row in s.execute(query):
            if row[0] not in wanted:
                continue
            for i, (w, start) in enumerate(zip(spans, starts, strict=True)):
                first, top, blind = row[2 + 3 * i : 5 + 3 * i]
                ev = out[row[0], w] = Evidence(
                    None if first is None else epoch_us(first),
                    None if first is None else epoch_us(row[1]),
                    None if top is None else float(top),
                    int(blind or 0),
                    None,
                )
                if (
                    ev.first_us is not None
                    and ev.last_us is not None
                    and ev.last_us >= now_us - g
                    and (busy_at is None or ev.top is None or ev.top < busy_at)
                    and not ev.blind
                    and ev.first_us <= epoch_us(start) + g
                ):
                    silent.add(row[0])
        todo = sorted(silent)
        for k in range(0, len(todo), 500):  # bound the IN list
            gaps = (
                select(
                    Heartbeat.machine_id.label("mid"),
                    us.label("us"),
                    func.lag(us)
                    .over(partition_by=Heartbeat.machine_id, order_by=col)
                    .label("prev"),
                )
                .where(Heartbeat.at >= since, Heartbeat.machine_id.in_(todo[k : k + 500]))
                .subquery()
            )
            q = [gaps.c.mid] + [
                func.max(case((gaps.c.prev >= literal(lo), gaps.c.us - gaps.c.prev)))
                for lo in bounds
            ]
            for row in s.execute(select(*q).group_by(gaps.c.mid)):
                for i, w in enumerate(spans):
                    if row[1 + i] is not None and (row[0], w) in out:
                        out[row[0], w] = replace(out[row[0], w], gap_us=int(row[1 + i]))
    return out


def _epoch_us(app: App) -> tuple[Any, Any]:
    """The heartbeat time column and it as exact integer microseconds since 1970 in SQL."""
    from sqlalchemy import BigInteger, Integer, cast

    col = Heartbeat.__table__.c.at
    if app.db.engine.dialect.name == "sqlite":  # stored as 'YYYY-MM-DD HH:MM:SS.ffffff'
        whole = func.strftime("%s", func.substr(col, 1, 19))  # no rounding of .999999 up
        return col, cast(whole, Integer) * 1_000_000 + cast(func.substr(col, 21, 6), Integer)
    return col, cast(func.round(func.extract("epoch", col) * 1_000_000), BigInteger)


def running_since(app: App, machine_ids: Iterable[str]) -> dict[str, datetime]:
    """When each machine last came up (launched, started, seen running again)."""
    wanted = set(machine_ids)
    with app.db.session() as s:
        rows = s.execute(
            select(Event.machine_id, func.max(Event.at))
            .where(Event.kind.in_(RUNNING_SINCE_EVENTS))
            .group_by(Event.machine_id)
        )
        return {mid: at for mid, at in rows if mid in wanted}


def threshold(rules: Iterable[IdleRule]) -> tuple[float, bool]:
    """The machine's idle threshold (its rules' lowest, else the default) and whether silence
    counts as idle (a rule of its says so)."""
    rules = list(rules)
    below = min((r.gpu_util_below for r in rules), default=IdleRule().gpu_util_below)
    return below, any(r.unknown_counts_as_idle for r in rules)


def idle_rules(policies: list[Policy], m: Machine) -> list[IdleRule]:
    """The machine's idle rules: its matching policies' and its experiment's own."""
    rules = [p.idle_rule for p in matching(policies, m.project, m.owner) if p.idle_rule]
    own = ((m.spec or {}).get("lifecycle") or {}).get("idle")
    return rules + ([IdleRule(**own)] if own else [])


IDLE_NOW = timedelta(minutes=10)  # GPUs below the threshold this long: flagged "idle now"


@dataclass(frozen=True)
class IdleNow:
    """A running machine whose GPUs have stayed below ``below`` % since ``since``."""

    machine_id: str
    since: datetime
    below: float


def idle_now(
    app: App, now: datetime, thresholds: dict[str, float], grace: timedelta
) -> dict[str, IdleNow]:
    """Of the running machines in ``thresholds`` (id: its idle threshold), those idle now: heard
    within ``grace``, every GPU below the threshold in every heartbeat since the last busy one,
    for :data:`IDLE_NOW` at least. ``since``: the first heartbeat after the last busy one (or,
    with none in the day of heartbeats kept, when the machine came up, else its first
    heartbeat). A heartbeat without GPUs (``max_util`` None) counts as busy: not judged. One
    query over the last minutes of every machine's heartbeats (:func:`_idle_candidates`), then
    one (two passes) per distinct threshold over the day of the machines still in question,
    summed up by the database."""
    from sqlalchemy import case, or_

    by_below: dict[float, list[str]] = {}
    for mid in _idle_candidates(app, now, thresholds, grace):
        by_below.setdefault(thresholds[mid], []).append(mid)
    h = Heartbeat
    latest: dict[str, datetime] = {}
    first_idle: dict[str, datetime] = {}
    with app.db.session() as s:
        for below, ids in by_below.items():
            for k in range(0, len(ids), 500):
                chunk = ids[k : k + 500]
                busy = or_(h.max_util.is_(None), h.max_util >= below)
                marks = (  # each machine's latest heartbeat and latest busy one, in one pass
                    select(
                        h.machine_id.label("mid"),
                        func.max(h.at).label("last_at"),
                        func.max(case((busy, h.at))).label("busy_at"),
                    )
                    .where(h.machine_id.in_(chunk))
                    .group_by(h.machine_id)
                    .subquery()
                )
                rows = s.execute(
                    select(h.machine_id, marks.c.last_at, func.min(h.at))
                    .join(marks, marks.c.mid == h.machine_id)
                    .where(
                        h.machine_id.in_(chunk),
                        or_(marks.c.busy_at.is_(None), h.at > marks.c.busy_at),
                    )
                    .group_by(h.machine_id, marks.c.last_at)
                )
                for mid, last, first in rows:
                    latest[mid], first_idle[mid] = last, first
    came_up = running_since(app, [m for m in first_idle if m in latest])
    out: dict[str, IdleNow] = {}
    for mid, first in first_idle.items():
        last = latest.get(mid)
        if last is None or now - last > grace:
            continue
        since = first
        up = came_up.get(mid)
        if up is not None and up > since:  # beats of an earlier run: from when it came up
            since = up
        if now - since >= IDLE_NOW:
            out[mid] = IdleNow(mid, since, thresholds[mid])
    return out


def _idle_candidates(
    app: App, now: datetime, thresholds: dict[str, float], grace: timedelta
) -> list[str]:
    """The machines :func:`idle_now` must look into, found in the last minutes alone: heard
    within ``grace`` and not busy within :data:`IDLE_NOW` (a busy heartbeat then means idle
    for less than that). A fleet at work is mostly left out, without a pass over its day."""
    from sqlalchemy import case, or_

    if not thresholds:
        return []
    h, recent = Heartbeat, now - IDLE_NOW
    belows = sorted(set(thresholds.values()))
    col = {below: 2 + i for i, below in enumerate(belows)}
    machine = beat_machine(app)
    cols: list[Any] = [machine, func.max(h.at)]
    cols += [
        func.max(case((or_(h.max_util.is_(None), h.max_util >= below), h.at))) for below in belows
    ]
    out = []
    with app.db.session() as s:
        rows = s.execute(select(*cols).where(h.at >= recent - grace).group_by(machine))
        for row in rows:
            below = thresholds.get(row[0])
            if below is None or now - row[1] > grace:
                continue
            busy = row[col[below]]
            if busy is None or busy < recent:
                out.append(row[0])
    return out


# --- the endpoint ----------------------------------------------------------------------------


def parse_authorization(header: str) -> tuple[str, int, str] | None:
    """(machine, time, signature) of a well-formed ``Authorization`` an agent signed
    (:func:`provisioner.agent.authorization`), else None. The scheduler's side only: the machine
    is not sent it."""
    scheme, _, rest = header.strip().partition(" ")
    if scheme != agent.SCHEME or len(rest) > 512:
        return None
    fields = dict(part.strip().partition("=")[::2] for part in rest.split(","))
    machine, at, sig = (fields.get(k, "") for k in ("machine", "time", "signature"))
    if not (0 < len(machine) <= 64 and at.isdigit() and len(at) <= 15 and len(sig) == 64):
        return None
    return machine, int(at), sig


REPLAY_WINDOW = timedelta(minutes=5)  # a heartbeat signed longer ago (or ahead) is refused


class HeartbeatApp:
    """The WSGI application of ``POST /v1/heartbeat``, ``POST /v1/notice``, ``GET /metrics``
    and ``GET /healthz`` (mount it at each of those paths, or at ``/``).

    A heartbeat is signed, not carrying its token: ``Authorization: PV1-HMAC-SHA256
    machine=ID, time=MS, signature=HEX`` (see :func:`provisioner.agent.signature`). It is
    refused (401) unless the machine is live and ``time`` is within :data:`REPLAY_WINDOW` of
    now — all before the body is read — and then unless the signature over the body matches;
    ``time`` must also grow from one request of a machine to the next on the same route (409:
    a replay). A notice is signed the same way over its own route.
    ``/metrics`` needs ``Authorization: Bearer <metrics_token>`` (or a personal token) when one
    is set; without one it is public and names no machine."""

    def __init__(self, app: App, metrics: Any = None, metrics_token: str | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.metrics_token = metrics_token

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        path = environ.get("SCRIPT_NAME", "") + (environ.get("PATH_INFO") or "")
        method = environ.get("REQUEST_METHOD", "GET")
        try:
            if path == "/v1/heartbeat":
                if method != "POST":
                    return respond(start_response, 405, {"error": "POST a heartbeat"})
                code, data = self._heartbeat(environ)
                return respond(start_response, code, data)
            if path == "/v1/notice":
                if method != "POST":
                    return respond(start_response, 405, {"error": "POST a notice"})
                code, data = self._notice(environ)
                return respond(start_response, code, data)
            if path == "/healthz":
                return respond(start_response, 200, {"ok": True})
            if path == "/metrics" and self.metrics is not None:
                return self._metrics(environ, start_response)
        except Exception:  # the state database is down, say: logged, answered, never fatal
            log.exception("%s %s failed", method, path)
            return respond(start_response, 500, {"error": "not recorded"})
        return respond(start_response, 404, {"error": "not found"})

    def _verified(self, environ: dict[str, Any], route: str) -> tuple[int, Any, bytes]:
        """(200, machine id, body) of a request signed by a live machine for ``route``, else
        (status, error, b""): the signature checks of every route an agent posts to."""
        auth = parse_authorization(environ.get("HTTP_AUTHORIZATION", ""))
        if auth is None:
            return 401, {"error": "unsigned or malformed Authorization"}, b""
        machine_id, at_ms, sig = auth
        now_ms = int(self.app.clock.now().timestamp() * 1000)
        if abs(now_ms - at_ms) > REPLAY_WINDOW.total_seconds() * 1000:
            return 401, {"error": "stale or future time: check the machine's clock"}, b""
        key = self._key(machine_id)
        if key is None:
            return 401, {"error": "unknown machine or token"}, b""
        length = environ.get("CONTENT_LENGTH") or ""
        if not length.isdigit():
            return 411, {"error": "a Content-Length is required"}, b""
        if int(length) > MAX_BODY:  # waitress refuses these first; kept for any other server
            return 413, {"error": f"the body must be at most {MAX_BODY} bytes"}, b""
        raw = environ["wsgi.input"].read(int(length))
        if not hmac.compare_digest(sig, agent.signature(key, machine_id, at_ms, raw, route)):
            return 401, {"error": "unknown machine or token"}, b""
        if not self._newer(route, machine_id, at_ms):
            return 409, {"error": "replayed or out-of-order request"}, b""
        return 200, machine_id, raw

    def _newer(self, route: str, machine_id: str, at_ms: int) -> bool:
        """Whether ``at_ms`` is newer than any this route accepted from the machine, recording
        it if so: in the state database (a restart forgets nothing, and every scheduler process
        shares it), check and update as one conditional statement, so two copies of one request
        cannot both pass."""
        from sqlalchemy import insert, update
        from sqlalchemy.exc import IntegrityError

        mark = SignedMark
        for _ in range(2):  # the first of a machine: inserted; a racing insert: updated
            with self.app.db.session() as s:
                done = s.execute(
                    update(mark)
                    .where(
                        mark.route == route,
                        mark.machine_id == machine_id,
                        mark.at_ms < at_ms,
                    )
                    .values(at_ms=at_ms)
                    .execution_options(synchronize_session=False)
                )
                if done.rowcount:  # type: ignore[attr-defined]
                    return True
                seen = s.scalar(
                    select(SignedMark.at_ms).where(
                        SignedMark.route == route, SignedMark.machine_id == machine_id
                    )
                )
                if seen is not None:
                    return False  # as old as one accepted, or older: a replay
            try:
                with self.app.db.session() as s:
                    s.execute(insert(mark).values(route=route, machine_id=machine_id, at_ms=at_ms))
                return True
            except IntegrityError:
                continue  # another request of the machine inserted it first: compare with it
        return False

    def _heartbeat(self, environ: dict[str, Any]) -> tuple[int, Any]:
        return self._signed(environ, agent.HEARTBEAT, parse_heartbeat, record_heartbeat)

    def _notice(self, environ: dict[str, Any]) -> tuple[int, Any]:
        return self._signed(environ, agent.NOTICE, parse_notice, record_notice)

    def _signed(
        self,
        environ: dict[str, Any],
        route: str,
        parse: Callable[[bytes], Any],
        keep: Callable[[App, str, Any], Machine | None],
    ) -> tuple[int, Any]:
        """A signed post on ``route``: verified, its body parsed and kept for the machine."""
        code, machine_id, raw = self._verified(environ, route)
        if code != 200:
            return code, machine_id
        try:
            body = parse(raw)
        except BadHeartbeat as e:
            return 400, {"error": str(e)}
        m = keep(self.app, machine_id, body)
        if m is None:
            return 401, {"error": "unknown machine or token"}
        return 200, {"ok": True, "machine": m.name}

    def _key(self, machine_id: str) -> str | None:
        """The signing key of a live machine: the stored hash of its token."""
        with self.app.db.session() as s:
            return s.scalar(
                select(Machine.agent_token_hash).where(
                    Machine.id == machine_id, Machine.status.not_in(ACTIVE_EXCLUDED)
                )
            )

    def _metrics(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        named = False
        if self.metrics_token:
            auth = environ.get("HTTP_AUTHORIZATION", "")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), self.metrics_token.encode()) and not (
                given.startswith(tokens.PREFIX) and tokens.verify(self.app, given)
            ):  # the metrics token, or a member's personal token
                return respond(start_response, 401, {"error": "a metrics token is required"})
            named = True
        body, ctype = self.metrics.render(names=named)
        start_response("200 OK", [("Content-Type", ctype), ("Content-Length", str(len(body)))])
        return [body]


def endpoint_apps(
    app: App, metrics: Any = None, metrics_token: str | None = None
) -> dict[str, WSGIApp]:
    """The scheduler's own paths, for :func:`provisioner.web.serve` (other apps mount beside)."""
    hb = HeartbeatApp(app, metrics, metrics_token)
    return {"/v1/heartbeat": hb, "/v1/notice": hb, "/metrics": hb, "/healthz": hb}


class Endpoint(Server):
    """Heartbeats, metrics and health on one port (``port=0``: a free one), and any other
    WSGI ``apps`` under their path prefixes."""

    def __init__(
        self,
        app: App,
        host: str = "127.0.0.1",
        port: int = 8787,
        metrics: Any = None,
        *,
        metrics_token: str | None = None,
        apps: dict[str, WSGIApp] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(
            {**(apps or {}), **endpoint_apps(app, metrics, metrics_token)}, host, port, **options
        )
        self.app = app

    def __enter__(self) -> Endpoint:
        self.start()
        return self


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
