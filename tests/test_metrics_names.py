"""``/metrics`` named as Prometheus's "Metric and label naming" asks
(https://prometheus.io/docs/practices/naming/): a fraction is a ``_ratio`` from 0 to 1, never a
``_percent``; money carries its unit — the currency's ISO 4217 code — in its name, one metric per
currency, never a ``currency`` label beside amounts that cannot be summed; and ``promtool check
metrics`` (Debian's ``prometheus`` package) finds nothing to say."""

from __future__ import annotations

import math
import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from provisioner.jobs.metrics import Metrics
from tests.test_dashboard import seed


@pytest.fixture
def text(home, clock, db_url) -> str:
    """The seeded team's month: a budget in USD, one in RUB, GPUs reporting."""
    app, _ = seed(home, clock, db_url)
    try:
        return Metrics(app).render()[0].decode()
    finally:
        app.close()


def test_promtool_finds_nothing_to_say(text):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    r = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert r.returncode == 0 and r.stdout + r.stderr == "", r.stdout + r.stderr


def test_units_are_in_the_names_and_fractions_are_ratios(text):
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert not [n for n in families if "percent" in n]
    for name in ("amount", "spent", "committed", "relaunches", "forecast", "idle_waste"):
        usd, rub = (
            families[f"provisioner_budget_{name}_usd"],
            families[f"provisioner_budget_{name}_rub"],
        )
        assert [s.labels["policy"] for s in usd.samples] == ["demo-budget"]
        assert [s.labels["policy"] for s in rub.samples] == ["vision-budget"]
        assert all("currency" not in s.labels for s in usd.samples + rub.samples)
    ratios = {
        s.labels["policy"]: s.value for s in families["provisioner_budget_spent_ratio"].samples
    }
    spent = {
        s.labels["policy"]: s.value
        for cur in ("usd", "rub")
        for s in families[f"provisioner_budget_spent_{cur}"].samples
    }
    amount = {
        s.labels["policy"]: s.value
        for cur in ("usd", "rub")
        for s in families[f"provisioner_budget_amount_{cur}"].samples
    }
    assert set(ratios) == {"demo-budget", "vision-budget"}
    for p, r in ratios.items():
        assert math.isclose(r, spent[p] / amount[p]) and spent[p] > 0, p
    util = families["provisioner_gpu_utilization_ratio"].samples
    assert util and all(0 <= s.value <= 1 for s in util)
    assert any(0 < s.value < 1 for s in util)  # a fraction, not a percent rounded to 0 or 1
