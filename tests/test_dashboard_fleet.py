"""The fleet page as a place to navigate from (issue 27, point 7): filters read from the query
(budget, project, owner, cloud, state), columns sorted on the server by links in the headers,
a totals row the shown rows add up to, the same rows as CSV, links machine → budget → fleet,
and stop / start / down from a row through the machine page's own confirmation."""

from __future__ import annotations

import csv
import io
import re
from datetime import timedelta
from decimal import ROUND_HALF_UP, Decimal
from html import unescape
from urllib.parse import quote

import pytest

from provisioner.app import App
from provisioner.dashboard import make_app
from provisioner.money import CENT
from provisioner.views import fleet as fleet_view
from tests.conftest import TEST_OWNER, make_settings
from tests.test_dashboard import (  # noqa: F401
    browser,
    browser_sign_in,
    call,
    go,
    seeded,
    served,
    up,
)
from tests.test_dashboard_act import BOB, as_user, events, machine, said, team  # noqa: F401


def rows(page: str) -> list[str]:
    return re.findall(r'<tr data-machine="([^"]+)">', page)


def money(text: str) -> tuple[str, Decimal]:
    """An English amount ($1,234.56, RUB 8,896.97, $0.1568/h) as (currency, amount)."""
    text = unescape(re.sub(r"<[^>]+>", "", text)).strip()
    currency = "USD" if text.startswith("$") else text[:3]
    return currency, Decimal(re.sub(r"[^\d.\-]", "", text.removesuffix("/h")))


def monies(text: str) -> dict[str, Decimal]:
    return dict(money(p) for p in unescape(re.sub(r"<[^>]+>", "", text)).split(" + ") if p != "—")


# --- filters ----------------------------------------------------------------------------------


def test_filters_by_budget_state_and_owner_say_so_with_a_way_back(seeded):  # noqa: F811
    a, _ = seeded
    wsgi = make_app(a)
    status, _, page = call(wsgi, "/?budget=demo-budget")
    assert status == 200 and sorted(rows(page)) == ["eval-ru", "train-a"]
    said = re.search(r'<p id="filtered">(.*?)</p>', page, re.S)
    assert said is not None
    text = unescape(re.sub(r"<[^>]+>", "", said.group(1)))
    assert text.startswith("Filtered by Budget: demo-budget.") and "clear filters" in text
    assert '<a href="/" id="clear-filters">' in page
    # its card on the summary is the one chosen, and links back here
    assert re.search(r'class="budget-card on[^"]*" data-budget="demo-budget"', page)
    assert 'href="/?budget=demo-budget"' in page
    assert rows(call(wsgi, "/?budget=vision-budget")[2]) == ["seg-1", "seg-2"]
    assert rows(call(wsgi, "/?state=stopped")[2]) == ["seg-2"]
    assert sorted(rows(call(wsgi, "/?state=running")[2])) == ["eval-ru", "seg-1", "train-a"]
    _, _, page = call(wsgi, "/?owner=carol%40example.com&state=running")
    assert rows(page) == ["seg-1"] and "State: <strong>running</strong>" in page
    # the summary's counts lead to the machines they count
    assert '<a href="/?owner=carol%40example.com&amp;state=stopped">stopped</a>' in page
    assert 'id="filtered"' not in call(wsgi, "/")[2]


def test_an_unknown_budget_or_state_is_a_400_that_says_so(seeded):  # noqa: F811
    a, _ = seeded
    wsgi = make_app(a)
    for query, words in (
        ("budget=nope", "no policy &#39;nope&#39; with a budget (budgets: demo-budget, vision"),
        ("state=asleep", "state &#39;asleep&#39;: one of running, idle, stopped, preempted, held"),
        ("sort=price", "sort &#39;price&#39;: one of name, project"),
        ("sort=cost&dir=up", "dir &#39;up&#39;: asc or desc"),
    ):
        for path in ("/", "/fleet.csv"):
            status, _, body = call(wsgi, f"{path}?{query}")
            assert status == 400 and words in body, (path, query, body)
            assert "Traceback" not in body


