"""Offers × spec (× policy) → candidates ranked by price per hour in one currency.

Every offer that is not a candidate keeps the reason it was turned down, so ``plan`` can say why
a cheaper-looking machine was not chosen.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from providers import CLOUDS, gpus
from providers.base import Offer
from provisioner import catalog
from provisioner.money import Money, Rates
from provisioner.spec import Experiment

Market = Literal["spot", "reserved"]
PolicyCheck = Callable[["Candidate"], str | None]  # reason to reject, or None


@dataclass(frozen=True)
class Candidate:
    offer: Offer
    market: Market
    price: Money  # per hour, in the offer's currency: the rate fixed at launch
    price_base: Money  # per hour, converted for ranking

    @property
    def spot(self) -> bool:
        return self.market == "spot"

    @property
    def where(self) -> str:
        o = self.offer
        return f"{o.cloud}/{o.zone or o.region}"


@dataclass
class Plan:
    experiment: Experiment
    candidates: list[Candidate]
    rejected: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # reason → one offer it turned down
    currency: str = "USD"
    rates: str = ""
    checks: list[Any] = field(default_factory=list)  # policy decision, budget projection, …
    unpriced: list[Offer] = field(default_factory=list)  # fit the request, but no price is known

    def summary_reasons(self) -> list[tuple[str, int]]:
        return self.rejected.most_common()


def _gpu_family(name: str) -> tuple[str, int]:
    return gpus.family(name), gpus.implied_memory_gb(name)


def plan(
    experiment: Experiment,
    offers: Iterable[Offer],
    rates: Rates,
    *,
    enabled_clouds: Iterable[str],
    policy_check: PolicyCheck | None = None,
) -> Plan:
    res = experiment.resources
    enabled = set(enabled_clouds)
    wanted = set(res.clouds) if res.clouds is not None else set(CLOUDS)
    regions, zones = set(res.regions), set(res.zones)
    family, min_mem = res.gpu.family, res.gpu.min_memory_gb
    markets: tuple[Market, ...] = ("spot", "reserved") if res.market == "any" else (res.market,)
    cap = res.max_price_per_hour

    # rows the catalog left unconverted (another GPU family) count as turned down here too
    rejected: Counter[str] = Counter(getattr(offers, "skipped", {}))
    examples: dict[str, str] = dict(getattr(offers, "examples", {}))
    out: list[Candidate] = []
    unpriced: list[Offer] = []

    def reject(reason: str, o: Offer) -> None:
        rejected[reason] += 1
        examples.setdefault(reason, f"{o.cloud}/{o.zone or o.region} {o.instance_type}")

    for o in offers:
        fam, implied = _gpu_family(o.gpu)
        if o.cloud not in wanted:
            reject("cloud not requested", o)
        elif o.cloud not in enabled:
            reject("cloud not enabled in settings", o)
        elif fam != family:
            reject(catalog.OTHER_GPU, o)
        elif o.gpu_count != res.gpu.count:
            reject(catalog.OTHER_COUNT, o)
        elif max(o.gpu_memory_gb, implied) < min_mem:
            reject(f"GPU memory below {min_mem} GB", o)
        elif regions and o.region not in regions:
            reject("region not requested", o)
        elif zones and o.zone not in zones:
            reject("zone not requested", o)
        elif o.vcpus < res.min_vcpus:
            reject(f"fewer than {res.min_vcpus} vCPUs", o)
        elif o.memory_gb < res.min_memory_gb:
            reject(f"less than {res.min_memory_gb} GB memory", o)
        else:
            for market in markets:
                amount = o.spot_price if market == "spot" else o.price
                if amount is None:
                    if o.price is None and o.spot_price is None:
                        unpriced.append(o)
                    reject(
                        "no public price (set prices in settings)"
                        if o.price is None and o.spot_price is None
                        else f"no {'spot' if market == 'spot' else 'on-demand'} price",
                        o,
                    )
                    continue
                price = Money(amount, o.currency)
                if not rates.can_convert(o.currency):
                    reject(f"no exchange rate for {o.currency} (set rates in settings)", o)
                    continue
                base = rates.convert(price)
                if cap is not None and rates.convert(price, cap.currency).amount > cap.amount:
                    reject(f"over max price {cap}/h", o)
                    continue
                cand = Candidate(o, market, price, base)
                why = policy_check(cand) if policy_check else None
                if why:
                    reject(why, o)
                    continue
                out.append(cand)

    out.sort(
        key=lambda c: (
            c.price_base.amount,
            c.offer.cloud,
            c.offer.region,
            c.offer.zone,
            c.offer.instance_type,
            c.market,
        )
    )
    return Plan(
        experiment, out, rejected, examples, rates.base, rates.describe(), unpriced=unpriced
    )
