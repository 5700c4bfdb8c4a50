"""The catalog's price checks (what each one catches in the shipped data), the date on every
row and the warning when the rows a command uses are old, and catalog files that are not
catalogs: one line naming the file and line, exit code 2."""

from __future__ import annotations

import csv
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path

import pytest

from provisioner import catalog, catalog_checks
from tests.conftest import ROOT, run_cli, write_settings, write_yaml

DATA = ROOT / "provisioner" / "data" / "catalog"
CLOUDS = ("aws", "gcp", "azure", "yandex", "sbercloud", "sandbox")


def _rows(cloud: str) -> list[dict[str, str]]:
    with (DATA / f"{cloud}.csv").open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _emptied() -> list[dict[str, str]]:
    with (DATA / "checks.csv").open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _as_built(cloud: str) -> list[dict[str, str]]:
    """The cloud's rows as the source had them: the shipped rows with every value the build
    emptied (checks.csv: file, line, field, value) put back."""
    rows = _rows(cloud)
    for e in _emptied():
        if e["file"] == f"{cloud}.csv":
            row = rows[int(e["line"]) - 2]
            assert row[e["field"]] == "" and row["instance_type"] == e["instance_type"]
            row[e["field"]] = e["value"]
    return rows


def test_the_checks_flag_exactly_what_the_build_emptied():
    """Put the emptied values back and the checks find each of them again, and nothing else:
    checks.csv is what the checks say of the source, not a hand-kept list."""
    for cloud in CLOUDS:
        found = catalog_checks.check(_as_built(cloud), f"{cloud}.csv")
        listed = [e for e in _emptied() if e["file"] == f"{cloud}.csv"]
        assert [(f.line, f.check, f.field, f.reason) for f in found] == [
            (int(e["line"]), e["check"], e["field"], e["reason"]) for e in listed
        ], cloud


def test_each_known_case_is_caught_by_its_check():
    by = {}
    for cloud in CLOUDS:
        for f in catalog_checks.check(_as_built(cloud), f"{cloud}.csv"):
            by.setdefault((f.check, cloud), []).append(f)
    # GCP H200: 6 of 9 on-demand rows ~42 % below the other 3; a median cannot see it (the
    # low rows are the majority), the per-GPU band does.
    h200 = [f for f in by[("band", "gcp")] if f.row["gpu"] == "H200"]
    assert len(h200) == 6 and all(Decimal(f.row["price"]) < 52 for f in h200)
    assert "tanod/cloud-gpu-list-prices" in h200[0].reason
    kept = {r["zone"]: r["price"] for r in _rows("gcp") if r["instance_type"] == "a3-ultragpu-8g"}
    assert kept["us-central1-b"] == "86.75992" and kept["europe-west1-b"] == ""
    # 29 AWS spot prices equal to on-demand (p5.48xlarge us-east-1 55.04 = 55.04), dropped
    aws_spot = by[("spot", "aws")]
    equal = [f for f in aws_spot if f.row["spot_price"] == f.row["price"]]
    assert len(equal) == 29
    assert any(
        f.row["instance_type"] == "p5.48xlarge"
        and f.row["region"] == "us-east-1"
        and f.row["spot_price"] == "55.04"
        for f in equal
    )
    shipped = _rows("aws")
    assert all(shipped[f.line - 2]["spot_price"] == "" for f in equal)  # dropped
    # committed-use-like GCP H100 prices at ~47 % of the median of the type's 14 regions
    assert any("of its 14 regions" in f.reason for f in by[("outlier", "gcp")])
    # a finding says where: file, line, cloud/zone and type, field and value, and why
    line = str(h200[0])
    assert line.startswith("gcp.csv:") and "a3-ultragpu-8g: price " in line and "band" in line


def test_band_catches_a_wrong_price_most_regions_share_and_the_median_cannot():
    def row(region: str, price: str) -> dict[str, str]:
        return dict(
            cloud="gcp", region=region, zone=f"{region}-a", instance_type="a3-ultragpu-8g",
            gpu="H200", gpu_count="8", price=price, spot_price="", currency="USD",
        )  # fmt: skip

    rows = [row(f"r{i}", "50") for i in range(6)] + [row(f"h{i}", "86.76") for i in range(3)]
    found = catalog_checks.check(rows, "x.csv")
    assert [(f.check, f.line) for f in found] == [("band", i + 2) for i in range(6)]
    # without the band (an unknown GPU), the median check sees nothing wrong
    for r in rows:
        r["gpu"] = "NEW-GPU"
    assert catalog_checks.check(rows, "x.csv") == []


