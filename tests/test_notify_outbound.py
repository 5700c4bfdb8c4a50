"""Webhooks go only where they should: a loopback, private, link-local or metadata address is
refused after resolution unless settings allow it, a redirect is not followed, and a failed
delivery keeps its status code, never the receiver's answer (issue 33: the scheduler host as an
SSRF proxy showing ``webhook 403: …db_password=hunter2`` on /alerts)."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from provisioner import notify, outbound
from provisioner.jobs import enforce
from tests import test_notify
from tests.test_notify import launch, make_app, policy, rows

LEAK = b"db_password=hunter2"

rx = test_notify.rx  # the receivers (a fixture)


class Admin:
    """An internal admin endpoint on 127.0.0.1: 403 with a secret in the body on /admin, a 307
    to /admin on /go."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        admin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                admin.paths.append(self.path)
                if self.path == "/go":
                    self.send_response(307)
                    self.send_header("Location", f"{admin.url}/admin")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(403)
                self.send_header("Content-Length", str(len(LEAK)))
                self.end_headers()
                self.wfile.write(LEAK)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def admin():
    a = Admin()
    yield a
    a.close()


def alert_to(home, clock, db_url, tmp_path, rx, url: str, allow: list[str]):
    app = make_app(
        home, clock, db_url, tmp_path, rx, policy(rx, [{"webhook": {"url": url}}]),
        notify={"allow": allow},
    )  # fmt: skip
    launch(app)
    clock.advance(timedelta(hours=1))
    enforce.run(app, clock.now())
    return app, notify.deliver(app, clock.now())


def test_a_loopback_webhook_is_refused_unless_settings_allow_it(
    home,
    clock,
    db_url,
    tmp_path,
    rx,
    admin,
):
    app, out = alert_to(home, clock, db_url, tmp_path, rx, admin.url + "/admin", [])
    [d] = rows(app)
    assert d.status == "failed" and admin.paths == []  # never asked
    assert d.error == (
        "127.0.0.1 resolves to 127.0.0.1, a non-public address; add it to notify.allow "
        "in settings to send there"
    )
    assert out == [f"webhook {admin.url}/admin: budget-alert failed: {d.error}"]
    app.close()


def test_an_allowed_receivers_error_answer_is_never_stored_or_shown(
    home,
    clock,
    db_url,
    tmp_path,
    rx,
    admin,
):
    app, out = alert_to(home, clock, db_url, tmp_path, rx, admin.url + "/admin", ["127.0.0.0/8"])
    [d] = rows(app)
    assert admin.paths == ["/admin"]
    assert (d.status, d.error) == ("failed", "webhook 403 (Forbidden)")
    kept = json.dumps([d.error, d.text, d.subject, d.channel, d.target]) + "\n".join(out)
    assert "hunter2" not in kept
    app.close()


def test_a_redirect_is_not_followed(home, clock, db_url, tmp_path, rx, admin):
    app, _ = alert_to(home, clock, db_url, tmp_path, rx, admin.url + "/go", ["127.0.0.1"])
    [d] = rows(app)
    assert admin.paths == ["/go"]  # /admin, where it pointed, never asked
    assert (d.status, d.error) == (
        "failed",
        "webhook 307 (Temporary Redirect, redirect not followed)",
    )
    app.close()


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",  # AWS, Azure, GCP, Yandex metadata
        "http://[fd00:ec2::254]/latest/meta-data/",  # AWS's IPv6 metadata
        "http://metadata.google.internal/computeMetadata/v1/",
        "http://100.100.100.200/latest/meta-data/",  # Alibaba's, in 100.64.0.0/10
        "http://10.0.0.5:8080/",
        "http://192.168.1.1/",
        "http://[::1]:9/",
        "http://[::ffff:127.0.0.1]:9/",  # IPv4-mapped loopback
        "http://0.0.0.0:9/",
        "http://localhost:9/",
        "http://2130706433:9/",  # 127.0.0.1 as one number: the resolver's reading is checked
    ],
)
def test_non_public_targets_are_refused_before_any_connection(url):
    with pytest.raises(outbound.Unreachable) as e:
        outbound.post(url, b"{}", {}, allow=[], timeout=1)
    assert e.value.refused, str(e.value)
    assert "allow" in str(e.value) or "metadata" in str(e.value)


def test_allow_names_a_host_or_a_network():
    assert outbound.resolve("localhost", 80, ["localhost"]) in ("127.0.0.1", "::1")
    assert outbound.resolve("10.1.2.3", 80, ["10.0.0.0/8"]) == "10.1.2.3"
    with pytest.raises(outbound.Unreachable):
        outbound.resolve("10.1.2.3", 80, ["10.9.0.0/16"])
