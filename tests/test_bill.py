"""`provisioner bill`: the ledger beside each cloud's own bill, through the CLI.

AWS: unmodified boto3 against moto's Cost Explorer (results injected through moto's own
``/moto-api/static/ce/cost-and-usage-results``, served in the order the calls are made).
The ledger is seeded as rows (machines and their usage intervals), as a launch would leave them."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from datetime import UTC, date, datetime
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from provisioner.app import App
from provisioner.bill import Line, rounded, totals
from provisioner.clock import CLOCK_ENV, ManualClock
from provisioner.models import Machine, UsageInterval
from provisioner.money import CENT, Money
from tests.conftest import make_settings, write_settings
from tests.contract.aws import clean_emulator
from tests.emulators.aws import AwsEmulator
from tests.emulators.bigquery import BigQueryEmulator

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

NOW = datetime(2026, 11, 6, 12, 0, tzinfo=UTC)  # a Friday noon: Nov 5 is inside AWS's lag
T = lambda d, h=0: datetime(2026, 11, d, h, tzinfo=UTC)  # noqa: E731
G4DN = Decimal("0.526")  # g4dn.xlarge on demand in us-east-1, the shipped catalog's price
P3 = Decimal("3.06")  # p3.2xlarge on demand in us-east-1, the shipped catalog's price


def seed(app: App, cloud: str, rows: list[tuple]):
    """Machines as a launch leaves them: (id, name, instance type, rate, up, down[, market])."""
    with app.db.session() as s:
        for mid, name, itype, rate, up, down, *market in rows:
            s.add(
                Machine(
                    id=mid,
                    name=name,
                    project="vision" if name != "nlp-1" else "nlp",
                    owner="ana@example.com",
                    status="terminated" if down else "running",
                    spec={},
                    cloud=cloud,
                    region={
                        "aws": "us-east-1",
                        "gcp": "us-central1",
                        "azure": "eastus",
                        "yandex": "ru-central1",
                        "sbercloud": "ru-moscow-1",
                    }[cloud],
                    zone=None,
                    instance_type=itype,
                    gpu="T4",
                    gpu_count=1,
                    market=market[0] if market else "reserved",
                    rate=rate,
                    currency="RUB" if cloud in ("yandex", "sbercloud") else "USD",
                    created_at=up,
                    launched_at=up,
                    terminated_at=down,
                )
            )
            s.flush()
            s.add(
                UsageInterval(
                    machine_id=mid,
                    kind="compute",
                    started_at=up,
                    ended_at=down,
                    rate=rate,
                    currency="RUB" if cloud in ("yandex", "sbercloud") else "USD",
                )
            )


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
def aws_bill(emu: AwsEmulator, home: Path, cli, monkeypatch: pytest.MonkeyPatch, db_url):
    """Two machines in the ledger and November's bill so far in Cost Explorer:
    train-a  g4dn.xlarge at 0.526/h, Nov 2 00:00 → Nov 5 00:00: 72 h = 37.872 USD, billed at
             the same price, plus its public IPv4 address (0.005/h) and a 5.00 USD credit;
    train-b  p3.2xlarge at 3.06/h, from Nov 3 00:00, still running at Nov 6 12:00; billed
             Nov 3–4 at 3.2130/h (5 % over the catalog); Nov 5 and 6 not billed yet;
    and, untagged, a t3.micro of somebody else's (0.25) and the month's tax (3.10)."""
    options = {"endpoint": emu.endpoint_url, "regions": ["us-east-1"]}
    app = App(make_settings(home, clouds={"aws": options}, state_url=db_url), ManualClock(NOW))
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
        "ResultsByTime": [
            day(3, [("ma", "Credit", "-5.00", None)]),
            day(4, [("", "Tax", "3.10", None)]),
        ],
        "DimensionValueAttributes": [],
    }
    ce_results(emu, usage, others)
    monkeypatch.setenv(CLOCK_ENV, NOW.isoformat())
    cfg = write_settings(home, clouds={"aws": options}, state_url=db_url)
    return lambda *args: cli("--config", str(cfg), "bill", "--period", "2026-11", *args)


def test_aws_bill_by_machine_names_every_difference(aws_bill) -> None:
    r = aws_bill("--cloud", "aws", "-o", "json")
    assert r.code == 0, r.err
    [aws] = json.loads(r.out)["clouds"]
    assert aws["through"] == "2026-11-04"  # the last billed day, and inside the one-day lag
    lines = {ln["key"]: ln for ln in aws["lines"]}
    usd = lambda a: Money(Decimal(a), "USD").as_json()  # noqa: E731  (JSON: exact text)
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
    assert (drift["machine"], drift["instance_type"], drift["pct"]) == (
        "train-b",
        "p3.2xlarge",
        "5.0",
    )
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


def test_bill_of_a_cloud_not_enabled_or_a_bad_period_exits_2(home: Path, cli) -> None:
    cfg = write_settings(home)
    r = cli("--config", str(cfg), "bill", "--cloud", "sbercloud")  # every cloud has a source now
    assert r.code == 2
    assert "not enabled" in r.err and "Traceback" not in r.err
    r = cli("--config", str(cfg), "bill", "--period", "2026-13")
    assert r.code == 2 and "--period" in r.err
    r = cli("--config", str(cfg), "bill")  # the sandbox only: no bill to read, and it says so
    assert r.code == 0 and "no cloud that sends a bill is enabled" in r.out


# --- GCP -------------------------------------------------------------------------------------

A2 = Decimal("3.67339")  # a2-highgpu-1g on demand in us-central1, the shipped catalog's price
A2_SPOT = Decimal("1.80385")  # its spot price there
TABLE = "demo-proj.billing.gcp_billing_export_v1_000000_000000_000000"


def export_row(
    d: int,
    sku: str,
    cost: str,
    machine: str | None = None,
    *,
    spec: str | None = None,
    credit: str | None = None,
    cost_type: str = "regular",
    month: int = 11,
) -> dict:
    """One row of the standard usage cost export, in its schema."""
    return {
        "service": {"id": "6F81-5844-456A", "description": "Compute Engine"},
        "sku": {"id": "0000-0000-0000", "description": sku},
        "usage_start_time": datetime(2026, month, d, 0, tzinfo=UTC),
        "usage_end_time": datetime(2026, month, d, 1, tzinfo=UTC),
        "labels": [{"key": "provisioner-machine", "value": machine}] if machine else [],
        "system_labels": [{"key": "compute.googleapis.com/machine_spec", "value": spec}]
        if spec
        else [],
        "cost": cost,
        "currency": "USD",
        "usage": {"amount_in_pricing_units": "24", "pricing_unit": "hour"},
        "credits": [
            {"name": "Sustained use discount", "amount": credit, "type": "SUSTAINED_USAGE_DISCOUNT"}
        ]
        if credit
        else [],
        "cost_type": cost_type,
    }


@pytest.fixture
def gcp_bill(home: Path, cli, monkeypatch: pytest.MonkeyPatch):
    """gpu-a  a2-highgpu-1g on demand at 3.67339/h, Nov 2 00:00 → Nov 4 00:00: 48 h, billed at
            the catalog's price in three SKUs a day, an external IP (0.12 a day) and an
            8.00 USD sustained use credit;
    gpu-b   a2-highgpu-1g spot at 1.80385/h from Nov 3 00:00, running; billed Nov 3–4 at
            2.00/h (10.9 % over the catalog); Nov 5 and 6 not billed yet;
    and a tax row and an unlabelled VM's core hours; an October row outside the period."""
    emu = BigQueryEmulator(page_size=4)  # several pages: jobs.getQueryResults is read too
    a2 = lambda d, sku, cost, **kw: export_row(d, sku, cost, "ga", spec="a2-highgpu-1g", **kw)  # noqa: E731
    emu.tables[TABLE] = [
        export_row(31, "A2 Instance Core running in Americas", "99", "ga", month=10),
        *(
            row
            for d in (2, 3)
            for row in (
                a2(
                    d,
                    "Nvidia Tesla A100 GPU running in Americas",
                    "70.0",
                    credit="-8.00" if d == 3 else None,
                ),
                a2(d, "A2 Instance Core running in Americas", "12.0"),
                a2(d, "A2 Instance Ram running in Americas", "6.16136"),
                export_row(d, "External IP Charge on a Standard VM", "0.12", "ga"),
            )
        ),
        *(
            export_row(
                d,
                "Nvidia Tesla A100 GPU running in Americas for Spot Preemptible VMs",
                "48.00",
                "gb",
                spec="a2-highgpu-1g",
            )
            for d in (3, 4)
        ),
        export_row(4, "N1 Predefined Instance Core running in Americas", "1.50"),
        export_row(4, "Tax: Compute Engine", "9.00", cost_type="tax"),
    ]
    options = {
        "project": "demo-proj",
        "anonymous": True,
        "regions": ["us-central1"],
        "billing_table": TABLE,
        "bigquery_endpoint": emu.url,
    }
    app = App(make_settings(home, clouds={"gcp": options}), ManualClock(NOW))
    seed(
        app,
        "gcp",
        [
            ("ga", "gpu-a", "a2-highgpu-1g", A2, T(2), T(4)),
            ("gb", "gpu-b", "a2-highgpu-1g", A2_SPOT, T(3), None, "spot"),
        ],
    )
    app.close()
    monkeypatch.setenv(CLOCK_ENV, NOW.isoformat())
    cfg = write_settings(home, clouds={"gcp": options})

    def run(*args: str):
        return cli("--config", str(cfg), "bill", "--period", "2026-11", *args)

    run.emu = emu  # type: ignore[attr-defined]
    yield run
    emu.stop()


