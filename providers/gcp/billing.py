"""Google Cloud's own bill for our machines: the Cloud Billing standard usage cost export in
BigQuery (the table named in settings, ``billing_table``), read with one ``jobs.query`` call.

The export's schema (https://cloud.google.com/billing/docs/how-to/export-data-bigquery-tables/
standard-usage): per row ``service.description``, ``sku.description``, ``usage_start_time``,
``labels`` (ARRAY<STRUCT<key, value>>: the resource's labels, ours among them),
``system_labels`` (``compute.googleapis.com/machine_spec``: a VM's machine type), ``cost``
(before credits), ``currency``, ``usage.amount_in_pricing_units`` and ``usage.pricing_unit``,
``credits`` (ARRAY<STRUCT<name, amount, type>>, negative amounts) and ``cost_type``
(``regular``, ``tax``, ``adjustment``, ``rounding_error``).

``jobs.query`` (https://cloud.google.com/bigquery/docs/reference/rest/v2/jobs/query): POST
``/bigquery/v2/projects/{projectId}/queries`` with ``query``, ``useLegacySql: false`` and named
``queryParameters``; the QueryResponse carries ``jobComplete``, ``jobReference``, ``rows`` (each
``{"f": [{"v": …}]}`` in the SELECT's order, values as strings) and ``pageToken``; the rest comes
from ``jobs.getQueryResults`` (GET ``/projects/{projectId}/queries/{jobId}``).
"""

from __future__ import annotations

from datetime import date
from decimal import Decimal
from typing import Any

from providers.base import TAG_MACHINE, AuthError, InvalidRequest
from providers.billing import Bill, BilledItem, BillingUnsupported, Kind

API = "https://bigquery.googleapis.com"
MACHINE_SPEC = "compute.googleapis.com/machine_spec"
#: Google gives no figure: "Cloud Billing exports usage and cost data to your BigQuery dataset
#: at regular intervals (there are no delivery or latency guarantees for the export to
#: BigQuery)" (export-data-bigquery-tables, "Frequency of data loads"). We take a day as
#: complete one day after it ends, and say so.
LAG = (
    "the BigQuery billing export has no delivery or latency guarantee (Cloud Billing docs, "
    '"Frequency of data loads"): days from yesterday on are taken as not billed yet'
)
COLUMNS = (
    "machine",
    "day",
    "cost_type",
    "service",
    "sku",
    "machine_spec",
    "cost",
    "currency",
    "usage_amount",
    "pricing_unit",
    "credits",
)


def query_text(table: str) -> str:
    """The one query: every row of the period, our label and the machine type pulled out.

    Bounded by partition: the export table is partitioned by day on ``_PARTITIONTIME`` (the day
    a row was exported), and BigQuery bills a query by the bytes of the partitions it reads
    (https://cloud.google.com/bigquery/docs/querying-partitioned-tables: "filter on the
    _PARTITIONTIME pseudocolumn" prunes the rest). A row is exported after its usage, so none of
    the period's rows is in a partition before its start (one day earlier, for the partition
    day's own time zone); rows exported late (credits, corrections) are in later partitions, so
    there is no upper bound: a past month's query reads from its start to today."""
    return f"""SELECT
  (SELECT l.value FROM UNNEST(labels) AS l WHERE l.key = '{TAG_MACHINE}') AS machine,
  FORMAT_DATE('%F', DATE(usage_start_time)) AS day,
  cost_type,
  service.description AS service,
  sku.description AS sku,
  (SELECT s.value FROM UNNEST(system_labels) AS s WHERE s.key = '{MACHINE_SPEC}') AS machine_spec,
  cost,
  currency,
  usage.amount_in_pricing_units AS usage_amount,
  usage.pricing_unit AS pricing_unit,
  (SELECT SUM(c.amount) FROM UNNEST(credits) AS c) AS credits
FROM `{table}`
WHERE usage_start_time >= @start AND usage_start_time < @end
  AND _PARTITIONTIME >= TIMESTAMP_SUB(@start, INTERVAL 1 DAY)"""


