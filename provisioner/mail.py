"""Mail: one multipart message (plain text, HTML with inline images, attachments) sent over SMTP
with STARTTLS, implicit TLS (``ssl``) or in the clear (``none``, for a relay on loopback).

The password comes only from ``$PROVISIONER_SMTP_PASSWORD``; it is never logged, stored or put
in an error message.
"""

from __future__ import annotations

import os
import smtplib
import ssl
from collections.abc import Mapping, Sequence
from email.message import EmailMessage
from email.utils import formatdate, make_msgid

from provisioner.errors import OperationFailed
from provisioner.redact import redact
from provisioner.settings import SmtpSettings

PASSWORD_ENV = "PROVISIONER_SMTP_PASSWORD"


class MailError(OperationFailed):
    """The message could not be handed to the SMTP server."""


def compose(
    *,
    sender: str,
    to: Sequence[str],
    subject: str,
    text: str,
    html: str | None = None,
    images: Mapping[str, bytes] | None = None,
    attachments: Sequence[tuple[str, bytes, str]] = (),
) -> EmailMessage:
    """multipart/mixed[alternative[text, related[html, images…]], attachments…]. ``images`` maps
    a content id (referenced as ``cid:<id>`` in the HTML) to PNG bytes; ``attachments`` are
    (filename, bytes, mime type).

    The subject is one line (a line break in a policy's name would end the header: RFC 5322
    §2.2 "A field body MUST NOT include CR and LF except when used in folding"); anything
    beyond ASCII goes as RFC 2047 encoded words, which the email package writes itself."""
    msg = EmailMessage()
    msg["Subject"] = one_line(subject)
    msg["From"] = sender
    msg["To"] = ", ".join(to)
    msg["Date"] = formatdate(localtime=False)
    msg["Message-ID"] = make_msgid(domain=sender.rpartition("@")[2] or None)
    msg.set_content(text)
    if html is not None:
        msg.add_alternative(html, subtype="html")
        html_part = msg.get_payload()[-1]  # type: ignore[index]  # multipart: a list
        for cid, png in (images or {}).items():
            # RFC 2387: the HTML's pictures ride in multipart/related, each named by its
            # Content-ID; shown in place ("inline", RFC 2183 §2.1), never as a file to save
            html_part.add_related(  # type: ignore[union-attr]  # an EmailMessage part
                png, "image", "png", cid=f"<{cid}>", filename=f"{cid}.png", disposition="inline"
            )
        if images:  # RFC 2387 §3.1: "type" names the root part's type, and is required
            html_part.set_param("type", "text/html")  # type: ignore[union-attr]
    for filename, data, mime in attachments:
        maintype, _, subtype = mime.partition("/")
        msg.add_attachment(data, maintype=maintype, subtype=subtype, filename=filename)
    return msg


def one_line(text: str) -> str:
    """``text`` with every line break (CR, LF, and the other breaks str.splitlines knows) as a
    space: what a header may carry."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def send(smtp: SmtpSettings, msg: EmailMessage) -> None:
    """Hand ``msg`` to the server in ``smtp``; every recipient must be accepted."""
    where = f"{smtp.host}:{smtp.port}"
    password = os.environ.get(PASSWORD_ENV)
    if smtp.user and not password:
        raise MailError(f"mail to {where}: user {smtp.user} is set but ${PASSWORD_ENV} is not")
    context = ssl.create_default_context(cafile=smtp.ca_file)
    try:
        if smtp.security == "ssl":
            client: smtplib.SMTP = smtplib.SMTP_SSL(
                smtp.host, smtp.port, timeout=smtp.timeout_seconds, context=context
            )
        else:
            client = smtplib.SMTP(smtp.host, smtp.port, timeout=smtp.timeout_seconds)
        with client:
            if smtp.security == "starttls":
                client.starttls(context=context)
            if smtp.user:
                client.login(smtp.user, password or "")
            refused = client.send_message(msg)
    except smtplib.SMTPAuthenticationError as e:
        raise MailError(f"mail to {where}: login as {smtp.user} refused ({e.smtp_code})") from None
    except (smtplib.SMTPException, OSError) as e:  # a server's reply may quote what it got
        why = redact(str(e), [password])
        raise MailError(f"mail to {where} ({smtp.security}) failed: {why}") from None
    if refused:
        raise MailError(f"mail to {where}: recipients refused: {', '.join(sorted(refused))}")
