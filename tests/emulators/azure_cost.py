"""Cost Management's Query API for the ARM emulator (tests/emulators/azure.py routes
``POST /subscriptions/{id}/providers/Microsoft.CostManagement/query`` here).

From the REST spec (azure-rest-api-specs, specification/cost-management/resource-manager/
Microsoft.CostManagement/stable/2023-11-01/costmanagement.json): a QueryDefinition has ``type``
(Usage, ActualCost, AmortizedCost) and ``timeframe`` (``Custom`` needs ``timePeriod`` with
``from`` and ``to``), a ``dataset`` with ``granularity`` (``Daily``), ``aggregation`` (name →
{name: column, function: Sum}), ``grouping`` ({type: Dimension | TagKey, name}; "Query can have
up to 2 group by clauses") and ``filter`` (``dimensions``: {name, operator: In, values}). The
QueryResult's ``properties`` hold ``columns`` ({name, type}) and ``rows``: the aggregation,
``UsageDate`` as a number (20261102) for daily granularity, a ``TagKey`` grouping as two
columns ``TagKey`` and ``TagValue``, a Dimension grouping as a column of its name, and
``Currency`` (as the spec's Query examples, e.g. "BillingAccountQuery.json", show them).

Records are cost details rows: {day, cost, currency, tags, ChargeType, MeterCategory}.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import date, datetime
from decimal import Decimal
from typing import Any

API_VERSIONS = {"2023-03-01", "2023-07-01-preview", "2023-08-01", "2023-11-01", "2024-08-01"}
TYPES = {"Usage", "ActualCost", "AmortizedCost"}
DIMENSIONS = {"ChargeType", "MeterCategory", "ResourceGroupName", "ResourceId", "ServiceName"}


class QueryError(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def query(records: list[dict[str, Any]], api_version: str, body: Any) -> dict[str, Any]:
    """The QueryResult for ``body`` over ``records`` (raises QueryError: HTTP 400)."""
    if api_version not in API_VERSIONS:
        raise QueryError(f"The api-version '{api_version}' is invalid.")
    if not isinstance(body, dict) or body.get("type") not in TYPES:
        raise QueryError(
            "Invalid query definition: type must be Usage, ActualCost or AmortizedCost"
        )
    if body.get("timeframe") != "Custom" or "timePeriod" not in body:
        raise QueryError("Invalid query definition: a Custom timeframe needs timePeriod")
    lo = datetime.fromisoformat(body["timePeriod"]["from"]).date()
    hi = datetime.fromisoformat(body["timePeriod"]["to"]).date()  # inclusive
    ds = body.get("dataset") or {}
    if ds.get("granularity") != "Daily":
        raise QueryError("The emulator answers Daily granularity only")
    aggs = ds.get("aggregation") or {}
    if any(a.get("function") != "Sum" or a.get("name") != "Cost" for a in aggs.values()):
        raise QueryError("Invalid aggregation: the emulator sums Cost")
    grouping = ds.get("grouping") or []
    if len(grouping) > 2:
        raise QueryError("Invalid query definition: query can have up to 2 group by clauses")
    for g in grouping:
        if g.get("type") not in ("Dimension", "TagKey") or (
            g["type"] == "Dimension" and g.get("name") not in DIMENSIONS
        ):
            raise QueryError(f"Invalid grouping {g!r}")
    keep = _filter(ds.get("filter"))
    sums: dict[tuple[Any, ...], Decimal] = defaultdict(Decimal)
    for r in records:
        if not (lo <= r["day"] <= hi) or not keep(r):
            continue
        key: list[Any] = [int(r["day"].strftime("%Y%m%d"))]
        for g in grouping:
            if g["type"] == "TagKey":
                value = (r.get("tags") or {}).get(g["name"])
                key += [g["name"] if value is not None else "", value or ""]
            else:
                key.append(r[g["name"]])
        key.append(r["currency"])
        sums[tuple(key)] += Decimal(str(r["cost"]))
    columns = [{"name": "Cost", "type": "Number"}, {"name": "UsageDate", "type": "Number"}]
    for g in grouping:
        if g["type"] == "TagKey":
            columns += [
                {"name": "TagKey", "type": "String"},
                {"name": "TagValue", "type": "String"},
            ]
        else:
            columns.append({"name": g["name"], "type": "String"})
    columns.append({"name": "Currency", "type": "String"})
    rows = [[float(cost), *key] for key, cost in sorted(sums.items())]
    return {
        "id": "subscriptions/x/providers/Microsoft.CostManagement/query/emulated",
        "name": "emulated",
        "type": "Microsoft.CostManagement/query",
        "properties": {"nextLink": None, "columns": columns, "rows": rows},
    }


def _filter(f: Any) -> Any:
    if not f:
        return lambda r: True
    dim = f.get("dimensions")
    if not dim or dim.get("operator") != "In" or dim.get("name") not in DIMENSIONS:
        raise QueryError(f"The emulator does not evaluate the filter {f!r}")
    values = set(dim["values"])
    return lambda r: r[dim["name"]] in values


def record(day: date, cost: str, meter: str, machine: str | None = None, charge: str = "Usage"):
    """A cost details record for the emulator's books."""
    return {
        "day": day,
        "cost": cost,
        "currency": "USD",
        "tags": {"provisioner-machine": machine} if machine else {},
        "ChargeType": charge,
        "MeterCategory": meter,
    }
