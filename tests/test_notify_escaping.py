"""A budget's name reaches every channel as written and does nothing else: Slack gets ``&``,
``<`` and ``>`` as the entities its formatting guide asks for (a budget named ``<!channel>``
pings nobody), Telegram plain text (no ``parse_mode``: nothing is parsed), the webhook JSON,
and a mail one subject line in RFC 2047 encoded words with the budget's recipients only."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from provisioner import notify
from provisioner.jobs import enforce
from tests.test_mail import free_port, smtp_server  # noqa: F401  (fixture)
from tests.test_notify import launch, make_app, policy, rows, rx, secrets  # noqa: F401

PING = "<!channel> & <@U123>"
MARKUP = "*_[]()~`>#+-=|{}.!\nBcc: evil@example.com \"q\" 'q' «бюджет» €"


def _slack_unescape(text: str) -> str:
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


@pytest.mark.parametrize("name", [PING, MARKUP], ids=["mentions", "markup"])
def test_each_channel_carries_the_name_escaped_as_it_documents(
    home,
    clock,
    db_url,
    tmp_path,
    rx,  # noqa: F811
    secrets,  # noqa: F811
    smtp_server,  # noqa: F811
    name,
):
    only = [
        {"telegram": {"chat_id": -1001, "token_env": "TG_TOKEN"}},
        {"slack": {"webhook_env": "SLACK_URL"}},
        {"webhook": {"url": rx.url + "/hook", "secret_env": "HOOK_SECRET"}},
        {"email": ["team@example.com"]},
    ]
    pol = {**policy(rx, only, recipients=["lead@example.com"]), "name": name}
    app = make_app(home, clock, db_url, tmp_path, rx, pol, smtp=smtp_server.smtp.model_dump())
    launch(app)
    clock.advance(timedelta(hours=1))
    [alert] = enforce.run(app, clock.now())
    out = notify.deliver(app, clock.now())
    assert len(out) == 4 and all(" sent" in line for line in out), out
    # the text every channel starts from (a line break in the subject is a space in a mail)
    [tg] = rx.telegram
    subject, _, _ = tg["text"].partition("\n\n")
    assert subject.startswith(f"Budget {name}: forecast ")

    # Slack: & < > as entities, nothing else touched; no <!…> or <@…> token survives
    [sl] = rx.slack
    assert sl["mrkdwn"] is False
    assert "<" not in sl["text"] and ">" not in sl["text"]
    assert "<!channel>" not in sl["text"] and "<@U123>" not in sl["text"]
    assert _slack_unescape(sl["text"]) == tg["text"]
    if name == PING:
        assert sl["text"].startswith("Budget &lt;!channel&gt; &amp; &lt;@U123&gt;: forecast")

    # Telegram: plain text, no parse mode, the name exactly as written
    assert "parse_mode" not in tg and name in tg["text"]

    # the webhook: JSON, the name a string like any other
    [(body, _)] = rx.webhook
    assert body["policy"] == name and body["subject"] == subject

    # mail: the channel's and the budget's; each one Subject, recipients as configured
    got = {tuple(rcpt): msg for rcpt, msg in smtp_server.inbox.messages}
    assert set(got) == {("team@example.com",), ("lead@example.com",)}
    for msg in got.values():
        assert msg["Bcc"] is None and msg.as_bytes().split(b"\n\n")[0].isascii()
        assert "\n" not in msg["Subject"] and name.replace("\n", " ") in msg["Subject"]
    assert got[("team@example.com",)]["Subject"] == subject.replace("\n", " ")
    lead = got[("lead@example.com",)]
    assert name in lead.get_body(("plain",)).get_content().replace("\r\n", "\n")
    html = lead.get_body(("html",)).get_content()
    if name == PING:  # the budget mail's HTML: the name as text, not markup
        assert "<!channel>" not in html and "&lt;!channel&gt;" in html
    assert alert.kind == "alert" and {d.status for d in rows(app)} == {"sent"}
    app.close()


def test_the_slack_escape_is_the_three_entities_only():
    assert notify.slack_escape("a & b <!here> > *x* «ю»") == (
        "a &amp; b &lt;!here&gt; &gt; *x* «ю»"
    )
    assert json.loads(json.dumps(notify.slack_payload("<x>"))) == {
        "text": "&lt;x&gt;",
        "mrkdwn": False,
    }
