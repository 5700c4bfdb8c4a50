"""One money model, one rounding rule, one money → JSON (issue #36, point 4): amounts are
:class:`provisioner.money.Money`, shown half up to the cent, written to JSON exact by
``Money.as_json`` alone — ``bill`` included."""

from __future__ import annotations

import ast
from decimal import Decimal

from provisioner.bill import Drift, Line, rounded, totals
from provisioner.money import Money, amount_text
from tests.conftest import ROOT


def test_half_a_cent_rounds_up_for_people_and_stays_exact_in_json():
    m = Money(Decimal("0.125"), "USD")
    assert str(m) == m.text() == "0.13 USD"  # half up, not half even (0.12)
    assert Money(Decimal("-0.125"), "USD").text(sign=True) == "-0.13 USD"
    assert Money(Decimal("1234.5"), "EUR").text(sign=True) == "+1,234.50 EUR"
    assert Money(Decimal("2.005"), "USD").text(currency=False) == "2.01"  # `plan`'s price column
    assert m.as_json() == {"amount": "0.125", "currency": "USD"}
    # 28 digits of a computed spend: 9 places, the last cut half up; never 1E+2
    assert amount_text(Decimal(1) / Decimal(3) * 2) == "0.666666667"
    assert amount_text(Decimal("1E+2")) == "100" and amount_text(Decimal("-0.00")) == "0"


def test_bill_shows_half_a_cent_as_the_ledger_does():
    """A machine billed 0.125 USD: `bill` says 0.13 USD, as `status` and reports say it (it used
    to format bare Decimals half even: 0.12)."""
    ln = Line("m", "USD")
    ln.billed = Decimal("0.125")
    ln.reasons["untagged"] = Decimal("0.125")
    (row,) = rounded([ln])
    assert row["billed"] == Money(Decimal("0.13"), "USD")
    assert row["billed"].text() == str(Money(Decimal("0.125"), "USD")) == "0.13 USD"
    assert row["difference"].text(sign=True) == "+0.13 USD"
    assert totals([row])["USD"]["billed"].as_json() == {"amount": "0.13", "currency": "USD"}
    d = Drift("m", "r", "t", "spot", "USD", Decimal(1), Decimal("1.00005"), Decimal(1), None)
    assert d.unit_price == Money(Decimal("1.0001"), "USD")  # unit prices: half up too


def _money_dicts(path) -> list[int]:
    """Lines of dict literals that write money by hand: keys "amount" and "currency"."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if {"amount", "currency"} <= keys:
                out.append(node.lineno)
    return out


def test_money_goes_to_json_through_one_function():
    """A second money → JSON (a dict of "amount" and "currency" written by hand) is how one
    budget came to read rounded in one command and unrounded in another: only
    ``Money.as_json`` (provisioner/money.py) may write one."""
    found = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in sorted((ROOT / "provisioner").rglob("*.py"))  # what writes JSON
        if p != ROOT / "provisioner/money.py"
        for line in _money_dicts(p)
    ]
    assert found == [], "write money with Money(...).as_json() instead"
    assert _money_dicts(ROOT / "provisioner/money.py")  # the check sees the one there is