def test_gcp_bill_from_the_bigquery_export(gcp_bill) -> None:
    r = gcp_bill("--cloud", "gcp", "-o", "json")
    assert r.code == 0, r.err
    [gcp] = json.loads(r.out)["clouds"]
    assert gcp["through"] == "2026-11-04"
    usd = lambda a: Money(Decimal(a), "USD").as_json()  # noqa: E731  (JSON: exact text)
    lines = {ln["key"]: ln for ln in gcp["lines"]}
    a = lines["gpu-a"]
    # billed 2 × 88.16136 + 2 × 0.12 − 8.00 = 168.56272; ledger 48 × 3.67339 = 176.32272
    assert (a["billed"], a["ledger"], a["difference"]) == (
        usd("168.56"),
        usd("176.32"),
        usd("-7.76"),
    )
    assert a["reasons"] == {"credit": usd("-8.00"), "unpriced": usd("0.24")}
    b = lines["gpu-b"]
    # billed 96.00; ledger 84 h × 1.80385 = 151.5234, shown 151.53 so that the ledger's lines
    # add up to its total (176.32272 + 151.5234 = 327.84612 → 327.85); on billed days 48 h:
    # 86.5848, so drift 9.4152 and not billed yet 64.9386, shares of −55.53
    assert (b["billed"], b["ledger"]) == (usd("96.00"), usd("151.53"))
    assert b["reasons"] == {"drift": usd("9.41"), "not_billed_yet": usd("-64.94")}
    u = lines["(untagged)"]
    assert u["reasons"] == {"tax": usd("9.00"), "untagged": usd("1.50")}
    # October's row is outside the period: 168.56272 + 96 + 10.50 = 275.06272
    assert gcp["totals"]["USD"]["billed"] == usd("275.06")
    [drift] = gcp["drift"]
    assert (drift["machine"], drift["market"], drift["pct"]) == ("gpu-b", "spot", "10.9")
    assert drift["billed"] == usd("2.0000") and drift["catalog"] == usd("1.80385")


