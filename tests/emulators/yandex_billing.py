"""The Billing usage API for the Yandex emulator (tests/emulators/yandex.py registers it):
``ConsumptionCoreService.GetLabelKeyUsageReport`` over the emulator's usage records.

From the SDK's own service definition (yandexcloud:
yandex/cloud/billing/usage_records/v1/consumption_core_service.proto and its docstrings in
consumption_core_service_pb2_grpc.py): ``billing_account_id``, ``start_date`` and ``end_date`` are
required, both dates inclusive with the time of day ignored; ``aggregation_period`` unspecified
means DAY; an unknown billing account is UNAUTHENTICATED ("if the user is not authenticated or
the billing account does not exist"); results are by label key-value pair, "the same resource's
cost is **duplicated** across its labels rather than split", each with a ``periodic`` series
whose ``timestamp`` is the start of its period; ``expense = cost + credit`` (credit_pb2).
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from decimal import Decimal
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from yandex.cloud.billing.usage_records.v1 import (
    billing_types_pb2,
    common_types_pb2,
    consumption_core_pb2,
    consumption_core_service_pb2,
    consumption_core_service_pb2_grpc,
    credit_pb2,
)

BILLING_ACCOUNT = "dn2billingaccount001"


def record(day: dt.date, cost: str, labels: dict[str, str], credit: str = "0") -> dict[str, Any]:
    """One day's usage of one resource: its labels, its cost and the credits applied."""
    return {"day": day, "cost": Decimal(cost), "credit": Decimal(credit), "labels": labels}


class Consumption(consumption_core_service_pb2_grpc.ConsumptionCoreServiceServicer):
    def __init__(self, emu: Any) -> None:
        self.emu = emu

    def GetLabelKeyUsageReport(self, request, context):
        emu = self.emu
        emu.begin("ConsumptionCoreService.GetLabelKeyUsageReport", request, context)
        if not request.HasField("start_date") or not request.HasField("end_date"):
            emu.invalid("GetLabelKeyUsageReport", context, "start_date and end_date are required")
        if request.billing_account_id != BILLING_ACCOUNT:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "billing account not found")
        if request.aggregation_period not in (common_types_pb2.TIME_GROUPING_UNSPECIFIED,
                                              common_types_pb2.DAY):  # fmt: skip
            emu.invalid("GetLabelKeyUsageReport", context, "the emulator reports by DAY only")
        lo = request.start_date.ToDatetime(tzinfo=dt.UTC).date()
        hi = request.end_date.ToDatetime(tzinfo=dt.UTC).date()
        series: dict[tuple[str, str], dict[dt.date, list[Decimal]]] = defaultdict(
            lambda: defaultdict(lambda: [Decimal(0), Decimal(0)])
        )
        for r in emu.usage_records:
            if lo <= r["day"] <= hi:
                for pair in r["labels"].items():  # repeated under every label, not split
                    sums = series[pair][r["day"]]
                    sums[0] += r["cost"]
                    sums[1] += r["credit"]
        out = consumption_core_service_pb2.LabelKeyUsageReportResponse(
            currency=common_types_pb2.RUB
        )
        total = [Decimal(0), Decimal(0)]
        for (key, value), days in sorted(series.items()):
            entity = consumption_core_pb2.LabelUsageReportEntityData(
                label=billing_types_pb2.Label(key=key, value=value)
            )
            e_total = [Decimal(0), Decimal(0)]
            for day, (cost, credit) in sorted(days.items()):
                ts = Timestamp()
                ts.FromDatetime(dt.datetime.combine(day, dt.time(0), dt.UTC))
                entity.periodic.append(
                    consumption_core_pb2.UsageReportPeriodicData(
                        timestamp=ts, **_money(cost, credit)
                    )
                )
                e_total = [e_total[0] + cost, e_total[1] + credit]
            for k, v in _money(*e_total).items():
                getattr(entity, k).CopyFrom(v)
            total = [total[0] + e_total[0], total[1] + e_total[1]]
            out.entities_data.append(entity)
        for k, v in _money(*total).items():
            getattr(out, k).CopyFrom(v)
        return emu.reply("ConsumptionCoreService.GetLabelKeyUsageReport", out, context)


def _money(cost: Decimal, credit: Decimal) -> dict[str, Any]:
    dec = common_types_pb2.StringDecimal
    return {
        "cost": dec(value=str(cost)),
        "credit_details": credit_pb2.CreditDetails(credit=dec(value=str(credit))),
        "expense": dec(value=str(cost + credit)),
    }
