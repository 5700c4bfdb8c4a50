"""The scheduler's HTTP server: WSGI applications mounted under path prefixes, served by
waitress.

waitress reads requests on one I/O thread and hands complete ones to a fixed pool of worker
threads, so a slow or stalled client costs a socket, never a thread: ``connection_limit`` caps
the sockets, ``channel_timeout`` closes idle ones, ``max_request_body_size`` answers 413 to a
larger ``Content-Length`` before reading it, and a malformed one (``-1``, ``abc``) gets 400.

No client can fill the server (:class:`_Guarded`): one address holds at most
``per_address_limit`` sockets, a request's headers must be in within ``header_timeout`` of its
first byte and its body within ``body_timeout`` (a byte a second does not keep a socket), and a
connection over either cap is accepted and closed at once — waitress would instead stop
accepting at its cap and leave every other client, heartbeats and ``/healthz`` too, waiting in
the listen backlog. Each refusal is told to ``on_refuse`` (the endpoint records it as an
outage: heartbeats may have been lost then).

    server = serve({"/v1/heartbeat": hb, "/metrics": hb, "/": dashboard}, "127.0.0.1", 8787)
    ...
    server.stop()

The longest mounted prefix that matches a request's path (on a ``/`` boundary) gets it, with
``SCRIPT_NAME``/``PATH_INFO`` shifted as WSGI middleware does (PEP 3333); ``/`` catches the rest.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

THREADS = 4  # workers: requests are short (one indexed query each)
CONNECTION_LIMIT = 100  # open sockets; more wait in the listen backlog
CHANNEL_TIMEOUT = 10  # seconds a connection may sit silent before it is closed
PER_ADDRESS_LIMIT = 32  # open sockets of one client address
HEADER_TIMEOUT = 5.0  # seconds from a request's first byte to the end of its headers
BODY_TIMEOUT = 10.0  # seconds from a request's first byte to the end of its body
REFUSED = b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
MAX_BODY = 64 * 1024  # no request this server handles is larger


def respond(start_response: Callable[..., Any], code: int, data: Any) -> list[bytes]:
    """A JSON answer (``data``) with status ``code``."""
    body = json.dumps(data).encode()
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    if code == 401:
        headers.append(("WWW-Authenticate", "Bearer"))
    start_response(f"{code} {_REASONS.get(code, 'Error')}", headers)
    return [body]


_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    411: "Length Required",
    413: "Content Too Large",
    500: "Internal Server Error",
}


def mount(apps: Mapping[str, WSGIApp]) -> WSGIApp:
    """One WSGI application dispatching to ``apps`` by path prefix."""
    table = sorted(((p.rstrip("/"), a) for p, a in apps.items()), key=lambda x: -len(x[0]))

    def dispatch(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        for prefix, app in table:
            if not prefix or path == prefix or path.startswith(prefix + "/"):
                environ["SCRIPT_NAME"] = environ.get("SCRIPT_NAME", "") + prefix
                environ["PATH_INFO"] = path[len(prefix) :]
                return app(environ, start_response)
        return respond(start_response, 404, {"error": "not found"})

    return dispatch


class Server:
    """``apps`` on ``host:port`` (``port=0``: a free one) in a background thread."""

    def __init__(
        self,
        apps: Mapping[str, WSGIApp],
        host: str = "127.0.0.1",
        port: int = 8787,
        *,
        connection_limit: int = CONNECTION_LIMIT,
        threads: int = THREADS,
        channel_timeout: float = CHANNEL_TIMEOUT,
        per_address_limit: int = PER_ADDRESS_LIMIT,
        header_timeout: float = HEADER_TIMEOUT,
        body_timeout: float = BODY_TIMEOUT,
        on_refuse: Callable[[str], None] | None = None,
    ) -> None:
        from waitress.adjustments import Adjustments
        from waitress.task import ThreadedTaskDispatcher

        adj = Adjustments(
            host=host,
            port=port,
            threads=threads,
            connection_limit=connection_limit,
            channel_timeout=channel_timeout,
            cleanup_interval=1,  # the deadlines are checked each second
            max_request_body_size=MAX_BODY,
            max_request_header_size=16 * 1024,
            ident="provisioner",
            clear_untrusted_proxy_headers=True,
            expose_tracebacks=False,
            asyncore_use_poll=True,
        )
        dispatcher = ThreadedTaskDispatcher()
        dispatcher.set_thread_count(threads)
        limits = _Limits(per_address_limit, header_timeout, body_timeout, on_refuse)
        server_class = _guarded_class()
        self._map: dict[int, Any] = {}
        for sockinfo in adj.listen:  # one per address the host resolves to; they share the map
            self.server: Any = server_class(
                mount(apps), self._map, dispatcher=dispatcher, adj=adj, sockinfo=sockinfo
            )
            self.server.limits = limits
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def address(self) -> tuple[str, int]:
        return str(self.server.effective_host), int(self.server.effective_port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    def start(self) -> Server:
        self._thread = threading.Thread(target=self._run, name="endpoint", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        """waitress's loop, one poll at a time, so :meth:`stop` ends it between polls rather
        than closing sockets under a ``select``."""
        from waitress import wasyncore

        while not self._stopping.is_set():
            wasyncore.loop(
                timeout=self.server.adj.asyncore_loop_timeout,
                map=self._map,
                use_poll=True,  # select() fails on a descriptor past 1023: a flood's reach
                count=1,
            )

    def stop(self) -> None:
        from waitress import wasyncore

        self._stopping.set()
        self.server.pull_trigger()  # wakes the poll at once
        if self._thread:
            self._thread.join()
        self.server.task_dispatcher.shutdown()
        wasyncore.close_all(self._map)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Limits:
    """The per-address cap, the request deadlines and who hears of refusals, with the count
    of each address's open sockets (kept on the I/O thread only)."""

    def __init__(
        self,
        per_address: int,
        header_timeout: float,
        body_timeout: float,
        on_refuse: Callable[[str], None] | None,
    ) -> None:
        self.per_address = per_address
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.on_refuse = on_refuse
        self.open: dict[str, int] = {}
        self.refused = 0


