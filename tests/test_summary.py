"""The landing summary — money burning now, counts, budgets, machines idle now — is one thing for
`provisioner status --summary` and the dashboard's fleet page; idle time of a machine still
running counts as idle waste in `report` (not only idle time a stop closed)."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from decimal import Decimal

from provisioner.dashboard import make_app
from tests.conftest import run_cli, write_settings
from tests.test_dashboard import NOW, call, report_json, seeded  # noqa: F401


def fresh_beats(a) -> None:
    """The seed's agents beat every 5 minutes until 5 minutes ago; one more each, at NOW, so a
    CLI whose clock runs on from NOW still hears them within the grace."""
    from sqlalchemy import select

    from provisioner import heartbeats
    from provisioner.models import Machine

    utils = {"eval-ru": 85.0, "seg-1": 2.0, "train-a": 50.0}
    with a.db.session() as s:
        live = {m.name: m.id for m in s.scalars(select(Machine).where(Machine.status == "running"))}
    for name, mid in live.items():
        heartbeats.record(a, mid, [{"index": 0, "util": utils[name], "mem_used_mb": 1000}])


def summary_json(a, pdir) -> dict:
    cfg = write_settings(a.settings.home, policies=[str(pdir)], state_url=a.settings.state_url)
    r = run_cli("--config", str(cfg), "status", "--summary", "--no-refresh", "-o", "json", now=NOW)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_status_summary_and_the_fleet_page_say_the_same(seeded):  # noqa: F811
    a, pdir = seeded
    fresh_beats(a)
    sm = summary_json(a, pdir)
    # three running (one idle: its agent reports 2 % for the last two hours), one stopped
    assert sm["counts"] == {
        "running": 3,
        "idle": 1,
        "stopped": 1,
        "preempted": 0,
        "held": 0,
        "waiting": 0,
    }
    [idle] = sm["idle_now"]
    assert idle["name"] == "seg-1" and idle["since"] == (NOW - timedelta(hours=2)).isoformat()
    rate = Decimal(idle["rate_per_hour"]["amount"])
    # two hours at its launch rate (the CLI's clock has run on a moment from NOW)
    assert rate * 2 <= Decimal(idle["wasted"]["amount"]) < rate * Decimal("2.02")
    assert {b["policy"] for b in sm["budgets"]} == {"demo-budget", "vision-budget"}
    currencies = {m["currency"] for m in sm["burning_per_hour"]}
    assert currencies == {"USD", "RUB"}  # eval-ru bills in roubles
    html = call(make_app(a), "/")[2]
    counts = dict(re.findall(r'<li data-count="(\w+)"><strong>(\d+)</strong>', html))
    assert {k: int(v) for k, v in counts.items()} == sm["counts"]
    assert re.search(r'<li data-machine="seg-1">', html)  # listed idle now
    row = re.search(r'<tr data-machine="seg-1">(.*?)</tr>', html, re.S)
    assert row is not None and 'class="idle-now"' in row.group(1)
    busy = re.search(r'<tr data-machine="train-a">(.*?)</tr>', html, re.S)
    assert busy is not None and 'class="idle-now"' not in busy.group(1)
    cards = re.findall(
        r'data-budget="([^"]+)"', html.split('id="summary"')[1].split("</section>")[0]
    )
    assert set(cards) == {"demo-budget", "vision-budget"}


def test_idle_waste_counts_a_machine_still_idle(seeded):  # noqa: F811
    from sqlalchemy import select

    from provisioner.models import Machine

    a, pdir = seeded
    fresh_beats(a)
    r = report_json(a, pdir, "--period", "2026-11", "--project", "vision", "--currency", "USD")
    sm = summary_json(a, pdir)
    [idle] = sm["idle_now"]
    with a.db.session() as s:
        seg2 = s.scalars(select(Machine).where(Machine.name == "seg-2")).one()
        rate, currency = seg2.rate, seg2.currency
    per_usd = {"USD": Decimal(1), "RUB": Decimal(80)}[currency]
    closed = rate / per_usd  # seg-2: idle from 19:00, stopped at 20:00 — one hour a stop closed
    still = Decimal(idle["wasted"]["amount"])  # seg-1: idle for two hours, still running (USD)
    got = Decimal(r["idle_waste"]["amount"])
    assert abs(got - (closed + still)) < Decimal("0.01")
