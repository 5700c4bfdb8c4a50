"""The cost ledger: usage intervals opened and closed on every observed transition, priced at the
rate fixed at launch, and spend as the exact overlap of intervals with a period.

Everything is derived from the intervals on demand — there is no accrual job to re-run, so a
report asked twice, or a transition observed twice, cannot count anything twice. Sums are exact:
overlaps are added as integer microseconds per (key, currency, rate) and priced once at the end
(Decimal), amounts keep their currency, and conversion happens only when a caller asks for one.

In four parts, lowest first: ``periods`` (a month, a week, a range of days), ``record``
(intervals opened and closed on transitions), ``sums`` (totals by the database) and
``projections`` (forecast, commitments, savings, idle waste).
"""

from provisioner.ledger.periods import DAY, SECONDS_PER_HOUR, Period, hours, midnight
from provisioner.ledger.projections import (
    SAVINGS_HORIZON,
    SAVINGS_METHOD,
    Bound,
    Forecast,
    commitments,
    forecast,
    idle_waste,
    max_lifetime,
    savings,
)
from provisioner.ledger.record import (
    interval_cost,
    machine_spend,
    record_transition,
    record_transitions,
    spend,
)
from provisioner.ledger.sums import BY, FIELDS, LABEL, Scope, day_tally, spend_by, tally, total

__all__ = [
    "BY",
    "DAY",
    "FIELDS",
    "LABEL",
    "SAVINGS_HORIZON",
    "SAVINGS_METHOD",
    "SECONDS_PER_HOUR",
    "Bound",
    "Forecast",
    "Period",
    "Scope",
    "commitments",
    "day_tally",
    "forecast",
    "hours",
    "idle_waste",
    "interval_cost",
    "machine_spend",
    "max_lifetime",
    "midnight",
    "record_transition",
    "record_transitions",
    "savings",
    "spend",
    "spend_by",
    "tally",
    "total",
]
