"""Reports over the simulated month: mailed to a real SMTP server on loopback (text, HTML, inline
chart, CSV whose totals match the ledger), in English and Russian; scheduled once per due time;
the CLI's outputs; rent or buy by hand."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from provisioner import ledger, machines, render, reports
from provisioner.app import App
from provisioner.errors import UserError
from provisioner.jobs import scheduled_reports
from provisioner.money import Money
from tests.conftest import make_settings, run_cli, write_settings, write_yaml
from tests.test_ledger import HAND_RUB, HAND_USD, NOV, cents, month, up
from tests.test_mail import smtp_server  # noqa: F401  (fixture)

POLICY = {
    "name": "demo-budget",
    "applies_to": {"projects": ["demo"]},
    "budget": {
        "amount": "500 USD",
        "recipients": ["lead@example.com", "cfo@example.com"],
        "report": {"cron": "0 9 * * MON"},
    },
}


@pytest.fixture
def rapp(home, clock, tmp_path, smtp_server):  # noqa: F811
    d = tmp_path / "policies"
    d.mkdir()
    a = App(make_settings(home, policies=[str(d)], smtp=smtp_server.smtp.model_dump()), clock)
    yield a
    a.close()


def the_policy(app):
    """The budget arrives after the month ran (its guard would have refused the A100)."""
    write_yaml(Path(app.settings.policies[0]) / "p.yaml", POLICY)
    app.__dict__.pop("policies", None)  # an App reads the policies once; read them again
    [p] = app.policies
    return p


def csv_totals(text: str) -> tuple[dict[str, Decimal], Decimal]:
    native: dict[str, Decimal] = {}
    converted = Decimal(0)
    for row in csv.DictReader(io.StringIO(text)):
        native[row["currency"]] = native.get(row["currency"], Decimal(0)) + Decimal(row["amount"])
        converted += Decimal(row["amount_USD"])
    return native, converted


def test_budget_report_by_mail(rapp, clock, smtp_server):  # noqa: F811
    month(rapp, clock)
    r = reports.for_budget(rapp, the_policy(rapp), clock.now(), period=NOV)
    render.email(rapp, r, ["lead@example.com", "cfo@example.com"])
    [(rcpt, msg)] = smtp_server.inbox.messages
    assert rcpt == ["lead@example.com", "cfo@example.com"]
    assert msg["From"] == "provisioner@example.com"
    # 485.39 USD of 500: the month is over, so the forecast is what was spent
    assert msg["Subject"] == "demo-budget: 97 % of budget, forecast 97 %"
    text = msg.get_body(("plain",)).get_content()
    assert "Spent: $485.39 (billed as RUB30,158.94 + $108.41)" in text
    assert "Rates used: 1 USD = 80 RUB" in text
    assert "off hours $8.93" in text  # 12 h × 0.15 + 12 h × 47.50 / 80 (no calendar: 12 h)
    html = msg.get_body(("html",)).get_content()
    assert '<img src="cid:chart"' in html and "$485.39" in html
    [img] = [p for p in msg.walk() if p.get_content_type() == "image/png"]
    assert img["Content-ID"] == "<chart>"
    assert img.get_content()[:8] == b"\x89PNG\r\n\x1a\n" and len(img.get_content()) > 10_000
    [att] = list(msg.iter_attachments())
    assert att.get_content_type() == "text/csv"
    assert att.get_filename() == "spend-demo-budget-2026-11.csv"
    native, converted = csv_totals(att.get_content())
    assert {c: cents(a) for c, a in native.items()} == {
        "USD": cents(HAND_USD),
        "RUB": cents(HAND_RUB),
    }
    assert cents(converted) == Decimal("485.39") == r.total.rounded().amount


def test_russian_report(rapp, clock):
    month(rapp, clock)
    r = reports.for_budget(rapp, the_policy(rapp), clock.now(), period=NOV, language="ru")
    assert render.subject(r) == "demo-budget: 97 % бюджета, прогноз 97 %"
    text = render.text(r)
    assert "Потрачено: 485,39\xa0$ (в валюте счёта 30\xa0158,94\xa0₽ + 108,41\xa0$)" in text
    assert "Период: 2026-11 (1 нояб. 2026\u202fг. – 30 нояб. 2026\u202fг.)" in text
    assert "Аренда или покупка" in text and "Курсы: 1 USD = 80 RUB" in text
    assert '<html lang="ru">' in render.html(r, None)


def test_rent_or_buy_by_hand(rapp, clock):
    month(rapp, clock)
    r = reports.build(rapp, NOV, now=clock.now())
    rows = {o.gpu: o for o in r.rent_or_buy}
    a100 = rows["A100"]
    # 12.5 GPU-hours in 720 h at 3.60 USD/h; owning: 8,000–15,000 USD, 400 W at 0.15 USD/kWh
    month_h = Decimal("12.5") / 720 * 730
    rental = Decimal("45.00") / 720 * 730
    power = month_h * Decimal("0.4") * Decimal("0.15")
    assert a100.cards == 1 and a100.gpu_hours == Decimal("12.5")
    assert a100.rental_month.amount == rental and a100.power_month.amount == power
    assert 8000 / (rental - power) > 36  # longer than the card lives: no payback at all
    assert a100.payback_low is None
    weekly_net = (Decimal("3.60") - Decimal("0.06")) * 52 / 12
    assert cents(a100.breakeven_low) == cents(Decimal(8000) / 36 / weekly_net) == Decimal("14.49")
    assert cents(a100.breakeven_high) == Decimal("27.16")  # the classic 20–30 h a week
    assert a100.verdict == "rent"  # 2.9 h a week
    t4 = rows["T4"]  # us-spot 402 h + ru-res 627 h in 720 h: two cards, busy all week
    assert t4.gpu_hours == 1029 and t4.cards == 2
    assert cents(t4.hours_per_week) == cents(Decimal(1029) / 720 * 168)
    assert t4.verdict == "own"
    net = t4.rental_month.amount - t4.power_month.amount
    assert t4.payback_low == t4.price_low.amount * 2 / net <= 36
    assert "A100: 2.9 GPU-hours a week" in render.ownership_text(r, a100)
    assert "would not pay off within the card's 36-month life" in render.ownership_text(r, a100)


def test_scheduled_report_once_per_due_time(rapp, clock, smtp_server):  # noqa: F811
    the_policy(rapp)
    clock.set(datetime(2026, 11, 2, 9, 0, 30, tzinfo=UTC))  # Monday, just after 09:00
    assert [s.split(":")[0] for s in scheduled_reports.run(rapp, clock.now())] == [
        "report demo-budget due 2026-11-02T09"
    ]
    assert scheduled_reports.run(rapp, clock.now()) == []
    clock.advance(timedelta(hours=6))
    assert scheduled_reports.run(rapp, clock.now()) == []
    clock.set(datetime(2026, 11, 9, 9, 5, tzinfo=UTC))
    assert len(scheduled_reports.run(rapp, clock.now())) == 1
    clock.set(datetime(2026, 11, 11, 9, 5, tzinfo=UTC))  # due Monday, but more than a day ago
    assert scheduled_reports.run(rapp, clock.now()) == []
    assert [m["Subject"] for _, m in smtp_server.inbox.messages] == [
        "demo-budget: 0 % of budget, forecast 0 %"
    ] * 2


def test_cli_outputs(home, clock, tmp_path):
    app = App(make_settings(home), clock)
    month(app, clock)
    span = ledger.Period.parse("2026-11-01..2026-11-20")  # closed before the clock's now
    with app.db.session() as s:
        expected = ledger.total(s, span.start, span.end)
    app.close()
    usd = cents(expected.total(app.settings.money_rates, "USD").amount)
    cfg = write_settings(home)
    args = ("--config", str(cfg), "report", "--period", "2026-11-01..2026-11-20")
    out = run_cli(*args, "--output", "csv", now=clock.now())
    assert out.returncode == 0, out.stderr
    native, converted = csv_totals(out.stdout)
    assert {c: cents(a) for c, a in native.items()} == {c: cents(a) for c, a in expected.items()}
    assert cents(converted) == usd
    js = run_cli(*args, "--by", "machine", "-o", "json", now=clock.now())
    data = json.loads(js.stdout)
    assert data["total"] == Money(usd, "USD").as_json()
    assert [ln["key"] for ln in data["lines"]] == ["ru-res", "us-spot", "us-a100"]
    # no off-hours calendar says when someone is back: each stop counts 12 h (1.80 USD of
    # us-spot, 570 RUB of ru-res), not until it started again (41.03 USD)
    assert data["savings"] == {"off-hours": {"amount": "8.93", "currency": "USD"}}
    table = run_cli(*args, "--by", "cloud", now=clock.now())
    assert table.returncode == 0 and "sandbox" in table.stdout and f"${usd:,}" in table.stdout
    bad = run_cli("--config", str(cfg), "report", "--period", "Nov")
    assert bad.returncode == 2 and "not a period" in bad.stderr


def test_report_over_a_missing_rate_is_a_clear_error(app, home, clock):
    month(app, clock)
    norates = App(make_settings(home, rates={}, state_url=app.settings.state_url), clock)
    with pytest.raises(UserError, match=r"no exchange rate for RUB \(set rates.RUB"):
        reports.build(norates, NOV, now=clock.now())
    norates.close()


def test_report_in_an_unknown_language_is_a_clear_error(app, clock):
    with pytest.raises(UserError, match=r"unknown language 'de'; use en, ru"):
        reports.build(app, NOV, language="de", now=clock.now())


def test_every_language_has_every_message_with_the_same_placeholders():
    """The report's words are gettext catalogs: a message missing in one language, or with a
    placeholder the other lacks, would fail only in that language's mail."""
    import re

    from provisioner import render

    source = render.messages("en")
    fields = re.compile(r"{(\w+)}")
    for language in render.LOCALES:
        words = render.messages(language)
        assert set(words) == set(source), language
        for key, text in source.items():
            assert set(fields.findall(words[key])) == set(fields.findall(text)), (language, key)


