"""Prometheus metrics for ``/metrics`` on the scheduler's endpoint.

Names follow Prometheus's "Metric and label naming" (https://prometheus.io/docs/practices/naming/):
one unit per metric, named by a suffix; a fraction is a ``_ratio`` from 0 to 1, "not 0-100". Money
has no base unit there and one metric "MUST refer to a single unit", so an amount's currency is
its unit and its suffix — ISO 4217's code in lower case (``provisioner_budget_spent_usd``) —
never a label beside amounts that could not be summed. Renamed in 0.x (README, "Metrics"):
``provisioner_budget_{amount,spent,…}{currency="USD"}`` → ``provisioner_budget_{…}_usd``,
``provisioner_budget_percent`` → ``provisioner_budget_spent_ratio``,
``provisioner_gpu_utilization_percent`` → ``provisioner_gpu_utilization_ratio``."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select

from provisioner import budget, efficiency, heartbeats, idle, ledger
from provisioner.app import App
from provisioner.errors import ProvisionerError
from provisioner.jobs.passes import REASONS
from provisioner.jobs.sweep import IdleCheck, assess
from provisioner.models import ACTIVE_EXCLUDED, Delivery, Event, Machine
from provisioner.schema import MachineStatus as S

log = logging.getLogger("provisioner.metrics")


class Metrics:
    """Prometheus metrics, read from the state at each scrape, so every scheduler sharing the
    database reports the same numbers (actions come from the machines' events)."""

    def __init__(self, app: App, *, names: bool = True) -> None:
        from prometheus_client import CollectorRegistry

        self.app = app
        self.names = names
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._anonymous: Metrics | None = None
        self._gpu_time: tuple[datetime, efficiency.Efficiency] | None = None

    def render(self, names: bool = True) -> tuple[bytes, str]:
        """The exposition; ``names=False``: without the per-machine series (machine names are
        for those holding the metrics token)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if not names and self.names:
            self._anonymous = self._anonymous or Metrics(self.app, names=False)
            return self._anonymous.render()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        app, now = self.app, self.app.clock.now()
        by_state = GaugeMetricFamily(
            "provisioner_machines", "Machines by state and cloud", labels=["state", "cloud"]
        )
        actions = CounterMetricFamily(
            "provisioner_scheduler_actions",
            "Actions the scheduler took, by kind and reason",
            labels=["action", "reason"],
        )
        with app.db.session() as s:
            for status, cloud, n in s.execute(
                select(Machine.status, Machine.cloud, func.count())
                .where(Machine.status.not_in(ACTIVE_EXCLUDED))
                .group_by(Machine.status, Machine.cloud)
            ):
                by_state.add_metric([status, cloud or ""], n)
            for kind, reason, n in s.execute(
                select(Event.kind, Event.reason, func.count())
                .where(Event.reason.in_(REASONS))
                .group_by(Event.kind, Event.reason)
            ):
                actions.add_metric([kind, reason or ""], n)
            running = list(s.scalars(select(Machine).where(Machine.status == S.RUNNING)))
        yield by_state
        yield actions
        grace = timedelta(seconds=app.settings.scheduler.heartbeat_grace_seconds)
        util = GaugeMetricFamily(
            "provisioner_gpu_utilization_ratio",
            "GPU utilisation (0 to 1) from each machine's latest heartbeat",
            labels=["machine", "cloud", "gpu"],
        )
        if self.names:
            for m, g in heartbeats.iter_latest_gpus(app, now - grace):
                util.add_metric([m.name, m.cloud or "", str(g["index"])], g["util"] / 100)
            yield util
        signals = GaugeMetricFamily(
            "provisioner_machine_activity",
            "Running machines by their strictest idle rule's signal (idle, busy, unknown, "
            "starting), whatever the hour",
            labels=["signal"],
        )
        counts = dict.fromkeys(("idle", "busy", "unknown", "starting"), 0)
        for a in assess(app, now, running)[0]:
            if a.signals:
                counts[_strictest(a.signals)] += 1
        for k, n in counts.items():
            signals.add_metric([k], n)
        yield signals
        yield GaugeMetricFamily(
            "provisioner_idle_machines",
            "Running machines idle under one of their rules",
            value=counts["idle"],
        )
        yield from _budgets(app, now)
        yield from self._efficiency(now)
        deliveries = GaugeMetricFamily(
            "provisioner_notify_deliveries",
            "Notices to notify channels and mail by channel kind and status (sent, pending, "
            "retrying, failed)",
            labels=["kind", "status"],
        )
        with app.db.session() as s:
            for channel, outcome, n in s.execute(
                select(Delivery.kind, Delivery.status, func.count()).group_by(
                    Delivery.kind, Delivery.status
                )
            ):
                deliveries.add_metric([channel, outcome], n)
        yield deliveries

    def _efficiency(self, now: datetime) -> Iterator[Any]:
        """GPU time paid, busy and unknown in the last hour per project (and owner, for those
        holding the token), and busy ÷ paid: see :func:`efficiency_families`. Computed at most
        once per :data:`GPU_TIME_EVERY`: a scrape every 15 s would read each hour's heartbeats
        again each time."""
        cached = self._gpu_time
        if cached is None or now - cached[0] >= GPU_TIME_EVERY or now < cached[0]:
            found = efficiency.gpu_efficiency(self.app, now - GPU_TIME_WINDOW, now)
            self._gpu_time = cached = now, found
        yield from efficiency_families(cached[1], owners=self.names)


#: The window GPU time is reported over, and how often it is computed again.
GPU_TIME_WINDOW = timedelta(hours=1)
GPU_TIME_EVERY = timedelta(minutes=1)


def efficiency_families(e: efficiency.Efficiency, *, owners: bool) -> Iterator[Any]:
    """Gauges of GPU-seconds (Prometheus's base unit of time is the second) paid, busy and
    unknown over the last hour, and busy ÷ paid as a ``_ratio`` (0 to 1). Gauges, not
    ``_total`` counters: a sliding window goes down as well as up, and heartbeats are pruned
    after a day, so no count since the start could be read back from the state."""
    from prometheus_client.core import GaugeMetricFamily

    labels = ["project", "owner"] if owners else ["project"]
    what = "GPU-seconds {} in the last hour (compute seconds × GPUs{})"
    families = {
        "paid": GaugeMetricFamily(
            "provisioner_gpu_paid_seconds", what.format("paid for", ""), labels=labels
        ),
        "busy": GaugeMetricFamily(
            "provisioner_gpu_busy_seconds",
            what.format("busy", " at or above the idle threshold"),
            labels=labels,
        ),
        "unknown": GaugeMetricFamily(
            "provisioner_gpu_unknown_seconds",
            what.format("paid for without a heartbeat", ""),
            labels=labels,
        ),
    }
    ratio = GaugeMetricFamily(
        "provisioner_gpu_busy_ratio",
        "Busy GPU-seconds ÷ paid GPU-seconds in the last hour (0 to 1)",
        labels=labels,
    )
    rows: list[tuple[list[str], efficiency.GpuTime]] = (
        [([p, o], t) for (p, o), t in e.pairs.items()]
        if owners
        else [([p], t) for p, t in e.projects.items()]
    )
    for values, t in sorted(rows, key=lambda vt: vt[0]):
        for k, us in (("paid", t.paid_us), ("busy", t.busy_us), ("unknown", t.unknown_us)):
            families[k].add_metric(values, us / 1_000_000)
        if t.ratio is not None:
            ratio.add_metric(values, float(t.ratio))
    yield from families.values()
    yield ratio


#: each budget's amounts: (name, help); the currency's code is the unit and the suffix
MONEY = (
    ("amount", "The budget for its period"),
    ("spent", "Spent in the budget's period so far"),
    ("committed", "What live machines will cost until the period ends, at their rates"),
    ("relaunches", "What preempted machines being relaunched will cost to the end"),
    ("forecast", "Spent + committed + relaunches: the period's end"),
    ("idle_waste", "What machines cost while idle before they were stopped"),
)


def _budgets(app: App, now: datetime) -> Iterator[Any]:
    """Each budget's standing in its period, as ``provisioner report`` and the budget checks
    compute it (:func:`provisioner.budget.status`): its amounts in the budget's currency, one
    metric per currency, and how much of it is spent as a ratio."""
    from prometheus_client.core import GaugeMetricFamily

    labels = ["policy", "period"]
    families: dict[str, Any] = {}

    def family(name: str, what: str) -> Any:
        if name not in families:
            families[name] = GaugeMetricFamily(name, what, labels=labels)
        return families[name]

    ratio = family("provisioner_budget_spent_ratio", "Spent as a fraction of the budget (1: all)")
    rates = app.settings.money_rates
    for policy in app.policies:
        try:
            if policy.budget is None or (st := budget.status(app, policy, now)) is None:
                continue
            cur = st.amount.currency
            with app.db.session() as s:
                waste = ledger.idle_waste(s, st.period, now, budget.scope_of(policy))
            wasted = waste.total(rates, cur)
        except (ProvisionerError, ValueError) as e:  # no rate for a currency: the others count
            log.warning("metrics: budget %s: %s", policy.name, e)
            continue
        key = [policy.name, st.period.label]
        unit = cur.lower()
        amounts = (st.amount, st.spent, st.committed, st.relaunches, st.forecast, wasted)
        if unit.isascii() and unit.isalpha():  # ISO 4217: three letters
            for (k, what), m in zip(MONEY, amounts, strict=True):
                family(f"provisioner_budget_{k}_{unit}", f"{what}, in {cur}").add_metric(
                    key, float(m.amount)
                )
        if st.amount.amount:
            ratio.add_metric(key, float(st.spent.amount / st.amount.amount))
    yield from families.values()


def _strictest(signals: dict[IdleCheck, idle.Signal]) -> idle.Signal:
    for s in ("idle", "unknown", "busy", "starting"):
        if s in signals.values():
            return s
    return "starting"
