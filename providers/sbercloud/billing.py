"""SberCloud's own bill for our machines: the Huawei BSS resource fee records,
``ListCustomerselfResourceRecords`` (``GET /v2/bills/customer-bills/res-fee-records``,
huaweicloudsdkbss 3.1.219 ``v2/bss_client.py``), by day (``statistic_type=2``: "1：按账期
2：按天 3：按明细", ``v2/model/list_customerself_resource_records_request.py``).

Each record (``v2/model/res_fee_record_v2.py``, ``ResFeeRecordV2``) is one resource's fee on one
``bill_date``, with its ``resource_id`` and ``resource_type`` (``hws.resource.type.vm`` for an ECS
server, as that model's docstring gives it). A record is ours when its ``resource_id`` is the
server id the ledger recorded for a machine (``provisioner.bill`` matches it); the records'
``resource_tag`` is a free string whose format the model does not give, so it is not read.

Amounts: ``amount`` ("应付金额", what is due) "等于 cash_amount, credit_amount, coupon_amount, …
的总和" and is the list price (``official_amount``, "官网价") less ``discount_amount`` ("优惠金额",
business and promotion discounts). So each record gives a usage line at the list price and a
discount line; what vouchers paid (``coupon_amount``, "代金券支付金额") is a credit line.
The response's ``currency`` is the account's ("货币单位代码", RUB on cloud.ru).

Days: ``cycle`` (a month) and ``bill_date`` are in GMT+08:00 ("按照东八区时间截取"); they are taken
as the ledger's UTC days, so a record can sit eight hours off the ledger's day edges.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from datetime import date, timedelta
from decimal import Decimal
from typing import Any

from providers.billing import Bill, BilledItem, BillingUnsupported, Kind

#: Huawei bills a pay-per-use hour about an hour after it ends ("if a pay-per-use ECS (which is
#: billed on an hourly basis) is deleted at 08:30 … you will not be billed for the 08:00 to 09:00
#: hour until about 10:00", support.huaweicloud.com/intl/pt-br/price-cce/cce_03_0016.html, "Bill
#: Generation"); a GMT+08:00 day ends at 16:00 UTC, so yesterday is complete, today is not.
LAG = (
    "Huawei bills a pay-per-use hour about an hour after it ends (Huawei Cloud pricing docs, "
    "'Bill Generation'): today is taken as not billed yet"
)
ENV_DOMAIN = ("SBERCLOUD_DOMAIN_ID", "HUAWEICLOUD_SDK_DOMAIN_ID")
VM = "hws.resource.type.vm"  # an ECS server (ResFeeRecordV2.resource_type docstring)
BY_DAY = 2  # statistic_type: by day
PAGE = 100  # limit per call; the model gives the default (10), not the largest value


def fetch(provider: Any, start: date, end: date) -> Bill:
    """The fee records of [start, end), month by month (``bill_date_begin`` and
    ``bill_date_end`` "必须和cycle…在同一个月")."""
    endpoint = provider.options.bss_endpoint
    if not endpoint:
        raise BillingUnsupported(
            "sbercloud: name the BSS endpoint in settings (clouds.sbercloud.bss_endpoint): the "
            "resource fee records are read from the billing service, not from ECS"
        )
    clients: list[Any] = []  # built on the first call, inside its retries: IAM may throttle

    def ask(request: Any) -> Any:
        if not clients:
            clients.append(_client(provider, endpoint))
        return clients[0].list_customerself_resource_records(request)

    items: list[BilledItem] = []
    currency = provider.spec.currency
    for first, last in _months(start, end):
        for page in _pages(provider, ask, first, last):
            currency = page.currency or currency
            for rec in page.fee_records or []:
                items.extend(_items(rec, currency))
    return Bill(
        "sbercloud",
        [i for i in items if i.amount],
        "BSS ListCustomerselfResourceRecords, daily, matched by resource id",
        LAG,
        1,
        [
            "sbercloud: records are matched by the server id; disks and addresses bought apart "
            "from the server show as untagged, and days are GMT+08:00 days"
        ],
    )


def _items(rec: Any, currency: str) -> list[BilledItem]:
    day = date.fromisoformat(rec.bill_date[:10])
    kind: Kind = "compute" if rec.resource_type == VM else "other"
    what = rec.resource_type or rec.cloud_service_type or ""
    official = rec.official_amount
    discount = Decimal(rec.discount_amount or 0)
    listed = Decimal(official) if official is not None else Decimal(rec.amount or 0) + discount
    rid = rec.resource_id or None
    return [
        BilledItem(day, listed, currency, kind, what=what, resource_id=rid),
        BilledItem(day, -discount, currency, "discount", what="discount", resource_id=rid),
        BilledItem(
            day,
            -Decimal(rec.coupon_amount or 0),
            currency,
            "credit",
            what="coupon",
            resource_id=rid,
        ),
    ]


def _pages(provider: Any, ask: Callable[[Any], Any], first: date, last: date) -> Iterator[Any]:
    """The pages of one month's fee records (``first`` to ``last``), until a short one."""
    from huaweicloudsdkbss.v2 import model

    offset = 0
    while True:
        request = model.ListCustomerselfResourceRecordsRequest(
            cycle=first.strftime("%Y-%m"),
            bill_date_begin=first.isoformat(),
            bill_date_end=last.isoformat(),
            statistic_type=BY_DAY,
            include_zero_record=False,
            offset=offset,
            limit=PAGE,
        )
        page = provider.call(lambda r=request: ask(r), "bss:ListCustomerselfResourceRecords")
        yield page
        records = page.fee_records or []
        offset += len(records)
        if not records or offset >= (page.total_count or 0):
            return


