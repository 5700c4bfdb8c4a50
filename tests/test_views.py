"""The CLI and the dashboard show the same figures, made once (:mod:`provisioner.views`): over
the dashboard's seeded state (tests/test_dashboard.py), at one instant for both, the real CLI
(``-o json``, through the console entry point) and the real WSGI app agree — on what each
machine has cost, on the days of a report (which add up to its total, to the cent, in both),
and on one forecast per budget on a page."""

from __future__ import annotations

import html
import json
import re
from datetime import timedelta
from decimal import ROUND_HALF_UP, Decimal

import pytest

from provisioner import identity, machines
from provisioner.app import App
from provisioner.clock import CLOCK_ENV, ManualClock, ShiftedClock
from provisioner.dashboard import make_app
from provisioner.jobs import reconcile, recover
from provisioner.money import CENT
from provisioner.settings import load_settings
from provisioner.spec import Experiment
from tests.conftest import TEST_START, sandbox_experiment, write_settings
from tests.test_dashboard import NOW, call, money_text, seed

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture


@pytest.fixture
def both(home, clock, db_url, cli, monkeypatch):
    """(the CLI, with the seeded settings; GET of a dashboard page -> its HTML), both at NOW."""
    a, pdir = seed(home, clock, db_url)
    cfg = write_settings(home, policies=[str(pdir)], state_url=a.settings.state_url)
    monkeypatch.setenv(CLOCK_ENV, NOW.isoformat())
    monkeypatch.setattr(ShiftedClock, "now", lambda self: NOW)
    wsgi = make_app(a)

    def run(*argv: str) -> dict | list:
        r = cli("--config", str(cfg), *argv, "-o", "json")
        assert r.code == 0, r.err
        return json.loads(r.out)

    def page(path: str) -> str:
        status, _, text = call(wsgi, path)
        assert status == 200, text
        return html.unescape(text)

    yield run, page
    a.close()


def amount(text: str) -> Decimal:
    """An amount as an English page writes it ($1,234.56, RUB 8,896.97)."""
    return Decimal(re.sub(r"[^\d.\-]", "", text))


def cents(exact: str) -> Decimal:
    """An exact amount (as `status -o json` gives it) to the cent, as pages show it."""
    return Decimal(exact).quantize(CENT, ROUND_HALF_UP)


def cells(page: str, pattern: str) -> list[str]:
    return [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(pattern, page, re.S)]


def test_each_machine_costs_the_same_in_status_and_on_its_pages(both):
    run, page = both
    listed = {m["name"]: m for m in run("status", "--no-refresh")}
    fleet = page("/")
    costs = dict(
        re.findall(r'<tr data-machine="([^"]+)">.*?<span class="cost">(.*?)</span>', fleet, re.S)
    )
    assert sorted(costs) == sorted(listed) == ["eval-ru", "seg-1", "seg-2", "train-a"]
    # each row as `status` rounds it; the totals row adds up the rows as shown
    total: dict[str, Decimal] = {}
    for name, m in listed.items():
        assert costs[name] == " + ".join(money_text(s) for s in m["spent"])
        for s in m["spent"]:
            total[s["currency"]] = total.get(s["currency"], Decimal(0)) + cents(s["amount"])
    (shown,) = cells(fleet, r'<span id="fleet-total">(.*?)</span><br>')
    assert shown == " + ".join(
        money_text({"amount": str(v), "currency": c}) for c, v in sorted(total.items())
    )
    # one machine: `status NAME` and its page; the page's usage rows add up to its cost
    for name in listed:
        d = run("status", name, "--no-refresh")
        assert d["spent"] == listed[name]["spent"]
        mpage = page(f"/machine/{name}")
        (spent,) = cells(mpage, r'<dd id="machine-spent">(.*?)</dd>')
        assert spent == " + ".join(money_text(s) for s in d["spent"])
        parts: dict[str, Decimal] = {}
        for c, text in re.findall(r'class="n part-cost" data-currency="(\w+)">(.*?)</td>', mpage):
            parts[c] = parts.get(c, Decimal(0)) + amount(text)
        assert parts == {s["currency"]: cents(s["amount"]) for s in d["spent"]}, name


@pytest.mark.parametrize("project", ["demo", "vision"])
def test_a_reports_days_add_up_to_its_total_in_the_cli_and_on_the_spend_page(both, project):
    """vision is billed in RUB and USD and reported in RUB: its days, each rounded alone, came
    to 2 kopecks less than the total on the page."""
    run, page = both
    r = run("report", "--project", project)
    days = [Decimal(d["amount"]) for d in r["daily"]]
    assert sum(days) == Decimal(r["total"]["amount"])
    spend = page(f"/spend?project={project}")
    shown = [amount(c) for c in cells(spend, r'<tr data-day="[^"]+">.*?<td class="n">(.*?)</td>')]
    assert shown == days[: len(shown)] and not any(days[len(shown) :])  # the days to come: none
    (total,) = cells(spend, r'<span class="big" id="total">(.*?)</span>')
    assert sum(shown) == amount(total) == Decimal(r["total"]["amount"])
    # the lines too: as the CLI shares them out, adding up to the same total
    lines = dict(
        re.findall(r'<tr data-key="([^"]+)">.*?class="n line-total">(.*?)</td>', spend, re.S)
    )
    assert lines == {ln["key"]: money_text(ln["total"]) for ln in r["lines"]}
    assert sum(amount(v) for v in lines.values()) == amount(total)