def test_spot_must_be_materially_below_on_demand():
    rows = [
        dict(
            cloud="aws",
            region=r,
            zone="",
            instance_type="p4d.24xlarge",
            gpu="A100",
            gpu_count="8",
            price="19.97951",
            spot_price=s,
            currency="USD",
        )
        # equal; above; the source's 4-decimal rounding of the same price; 4 % off; 5 % off
        for r, s in (
            ("a", "19.97951"),
            ("b", "21"),
            ("c", "19.9795"),
            ("d", "19.18"),
            ("e", "18.98"),
        )
    ]
    found = catalog_checks.check(rows)
    assert [(f.line, f.field) for f in found] == [(i, "spot_price") for i in (2, 3, 4, 5)]
    assert "equal to the on-demand price 19.97951" in found[0].reason
    assert found[1].reason.startswith("above")
    assert found[2].reason.startswith("0.00% below the on-demand price 19.97951: less than 5% off")
    assert found[3].reason.startswith("4.00% below")


def test_no_shipped_spot_price_is_within_the_tolerance_of_on_demand():
    """What `plan` may choose as spot is at least 5 % below on-demand on every cloud."""
    for cloud in CLOUDS:
        for r in _rows(cloud):
            if r["price"] and r["spot_price"]:
                price, spot = Decimal(r["price"]), Decimal(r["spot_price"])
                assert spot <= price * (1 - catalog_checks.SPOT_MIN_DISCOUNT), (cloud, r)


def test_gcp_spot_only_types_match_the_gcp_shapes():
    from providers.gcp.prices import SHAPES

    spot_only = {s.instance_type for s in SHAPES if s.spot_only}
    assert spot_only == catalog_checks.GCP_SPOT_ONLY


def test_every_priced_row_carries_its_date():
    undated = []
    for cloud in ("aws", "gcp", "azure", "yandex"):
        for r in _rows(cloud):
            if r["price"] or r["spot_price"]:
                if not r["as_of"]:
                    undated.append((cloud, r["instance_type"]))
                else:
                    assert date.fromisoformat(r["as_of"])
    assert undated == []
    # Yandex T4i: its rate file (rub-instance-resources.md @0a247371) is undated, but its prices
    # include 20 % VAT, which ended 2026-01-01: dated the latest it can be, so stale
    t4i = [r for r in _rows("yandex") if r["instance_type"].startswith("standard-v3-t4i/")]
    assert t4i and {r["as_of"] for r in t4i} == {"2025-12-31"}


def test_yandex_2022_rates_are_rebased_to_22_percent_vat_and_keep_their_old_date():
    a100 = {r["instance_type"]: r for r in _rows("yandex")}["gpu-standard-v3/1g-28c-119gb"]
    # 371.70 + 28 × 0.90 + 119 × 0.28 = 430.22 with 20 % VAT → ÷ 1.20 × 1.22
    assert a100["price"] == "437.39" and a100["as_of"] == "2022-04-13"
    assert "22% VAT" in a100["source"] and "not current" in a100["source"]
    gen2 = {r["instance_type"]: r for r in _rows("yandex")}["gpu-standard-v3i/1g-18c-144gb"]
    assert gen2["price"] == "801.73" and gen2["as_of"] == "2026-01-23"  # already 22 %


def test_stale_rows_are_named_per_cloud_and_fresh_ones_are_not(settings):
    offers = catalog.load(settings, ["aws", "yandex", "sandbox"])
    lines = catalog_checks.stale(offers, date(2026, 12, 3))
    assert len(lines) == 1 and lines[0].startswith("yandex: ")
    assert "as of 2022-04-13" in lines[0] and "catalog refresh --cloud yandex" in lines[0]
    # the AWS rows of 2026-11-30 are 91 days old
    later = catalog_checks.stale(offers, date(2027, 3, 1))
    assert [x.split(":")[0] for x in later] == ["aws", "yandex"]
    assert catalog_checks.stale(offers, date(2027, 2, 28))[0].startswith("yandex")  # 90 days: fresh


NOW = datetime(2026, 12, 3, 9, 0, tzinfo=UTC)


def _experiment(home: Path, gpu: str, clouds: list[str]) -> Path:
    return write_yaml(
        home.parent / "exp.yaml",
        {"name": "exp", "project": "p", "owner": "a@example.com",
         "resources": {"gpu": gpu, "clouds": clouds}},
    )  # fmt: skip


