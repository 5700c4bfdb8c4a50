"""Offers × spec (× policy) → candidates ranked by price per hour in one currency.

The planner is a pipeline of named filters. Each filter looks at one offer (or one offer on one
market) against the request and answers None (keep) or the reason the user sees. An offer first
meets the fit filters (:data:`FIT_FILTERS`: is this the machine asked for?); one that fits is
quoted on each market the request accepts and meets the price filters (:data:`PRICE_FILTERS`: is
there a price, can it be compared, is it allowed?). The first filter that turns an offer down
names the reason it is counted under, so ``plan`` can say why a cheaper-looking machine was not
chosen; what is left is ranked by price in the base currency.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any, Generic, Literal, TypeVar

from providers import CLOUDS, gpus
from providers.base import Offer
from provisioner import catalog
from provisioner.console import number
from provisioner.money import Money, Rates
from provisioner.spec import Experiment

Market = Literal["spot", "reserved"]
PolicyCheck = Callable[["Candidate"], str | None]  # reason to reject, or None
NO_PUBLIC_PRICE = "no public price (set prices in settings)"
T = TypeVar("T")


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

    def to_json(self) -> dict[str, Any]:
        """The candidate as `plan -o json` and the dashboard's plan show it (amounts as exact
        decimal strings with their currency)."""
        o = self.offer
        return {
            "cloud": o.cloud,
            "region": o.region,
            "zone": o.zone,
            "instance_type": o.instance_type,
            "gpu": o.gpu,
            "gpu_count": o.gpu_count,
            "gpu_memory_gb": o.gpu_memory_gb,
            "vcpus": o.vcpus,
            "memory_gb": number(o.memory_gb),
            "market": self.market,
            "price_per_hour": self.price.as_json(),
            "price_per_hour_base": self.price_base.as_json(),
            "source": o.source,
        }


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
    new_volume_gb: int = 0  # the experiment's volumes not created yet: budgets count them

    def pin(self, pin: VolumePin) -> None:
        """Keep only the candidates where ``pin``'s volume is: a volume attaches only to a
        machine in its zone."""
        keep = []
        for c in self.candidates:
            if not pin.admits(c.offer):
                self.reject(str(pin), c.offer)
            elif pin.zone and not c.offer.zone:  # priced per region: launched in its zone
                keep.append(replace(c, offer=replace(c.offer, zone=pin.zone)))
            else:
                keep.append(c)
        self.candidates = keep
        self.checks.append(pin)

    def refuse(self, why: Callable[[Candidate], str | None]) -> None:
        """Drop the candidates ``why`` answers a reason for, each counted under it."""
        keep = []
        for c in self.candidates:
            if reason := why(c):
                self.reject(reason, c.offer)
            else:
                keep.append(c)
        self.candidates = keep

    def summary_reasons(self) -> list[tuple[str, int]]:
        return self.rejected.most_common()

    def reject(self, reason: str, o: Offer) -> None:
        self.rejected[reason] += 1
        if reason not in self.examples:
            self.examples[reason] = f"{o.cloud}/{o.zone or o.region} {o.instance_type}"


@dataclass(frozen=True)
class VolumePin:
    """The experiment's project already has a volume it names: only that volume's cloud and
    zone can use it. An offer priced per region (zone "") is admitted in the volume's region:
    its cloud places the machine (and must place it in the volume's zone)."""

    cloud: str
    region: str
    zone: str
    volume: str

    def admits(self, o: Offer) -> bool:
        if (o.cloud, o.region) != (self.cloud, self.region):
            return False
        return not self.zone or not o.zone or o.zone == self.zone

    def __str__(self) -> str:
        return f"pinned to {self.cloud} {self.zone or self.region} by volume {self.volume}"

    def as_json(self) -> dict[str, Any]:
        return {
            "check": "volume-pin",
            "cloud": self.cloud,
            "region": self.region,
            "zone": self.zone,
            "volume": self.volume,
            "message": str(self),
        }


@dataclass(frozen=True, slots=True)
class Request:
    """What the filters compare an offer to: the experiment's resources and the context (enabled
    clouds, exchange rates, the policy hook), settled once per plan."""

    wanted: frozenset[str]  # the clouds the experiment names (every real cloud if it names none)
    enabled: frozenset[str]
    unlisted: str  # the reason for a cloud not wanted
    gpu_family: str
    gpu_count: int
    min_gpu_memory_gb: int
    regions: frozenset[str]
    zones: frozenset[str]
    min_vcpus: int
    min_memory_gb: Decimal
    markets: tuple[Market, ...]
    cap: Money | None
    rates: Rates
    policy_check: PolicyCheck | None

    @classmethod
    def of(
        cls,
        experiment: Experiment,
        enabled_clouds: Iterable[str],
        rates: Rates,
        policy_check: PolicyCheck | None,
    ) -> Request:
        res = experiment.resources
        enabled = frozenset(enabled_clouds)
        unlisted = "cloud not requested"
        # No real cloud enabled (only the simulated one), and an experiment naming no cloud:
        # say what to change.
        if res.clouds is None and not enabled & set(CLOUDS):
            unlisted += (
                ": without clouds: an experiment uses the real clouds enabled in settings, and "
                f"only {', '.join(sorted(enabled)) or 'none'} is; list clouds: [CLOUD] in the "
                "experiment, or enable a cloud under clouds: in settings"
            )
        return cls(
            wanted=frozenset(res.clouds if res.clouds is not None else CLOUDS),
            enabled=enabled,
            unlisted=unlisted,
            gpu_family=res.gpu.family,
            gpu_count=res.gpu.count,
            min_gpu_memory_gb=res.gpu.min_memory_gb,
            regions=frozenset(res.regions),
            zones=frozenset(res.zones),
            min_vcpus=res.min_vcpus,
            min_memory_gb=res.min_memory_gb,
            markets=("spot", "reserved") if res.market == "any" else (res.market,),
            cap=res.max_price_per_hour,
            rates=rates,
            policy_check=policy_check,
        )


@dataclass(slots=True)
class Quote:
    """An offer that fits, on one market: what the price filters look at."""

    offer: Offer
    market: Market
    amount: Decimal | None  # per hour, in the offer's currency; None: no price on this market
    _candidate: Candidate | None = None

    def candidate(self, rates: Rates) -> Candidate:
        """Only for a quote with a price in a currency ``rates`` converts (built once: the
        policy filter and the ranking see the same one)."""
        if self._candidate is None:
            assert self.amount is not None
            price = Money(self.amount, self.offer.currency)
            self._candidate = Candidate(self.offer, self.market, price, rates.convert(price))
        return self._candidate


@dataclass(frozen=True)
class Filter(Generic[T]):
    """One named step of the pipeline: ``reject`` answers None (keep) or the reason the user
    sees. ``applies`` leaves out a filter the request cannot trip (no regions asked, no cap)."""

    name: str
    reject: Callable[[T, Request], str | None]
    applies: Callable[[Request], bool] = lambda r: True


# The fit filters: is this offer the machine asked for?


def cloud_requested(o: Offer, r: Request) -> str | None:
    return None if o.cloud in r.wanted else r.unlisted


def cloud_enabled(o: Offer, r: Request) -> str | None:
    return None if o.cloud in r.enabled else "cloud not enabled in settings"


def gpu_type(o: Offer, r: Request) -> str | None:
    return None if gpus.family(o.gpu) == r.gpu_family else catalog.OTHER_GPU


def gpu_count(o: Offer, r: Request) -> str | None:
    return None if o.gpu_count == r.gpu_count else catalog.OTHER_COUNT


def gpu_memory(o: Offer, r: Request) -> str | None:
    """A name can promise more memory than its row says (A100-80GB)."""
    if max(o.gpu_memory_gb, gpus.implied_memory_gb(o.gpu)) >= r.min_gpu_memory_gb:
        return None
    return f"GPU memory below {r.min_gpu_memory_gb} GB"


def region(o: Offer, r: Request) -> str | None:
    return None if o.region in r.regions else "region not requested"


def zone(o: Offer, r: Request) -> str | None:
    return None if o.zone in r.zones else "zone not requested"


def vcpus(o: Offer, r: Request) -> str | None:
    return None if o.vcpus >= r.min_vcpus else f"fewer than {r.min_vcpus} vCPUs"


def memory(o: Offer, r: Request) -> str | None:
    return None if o.memory_gb >= r.min_memory_gb else f"less than {r.min_memory_gb} GB memory"


# The price filters: on this market, is there a price, can it be compared, is it allowed?


def priced(q: Quote, r: Request) -> str | None:
    if q.amount is not None:
        return None
    if q.offer.price is None and q.offer.spot_price is None:
        return NO_PUBLIC_PRICE
    return f"no {'spot' if q.market == 'spot' else 'on-demand'} price"


def exchange_rate(q: Quote, r: Request) -> str | None:
    currency = q.offer.currency
    if r.rates.can_convert(currency):
        return None
    return f"no exchange rate for {currency} (set rates in settings)"


def max_price(q: Quote, r: Request) -> str | None:
    assert r.cap is not None  # applies only with a cap
    c = q.candidate(r.rates)
    # a cap in the base currency (the usual case) compares the price already converted
    price = (
        c.price_base if r.cap.currency == r.rates.base else r.rates.convert(c.price, r.cap.currency)
    )
    return f"over max price {r.cap}/h" if price.amount > r.cap.amount else None


def policy(q: Quote, r: Request) -> str | None:
    """The policies' rules for one candidate (see :mod:`provisioner.planning`)."""
    assert r.policy_check is not None  # applies only with a hook
    return r.policy_check(q.candidate(r.rates)) or None


FIT_FILTERS: tuple[Filter[Offer], ...] = (  # in the order their reasons win
    Filter("cloud requested", cloud_requested),
    Filter("cloud enabled", cloud_enabled),
    Filter("GPU type", gpu_type),
    Filter("GPU count", gpu_count),
    Filter("GPU memory", gpu_memory, lambda r: r.min_gpu_memory_gb > 0),
    Filter("region", region, lambda r: bool(r.regions)),
    Filter("zone", zone, lambda r: bool(r.zones)),
    Filter("vCPUs", vcpus, lambda r: r.min_vcpus > 0),
    Filter("memory", memory, lambda r: r.min_memory_gb > 0),
)
PRICE_FILTERS: tuple[Filter[Quote], ...] = (
    Filter("price", priced),
    Filter("exchange rate", exchange_rate),
    Filter("max price", max_price, lambda r: r.cap is not None),
    Filter("policy", policy, lambda r: r.policy_check is not None),
)


def _pipeline(filters: Iterable[Filter[T]], r: Request) -> Callable[[T], str | None]:
    """The filters that apply to ``r`` as one step: the first reason to turn an item down."""
    steps = tuple(f.reject for f in filters if f.applies(r))

    def first_reason(item: T) -> str | None:
        for reject in steps:
            why = reject(item, r)
            if why is not None:
                return why
        return None

    return first_reason


def _rank(c: Candidate) -> tuple[Any, ...]:
    o = c.offer
    return (c.price_base.amount, o.cloud, o.region, o.zone, o.instance_type, c.market)


def plan(
    experiment: Experiment,
    offers: Iterable[Offer],
    rates: Rates,
    *,
    enabled_clouds: Iterable[str],
    policy_check: PolicyCheck | None = None,
) -> Plan:
    """Each offer through the fit filters; each that fits quoted on every market the request
    accepts and through the price filters; the quotes left ranked by price in the base currency.
    An offer turned down counts under the reason of the first filter that turned it down."""
    r = Request.of(experiment, enabled_clouds, rates, policy_check)
    fits, sells = _pipeline(FIT_FILTERS, r), _pipeline(PRICE_FILTERS, r)
    p = Plan(experiment, [], currency=rates.base, rates=rates.describe())
    # rows the catalog left unconverted (another GPU family) count as turned down here too
    p.rejected.update(getattr(offers, "skipped", {}))
    p.examples.update(getattr(offers, "examples", {}))
    for o in offers:
        why = fits(o)
        if why is not None:
            p.reject(why, o)
            continue
        if o.price is None and o.spot_price is None:
            p.unpriced.append(o)
        for market in r.markets:
            q = Quote(o, market, o.spot_price if market == "spot" else o.price)
            why = sells(q)
            if why is None:
                p.candidates.append(q.candidate(rates))
            else:
                p.reject(why, o)
    p.candidates.sort(key=_rank)
    return p
