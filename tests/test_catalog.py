"""The shipped catalog and its refresh: sources on every row, unknown prices stay unknown, a
failed or partial refresh never loses prices."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal

import pytest

from provisioner import catalog
from tests.conftest import ROOT, run_cli, write_settings


def test_shipped_catalog_covers_five_clouds_with_sources(settings):
    offers = catalog.load(settings, ["aws", "gcp", "azure", "yandex", "sbercloud"])
    by_cloud = {}
    for o in offers:
        by_cloud.setdefault(o.cloud, set()).add(o.gpu)
        assert o.source, o
        assert o.currency == ("RUB" if o.cloud in ("yandex", "sbercloud") else "USD")
    assert {"A100", "H100", "T4"} <= by_cloud["aws"]
    assert {"A100", "A100-80GB", "H100", "T4"} <= by_cloud["gcp"]
    assert {"A100", "A100-80GB", "H100", "T4"} <= by_cloud["azure"]
    assert {"A100-80GB", "T4", "V100"} <= by_cloud["yandex"]
    assert {"A100-80GB", "H100", "T4", "V100"} <= by_cloud["sbercloud"]
    assert all(o.price is None and o.spot_price is None for o in offers if o.cloud == "sbercloud")


def test_gcp_t4_is_host_plus_gpu(settings):
    (o,) = [
        o
        for o in catalog.load(settings, ["gcp"])
        if o.zone == "us-central1-a"
        and o.instance_type == "n1-standard-4"
        and o.gpu == "T4"
        and o.gpu_count == 1
    ]
    assert o.accelerator == "nvidia-tesla-t4" and o.price == Decimal("0.54")


def test_refresh_keeps_old_data_on_failure_and_old_prices_where_the_source_has_none(settings):
    old = catalog.load(settings, ["yandex"])
    with pytest.raises(ValueError, match="keeping the old catalog"):
        catalog.refresh(settings, "yandex", [])
    assert catalog.load(settings, ["yandex"]) == old
    fetched = [
        replace(o, price=None, spot_price=None, source="billing API")
        if o.gpu == "YC-V4"
        else replace(o, price=o.price * 2, source="billing API")
        for o in old
    ]
    catalog.refresh(settings, "yandex", fetched)
    new = {(o.zone, o.instance_type): o for o in catalog.load(settings, ["yandex"])}
    for o in old:
        n = new[(o.zone, o.instance_type)]
        if o.gpu == "YC-V4":
            assert n.price == o.price and "price kept from the previous catalog" in n.source
        else:
            assert n.price == o.price * 2 and n.source == "billing API"


def test_refresh_of_a_cloud_without_price_source_fails_cleanly(home):
    cfg = write_settings(home)
    r = run_cli("--config", str(cfg), "catalog", "refresh", "--cloud", "sandbox")
    # asking for what cannot be: a usage mistake (exit 2) that says why, the catalog untouched
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "sandbox has no price source to refresh" in r.stderr
    assert not (home / "catalog" / "sandbox.csv").exists()


def _rows(cloud: str) -> list[dict]:
    import csv

    path = ROOT / "provisioner" / "data" / "catalog" / f"{cloud}.csv"
    return list(csv.DictReader(path.open()))


def test_shipped_prices_pass_the_builds_checks():
    """What the build empties stays out: the shipped rows pass the checks again unchanged."""
    from provisioner import catalog_checks

    for cloud in ("aws", "gcp", "azure", "yandex", "sbercloud", "sandbox"):
        rows = _rows(cloud)
        assert [str(f) for f in catalog_checks.check(rows, cloud)] == [], cloud
        for r in rows:
            if r["spot_price"] and r["price"]:
                assert Decimal(r["spot_price"]) < Decimal(r["price"]), r


def test_untrusted_source_prices_are_emptied_and_listed():
    gcp = _rows("gcp")
    # GCP sells a3-highgpu-1g/2g/4g only as Spot or Flex-start.
    small_h100 = [r for r in gcp if r["instance_type"] in ("a3-highgpu-1g", "a3-highgpu-4g")]
    assert small_h100 and all(not r["price"] and r["spot_price"] for r in small_h100)
    # The source's committed-use-like prices: a3-highgpu-8g at ~43 in us-central1 vs ~88 in
    # us-east4; A100-80GB below A100-40GB per card in us-central1.
    h100 = {r["zone"]: r["price"] for r in gcp if r["instance_type"] == "a3-highgpu-8g"}
    assert h100["us-central1-a"] == "" and Decimal(h100["us-east4-a"]) > 80
    ultra = {r["zone"]: r["price"] for r in gcp if r["instance_type"] == "a2-ultragpu-1g"}
    assert ultra["us-central1-a"] == "" and Decimal(ultra["us-east5-a"]) > 5
    import csv

    listed = list(csv.DictReader((ROOT / "provisioner/data/catalog/checks.csv").open()))
    emptied = {(f["cloud"], f["zone"], f["instance_type"], f["field"]) for f in listed}
    assert ("gcp", "us-central1-a", "a3-highgpu-8g", "price") in emptied
    assert ("gcp", "us-central1-a", "a3-highgpu-1g", "price") in emptied
    assert all(f["reason"] and f["value"] for f in listed)


def test_offers_stay_inside_the_regions_and_zones_settings_enable(home):
    from tests.conftest import make_settings

    s = make_settings(home, clouds={"aws": {"regions": ["us-west-2"]}, "gcp": {}})
    aws = catalog.load(s, ["aws"])
    assert aws and {o.region for o in aws} == {"us-west-2"}
    assert not [o for o in aws if "lax" in o.zone]  # Local Zones are opt-in
    gcp = {o.region for o in catalog.load(s, ["gcp"])}
    assert gcp == {"us-central1", "us-east4", "europe-west4"}  # the GCP default regions
    lax = make_settings(
        home, clouds={"aws": {"regions": ["us-west-2"], "zones": ["usw2-lax1-az1"]}}
    )
    assert {o.zone for o in catalog.load(lax, ["aws"])} == {"usw2-lax1-az1"}


@pytest.mark.parametrize("gpu", ["T4:1", "A100-80GB:8", "H100:8", "A100:40GB:1"])
def test_a_plan_that_reads_only_its_gpu_ranks_and_counts_as_one_reading_everything(settings, gpu):
    """``plan`` converts only the rows of the asked GPU; the rows it skips are still counted
    under the planner's own reasons, so the candidates, their order and every count are those
    of a plan over the whole catalog."""
    from provisioner import planner
    from provisioner.spec import Experiment

    experiment = Experiment.model_validate(
        {"name": "exp", "project": "p", "owner": "o@example.com", "resources": {"gpu": gpu}}
    )
    clouds = ["aws", "gcp", "azure", "yandex", "sbercloud"]
    res = experiment.resources

    def ranked(offers):
        return planner.plan(experiment, offers, settings.money_rates, enabled_clouds=clouds)

    whole = ranked(catalog.load(settings, clouds))
    narrow_offers = catalog.load(
        settings, clouds, gpu_family=res.gpu.family, gpu_count=res.gpu.count
    )
    narrow = ranked(narrow_offers)
    assert len(narrow_offers) < len(catalog.load(settings, clouds)) / 2
    assert narrow.candidates == whole.candidates and whole.candidates
    assert narrow.rejected == whole.rejected
    assert narrow.examples == whole.examples


def test_a_refreshed_catalog_plans_from_its_index_as_from_every_row(settings):
    """A refreshed catalog is planned from its index (made by the first plan, beside the file):
    the same offers in the same order, the same counts and examples of the rows turned down,
    as reading every row; once the file changes, the file is read again, not the old index."""
    import shutil

    clouds = ["aws", "gcp", "azure"]

    def narrow():
        offers = catalog.load(settings, clouds, gpu_family="A100", gpu_count=8)
        return list(offers), list(offers.skipped.items()), list(offers.examples.items())

    shipped = narrow()  # read row by row
    for cloud in clouds:
        path = catalog.refreshed_path(settings, cloud)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(catalog._shipped(cloud), path)
    assert narrow() == shipped  # made the index
    index = settings.home / "catalog" / ".aws.csv.index"
    assert index.exists()
    assert narrow() == shipped  # read it
    aws = catalog.refreshed_path(settings, "aws")
    rows = aws.read_text().splitlines(keepends=True)
    aws.write_text("".join(r for r in rows if ",A100" not in r and ",T4," not in r))
    offers, skipped, examples = narrow()
    assert {o.cloud for o in offers} == {o.cloud for o in shipped[0]} - {"aws"}
    assert dict(skipped)[catalog.OTHER_GPU] < dict(shipped[1])[catalog.OTHER_GPU]
    index.write_bytes(b"not an index")
    assert narrow() == (offers, skipped, examples)
