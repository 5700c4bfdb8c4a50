"""Mail over a real SMTP server on loopback (aiosmtpd): plain, STARTTLS with login (a self-signed
certificate made here), and implicit TLS. The password comes from the environment only and never
shows up in an error."""

from __future__ import annotations

import email
import email.policy
import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult

from provisioner import mail
from provisioner.settings import SmtpSettings

PASSWORD = "s3cret-Pa55"


@dataclass
class Inbox:
    """What the server received: (envelope recipients, parsed message) per mail."""

    messages: list[tuple[list[str], email.message.EmailMessage]] = field(default_factory=list)
    logins: list[str] = field(default_factory=list)

    async def handle_DATA(self, server, session, envelope):
        msg = email.message_from_bytes(envelope.content, policy=email.policy.default)
        self.messages.append((list(envelope.rcpt_tos), msg))
        return "250 OK"

    def authenticate(self, server, session, envelope, mechanism, auth_data):
        ok = auth_data.login == b"robot" and auth_data.password == PASSWORD.encode()
        if ok:
            self.logins.append(auth_data.login.decode())
        return AuthResult(success=ok, handled=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    inbox: Inbox
    smtp: SmtpSettings


@pytest.fixture
def smtp_server():
    """A plain SMTP server on loopback and the settings that reach it."""
    inbox = Inbox()
    port = free_port()
    c = Controller(inbox, hostname="127.0.0.1", port=port)
    c.start()
    try:
        yield Server(
            inbox,
            SmtpSettings(
                host="127.0.0.1", port=port, security="none", sender="provisioner@example.com"
            ),
        )
    finally:
        c.stop()


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[Path, Path]:
    from tests.emulators.tls import self_signed_localhost

    crt, key = self_signed_localhost()
    d = tmp_path_factory.mktemp("tls")
    (d / "cert.pem").write_bytes(crt)
    (d / "key.pem").write_bytes(key)
    return d / "cert.pem", d / "key.pem"


def _server_context(cert: tuple[Path, Path]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(*map(str, cert))
    return ctx


def sample(to: list[str]) -> email.message.EmailMessage:
    return mail.compose(
        sender="provisioner@example.com",
        to=to,
        subject="nlp-research: 82 % of budget",
        text="plain body",
        html='<p>html body <img src="cid:chart"></p>',
        images={"chart": b"\x89PNG\r\n\x1a\nfake"},
        attachments=[("spend.csv", b"a,b\n1,2\n", "text/csv")],
    )


def test_plain_delivery_keeps_every_part(smtp_server):
    mail.send(smtp_server.smtp, sample(["lead@example.com", "cfo@example.com"]))
    [(rcpt, msg)] = smtp_server.inbox.messages
    assert rcpt == ["lead@example.com", "cfo@example.com"]
    assert msg["Subject"] == "nlp-research: 82 % of budget"
    assert msg.get_body(("plain",)).get_content().strip() == "plain body"
    assert "cid:chart" in msg.get_body(("html",)).get_content()
    [img] = [p for p in msg.walk() if p.get_content_type() == "image/png"]
    assert img["Content-ID"] == "<chart>" and img.get_content().startswith(b"\x89PNG")
    [att] = list(msg.iter_attachments())
    assert att.get_filename() == "spend.csv" and att.get_content() == "a,b\n1,2\n"


def test_starttls_with_login_from_the_environment(cert, monkeypatch):
    inbox, port = Inbox(), free_port()
    c = Controller(
        inbox,
        hostname="127.0.0.1",
        port=port,
        tls_context=_server_context(cert),
        require_starttls=True,
        authenticator=inbox.authenticate,
        auth_required=True,
    )
    c.start()
    try:
        smtp = SmtpSettings(
            host="127.0.0.1",
            port=port,
            security="starttls",
            user="robot",
            sender="provisioner@example.com",
            ca_file=str(cert[0]),
        )
        monkeypatch.delenv(mail.PASSWORD_ENV, raising=False)
        with pytest.raises(mail.MailError, match=r"\$PROVISIONER_SMTP_PASSWORD is not"):
            mail.send(smtp, sample(["lead@example.com"]))
        monkeypatch.setenv(mail.PASSWORD_ENV, "wrong-" + PASSWORD)
        with pytest.raises(mail.MailError, match="login as robot refused") as refused:
            mail.send(smtp, sample(["lead@example.com"]))
        assert PASSWORD not in str(refused.value)
        monkeypatch.setenv(mail.PASSWORD_ENV, PASSWORD)
        mail.send(smtp, sample(["lead@example.com"]))
    finally:
        c.stop()
    assert inbox.logins == ["robot"]
    assert [r for r, _ in inbox.messages] == [["lead@example.com"]]


def test_starttls_refuses_a_server_it_does_not_trust(cert):
    inbox, port = Inbox(), free_port()
    c = Controller(
        inbox,
        hostname="127.0.0.1",
        port=port,
        tls_context=_server_context(cert),
        require_starttls=True,
    )
    c.start()
    try:
        smtp = SmtpSettings(host="127.0.0.1", port=port, security="starttls")  # no ca_file
        with pytest.raises(mail.MailError, match="CERTIFICATE_VERIFY_FAILED"):
            mail.send(smtp, sample(["lead@example.com"]))
    finally:
        c.stop()
    assert inbox.messages == []


def test_implicit_tls(cert):
    inbox, port = Inbox(), free_port()
    c = Controller(inbox, hostname="127.0.0.1", port=port, ssl_context=_server_context(cert))
    c.start()
    try:
        smtp = SmtpSettings(host="127.0.0.1", port=port, security="ssl", ca_file=str(cert[0]))
        mail.send(smtp, sample(["lead@example.com"]))
    finally:
        c.stop()
    assert len(inbox.messages) == 1


def test_unreachable_server_is_one_clear_error():
    smtp = SmtpSettings(host="127.0.0.1", port=free_port(), security="none", timeout_seconds=5)
    with pytest.raises(mail.MailError, match=r"mail to 127\.0\.0\.1:\d+ \(none\) failed"):
        mail.send(smtp, sample(["lead@example.com"]))


def test_the_chart_is_inline_in_the_html_not_an_attachment(smtp_server):
    """RFC 2387: the picture the HTML shows rides beside it in multipart/related (whose "type"
    names the HTML), referenced by ``cid:``, disposition inline — a mail client shows it in
    place instead of listing chart.png among the files."""
    mail.send(smtp_server.smtp, sample(["lead@example.com"]))
    [(_, msg)] = smtp_server.inbox.messages
    [related] = [p for p in msg.walk() if p.get_content_type() == "multipart/related"]
    assert related.get_param("type") == "text/html"
    html, img = related.get_payload()
    assert html.get_content_type() == "text/html" and img.get_content_type() == "image/png"
    cid = img["Content-ID"].strip("<>")
    assert f'src="cid:{cid}"' in html.get_content()
    assert img.get_content_disposition() == "inline"
    assert [a.get_filename() for a in msg.iter_attachments()] == ["spend.csv"]


@pytest.mark.parametrize(
    "name",
    ["<!channel> & <@U123>", "a\r\nBcc: evil@example.com", "Бюджет «ночь» 💸 \"q\" 'q'"],
)
def test_a_subject_is_one_header_whatever_the_name_holds(smtp_server, name):
    """RFC 5322 §2.2: no CR or LF in a field body (a name with a line break cannot add a Bcc);
    RFC 2047: what is not ASCII goes as encoded words and reads back as written."""
    msg = mail.compose(
        sender="provisioner@example.com",
        to=["lead@example.com"],
        subject=f"Budget {name}",
        text="body",
    )
    mail.send(smtp_server.smtp, msg)
    [(rcpt, got)] = smtp_server.inbox.messages
    assert rcpt == ["lead@example.com"] and got["Bcc"] is None
    assert got["Subject"] == "Budget " + " ".join(name.split("\r\n"))
    raw = got.as_bytes()
    assert raw.isascii() and b"\r\nBcc" not in raw and b"\nBcc" not in raw
