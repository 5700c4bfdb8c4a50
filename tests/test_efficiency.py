"""A team lead's answers: how much of the GPU time paid for was busy (busy GPU-hours ÷ paid,
per machine, owner, project and budget) in `report`, its JSON, the dashboard's spend page and
/metrics; and spend unusual against its own recent days, flagged with its rule."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from provisioner import efficiency, heartbeats, machines, reports
from provisioner.app import App
from provisioner.ledger import Period
from provisioner.spec import Experiment
from tests.conftest import TEST_START, make_settings, sandbox_experiment, write_yaml

T0 = TEST_START  # Mon 2026-11-02 09:00 UTC
HOUR = timedelta(hours=1)
STEP = timedelta(seconds=30)  # the agent's period (settings' default): a heartbeat speaks 60 s

POLICIES = [
    {"name": "demo-budget", "applies_to": {"projects": ["demo"]}, "budget": {"amount": "900 USD"}},
]


def up(app: App, name: str, project: str, owner: str, **res: object) -> str:
    app.actor = owner
    e = sandbox_experiment(name, **res) | {"project": project, "owner": owner}
    return machines.up(app, Experiment.model_validate(e)).machine.id


def beat(app: App, clock, mid: str, at: datetime, *utils: float) -> None:
    clock.set(at)
    heartbeats.record(app, mid, [{"index": i, "util": u} for i, u in enumerate(utils)])


@pytest.fixture
def fleet(home: Path, clock, db_url):
    """Two machines over the hour from T0:
    - ``train`` (ana, demo, T4 × 1): GPU at 50 % for 10 min, at 1 % for 10 min, then silent;
    - ``seg`` (bob, vision, T4 × 4): GPUs at 90, 90, 0 and 4 % all hour (4 % is below 5 %)."""
    pdir = home.parent / "policies"
    pdir.mkdir(parents=True, exist_ok=True)
    for p in POLICIES:
        write_yaml(pdir / f"{p['name']}.yaml", p)
    app = App(make_settings(home, state_url=db_url, policies=[str(pdir)]), clock)
    clock.set(T0)
    train = up(app, "train", "demo", "ana@example.com")
    seg = up(app, "seg", "vision", "bob@example.com", gpu="T4:4")
    for i in range(120):  # every 30 s from T0 to T0 + 59:30
        at = T0 + i * STEP
        if i < 40:
            beat(app, clock, train, at, 50.0 if i < 20 else 1.0)
        beat(app, clock, seg, at, 90.0, 90.0, 0.0, 4.0)
    clock.set(T0 + HOUR)
    yield app
    app.close()


def test_busy_gpu_hours_over_paid_per_machine_owner_project_and_budget(fleet):
    e = efficiency.gpu_efficiency(fleet, T0, T0 + HOUR)
    train, seg = e.machines["train"], e.machines["seg"]
    us = 3_600_000_000  # an hour
    # train: 10 min busy, 10 min idle (its last beat at 19:30 speaks until 20:30), the rest
    # unknown: no heartbeat is neither busy nor idle
    assert (train.paid_us, train.busy_us, train.unknown_us) == (us, us // 6, us * 79 // 120)
    assert train.ratio == Decimal(1) / Decimal(6)
    # seg: 4 cards paid for an hour, 2 of them busy all hour, every second heard
    assert (seg.paid_us, seg.busy_us, seg.unknown_us) == (4 * us, 2 * us, 0)
    assert seg.ratio == Decimal("0.5")
    assert e.owners["ana@example.com"] == train and e.owners["bob@example.com"] == seg
    assert e.projects == {"demo": train, "vision": seg}
    assert e.budgets == {"demo-budget": train}  # the budget's scope: its policy's applies_to
    assert e.total.ratio == Decimal(us // 6 + 2 * us) / Decimal(5 * us)


def test_the_report_says_it_in_json_text_and_html(fleet):
    from provisioner import render

    period = Period.between(T0.date(), T0.date())
    r = reports.build(fleet, period, now=T0 + HOUR)
    j = r.as_json()["gpu_efficiency"]
    assert j["busy_ratio"] == "0.433"  # (1/6 h + 2 h) ÷ 5 h
    assert (j["paid_gpu_hours"], j["busy_gpu_hours"]) == ("5.00", "2.17")
    assert j["method"] == efficiency.EFFICIENCY_METHOD
    assert j["by_owner"] == [
        {
            "key": "ana@example.com",
            "busy_ratio": "0.167",
            "paid_gpu_hours": "1.00",
            "busy_gpu_hours": "0.17",
            "unknown_gpu_hours": "0.66",
        },
        {
            "key": "bob@example.com",
            "busy_ratio": "0.500",
            "paid_gpu_hours": "4.00",
            "busy_gpu_hours": "2.00",
            "unknown_gpu_hours": "0.00",
        },
    ]
    assert [b["key"] for b in j["by_budget"]] == ["demo-budget"]
    text = render.text(r)
    assert "GPU efficiency" in text and "43.3 %" in text and "busy GPU-hours ÷ paid" in text
    assert "; busy 16.7 %" in text.split("train —")[1].split("\n")[0]  # per machine
    html = render.html_page(r)
    assert "bob@example.com" in html and "50.0 %" in html


def test_metrics_say_busy_paid_and_the_ratio_per_project_and_owner(fleet):
    from provisioner.jobs.metrics import Metrics

    text = Metrics(fleet).render()[0].decode()  # the last hour: T0 to T0 + 1 h
    fam = {f.name: f for f in text_string_to_metric_families(text)}
    ratio = {
        (s.labels["project"], s.labels["owner"]): s.value
        for s in fam["provisioner_gpu_busy_ratio"].samples
    }
    assert ratio == {
        ("demo", "ana@example.com"): pytest.approx(1 / 6),
        ("vision", "bob@example.com"): 0.5,
    }
    paid = {s.labels["project"]: s.value for s in fam["provisioner_gpu_paid_seconds"].samples}
    busy = {s.labels["project"]: s.value for s in fam["provisioner_gpu_busy_seconds"].samples}
    assert paid == {"demo": 3600.0, "vision": 14400.0} and busy == {"demo": 600.0, "vision": 7200.0}
    anonymous = Metrics(fleet).render(names=False)[0].decode()
    assert "ana@example.com" not in anonymous and "provisioner_gpu_busy_ratio{" in anonymous


def test_the_rule_of_unusual_spend():
    steady = [Decimal(100)] * 14
    assert efficiency.verdict(Decimal(199), steady)[3] is False  # MAD 0: 2 × median
    assert efficiency.verdict(Decimal(200), steady)[3] is True
    wobbly = [Decimal(x) for x in (90, 110) * 7]  # median 100, MAD 10: limit 130
    assert efficiency.verdict(Decimal(129), wobbly)[2:] == (Decimal(130), False)
    assert efficiency.verdict(Decimal(130), wobbly)[3] is True
    assert efficiency.verdict(Decimal(9), [Decimal(0)] * 14)[3] is False  # below the floor


def test_a_spike_is_flagged_a_steady_series_is_not(home, clock, db_url):
    from provisioner import render

    app = App(make_settings(home, state_url=db_url), clock)
    start = datetime(2026, 11, 1, tzinfo=T0.tzinfo)
    clock.set(start)
    up(app, "steady", "demo", "ana@example.com", gpu="A100:8", market="reserved")  # $29/h
    up(app, "base", "vision", "bob@example.com", gpu="A100:8", market="reserved")
    last = start + timedelta(days=15)  # the 16th: its whole day the latest full one
    clock.set(last)
    up(app, "burst", "vision", "bob@example.com", gpu="A100:8", market="reserved")
    now = last + timedelta(days=1, hours=3)
    clock.set(now)
    rates = app.settings.money_rates
    found = efficiency.unusual_spend(app, now, currency="USD", rates=rates)
    assert {(u.by, u.key) for u in found} == {("project", "vision"), ("owner", "bob@example.com")}
    u = next(u for u in found if u.by == "project")
    # two machines (compute and disk) on the 16th where one ran each day before: twice the median
    assert u.day.isoformat() == "2026-11-16" and u.mad.amount == 0
    assert u.spent.amount >= 2 * u.median.amount > 29 * 24 * 2  # days to the cent
    every = efficiency.unusual_spend(app, now, currency="USD", rates=rates, flagged_only=False)
    assert ("project", "demo", False) in {(u.by, u.key, u.flagged) for u in every}
    report = reports.build(app, Period.between(last.date(), last.date()), now=now)
    text = render.text(report)
    said = text.split("Unusual spend:")[1]
    assert f"vision (project), Nov 16, 2026: ${u.spent.amount:,}" in said and "median" in said
    r = report.as_json()
    assert [(x["by"], x["key"]) for x in r["unusual_spend"]] == [
        ("owner", "bob@example.com"),
        ("project", "vision"),
    ]
    assert "median" in r["unusual_method"]
    from provisioner.dashboard import make_app
    from tests.test_dashboard import call

    page = call(make_app(app), "/spend")[2]
    flags = page.split('id="unusual-spend"')[1].split("</ul>")[0]
    assert 'data-by="project" data-key="vision"' in flags and "demo" not in flags
    app.close()


def test_the_spend_page_shows_efficiency_per_project_and_owner(fleet):
    from provisioner.dashboard import make_app
    from tests.test_dashboard import call

    status, _, html = call(make_app(fleet), "/spend")
    assert status == 200
    row = html.split('id="efficiency-owner"')[1].split('data-key="bob@example.com">')[1]
    cells = row.split("</tr>")[0]
    assert '"ratio">50.0 %<' in cells and '"busy">2.00<' in cells and '"paid">4.00<' in cells
    assert 'id="efficiency-project"' in html and 'data-key="vision"' in html
    assert "busy GPU-hours ÷ paid GPU-hours" in html  # the method beside the figure
    assert 'id="unusual-spend"' in html and "median + 3 × MAD" in html
    top = html.split('id="top"')[1].split('data-key="train">')[1].split("</tr>")[0]
    assert '"busy-ratio">16.7 %<' in top  # per machine, beside its spend


def test_my_machines_are_a_signed_in_users_default_view(fleet):
    from provisioner import tokens
    from provisioner.dashboard import make_app
    from tests.test_dashboard import call, sign_in

    fleet.actor = "bob@example.com"
    bob = tokens.create(fleet, "bob@example.com").token
    dash = make_app(fleet, listen="127.0.0.1:8765")

    def names(body: str) -> set[str]:
        return {n for n in ("train", "seg") if f'data-machine="{n}"' in body}

    anonymous = call(dash, "/")[2]
    assert names(anonymous) == {"train", "seg"} and 'id="everyones"' not in anonymous
    as_bob = sign_in(dash, bob)
    mine = call(dash, "/", cookie=as_bob)[2]
    assert names(mine) == {"seg"} and 'id="everyones"' in mine
    link = mine.split('id="everyones"')[0].rsplit('href="', 1)[1].split('"')[0]
    assert link == "/?owner=%2A"
    everyone = call(dash, link, cookie=as_bob)[2]
    assert names(everyone) == {"train", "seg"} and 'id="mine"' in everyone
    # the owner filter's "all" is everyone's too; another owner asked is that owner's
    assert names(call(dash, "/?owner=", cookie=as_bob)[2]) == {"train", "seg"}
    assert names(call(dash, "/?owner=ana%40example.com", cookie=as_bob)[2]) == {"train"}


def test_a_filter_asked_shows_everyones_machines_in_it(fleet):
    from provisioner import tokens
    from provisioner.dashboard import make_app
    from tests.test_dashboard import call, sign_in

    fleet.actor = "bob@example.com"
    dash = make_app(fleet, listen="127.0.0.1:8765")
    as_bob = sign_in(dash, tokens.create(fleet, "bob@example.com").token)
    body = call(dash, "/?cloud=sandbox", cookie=as_bob)[2]  # a budget's or a cloud's machines
    assert 'data-machine="train"' in body and 'data-machine="seg"' in body
