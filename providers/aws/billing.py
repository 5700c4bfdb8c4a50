"""AWS's own bill for our machines: Cost Explorer ``GetCostAndUsage``, daily, grouped by our
machine tag.

Two calls, because Cost Explorer groups by at most two keys at once ("You can group by up to two
different dimensions", GetCostAndUsage API reference, GroupBy):
- usage lines, ``RECORD_TYPE`` one of :data:`USAGE_RECORD_TYPES` (usage, and usage a Reserved
  Instance or Savings Plan covered), grouped by TAG ``provisioner-machine`` × ``USAGE_TYPE``
  with ``UnblendedCost`` and ``UsageQuantity``: the usage type names what was billed
  (``BoxUsage:<type>``/``SpotUsage:<type>`` an instance hour, ``EBS:VolumeUsage.<class>`` a
  volume, anything else — ``PublicIPv4:InUseAddress``, data transfer — a piece the ledger does not
  price); EC2 usage types as the AWS Billing user guide names them ("Understanding your
  usage types"; the CUR column lineItem/UsageType,
  https://docs.aws.amazon.com/cur/latest/userguide/product-columns.html);
- the other record types (tax, credits, refunds, discounts), grouped by the tag × ``RECORD_TYPE``.

A group's tag key comes back as ``<tag key>$<value>``, and ``<tag key>$`` for resources without
the tag (GetCostAndUsage API reference, Group.Keys; "Cost allocation tags" in the AWS Billing
user guide). A tag only shows in Cost Explorer once it is activated as a cost allocation tag
(https://docs.aws.amazon.com/awsaccountbilling/latest/aboutv2/activating-tags.html).
"""

from __future__ import annotations

from datetime import date
from decimal import Decimal
from typing import Any

from providers.base import TAG_MACHINE
from providers.billing import Bill, BilledItem, Kind

#: "AWS billing information updates up to three times daily" and Cost Explorer shows it from
#: then (https://docs.aws.amazon.com/cost-management/latest/userguide/ce-api-best-practices.html):
#: a day is taken as billed one day after it ends.
LAG = (
    "Cost Explorer data updates up to three times a day (AWS Cost Management user guide, "
    "ce-api-best-practices): yesterday may still be incomplete"
)
ACTIVATE = (
    f"aws: the tag {TAG_MACHINE!r} must be activated as a cost allocation tag (Billing console → "
    "Cost allocation tags, or `aws ce update-cost-allocation-tags-status`) before Cost Explorer "
    "groups by it; it shows only for usage after activation"
)


def fetch(provider: Any, start: date, end: date) -> Bill:
    """The bill for [start, end) (whole UTC days; Cost Explorer's End is exclusive)."""
    ce = provider._client("ce", "us-east-1")  # Cost Explorer's one endpoint
    period = {"Start": start.isoformat(), "End": end.isoformat()}
    usage = _pages(
        provider,
        ce,
        TimePeriod=period,
        Granularity="DAILY",
        Metrics=["UnblendedCost", "UsageQuantity"],
        Filter={"Dimensions": {"Key": "RECORD_TYPE", "Values": list(USAGE_RECORD_TYPES)}},
        GroupBy=[{"Type": "TAG", "Key": TAG_MACHINE}, {"Type": "DIMENSION", "Key": "USAGE_TYPE"}],
    )
    others = _pages(
        provider,
        ce,
        TimePeriod=period,
        Granularity="DAILY",
        Metrics=["UnblendedCost"],
        Filter={"Not": {"Dimensions": {"Key": "RECORD_TYPE", "Values": list(USAGE_RECORD_TYPES)}}},
        GroupBy=[{"Type": "TAG", "Key": TAG_MACHINE}, {"Type": "DIMENSION", "Key": "RECORD_TYPE"}],
    )
    items: list[BilledItem] = []
    for day, keys, metrics in usage:
        items.append(_usage_item(day, keys, metrics))
    for day, keys, metrics in others:
        cost = metrics["UnblendedCost"]
        items.append(
            BilledItem(
                day,
                Decimal(cost["Amount"]),
                cost["Unit"],
                record_kind(keys[1]),
                _machine(keys[0]),
                keys[1],
            )
        )
    return Bill(
        "aws",
        [i for i in items if i.amount],
        f"Cost Explorer GetCostAndUsage, daily, grouped by tag {TAG_MACHINE}",
        LAG,
        1,
        [ACTIVATE] if items and all(i.machine is None for i in items) else [],
    )


