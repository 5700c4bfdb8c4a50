"""Yandex Cloud's own bill for our machines: the Billing usage API,
``ConsumptionCoreService.GetLabelKeyUsageReport`` (yandexcloud:
yandex/cloud/billing/usage_records/v1/consumption_core_service.proto), daily, over the billing
account named in settings.

The report groups cost by label key and value ("Results are organized by label key-value pairs,
with usage, costs, and credits detailed for each"; a resource's cost is repeated under each of
its labels, not split), with a daily time series per pair (``periodic``: ``cost``,
``credit_details.credit``, ``expense = cost + credit``). We keep the pairs of our machine label.
What it cannot tell: which part of a machine's cost was its VM, its disks or its address (one
sum per label value: kind ``usage``), and usage without our label (the report has no "no label"
group). Prices in Yandex Cloud include VAT, so there is no tax line.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

from providers.base import TAG_MACHINE
from providers.billing import Bill, BilledItem, BillingUnsupported

#: The API's documentation gives no figure for how late usage shows; a day is taken as complete
#: one day after it ends, as on the other clouds.
LAG = "the Billing usage API documents no delay: days from yesterday on are taken as not billed yet"


def fetch(provider: Any, start: date, end: date) -> Bill:
    from google.protobuf.timestamp_pb2 import Timestamp
    from yandex.cloud.billing.usage_records.v1 import common_types_pb2
    from yandex.cloud.billing.usage_records.v1.consumption_core_service_pb2 import (
        UsageReportRequest,
    )
    from yandex.cloud.billing.usage_records.v1.consumption_core_service_pb2_grpc import (
        ConsumptionCoreServiceStub,
    )

    account = provider.options.billing_account_id
    if not account:
        raise BillingUnsupported(
            "yandex: name the billing account in settings (clouds.yandex.billing_account_id): "
            "the Billing usage API reports per billing account"
        )
    first, last = Timestamp(), Timestamp()
    first.FromDatetime(datetime.combine(start, datetime.min.time(), UTC))
    last.FromDatetime(datetime.combine(end - timedelta(days=1), datetime.min.time(), UTC))
    request = UsageReportRequest(
        billing_account_id=account,
        start_date=first,
        end_date=last,  # inclusive, "the time component … is ignored"
        aggregation_period=common_types_pb2.DAY,
    )
    answer = provider._rpc(
        ConsumptionCoreServiceStub, "GetLabelKeyUsageReport", request, "billing usage report"
    )
    currency = common_types_pb2.Currency.Name(answer.currency)
    items: list[BilledItem] = []
    for entity in answer.entities_data:
        if entity.label.key != TAG_MACHINE:
            continue
        for p in entity.periodic:
            day = p.timestamp.ToDatetime(tzinfo=UTC).date()
            machine = entity.label.value or None
            cost, credit = (
                Decimal(p.cost.value or "0"),
                Decimal(p.credit_details.credit.value or "0"),
            )
            items.append(BilledItem(day, cost, currency, "usage", machine, "label report"))
            items.append(BilledItem(day, credit, currency, "credit", machine, "credits"))
    return Bill(
        "yandex",
        [i for i in items if i.amount],
        f"Billing usage API GetLabelKeyUsageReport, daily, label {TAG_MACHINE}",
        LAG,
        1,
        [
            "yandex: the label report gives one sum per machine (VM, disks and address "
            "together) and nothing for unlabelled usage"
        ],
    )
