"""Planner: ranking in one currency, and a reason for every offer turned down."""

from __future__ import annotations

from decimal import Decimal

import pytest

from providers.base import Offer
from provisioner.money import Money, Rates
from provisioner.planner import FIT_FILTERS, PRICE_FILTERS, plan
from provisioner.spec import Experiment


def offer(
    cloud="aws",
    zone="z1",
    gpu="A100",
    count=8,
    price="30",
    spot="10",
    currency="USD",
    mem=40,
    vcpus=96,
    region=None,
) -> Offer:
    return Offer(
        cloud=cloud,
        region=region or f"{cloud}-r",
        zone=zone,
        instance_type=f"{cloud}-{gpu}-{count}",
        gpu=gpu,
        gpu_count=count,
        gpu_memory_gb=mem,
        vcpus=vcpus,
        memory_gb=Decimal(512),
        price=Decimal(price) if price else None,
        spot_price=Decimal(spot) if spot else None,
        currency=currency,
    )


def exp(**res) -> Experiment:
    return Experiment.model_validate(
        {
            "name": "e1",
            "project": "p",
            "owner": "o",
            "resources": {"gpu": "A100:8", "market": "spot", **res},
        }
    )


RATES = Rates("USD", {"RUB": Decimal(80)})
ALL = ("aws", "gcp", "azure", "yandex", "sbercloud", "sandbox")


def run(offers, **res):
    return plan(exp(**res), offers, RATES, enabled_clouds=ALL)


def test_ranks_by_price_in_base_currency_across_currencies():
    p = run(
        [
            offer("aws", spot="12"),
            offer("yandex", spot="800", currency="RUB"),  # 10 USD
            offer("gcp", spot="11"),
        ]
    )
    assert [c.offer.cloud for c in p.candidates] == ["yandex", "gcp", "aws"]
    y = p.candidates[0]
    assert y.price == Money(Decimal(800), "RUB")  # the rate fixed at launch stays in RUB
    assert y.price_base == Money(Decimal(10), "USD")


def test_every_rejection_has_a_reason():
    p = run(
        [
            offer("aws"),
            offer("aws", gpu="H100"),
            offer("aws", count=4),
            offer("sandbox"),
            offer("sbercloud", price=None, spot=None, currency="RUB"),
            offer("gcp", spot=None),
            offer("azure", vcpus=8),
            offer("gcp", spot="50"),
        ],
        min_vcpus=32,
        max_price_per_hour="40 USD",
    )
    assert len(p.candidates) == 1
    assert p.rejected == {
        "other GPU type": 1,
        "other GPU count": 1,
        "cloud not requested": 1,
        "no public price (set prices in settings)": 1,
        "no spot price": 1,
        "fewer than 32 vCPUs": 1,
        "over max price 40.00 USD/h": 1,
    }
    assert p.examples["other GPU type"] == "aws/z1 aws-H100-8"


def test_market_any_offers_both_and_reserved_wins_when_cheaper():
    p = run([offer("aws", price="9", spot="10")], market="any")
    assert [(c.market, c.price.amount) for c in p.candidates] == [("reserved", 9), ("spot", 10)]


def test_memory_requirement_and_a100_80gb_alias():
    offers = [offer("aws", mem=40, spot="5"), offer("gcp", gpu="A100-80GB", mem=80, spot="7")]
    p = plan(
        Experiment.model_validate(
            {
                "name": "e1",
                "project": "p",
                "owner": "o",
                "resources": {"gpu": "A100:80GB:8", "market": "spot"},
            }
        ),
        offers,
        RATES,
        enabled_clouds=ALL,
    )
    assert [c.offer.cloud for c in p.candidates] == ["gcp"]
    assert p.rejected == {"GPU memory below 80 GB": 1}
    plain = run(offers)  # "A100" means either memory size: the cheaper 40 GB comes first
    assert [c.offer.cloud for c in plain.candidates] == ["aws", "gcp"]


def test_regions_zones_and_cap_in_other_currency():
    offers = [
        offer("yandex", zone="ru-a", spot="1000", currency="RUB", region="ru"),
        offer("yandex", zone="ru-b", spot="3000", currency="RUB", region="ru"),
        offer("aws", zone="us-1a", region="us"),
    ]
    p = run(offers, regions=["ru"], max_price_per_hour="2000 RUB")
    assert [c.offer.zone for c in p.candidates] == ["ru-a"]
    assert (
        p.rejected["region not requested"] == 1 and p.rejected["over max price 2,000.00 RUB/h"] == 1
    )