def test_gcp_bill_without_its_export_table_says_what_to_set(home: Path, cli) -> None:
    cfg = write_settings(home, clouds={"gcp": {"project": "p", "anonymous": True}})
    r = cli("--config", str(cfg), "bill", "--cloud", "gcp")
    assert r.code == 2, r.out
    assert "clouds.gcp.billing_table" in r.err


# --- Azure -----------------------------------------------------------------------------------

NC4 = Decimal("0.526")  # Standard_NC4as_T4_v3 in eastus, the shipped catalog's price


@pytest.fixture
def azure_bill(home: Path, cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """vm-a  Standard_NC4as_T4_v3 at 0.526/h, Nov 2 00:00 → Nov 4 00:00, billed at that price,
          with its public IP (Virtual Network, 0.12 a day) and a 2.00 USD refund;
    vm-b  the same type from Nov 3 00:00, running; billed Nov 3–4 at 0.5523/h (5 % over);
    and an untagged VM's 0.50. The ARM emulator over TLS signs the CLI in as a service
    principal (azure-identity's EnvironmentCredential), as tests/test_azure.py does."""
    import sys

    from tests.contract.azure import scrub_credentials
    from tests.emulators.azure import CLIENT_ID, CLIENT_SECRET, TENANT, AzureEmulator
    from tests.emulators.azure_cost import record
    from tests.emulators.tls import self_signed_localhost

    cert, key = self_signed_localhost()
    ca = tmp_path / "emulator-ca.pem"
    ca.write_bytes(cert)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scrub_credentials(monkeypatch, bin_dir)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}")
    env = {
        "AZURE_CLIENT_ID": CLIENT_ID,
        "AZURE_CLIENT_SECRET": CLIENT_SECRET,
        "AZURE_TENANT_ID": TENANT,
        "REQUESTS_CA_BUNDLE": str(ca),
    }
    with AzureEmulator(tls=(cert, key)) as emu:
        for k, v in {**env, "AZURE_AUTHORITY_HOST": emu.base_url}.items():
            monkeypatch.setenv(k, v)
        d = lambda n: date(2026, 11, n)  # noqa: E731
        emu.cost_records = [
            record(d(2), "12.624", "Virtual Machines", "za"),
            record(d(3), "12.624", "Virtual Machines", "za"),
            record(d(2), "0.12", "Virtual Network", "za"),
            record(d(3), "0.12", "Virtual Network", "za"),
            record(d(3), "-2.00", "Virtual Machines", "za", charge="Refund"),
            record(d(3), "13.2552", "Virtual Machines", "zb"),
            record(d(4), "13.2552", "Virtual Machines", "zb"),
            record(d(4), "0.50", "Virtual Machines"),
            record(date(2026, 10, 31), "99", "Virtual Machines", "za"),  # outside the period
        ]
        options = {
            "subscription_id": emu.subscription_id,
            "endpoint": emu.base_url,
            "regions": ["eastus"],
            "disable_instance_discovery": True,
            "retry_base_seconds": 0.001,
        }
        app = App(make_settings(home, clouds={"azure": options}), ManualClock(NOW))
        seed(
            app,
            "azure",
            [
                ("za", "vm-a", "Standard_NC4as_T4_v3", NC4, T(2), T(4)),
                ("zb", "vm-b", "Standard_NC4as_T4_v3", NC4, T(3), None),
            ],
        )
        app.close()
        monkeypatch.setenv(CLOCK_ENV, NOW.isoformat())
        cfg = write_settings(home, clouds={"azure": options})
        yield emu, lambda *args: cli("--config", str(cfg), "bill", "--period", "2026-11", *args)


