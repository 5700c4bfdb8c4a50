"""The fleet page a page at a time (issue 27, point 9: 1,000 machines within half a second):
100 rows a page, sorted and filtered over the whole fleet on the server, links to the pages
before and after that keep the filters and the sort, a totals row over every filtered machine
(on every page), and the CSV with every row."""

from __future__ import annotations

import csv
import io
import re
from datetime import timedelta
from decimal import ROUND_HALF_UP, Decimal
from html import unescape

import pytest

from provisioner.app import App
from provisioner.dashboard import make_app
from provisioner.money import CENT, Money
from provisioner.views import fleet as fleet_view
from tests.conftest import TEST_OWNER, make_settings
from tests.test_dashboard import browser, call, go, sign_in, stop_server  # noqa: F401
from tests.test_dashboard_fleet import monies, rows

N = 250


@pytest.fixture
def big(home, clock, db_url):
    """250 running machines launched 7 min 13 s apart, one in five billed in roubles, rates
    full of fractions of a cent, each with a heartbeat a minute ago at its own utilisation (one
    in seven busier half an hour ago)."""
    from sqlalchemy import insert

    from provisioner.models import Event, Heartbeat, Machine, UsageInterval, epoch_us

    a = App(make_settings(home, state_url=db_url), clock)
    now = clock.now()
    machines = []
    for i in range(N):
        at = now - timedelta(days=2) + i * timedelta(minutes=7, seconds=13)
        machines.append(
            {
                "id": f"id{i:04d}",
                "name": f"m-{i}",
                "project": f"p{i % 3}",
                "owner": TEST_OWNER,
                "status": "running",
                "spec": {},
                "cloud": "sandbox",
                "region": "sandbox-us",
                "zone": "sandbox-us-1a",
                "instance_type": "sbx-t4-1",
                "instance_id": f"i-{i:08x}",
                "gpu": "T4",
                "gpu_count": 1,
                "market": "spot",
                "rate": Decimal("0.1234") + Decimal(i % 17) / 997,
                "disk_rate": Decimal("0.0068"),
                "currency": "RUB" if i % 5 == 0 else "USD",
                "created_at": at,
                "launched_at": at,
            }
        )
    with a.db.engine.begin() as conn:
        conn.execute(insert(Machine.__table__), machines)
        conn.execute(
            insert(Event.__table__),
            [
                {"machine_id": m["id"], "at": m["launched_at"], "kind": "launched", "detail": {}}
                for m in machines
            ],
        )
        conn.execute(
            insert(UsageInterval.__table__),
            [
                {
                    "machine_id": m["id"],
                    "kind": kind,
                    "started_at": m["launched_at"],
                    "ended_at": None,
                    "start_us": epoch_us(m["launched_at"]),
                    "end_us": None,
                    "rate": m[col],
                    "currency": m["currency"],
                }
                for m in machines
                for kind, col in (("compute", "rate"), ("disk", "disk_rate"))
            ],
        )
        conn.execute(
            insert(Heartbeat.__table__),
            [
                {
                    "machine_id": m["id"],
                    "at": now - timedelta(minutes=1),
                    "gpus": [{"index": 0, "util": util(i)}],
                    "max_util": util(i),
                }
                for i, m in enumerate(machines)
            ]
            + [  # busier in an earlier step of the sparkline: not the figure shown, nor sorted by
                {
                    "machine_id": m["id"],
                    "at": now - timedelta(minutes=30),
                    "gpus": [{"index": 0, "util": 100.0}],
                    "max_util": 100.0,
                }
                for i, m in enumerate(machines)
                if i % 7 == 0
            ],
        )
    yield a
    a.close()


def util(i: int) -> float:
    return float(i * 37 % 101)


def by_cost(a: App) -> list[str]:
    """The fleet's names, most expensive first (in the settings' currency; ties by name), from
    what ``status`` lists."""
    from provisioner.views.status import read_fleet

    rates = a.settings.money_rates
    listed = read_fleet(a, all_=False).rows
    assert len(listed) == N

    def usd(r) -> Decimal:
        return sum(
            (rates.convert(Money(v, c), rates.base).amount for c, v in r.spent.items()),
            Decimal(0),
        )

    ordered = sorted(listed, key=lambda r: fleet_view.natural(r.name))
    return [r.name for r in sorted(ordered, key=usd, reverse=True)]


