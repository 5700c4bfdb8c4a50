"""Notice receivers on 127.0.0.1, each speaking its documented API: the Telegram Bot API's
``sendMessage``, a Slack incoming webhook and a generic webhook that checks an HMAC-SHA256
signature. They record what they accept and can be told to refuse the next requests.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Receivers:
    token: str = "123456:ABC-DEF1234ghIkl-zyx57W2v1u123ew11"  # the format of BotFather's tokens
    slack_path: str = "/services/T000/B000/XXXXXXXX"
    secret: str = "whsec-test"
    telegram: list[dict[str, Any]] = field(default_factory=list)  # accepted sendMessage bodies
    slack: list[dict[str, Any]] = field(default_factory=list)
    webhook: list[tuple[dict[str, Any], dict[str, str]]] = field(default_factory=list)
    flood: int = 0  # the next n Telegram requests get 429
    retry_after: int = 30
    webhook_down: int = 0  # the next n webhook requests get 503
    requests: int = 0
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> Receivers:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def _handler(r: Receivers) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def _answer(self, code: int, body: bytes, ctype: str, **headers: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, data: dict[str, Any], **headers: str) -> None:
            self._answer(code, json.dumps(data).encode(), "application/json", **headers)

        def do_POST(self) -> None:
            r.requests += 1
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if m := re.fullmatch(r"/bot([^/]+)/(\w+)", self.path):
                return self._telegram(m.group(1), m.group(2), raw)
            if self.path.startswith("/services/"):
                return self._slack(raw)
            if self.path == "/hook":
                return self._webhook(raw)
            self._answer(404, b"not found", "text/plain")

        def _telegram(self, token: str, method: str, raw: bytes) -> None:
            """https://core.telegram.org/bots/api#making-requests: requests go to
            ``/bot<token>/METHOD_NAME``; every answer is a JSON object with ``ok``; on failure
            ``error_code`` and ``description``, and ``parameters`` (ResponseParameters) such as
            ``retry_after`` — "in case of exceeding flood control, the number of seconds left to
            wait before the request can be repeated"
            (https://core.telegram.org/bots/api#responseparameters). A wrong token is 401
            Unauthorized (https://core.telegram.org/api/errors#401-unauthorized)."""
            if token != r.token:
                return self._json(
                    401, {"ok": False, "error_code": 401, "description": "Unauthorized"}
                )
            if method.lower() != "sendmessage":  # "All methods in the Bot API are case-insensitive"
                return self._json(404, {"ok": False, "error_code": 404, "description": "Not Found"})
            if r.flood > 0:
                r.flood -= 1
                return self._json(
                    429,
                    {
                        "ok": False,
                        "error_code": 429,
                        "description": f"Too Many Requests: retry after {r.retry_after}",
                        "parameters": {"retry_after": r.retry_after},
                    },
                )
            try:
                body = json.loads(raw)
            except ValueError:
                body = {}
            # https://core.telegram.org/bots/api#sendmessage: chat_id and text are required
            if not body.get("chat_id") or not body.get("text"):
                return self._json(
                    400,
                    {
                        "ok": False,
                        "error_code": 400,
                        "description": "Bad Request: message text is empty",
                    },
                )
            r.telegram.append(body)
            # the result is the sent Message (https://core.telegram.org/bots/api#message)
            self._json(
                200,
                {
                    "ok": True,
                    "result": {
                        "message_id": len(r.telegram),
                        "date": 0,
                        "chat": {"id": body["chat_id"], "type": "group"},
                        "text": body["text"],
                    },
                },
            )

        def _slack(self, raw: bytes) -> None:
            """https://api.slack.com/messaging/webhooks: POST a JSON body with ``text`` to the
            webhook URL; a success is 200 with the body ``ok``. Errors (Handling errors section)
            are HTTP codes with a short text: 403 ``invalid_token`` for a URL Slack does not know,
            400 ``invalid_payload`` for a body it cannot read, 400 ``no_text`` without text."""
            if self.path != r.slack_path:
                return self._answer(403, b"invalid_token", "text/html")
            try:
                body = json.loads(raw)
            except ValueError:
                return self._answer(400, b"invalid_payload", "text/html")
            if not isinstance(body, dict) or not body.get("text"):
                return self._answer(400, b"no_text", "text/html")
            r.slack.append(body)
            self._answer(200, b"ok", "text/html")

        def _webhook(self, raw: bytes) -> None:
            """The receiver a team writes: it checks the HMAC-SHA256 of the raw body under the
            shared secret before believing it."""
            if r.webhook_down > 0:
                r.webhook_down -= 1
                return self._answer(503, b"busy", "text/plain")
            want = "sha256=" + hmac.new(r.secret.encode(), raw, hashlib.sha256).hexdigest()
            got = self.headers.get("X-Provisioner-Signature", "")
            if not hmac.compare_digest(want, got):
                return self._answer(401, b"bad signature", "text/plain")
            r.webhook.append((json.loads(raw), dict(self.headers)))
            self._answer(204, b"", "text/plain")

    return Handler
