"""What a cloud bills at a rate the catalog does not know (Azure's managed disks, priced per
size tier; GCP's, Yandex's and SberCloud's public IPv4) is said as "not priced" in `status`,
`report` (text, JSON, Russian) — never passed off as a zero."""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal

from sqlalchemy import insert

from provisioner.app import App
from provisioner.models import Machine, Volume
from tests.conftest import TEST_START, make_settings, run_cli, write_settings


def _machine(i: int, cloud: str, **kw: object) -> dict:
    return {
        "id": f"m{i}",
        "name": f"exp-{i}",
        "project": "nlp",
        "owner": "ana@example.com",
        "status": "stopped",
        "spec": {},
        "cloud": cloud,
        "gpu": "A100",
        "gpu_count": 8,
        "rate": Decimal("27.197"),
        "currency": "USD",
        "disk_gb": 200,
        "market": "spot",
        "created_at": TEST_START - timedelta(hours=2),
        "launched_at": TEST_START - timedelta(hours=2),
        "terminated_at": None,
        "disk_rate": None,
        "address_rate": None,
        "address_billed": None,
        **kw,
    }


def _seed(home) -> None:
    write_settings(home)
    app = App(make_settings(home))
    rows = [
        # Azure: the boot disk's rate is unknown (priced per size tier), the address is known
        _machine(1, "azure", address_rate=Decimal("0.005"), address_billed="held"),
        # GCP: the disk is priced, the external IPv4 bills while it runs at an unknown rate
        _machine(2, "gcp", disk_rate=Decimal("0.0274"), address_billed="running"),
        # priced whole: nothing to say
        _machine(
            3,
            "aws",
            disk_rate=Decimal("0.0219"),
            address_rate=Decimal("0.005"),
            address_billed="running",
        ),
        # no public address at all: nothing billed for one
        _machine(4, "gcp", disk_rate=Decimal("0.0274"), address_billed="none"),
        # ended before the period: not in it
        _machine(
            5,
            "azure",
            status="terminated",
            created_at=TEST_START - timedelta(days=90),
            terminated_at=TEST_START - timedelta(days=80),
        ),
        # a volume's ledger row (as provisioner.machines.volumes writes it): no machine
        _machine(
            6,
            "azure",
            id="v1",
            name="volume:data",
            status="terminated",
            market="volume",
            rate=None,
            gpu=None,
            gpu_count=None,
            disk_gb=500,
        ),
    ]
    with app.db.engine.begin() as conn:
        conn.execute(insert(Machine.__table__), rows)
        conn.execute(
            insert(Volume.__table__),
            [
                {
                    "id": "v1",
                    "project": "nlp",
                    "name": "data",
                    "owner": "ana@example.com",
                    "cloud": "azure",
                    "region": "eastus",
                    "zone": "1",
                    "size_gb": 500,
                    "token": "t",
                    "volume_id": "/subscriptions/x/disks/data",
                    "status": "available",
                    "rate": None,
                    "currency": "USD",
                    "created_at": TEST_START - timedelta(days=1),
                    "deleted_at": None,
                    "attached_machine_id": None,
                }
            ],
        )
    app.db.dispose()


def test_status_says_which_billed_pieces_are_not_priced(home):
    _seed(home)
    azure = run_cli("status", "exp-1", "--no-refresh")
    assert azure.returncode == 0, azure.stderr
    assert "boot disk not priced" in azure.stdout and "public IPv4 not priced" not in azure.stdout
    gcp = run_cli("status", "exp-2", "--no-refresh")
    assert "public IPv4 not priced" in gcp.stdout and "boot disk not priced" not in gcp.stdout
    for whole in ("exp-3", "exp-4"):
        assert "not priced" not in run_cli("status", whole, "--no-refresh").stdout
    listed = json.loads(run_cli("status", "--no-refresh", "-o", "json").stdout)
    by_name = {m["name"]: m["not_priced"] for m in listed}
    assert by_name["exp-1"] == ["boot disk"] and by_name["exp-2"] == ["public IPv4"]
    assert by_name["exp-3"] == [] and by_name["exp-4"] == []


def test_report_lists_what_it_holds_at_no_price(home):
    _seed(home)
    r = run_cli("report", "--period", "2026-11", "-o", "json")
    assert r.returncode == 0, r.stderr
    got = {
        (u["piece"], u["cloud"]): (u["count"], u["setting"])
        for u in json.loads(r.stdout)["unpriced"]
    }
    assert got == {
        ("boot disk", "azure"): (1, "disk_prices.azure"),
        ("public IPv4", "gcp"): (1, "address_prices.gcp"),
        ("volume", "azure"): (1, "disk_prices.azure"),
    }
    text = run_cli("report", "--period", "2026-11").stdout
    assert "Not priced (the cloud bills it; counted here at 0)" in text
    assert "1 × boot disk on azure: set disk_prices.azure to count it" in text
    ru = run_cli("report", "--period", "2026-11", "--language", "ru").stdout
    assert "Без цены" in ru and "загрузочный диск в azure" in ru
    # a scope the pieces are not in: nothing said; the cloud's own scope: only its pieces
    other = json.loads(
        run_cli("report", "--period", "2026-11", "--owner", "bo@*", "-o", "json").stdout
    )
    assert other["unpriced"] == []
    gcp = json.loads(
        run_cli("report", "--period", "2026-11", "--cloud", "gcp", "-o", "json").stdout
    )
    assert [(u["piece"], u["cloud"]) for u in gcp["unpriced"]] == [("public IPv4", "gcp")]


def test_plan_says_a_boot_disk_and_an_address_are_billed_at_rates_not_known(home, tmp_path):
    from tests.conftest import sandbox_experiment, write_yaml

    cfg = write_settings(
        home, clouds={"azure": {"regions": ["eastus"]}, "gcp": {"regions": ["us-central1"]}}
    )
    spec = write_yaml(
        tmp_path / "t.yaml", sandbox_experiment("big", gpu="A100:8", clouds=["azure", "gcp"])
    )
    r = run_cli("--config", str(cfg), "plan", str(spec), "-o", "json")
    assert r.returncode == 0, r.stderr
    lines = json.loads(r.stdout)["addresses"]
    assert any(
        ln.startswith("azure boot disk billed") and "disk_prices.azure" in ln for ln in lines
    )
    assert any(ln.startswith("gcp billed while it runs, at a rate not known") for ln in lines)
    assert not any(ln.startswith("gcp boot disk") for ln in lines)  # priced: a cited rate