def pager(page: str) -> str:
    said = re.search(r'<nav class="pages" id="pages"[^>]*>(.*?)</nav>', page, re.S)
    assert said is not None
    return said.group(1)


def links(page: str) -> dict[str, str]:
    return {
        rel: unescape(href)
        for rel, href in re.findall(r'rel="(\w+)" class="\w+" href="([^"]+)"', pager(page))
    }


def test_page_two_sorted_by_cost_has_the_next_hundred_of_the_whole_fleet(big):
    wsgi = make_app(big)
    want = by_cost(big)
    status, _, page = call(wsgi, "/?sort=cost&dir=desc&page=2")
    assert status == 200 and rows(page) == want[100:200]
    text = re.sub(r"<[^>]+>", "", pager(page))
    assert text == "rows 101–200 of 250 · previous page · next page"
    assert links(page) == {"prev": "/?sort=cost&dir=desc", "next": "/?page=3&sort=cost&dir=desc"}
    # the sparklines, next moves and act forms of the page's rows only
    assert page.count('class="spark-cell"') == page.count('data-next-action="') == 100
    _, _, first = call(wsgi, links(page)["prev"])
    _, _, last = call(wsgi, links(page)["next"])
    assert rows(first) == want[:100] and rows(last) == want[200:]
    assert "next" not in links(last) and "prev" not in links(first)


def test_the_totals_row_is_over_every_page_and_the_pages_rows_add_up_to_it(big):
    wsgi = make_app(big)
    summed: dict[str, Decimal] = {}
    names = []
    for n in (1, 2, 3):
        _, _, page = call(wsgi, f"/?sort=cost&page={n}")
        names += rows(page)
        body = page.split('<tbody id="fleet-rows"')[1]
        for cost in re.findall(r'<span class="cost">(.*?)</span>', body):
            for c, v in monies(cost).items():
                summed[c] = summed.get(c, Decimal(0)) + v
        foot = page.split('<tfoot id="fleet-foot"')[1]
        (count,) = re.findall(r'id="fleet-count">(.*?)</th>', foot)
        assert count == "Total · all 250 machines, every page"
        total = monies(re.search(r'<span id="fleet-total">(.*?)</span><br>', foot).group(1))  # type: ignore[union-attr]
        assert total == totals(big)
    assert sorted(names) == sorted(f"m-{i}" for i in range(N))  # each machine once
    assert summed == totals(big) and set(summed) == {"RUB", "USD"}
    # one page (a project's 83 machines): no pages, the rows as before
    _, _, page = call(wsgi, "/?project=p1")
    assert len(rows(page)) == 83 and re.sub(r"<[^>]+>", "", pager(page)) == ""
    assert "Total · machines: 83</th>" in page


def totals(a: App) -> dict[str, Decimal]:
    """Each machine's cost rounded alone, as ``status NAME`` shows it, summed per currency."""
    from provisioner.views.status import read_fleet

    out: dict[str, Decimal] = {}
    for r in read_fleet(a, all_=False).rows:
        for c, v in r.spent.items():
            out[c] = out.get(c, Decimal(0)) + v.quantize(CENT, ROUND_HALF_UP)
    return out


