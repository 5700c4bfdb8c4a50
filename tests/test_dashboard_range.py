"""The Spend page's period picker and the previous period beside it, ``report --compare``, and
the Alerts page (each notice and its delivery). Over the dashboard's seeded November (the
test's clock: Thursday 2026-11-26 10:00 UTC) and, for alerts, notices sent through the real
notify path to loopback receivers."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from html import unescape

import pytest

from provisioner import notify
from provisioner.app import App
from provisioner.dashboard import make_app as dashboard
from provisioner.jobs import enforce
from provisioner.views import alerts as alerts_view
from tests.conftest import make_settings, run_cli, write_settings, write_yaml
from tests.test_dashboard import (  # noqa: F401  (fixtures)
    NOW,
    axe_problems,
    browser,
    call,
    money_text,
    screens,
    seed,
    shoot,
    stop_server,
    window,
)
from tests.test_notify import channels, launch, rx, secrets  # noqa: F401  (fixtures)


@pytest.fixture
def state(home, clock, db_url):
    """The dashboard tests' November (a sandbox fleet, two budgets), on SQLite and PostgreSQL."""
    a, pdir = seed(home, clock, db_url)
    yield a, pdir
    a.close()


def cli(a: App, pdir, *args: str, now: datetime = NOW) -> dict:
    cfg = write_settings(a.settings.home, policies=[str(pdir)], state_url=a.settings.state_url)
    r = run_cli("--config", str(cfg), "report", *args, "-o", "json", now=now)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def cells(html: str, cls: str) -> dict[str, str]:
    """Each line of the #lines table (by its key): the text of its cell of class ``cls``."""
    table = html[html.index('<table id="lines"') :]
    table = table[: table.index("</table>")]
    out = {}
    for key, row in re.findall(r'<tr data-key="([^"]*)"[^>]*>(.*?)</tr>', table, re.S):
        m = re.search(rf'<td class="n {cls}">(.*?)</td>', row, re.S)
        assert m, (key, row)
        out[unescape(key)] = unescape(m[1])
    return out


def by_id(html: str, id_: str) -> str:
    m = re.search(rf'id="{id_}"[^>]*>(.*?)</', html, re.S)
    assert m, id_
    return unescape(m[1])


def choices(html: str) -> dict[str, str]:
    """The picker's quick choices: id → the period its link asks for ('' the budget's)."""
    nav = html[html.index('id="period-choices"') :]
    nav = nav[: nav.index("</ul>")]
    out = {}
    for href, id_ in re.findall(r'<a href="([^"]*)" id="(p-[\w-]+)"', nav):
        m = re.search(r"period=([^&]*)", unescape(href))
        out[id_] = m[1] if m else ""
    return out


# --- the picker ------------------------------------------------------------------------------


def test_the_picker_asks_for_periods_the_report_reads(state):
    a, _ = state
    wsgi = dashboard(a)
    status, _, html = call(wsgi, "/spend?budget=demo-budget&by=owner")
    assert status == 200
    assert choices(html) == {
        "p-budget": "",  # the budget's running period: November in Berlin
        "p-month": "2026-11",
        "p-last-month": "2026-10",
        "p-7": "2026-11-20..2026-11-26",  # today and the six days before
        "p-30": "2026-10-28..2026-11-26",
        "p-quarter": "2026-10-01..2026-12-31",
        "p-year": "2026-01-01..2026-12-31",
    }
    assert 'id="p-budget" aria-current="true"' in html  # the one shown, and only it
    assert html.count('aria-current="true"') == 1
    # each link keeps the other filters
    nav = html[html.index('id="period-choices"') : html.index("</ul>", html.index("choices"))]
    assert nav.count("budget=demo-budget") == 7 and nav.count("by=owner") == 7
    # the custom days: a GET form that carries the filters, its dates the period shown
    form = html[html.index('<form method="get" action="/spend" class="filters" id="range">') :]
    form = form[: form.index("</form>")]
    assert '<input type="hidden" name="budget" value="demo-budget">' in form
    assert '<input type="hidden" name="by" value="owner">' in form
    assert 'type="date" name="from" id="f-from" value="2026-11-01"' in form
    assert 'type="date" name="to" id="f-to" value="2026-11-30"' in form
    # from..to is the period report --period reads: the same page
    days = call(wsgi, "/spend?budget=demo-budget&by=owner&from=2026-11-03&to=2026-11-09")[2]
    same = call(wsgi, "/spend?budget=demo-budget&by=owner&period=2026-11-03..2026-11-09")[2]
    assert cells(days, "line-total") == cells(same, "line-total")
    assert "2026-11-03..2026-11-09 (Nov 3, 2026 – Nov 9, 2026)" in days
    assert 'id="p-month"' in days and "aria-current" not in days  # no quick choice is it
    # the main form keeps the chosen period when another filter changes
    assert '<input type="hidden" name="period" value="2026-11-03..2026-11-09">' in days
    # a quick choice shown lights up
    last = call(wsgi, "/spend?by=owner&period=2026-10")[2]
    assert 'id="p-last-month" aria-current="true"' in last and "p-budget" not in last