def test_policy_hook_rejects_with_its_reason():
    p = plan(
        exp(),
        [offer("aws"), offer("gcp")],
        RATES,
        enabled_clouds=ALL,
        policy_check=lambda c: (
            "policy nlp: cloud gcp not allowed" if c.offer.cloud == "gcp" else None
        ),
    )
    assert [c.offer.cloud for c in p.candidates] == ["aws"]
    assert p.rejected == {"policy nlp: cloud gcp not allowed": 1}


def test_missing_exchange_rate_is_a_reason_not_a_crash():
    p = run([offer("aws", currency="EUR")])
    assert not p.candidates and "no exchange rate for EUR (set rates in settings)" in p.rejected


# One offer failing each filter of the pipeline, and the reason ``plan`` shows for it: filter name →
# (the offer, the experiment's resources, other arguments to plan, the reason).
FAILS_ONE = {
    "cloud requested": (offer("gcp"), {"clouds": ["aws"]}, {}, "cloud not requested"),
    "cloud enabled": (
        offer("gcp"),
        {},
        {"enabled_clouds": ("aws",)},
        "cloud not enabled in settings",
    ),
    "GPU type": (offer(gpu="H100"), {}, {}, "other GPU type"),
    "GPU count": (offer(count=4), {}, {}, "other GPU count"),
    "GPU memory": (offer(mem=40), {"gpu": "A100:80GB:8"}, {}, "GPU memory below 80 GB"),
    "region": (offer(region="eu"), {"regions": ["us"]}, {}, "region not requested"),
    "zone": (offer(zone="z1"), {"zones": ["z9"]}, {}, "zone not requested"),
    "vCPUs": (offer(vcpus=8), {"min_vcpus": 32}, {}, "fewer than 32 vCPUs"),
    "memory": (offer(), {"min_memory_gb": 1024}, {}, "less than 1024 GB memory"),
    "price": (offer(spot=None), {}, {}, "no spot price"),
    "exchange rate": (
        offer(currency="EUR"),
        {},
        {},
        "no exchange rate for EUR (set rates in settings)",
    ),
    "max price": (
        offer(spot="12"),
        {"max_price_per_hour": "10 USD"},
        {},
        "over max price 10.00 USD/h",
    ),
    "policy": (
        offer(),
        {},
        {"policy_check": lambda c: f"policy nlp: cloud {c.offer.cloud} not allowed"},
        "policy nlp: cloud aws not allowed",
    ),
}


def test_every_filter_has_a_case_below():
    assert [f.name for f in FIT_FILTERS + PRICE_FILTERS] == list(FAILS_ONE)


@pytest.mark.parametrize("name", FAILS_ONE)
def test_each_filter_turns_down_with_its_own_reason(name):
    o, res, kwargs, reason = FAILS_ONE[name]
    p = plan(exp(**res), [o], RATES, **{"enabled_clouds": ALL, **kwargs})
    assert not p.candidates
    assert p.summary_reasons() == [(reason, 1)]
    assert p.examples[reason] == f"{o.cloud}/{o.zone} {o.instance_type}"


def test_the_first_filter_in_the_pipeline_names_the_reason():
    # another GPU and too few vCPUs and no price: the GPU is what the user reads
    p = run([offer(gpu="H100", vcpus=8, spot=None)], min_vcpus=32)
    assert p.rejected == {"other GPU type": 1}


def test_only_the_simulated_cloud_enabled_says_what_to_change():
    p = plan(exp(), [offer("sandbox")], RATES, enabled_clouds=("sandbox",))
    [(reason, count)] = p.summary_reasons()
    assert count == 1
    assert reason.startswith("cloud not requested: without clouds:")
    assert "only sandbox is; list clouds: [CLOUD] in the experiment" in reason
    named = plan(exp(clouds=["sandbox"]), [offer("sandbox")], RATES, enabled_clouds=("sandbox",))
    assert [c.offer.cloud for c in named.candidates] == ["sandbox"]


def test_an_offer_without_any_price_is_listed_once_on_both_markets():
    p = run([offer("sbercloud", price=None, spot=None, currency="RUB")], market="any")
    assert [o.cloud for o in p.unpriced] == ["sbercloud"]
    assert p.rejected == {"no public price (set prices in settings)": 2}  # once per market