def test_azure_bill_from_cost_management(azure_bill) -> None:
    emu, run = azure_bill
    r = run("--cloud", "azure", "-o", "json")
    assert r.code == 0, r.err
    [az] = json.loads(r.out)["clouds"]
    assert az["through"] == "2026-11-04"
    usd = lambda a: Money(Decimal(a), "USD").as_json()  # noqa: E731  (JSON: exact text)
    lines = {ln["key"]: ln for ln in az["lines"]}
    a = lines["vm-a"]
    # billed 2 × 12.624 + 2 × 0.12 − 2.00 = 23.488; ledger 48 × 0.526 = 25.248
    assert (a["billed"], a["ledger"], a["difference"]) == (usd("23.49"), usd("25.25"), usd("-1.76"))
    assert a["reasons"] == {"credit": usd("-2.00"), "unpriced": usd("0.24")}
    b = lines["vm-b"]
    # billed 26.5104; ledger 84 h × 0.526 = 44.184; on billed days 48 h: 25.248
    assert (b["billed"], b["ledger"]) == (usd("26.51"), usd("44.18"))
    assert b["reasons"] == {"drift": usd("1.26"), "not_billed_yet": usd("-18.93")}
    assert lines["(untagged)"]["reasons"] == {"untagged": usd("0.50")}
    [drift] = az["drift"]
    assert (drift["machine"], drift["pct"]) == ("vm-b", "5.0")
    # the two queries Cost Management was asked: usage by meter category, the rest by charge
    asked = [q.body for q in emu.requests if q.path.lower().endswith("costmanagement/query")]
    assert [q["dataset"]["grouping"][1]["name"] for q in asked] == ["MeterCategory", "ChargeType"]
    assert asked[0]["timePeriod"] == {
        "from": "2026-11-01T00:00:00+00:00",
        "to": "2026-11-06T23:59:59+00:00",  # up to today: later days cannot be billed yet
    }


# --- what else shows it ----------------------------------------------------------------------