@pytest.mark.parametrize(
    "query, period",
    [
        ("from=2026-11-31&to=2026-12-01", "2026-11-31..2026-12-01"),
        ("from=2026-11-09&to=2026-11-03", "2026-11-09..2026-11-03"),
        ("from=1800-01-01&to=1800-01-02", "1800-01-01..1800-01-02"),
        ("period=last-week", "last-week"),
    ],
)
def test_bad_days_are_400_with_the_clis_words(state, query, period):
    a, pdir = state
    status, _, html = call(dashboard(a), f"/spend?{query}")
    cfg = write_settings(a.settings.home, policies=[str(pdir)], state_url=a.settings.state_url)
    r = run_cli("--config", str(cfg), "report", "--period", period, now=NOW)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    said = r.stderr.strip().removeprefix("error: ")
    assert status == 400 and by_id(html, "error") == said, (html, said)
    assert "Traceback" not in html


def test_one_day_of_two_is_400(state):
    status, _, html = call(dashboard(state[0]), "/spend?from=2026-11-03&by=owner")
    assert status == 400 and by_id(html, "error") == "period: give both days, from and to"


# --- the previous period -------------------------------------------------------------------


@pytest.mark.parametrize(
    "period, tz, before",
    [
        ("2026-03", "Europe/Berlin", "2026-02"),
        ("2026-01", "UTC", "2025-12"),
        ("2026-W01", "UTC", "2025-W52"),
        ("2026-11-20..2026-11-26", "UTC", "2026-11-13..2026-11-19"),
        ("2026-10-01..2026-12-31", "UTC", "2026-07-01..2026-09-30"),  # a quarter: 92 days
        ("2026-03-29..2026-03-29", "Europe/Berlin", "2026-03-28..2026-03-28"),  # DST: 23 h
    ],
)
def test_the_period_before_is_of_the_same_kind_and_length(period, tz, before):
    from provisioner.ledger import Period

    p = Period.parse(period, tz).previous()
    assert p == Period.parse(before, tz) and p.end == Period.parse(period, tz).start


def test_the_previous_period_is_the_report_of_the_days_before(state):
    """Last 7 days by owner: each line's previous figure and the total are what
    ``provisioner report`` says of the 7 days before; the change is the difference; the
    dashboard and ``report --compare`` agree."""
    a, pdir = state
    html = call(dashboard(a), "/spend?by=owner&from=2026-11-20&to=2026-11-26")[2]
    now = cli(a, pdir, "--by", "owner", "--period", "2026-11-20..2026-11-26")
    before = cli(a, pdir, "--by", "owner", "--period", "2026-11-13..2026-11-19")
    assert cells(html, "line-total") == {ln["key"]: money_text(ln["total"]) for ln in now["lines"]}
    want = {ln["key"]: money_text(ln["total"]) for ln in before["lines"]}
    assert cells(html, "line-previous") == want and len(want) == 3
    assert by_id(html, "lines-previous") == money_text(before["total"])
    assert by_id(html, "previous-total") == money_text(before["total"])
    # the shown previous lines add up to the shown previous total
    shown = [Decimal(ln["total"]["amount"]) for ln in before["lines"]]
    assert sum(shown) == Decimal(before["total"]["amount"]) > 0
    # the change: now − before, and in per cent of before
    diff = Decimal(now["total"]["amount"]) - Decimal(before["total"]["amount"])
    pct = (diff * 100 / Decimal(before["total"]["amount"])).quantize(Decimal(1), ROUND_HALF_UP)
    sign = "+" if diff > 0 else ""
    shown = money_text({"amount": str(diff), "currency": "USD"})
    assert by_id(html, "lines-change") == f"{sign}{shown} ({sign}{pct} %)"
    # report --compare: the same figures in JSON
    both = cli(a, pdir, "--by", "owner", "--period", "2026-11-20..2026-11-26", "--compare")
    prev = both["previous"]
    assert prev["period"]["label"] == "2026-11-13..2026-11-19"
    assert prev["total"] == before["total"]
    assert {ln["key"]: ln["total"] for ln in prev["lines"]} == {
        ln["key"]: ln["total"] for ln in before["lines"]
    }
    assert Decimal(prev["change"]["amount"]) == diff
    assert both["lines"] == now["lines"] and both["total"] == now["total"]