@pytest.mark.parametrize("query", ["project=demo", "budget=demo-budget"])
def test_one_forecast_per_budget_on_a_page_and_in_the_cli(both, query):
    run, page = both
    r = run("report", "--project", "demo")
    # the report's forecast is its budget's: shown to the cent, exact in the budget's JSON
    assert Decimal(r["forecast"]["amount"]) == cents(r["budget"]["forecast"]["amount"])
    spend = page(f"/spend?{query}")
    card = re.search(r'data-budget="demo-budget">(.*?)</a>', spend, re.S)
    assert card is not None
    shown = cells(card.group(1), r'data-field="forecast">(.*?)</span>')
    shown += cells(spend, r'id="forecast">(.*?)</span>')
    assert shown == [money_text(r["budget"]["forecast"])] * 2


def test_a_relaunched_machine_costs_every_launch_on_its_pages_as_in_status(cli, home, monkeypatch):
    """Preempted after 2 h and relaunched, an hour later: `status NAME`, the fleet page and the
    machine page each count both launches (the page used to count the last one), and the
    page's usage rows — both launches', compute and disk — add up to it."""
    cfg = write_settings(home)
    a = App(load_settings(cfg), ManualClock(TEST_START))
    e = sandbox_experiment("spot") | {"lifecycle": {"on_preemption": "relaunch"}}
    machines.up(a, Experiment.model_validate(e))
    a.clock.advance(timedelta(hours=2))
    a.provider("sandbox").preempt(machines.ref(machines.find(a, "spot")))
    reconcile.run(a)
    a.provider("sandbox").terminate(machines.ref(machines.find(a, "spot")))  # not kept
    assert [x.done for x in recover.run(a).actions] == [True]
    a.clock.advance(timedelta(hours=1))
    at = a.clock.now()
    monkeypatch.setenv(CLOCK_ENV, at.isoformat())
    monkeypatch.setattr(ShiftedClock, "now", lambda self: at)
    r = cli("--config", str(cfg), "status", "spot", "--no-refresh", "-o", "json")
    d = json.loads(r.out)
    assert d["launches"] == 2
    (spent,) = d["spent"]
    wsgi = make_app(a)
    _, _, fleet = call(wsgi, "/")
    assert cells(fleet, r'<span class="cost">(.*?)</span>') == [money_text(spent)]
    _, _, page = call(wsgi, "/machine/spot")
    assert cells(page, r'<dd id="machine-spent">(.*?)</dd>') == [money_text(spent)]
    parts = [amount(c) for c in cells(page, r'class="n part-cost"[^>]*>(.*?)</td>')]
    assert len(parts) == 4 and sum(parts) == cents(spent["amount"])
    a.close()


def test_report_policy_covers_what_its_budget_covers(both):
    """`report --policy demo-budget` totals what demo's budget counts (project demo), not every
    project beside it: its total is the budget's spend, its lines only demo, its forecast the
    budget's — in the CLI and on the Spend page (budget=) alike."""
    run, page = both
    r = run("report", "--policy", "demo-budget")
    assert [ln["key"] for ln in r["lines"]] == ["demo"]
    assert Decimal(r["total"]["amount"]) == cents(r["budget"]["spent"]["amount"])
    assert Decimal(r["forecast"]["amount"]) == cents(r["budget"]["forecast"]["amount"])
    everything = run("report")
    assert {ln["key"] for ln in everything["lines"]} == {"demo", "vision"}
    spend = page("/spend?budget=demo-budget")
    (total,) = cells(spend, r'<span class="big" id="total">(.*?)</span>')
    assert total == money_text(r["total"])


def test_each_budget_card_adds_up_and_nothing_running_forecasts_what_was_spent(both, home):
    """A card's spent + committed (+ relaunches) is its forecast, to the cent, as shown; with
    nothing running, the forecast is what was spent (it used to extrapolate the average burn:
    132 % beside spent + committed at 113 %)."""
    run, page = both

    def cards(html_text: str) -> dict[str, dict[str, Decimal]]:
        out = {}
        for name, body in re.findall(r'data-budget="([^"]+)">(.*?)</a>', html_text, re.S):
            fields = re.findall(r'data-field="(\w+)">(.*?)</span>', body)
            out[name] = {k: amount(v) for k, v in fields}
        return out

    shown = cards(page("/"))
    assert sorted(shown) == ["demo-budget", "vision-budget"]
    for name, c in shown.items():
        assert c["spent"] + c["committed"] + c.get("relaunches", 0) == c["forecast"], name
        assert c["committed"] > 0, name  # each has a machine running
    summary = run("status", "--summary")
    for b in summary["budgets"]:
        parts = sum(Decimal(b[k]["amount"]) for k in ("spent", "committed", "relaunches"))
        assert parts == Decimal(b["forecast"]["amount"]), b["policy"]