def test_dashboard_spend_page_shows_the_last_bill_beside_the_ledger(
    aws_bill, home: Path, db_url
) -> None:
    import io
    from wsgiref.util import setup_testing_defaults

    from provisioner.dashboard import make_app

    settings = make_settings(home, clouds={"aws": {"regions": ["us-east-1"]}}, state_url=db_url)
    app = App(settings, ManualClock(NOW))
    try:
        wsgi = make_app(app, listen="127.0.0.1:8765")

        def spend_page() -> str:
            env: dict = {"REQUEST_METHOD": "GET", "PATH_INFO": "/spend", "QUERY_STRING": ""}
            setup_testing_defaults(env)
            env["wsgi.input"] = io.BytesIO(b"")
            got: dict = {}
            body = b"".join(wsgi(env, lambda s, h, e=None: got.update(status=s)))
            assert got["status"].startswith("200")
            return body.decode()

        assert "billed by the cloud" not in spend_page()  # `bill` never ran: nothing claimed
        assert aws_bill().code == 0
        wsgi = make_app(app, listen="127.0.0.1:8765")  # a new app: no cached page
        html = spend_page()
        assert "billed by the cloud (aws, through 2026-11-04)" in html
        assert "190.81 USD" in html and "ledger 294.91 USD" in html
    finally:
        app.close()


def test_check_says_the_tag_must_be_a_cost_allocation_tag(emu: AwsEmulator, home: Path, cli):
    cfg = write_settings(home, clouds={"aws": {"endpoint": emu.endpoint_url}})
    r = cli("--config", str(cfg), "check")
    assert r.out.startswith("ok") and len(r.out.splitlines()) == 2  # aws, sandbox: one line each
    said = " ".join(r.err.split())
    assert "'provisioner-machine' must be activated as a cost allocation tag" in said


# --- rounding ----------------------------------------------------------------------------------


@given(
    st.lists(
        st.tuples(*[st.decimals(-1000, 1000, places=6, allow_nan=False, allow_infinity=False)] * 6),
        min_size=1,
        max_size=8,
    )
)
def test_rounded_lines_add_up_and_reasons_add_up_to_each_difference(raw) -> None:
    """Whatever the amounts: the shown lines add up to the shown totals, which are the exact
    totals rounded, and each line's shown reasons add up to its shown difference."""
    lines = []
    for n, (ledger_on_billed, ledger_later, tax, credit, unpriced, usage) in enumerate(raw):
        ln = Line(f"m{n}", "USD")
        ln.ledger = abs(ledger_on_billed) + abs(ledger_later)
        ln.billed = tax + credit + unpriced + usage
        ln.reasons.update(
            tax=tax,
            credit=credit,
            unpriced=unpriced,
            drift=usage - abs(ledger_on_billed),
            not_billed_yet=-abs(ledger_later),
        )
        lines.append(ln)
    rows = rounded(lines)
    cents = lambda d: d.quantize(CENT, ROUND_HALF_UP)  # noqa: E731
    t = totals(rows)["USD"]
    assert t["billed"] == Money(cents(sum((ln.billed for ln in lines), Decimal(0))), "USD")
    assert t["ledger"] == Money(cents(sum((ln.ledger for ln in lines), Decimal(0))), "USD")
    for r in rows:
        assert sum(r["reasons"].values(), Money.zero("USD")) == r["difference"]


# --- Yandex ----------------------------------------------------------------------------------