def _usage_item(day: date, keys: list[str], metrics: dict[str, Any]) -> BilledItem:
    """One usage group (machine tag, usage type) of one day; a compute one with its hours."""
    machine, usage_type = _machine(keys[0]), keys[1]
    kind, itype = usage_kind(usage_type)
    cost = metrics["UnblendedCost"]
    quantity = metrics.get("UsageQuantity") or {}
    hours = Decimal(quantity["Amount"]) if kind == "compute" and quantity else None
    return BilledItem(
        day, Decimal(cost["Amount"]), cost["Unit"], kind, machine, usage_type, itype, hours
    )


def usage_kind(usage_type: str) -> tuple[Kind, str | None]:
    """``USE1-BoxUsage:p4d.24xlarge`` → (compute, p4d.24xlarge); EBS volume → disk; else other.
    us-east-1's usage types carry no region prefix (``BoxUsage:g4dn.xlarge``)."""
    name = usage_type.split("-", 1)[1] if "-" in usage_type.split(":")[0] else usage_type
    head, _, tail = name.partition(":")
    if head in ("BoxUsage", "SpotUsage", "DedicatedUsage") and tail:
        return "compute", tail
    if head == "EBS" and tail.startswith("VolumeUsage"):
        return "disk", None
    return "other", None


#: Cost Explorer's RECORD_TYPE values (its "charge types"; the CUR's line_item_line_item_type,
#: https://docs.aws.amazon.com/cur/latest/userguide/Lineitem-columns.html) by what they mean:
#: - usage: ``Usage``, and the usage a commitment covered: ``DiscountedUsage`` (a Reserved
#:   Instance's — the CUR's reservation columns apply to "DiscountedUsage line items") and
#:   ``SavingsPlanCoveredUsage``; read with the usage types, per machine, as any usage is;
#: - discount: ``SavingsPlanNegation`` (the covered usage's cost taken back) and the discounts
#:   (``BundledDiscount``, ``EdpDiscount``, ``PrivateRateDiscount``, ``DistributorDiscount``;
#:   the console's spellings ``Bundled Discount``, ``Enterprise Discount Program Discount``);
#: - tax, credit (``Credit``, ``Refund``); anything else — the commitments' own fees
#:   (``RIFee``, ``SavingsPlanRecurringFee``, ``SavingsPlanUpfrontFee``), ``Fee``, ``Support`` —
#:   is a piece the ledger does not price. Not by substring: "DiscountedUsage" names usage.
USAGE_RECORD_TYPES = ("Usage", "DiscountedUsage", "SavingsPlanCoveredUsage")
RECORD_KINDS: dict[str, Kind] = {
    "Tax": "tax",
    "Credit": "credit",
    "Refund": "credit",
    **dict.fromkeys(
        (
            "SavingsPlanNegation",
            "BundledDiscount",
            "Bundled Discount",
            "EdpDiscount",
            "Enterprise Discount Program Discount",
            "PrivateRateDiscount",
            "DistributorDiscount",
            "Discount",
        ),
        "discount",
    ),
}


def record_kind(record_type: str) -> Kind:
    """What one Cost Explorer RECORD_TYPE is (:data:`RECORD_KINDS`; else ``other``)."""
    return RECORD_KINDS.get(record_type, "other")


def _machine(key: str) -> str | None:
    _, _, value = key.partition("$")
    return value or None


def _pages(provider: Any, ce: Any, **params: Any) -> list[tuple[date, list[str], dict[str, Any]]]:
    out: list[tuple[date, list[str], dict[str, Any]]] = []
    while True:
        page = provider.call(lambda: ce.get_cost_and_usage(**params), "ce:GetCostAndUsage")
        for result in page.get("ResultsByTime", []):
            day = date.fromisoformat(result["TimePeriod"]["Start"][:10])
            for group in result.get("Groups", []):
                out.append((day, group["Keys"], group["Metrics"]))
        token = page.get("NextPageToken")
        if not token:
            return out
        params["NextPageToken"] = token