def test_a_budget_reads_the_same_in_report_and_status_summary(both):
    """One budget, one money → JSON: `report --policy NAME -o json` and `status --summary -o
    json` give its amount, spend, commitments and forecast alike, exact (the report's copy was
    rounded to the cent, the summary's not)."""
    run, _ = both
    summary = {b["policy"]: b for b in run("status", "--summary")["budgets"]}
    assert sorted(summary) == ["demo-budget", "vision-budget"]
    for name, b in summary.items():
        r = run("report", "--policy", name)["budget"]
        assert r["amount"] == b["amount"], name
        for k in ("spent", "committed", "relaunches", "forecast"):
            assert r[k] == b[k], (name, k)


def test_with_nothing_running_a_budgets_forecast_is_its_spend(home, clock):
    from provisioner import budget
    from provisioner.views import spend

    a, _ = seed(home, clock)
    a.actor = identity.SCHEDULER  # the team's machines, bob's among them: only it may end all
    for name in ("train-a", "eval-ru", "seg-1", "seg-2"):
        machines.down(a, name)
    (demo,) = [st for st in spend.standings(a, NOW) if st.policy.name == "demo-budget"]
    assert demo.committed.amount == 0 and demo.relaunches.amount == 0
    assert demo.forecast == demo.spent and demo.forecast_pct == demo.pct
    assert budget.status(a, demo.policy, NOW) == demo
    a.close()


def test_a_mailed_report_and_its_chart_give_one_forecast_for_its_budget(home, clock):
    """A mailed report's words and its chart give its budget's one forecast (the chart drew
    another, of the report's own scope)."""
    pytest.importorskip("matplotlib")
    from provisioner import render
    from provisioner.views import spend

    a, _ = seed(home, clock)
    r = spend.report(a, spend.Query(project="demo", owner="bob@example.com"), NOW).report
    assert r.budget is not None and r.forecast is not None
    assert r.forecast.rounded() != r.budget.forecast.rounded()  # two scopes: two forecasts
    f = render.fmt(r)
    legend = [t.get_text() for t in render.chart(r).axes[0].get_legend().get_texts()]
    said = f.money(r.budget.forecast)
    assert f"{f.t('forecast_line')} {said}" in legend
    assert f"{f.t('forecast')}: {said}" in render.text(r)
    assert (
        json.loads(json.dumps(r.as_json(), default=str))["forecast"]
        == r.budget.as_json()["forecast"]
    )
    a.close()


def test_plan_over_budget_offers_no_candidate_on_the_page_or_in_the_cli(
    home, clock, cli, monkeypatch
):
    """An 8×A100 for the rest of November overruns demo's budget: the page no longer lists ten
    candidates under a verdict that says `up` would refuse — it says none may launch and why,
    as `plan` does (exit 2), with the same words."""
    from urllib.parse import urlencode

    a, pdir = seed(home, clock)
    monkeypatch.setenv(CLOCK_ENV, NOW.isoformat())
    monkeypatch.setattr(ShiftedClock, "now", lambda self: NOW)
    exp = home / "big.yaml"
    exp.write_text(
        "name: big\nproject: demo\nowner: ana@example.com\nresources:\n  gpu: A100:8\n"
        "  market: reserved\n  clouds: [sandbox]\n"
    )
    cfg = write_settings(home, policies=[str(pdir)], state_url=a.settings.state_url)
    r = cli("--config", str(cfg), "plan", str(exp), "-o", "json")
    assert r.code == 2
    said = json.loads(r.out)
    assert said["candidate_count"] > 0 and said["launchable_count"] == 0
    assert said["refused"].startswith("budget demo-budget (2026-11) overrun by ")
    status, _, body = call(make_app(a), "/plan", "POST", urlencode({"text": exp.read_text()}))
    assert status == 200
    body = html.unescape(body)
    (verdict,) = cells(body, r'<h2 id="plan-verdict">(.*?)</h2>')
    assert verdict.endswith(
        f"{said['candidate_count']} offers fit, none may launch: {said['refused']}"
    )
    assert '<table id="candidates" class="refused">' in body
    text = cli("--config", str(cfg), "plan", str(exp))
    assert f"none may launch: {said['refused']}" in " ".join(text.out.split())
    # within the budget: every candidate may launch, and the page says so
    small = exp.read_text().replace("A100:8", "T4:1").replace("reserved", "spot")
    status, _, body = call(make_app(a), "/plan", "POST", urlencode({"text": small}))
    (verdict,) = cells(html.unescape(body), r'<h2 id="plan-verdict">(.*?)</h2>')
    assert "candidates, cheapest first" in verdict and "none may launch" not in verdict
    a.close()