def test_yandex_bill_from_the_label_usage_report(home: Path, cli, monkeypatch) -> None:
    """yc-a at 100 RUB/h, Nov 2 00:00 → Nov 4 00:00 (4,800 RUB in the ledger); the Billing usage
    API has 2,400 for Nov 2 and 2,450 with a 100 credit for Nov 3 under its label (its VM, disk
    and address in one sum), and an unlabelled resource it cannot show per label."""
    from tests.contract.yandex import running_emulator, tls_material, yc_env
    from tests.emulators.yandex_billing import BILLING_ACCOUNT, record

    yc_env(monkeypatch)
    with running_emulator() as emu:
        ours = {"provisioner-machine": "ya", "managed-by": "provisioner"}
        emu.usage_records = [
            record(date(2026, 10, 31), "999", ours),  # before the period
            record(date(2026, 11, 2), "2400", ours),
            record(date(2026, 11, 3), "2450", ours, credit="-100"),
            record(date(2026, 11, 3), "77", {}),  # no label: not in the label report
        ]
        options = {
            "folder_id": "b1gfolder00000000000",
            "endpoint": emu.endpoint,
            "root_certificates_file": str(tls_material()[2]),
            "billing_account_id": BILLING_ACCOUNT,
        }
        app = App(make_settings(home, clouds={"yandex": options}), ManualClock(NOW))
        seed(app, "yandex", [("ya", "yc-a", "gpu-standard-v3", Decimal(100), T(2), T(4))])
        app.close()
        monkeypatch.setenv(CLOCK_ENV, NOW.isoformat())
        cfg = write_settings(home, clouds={"yandex": options})
        r = cli(
            "--config", str(cfg), "bill", "--period", "2026-11", "--cloud", "yandex", "-o", "json"
        )
        asked = [c.request for c in emu.requests if c.method.endswith("GetLabelKeyUsageReport")]
    assert r.code == 0, r.err
    [yc] = json.loads(r.out)["clouds"]
    rub = lambda a: Money(Decimal(a), "RUB").as_json()  # noqa: E731  (JSON: exact text)
    [line] = yc["lines"]
    assert line["key"] == "yc-a"
    assert (line["billed"], line["ledger"]) == (rub("4750.00"), rub("4800.00"))
    assert line["reasons"] == {"credit": rub("-100.00"), "drift": rub("50.00")}
    assert yc["through"] == "2026-11-03"
    assert "nothing for unlabelled usage" in " ".join(yc["notes"])
    [req] = asked
    assert req.end_date.ToDatetime().date() == date(2026, 11, 6)  # inclusive: up to today


# --- SberCloud ---------------------------------------------------------------------------------


@pytest.fixture
def sber_bill(home: Path, cli, monkeypatch: pytest.MonkeyPatch):
    """sb-a at 100 RUB/h, server srv-a, Nov 2 00:00 → Nov 4 00:00 (4,800 RUB in the ledger);
    sb-b at 50 RUB/h, server srv-b, Nov 5 12:00 → Nov 6 06:00 (900 RUB in the ledger).
    The BSS fee records, by day: srv-a 2,400 on Nov 2 and 2,500 less a 100 discount and 30 paid
    by a voucher on Nov 3; srv-b 600 on Nov 5 and 250 so far on Nov 6 (today: inside the lag);
    an EIP of srv-a (its own resource id, 40) and a server not ours (77); and one of October."""
    from tests.contract.sbercloud import AK, SK, sber_env
    from tests.contract.sbercloud import options as sber_options
    from tests.emulators.sbercloud import EcsEmulator
    from tests.emulators.sbercloud_billing import DOMAIN_ID, fee_record

    sber_env(monkeypatch)
    emu = EcsEmulator(AK, SK).start()
    emu.fee_records = [
        fee_record("2026-10-31", "srv-a", "999"),
        fee_record("2026-11-02", "srv-a", "2400"),
        fee_record("2026-11-03", "srv-a", "2500", discount="100", coupon="30"),
        fee_record("2026-11-05", "srv-b", "600"),
        fee_record("2026-11-06", "srv-b", "250"),
        fee_record("2026-11-03", "eip-a", "40", resource_type="hws.resource.type.ip"),
        fee_record("2026-11-03", "srv-x", "77"),
    ]
    opts = {**sber_options(emu), "bss_endpoint": emu.endpoint, "domain_id": DOMAIN_ID}
    app = App(make_settings(home, clouds={"sbercloud": opts}), ManualClock(NOW))
    seed(
        app,
        "sbercloud",
        [
            ("sa", "sb-a", "g6.xlarge.2", Decimal(100), T(2), T(4)),
            ("sb", "sb-b", "g6.xlarge.2", Decimal(50), T(5, 12), T(6, 6)),
        ],
    )
    with app.db.session() as s:
        for mid, server in (("sa", "srv-a"), ("sb", "srv-b")):
            s.get(Machine, mid).instance_id = server  # type: ignore[union-attr]
    app.close()
    monkeypatch.setenv(CLOCK_ENV, NOW.isoformat())
    cfg = write_settings(home, clouds={"sbercloud": opts})
    yield emu, cfg, opts
    emu.stop()