def fetch(provider: Any, start: date, end: date) -> Bill:
    table = provider.options.billing_table
    if not table:
        raise BillingUnsupported(
            "gcp: name the Cloud Billing export table in settings (clouds.gcp.billing_table: "
            "PROJECT.DATASET.gcp_billing_export_v1_BILLING_ACCOUNT_ID); export it as "
            "https://cloud.google.com/billing/docs/how-to/export-data-bigquery-setup says"
        )
    project = table.split(".")[0] if table.count(".") == 2 else provider._project()
    body = {
        "query": query_text(table),
        "useLegacySql": False,
        "parameterMode": "NAMED",
        "queryParameters": [
            _timestamp("start", start),
            _timestamp("end", end),
        ],
        "timeoutMs": 60_000,
    }
    rows = _query(provider, project, body)
    items: list[BilledItem] = []
    for raw in rows:
        items.extend(_billed(dict(zip(COLUMNS, (cell.get("v") for cell in raw["f"]), strict=True))))
    return Bill(
        "gcp",
        [i for i in items if i.amount],
        f"Cloud Billing export {table} (BigQuery jobs.query), by label {TAG_MACHINE}",
        LAG,
        1,
    )


def _billed(r: dict[str, Any]) -> list[BilledItem]:
    """One row of the export (by COLUMNS) as the ledger's items: its cost, and its credits."""
    d = date.fromisoformat(r["day"])
    kind = row_kind(r["cost_type"], r["service"] or "", r["sku"] or "")
    items = [
        BilledItem(
            d,
            Decimal(r["cost"]),
            r["currency"],
            kind,
            r["machine"] or None,
            r["sku"] or "",
            r["machine_spec"] if kind == "compute" else None,
        )
    ]
    if r["credits"] and Decimal(r["credits"]):
        items.append(
            BilledItem(
                d,
                Decimal(r["credits"]),
                r["currency"],
                "credit",
                r["machine"] or None,
                f"credits on {r['sku']}",
            )
        )
    return items


def row_kind(cost_type: str, service: str, sku: str) -> Kind:
    """A row's kind: tax and adjustments by ``cost_type``; Compute Engine's instance SKUs
    (cores, RAM, GPUs: "N1 Predefined Instance Core running in Americas", "Nvidia Tesla T4 GPU
    running in Americas") and persistent disks ("Storage PD Capacity", "Balanced PD Capacity",
    "SSD backed PD Capacity"), as the SKUs are named in the Cloud Billing Catalog; anything else
    (an external IP address, egress) is a piece the ledger does not price."""
    if cost_type == "tax":
        return "tax"
    if cost_type == "adjustment":
        return "credit"
    if service != "Compute Engine":
        return "other"
    low = sku.lower()
    if "pd capacity" in low or "pd snapshot" in low:
        return "disk"
    if any(w in low for w in ("instance core", "instance ram", " gpu ", "gpu running")):
        return "compute"
    return "other"


def _timestamp(name: str, day: date) -> dict[str, Any]:
    return {
        "name": name,
        "parameterType": {"type": "TIMESTAMP"},
        "parameterValue": {"value": f"{day.isoformat()} 00:00:00+00"},
    }


def _query(provider: Any, project: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """jobs.query, then jobs.getQueryResults until the job is complete and every page read."""
    from google.auth.transport.requests import AuthorizedSession  # lazily: the SDK's transport

    root = (provider.options.bigquery_endpoint or API).rstrip("/")
    session = AuthorizedSession(provider._credentials()[0])
    base = f"{root}/bigquery/v2/projects/{project}/queries"

    def call(method: str, url: str, **kw: Any) -> dict[str, Any]:
        r = session.request(method, url, timeout=60, **kw)
        if r.status_code in (401, 403):
            raise AuthError(f"gcp: BigQuery refused the billing query: {_message(r)}", code="auth")
        if r.status_code >= 400:
            raise InvalidRequest(f"gcp: BigQuery billing query failed: {_message(r)}")
        answer: dict[str, Any] = r.json()
        return answer

    page = provider.call(lambda: call("POST", base, json=body), "bigquery:jobs.query")
    rows: list[dict[str, Any]] = []
    while True:
        if page.get("jobComplete", True):
            rows.extend(page.get("rows", []))
        token = page.get("pageToken")
        if page.get("jobComplete", True) and not token:
            return rows
        job = page["jobReference"]
        params = {"location": job.get("location")} if job.get("location") else {}
        if token:
            params["pageToken"] = token
        url = f"{base}/{job['jobId']}"
        page = provider.call(
            lambda u=url, p=params: call("GET", u, params=p), "bigquery:jobs.getQueryResults"
        )


def _message(r: Any) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}"