def test_without_matplotlib_the_mail_is_whole_but_for_the_picture(rapp, clock, monkeypatch):
    """matplotlib is the ``charts`` extra: without it a report mail keeps its text, table and
    CSV, and the HTML names no missing image."""
    import sys

    month(rapp, clock)
    r = reports.for_budget(rapp, the_policy(rapp), clock.now(), period=NOV)
    with_chart = render.message(rapp, r, ["lead@example.com"])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    msg = render.message(rapp, r, ["lead@example.com"])
    kinds = [p.get_content_type() for p in msg.walk()]
    assert "image/png" in [p.get_content_type() for p in with_chart.walk()]
    assert "image/png" not in kinds and "text/csv" in kinds and "text/plain" in kinds
    html = next(p for p in msg.walk() if p.get_content_type() == "text/html").get_content()
    assert "<img" not in html and render.fmt(r).money(r.total) in html


def test_one_currency_shows_one_figure_and_the_machines_table(app, clock):
    """No unexplained second figure ("Spent: $18.41 ($18.41)"); the machines table says whose
    machine, which GPUs, how long and at what rate; its rows add up to the total."""
    clock.set(datetime(2026, 11, 2, 9, tzinfo=UTC))
    up(app, "t4", gpu="T4:1")
    clock.advance(timedelta(hours=10))
    machines.down(app, "t4")
    r = reports.build(app, NOV, by="owner", now=datetime(2026, 12, 1, tzinfo=UTC))
    text = render.text(r)
    assert f"Spent: {render.fmt(r).money(r.total)}\n" in text and "billed as" not in text
    assert "1. t4 — ana@example.com, 1× T4, 10.0 h × $0.15/h: $1.57" in text  # disk too
    html = render.html(r, None)
    assert '<td>ana@example.com</td><td>1× T4</td><td class="n">10.0</td>' in html
    assert "$0.15/h" in html and "billed as" not in html


