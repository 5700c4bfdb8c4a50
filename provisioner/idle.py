"""The idle signal: heartbeats from the on-machine agent, the endpoint that receives them, and
whether a machine has been idle for a rule's window.

Agents authenticate with a per-machine token issued at launch; only its SHA-256 is stored. The
endpoint (stdlib ThreadingHTTPServer) serves ``POST /v1/heartbeat``, ``GET /metrics``
(Prometheus) and ``GET /healthz``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import secrets
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import Select, delete, func, select

from providers.userdata import combine
from provisioner.models import ACTIVE_EXCLUDED, Event, Heartbeat, Machine
from provisioner.state import machine as machine_row

if TYPE_CHECKING:
    from provisioner.app import App

log = logging.getLogger("provisioner.idle")

Signal = Literal["idle", "busy", "unknown", "starting"]
MAX_BODY = 64 * 1024
SOCKET_TIMEOUT = 10  # seconds a heartbeat connection may sit silent
AGENT_DIR = "/etc/provisioner"
RUNNING_SINCE_EVENTS = ("launched", "adopted", "started", "running")


# --- tokens and startup data -----------------------------------------------------------------


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def issue_token(app: App, machine_id: str) -> str:
    """A fresh agent token for ``machine_id``; only its hash is kept."""
    token = secrets.token_urlsafe(32)
    with app.db.session() as s:
        machine_row(s, machine_id).agent_token_hash = token_hash(token)
    return token


def startup_data(user_script: str | None, endpoint: str, token: str, interval: int) -> str:
    """The machine's startup script: install the agent as a service (it never blocks or fails
    the boot), then run the user's own script unchanged. A ``#cloud-config`` user script is
    combined as a MIME multipart document, which cloud-init reads."""
    agent_py = resources.files("provisioner").joinpath("agent.py").read_text(encoding="utf-8")
    cmd = (
        f"/usr/bin/env python3 {AGENT_DIR}/agent.py --endpoint {_sh(endpoint)} "
        f"--token-file {AGENT_DIR}/agent-token --interval {int(interval)}"
    )
    install = _render_install(agent_dir=AGENT_DIR, token=token, agent_py=agent_py, cmd=cmd)
    if not user_script:
        return install
    if user_script.lstrip().startswith("#cloud-config") or user_script.startswith("Content-Type:"):
        return combine(install, user_script) or install  # cloud-init runs the parts in order
    end = "PV_USER_SCRIPT_" + secrets.token_hex(6)
    script = user_script if user_script.startswith("#!") else "#!/bin/bash\n" + user_script
    return (
        f"{install}mkdir -p /var/lib/provisioner\n"
        f"cat > /var/lib/provisioner/startup <<'{end}'\n{script.rstrip()}\n{end}\n"
        "chmod 700 /var/lib/provisioner/startup\nexec /var/lib/provisioner/startup\n"
    )


def _render_install(**values: str) -> str:
    from jinja2 import Environment, StrictUndefined  # only when a machine is launched

    template = resources.files("provisioner").joinpath("templates/agent-install.sh")
    env = Environment(undefined=StrictUndefined, keep_trailing_newline=True, autoescape=False)
    return env.from_string(template.read_text(encoding="utf-8")).render(**values)


def _sh(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


# --- recording -------------------------------------------------------------------------------


class BadHeartbeat(ValueError):
    pass


def parse_body(raw: bytes) -> list[dict[str, Any]]:
    """The GPUs of a heartbeat body ``{"gpus": [{"index", "util", "mem_used_mb",
    "mem_total_mb"}], "note": "..."}``; anything else is refused."""
    try:
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError):
        raise BadHeartbeat("body is not JSON") from None
    if not isinstance(body, dict) or not isinstance(body.get("gpus"), list):
        raise BadHeartbeat('body must be {"gpus": [...]}')
    gpus: list[dict[str, Any]] = []
    for g in body["gpus"]:
        if not isinstance(g, dict):
            raise BadHeartbeat("each GPU is an object")
        util = g.get("util")
        if isinstance(util, bool) or not isinstance(util, int | float) or not 0 <= util <= 100:
            raise BadHeartbeat("util must be a percent")
        gpus.append(
            {
                "index": int(g.get("index", len(gpus))),
                "util": float(util),
                "mem_used_mb": _num(g.get("mem_used_mb")),
                "mem_total_mb": _num(g.get("mem_total_mb")),
            }
        )
    return gpus


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _live_holding(token: str) -> Select[Any]:
    return select(Machine).where(
        Machine.agent_token_hash == token_hash(token), Machine.status.not_in(ACTIVE_EXCLUDED)
    )


def record(app: App, token: str, gpus: list[dict[str, Any]]) -> Machine | None:
    """Store one heartbeat for the live machine holding ``token``; None when no machine does."""
    if not token:
        return None
    with app.db.session() as s:
        m = s.scalars(_live_holding(token)).first()
        if m is None:
            return None
        top = max((g["util"] for g in gpus), default=None)
        s.add(Heartbeat(machine_id=m.id, at=app.clock.now(), gpus=gpus, max_util=top))
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


def classify(
    beats: list[Beat],
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
    recent = [b for b in beats if b.at >= start - grace]
    if not recent or recent[-1].at < now - grace:
        return "unknown"
    in_window = [b for b in recent if b.at >= start]
    if any(b.max_util is not None and b.max_util >= below for b in in_window):
        return "busy"
    if any(b.max_util is None for b in in_window):
        return "unknown"
    seen = [b.at for b in recent] + [now]  # silent longer than grace inside the window: unknown
    if seen[0] > start + grace or any(b - a > grace for a, b in itertools.pairwise(seen)):
        return "unknown"
    return "idle"


def beats_since(app: App, machine_ids: Iterable[str], since: datetime) -> dict[str, list[Beat]]:
    """Heartbeats after ``since`` per machine, oldest first (one query)."""
    wanted = set(machine_ids)
    out: dict[str, list[Beat]] = {}
    with app.db.session() as s:
        rows = s.execute(
            select(Heartbeat.machine_id, Heartbeat.at, Heartbeat.max_util)
            .where(Heartbeat.at >= since)
            .order_by(Heartbeat.machine_id, Heartbeat.at)
        )
        for mid, at, top in rows:
            if mid in wanted:
                out.setdefault(mid, []).append(Beat(at, top))
    return out


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


# --- the endpoint ----------------------------------------------------------------------------


class Endpoint:
    """Heartbeats in, metrics out, on one port. ``port=0`` picks a free one."""

    def __init__(self, app: App, host: str = "127.0.0.1", port: int = 8787, metrics=None) -> None:
        self.app = app
        self.metrics = metrics
        self.server = ThreadingHTTPServer((host, port), _handler(self))
        self.server.daemon_threads = True
        self._thread: threading.Thread | None = None

    def knows(self, token: str) -> bool:
        """Whether a live machine holds ``token`` (a heartbeat is parsed only then)."""
        with self.app.db.session() as s:
            return s.execute(_live_holding(token).with_only_columns(Machine.id)).first() is not None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"  # an AF_INET address: host is a str

    def start(self) -> Endpoint:
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self._thread:
            self._thread.join()

    def __enter__(self) -> Endpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _handler(ep: Endpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "provisioner"
        timeout = SOCKET_TIMEOUT  # a client that stalls gives its thread back

        def log_message(self, fmt: str, *args: Any) -> None:  # never log headers (the token)
            log.debug("%s %s", self.address_string(), fmt % args)

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            if code == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, data: Any) -> None:
            self._send(code, json.dumps(data).encode())

        def do_GET(self) -> None:
            if self.path == "/healthz":
                self._json(200, {"ok": True})
            elif self.path == "/metrics" and ep.metrics is not None:
                body, ctype = ep.metrics.render()
                self._send(200, body, ctype)
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self) -> None:
            if self.path != "/v1/heartbeat":
                self._json(404, {"error": "not found"})
                return
            auth = self.headers.get("Authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not token or not ep.knows(token):  # before reading a byte of the body
                self._json(401, {"error": "unknown or missing token"})
                return
            try:
                length = int(self.headers.get("Content-Length") or "")
            except ValueError:
                self._json(411, {"error": "a Content-Length is required"})
                return
            if not 0 <= length <= MAX_BODY:
                self._json(413, {"error": f"the body must be 0 to {MAX_BODY} bytes"})
                return
            try:
                raw = self.rfile.read(length)
            except TimeoutError:
                self.close_connection = True  # stalled: its thread is given back, quietly
                return
            try:
                gpus = parse_body(raw)
            except BadHeartbeat as e:
                self._json(400, {"error": str(e)})
                return
            try:
                m = record(ep.app, token, gpus)
            except Exception:
                log.exception("heartbeat not recorded")
                self._json(500, {"error": "not recorded"})
                return
            if m is None:
                self._json(401, {"error": "unknown or missing token"})
            else:
                self._json(200, {"ok": True, "machine": m.name})

    return Handler


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


def gpus_not_seen(app: App, since: datetime) -> dict[str, str]:
    """Machines whose agent, in its latest heartbeat, sees fewer GPUs than the machine was
    launched with — a wrong image or a missing driver shows within a heartbeat, not on the
    bill: {machine name: what to say}."""
    out = {}
    for m, hb in latest_heartbeats(app, since):
        wanted, seen = m.gpu_count or 0, len(hb.gpus)
        if seen < wanted:
            out[m.name] = f"the agent sees {seen} of {wanted} GPUs: driver missing or wrong image?"
    return out
