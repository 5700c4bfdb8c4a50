"""Channel secrets go nowhere: planted with newlines (a Kubernetes secret made from a file, an
EnvironmentFile with CRLF), quotes and unicode, they are sent with but never found — raw,
stripped, line by line, escaped as repr or JSON would, URL- or HTML-encoded — in any text
column of any table, in ``sweep``'s or ``events --notices``' output, in a log line or on
/alerts, whether the delivery succeeded or failed (issue 33: a bot token ending in a newline
appeared whole in the deliveries row, sweep, events and /alerts)."""

from __future__ import annotations

import html
import json
import logging
import re
from datetime import timedelta
from urllib.parse import quote, quote_plus

from sqlalchemy import select

from provisioner import notify
from provisioner.app import App
from provisioner.jobs import enforce
from provisioner.models import Base
from tests import test_notify
from tests.conftest import make_settings, run_cli, write_settings, write_yaml
from tests.test_mail import free_port
from tests.test_notify import launch, rows

SMTP_PASSWORD = "smtp-pässwörd\"'\\x\r\n"

rx = test_notify.rx  # the receivers (a fixture)


def planted(rx) -> dict[str, str]:
    """Secrets as a careless environment holds them; those that work do so once stripped."""
    rx.secret = 'whsec-"quo\'te"-ключ-🔑'
    return {
        "TG_TOKEN": rx.token + "\r\n",  # works: the receiver knows the token without CRLF
        "BAD_TG": "999:wr\"ong'tök\nen-секрет\n",  # fails: not a token a URL can carry
        "SLACK_URL": rx.url + rx.slack_path + "\n",  # works
        "HOOK_SECRET": rx.secret + "\n",  # works: the signature is over the stripped key
        "HOOK_URL": rx.url + "/hook?token=t0k\"en'-" + "x" * 8 + "\n",  # fails: 404
        "PROVISIONER_SMTP_PASSWORD": SMTP_PASSWORD,  # fails: nothing listens
    }


def encodings(secret: str) -> set[str]:
    """How a message, a row or a page could carry ``secret`` or one of its lines."""
    pieces = {secret, secret.strip(), *(p.strip() for p in re.split(r"[\r\n]+", secret))}
    out = set()
    for p in (p for p in pieces if len(p) >= 6):
        out |= {p, repr(p)[1:-1], json.dumps(p)[1:-1], quote(p, safe=""), quote(p)}
        out |= {quote_plus(p), html.escape(p), p.encode("unicode_escape").decode()}
    return out