def test_rent_or_buy_counts_the_cards_of_a_machine(app, clock):
    """An 8×A100 machine busy 10 % of the month is 8 cards to own, not 1."""
    clock.set(datetime(2026, 11, 2, 9, tzinfo=UTC))
    up(app, "big", gpu="A100:8", market="reserved")
    clock.advance(timedelta(hours=72))
    machines.down(app, "big")
    r = reports.build(app, NOV, now=datetime(2026, 12, 1, tzinfo=UTC))
    [a100] = r.rent_or_buy
    assert a100.gpu_hours == 8 * 72 and a100.cards == 8
    # 576 GPU-hours in 720 h: 134.4 a week, 16.8 per card (on 1 card: 134.4, "owning wins")
    assert "(16.8 h per card on 8 cards)" in render.ownership_text(r, a100)
    [m] = r.top_machines
    assert (m.gpu, m.gpu_count, m.hours) == ("A100", 8, Decimal(72))


@pytest.mark.parametrize("language", ["en", "ru"])
def test_the_chart_has_one_axis_per_panel_in_the_locales_numbers(rapp, clock, language):
    """Cumulative spend against the budget line on one axis above, the days' bars on their own
    panel below; every tick and legend figure in the language's numbers (ru: decimal comma)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    month(rapp, clock)
    r = reports.for_budget(rapp, the_policy(rapp), clock.now(), period=NOV, language=language)
    fig = render.chart(r)
    FigureCanvasAgg(fig).draw()
    top, bottom = fig.axes  # two panels, no twin axis
    assert max(p.get_height() for p in bottom.patches) == pytest.approx(
        max(float(m.amount) for _, m in r.daily)
    )
    assert len(top.patches) == 0 and len(bottom.lines) == 0
    figures = [t.get_text() for ax in fig.axes for t in ax.get_yticklabels()]
    figures += [t.get_text() for t in top.get_legend().get_texts()]
    f = render.fmt(r)
    assert f"{f.t('budget_line')} {f.money(r.budget.amount)}" in figures
    decimals = [x for x in figures if any(ch.isdigit() for ch in x)]
    sep, other = (",", ".") if language == "ru" else (".", ",")
    assert any(sep in x for x in decimals)
    if language == "ru":
        assert not any(other in x for x in decimals), decimals
    assert top.get_ylabel().endswith("USD") and bottom.get_ylabel().endswith("USD")


def test_report_cli_refuses_an_unknown_project_and_bad_addresses(home, clock, smtp_server):  # noqa: F811
    app = App(make_settings(home, smtp=smtp_server.smtp.model_dump()), clock)
    month(app, clock)
    app.close()
    cfg = write_settings(home, smtp=smtp_server.smtp.model_dump())
    base = ("--config", str(cfg), "report", "--period", "2026-11")
    nosuch = run_cli(*base, "--project", "nosuch", now=clock.now())
    assert nosuch.returncode == 2 and "no project 'nosuch' (projects: demo)" in nosuch.stderr
    assert "Traceback" not in nosuch.stderr
    assert run_cli(*base, "--project", "de*", now=clock.now()).returncode == 0  # a glob that fits
    bad = run_cli(*base, "--to", "cfo-at-example.com", now=clock.now())
    assert (
        bad.returncode == 2 and "--to: 'cfo-at-example.com' is not an email address" in bad.stderr
    )
    assert smtp_server.inbox.messages == []
    # --to implies --email
    sent = run_cli(*base, "--to", "cfo@example.com", now=clock.now())
    assert sent.returncode == 0, sent.stderr
    [(rcpt, _)] = smtp_server.inbox.messages
    assert rcpt == ["cfo@example.com"] and "sent" in sent.stderr


def test_report_cli_table_adds_up(home, clock):
    app = App(make_settings(home), clock)
    month(app, clock)
    app.close()
    cfg = write_settings(home)
    out = run_cli(
        "--config",
        str(cfg),
        "report",
        "--period",
        "2026-11",
        "--by",
        "machine",
        now=clock.now(),
        env={"COLUMNS": "160"},
    )
    assert out.returncode == 0, out.stderr
    assert "Spent: $485.39  (billed as RUB30,158.94 + $108.41)" in out.stdout
    assert "ana@example.com" in out.stdout and "1× A100" in out.stdout and "$3.60/h" in out.stdout
    assert "RUB47.50/h" in out.stdout
