"""What a cloud's own billing data says about our machines: billed line items in the cloud's
terms, tagged (or not) with our machine id, for ``provisioner bill`` to set beside the ledger.

Each cloud's source lives in its folder (``providers/<cloud>/billing.py``) and is named on its
:class:`~providers.spec.CloudSpec` (``billing``); a cloud without one says why (``billing_why``).
Amounts are exact Decimals in the currency the cloud bills in; nothing is converted here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date
from decimal import Decimal
from typing import Literal

#: What a billed line is, as the ledger sees it: ``compute`` and ``disk`` the ledger prices;
#: ``usage`` a machine's usage not split by what it was (Yandex's label report); ``other`` a
#: billed piece it does not price (a public IPv4 address, egress); ``tax``, ``credit`` and
#: ``discount`` lines of the bill that are not usage at all.
Kind = Literal["compute", "disk", "usage", "other", "tax", "credit", "discount"]
KINDS: tuple[Kind, ...] = ("compute", "disk", "usage", "other", "tax", "credit", "discount")


@dataclass(frozen=True)
class BilledItem:
    """One day's billed amount of one thing. ``machine`` is the value of our machine tag
    (``provisioner-machine``) on the billed resource; None when the line carries no such tag."""

    day: date
    amount: Decimal
    currency: str
    kind: Kind
    machine: str | None = None
    what: str = ""  # the cloud's own name: usage type, SKU, meter, record type
    instance_type: str | None = None  # for compute lines where the source names it
    usage_hours: Decimal | None = None  # for compute lines where the source gives usage
    # the cloud's id of the billed resource, for sources that carry no tag (SberCloud's BSS):
    # ``provisioner bill`` matches it to the machine whose instance id it is
    resource_id: str | None = None


@dataclass(frozen=True)
class Bill:
    """What one cloud's billing source returned for [start, end) (whole UTC days)."""

    cloud: str
    items: list[BilledItem]
    source: str  # which API, grouped by what
    lag: str  # how late the cloud's data runs, with the source of that fact
    lag_days: int  # days before today that the source may not have complete yet
    notes: list[str] = field(default_factory=list)

    def through(self, today: date) -> date | None:
        """The last day the bill can be taken as complete: the last day it has anything for,
        and never closer to ``today`` than the cloud's lag."""
        days = [i.day for i in self.items]
        if not days:
            return None
        return min(max(days), date.fromordinal(today.toordinal() - self.lag_days))


class BillingUnsupported(Exception):
    """The cloud has no billing source here; the message says why, with the source missing."""