def test_a_line_spent_only_before_and_a_new_one(state):
    """big-a100 ran Nov 5–12: by machine over Nov 13–19 it is a line of the previous week only
    (0 now, −100 %); seg-2, launched Nov 16, is new against Nov 6–12."""
    a, pdir = state
    html = call(dashboard(a), "/spend?by=machine&period=2026-11-13..2026-11-19")[2]
    before = cli(a, pdir, "--by", "machine", "--period", "2026-11-06..2026-11-12")
    shown_before = {ln["key"]: money_text(ln["total"]) for ln in before["lines"]}
    assert cells(html, "line-previous") == {**shown_before, "seg-2": "$0.00"}
    assert cells(html, "line-total")["big-a100"] == "$0.00"
    assert cells(html, "line-change")["big-a100"].endswith("(-100 %)")
    assert cells(html, "line-change")["seg-2"] == "new"
    assert by_id(html, "lines-previous") == money_text(before["total"])
    # the CLI's table: the same columns
    cfg = write_settings(a.settings.home, policies=[str(pdir)], state_url=a.settings.state_url)
    r = run_cli(
        "--config", str(cfg), "report", "--by", "machine", "--period", "2026-11-13..2026-11-19",
        "--compare", now=NOW,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Previous" in r.stdout and "Change" in r.stdout
    [row] = [ln for ln in r.stdout.splitlines() if "big-a100" in ln]
    assert shown_before["big-a100"] in row and "-100 %" in row
    said = "Previous: 2026-11-06..2026-11-12 (Nov 6, 2026 – Nov 12, 2026) — "
    assert said + money_text(before["total"]) in r.stdout


def test_compare_is_for_the_table_and_json(state):
    a, pdir = state
    cfg = write_settings(a.settings.home, policies=[str(pdir)], state_url=a.settings.state_url)
    r = run_cli("--config", str(cfg), "report", "--compare", "-o", "csv", now=NOW)
    assert r.returncode == 2 and "--compare: shown in the table and in -o json" in r.stderr


# --- alerts --------------------------------------------------------------------------------


@pytest.fixture
def alerted(home, clock, db_url, tmp_path, rx, secrets):  # noqa: F811
    """Two budgets over demo, alerted by enforce and delivered by notify: demo-budget's
    channels — Slack sent, Telegram flood-limited (retrying), a webhook whose secret is not
    set (failed) — and quiet-budget with no channel at all (nobody told)."""
    d = tmp_path / "policies"
    d.mkdir()
    only = [
        {"slack": {"webhook_env": "SLACK_URL"}},
        {"telegram": {"chat_id": 42, "token_env": "TG_TOKEN"}},
        {"webhook": {"url": rx.url + "/hook?<b>", "secret_env": "NOPE"}},
    ]
    budget = {"amount": "2000 USD", "alerts": {"actual": [50], "forecast": [50, 100]}}
    write_yaml(d / "demo.yaml", {"name": "demo-budget", "applies_to": {"projects": ["demo"]},
                                 "budget": budget, "notify": only})  # fmt: skip
    write_yaml(d / "quiet.yaml", {"name": "quiet-budget", "applies_to": {"projects": ["demo"]},
                                  "budget": {**budget, "amount": "1000 USD"}})  # fmt: skip
    notify_settings = {"telegram_api": rx.url, "allow": ["127.0.0.1"]}
    settings = make_settings(home, state_url=db_url, policies=[str(d)], notify=notify_settings)
    app = App(settings, clock)
    rx.flood, rx.retry_after = 1, 300
    launch(app)
    clock.advance(timedelta(hours=1))
    enforce.run(app, clock.now())
    notify.deliver(app, clock.now())
    yield app
    app.close()


def statuses(html: str, table: str = "alerts") -> list[tuple[str, str]]:
    body = html[html.index(f'<table id="{table}"') :]
    body = body[: body.index("</table>")]
    return re.findall(r'<tr data-status="(\w+)" data-budget="([\w-]+)"', body)


def test_alerts_list_each_notice_and_how_its_delivery_went(alerted, clock):
    wsgi = dashboard(alerted)
    status, _, html = call(wsgi, "/alerts")
    assert status == 200
    assert sorted(statuses(html)) == [
        ("failed", "demo-budget"),
        ("retrying", "demo-budget"),
        ("sent", "demo-budget"),
        ("unsent", "quiet-budget"),
    ]
    rows = dict(re.findall(r'<tr data-status="(\w+)"[^>]*>(.*?)</tr>', html, re.S))
    assert "$NOPE is not set" in rows["failed"] and "<b>" not in html.split("<main>")[1]
    assert "forecast ≥ 100 %" in rows["sent"] and "slack" in rows["sent"]
    assert "Telegram 429" in rows["retrying"] and "next try" in rows["retrying"]
    assert "nobody told" in rows["unsent"] and "forecast ≥ 100 %" in rows["unsent"]
    # by status and budget
    assert statuses(call(wsgi, "/alerts?status=failed")[2]) == [("failed", "demo-budget")]
    assert statuses(call(wsgi, "/alerts?budget=quiet-budget")[2]) == [("unsent", "quiet-budget")]
    assert statuses(call(wsgi, "/alerts?budget=demo-budget&status=unsent")[2]) == []
    # a later pass sends the flood-limited one: the page says so
    clock.advance(timedelta(seconds=300))
    notify.deliver(alerted, clock.now())
    assert ("sent", "demo-budget") in statuses(call(wsgi, "/alerts?status=sent")[2])
    assert statuses(call(wsgi, "/alerts?status=retrying")[2]) == []
    html = call(wsgi, "/alerts?status=sent", cookie="provisioner_lang=ru")[2]
    assert "отправлено ×2" in html and "прогноз ≥ 100 %" in html


def test_alerts_page_by_page_and_bad_filters_are_400(alerted, monkeypatch):
    wsgi = dashboard(alerted)
    every = statuses(call(wsgi, "/alerts")[2])
    monkeypatch.setattr(alerts_view, "PAGE", 3)
    first = call(wsgi, "/alerts")[2]
    assert 'href="/alerts?page=2" id="older"' in first and 'id="newer"' not in first
    second = call(wsgi, "/alerts?page=2")[2]
    assert 'href="/alerts?page=1" id="newer"' in second and 'id="older"' not in second
    assert statuses(first) + statuses(second) == every and len(every) == 4  # newest first
    for q, said in (
        ("status=lost", "status: use one of sent, retrying, failed, pending, unsent"),
        ("page=0", "page: a number from 1"),
        ("page=x", "page: a number from 1"),
    ):
        status, _, html = call(wsgi, f"/alerts?{q}")
        assert status == 400 and by_id(html, "error").startswith(said), q


def test_the_spend_page_shows_the_latest_and_the_fleet_what_went_undelivered(alerted):
    wsgi = dashboard(alerted)
    html = call(wsgi, "/spend?budget=demo-budget")[2]
    assert sorted(s for s, _ in statuses(html, "notices")) == ["failed", "retrying", "sent"]
    assert '<a href="/alerts?budget=demo-budget" id="all-alerts"' in html
    fleet = call(wsgi, "/")[2]
    line = by_id(fleet, "undelivered")
    assert line.startswith("2 notices not delivered (failed or retrying)")
    assert '<a href="/alerts">see alerts</a>' in fleet
    assert '<a href="/alerts">Alerts</a>' in fleet  # in the navigation


# --- the browser ---------------------------------------------------------------------------

DECEMBER = datetime(2026, 12, 3, 10, tzinfo=UTC)  # "last month" is the seeded November


@pytest.fixture
def served_december(state, clock):
    import threading

    from waitress.server import create_server

    a, pdir = state
    clock.set(DECEMBER)
    notify.record_mail(a, "k1", "budget-alert", ["lead@example.com"], "budget demo-budget: "
                       "actual 89 %", "mail to 127.0.0.1: refused", retried=False,
                       policy="demo-budget")  # fmt: skip
    notify.record_mail(a, "k2", "report", ["lead@example.com"], "report demo-budget",
                       "timed out", retried=True, policy="demo-budget")  # fmt: skip
    notify.record_mail(a, "k3", "report", ["lead@example.com"], "report vision-budget", None,
                       retried=True, policy="vision-budget")  # fmt: skip
    server = create_server(dashboard(a), host="127.0.0.1", port=0, threads=2)
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.effective_port}", a, pdir
    stop_server(server, t)