def _guarded_class() -> type:
    """waitress's TCP server with the caps and deadlines (built on first use: waitress is
    imported only when a server is)."""
    import time

    from waitress.channel import HTTPChannel
    from waitress.server import TcpWSGIServer

    class Channel(HTTPChannel):
        begun: float | None = None  # when the request being read sent its first byte
        peer: str = ""

        def received(self, data: bytes) -> bool:
            if self.request is None and data:
                self.begun = time.monotonic()
            done = super().received(data)
            if self.request is None:  # complete (handed to a worker), or nothing pending
                self.begun = None
            return bool(done)

        def del_channel(self, map: Any = None) -> None:
            opened = self.server.limits.open
            if self.peer in opened:
                opened[self.peer] -= 1
                if opened[self.peer] <= 0:
                    del opened[self.peer]
                self.peer = ""
            super().del_channel(map)

    class Guarded(TcpWSGIServer):
        channel_class = Channel
        limits: _Limits
        next_channel_cleanup: float

        def readable(self) -> bool:
            """Always accepting (waitress stops at its cap, leaving everyone in the backlog;
            here a connection over a cap is closed at once), with waitress's maintenance."""
            now = time.time()
            if now >= self.next_channel_cleanup:
                self.next_channel_cleanup = now + self.adj.cleanup_interval
                self.maintenance(now)
            return bool(self.accepting)

        def handle_accept(self) -> None:
            try:
                pair = self.accept()
                if pair is None:
                    return
                conn, addr = pair
            except OSError:  # the client left before accept, or out of descriptors
                return
            peer = str(addr[0]) if isinstance(addr, tuple) else str(addr)
            lim = self.limits
            why = None
            if len(self._map) >= self.adj.connection_limit:
                why = "connection-limit"
            elif lim.open.get(peer, 0) >= lim.per_address:
                why = "address-limit"
            if why:
                lim.refused += 1
                try:  # a word before closing; never a wait
                    conn.setblocking(False)
                    conn.send(REFUSED)
                except OSError:
                    pass
                conn.close()
                if lim.on_refuse:
                    lim.on_refuse(why)
                return
            channel = self.channel_class(self, conn, self.fix_addr(addr), self.adj, map=self._map)
            channel.peer = peer
            lim.open[peer] = lim.open.get(peer, 0) + 1

        def maintenance(self, now: float) -> None:
            super().maintenance(now)  # idle sockets: channel_timeout
            mono, lim = time.monotonic(), self.limits
            for channel in list(self.active_channels.values()):
                begun, request = getattr(channel, "begun", None), channel.request
                if begun is None or request is None or channel.requests:
                    continue
                limit = lim.body_timeout if request.headers_finished else lim.header_timeout
                if mono - begun > limit:
                    channel.will_close = True

    return Guarded


def serve(apps: Mapping[str, WSGIApp], host: str, port: int, **options: Any) -> Server:
    """Serve ``apps`` (path prefix → WSGI application) on ``host:port``, started."""
    return Server(apps, host, port, **options).start()
