"""`bill` does not trust the bill: every field a bill reader takes from a cloud's answer is
checked, and an answer it cannot take is one line, exit 1, nothing stored (issue 33: 6 of 11
malformed Cost Explorer answers ended in a traceback). AWS: unmodified boto3 against moto's
Cost Explorer, answers injected as in tests/test_bill.py."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest

from provisioner.clock import CLOCK_ENV
from tests.conftest import write_settings
from tests.contract.aws import clean_emulator
from tests.emulators.aws import AwsEmulator
from tests.test_bill import NOW, ce_results, day

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

GOOD = day(3, [("ma", "BoxUsage:g4dn.xlarge", "12.624", "24")])


def broken(**change: object) -> dict:
    """One day of GetCostAndUsage whose one group has ``change`` applied: ``metrics``,
    ``keys``, ``start`` replace those parts; ``amount``, ``unit``, ``hours`` the values."""
    d = copy.deepcopy(GOOD)
    g = d["Groups"][0]
    if "start" in change:
        d["TimePeriod"]["Start"] = change["start"]
    if "keys" in change:
        g["Keys"] = change["keys"]
    if "amount" in change:
        g["Metrics"]["UnblendedCost"]["Amount"] = change["amount"]
    if "unit" in change:
        g["Metrics"]["UnblendedCost"]["Unit"] = change["unit"]
    if "hours" in change:
        g["Metrics"]["UsageQuantity"]["Amount"] = change["hours"]
    if "metrics" in change:
        if change["metrics"] is None:
            del g["Metrics"]
        else:
            g["Metrics"] = change["metrics"]
    return d


@pytest.fixture
def emu(monkeypatch: pytest.MonkeyPatch) -> Iterator[AwsEmulator]:
    with clean_emulator(monkeypatch) as emulator:
        yield emulator


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (broken(amount="NaN"), "amount NaN is not an amount"),
        (broken(amount="Infinity"), "amount Infinity is not an amount"),
        (broken(amount="twelve dollars"), "InvalidOperation"),
        (broken(amount="1e999999"), "amount 1E+999999 is not an amount"),
        (broken(metrics=None), "KeyError: 'Metrics'"),
        (broken(metrics={}), "KeyError: 'UnblendedCost'"),
        (broken(keys=["provisioner-machine$ma"]), "IndexError"),
        (broken(start="9999-99-99"), "ValueError"),
        (broken(start="2031-01-01"), "day 2031-01-01 is not in 2026-11-01…2026-11-07"),
        (broken(unit="dollars"), "currency 'dollars' is not a code"),
        (broken(hours="-24"), "usage hours -24 are not hours"),
    ],
)
def test_a_malformed_cost_explorer_answer_is_one_line_exit_1_and_nothing_stored(
    emu: AwsEmulator, home: Path, cli, monkeypatch: pytest.MonkeyPatch, answer: dict, said: str
) -> None:
    ce_results(emu, {"ResultsByTime": [answer]}, {"ResultsByTime": []})
    monkeypatch.setenv(CLOCK_ENV, NOW.isoformat())
    options = {"endpoint": emu.endpoint_url, "regions": ["us-east-1"]}
    cfg = write_settings(home, clouds={"aws": options})
    r = cli("--config", str(cfg), "bill", "--period", "2026-11", "--cloud", "aws")
    assert r.code == 1, (r.out, r.err)
    assert "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1, r.err
    assert r.err.startswith("error: aws: the bill's answer is malformed (")
    assert said in r.err and r.err.strip().endswith("; nothing was stored")
    assert not (home / "bill").exists()  # the dashboard's copy of the last bill: untouched


def test_a_well_formed_answer_still_reads(emu: AwsEmulator, home: Path, cli, monkeypatch) -> None:
    ce_results(emu, {"ResultsByTime": [GOOD]}, {"ResultsByTime": []})
    monkeypatch.setenv(CLOCK_ENV, NOW.isoformat())
    options = {"endpoint": emu.endpoint_url, "regions": ["us-east-1"]}
    cfg = write_settings(home, clouds={"aws": options})
    r = cli("--config", str(cfg), "bill", "--period", "2026-11", "--cloud", "aws")
    assert r.code == 0, r.err
    assert (home / "bill" / "aws.json").exists()
