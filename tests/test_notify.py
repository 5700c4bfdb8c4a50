"""Notify channels: budget alerts, reports and machine notices reach Telegram, Slack, a signed
webhook and mail on loopback receivers speaking each documented API; each delivery is recorded
(sent, retrying with backoff across passes, failed with the reason) and shown in ``events`` and
``/metrics``; secrets are never stored."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import select

from provisioner import budget, machines, notify
from provisioner.app import App
from provisioner.jobs import enforce, scheduled_reports
from provisioner.jobs.metrics import Metrics
from provisioner.models import Delivery
from provisioner.spec import Experiment
from tests.conftest import make_settings, run_cli, sandbox_experiment, write_settings, write_yaml
from tests.emulators.notify import Receivers
from tests.test_mail import free_port, smtp_server  # noqa: F401  (fixture)
from tests.test_scheduler import sched  # noqa: F401  (fixture)


@pytest.fixture
def rx():
    r = Receivers().start()
    yield r
    r.stop()


@pytest.fixture
def secrets(rx, monkeypatch):
    monkeypatch.setenv("TG_TOKEN", rx.token)
    monkeypatch.setenv("SLACK_URL", rx.url + rx.slack_path)
    monkeypatch.setenv("HOOK_SECRET", rx.secret)


def channels(rx, **over) -> list[dict]:
    return over.pop(
        "only",
        [
            {"telegram": {"chat_id": -1001, "token_env": "TG_TOKEN"}},
            {"slack": {"webhook_env": "SLACK_URL"}},
            {"webhook": {"url": rx.url + "/hook", "secret_env": "HOOK_SECRET"}},
        ],
    )


def policy(rx, notify_to=None, **budget_extra) -> dict:
    return {
        "name": "demo-budget",
        "applies_to": {"projects": ["demo"]},
        "budget": {
            "amount": "2000 USD",
            "alerts": {"actual": [50], "forecast": [100]},
            **budget_extra,
        },
        "notify": channels(rx) if notify_to is None else notify_to,
    }


def make_app(home, clock, db_url, tmp_path, rx, pol: dict, **settings) -> App:
    d = tmp_path / "policies"
    d.mkdir(exist_ok=True)
    write_yaml(d / "p.yaml", pol)
    notify_settings = {"telegram_api": rx.url, "allow": ["127.0.0.1"], **settings.pop("notify", {})}
    return App(
        make_settings(
            home, state_url=db_url, policies=[str(d)], notify=notify_settings, **settings
        ),
        clock,
    )


def big(name="big") -> Experiment:
    return Experiment.model_validate(sandbox_experiment(name, gpu="A100:8", market="spot"))


def launch(app: App) -> None:
    """An 8×A100 spot machine (11 USD/h) launched before the budget's policy is read: the
    budget refuses a launch it cannot afford for the whole period."""
    app.__dict__["policies"] = []
    machines.up(app, big())
    app.__dict__.pop("policies")


def rows(app: App) -> list[Delivery]:
    with app.db.session() as s:
        return list(s.scalars(select(Delivery).order_by(Delivery.id)))


def test_a_budget_alert_reaches_telegram_slack_and_the_signed_webhook(
    home, clock, db_url, tmp_path, rx, secrets
):
    app = make_app(home, clock, db_url, tmp_path, rx, policy(rx))
    launch(app)
    clock.advance(timedelta(hours=1))
    [alert] = enforce.run(app, clock.now())
    assert alert.kind == "alert" and "forecast 378 %" in alert.detail
    assert [(d.kind, d.status) for d in rows(app)] == [
        ("telegram", "pending"),
        ("slack", "pending"),
        ("webhook", "pending"),
    ]
    out = notify.deliver(app, clock.now())
    assert len(out) == 3 and all(" sent" in line for line in out), out
    subject = "Budget demo-budget: forecast 378 % (threshold 100 %)"
    [tg] = rx.telegram
    assert tg["chat_id"] == -1001 and tg["text"].startswith(subject)
    assert "Spent 11.01 USD of 2,000.00 USD" in tg["text"]
    [sl] = rx.slack
    assert sl["text"].startswith(subject)
    [(body, headers)] = rx.webhook  # the receiver checked the HMAC before accepting it
    assert body["topic"] == "budget-alert" and body["subject"] == subject
    assert body["policy"] == "demo-budget" and body["threshold"] == "100"
    raw = json.dumps(body, sort_keys=True).encode()
    assert headers["X-Provisioner-Signature"] == notify.signature(rx.secret, raw)
    assert {d.status for d in rows(app)} == {"sent"}
    # once: the next passes neither queue nor send it again
    assert enforce.run(app, clock.now()) == [] and notify.deliver(app, clock.now()) == []
    assert len(rx.telegram) == 1 and len(rx.slack) == 1 and len(rx.webhook) == 1
    # no secret is kept in the state
    for d in rows(app):
        kept = json.dumps(d.channel) + d.target + (d.error or "")
        assert rx.token not in kept and rx.slack_path not in kept and rx.secret not in kept
    app.close()


def test_telegram_flood_control_is_retried_after_retry_after_at_a_later_pass(
    home, clock, db_url, tmp_path, rx, secrets
):
    only = [{"telegram": {"chat_id": 42, "token_env": "TG_TOKEN"}}]
    app = make_app(home, clock, db_url, tmp_path, rx, policy(rx, only))
    rx.flood, rx.retry_after = 1, 300  # documented: parameters.retry_after, in seconds
    launch(app)
    clock.advance(timedelta(hours=1))
    enforce.run(app, clock.now())
    [line] = notify.deliver(app, clock.now())
    assert "retrying: Telegram 429 (Too Many Requests)" in line
    [d] = rows(app)
    assert d.status == "retrying" and d.attempts == 1
    assert d.next_at == clock.now() + timedelta(seconds=300)  # the longer of 300 s and 60 s
    clock.advance(timedelta(seconds=299))
    assert notify.deliver(app, clock.now()) == []  # not before retry_after
    assert rx.telegram == []
    clock.advance(timedelta(seconds=1))
    [line] = notify.deliver(app, clock.now())
    assert line.endswith("budget-alert sent")
    [d] = rows(app)
    assert (d.status, d.attempts, d.error) == ("sent", 2, None)
    assert len(rx.telegram) == 1
    app.close()


def test_refusals_fail_for_good_with_the_reason_and_never_the_secret(
    home, clock, db_url, tmp_path, rx, secrets, monkeypatch
):
    monkeypatch.setenv("TG_TOKEN", "999:wrong-token")
    monkeypatch.setenv("SLACK_URL", rx.url + "/services/T000/B000/revoked")
    monkeypatch.setenv("HOOK_SECRET", "not-the-shared-secret")
    monkeypatch.delenv("NOT_SET", raising=False)
    only = [
        *channels(rx),
        {"telegram": {"chat_id": 1, "token_env": "NOT_SET"}},
    ]
    app = make_app(home, clock, db_url, tmp_path, rx, policy(rx, only))
    launch(app)
    clock.advance(timedelta(hours=1))
    enforce.run(app, clock.now())
    out = notify.deliver(app, clock.now())
    got = {(d.kind, d.target): (d.status, d.error) for d in rows(app)}
    assert got == {
        ("telegram", "chat -1001"): ("failed", "Telegram 401 (Unauthorized)"),
        ("slack", "$SLACK_URL"): ("failed", "Slack 403 (Forbidden)"),
        ("webhook", rx.url + "/hook"): ("failed", "webhook 401 (Unauthorized)"),
        ("telegram", "chat 1"): ("failed", "$NOT_SET is not set"),
    }
    assert "999:wrong-token" not in "\n".join(out) and "revoked" not in "\n".join(out)
    clock.advance(timedelta(hours=1))
    assert notify.deliver(app, clock.now()) == []  # failed is final
    app.close()


def test_a_webhook_down_is_retried_with_backoff_until_it_answers_or_gives_up(
    home, clock, db_url, tmp_path, rx, secrets
):
    only = [{"webhook": {"url": rx.url + "/hook", "secret_env": "HOOK_SECRET"}}]
    app = make_app(home, clock, db_url, tmp_path, rx, policy(rx, only), notify={"max_attempts": 3})
    rx.webhook_down = 2
    launch(app)
    clock.advance(timedelta(hours=1))
    enforce.run(app, clock.now())
    waits = []
    for _ in range(3):
        assert len(notify.deliver(app, clock.now())) == 1
        [d] = rows(app)
        if d.status != "retrying":
            break
        waits.append(d.next_at - clock.now())
        clock.advance(d.next_at - clock.now())
    assert waits == [timedelta(seconds=60), timedelta(seconds=120)]  # doubled each try
    assert (d.status, d.attempts) == ("sent", 3) and len(rx.webhook) == 1
    # a receiver that stays down: failed after max_attempts, with the last reason
    rx.webhook_down = 10
    notify.tell_policy(
        app,
        notify.Notice("report", "k2", notify.texts("preempted", machine="m", where="w")),
        "demo-budget",
    )
    for _ in range(3):
        notify.deliver(app, clock.now())
        clock.advance(timedelta(hours=2))
    d = rows(app)[-1]
    assert (d.status, d.attempts) == ("failed", 3)
    assert d.error == "webhook 503 (Service Unavailable) (gave up after 3 attempts)"
    app.close()


def test_russian_texts_follow_the_channel_or_the_budget_language(
    home, clock, db_url, tmp_path, rx, secrets
):
    only = [
        {"telegram": {"chat_id": 7, "token_env": "TG_TOKEN"}},  # the budget's language: ru
        {"slack": {"webhook_env": "SLACK_URL"}, "language": "en"},
    ]
    pol = policy(rx, only, language="ru")
    app = make_app(
        home, clock, db_url, tmp_path, rx, pol, notify={"dashboard_url": "https://gpu.example.com"}
    )
    launch(app)
    clock.advance(timedelta(hours=1))
    enforce.run(app, clock.now())
    notify.deliver(app, clock.now())
    [tg] = rx.telegram
    assert tg["text"].startswith("Бюджет demo-budget: прогноз 378 % (порог 100 %)")
    assert "Потрачено 11.01 USD из 2,000.00 USD" in tg["text"]
    assert tg["text"].endswith("https://gpu.example.com/")  # the dashboard, when known
    assert rx.slack[0]["text"].startswith("Budget demo-budget: forecast 378 %")
    app.close()


def test_an_owners_channels_hear_of_the_stop_warning(
    home,
    clock,
    db_url,
    tmp_path,
    rx,
    secrets,
    smtp_server,  # noqa: F811
):
    pol = {
        "name": "nights",
        "off_hours": {"timezone": "UTC", "weekends": "mon-sun"},
        "idle": {"unknown_counts_as_idle": True, "warn_minutes": 10},
    }
    owners = {"ana@*": [{"telegram": {"chat_id": 5, "token_env": "TG_TOKEN"}}]}
    app = make_app(
        home,
        clock,
        db_url,
        tmp_path,
        rx,
        pol,
        notify={"owners": owners},
        smtp=smtp_server.smtp.model_dump(),
    )
    from provisioner.jobs import sweep

    m = machines.up(app, Experiment.model_validate(sandbox_experiment("idle-one"))).machine
    clock.advance(timedelta(hours=1))
    assert [a.action for a in sweep.run(app).actions] == ["warn"]
    notify.deliver(app, clock.now())
    [tg] = rx.telegram
    assert tg["chat_id"] == 5
    assert tg["text"].startswith(f"{m.name} will be stopped at ")
    assert f"provisioner keep {m.name} --until" in tg["text"]
    kinds = {(d.topic, d.kind, d.status) for d in rows(app)}
    assert kinds == {("stop-warning", "telegram", "sent"), ("stop-warning", "email", "sent")}
    app.close()


def test_a_failing_budget_mail_is_recorded_and_shown(home, clock, db_url, tmp_path, rx, secrets):
    """The issue: a month of budget-alert mails failed and nothing showed it."""
    dead = {"host": "127.0.0.1", "port": free_port(), "security": "none", "timeout_seconds": 2}
    pol = policy(rx, [], recipients=["lead@example.com"])
    app = make_app(home, clock, db_url, tmp_path, rx, pol, smtp=dead)
    launch(app)
    clock.advance(timedelta(hours=1))
    for _ in range(2):  # the alert stays unclaimed: each pass tries the mail again
        [a] = enforce.run(app, clock.now())
        assert a.error and "refused" in a.error.lower()
        clock.advance(timedelta(minutes=1))
    [d] = rows(app)
    assert (d.kind, d.status, d.attempts, d.target) == ("email", "retrying", 2, "lead@example.com")
    assert "mail to 127.0.0.1" in d.error
    text = Metrics(app).render()[0].decode()
    assert 'provisioner_notify_deliveries{kind="email",status="retrying"} 2.0' not in text
    assert 'provisioner_notify_deliveries{kind="email",status="retrying"} 1.0' in text
    app.close()


def test_metrics_carry_each_budget_as_the_budget_code_computes_it(
    home, clock, db_url, tmp_path, rx
):
    app = make_app(home, clock, db_url, tmp_path, rx, policy(rx, []))
    launch(app)
    clock.advance(timedelta(hours=10))
    text = Metrics(app).render()[0].decode()
    [pol] = app.policies
    st = budget.status(app, pol, clock.now())
    assert st is not None
    labels = 'period="2026-11",policy="demo-budget"'
    for name, value in (
        ("amount", st.amount.amount),
        ("spent", st.spent.amount),
        ("committed", st.committed.amount),
        ("forecast", st.forecast.amount),
    ):
        assert f"provisioner_budget_{name}_usd{{{labels}}} {float(value)!r}" in text, name
    ratio = float(st.spent.amount / st.amount.amount)
    assert f"provisioner_budget_spent_ratio{{{labels}}} {ratio!r}" in text
    assert float(st.spent.amount) > 100  # 10 h at 11 USD/h: a real figure, not a zero
    assert "# TYPE provisioner_budget_spent_usd gauge" in text
    assert "# HELP provisioner_budget_idle_waste_usd " in text
    assert 'provisioner_machines{cloud="sandbox",state="running"} 1.0' in text
    from prometheus_client.parser import text_string_to_metric_families

    names = {f.name for f in text_string_to_metric_families(text)}  # valid exposition
    assert {"provisioner_budget_forecast_usd", "provisioner_notify_deliveries"} <= names
    app.close()


def test_events_notices_lists_each_delivery(home, clock, db_url, tmp_path, rx, secrets):
    only = [
        {"slack": {"webhook_env": "SLACK_URL"}},
        {"telegram": {"chat_id": 1, "token_env": "NO"}},
    ]
    pol = policy(rx, only)
    settings = write_settings(
        home, state_url=db_url, policies=[str(write_yaml(tmp_path / "p.yaml", pol))],
        notify={"telegram_api": rx.url, "allow": ["127.0.0.1"]},
    )  # fmt: skip
    app = App(
        make_settings(
            home, state_url=db_url, policies=[str(tmp_path / "p.yaml")],
            notify={"allow": ["127.0.0.1"]},
        ),
        clock,
    )  # fmt: skip
    launch(app)
    clock.advance(timedelta(hours=1))
    enforce.run(app, clock.now())
    notify.deliver(app, clock.now())
    env = {"PROVISIONER_CONFIG": str(settings), "SLACK_URL": rx.url + rx.slack_path}
    r = run_cli("events", env=env, now=clock.now())
    assert r.returncode == 0, r.stderr
    assert "notices: 1 failed (see `provisioner events --notices`)" in r.stdout
    r = run_cli("events", "--notices", env=env, now=clock.now())
    assert r.returncode == 0, r.stderr
    assert "budget-alert" in r.stdout and "slack" in r.stdout and "sent" in r.stdout
    assert "$NO is not set" in r.stdout
    r = run_cli("events", "--notices", "--output", "json", env=env, now=clock.now())
    got = {(x["channel"], x["status"]) for x in json.loads(r.stdout)}
    assert got == {("slack", "sent"), ("telegram", "failed")}
    app.close()


def test_a_scheduled_report_goes_to_the_channels(home, clock, db_url, tmp_path, rx, secrets):
    only = [{"slack": {"webhook_env": "SLACK_URL"}}]
    app = make_app(
        home, clock, db_url, tmp_path, rx, policy(rx, only, report={"cron": "0 8 * * mon"})
    )
    clock.advance(timedelta(days=7))  # Monday 09:00 a week on: the 08:00 report is due
    out = scheduled_reports.run(app, clock.now())
    assert out == ["report demo-budget due 2026-11-09T08:00+00:00: queued for its notify channels"]
    assert scheduled_reports.run(app, clock.now()) == []
    notify.deliver(app, clock.now())
    [sl] = rx.slack
    assert sl["text"].startswith("Report demo-budget, 2026-11: 0.00 USD of 2,000.00 USD (0 %)")


def test_a_channel_needs_exactly_one_kind(tmp_path, home):
    bad = {
        "name": "x",
        "notify": [{"telegram": {"chat_id": 1, "token_env": "T"}, "email": ["a@b.io"]}],
    }
    path = write_yaml(tmp_path / "bad.yaml", bad)
    settings = write_settings(home, policies=[str(path)])
    r = run_cli("--config", str(settings), "scheduler", "run", timeout=60)
    assert r.returncode == 2
    assert "give exactly one of telegram, slack, webhook, email" in r.stdout + r.stderr
    assert "Traceback" not in r.stderr


def test_the_dashboard_lists_recent_notices(home, clock, db_url, tmp_path, rx, secrets):
    from provisioner.dashboard import make_app as dashboard
    from tests.test_dashboard import call

    only = [
        {"slack": {"webhook_env": "SLACK_URL"}},
        {"webhook": {"url": rx.url + "/hook?<b>", "secret_env": "NOPE"}},
    ]
    app = make_app(home, clock, db_url, tmp_path, rx, policy(rx, only))
    launch(app)
    clock.advance(timedelta(hours=1))
    enforce.run(app, clock.now())
    notify.deliver(app, clock.now())
    status, _, html = call(dashboard(app, listen="127.0.0.1:8765"), "/spend")
    assert status == 200
    section = html[html.index('<table id="notices"') :]
    section = section[: section.index("</table>")]
    assert section.count("<tr ") == 2
    assert 'data-status="sent"' in section and 'data-status="failed"' in section
    assert "$NOPE is not set" in section and "<b>" not in section
    assert "Budget demo-budget: forecast 378 %" in section
    app.close()


def test_preemption_and_a_refused_relaunch_reach_the_owners_channel(sched, rx, secrets):  # noqa: F811
    """The owner's Telegram hears the preemption (reconcile) and, once, that policy refused the
    relaunch (recover), however many passes keep it held."""
    from provisioner.jobs import reconcile
    from tests.test_held import A100_ONLY, ANY, day_of_passes
    from tests.test_scheduler import preempt, up

    owners = {"ana@example.com": [{"telegram": {"chat_id": 9, "token_env": "TG_TOKEN"}}]}
    settings = {"notify": {"telegram_api": rx.url, "allow": ["127.0.0.1"], "owners": owners}}
    first = sched(ANY, **settings)
    up(first, "spot", lifecycle={"on_preemption": "relaunch"})
    preempt(first, "spot")
    reconcile.run(first)
    app = sched(A100_ONLY, start=first.clock.now(), **settings)
    day_of_passes(app, timedelta(hours=5))  # every try refused, then given up
    notify.deliver(app, app.clock.now())
    got = [m["text"].split("\n")[0] for m in rx.telegram]
    assert got == ["spot was preempted", "Relaunch of spot refused", "Gave up relaunching spot"]
    assert all(m["chat_id"] == 9 for m in rx.telegram)
    assert "policy" in rx.telegram[1]["text"]
    day_of_passes(app, timedelta(hours=1))  # further passes queue nothing new
    notify.deliver(app, app.clock.now())
    assert len(rx.telegram) == 3


def test_a_launch_after_waiting_reaches_the_project_channel_in_russian(
    home,
    clock,
    db_url,
    tmp_path,
    rx,
    secrets,
    smtp_server,  # noqa: F811
):
    from provisioner.jobs import waiting as waiting_pass
    from tests.test_waiting import FULL, queue

    pol = {
        "name": "demo-team",
        "applies_to": {"projects": ["demo"]},
        "notify": [{"slack": {"webhook_env": "SLACK_URL"}, "language": "ru"}],
    }
    app = make_app(home, clock, db_url, tmp_path, rx, pol, smtp=smtp_server.smtp.model_dump())
    app.provider("sandbox").inject(capacity=FULL)
    m = queue(app)
    clock.advance(timedelta(minutes=1))
    waiting_pass.run(app)
    notify.deliver(app, clock.now())
    assert rx.slack == []  # still waiting: nothing to tell
    app.provider("sandbox").inject(capacity={})
    clock.advance(timedelta(minutes=2))
    [a] = waiting_pass.run(app).actions
    assert a.done
    notify.deliver(app, clock.now())
    [sl] = rx.slack
    assert sl["text"].startswith(f"{m.name} запущена после ожидания мощностей")
    assert (
        "(проект demo) запущена в sandbox sandbox-us-1a после ожидания с 2026-11-02 09:00 UTC"
        in sl["text"]
    )
    got = {(d.topic, d.kind, d.status) for d in rows(app)}
    assert got == {("launched", "slack", "sent"), ("launched", "email", "sent")}
    app.close()


def test_a_higher_threshold_supersedes_the_mail_still_retrying(home, clock, db_url, tmp_path, rx):
    dead = {"host": "127.0.0.1", "port": free_port(), "security": "none", "timeout_seconds": 2}
    pol = policy(rx, [], recipients=["lead@example.com"])
    pol["budget"]["alerts"] = {"actual": [1, 2], "forecast": []}
    app = make_app(home, clock, db_url, tmp_path, rx, pol, smtp=dead)
    launch(app)
    clock.advance(timedelta(hours=2, minutes=30))  # 27.5 USD: 1.4 %
    [a] = enforce.run(app, clock.now())
    assert a.error and "(threshold 1 %)" in a.detail
    clock.advance(timedelta(hours=1, minutes=30))  # 44 USD: 2.2 %: the mail now says 2 %
    [a] = enforce.run(app, clock.now())
    assert a.error and "(threshold 2 %)" in a.detail
    first, second = rows(app)
    assert first.status == "failed" and first.error.endswith(
        "; superseded by “budget demo-budget: actual 2 % (threshold 2 %)”"
    )
    assert second.status == "retrying"
    app.close()