def test_page_links_keep_the_filters_and_sort_and_a_new_filter_or_sort_starts_at_page_one(big):
    from provisioner import tokens

    wsgi = make_app(big)
    big.actor = TEST_OWNER
    owner = sign_in(wsgi, tokens.create(big, TEST_OWNER).token)  # their rows' act forms
    _, _, page = call(wsgi, "/?cloud=sandbox&sort=name&dir=desc&page=2", cookie=owner)
    assert rows(page) == [f"m-{i}" for i in range(149, 49, -1)]
    assert links(page) == {
        "prev": "/?cloud=sandbox&sort=name&dir=desc",
        "next": "/?cloud=sandbox&page=3&sort=name&dir=desc",
    }
    # the filter form and the column headers lead to a first page; a row's act form comes back
    form = page.split('id="filters"')[1].split("</form>")[0]
    assert 'name="page"' not in form and 'name="sort" value="name"' in form
    assert 'data-sort="cost" href="/?cloud=sandbox&amp;sort=cost&amp;dir=desc"' in page
    assert 'name="back" value="/?cloud=sandbox&amp;sort=name&amp;dir=desc&amp;page=2"' in page


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_page_past_the_last_shows_the_last_and_a_bad_page_is_a_400(big):
    wsgi = make_app(big)
    status, _, page = call(wsgi, "/?sort=name&page=7")
    assert status == 200 and rows(page) == [f"m-{i}" for i in range(200, 250)]
    assert re.sub(r"<[^>]+>", "", pager(page)).startswith("rows 201–250 of 250")
    for bad in ("0", "-1", "two", "²"):
        for path in ("/", "/fleet.csv"):
            status, _, body = call(wsgi, f"{path}?page={bad}")
            assert status == 400 and "a whole number from 1" in unescape(body), (path, bad)
            assert "Traceback" not in body
    status, _, body = call(wsgi, "/?page=0", cookie="provisioner_lang=ru")
    assert status == 400


def test_the_csv_has_every_row_in_the_pages_order(big):
    wsgi = make_app(big)
    _, _, page = call(wsgi, "/?sort=cost&dir=desc&page=3")
    link = re.search(r'<a href="([^"]+)" id="fleet-csv" download>', page)
    assert link is not None and "page" not in link.group(1)
    status, _, body = call(wsgi, unescape(link.group(1)) + "&page=3")  # a page asked: all the same
    assert status == 200
    got = [r["machine"] for r in csv.DictReader(io.StringIO(body))]
    assert got == by_cost(big)
    assert all(r["next_action"] for r in csv.DictReader(io.StringIO(body)))


def test_sorting_by_utilisation_ranks_the_whole_fleet_by_the_figure_shown(big):
    wsgi = make_app(big)
    names = sorted((f"m-{i}" for i in range(N)), key=fleet_view.natural)
    want = sorted(names, key=lambda n: util(int(n[2:])), reverse=True)
    for n in (1, 3):
        _, _, page = call(wsgi, f"/?sort=util&dir=desc&page={n}")
        assert rows(page) == want[(n - 1) * 100 : n * 100]
        shown = re.findall(r'<tr data-machine="([^"]+)">.*?<span class="util">(\d+)', page, re.S)
        assert [(name, f"{util(int(name[2:])):.0f}") for name, _ in shown] == shown
        assert len(shown) == len(rows(page))


@pytest.mark.slow  # a real browser
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_page_refreshes_in_place_and_leads_to_the_next(big, browser, clock):  # noqa: F811
    """live.js fetches the page's own address again, page and all: the reader stays on page 2;
    its "next page" link leads on with the sort kept."""
    import threading

    from selenium.webdriver.common.by import By
    from waitress.server import create_server

    server = create_server(make_app(big).warm(), host="127.0.0.1", port=0, threads=2)
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        drv = browser
        drv.get(f"http://127.0.0.1:{server.effective_port}/?sort=name&page=2")

        def shown() -> list[str]:
            return [
                tr.get_attribute("data-machine")
                for tr in drv.find_elements(By.CSS_SELECTOR, "#fleet tbody tr")
            ]

        assert shown() == [f"m-{i}" for i in range(100, 200)]
        updated = drv.find_element(By.ID, "updated").text
        clock.advance(timedelta(minutes=1))
        assert drv.execute_async_script("window.provisionerRefresh().then(arguments[0])") is True
        assert drv.find_element(By.ID, "updated").text != updated
        assert shown() == [f"m-{i}" for i in range(100, 200)]
        assert drv.find_element(By.ID, "pages").text.startswith("rows 101–200 of 250")
        go(drv, drv.find_element(By.CSS_SELECTOR, "#pages a[rel=next]"))
        assert shown() == [f"m-{i}" for i in range(200, 250)]
        assert drv.current_url.endswith("/?page=3&sort=name")
    finally:
        stop_server(server, t)