# --- sorting ----------------------------------------------------------------------------------


def test_columns_sort_on_the_server_keeping_the_filters(seeded):  # noqa: F811
    a, _ = seeded
    wsgi = make_app(a)
    _, _, page = call(wsgi, "/?sort=name")
    assert rows(page) == ["eval-ru", "seg-1", "seg-2", "train-a"]
    assert re.search(r'<th aria-sort="ascending"><a class="sort on" data-sort="name"', page)
    _, _, page = call(wsgi, "/?sort=name&dir=desc")
    assert rows(page) == ["train-a", "seg-2", "seg-1", "eval-ru"]
    assert 'aria-sort="descending"' in page
    # the header links the other way round
    assert 'data-sort="name" href="/?sort=name&amp;dir=asc"' in page
    # by cost, converted to the settings' currency (USD; RUB at the settings' rate)
    _, _, page = call(wsgi, "/?sort=cost&dir=desc")
    shown = re.findall(r'<tr data-machine="([^"]+)">.*?<span class="cost">(.*?)</span>', page, re.S)
    rates = a.settings.money_rates
    from provisioner.money import Money

    usd = [
        sum(rates.convert(Money(v, c), "USD").amount for c, v in monies(cost).items())
        for _, cost in shown
    ]
    assert usd == sorted(usd, reverse=True) and len(usd) == 4
    usd_names = [n for n, _ in shown]
    # a filtered page's headers keep its filter
    _, _, page = call(wsgi, "/?project=vision&sort=burn")
    assert 'data-sort="cost" href="/?project=vision&amp;sort=cost&amp;dir=desc"' in page
    assert 'name="sort" value="burn"' in page  # the filter form keeps the sort
    for key in fleet_view.SORTS:  # every column, both ways, in both languages
        for way in ("asc", "desc"):
            for lang in ("en", "ru"):
                status, _, page = call(
                    wsgi, f"/?sort={key}&dir={way}", cookie=f"provisioner_lang={lang}"
                )
                assert status == 200 and sorted(rows(page)) == sorted(usd_names), (key, way)
    # nothing in a state: said, with the way back
    status, _, page = call(wsgi, "/?state=held", cookie="provisioner_lang=ru")
    assert status == 200 and 'id="filtered"' in page and "сбросить фильтры" in page
    assert rows(page) == []


def test_names_sort_naturally_and_rows_without_a_value_come_last():
    assert sorted(["gpu-10", "gpu-2", "GPU-1", "a"], key=fleet_view.natural) == [
        "a",
        "GPU-1",
        "gpu-2",
        "gpu-10",
    ]


# --- the totals row ---------------------------------------------------------------------------


@pytest.fixture
def many(home, clock):
    """Forty machines launched 7 min 13 s apart in two currencies, two stopped: costs and
    rates full of fractions of a cent."""
    from provisioner import machines

    a = App(make_settings(home), clock)
    for i in range(40):
        ru = i % 3 == 0
        where = {"regions": ["sandbox-ru"], "market": "reserved"} if ru else {}
        up(a, f"m-{i}", project=f"p{i % 4}", **where)
        clock.advance(timedelta(minutes=7, seconds=13))
    for name in ("m-5", "m-6"):
        machines.stop(a, name)
    clock.advance(timedelta(hours=3, seconds=7))
    yield a
    a.close()