def test_plan_and_catalog_warn_of_old_rows_and_name_refresh(home):
    cfg = write_settings(home, clouds={"yandex": {}, "aws": {}})
    r = run_cli("--config", str(cfg), "plan", str(_experiment(home, "V100:1", ["yandex"])), now=NOW)
    assert r.returncode == 0, r.stderr
    assert "yandex: catalog rows used: " in r.stdout and "as of 2022-04-13" in r.stdout
    assert "provisioner catalog refresh --cloud yandex" in r.stdout
    r = run_cli("--config", str(cfg), "plan", str(_experiment(home, "V100:1", ["aws"])), now=NOW)
    assert r.returncode == 0 and "catalog refresh" not in r.stdout  # AWS rows of 2026-11-30
    r = run_cli("--config", str(cfg), "catalog", "--gpu", "V100", now=NOW)
    assert r.returncode == 0 and "catalog refresh --cloud yandex" in r.stdout
    assert "--cloud aws" not in r.stdout


def test_refresh_dates_fetched_rows_by_the_app_clock(settings):
    from dataclasses import replace

    old = catalog.load(settings, ["yandex"])
    fetched = [replace(o, as_of="", source="billing API") for o in old[:3]]
    path = catalog.refresh(settings, "yandex", fetched, as_of="2026-12-03")
    assert {o.as_of for o in catalog.read_csv(path)} == {"2026-12-03"}


P5 = "aws,us-east-1,use1-az1,p5.48xlarge,H100,8,80,192,2048,55.04,,USD,,src,2026-11-30\n"


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("55.04,,USD", None),
        ("NaN,,USD", "column price: 'NaN' is not a price"),
        ("-1,,USD", "column price: '-1' is not a price"),
        ("abc,,USD", "column price: 'abc' is not a number"),
        ("55.04,1e999999,USD", "column spot_price: '1e999999' is not a price"),
        ("55.04,,XYZ", "column currency: 'XYZ' is not a currency"),
    ],
)
def test_a_bad_catalog_value_is_one_line_with_file_and_line_and_exit_2(home, bad, says):
    cfg = write_settings(home, clouds={"aws": {}})
    path = home / "catalog" / "aws.csv"
    path.parent.mkdir(parents=True)
    header = (DATA / "aws.csv").read_text().splitlines()[0]
    path.write_text(header + "\n" + P5 + P5.replace("55.04,,USD", bad))
    r = run_cli("--config", str(cfg), "catalog", "--gpu", "H100", now=NOW)
    if says is None:  # the good file: the control
        assert r.returncode == 0 and "55.04 USD" in r.stdout, r.stderr
        return
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"error: {path}:3: {r.stderr.split(':3: ', 1)[1].strip()}"
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "content",
    [bytes(range(256)) * 4, b"cloud,region\n\xff\xfe\x00garbage\n"],
    ids=["binary", "latin1"],
)
def test_a_binary_catalog_file_is_refused_with_its_path(home, content):
    cfg = write_settings(home, clouds={"aws": {}})
    path = home / "catalog" / "aws.csv"
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    r = run_cli("--config", str(cfg), "catalog", now=NOW)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{path}:" in r.stderr and "not a catalog" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_short_row_is_refused_with_its_line(home):
    cfg = write_settings(home, clouds={"aws": {}})
    path = home / "catalog" / "aws.csv"
    path.parent.mkdir(parents=True)
    header = (DATA / "aws.csv").read_text().splitlines()[0]
    path.write_text(header + "\n" + P5 + "aws,us-east-1\n")
    r = run_cli("--config", str(cfg), "catalog", now=NOW)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"error: {path}:3: 2 fields, the header has 15"


def test_refresh_runs_the_checks_and_empties_what_they_flag(settings):
    """A refreshed catalog is checked as the shipped one is built: a spot price equal to
    on-demand is dropped, saying why in the row's source, and the finding is reported."""
    from dataclasses import replace

    old = [o for o in catalog.load(settings, ["aws"]) if o.spot_price and o.price]
    same = replace(old[0], spot_price=old[0].price, as_of="")
    found: list = []
    path = catalog.refresh(settings, "aws", [same, *old[1:5]], as_of="2026-12-03", findings=found)
    [f] = found
    assert (f.check, f.line, f.field) == ("spot", 2, "spot_price")
    rows = list(catalog.read_csv(path))
    assert rows[0].spot_price is None and rows[0].price == same.price
    assert (
        "spot_price" in rows[0].source and "emptied: equal to the on-demand price" in rows[0].source
    )
    assert [o.spot_price for o in rows[1:]] == [o.spot_price for o in old[1:5]]