def test_sbercloud_bill_from_the_bss_fee_records(sber_bill, cli) -> None:
    emu, cfg, _ = sber_bill
    r = cli(
        "--config", str(cfg), "bill", "--period", "2026-11", "--cloud", "sbercloud", "-o", "json"
    )
    assert r.code == 0, r.err
    [sc] = json.loads(r.out)["clouds"]
    rub = lambda a: Money(Decimal(a), "RUB").as_json()  # noqa: E731  (JSON: exact text)
    lines = {ln["key"]: ln for ln in sc["lines"]}
    assert set(lines) == {"sb-a", "sb-b", "(untagged)"}
    a, b, untagged = lines["sb-a"], lines["sb-b"], lines["(untagged)"]
    # 2,400 + 2,500 − 100 − 30 = 4,770 billed; the ledger's 48 h at 100 = 4,800
    assert (a["billed"], a["ledger"]) == (rub("4770.00"), rub("4800.00"))
    # the discount and the voucher are credits; the list price was 100 over the ledger's
    assert a["reasons"] == {"credit": rub("-130.00"), "drift": rub("100.00")}
    # Nov 6 is inside the one-day lag: what is billed of it so far is not the whole day
    assert (b["billed"], b["ledger"]) == (rub("850.00"), rub("900.00"))
    assert b["reasons"] == {"not_billed_yet": rub("-50.00")}
    assert untagged["billed"] == rub("117.00") and untagged["reasons"] == {
        "untagged": rub("117.00")
    }
    assert sc["through"] == "2026-11-05"
    asked = emu.received("GET", r"^/v2/bills/customer-bills/res-fee-records$")
    assert [q.query["cycle"] for q in asked] == ["2026-11"]
    assert asked[0].query["statistic_type"] == "2"
    assert asked[0].headers.get("X-Domain-Id")
    assert "server id" in " ".join(sc["notes"])


def test_sbercloud_bill_by_day_reads_every_page(sber_bill, cli) -> None:
    """120 more records of somebody else's on Nov 4, 1 RUB each: two pages of 100."""
    from tests.emulators.sbercloud_billing import fee_record

    emu, cfg, _ = sber_bill
    emu.fee_records += [fee_record("2026-11-04", f"srv-y{i}", "1") for i in range(120)]
    r = cli(
        "--config", str(cfg), "bill", "--period", "2026-11", "--cloud", "sbercloud",
        "--by", "day", "-o", "json",
    )  # fmt: skip
    assert r.code == 0, r.err
    lines = {ln["key"]: ln for ln in json.loads(r.out)["clouds"][0]["lines"]}
    assert lines["2026-11-04"]["billed"] == {"amount": "120", "currency": "RUB"}
    assert lines["2026-11-04"]["reasons"] == {"untagged": {"amount": "120", "currency": "RUB"}}
    assert "2026-10-31" not in lines
    asked = emu.received("GET", r"^/v2/bills/customer-bills/res-fee-records$")
    assert [q.query["offset"] for q in asked] == ["0", "100"]


def test_sbercloud_bill_without_the_bss_endpoint_says_what_to_set(sber_bill, cli, home) -> None:
    emu, _, opts = sber_bill
    cfg = write_settings(
        home, clouds={"sbercloud": {k: v for k, v in opts.items() if k != "bss_endpoint"}}
    )
    r = cli("--config", str(cfg), "bill", "--cloud", "sbercloud")
    assert r.code == 2
    assert "clouds.sbercloud.bss_endpoint" in r.err and "Traceback" not in r.err
    assert not emu.received("GET", "res-fee-records")


def test_sbercloud_bill_finds_the_account_in_iam_and_rides_out_throttling(
    sber_bill, cli, home, monkeypatch
):
    """Without ``domain_id`` the SDK asks IAM for the account; a throttled call is retried."""
    from huaweicloudsdkcore.auth.credentials import GlobalCredentials

    from tests.emulators.sbercloud_billing import DOMAIN_ID

    emu, _, opts = sber_bill
    # the SDK keeps looked-up domain ids per AK for the process: start without one
    monkeypatch.setattr(GlobalCredentials, "_CACHE", {})
    cfg = write_settings(home, clouds={"sbercloud": {**opts, "domain_id": None}})
    emu.throttle(1)
    r = cli("--config", str(cfg), "bill", "--period", "2026-11", "--cloud", "sbercloud")
    assert r.code == 0, r.err
    assert "sb-a" in r.out and "RUB" in r.out
    # the lookup was throttled once and asked again; every BSS call names the account
    assert [q.status for q in emu.received("GET", r"^/v3/auth/domains$")] == [429, 200]
    asked = emu.received("GET", r"^/v2/bills/customer-bills/res-fee-records$")
    assert asked and all(q.headers.get("X-Domain-Id") == DOMAIN_ID for q in asked)


