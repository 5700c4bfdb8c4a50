"""Chargeback: spend by an experiment's label (``report --by label:KEY``) and by team (owners
mapped to teams in settings), with lines that add up to the total to the cent."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from pydantic import ValidationError

from provisioner import machines, reports
from provisioner.app import App
from provisioner.errors import UserError
from provisioner.spec import Experiment
from tests.conftest import make_settings, run_cli, sandbox_experiment, write_settings
from tests.test_ledger import NOV

TEAMS = {"ml-platform": ["ana@example.com", "Bob@Example.com"], "vision": ["*@vision.example.com"]}
END = datetime(2026, 12, 1, tzinfo=UTC)


@pytest.fixture
def tapp(home, clock, db_url):
    a = App(make_settings(home, state_url=db_url, teams=TEAMS), clock)
    yield a
    a.close()


def _up(app, name: str, owner: str, labels: dict[str, str], hours: int, **res) -> None:
    spec = {**sandbox_experiment(name, **res), "owner": owner, "labels": labels}
    app.actor = owner  # each owner launches their own (provisioner.identity)
    machines.up(app, Experiment.model_validate(spec))
    app.clock.advance(timedelta(hours=hours))
    machines.down(app, name)


def fleet(app, clock) -> None:
    """Five machines of four owners over November; T4 spot at 0.15 USD/h plus a 50 GB disk.
    The ``cost-center`` label: cc-1 (ana 10 h, carl 7 h), cc-2 (bob 3 h), none (dora, eve)."""
    clock.set(datetime(2026, 11, 2, 9, tzinfo=UTC))
    _up(app, "a1", "ana@example.com", {"cost-center": "cc-1", "team": "x"}, 10)
    _up(app, "b1", "bob@example.com", {"cost-center": "cc-2"}, 3)
    _up(app, "c1", "carl@vision.example.com", {"cost-center": "cc-1"}, 7)
    _up(app, "d1", "dora@elsewhere.org", {}, 5)
    _up(app, "e1", "eve@elsewhere.org", {"other": "y"}, 1, market="reserved")


def _adds_up(r: reports.Report) -> None:
    assert sum((ln.shown.amount for ln in r.lines), Decimal(0)) == r.shown_total.amount
    for ln in r.lines:
        assert sum((m.amount for m in ln.shown_by_kind.values()), Decimal(0)) == ln.shown.amount


def test_report_by_label_groups_machines_by_their_label_value(tapp, clock):
    fleet(tapp, clock)
    r = reports.build(tapp, NOV, by="label:cost-center", now=END)
    lines = {ln.key: ln for ln in r.lines}
    assert set(lines) == {"cc-1", "cc-2", "—"}  # machines without the label: one line
    by_owner = {ln.key: ln for ln in reports.build(tapp, NOV, by="owner", now=END).lines}
    # cc-1 is exactly ana's and carl's machines
    assert lines["cc-1"].total.amount == (
        by_owner["ana@example.com"].total.amount + by_owner["carl@vision.example.com"].total.amount
    )
    assert lines["cc-2"].total == by_owner["bob@example.com"].total
    _adds_up(r)
    assert r.as_json()["by"] == "label:cost-center"


def test_report_by_team_maps_owners_case_and_globs_and_leaves_the_rest_apart(tapp, clock):
    fleet(tapp, clock)
    r = reports.build(tapp, NOV, by="team", now=END)
    lines = {ln.key: ln for ln in r.lines}
    assert set(lines) == {"ml-platform", "vision", "—"}
    by_owner = {ln.key: ln for ln in reports.build(tapp, NOV, by="owner", now=END).lines}
    # Bob@Example.com in settings is bob@example.com's team; carl matches *@vision.example.com
    assert lines["ml-platform"].total.amount == (
        by_owner["ana@example.com"].total.amount + by_owner["bob@example.com"].total.amount
    )
    assert lines["vision"].total == by_owner["carl@vision.example.com"].total
    assert lines["—"].total.amount == (
        by_owner["dora@elsewhere.org"].total.amount + by_owner["eve@elsewhere.org"].total.amount
    )
    _adds_up(r)


def test_rounded_lines_add_up_to_the_rounded_total_with_many_small_lines(tapp, clock):
    """Seven machines of a third of a cent each way: each line rounded alone would not add up."""
    clock.set(datetime(2026, 11, 2, 9, tzinfo=UTC))
    for i in range(7):
        spec = {**sandbox_experiment(f"m{i}"), "labels": {"cc": f"cc-{i}"}}
        machines.up(tapp, Experiment.model_validate(spec))
        clock.advance(timedelta(minutes=7))
        machines.down(tapp, f"m{i}")
    r = reports.build(tapp, NOV, by="label:cc", now=END)
    assert len(r.lines) == 7
    _adds_up(r)


def test_bad_groupings_and_team_maps_are_refused(tapp, home):
    for by in ("label:", "teams", "label"):
        with pytest.raises(UserError, match="by: use one of"):
            reports.build(tapp, NOV, by=by, now=END)
    with pytest.raises(ValidationError, match=r"'A@x\.io' is in two teams: one and two"):
        make_settings(home, teams={"one": ["a@x.io"], "two": ["A@x.io"]})


def test_report_cli_by_team_and_label(home, clock):
    app = App(make_settings(home, teams=TEAMS), clock)
    fleet(app, clock)
    app.close()
    cfg = write_settings(home, teams=TEAMS)

    def report(*args: str):
        return run_cli("--config", str(cfg), "report", "--period", "2026-11", *args, now=END)

    r = report("--by", "team", "-o", "json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["by"] == "team"
    keys = [ln["key"] for ln in data["lines"]]
    assert sorted(keys) == ["ml-platform", "vision", "—"]
    r = report("--by", "label:cost-center")
    assert r.returncode == 0, r.stderr
    assert "Label cost-center" in r.stdout and "cc-1" in r.stdout and "cc-2" in r.stdout
    r = report("--by", "color")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "by: use one of project, owner, cloud, gpu, machine, team or label:KEY" in r.stderr
    assert "(not 'color')" in r.stderr


def test_dashboard_spend_page_by_team_and_by_label(tapp, clock):
    from provisioner.dashboard import make_app
    from tests.test_dashboard import call

    fleet(tapp, clock)
    clock.set(END)
    wsgi = make_app(tapp)
    status, _, html = call(wsgi, "/spend?period=2026-11&by=team")
    assert status == 200
    assert '<option value="team" selected>Team</option>' in html
    assert "<h2>Team</h2>" in html and 'data-key="ml-platform"' in html
    assert 'data-key="vision"' in html and 'data-key="—"' in html
    status, _, html = call(wsgi, "/spend?period=2026-11&by=label:cost-center")
    assert status == 200 and "<h2>Label cost-center</h2>" in html
    assert 'data-key="cc-1"' in html and 'data-key="cc-2"' in html
    status, _, body = call(wsgi, "/spend.csv?period=2026-11&by=team")
    assert status == 200 and body.splitlines()[0].startswith("period,team,kind")