def test_planted_secrets_are_used_but_never_stored_printed_logged_or_shown(
    home,
    clock,
    db_url,
    tmp_path,
    rx,
    monkeypatch,
    caplog,
):
    from provisioner.dashboard import make_app as dashboard
    from tests.test_dashboard import call

    env = planted(rx)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    pol = {
        "name": "demo-budget",
        "applies_to": {"projects": ["demo"]},
        "budget": {
            "amount": "2000 USD",
            "alerts": {"actual": [50], "forecast": [100]},
            "recipients": ["lead@example.com"],
        },
        "notify": [
            {"telegram": {"chat_id": -1001, "token_env": "TG_TOKEN"}},
            {"telegram": {"chat_id": 7, "token_env": "BAD_TG"}},
            {"slack": {"webhook_env": "SLACK_URL"}},
            {"webhook": {"url": rx.url + "/hook", "secret_env": "HOOK_SECRET"}},
            {"webhook": {"url_env": "HOOK_URL"}},
        ],
    }
    smtp = {"host": "127.0.0.1", "port": free_port(), "security": "none", "user": "bot",
            "timeout_seconds": 2}  # fmt: skip
    options = {
        "state_url": db_url,
        "policies": [str(write_yaml(tmp_path / "p.yaml", pol))],
        "notify": {"telegram_api": rx.url, "allow": ["127.0.0.1"]},
        "smtp": smtp,
    }
    caplog.set_level(logging.DEBUG)
    app = App(make_settings(home, **options), clock)
    launch(app)
    clock.advance(timedelta(hours=1))
    enforce.run(app, clock.now())
    said = notify.deliver(app, clock.now())
    got = {(d.kind, d.target): d.status for d in rows(app)}
    assert got == {
        ("telegram", "chat -1001"): "sent",
        ("telegram", "chat 7"): "failed",
        ("slack", "$SLACK_URL"): "sent",
        ("webhook", rx.url + "/hook"): "sent",
        ("webhook", "$HOOK_URL"): "failed",
        ("email", "lead@example.com"): "retrying",
    }
    assert len(rx.telegram) == len(rx.slack) == len(rx.webhook) == 1  # the secrets worked
    assert {d.error for d in rows(app) if d.kind == "webhook" and d.error} == {
        "webhook 404 (Not Found)"
    }
    # the CLI: a sweep (it tries the mail again) and the notices, as a member reads them
    cfg = write_settings(home, **options)
    clock.advance(timedelta(minutes=2))
    outputs = [run_cli("--config", str(cfg), a, *rest, env=env, now=clock.now())
               for a, *rest in (["sweep"], ["events", "--notices"],
                                ["events", "--notices", "-o", "json"])]  # fmt: skip
    assert all(r.returncode == 0 for r in outputs), [r.stderr for r in outputs]
    assert "lead@example.com" in outputs[1].stdout and "chat 7" in outputs[1].stdout
    status, _, page = call(dashboard(app), "/alerts")
    assert status == 200 and "chat 7" in page
    # every text of every table
    stored = []
    with app.db.session() as s:
        for table in Base.metadata.sorted_tables:
            for row in s.execute(select(table)):
                stored += [json.dumps(v, default=str, ensure_ascii=False) for v in row]
                stored += [str(v) for v in row]
    seen = "\n".join(
        [*stored, *said, page, *(r.stdout + r.stderr for r in outputs)]
        + [r.getMessage() for r in caplog.records]
    )
    assert "chat -1001" in seen and "$HOOK_URL" in seen
    for name, secret in env.items():
        for form in encodings(secret):
            assert form not in seen, (name, form)
    app.close()


def test_a_secret_quoted_in_a_notice_in_any_form_is_masked_in_the_row_and_the_message(
    home,
    clock,
    db_url,
    tmp_path,
    rx,
    monkeypatch,
):
    """A notice quoting an error that quoted a secret (a cloud's message, a relaunch's reason):
    raw, as repr, URL-encoded, HTML-escaped, split across lines."""
    secret = "tok-\"ключ'-" + "z" * 8 + "\r\n"
    monkeypatch.setenv("TG_TOKEN", rx.token)
    monkeypatch.setenv("HOOK_SECRET", secret)
    core = secret.strip()
    why = " | ".join(
        [secret, repr(secret), quote(core, safe=""), quote_plus(core), html.escape(core),
         core[:6] + "\n" + core[6:], json.dumps(secret)]
    )  # fmt: skip
    pol = {
        "name": "demo-budget",
        "notify": [
            {"telegram": {"chat_id": 1, "token_env": "TG_TOKEN"}},
            {"webhook": {"url": rx.url + "/nowhere", "secret_env": "HOOK_SECRET"}},
        ],
    }
    app = App(
        make_settings(
            home, state_url=db_url, policies=[str(write_yaml(tmp_path / "p.yaml", pol))],
            notify={"telegram_api": rx.url, "allow": ["127.0.0.1"]},
        ),
        clock,
    )  # fmt: skip
    texts = notify.texts("relaunch-failed", machine="m", attempt=1, why=why)
    assert notify.tell_policy(app, notify.Notice("relaunch-failed", "k", texts), "demo-budget")
    notify.deliver(app, clock.now())
    [sent] = rx.telegram
    assert sent["text"].count("***") == 7
    seen = sent["text"] + "".join(d.text + d.subject + (d.error or "") for d in rows(app))
    for form in encodings(secret) | {core[:6] + "\n" + core[6:]}:
        assert form not in seen, form
    app.close()
