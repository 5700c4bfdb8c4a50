"""The heartbeat endpoint (:class:`HeartbeatApp`, a WSGI application served by
:mod:`provisioner.web`): ``POST /v1/heartbeat``, ``POST /v1/notice`` (a cloud's preemption
notice, signed the same way), ``GET /metrics`` (Prometheus) and ``GET /healthz``.

Agents hold a per-machine token issued at launch; only its SHA-256 is stored, and it is the key
with which the agent signs each heartbeat (the token itself never travels again). What a
verified post carries is parsed and kept by :mod:`provisioner.heartbeats`.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from provisioner import agent, tokens
from provisioner.heartbeats import (
    BadHeartbeat,
    parse_heartbeat,
    parse_notice,
    record_heartbeat,
    record_notice,
)
from provisioner.models import ACTIVE_EXCLUDED, Machine, SignedMark
from provisioner.web import MAX_BODY, Server, WSGIApp, respond

if TYPE_CHECKING:
    from provisioner.app import App

log = logging.getLogger("provisioner.idle")


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