def _months(start: date, end: date) -> list[tuple[date, date]]:
    """[start, end) as (first, last) day pairs, one per calendar month, both inclusive."""
    out = []
    first = start
    while first < end:
        nxt = (first.replace(day=1) + timedelta(days=32)).replace(day=1)
        last = min(nxt, end) - timedelta(days=1)
        out.append((first, last))
        first = nxt
    return out


def _client(provider: Any, endpoint: str) -> Any:
    """A BssClient on ``endpoint``: a global service, signed with GlobalCredentials (the SDK's
    ``BssClient.new_builder`` asks for them), which send the account's domain id as
    ``X-Domain-Id``; without one in settings the SDK looks it up in IAM (``GET /v3/auth/domains``,
    huaweicloudsdkcore ``auth/credentials.py`` ``GlobalCredentials.process_auth_params``)."""
    from huaweicloudsdkbss.v2 import BssClient
    from huaweicloudsdkcore.auth.credentials import GlobalCredentials
    from huaweicloudsdkcore.exceptions.exceptions import SdkException
    from huaweicloudsdkcore.http.http_config import HttpConfig
    from huaweicloudsdkcore.region.region import Region

    from providers.base import AuthError, Throttled
    from providers.sbercloud import ENV_AK, ENV_SK, env

    ak, sk = env(ENV_AK), env(ENV_SK)
    if not ak or not sk:
        raise AuthError(
            "sbercloud: no credentials: set SBERCLOUD_ACCESS_KEY and SBERCLOUD_SECRET_KEY",
            code="NoCredentials",
        )
    config = HttpConfig.get_default_config()
    config.retry_times = 0
    config.timeout = (10, 60)
    domain = provider.options.domain_id or next(
        (os.environ[n] for n in ENV_DOMAIN if os.environ.get(n)), None
    )
    credentials = GlobalCredentials(ak, sk, domain)
    builder = BssClient.new_builder().with_http_config(config).with_credentials(credentials)
    if domain:
        builder.with_endpoints([endpoint])
    else:  # the SDK asks IAM (KeystoneListAuthDomains) for the domain while building
        credentials.with_iam_endpoint(provider.iam_endpoint)
        builder.with_region(Region(provider.region, endpoint))
    try:
        return builder.build()
    except SdkException as e:
        # the SDK wraps IAM's answer in a plain SdkException; the answer is its context
        cause = e.__context__ if isinstance(e.__context__, SdkException) else e
        err = provider.map_error(cause, "find the account's domain id via IAM")
        raise (err if isinstance(err, Throttled) else AuthError(str(err), code=err.code)) from e
