"""Azure's own bill for our machines: Cost Management's Query API over the subscription, daily,
grouped by our machine tag.

``POST {scope}/providers/Microsoft.CostManagement/query?api-version=2023-11-01`` with a
QueryDefinition (type ``ActualCost``, timeframe ``Custom`` with ``timePeriod`` from/to, a dataset
of granularity ``Daily``, an aggregation of ``Cost`` by ``Sum``, ``grouping`` and ``filter``),
answered by a QueryResult whose ``properties`` hold ``columns`` (name, type), ``rows`` and
``nextLink`` (azure-rest-api-specs, specification/cost-management/resource-manager/
Microsoft.CostManagement/stable/2023-11-01/costmanagement.json, Query_Usage and the
QueryDefinition/QueryDataset/QueryResult definitions; "Query can have up to 2 group by
clauses", QueryDataset.grouping). Sent through the compute client's own pipeline
(``send_request``): the same credential, endpoint and policies as every other Azure call.

Two queries, as on AWS: usage (ChargeType ``Usage``) by tag × ``MeterCategory`` (``Virtual
Machines`` an instance, ``Storage`` a managed disk, anything else — ``Virtual Network``'s IP
addresses, ``Bandwidth`` — a piece the ledger does not price), and the other charge types by tag ×
``ChargeType`` (``Refund`` a credit; ``Purchase``, ``UnusedReservation``, ``UnusedSavingsPlan``
pieces the ledger does not price). Charge types and meter categories as the cost details fields
name them (learn.microsoft.com/azure/cost-management-billing/automate/
understand-usage-details-fields).
"""

from __future__ import annotations

from datetime import date, timedelta
from decimal import Decimal
from typing import Any

from providers.base import TAG_MACHINE
from providers.billing import Bill, BilledItem, Kind

API_VERSION = "2023-11-01"
#: "Cost and usage data is typically available in Cost Management + Billing in the Azure portal
#: and supporting APIs within 8-24 hours" (Microsoft Learn, "Understand Cost Management data").
LAG = (
    "Cost Management data is typically available within 8-24 hours (Microsoft Learn, "
    '"Understand Cost Management data"): yesterday may still be incomplete'
)
CHARGE_TYPES_OTHER = ["Refund", "Purchase", "UnusedReservation", "UnusedSavingsPlan"]


def fetch(provider: Any, start: date, end: date) -> Bill:
    compute, _ = provider._clients()
    scope = f"/subscriptions/{provider._subscription_id()}"
    period = {
        "from": f"{start.isoformat()}T00:00:00+00:00",
        "to": f"{(end - timedelta(days=1)).isoformat()}T23:59:59+00:00",  # "to" is inclusive
    }
    usage = _query(provider, compute, scope, period, "MeterCategory", ["Usage"])
    others = _query(provider, compute, scope, period, "ChargeType", CHARGE_TYPES_OTHER)
    items: list[BilledItem] = []
    for day, machine, category, cost, currency in usage:
        items.append(BilledItem(day, cost, currency, meter_kind(category), machine, category))
    for day, machine, charge, cost, currency in others:
        kind: Kind = "credit" if charge == "Refund" else "other"
        items.append(BilledItem(day, cost, currency, kind, machine, charge))
    return Bill(
        "azure",
        [i for i in items if i.amount],
        f"Cost Management Query (ActualCost), daily, grouped by tag {TAG_MACHINE}",
        LAG,
        1,
    )


def meter_kind(category: str) -> Kind:
    if category == "Virtual Machines":
        return "compute"
    if category == "Storage":
        return "disk"
    return "other"


def _query(
    provider: Any, compute: Any, scope: str, period: dict[str, str], by: str, charge: list[str]
) -> list[tuple[date, str | None, str, Decimal, str]]:
    from azure.core.rest import HttpRequest

    body = {
        "type": "ActualCost",
        "timeframe": "Custom",
        "timePeriod": period,
        "dataset": {
            "granularity": "Daily",
            "aggregation": {"totalCost": {"name": "Cost", "function": "Sum"}},
            "grouping": [
                {"type": "TagKey", "name": TAG_MACHINE},
                {"type": "Dimension", "name": by},
            ],
            "filter": {"dimensions": {"name": "ChargeType", "operator": "In", "values": charge}},
        },
    }
    url = f"{scope}/providers/Microsoft.CostManagement/query?api-version={API_VERSION}"
    out: list[tuple[date, str | None, str, Decimal, str]] = []
    while url:

        def post(u: str = url) -> dict[str, Any]:
            r = compute.send_request(HttpRequest("POST", u, json=body))
            r.raise_for_status()
            answer: dict[str, Any] = r.json()
            return answer

        props = provider.call(post, "costmanagement:query")["properties"]
        names = [c["name"] for c in props["columns"]]
        for row in props.get("rows", []):
            r = dict(zip(names, row, strict=True))
            day = date.fromisoformat(str(int(r["UsageDate"])))  # a number: 20261102
            tag = r.get("TagValue") if r.get("TagKey") == TAG_MACHINE else None
            out.append((day, tag or None, r[by], Decimal(str(r["Cost"])), r["Currency"]))
        url = props.get("nextLink") or ""
    return out