@pytest.mark.parametrize("query", ["", "sort=cost&dir=desc", "project=p1", "state=stopped"])
def test_the_rows_add_up_to_the_totals_row_to_the_cent(many, query):
    status, _, page = call(make_app(many), f"/?{query}")
    assert status == 200
    body = page.split('<tbody id="fleet-rows"')[1]
    costs = [monies(c) for c in re.findall(r'<span class="cost">(.*?)</span>', body)]
    rates = [monies(r) for r in re.findall(r'<span class="muted sub rate">(.*?)</span>', body)]
    assert len(costs) == len(rates) == len(rows(page)) > 0
    foot = page.split('<tfoot id="fleet-foot"')[1]
    (count,) = re.findall(r'id="fleet-count">(.*?)</th>', foot)
    assert count == f"Total · machines: {len(costs)}"
    total = monies(re.search(r'<span id="fleet-total">(.*?)</span><br>', foot).group(1))  # type: ignore[union-attr]
    burn = monies(re.search(r'id="fleet-burn">(.*?)</span></td>', foot).group(1))  # type: ignore[union-attr]
    for shown, want in ((costs, total), (rates, burn)):
        summed: dict[str, Decimal] = {}
        for r in shown:
            for c, v in r.items():
                summed[c] = summed.get(c, Decimal(0)) + v
        assert summed == want
    # each row is the machine's cost as `status` rounds it (so its own page and `status NAME`
    # agree with the row), and the totals row sums the rows as shown
    from provisioner.views.status import read_fleet

    shown_by_name = dict(zip(rows(page), costs, strict=True))
    for r in read_fleet(many, all_=False).rows:
        if r.name in shown_by_name:
            want = {c: v.quantize(CENT, ROUND_HALF_UP) for c, v in r.spent.items()}
            assert shown_by_name[r.name] == want, r.name


# --- CSV ----------------------------------------------------------------------------------------


def test_the_fleet_as_csv_with_the_pages_filters_and_order(seeded):  # noqa: F811
    a, _ = seeded
    wsgi = make_app(a)
    _, _, page = call(wsgi, "/?budget=demo-budget&sort=cost&dir=desc")
    link = re.search(r'<a href="([^"]+)" id="fleet-csv" download>Download CSV</a>', page)
    assert link is not None
    status, headers, body = call(wsgi, unescape(link.group(1)))
    assert status == 200 and dict(headers)["Content-Type"].startswith("text/csv")
    got = list(csv.DictReader(io.StringIO(body)))
    assert [r["machine"] for r in got] == rows(page)
    assert sorted(rows(page)) == ["eval-ru", "train-a"]
    from provisioner.views.status import read_fleet

    listed = {r.name: r for r in read_fleet(a, all_=False).rows}
    for r in got:
        assert Decimal(r["cost"]) == listed[r["machine"]].spent[r["currency"]].quantize(
            Decimal("0.000001")
        )
        assert r["project"] == "demo" and r["state"] == "running"
        assert Decimal(r["per_hour"]) > 0
    assert list(got[0]) == [
        "machine", "project", "owner", "cloud", "where", "gpu", "gpu_count", "market",
        "state", "idle_since", "currency", "cost", "per_hour", "next_action", "next_at",
    ]  # fmt: skip


def test_fleet_csv_cells_cannot_become_formulas(home, clock):
    a = App(make_settings(home), clock)
    up(a, "sheet", project='=HYPERLINK("http://evil.example","x")', owner="@ana")
    clock.advance(timedelta(hours=5))
    _, _, body = call(make_app(a), "/fleet.csv")
    [row] = list(csv.DictReader(io.StringIO(body)))
    assert row["project"].startswith("'=HYPERLINK") and row["owner"] == "'@ana"
    a.close()


# --- links --------------------------------------------------------------------------------------


def test_a_machine_links_to_its_budgets_and_to_its_project_and_owners_fleet(seeded):  # noqa: F811
    a, _ = seeded
    wsgi = make_app(a)
    _, _, page = call(wsgi, "/machine/train-a")
    budgets = re.search(r'<dd id="machine-budgets">(.*?)</dd>', page)
    assert budgets is not None
    assert re.findall(r'href="([^"]+)"', budgets.group(1)) == ["/spend?budget=demo-budget"]
    assert 'href="/?project=demo" id="machine-project"' in page
    assert 'href="/?owner=ana%40example.com" id="machine-owner"' in page
    # each budget card, on the fleet and on the spend page: its spend and its machines
    for path in ("/", "/spend?budget=vision-budget"):
        _, _, page = call(wsgi, path)
        for name in ("demo-budget", "vision-budget"):
            card = re.search(rf'data-budget="{name}">(.*?)</div>', page, re.S)
            assert card is not None, (path, name)
            assert re.findall(r'href="([^"]+)"', card.group(1)) == [
                f"/spend?budget={name}",
                f"/?budget={name}",
            ]


