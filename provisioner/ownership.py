"""Rent or buy: for each GPU type a report's period used, what renting cost a month beside
what owning the cards would (price, power, amortisation), the payback and the use a week above
which owning wins."""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING

from provisioner.money import Money, Rates, Tally

if TYPE_CHECKING:
    from provisioner.app import App

HOURS_PER_MONTH = Decimal(730)  # 8760 / 12, the clouds' own convention
WEEKS_PER_MONTH = Decimal(52) / Decimal(12)


@dataclass
class Ownership:
    """Rent or buy for one GPU type, in the report's currency."""

    gpu: str
    gpu_hours: Decimal
    hours_per_week: Decimal
    cards: int
    rental_month: Money
    price_low: Money | None = None
    price_high: Money | None = None
    power_month: Money | None = None
    amortisation_months: int = 0
    payback_low: Decimal | None = None  # months until owning would have paid for itself
    payback_high: Decimal | None = None
    breakeven_low: Decimal | None = None  # hours a week per card above which owning wins
    breakeven_high: Decimal | None = None

    @property
    def verdict(self) -> str | None:
        if self.breakeven_low is None or self.breakeven_high is None:
            return None if self.price_low is None else "rent"
        use = self.hours_per_week / self.cards
        if use >= self.breakeven_high:
            return "own"
        return "rent" if use < self.breakeven_low else "close"


def rent_or_buy(
    app: App, gpus: Tally, elapsed_h: Decimal, rates: Rates, cur: str
) -> list[Ownership]:
    """Rent or buy for each GPU type used over ``elapsed_h`` hours (``gpus``: usage by GPU and
    cards per machine), in ``cur``: what renting cost a month, what owning would, and the use
    a week above which owning wins (priced by the settings' ``ownership``)."""
    if elapsed_h <= 0:
        return []
    own = app.settings.ownership
    hours: dict[str, Decimal] = {}
    cost: dict[str, Money] = {}
    largest: dict[str, int] = {}  # the most cards one machine had
    amounts = gpus.amounts()
    for (gpu, count), h in gpus.hours().items():
        hours[gpu] = hours.get(gpu, Decimal(0)) + h * count
        cost[gpu] = cost.get(gpu, Money.zero(cur)) + amounts[(gpu, count)].total(rates, cur)
        largest[gpu] = max(largest.get(gpu, 0), count)
    out = []
    for gpu in sorted(hours):
        gh = hours[gpu]
        if gh <= 0:
            continue
        o = Ownership(
            gpu=gpu,
            gpu_hours=gh,
            hours_per_week=gh / elapsed_h * 168,
            # owning means owning the biggest machine's cards, at least: 8×H100 is 8 cards
            cards=max(largest[gpu], math.ceil(gh / elapsed_h)),
            rental_month=cost[gpu] * (HOURS_PER_MONTH / elapsed_h),
        )
        spec = own.gpus.get(gpu)
        if spec is not None:
            conv = lambda a: rates.convert(Money(a, own.currency), cur)  # noqa: E731
            o.price_low, o.price_high = conv(spec.price_low), conv(spec.price_high)
            o.amortisation_months = own.amortisation_months
            kw = Decimal(spec.power_watts) / 1000
            o.power_month = conv(gh / elapsed_h * HOURS_PER_MONTH * kw * own.electricity_per_kwh)
            net = o.rental_month - o.power_month
            # a payback longer than the card's useful life is no payback at all
            if (
                net.amount > 0
                and o.price_low.amount * o.cards / net.amount <= own.amortisation_months
            ):
                o.payback_low = o.price_low.amount * o.cards / net.amount
                o.payback_high = o.price_high.amount * o.cards / net.amount
            per_hour_net = cost[gpu].amount / gh - conv(kw * own.electricity_per_kwh).amount
            if per_hour_net > 0:
                o.breakeven_low, o.breakeven_high = (
                    p.amount / own.amortisation_months / (per_hour_net * WEEKS_PER_MONTH)
                    for p in (o.price_low, o.price_high)
                )
        out.append(o)
    return out
