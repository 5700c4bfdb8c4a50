"""`provisioner bill`: the ledger beside each cloud's own bill, through the CLI.

AWS: unmodified boto3 against moto's Cost Explorer (results injected through moto's own
``/moto-api/static/ce/cost-and-usage-results``, served in the order the calls are made).
The ledger is seeded as rows (machines and their usage intervals), as a launch would leave them."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from provisioner.app import App
from provisioner.clock import CLOCK_ENV, ManualClock
from provisioner.models import Machine, UsageInterval
from tests.conftest import make_settings, write_settings
from tests.contract.aws import clean_emulator
from tests.emulators.aws import AwsEmulator

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

NOW = datetime(2026, 11, 6, 12, 0, tzinfo=UTC)  # a Friday noon: Nov 5 is inside AWS's lag
T = lambda d, h=0: datetime(2026, 11, d, h, tzinfo=UTC)  # noqa: E731
G4DN = Decimal("0.526")  # g4dn.xlarge on demand in us-east-1, the shipped catalog's price
P3 = Decimal("3.06")  # p3.2xlarge on demand in us-east-1, the shipped catalog's price


def seed(app: App, cloud: str, rows: list[tuple[str, str, str, Decimal, datetime, datetime | None]]):
    """Machines as a launch leaves them: (id, name, instance type, rate, up, down)."""
    with app.db.session() as s:
        for mid, name, itype, rate, up, down in rows:
            s.add(
                Machine(
                    id=mid,
                    name=name,
                    project="vision" if name != "nlp-1" else "nlp",
                    owner="ana@example.com",
                    status="terminated" if down else "running",
                    spec={},
                    cloud=cloud,
                    region={"aws": "us-east-1", "gcp": "us-central1", "azure": "eastus"}[cloud],
                    zone=None,
                    instance_type=itype,
                    gpu="T4",
                    gpu_count=1,
                    market="reserved",
                    rate=rate,
                    currency="USD",
                    created_at=up,
                    launched_at=up,
                    terminated_at=down,
                )
            )
            s.flush()
            s.add(
                UsageInterval(
                    machine_id=mid, kind="compute", started_at=up, ended_at=down, rate=rate,
                    currency="USD",
                )
            )  # fmt: skip


# --- AWS -------------------------------------------------------------------------------------


@pytest.fixture
def emu(monkeypatch: pytest.MonkeyPatch) -> Iterator[AwsEmulator]:
    with clean_emulator(monkeypatch) as emulator:
        yield emulator


def ce_results(emu: AwsEmulator, *results: dict) -> None:
    """Queue GetCostAndUsage answers in moto (moto/ce/models.py, get_cost_and_usage: each new
    request body takes the next queued result)."""
    req = urllib.request.Request(
        f"{emu.moto_url}/moto-api/static/ce/cost-and-usage-results",
        data=json.dumps({"results": list(results)}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 201


def day(d: int, groups: list[tuple[str, str, str, str | None]]) -> dict:
    """One day of GetCostAndUsage ResultsByTime: groups of (tag value, second key, cost,
    usage hours)."""
    return {
        "TimePeriod": {"Start": f"2026-11-{d:02d}", "End": f"2026-11-{d + 1:02d}"},
        "Total": {},
        "Groups": [
            {
                "Keys": [f"provisioner-machine${tag}", key],
                "Metrics": {
                    "UnblendedCost": {"Amount": cost, "Unit": "USD"},
                    **({"UsageQuantity": {"Amount": hours, "Unit": "Hrs"}} if hours else {}),
                },
            }
            for tag, key, cost, hours in groups
        ],
        "Estimated": True,
    }


@pytest.fixture
def aws_bill(emu: AwsEmulator, home: Path, cli, monkeypatch: pytest.MonkeyPatch):
    """Two machines in the ledger and November's bill so far in Cost Explorer:
    train-a  g4dn.xlarge at 0.526/h, Nov 2 00:00 → Nov 5 00:00: 72 h = 37.872 USD, billed at
             the same price, plus its public IPv4 address (0.005/h) and a 5.00 USD credit;
    train-b  p3.2xlarge at 3.06/h, from Nov 3 00:00, still running at Nov 6 12:00; billed
             Nov 3–4 at 3.2130/h (5 % over the catalog); Nov 5 and 6 not billed yet;
    and, untagged, a t3.micro of somebody else's (0.25) and the month's tax (3.10)."""
    options = {"endpoint": emu.endpoint_url, "regions": ["us-east-1"]}
    app = App(make_settings(home, clouds={"aws": options}), ManualClock(NOW))
    seed(
        app,
        "aws",
        [
            ("ma", "train-a", "g4dn.xlarge", G4DN, T(2), T(5)),
            ("mb", "train-b", "p3.2xlarge", P3, T(3), None),
        ],
    )
    app.close()
    ip = ("ma", "USE1-PublicIPv4:InUseAddress", "0.12", None)
    usage = {
        "ResultsByTime": [
            day(2, [("ma", "BoxUsage:g4dn.xlarge", "12.624", "24"), ip]),
            day(
                3,
                [
                    ("ma", "BoxUsage:g4dn.xlarge", "12.624", "24"),
                    ip,
                    ("mb", "BoxUsage:p3.2xlarge", "77.112", "24"),
                ],
            ),
            day(
                4,
                [
                    ("ma", "BoxUsage:g4dn.xlarge", "12.624", "24"),
                    ip,
                    ("mb", "BoxUsage:p3.2xlarge", "77.112", "24"),
                    ("", "BoxUsage:t3.micro", "0.25", "24"),
                ],
            ),
        ],
        "DimensionValueAttributes": [],
    }
    others = {
        "ResultsByTime": [day(3, [("ma", "Credit", "-5.00", None)]), day(4, [("", "Tax", "3.10", None)])],
        "DimensionValueAttributes": [],
    }
    ce_results(emu, usage, others)
    monkeypatch.setenv(CLOCK_ENV, NOW.isoformat())
    cfg = write_settings(home, clouds={"aws": options})
    return lambda *args: cli("--config", str(cfg), "bill", "--period", "2026-11", *args)


def test_aws_bill_by_machine_names_every_difference(aws_bill) -> None:
    r = aws_bill("--cloud", "aws", "-o", "json")
    assert r.code == 0, r.err
    [aws] = json.loads(r.out)["clouds"]
    assert aws["through"] == "2026-11-04"  # the last billed day, and inside the one-day lag
    lines = {ln["key"]: ln for ln in aws["lines"]}
    usd = lambda a: {"amount": a, "currency": "USD"}  # noqa: E731
    a = lines["train-a"]
    # billed: 3 × 12.624 + 3 × 0.12 − 5.00 = 33.232; ledger 72 h × 0.526 = 37.872
    assert (a["billed"], a["ledger"], a["difference"]) == (usd("33.23"), usd("37.87"), usd("-4.64"))
    assert a["reasons"] == {"credit": usd("-5.00"), "unpriced": usd("0.36")}
    b = lines["train-b"]
    # billed 2 × 77.112 = 154.224, shown 154.23: the lines' cents must add up to the total's
    # (33.232 + 154.224 + 3.35 = 190.806 → 190.81) and 154.224 lost most in rounding down;
    # ledger 84 h × 3.06 = 257.04 (Nov 3 00:00 → Nov 6 12:00)
    assert (b["billed"], b["ledger"]) == (usd("154.23"), usd("257.04"))
    # drift: 154.224 − 48 h × 3.06 = 7.344; not billed yet: 36 h × 3.06 = 110.16; shown as
    # shares of the shown difference, 154.23 − 257.04 = −102.81 = 7.35 − 110.16
    assert b["difference"] == usd("-102.81")
    assert b["reasons"] == {"drift": usd("7.35"), "not_billed_yet": usd("-110.16")}
    u = lines["(untagged)"]
    assert u["ledger"] == usd("0.00")
    assert u["reasons"] == {"tax": usd("3.10"), "untagged": usd("0.25")}
    # the rounded lines add up to the rounded totals
    tot = aws["totals"]["USD"]
    for k in ("billed", "ledger", "difference"):
        assert sum(Decimal(ln[k]["amount"]) for ln in aws["lines"]) == Decimal(tot[k]["amount"])
    assert tot["billed"] == usd("190.81")  # 33.232 + 154.224 + 3.35, exact sum rounded
    # the billed unit price of train-b's type is 5 % over the catalog: said, with the fix
    [drift] = aws["drift"]
    assert (drift["machine"], drift["instance_type"], drift["pct"]) == ("train-b", "p3.2xlarge", "5.0")
    assert drift["billed"] == usd("3.2130") and drift["catalog"] == usd("3.06")
    assert drift["fix"] == "provisioner catalog refresh"


def test_aws_bill_table_and_by_day(aws_bill) -> None:
    r = aws_bill("--by", "day")
    assert r.code == 0, r.err
    rows = {ln.split()[0]: ln for ln in r.out.splitlines() if ln.startswith(("2026-", "total"))}
    # Nov 4: billed 12.624 + 0.12 + 77.112 + 0.25 + 3.10 = 93.206; ledger 24 × (0.526 + 3.06)
    # = 86.064; the difference shown is that of the shown amounts
    assert rows["2026-11-04"].split()[1:7] == ["93.21", "USD", "86.06", "USD", "+7.15", "USD"]
    assert "tax +3.10 USD" in rows["2026-11-04"] and "untagged +0.25 USD" in rows["2026-11-04"]
    # Nov 5 and 6: nothing billed, the ledger's spend is not billed yet
    assert rows["2026-11-05"].split()[1:3] == ["0.00", "USD"]
    assert "not billed yet -73.44 USD" in rows["2026-11-05"]  # 24 h × 3.06
    assert rows["total"].split()[1:5] == ["190.81", "USD", "294.91", "USD"]
    assert "billed by the cloud through 2026-11-04" in r.out
    assert "`provisioner catalog refresh` fixes them" in r.out
    assert "train-b: p3.2xlarge reserved in us-east-1: billed 3.2130 USD/h, catalog 3.06" in r.out


def test_aws_bill_by_project(aws_bill) -> None:
    r = aws_bill("--by", "project", "-o", "json")
    assert r.code == 0, r.err
    keys = [ln["key"] for ln in json.loads(r.out)["clouds"][0]["lines"]]
    assert keys == ["vision", "(untagged)"]


def test_bill_of_a_cloud_without_a_source_says_why(home: Path, cli) -> None:
    cfg = write_settings(home)
    r = cli("--config", str(cfg), "bill", "--cloud", "yandex")
    assert r.code == 2
    assert "yandex" in r.err and "Traceback" not in r.err
    r = cli("--config", str(cfg), "bill", "--period", "2026-13")
    assert r.code == 2 and "--period" in r.err