# --- acting from a row ------------------------------------------------------------------------


def test_a_row_stops_its_machine_after_the_confirmation_and_returns_to_the_list(team):  # noqa: F811
    app, dash, _ = team
    m = machine(app, "train")
    back = "/?sort=name&project=demo"
    _, _, page = as_user(dash, TEST_OWNER, back)
    form = re.search(
        r'action="/machine/([^"]+)" class="row-acts" id="row-act-train">(.*?)</form>', page, re.S
    )
    assert form is not None and form.group(1) == m.id
    assert f'name="back" value="{back.replace("&", "&amp;")}"' in form.group(2)
    assert 'name="do" value="stop" aria-label="Stop train">Stop</button>' in form.group(2)
    assert 'aria-label="Terminate train"' in form.group(2) or 'value="down"' in form.group(2)
    assert 'value="start"' not in form.group(2)  # running: nothing to start
    # the machine page's flow: asked first, the answer goes back to the list
    body = f"do=stop&back={quote(back, safe='')}"
    status, _, page = as_user(dash, TEST_OWNER, f"/machine/{m.id}", "POST", body)
    assert status == 200 and "Stop train? Compute billing ends" in page
    assert f'name="back" value="{back.replace("&", "&amp;")}"' in page
    # the safe choice has the focus: back to the row, nothing done
    row_back = f"{back}#row-{m.id}".replace("&", "&amp;")
    assert f'href="{row_back}" id="confirm-no" class="button" autofocus>' in page
    assert 'id="confirm-yes">' in page and "autofocus" not in page.split('id="confirm-yes"')[1]
    assert machine(app, "train").status == "running"
    status, headers, _ = as_user(
        dash, TEST_OWNER, f"/machine/{m.id}", "POST", body + "&confirm=yes"
    )
    # back at the row acted on: the list with its filters, the row's link (live.js focuses it)
    assert status == 303 and dict(headers)["Location"] == f"{back}#row-{m.id}"
    assert machine(app, "train").status == "stopped"
    assert events(app, "train")[-1] == ("stopped", TEST_OWNER)
    _, _, page = as_user(dash, TEST_OWNER, back, cookie=said(headers))
    assert '<p class="flash" id="flash" role="status">train stopped</p>' in page
    row = re.search(r'<tr data-machine="train">(.*?)</tr>', page, re.S)
    assert row is not None and 'value="start"' in row.group(1)  # stopped: start offered
    # a back to another site is not followed
    status, headers, _ = as_user(
        dash, TEST_OWNER, f"/machine/{m.id}", "POST", "do=start&back=%2F%2Fevil.example"
    )
    assert status == 303 and dict(headers)["Location"] == f"/#row-{m.id}"  # this site's list


def test_a_row_offers_nothing_to_a_colleague_and_refuses_them_in_the_clis_words(team):  # noqa: F811
    app, dash, _ = team
    m = machine(app, "train")
    _, _, page = as_user(dash, BOB, "/")
    assert "row-act-" not in page and 'class="row-act"' not in page
    before = events(app, "train")
    status, _, page = as_user(
        dash, BOB, f"/machine/{m.id}", "POST", "do=stop&confirm=yes&back=%2F%3Fsort%3Dname"
    )
    assert status == 403 and (
        "refused: bob@example.com is not the owner of this machine (ana@example.com) and no "
        "policy grants act_as over them" in page
    )
    assert 'href="/?sort=name" id="back"' in page  # and a way back to the list
    status, _, page = as_user(
        dash, TEST_OWNER, f"/machine/{m.id}", "POST", "do=stop&confirm=yes&back=%2F", csrf=False
    )
    assert status == 403 and "security token is missing" in page
    assert machine(app, "train").status == "running" and events(app, "train") == before


# --- in Chromium ------------------------------------------------------------------------------