def test_sbercloud_asks_month_by_month() -> None:
    """BSS takes bill dates within one ``cycle`` month only: a period across months is split."""
    from providers.sbercloud.billing import _months

    assert _months(date(2026, 10, 30), date(2026, 12, 2)) == [
        (date(2026, 10, 30), date(2026, 10, 31)),
        (date(2026, 11, 1), date(2026, 11, 30)),
        (date(2026, 12, 1), date(2026, 12, 1)),
    ]
    assert _months(date(2026, 11, 1), date(2026, 12, 1)) == [
        (date(2026, 11, 1), date(2026, 11, 30))
    ]


def test_aws_record_types_are_classed_by_their_documented_meaning() -> None:
    """RI- and Savings-Plan-covered usage is usage, read per machine with the usage types, not
    a "discount" because its name holds the word; fees of commitments are not priced here."""
    from providers.aws.billing import USAGE_RECORD_TYPES, record_kind

    assert {"Usage", "DiscountedUsage", "SavingsPlanCoveredUsage"} == set(USAGE_RECORD_TYPES)
    assert record_kind("Tax") == "tax"
    assert record_kind("Credit") == record_kind("Refund") == "credit"
    for discount in ("SavingsPlanNegation", "BundledDiscount", "EdpDiscount", "Bundled Discount",
                     "Enterprise Discount Program Discount"):  # fmt: skip
        assert record_kind(discount) == "discount", discount
    for other in ("RIFee", "SavingsPlanRecurringFee", "SavingsPlanUpfrontFee", "Fee", "Support",
                  "Discounted something new"):  # fmt: skip
        assert record_kind(other) == "other", other


def test_bill_of_every_cloud_skips_those_without_credentials_one_line_each(
    aws_bill, home: Path, cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With AWS, Azure and GCP (an export table named) enabled but no credentials for the two,
    enabled, `bill` reads AWS's and says in one line each why the other two were skipped."""
    import yaml

    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.delenv("AZURE_SUBSCRIPTION_ID", raising=False)
    monkeypatch.setenv("HOME", str(home))  # no gcloud application-default credentials
    cfg = home.parent / "settings.yaml"
    data = yaml.safe_load(cfg.read_text())
    data["clouds"]["azure"] = {"regions": ["eastus"]}
    data["clouds"]["gcp"] = {"project": "p", "billing_table": "p.billing.gcp_billing_export_v1_X"}
    cfg.write_text(yaml.safe_dump(data))
    r = cli("--config", str(cfg), "bill", "--period", "2026-11")
    assert r.code == 0, r.err
    skipped = [ln for ln in r.out.splitlines() if "skipped, no credentials" in ln]
    assert sorted(ln.split(":")[0] for ln in skipped) == ["azure", "gcp"], r.out
    assert all("no credentials found" in ln for ln in skipped)
    assert "train-a" in r.out  # AWS's bill was read and reconciled all the same
    # named, a cloud without credentials is the user's to fix: one line, exit 2
    named = cli("--config", str(cfg), "bill", "--period", "2026-11", "--cloud", "azure")
    assert named.code == 2 and "no credentials found" in named.err, named.err
    assert len(named.err.strip().splitlines()) == 1


def test_gcp_bill_reads_only_the_partitions_from_the_period_on(gcp_bill, home: Path) -> None:
    """BigQuery bills by the bytes a query reads: the export's older partitions (the year's
    rows before November) are not read; a correction exported days later still is."""
    emu = gcp_bill.emu
    older = [export_row(d, "A2 Instance Core running in Americas", "5", "ga", month=m)
             for m in range(1, 10) for d in (1, 15)]  # fmt: skip
    late = export_row(3, "A2 Instance Core running in Americas", "-1.50", "ga")
    late["export_time"] = datetime(2026, 11, 6, 9, tzinfo=UTC)  # three days after its usage
    emu.tables[TABLE] = older + emu.tables[TABLE] + [late]
    before = len(emu.tables[TABLE])
    r = gcp_bill("-o", "json")
    assert r.code == 0, r.err
    read = emu.rows_read[-1]
    # nothing of January..September was read; the October row (its partition Oct 31, the day
    # before the period) and the late correction (exported three days on) were
    assert read == before - len(older)
