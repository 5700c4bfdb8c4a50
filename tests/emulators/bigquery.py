"""A local BigQuery ``jobs.query`` emulator holding a Cloud Billing standard usage cost export
table, for ``provisioner bill`` on GCP.

Wire shape from the BigQuery REST reference:
- ``POST /bigquery/v2/projects/{projectId}/queries`` takes a QueryRequest (``query``,
  ``useLegacySql``, ``parameterMode``, ``queryParameters``, ``maxResults``) and answers a
  QueryResponse: ``kind: bigquery#queryResponse``, ``schema.fields``, ``jobReference``
  (projectId, jobId, location), ``totalRows`` (a string), ``rows`` as ``{"f": [{"v": …}]}`` with
  every value a string or null, ``pageToken`` when more rows remain, ``jobComplete``
  (https://cloud.google.com/bigquery/docs/reference/rest/v2/jobs/query);
- ``GET /bigquery/v2/projects/{projectId}/queries/{jobId}?pageToken=…`` (jobs.getQueryResults)
  pages on (https://cloud.google.com/bigquery/docs/reference/rest/v2/jobs/getQueryResults);
- errors as ``{"error": {"code", "message", "errors": [{"reason"}], "status"}}``; a table that does
  not exist is 404 ``notFound`` "Not found: Table …".

It evaluates the SQL it understands and refuses (400 ``invalidQuery``) any other: a SELECT list
of export columns (``cost``, ``currency``, ``cost_type``, ``service.description``,
``sku.description``, ``usage.amount_in_pricing_units``, ``usage.pricing_unit``), a label's
value (``(SELECT x.value FROM UNNEST(labels|system_labels) AS x WHERE x.key = 'K')``), the sum of
the row's credits, ``FORMAT_DATE('%F', DATE(usage_start_time))``; ``FROM `table```; and ``WHERE
usage_start_time >= @start AND usage_start_time < @end`` with TIMESTAMP named parameters, and
optionally ``AND _PARTITIONTIME >= TIMESTAMP_SUB(@p, INTERVAL n DAY)``: the table is partitioned
by export day, and a query with that filter reads only those partitions (:attr:`rows_read`
counts what each query read: BigQuery bills by the bytes read). Rows
are the export's schema (https://cloud.google.com/billing/docs/how-to/export-data-bigquery-tables/
standard-usage): labels and system_labels as lists of {key, value}, credits as {name, amount,
type}, usage as {amount_in_pricing_units, pricing_unit}.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Callable
from datetime import date, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

_QUERY = re.compile(
    r"^\s*SELECT\s+(?P<select>.*?)\s+FROM\s+`(?P<table>[^`]+)`\s+WHERE\s+(?P<where>.*?)\s*$",
    re.S | re.I,
)
_WHERE = re.compile(
    r"usage_start_time\s*>=\s*@(\w+)\s+AND\s+usage_start_time\s*<\s*@(\w+)"
    r"(?:\s+AND\s+_PARTITIONTIME\s*>=\s*TIMESTAMP_SUB\(@(\w+),\s*INTERVAL\s+(\d+)\s+DAY\))?",
    re.I,
)
_LABEL = re.compile(
    r"\(SELECT (\w+)\.value FROM UNNEST\((labels|system_labels)\) AS \1 WHERE \1\.key = '([^']+)'\)"
)
_CREDITS = re.compile(r"\(SELECT SUM\((\w+)\.amount\) FROM UNNEST\(credits\) AS \1\)")
_COLUMNS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "cost": lambda r: r["cost"],
    "currency": lambda r: r["currency"],
    "cost_type": lambda r: r.get("cost_type", "regular"),
    "service.description": lambda r: r["service"]["description"],
    "sku.description": lambda r: r["sku"]["description"],
    "usage.amount_in_pricing_units": lambda r: r["usage"]["amount_in_pricing_units"],
    "usage.pricing_unit": lambda r: r["usage"]["pricing_unit"],
    "FORMAT_DATE('%F', DATE(usage_start_time))": lambda r: r["usage_start_time"].date().isoformat(),
}


class BadQuery(Exception):
    pass


def _partition(row: dict[str, Any]) -> date:
    """The day partition a row is in: the day it was exported (``export_time``; a row given
    none was exported six hours after its usage began). BigQuery prunes partitions on a
    ``_PARTITIONTIME`` filter and bills by the bytes of the partitions read
    (https://cloud.google.com/bigquery/docs/querying-partitioned-tables); the standard usage
    export has ``export_time`` (billing docs, export-data-bigquery-tables/standard-usage)."""
    exported = row.get("export_time") or row["usage_start_time"] + timedelta(hours=6)
    return exported.date()


class BigQueryEmulator:
    def __init__(self, page_size: int = 1000) -> None:
        self.tables: dict[str, list[dict[str, Any]]] = {}  # "project.dataset.table" → rows
        self.rows_read: list[int] = []  # per query: the rows of the partitions it read
        self.page_size = page_size
        self.requests: list[tuple[str, str]] = []
        self._pages: dict[str, list[dict[str, Any]]] = {}  # jobId → rows not yet served
        emulator = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                emulator._answer(self, "POST", json.loads(self.rfile.read(n) or b"{}"))

            def do_GET(self) -> None:
                emulator._answer(self, "GET", None)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # --- the wire ----------------------------------------------------------------------------

    def _answer(self, h: BaseHTTPRequestHandler, method: str, body: Any) -> None:
        url = urlsplit(h.path)
        self.requests.append((method, url.path))
        m = re.fullmatch(r"/bigquery/v2/projects/([^/]+)/queries(?:/([^/]+))?", url.path)
        try:
            if m and method == "POST" and not m[2]:
                status, answer = 200, self._query(m[1], body)
            elif m and method == "GET" and m[2]:
                token = parse_qs(url.query).get("pageToken", [""])[0]
                status, answer = 200, self._page(m[1], m[2], token)
            else:
                status, answer = 404, _error(404, "notFound", f"Not found: {url.path}")
        except BadQuery as e:
            status, answer = 400, _error(400, "invalidQuery", str(e))
        except LookupError as e:
            status, answer = 404, _error(404, "notFound", str(e))
        data = json.dumps(answer).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json; charset=UTF-8")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _query(self, project: str, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("useLegacySql", True):
            # QueryRequest.useLegacySql defaults to true; backquoted names are standard SQL
            raise BadQuery("Invalid table name: use standard SQL (useLegacySql: false)")
        m = _QUERY.match(body.get("query", ""))
        if not m:
            raise BadQuery("Syntax error: the emulator reads SELECT … FROM `table` WHERE …")
        table = m["table"]
        if table not in self.tables:
            raise LookupError(f"Not found: Table {table.replace('.', ':', 1)} was not found")
        params = {
            p["name"]: p
            for p in body.get("queryParameters", [])
            if body["parameterMode"] == "NAMED"
        }
        w = _WHERE.fullmatch(m["where"].strip())
        if not w:
            raise BadQuery(f"the emulator does not evaluate WHERE {m['where']!r}")
        lo, hi = (_timestamp(params, name) for name in (w[1], w[2]))
        select = [_projection(part) for part in _split(m["select"])]
        read = self.tables[table]
        if w[3]:  # partition pruning: only partitions from that day on are read (and billed)
            first = (_timestamp(params, w[3]) - timedelta(days=int(w[4]))).date()
            read = [r for r in read if _partition(r) >= first]
        self.rows_read.append(len(read))
        rows = [
            {"f": [{"v": _cell(fn(r))} for _, fn in select]}
            for r in read
            if lo <= r["usage_start_time"] < hi
        ]
        job = {"projectId": project, "jobId": f"job_{uuid.uuid4().hex}", "location": "US"}
        answer: dict[str, Any] = {
            "kind": "bigquery#queryResponse",
            "schema": {"fields": [{"name": alias, "type": "STRING"} for alias, _ in select]},
            "jobReference": job,
            "totalRows": str(len(rows)),
            "jobComplete": True,
            "cacheHit": False,
        }
        answer["rows"], rest = rows[: self.page_size], rows[self.page_size :]
        if rest:
            self._pages[job["jobId"]] = rest
            answer["pageToken"] = job["jobId"]
        return answer

    def _page(self, project: str, job_id: str, token: str) -> dict[str, Any]:
        if token != job_id or job_id not in self._pages:
            raise LookupError(f"Not found: Job {project}:{job_id}")
        rows = self._pages.pop(job_id)
        answer: dict[str, Any] = {
            "kind": "bigquery#getQueryResultsResponse",
            "jobReference": {"projectId": project, "jobId": job_id, "location": "US"},
            "jobComplete": True,
            "rows": rows[: self.page_size],
        }
        if rows[self.page_size :]:
            self._pages[job_id] = rows[self.page_size :]
            answer["pageToken"] = job_id
        return answer


def _split(select: str) -> list[str]:
    """The SELECT list at top-level commas."""
    parts, depth, cur = [], 0, ""
    for ch in select:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*parts, cur.strip()]


def _projection(part: str) -> tuple[str, Callable[[dict[str, Any]], Any]]:
    expr, _, alias = part.rpartition(" AS ")
    if not expr:
        expr, alias = part, part.split(".")[-1]
    expr = " ".join(expr.split())
    if expr in _COLUMNS:
        return alias, _COLUMNS[expr]
    if m := _LABEL.fullmatch(expr):
        field, key = m[2], m[3]
        return alias, lambda r: next(
            (lb["value"] for lb in r.get(field, []) if lb["key"] == key), None
        )
    if _CREDITS.fullmatch(expr):
        return (
            alias,
            lambda r: sum(float(c["amount"]) for c in r["credits"]) if r.get("credits") else None,
        )
    raise BadQuery(f"the emulator does not evaluate {expr!r}")


def _timestamp(params: dict[str, Any], name: str) -> datetime:
    p = params.get(name)
    if p is None:
        raise BadQuery(f"Query parameter '{name}' not found")
    if p["parameterType"]["type"] != "TIMESTAMP":
        raise BadQuery(f"No matching signature for operator >= for argument types: TIMESTAMP, {p}")
    return datetime.fromisoformat(p["parameterValue"]["value"].replace(" ", "T"))


def _cell(v: Any) -> str | None:
    """Every value goes on the wire as a string (the REST API's JSON rows), null as null."""
    return None if v is None else str(v)


def _error(code: int, reason: str, message: str) -> dict[str, Any]:
    status = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND"}.get(code, "UNKNOWN")
    return {
        "error": {
            "code": code,
            "message": message,
            "errors": [{"message": message, "domain": "global", "reason": reason}],
            "status": status,
        }
    }
