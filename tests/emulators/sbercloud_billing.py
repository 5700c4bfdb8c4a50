"""The Huawei BSS resource fee records for the SberCloud emulator:
``GET /v2/bills/customer-bills/res-fee-records``, the path and query of
``ListCustomerselfResourceRecords`` in huaweicloudsdkbss 3.1.219 (``v2/bss_client.py``);
query names from
``v2/model/list_customerself_resource_records_request.py`` ``attribute_map``, the answer's from
``list_customerself_resource_records_response.py`` and ``res_fee_record_v2.py``.

Served by :class:`tests.emulators.sbercloud.EcsEmulator` (same signature check); tests put
records in ``emu.fee_records`` with :func:`fee_record`.
"""

from __future__ import annotations

import re
from typing import Any

PATH = "/v2/bills/customer-bills/res-fee-records"
DOMAIN_ID = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"
# attribute_map of ListCustomerselfResourceRecordsRequest, less the X-Language header
QUERY = {
    "cycle", "cloud_service_type", "region", "charge_mode", "bill_type", "offset", "limit",
    "resource_id", "enterprise_project_id", "include_zero_record", "method", "sub_customer_id",
    "trade_id", "bill_date_begin", "bill_date_end", "statistic_type",
}  # fmt: skip
_MONTH = re.compile(r"\d{4}-\d{2}")
_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")


class BssReject(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        # BSS answers a bad parameter with CBC.0100 "Invalid parameter" (Huawei BSS API
        # reference, "Error Codes", support.huaweicloud.com/intl/en-us/api-oce/api_error_code.html)
        self.body = {"error_code": "CBC.0100", "error_msg": message}


def fee_record(
    bill_date: str,
    resource_id: str,
    official: str,
    *,
    discount: str = "0",
    coupon: str = "0",
    resource_type: str = "hws.resource.type.vm",
) -> dict[str, Any]:
    """One ResFeeRecordV2 as the API sends it: ``amount`` = list price − discount, paid in cash
    but for what ``coupon`` covers (``amount`` is the sum of the ``*_amount`` payments)."""
    from decimal import Decimal

    amount = Decimal(official) - Decimal(discount)
    return {
        "bill_date": bill_date,
        "bill_type": 5,  # 消费-使用 (usage)
        "customer_id": DOMAIN_ID,
        "region": "ru-moscow-1",
        "cloud_service_type": "hws.service.type.ec2",
        "resource_type": resource_type,
        "resource_id": resource_id,
        "resource_name": resource_id,
        "resource_tag": "",
        "charge_mode": "3",  # on demand
        "official_amount": float(official),
        "discount_amount": float(discount),
        "amount": float(amount),
        "cash_amount": float(amount - Decimal(coupon)),
        "coupon_amount": float(coupon),
        "measure_id": 1,  # 金额单位 1：元
    }


def auth_domains() -> dict[str, Any]:
    """IAM ``KeystoneListAuthDomains`` (``GET /v3/auth/domains``): the account the AK/SK belongs
    to, whose ``domains[0].id`` the SDK's GlobalCredentials take (huaweicloudsdkcore
    ``auth/credentials.py``); fields from huaweicloudsdkiam 3.1.219
    ``v3/model/keystone_list_auth_domains_response.py`` and ``v3/model/domains.py``."""
    links = {"self": "https://iam.example/v3/auth/domains", "previous": None, "next": None}
    domain = {"enabled": True, "id": DOMAIN_ID, "name": "sbercloud-acct", "description": ""}
    return {
        "domains": [{**domain, "links": {"self": "https://iam.example/v3/domains"}}],
        "links": links,
    }


def answer(records: list[dict[str, Any]], query: dict[str, str], currency: str) -> dict[str, Any]:
    """The page of ``records`` the query asks for, by day (``statistic_type=2``) only."""
    unknown = set(query) - QUERY
    if unknown:
        raise BssReject(f"unknown parameter {sorted(unknown)[0]}")
    cycle = query.get("cycle", "")
    if not _MONTH.fullmatch(cycle):  # cycle: mandatory, YYYY-MM (request model docstring)
        raise BssReject("cycle must be YYYY-MM")
    begin, end = query.get("bill_date_begin"), query.get("bill_date_end")
    if (begin is None) != (end is None):  # "两个参数必须同时出现，否则仅按照cycle…进行查询"
        begin = end = None
    for d in (begin, end):
        # "必须和cycle（即资源的消费账期）在同一个月"
        if d is not None and (not _DAY.fullmatch(d) or d[:7] != cycle):
            raise BssReject("bill_date_begin and bill_date_end must be in the cycle's month")
    if query.get("statistic_type", "3") != "2":
        raise BssReject("this emulator serves statistic_type=2 (by day) only")
    rows = [
        r
        for r in records
        if r["bill_date"][:7] == cycle
        and (begin is None or begin <= r["bill_date"] <= end)  # type: ignore[operator]
        and (query.get("include_zero_record") != "false" or r["amount"])
    ]
    offset, limit = int(query.get("offset", "0")), int(query.get("limit", "10"))  # default 10
    return {
        "fee_records": rows[offset : offset + limit],
        "total_count": len(rows),
        "currency": currency,
    }
