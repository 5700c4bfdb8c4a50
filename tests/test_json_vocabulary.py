"""One name per concept across every ``-o json``: every command (discovered from the Typer app,
as tests/test_cli_surface.py runs them), and the forms a budget and a report add, on a small
state with a budget; the keys are gathered from every object at any depth and each group of
names for one concept may show only its one name. Money is always ``{"amount": "1.23",
"currency": "USD"}`` (the form of :meth:`provisioner.money.Money.as_json`, the one most outputs
already used), and a date not known is ``null``, never ``""``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from provisioner import machines
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.settings import load_settings
from provisioner.spec import Experiment
from tests.conftest import TEST_START, sandbox_experiment, write_settings, write_yaml
from tests.test_cli_surface import DAEMONS, argv_for, commands, has_output

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

#: concept → its one name, and the names it must not also go by
VOCABULARY: dict[str, tuple[str, set[str]]] = {
    "spent as a percent of the budget": ("spent_percent", {"percent", "spent_pct", "pct"}),
    "forecast as a percent of the budget": ("forecast_percent", {"forecast_pct"}),
    "the budget's amount": ("amount", {"budget_amount"}),
    "an offer's price an hour": ("price_per_hour", {"price", "hourly_price"}),
    "the day prices were read": ("as_of", {"asof", "as_at", "dated"}),
}
#: keys whose value is money: each {"amount": str, "currency": str}
MONEY = {"price_per_hour", "rate_per_hour", "spent", "committed", "relaunches", "forecast", "left"}
MONEY |= {"total", "idle_waste", "price_low", "price_high", "rental_per_month", "power_per_month"}


@pytest.fixture
def state(home: Path, tmp_path: Path):
    """A running machine under a budget: the forms a budget adds show up."""
    pdir = tmp_path / "policies"
    pdir.mkdir()
    write_yaml(
        pdir / "b.yaml",
        {"name": "demo-budget", "budget": {"amount": "2000 USD", "alerts": {"actual": [50]}}},
    )
    cfg = write_settings(home, policies=[str(pdir)])
    spec = write_yaml(tmp_path / "exp.yaml", sandbox_experiment("exp"))
    a = App(load_settings(cfg), ManualClock(TEST_START))
    machines.up(a, Experiment.model_validate(sandbox_experiment("exp")))
    a.close()
    return cfg, spec


def walk(x: Any, where: str, keys: dict[str, set[str]], found: list[tuple[str, str, Any]]):
    if isinstance(x, dict):
        for k, v in x.items():
            keys.setdefault(k, set()).add(where)
            found.append((where, k, v))
            walk(v, where, keys, found)
    elif isinstance(x, list):
        for v in x:
            walk(v, where, keys, found)


def outputs(cli, cfg: Path, spec: Path) -> list[tuple[str, Any]]:
    runnable = [p for p in commands() if p not in DAEMONS and has_output(p)]
    runnable.sort(key=lambda p: p == ("down",))  # the others see the running machine
    argvs = [["status", "--summary"], ["report"], ["report", "--by", "owner"]]
    argvs += [argv_for(p, spec) for p in runnable]
    got = []
    for argv in argvs:
        r = cli("--config", str(cfg), *argv, "-o", "json")
        got.append((" ".join(argv[:2]), json.loads(r.out)))
    return got


def test_one_name_per_concept_across_every_json_output(cli, state):
    keys: dict[str, set[str]] = {}
    found: list[tuple[str, str, Any]] = []
    for where, data in outputs(cli, *state):
        walk(data, where, keys, found)
    # the forms this test is about did show up (a budget, a report, the catalog, a plan)
    assert {"spent_percent", "forecast_percent", "price_per_hour", "as_of"} <= set(keys)
    for concept, (name, others) in VOCABULARY.items():
        drift = {o: sorted(keys[o]) for o in others if o in keys}
        assert not drift, f"{concept}: {name!r}, not {drift}"
    for where, k, v in found:
        if k in MONEY and v is not None:  # one money, or one per currency
            for m in v if isinstance(v, list) else [v]:
                assert isinstance(m, dict) and set(m) >= {"amount", "currency"}, (where, k, v)
                assert isinstance(m["amount"], str) and isinstance(m["currency"], str), (where, k)
        if k == "as_of":
            assert v is None or (isinstance(v, str) and v), (where, v)
        if k in ("spent_percent", "forecast_percent"):
            assert isinstance(v, str) and "E" not in v and len(v.partition(".")[2]) <= 1, v