@pytest.mark.slow  # a real browser against a real server
def test_sort_follow_links_and_stop_from_the_fleet_keyboard_only(served, browser):  # noqa: F811
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    base, a, _ = served
    drv = browser
    browser_sign_in(drv, base, a, TEST_OWNER)  # acting needs it, on loopback too
    drv.get(base + "/?owner=")  # everyone's machines, not only the signed-in user's

    def shown() -> list[str]:
        trs = drv.find_elements(By.CSS_SELECTOR, "#fleet tbody tr")
        return [r.get_attribute("data-machine") for r in trs]

    # sort by a header: by name, then the other way round
    go(drv, drv.find_element(By.CSS_SELECTOR, 'th a[data-sort="name"]'))
    assert shown() == ["eval-ru", "seg-1", "seg-2", "train-a"]
    th = drv.find_element(By.CSS_SELECTOR, 'th[aria-sort] a[data-sort="name"]')
    assert th.find_element(By.XPATH, "..").get_attribute("aria-sort") == "ascending"
    go(drv, drv.find_element(By.CSS_SELECTOR, 'th a[data-sort="name"]'))
    assert shown() == ["train-a", "seg-2", "seg-1", "eval-ru"]
    # machine → its budget's spend page → the budget's machines
    go(drv, drv.find_element(By.LINK_TEXT, "train-a"))
    go(drv, drv.find_element(By.CSS_SELECTOR, '#machine-budgets a[data-budget="demo-budget"]'))
    assert drv.current_url == base + "/spend?budget=demo-budget"
    card = drv.find_element(By.CSS_SELECTOR, '.budget-card[data-budget="demo-budget"]')
    go(drv, card.find_element(By.CSS_SELECTOR, "a.to-fleet"))
    assert drv.current_url == base + "/?budget=demo-budget"
    assert sorted(shown()) == ["eval-ru", "train-a"]
    assert "Budget: demo-budget" in drv.find_element(By.ID, "filtered").text

    # stop train-a from its row, keyboard only: Tab to its menu, Enter, Tab, Enter, Enter
    def focused() -> str:
        return drv.execute_script(
            "const e = document.activeElement, r = e.closest('tr');"
            "return (r ? r.dataset.machine : '') + ':' + e.tagName + ':' + "
            "(e.getAttribute('aria-label') || e.id || '')"
        )

    def tab_to(want: str) -> None:
        for _ in range(150):
            ActionChains(drv).send_keys(Keys.TAB).perform()
            if focused() == want:
                return
        raise AssertionError(f"Tab never reached {want}")

    def enter_and_wait() -> None:
        old = drv.find_element(By.TAG_NAME, "html")
        ActionChains(drv).send_keys(Keys.ENTER).perform()
        from selenium.webdriver.support.ui import WebDriverWait

        from tests.test_dashboard_act import _stale

        WebDriverWait(drv, 30).until(lambda _: _stale(old))

    tab_to("train-a:SUMMARY:Act on train-a")
    ActionChains(drv).send_keys(Keys.ENTER).perform()  # opens the row's menu
    ActionChains(drv).send_keys(Keys.TAB).perform()
    assert focused() == "train-a:BUTTON:Stop train-a"
    enter_and_wait()
    # the confirmation focuses the safe choice: Enter now would do nothing
    assert drv.switch_to.active_element.get_attribute("id") == "confirm-no"
    assert "Stop train-a?" in drv.find_element(By.ID, "confirm-question").text
    ActionChains(drv).send_keys(Keys.TAB).perform()
    assert drv.switch_to.active_element.get_attribute("id") == "confirm-yes"
    enter_and_wait()
    a_id = machine(a, "train-a").id
    assert drv.current_url == f"{base}/?budget=demo-budget#row-{a_id}"  # the list it was on
    assert drv.find_element(By.ID, "flash").text == "train-a stopped"
    assert focused() == "train-a:A:row-" + a_id  # the keyboard goes on from the row acted on
    row = drv.find_element(By.CSS_SELECTOR, 'tr[data-machine="train-a"]')
    assert "stopped" in row.find_element(By.CSS_SELECTOR, ".state").text
    stops = [e for e in events(a, "train-a") if e[0] == "stopped"]
    assert stops == [("stopped", TEST_OWNER)]