@pytest.mark.slow  # a real browser
def test_last_month_keyboard_only_shows_the_previous_column_and_alerts_pass_axe(
    served_december,
    browser,  # noqa: F811
    screens,  # noqa: F811
):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    base, a, pdir = served_december
    drv = browser
    drv.get(base + "/spend?by=owner")
    for _ in range(40):  # Tab to the picker's "Last month", as a keyboard user does
        if drv.execute_script("return document.activeElement.id") == "p-last-month":
            break
        ActionChains(drv).send_keys(Keys.TAB).perform()
    assert drv.switch_to.active_element.text == "Last month"
    old = drv.find_element(By.TAG_NAME, "html")
    ActionChains(drv).send_keys(Keys.ENTER).perform()
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(drv, 30).until(lambda _: not _alive(old))
    assert "period=2026-11" in drv.current_url and "by=owner" in drv.current_url
    want_now = cli(a, pdir, "--by", "owner", "--period", "2026-11", now=DECEMBER)
    want_before = cli(a, pdir, "--by", "owner", "--period", "2026-10", now=DECEMBER)
    heads = [th.text for th in drv.find_elements(By.CSS_SELECTOR, "#lines thead th")]
    assert heads[-2:] == ["Previous\n2026-10", "Change"]
    got = {
        r.get_attribute("data-key"): (
            r.find_element(By.CSS_SELECTOR, ".line-total").text,
            r.find_element(By.CSS_SELECTOR, ".line-previous").text,
            r.find_element(By.CSS_SELECTOR, ".line-change").text,
        )
        for r in drv.find_elements(By.CSS_SELECTOR, "#lines tbody tr")
    }
    assert want_before["lines"] == []  # nothing ran in October: each line is new
    assert got == {ln["key"]: (money_text(ln["total"]), "$0.00", "new") for ln in want_now["lines"]}
    assert drv.find_element(By.ID, "lines-previous").text == "$0.00"
    assert drv.find_element(By.ID, "p-last-month").get_attribute("aria-current") == "true"
    assert axe_problems(drv) == [], "/spend with the previous column"
    shoot(drv, screens, "spend-last-month")
    # the alert history: no critical or serious axe violation, in English and Russian
    drv.get(base + "/alerts")
    rows = drv.find_elements(By.CSS_SELECTOR, "#alerts tbody tr")
    assert sorted(r.get_attribute("data-status") for r in rows) == ["failed", "retrying", "sent"]
    assert axe_problems(drv) == [], "/alerts"
    shoot(drv, screens, "alerts")
    drv.get(base + "/lang?to=ru&back=/alerts?status=failed")
    assert len(drv.find_elements(By.CSS_SELECTOR, "#alerts tbody tr")) == 1
    assert axe_problems(drv) == [], "ru /alerts"
    window(drv, 400, 900, 1.0)  # a phone: neither page scrolls sideways
    for path in ("/spend?by=owner&period=2026-11", "/alerts"):
        drv.get(base + path)
        wide = drv.execute_script(
            "return [document.documentElement.scrollWidth, document.documentElement.clientWidth]"
        )
        assert wide[0] <= wide[1], (path, wide)
    drv.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def _alive(el) -> bool:
    from selenium.common.exceptions import WebDriverException

    try:
        el.tag_name  # noqa: B018
    except WebDriverException:
        return False
    return True
