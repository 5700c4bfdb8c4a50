"""The scheduler's HTTP server: WSGI applications mounted under path prefixes, served by
waitress.

waitress reads requests on one I/O thread and hands complete ones to a fixed pool of worker
threads, so a slow or stalled client costs a socket, never a thread: ``connection_limit`` caps
the sockets, ``channel_timeout`` closes idle ones, ``max_request_body_size`` answers 413 to a
larger ``Content-Length`` before reading it, and a malformed one (``-1``, ``abc``) gets 400.

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
    ) -> None:
        from waitress.server import create_server

        self.server: Any = create_server(
            mount(apps),
            host=host,
            port=port,
            threads=threads,
            connection_limit=connection_limit,
            channel_timeout=channel_timeout,
            cleanup_interval=max(1, int(channel_timeout) // 2),
            max_request_body_size=MAX_BODY,
            max_request_header_size=16 * 1024,
            ident="provisioner",
            clear_untrusted_proxy_headers=True,
            expose_tracebacks=False,
        )
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
                timeout=self.server.adj.asyncore_loop_timeout, map=self.server._map, count=1
            )

    def stop(self) -> None:
        from waitress import wasyncore

        self._stopping.set()
        self.server.pull_trigger()  # wakes the poll at once
        if self._thread:
            self._thread.join()
        self.server.task_dispatcher.shutdown()
        wasyncore.close_all(self.server._map)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(apps: Mapping[str, WSGIApp], host: str, port: int, **options: Any) -> Server:
    """Serve ``apps`` (path prefix → WSGI application) on ``host:port``, started."""
    return Server(apps, host, port, **options).start()
