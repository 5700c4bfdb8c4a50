"""Exact money: Decimal amounts that always carry their currency, conversion by set rates, and
sums of usage kept as integer microseconds per rate until priced once (:class:`Tally`).

**The one model and the one rounding rule.** Every amount of money in provisioner — ledger,
budgets, reports, ``bill`` — is a :class:`Money` (a Decimal with its ISO currency), kept exact.
It is rounded only where it is shown:

- **to people** (tables, text, mail, pages): half up (``ROUND_HALF_UP``) to the cent, the minor
  unit of every currency the clouds bill in (USD, EUR, RUB): ``str(Money)``, :meth:`Money.text`;
  ``0.125 USD`` reads ``0.13 USD`` everywhere, ``bill`` included;
- **in JSON** (every ``-o json``): exact, through the one function :meth:`Money.as_json` —
  ``{"amount": "<plain decimal text>", "currency": "USD"}``, the text from :func:`amount_text`
  (at most 9 places, cut half up; trailing zeros dropped; never ``1E+2``).

Figures that are *shared out* to the cent so that their lines add up to their total (a report's
lines and days, a bill's lines and reasons: :func:`allocate`) are cents by construction; their
JSON carries those cents, through the same function."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_FLOOR, ROUND_HALF_UP, Decimal, InvalidOperation
from typing import Any

CENT = Decimal("0.01")
LIMIT = Decimal(10) ** 12  # no price, budget or cap reaches it; 1e999999 would overflow sums


def amount_text(d: Decimal) -> str:
    """An amount for JSON: plain decimal text, to 9 places at most (a computed spend carries
    28 digits, no invoice more than 6; the 9th place cut half up), trailing zeros dropped,
    never ``1E+2``."""
    if d.as_tuple().exponent < -9:  # type: ignore[operator]
        d = d.quantize(Decimal("1E-9"), ROUND_HALF_UP)
    text = f"{d.normalize():f}"
    return "0" if text in ("-0", "0") else text


@dataclass(frozen=True, order=True)
class Money:
    amount: Decimal
    currency: str

    def __post_init__(self) -> None:
        if not isinstance(self.amount, Decimal):
            object.__setattr__(self, "amount", Decimal(str(self.amount)))

    def __add__(self, other: Money) -> Money:
        self._same(other)
        return Money(self.amount + other.amount, self.currency)

    def __sub__(self, other: Money) -> Money:
        self._same(other)
        return Money(self.amount - other.amount, self.currency)

    def __mul__(self, k: Decimal | int) -> Money:
        return Money(self.amount * Decimal(k), self.currency)

    def _same(self, other: Money) -> None:
        if other.currency != self.currency:
            raise ValueError(f"cannot mix {self.currency} and {other.currency}")

    def rounded(self) -> Money:
        return Money(self.amount.quantize(CENT, ROUND_HALF_UP), self.currency)

    def __str__(self) -> str:
        return self.text()

    def text(self, sign: bool = False, currency: bool = True) -> str:
        """For people: half up to the cent, with thousands separators (``1,234.57 USD``);
        ``sign``: a ``+`` before a positive amount (a difference); ``currency``: False in a
        column whose header names it."""
        d = self.amount.quantize(CENT, ROUND_HALF_UP)
        text = f"{d:+,}" if sign else f"{d:,}"
        return f"{text} {self.currency}" if currency else text

    def as_json(self) -> dict[str, str]:
        """The one money → JSON of provisioner: the exact amount as :func:`amount_text` writes
        it, and the currency. Every ``-o json`` writes money through this."""
        return {"amount": amount_text(self.amount), "currency": self.currency}

    @classmethod
    def zero(cls, currency: str) -> Money:
        return cls(Decimal(0), currency)

    @classmethod
    def parse(cls, value: object, default_currency: str | None = None) -> Money:
        """Accept ``"30 USD"``, ``"30"`` (with a default currency), a number, or
        ``{"amount": 30, "currency": "USD"}``."""
        if isinstance(value, Money):
            return value
        currency = default_currency
        if isinstance(value, Mapping):
            amount, currency = value.get("amount"), value.get("currency", default_currency)
        elif isinstance(value, str) and len(value.split()) == 2:
            amount, currency = value.split()
        else:
            amount = value
        if isinstance(amount, float):
            amount = repr(amount)
        try:
            dec = Decimal(str(amount).replace("_", ""))
        except (InvalidOperation, ValueError):
            raise ValueError(f"not an amount: {amount!r} (write e.g. '30 USD')") from None
        if not dec.is_finite():
            raise ValueError(f"not an amount: {amount!r}")
        if abs(dec) >= LIMIT:
            raise ValueError(f"{amount} is too large for an amount (at most {LIMIT:,})")
        if not currency:
            raise ValueError("an amount needs a currency (e.g. '30 USD')")
        currency = str(currency).upper()
        if len(currency) != 3 or not currency.isalpha():
            raise ValueError(f"unknown currency {currency!r} (use an ISO code: USD, RUB, EUR)")
        return cls(dec, currency)


def allocate(
    parts: Sequence[Decimal], total: Decimal | None = None, step: Decimal = CENT
) -> list[Decimal]:
    """``parts`` rounded to ``step`` so that they add up to ``total`` (their sum rounded half up
    to ``step``, unless given otherwise), by largest remainder: each part is rounded down, and
    the steps left over go, one each, to the parts that lost most (ties: the earlier part).
    Every result is its part rounded down or up — never further off than one step."""
    if total is None:
        total = sum(parts, Decimal(0)).quantize(step, ROUND_HALF_UP)
    floors = [p.quantize(step, ROUND_FLOOR) for p in parts]
    left = int((total - sum(floors, Decimal(0))) / step)
    if not 0 <= left <= len(parts):
        raise ValueError(f"cannot share {total} over parts adding up to {sum(parts)}")
    if left:
        lost = [p - f for p, f in zip(parts, floors, strict=True)]
        # stable: among equal remainders the earlier part goes first
        for i in sorted(range(len(parts)), key=lost.__getitem__, reverse=True)[:left]:
            floors[i] += step
    return floors


class Rates:
    """Conversion into one base currency. ``per_base[X]`` = units of X per 1 unit of base
    (``{"RUB": 80}`` with base USD means 1 USD = 80 RUB)."""

    def __init__(self, base: str, per_base: Mapping[str, Decimal]) -> None:
        self.base = base
        self.per_base = {base: Decimal(1), **{k.upper(): Decimal(v) for k, v in per_base.items()}}
        for code, rate in self.per_base.items():
            if not (rate.is_finite() and 0 < rate < LIMIT):
                raise ValueError(f"rates.{code}: {rate} is not a rate (a positive number)")

    def can_convert(self, currency: str) -> bool:
        return currency in self.per_base

    def convert(self, money: Money, to: str | None = None) -> Money:
        to = to or self.base
        if money.currency == to:
            return money
        try:
            in_base = money.amount / self.per_base[money.currency]
            return Money(in_base * self.per_base[to], to)
        except KeyError as e:
            raise ValueError(
                f"no exchange rate for {e.args[0]} (set rates.{e.args[0]} in settings)"
            ) from None

    def describe(self) -> str:
        return ", ".join(
            f"1 {self.base} = {v} {k}" for k, v in self.per_base.items() if k != self.base
        )


US_PER_HOUR = Decimal(3_600_000_000)
_ZERO = Decimal(0)


class Amounts(dict[str, Decimal]):
    """Sums that keep their currencies apart; converted only on request."""

    def add(self, currency: str, amount: Decimal) -> None:
        self[currency] = self.get(currency, _ZERO) + amount

    def merge(self, other: Amounts, k: Decimal | int = 1) -> Amounts:
        for c, a in other.items():
            self.add(c, a * k)
        return self

    def total(self, rates: Rates, currency: str) -> Money:
        out = _ZERO  # the sum of Money.zero and the converted amounts, without a Money each
        for c in sorted(self):
            out += rates.convert(Money(self[c], c), currency).amount
        return Money(out, currency)

    def monies(self) -> list[Money]:
        return [Money(self[c], c) for c in sorted(self)]

    def __str__(self) -> str:
        return " + ".join(str(m) for m in self.monies()) or "0"


class Tally:
    """Exact sums: integer microseconds per (key, currency, rate), priced once at the end."""

    def __init__(self) -> None:
        self._us: defaultdict[tuple[Hashable, str, str], int] = defaultdict(int)

    def add(self, key: Hashable, currency: str, rate: str, us: int) -> None:
        self._us[(key, currency, rate)] += us

    def items(self) -> Iterator[tuple[tuple[Hashable, str, str], int]]:
        return iter(self._us.items())

    def amounts(self) -> dict[Any, Amounts]:
        out: dict[Any, Amounts] = {}
        prices: dict[str, Decimal] = {}
        for (key, currency, rate), us in self._us.items():
            price = prices.get(rate)
            if price is None:
                price = prices[rate] = Decimal(rate)
            amounts = out.get(key)
            if amounts is None:
                amounts = out[key] = Amounts()
            amounts.add(currency, price * us / US_PER_HOUR)
        return out

    def hours(self) -> dict[Any, Decimal]:
        out: dict[Any, int] = defaultdict(int)
        for (key, _, _), us in self._us.items():
            out[key] += us
        return {k: Decimal(us) / US_PER_HOUR for k, us in out.items()}


def one_place(pct: Decimal) -> str:
    """A percent in JSON: a decimal string to one place ("378.4"), in every ``-o json``."""
    return str(pct.quantize(Decimal("0.1")))
