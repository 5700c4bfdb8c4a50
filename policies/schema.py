"""The policy file: who a policy applies to and what it allows, spends and stops.

A file holds one policy or a list under ``policies:``. Every field is optional except ``name``;
an absent field sets no rule. Where several policies match a request, each is checked and the
strictest wins (see ``policies.evaluate``).
"""

from __future__ import annotations

import re
import zoneinfo
from datetime import date, time, timedelta
from decimal import Decimal, InvalidOperation
from fnmatch import fnmatchcase
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from policies.channels import Channel
from policies.duration import autostop_duration, parse_duration

Action = Literal["stop", "terminate"]
Market = Literal["spot", "reserved"]
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
LIMIT = Decimal(10) ** 12  # the largest amount (provisioner.money.LIMIT)
MINUTES_MAX = 10 * 366 * 24 * 60  # ten years, as a duration's bound (policies.duration)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


class Amount(_Strict):
    """Money in a policy: ``"5000 USD"`` or ``{amount: 5000, currency: USD}``. The field names
    are those of ``provisioner.money.Money``: convert with ``Money(a.amount, a.currency)``."""

    amount: Decimal = Field(gt=0)
    currency: str

    @model_validator(mode="before")
    @classmethod
    def _text(cls, v: Any) -> Any:
        if isinstance(v, str):
            parts = v.split()
            if len(parts) != 2:
                raise ValueError(f"write an amount and a currency, e.g. '5000 USD' (got {v!r})")
            return {"amount": parts[0].replace("_", ""), "currency": parts[1]}
        if isinstance(v, int | float) and not isinstance(v, bool):
            raise ValueError("an amount needs a currency, e.g. '5000 USD'")
        return v

    @field_validator("amount", mode="before")
    @classmethod
    def _decimal(cls, v: Any) -> Any:
        try:
            d = Decimal(repr(v) if isinstance(v, float) else str(v))
        except (InvalidOperation, ValueError):
            raise ValueError(f"not an amount: {v!r}") from None
        if not d.is_finite():
            raise ValueError(f"not an amount: {v!r}")
        if abs(d) >= LIMIT:
            raise ValueError(f"{v} is too large for an amount (at most {LIMIT:,})")
        return d

    @field_validator("currency")
    @classmethod
    def _iso(cls, v: str) -> str:
        if len(v) != 3 or not v.isalpha():
            raise ValueError(f"unknown currency {v!r} (use an ISO code: USD, RUB, EUR)")
        return v.upper()

    def __str__(self) -> str:
        return f"{self.amount} {self.currency}"


def parse_days(value: Any) -> tuple[str, ...]:
    """``mon-fri``, ``[sat, sun]``, ``"mon, wed"`` → ordered day names."""
    items = value if isinstance(value, list | tuple) else str(value).split(",")
    out: list[str] = []
    for item in items:
        out.extend(_days_of(item))
    return tuple(d for d in DAYS if d in out)


def _days_of(item: Any) -> list[str]:
    """One day (``mon``) or span (``fri-mon`` wraps round the week) as day names."""
    text = str(item).strip().lower()
    lo, sep, hi = text.partition("-")
    names = [lo[:3], hi[:3]] if sep else [text[:3]]
    for n in names:
        if n not in DAYS:
            raise ValueError(f"unknown day {item!r} (use mon, tue, … sun or mon-fri)")
    if not sep:
        return [names[0]]
    i, j = DAYS.index(names[0]), DAYS.index(names[1])
    span = range(i, j + 1) if i <= j else [*range(i, 7), *range(0, j + 1)]
    return [DAYS[k] for k in span]


# ---- who -------------------------------------------------------------------------------


class AppliesTo(_Strict):
    """Shell-style globs; a policy applies when the project AND the owner match."""

    projects: list[str] = Field(default_factory=lambda: ["*"])
    owners: list[str] = Field(default_factory=lambda: ["*"])

    def matches(self, project: str, owner: str) -> bool:
        return any(fnmatchcase(project, p) for p in self.projects) and any(
            fnmatchcase(owner, o) for o in self.owners
        )


class Allow(_Strict):
    """Each list is an allow-list of globs (regions: ``eu-*``); absent = anything."""

    clouds: list[str] | None = None
    regions: list[str] | None = None
    gpus: list[str] | None = None
    markets: list[Market] | None = None

    @field_validator("gpus")
    @classmethod
    def _upper(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else [g.upper() for g in v]


# ---- money -----------------------------------------------------------------------------


class CustomPeriod(_Strict):
    """A one-off budget period; both dates inclusive."""

    start: date
    end: date

    @model_validator(mode="after")
    def _order(self) -> CustomPeriod:
        if self.end < self.start:
            raise ValueError("end is before start")
        return self


class Alerts(_Strict):
    """Percent-of-budget thresholds on actual spend and on the period-end forecast."""

    actual: list[Decimal] = Field(default_factory=lambda: [Decimal(50), Decimal(80), Decimal(100)])
    forecast: list[Decimal] = Field(default_factory=lambda: [Decimal(100)])

    @field_validator("actual", "forecast")
    @classmethod
    def _percent(cls, v: list[Decimal]) -> list[Decimal]:
        for p in v:
            if not (p.is_finite() and 0 < p <= 1000):
                raise ValueError(f"threshold {p} must be a percent above zero, at most 1000")
        return sorted(set(v))


class ReportSchedule(_Strict):
    cron: str  # five-field crontab, read in the policy's timezone

    @field_validator("cron")
    @classmethod
    def _cron(cls, v: str) -> str:
        from apscheduler.triggers.cron import CronTrigger

        try:
            CronTrigger.from_crontab(v)
        except ValueError as e:
            raise ValueError(f"not a crontab expression {v!r}: {e}") from None
        return v


class Budget(_Strict):
    amount: Amount
    period: Literal["month", "week"] | CustomPeriod = "month"
    alerts: Alerts = Field(default_factory=Alerts)
    on_exhausted: Literal["block", "stop", "terminate"] = "block"
    recipients: list[str] = Field(default_factory=list)
    language: Literal["en", "ru"] = "en"
    report: ReportSchedule | None = None

    @field_validator("recipients")
    @classmethod
    def _emails(cls, v: list[str]) -> list[str]:
        for r in v:
            if not re.match(r"^[^@\s]+@[^@\s]+\.[^@\s]+$", r):
                raise ValueError(f"not an email address: {r!r}")
        return v


# ---- time ------------------------------------------------------------------------------


class Window(_Strict):
    """On each of ``days``, local times in [start, end) are off hours. When end <= start the
    window wraps around midnight: ``20:00–08:00`` on Monday means Monday before 08:00 and from
    20:00 on."""

    days: tuple[str, ...] = DAYS[:5]
    start: time
    end: time

    @field_validator("days", mode="before")
    @classmethod
    def _days(cls, v: Any) -> tuple[str, ...]:
        return parse_days(v)

    @field_validator("start", "end", mode="before")
    @classmethod
    def _hhmm(cls, v: Any) -> Any:
        if isinstance(v, int):  # YAML 1.1 reads 20:00 unquoted as sexagesimal 1200
            return time(v // 60, v % 60) if 0 <= v < 24 * 60 else v
        if isinstance(v, str) and v.strip() in ("24:00", "24"):
            return time(0)
        return v

    def covers(self, t: time) -> bool:
        """Whether local time ``t`` falls in the window (on a day the window applies to)."""
        if self.start < self.end:
            return self.start <= t < self.end
        return t >= self.start or t < self.end


class Holidays(_Strict):
    country: str  # ISO 3166 code the `holidays` package knows: RU, US, DE…
    subdivision: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _short(cls, v: Any) -> Any:
        return {"country": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _known(self) -> Holidays:
        import holidays

        try:
            holidays.country_holidays(self.country, subdiv=self.subdivision, years=[])
        except NotImplementedError:
            raise ValueError(f"the holidays package does not know {self.country!r}") from None
        return self


class OffHours(_Strict):
    """When machines are out of hours (evaluated by ``policies.calendar``)."""

    timezone: str
    windows: list[Window] = Field(default_factory=list)
    weekends: tuple[str, ...] = ("sat", "sun")  # whole days off; [] for none
    holidays: Holidays | None = None
    extra_off: list[date] = Field(default_factory=list)  # whole days off
    extra_on: list[date] = Field(default_factory=list)  # working days whatever else says

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str) -> str:
        try:
            zoneinfo.ZoneInfo(v)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown IANA timezone {v!r} (e.g. Europe/Moscow)") from None
        return v

    @field_validator("weekends", mode="before")
    @classmethod
    def _weekend_days(cls, v: Any) -> tuple[str, ...]:
        return () if v in (None, [], False) else parse_days(v)


class IdleRule(_Strict):
    """Idle = every GPU below ``gpu_util_below`` percent for ``for_minutes`` and no job running
    (``gpus_only: true``: the GPUs alone). With an off-hours calendar in the same policy the
    rule acts only out of hours; without one, at any time."""

    gpu_util_below: float = Field(5.0, ge=0, le=100)
    for_minutes: int = Field(30, ge=1, le=MINUTES_MAX)
    unknown_counts_as_idle: bool = False  # no heartbeat for longer than the grace period
    action: Action = "stop"
    warn_minutes: int = Field(0, ge=0, le=240)  # mail the owner this long before acting; 0: no
    # false (the default): a machine with a running job is busy whatever its GPUs (as in
    # SkyPilot); true: only the GPUs count, and a stop ends the job (recorded, owner told)
    gpus_only: bool = False


class MaxLifetime(_Strict):
    after: timedelta
    action: Action = "stop"

    @model_validator(mode="before")
    @classmethod
    def _short(cls, v: Any) -> Any:
        return {"after": v} if not isinstance(v, dict) else v

    @field_validator("after", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> timedelta:
        d = parse_duration(v)
        if d <= timedelta(0):
            raise ValueError("must be longer than zero")
        return d


# ---- who may do what -----------------------------------------------------------------


class PerOwner(_Strict):
    """Caps each owner in the policy's scope separately (the policy's own caps count everyone
    in the scope together): live machines, their GPUs, and a budget of the owner's spend."""

    max_machines: int | None = Field(None, ge=0, le=1_000_000)
    max_gpus: int | None = Field(None, ge=0, le=1_000_000)
    budget: Budget | None = None


# ---- the policy ------------------------------------------------------------------------


class Policy(_Strict):
    name: str = Field(min_length=1)
    applies_to: AppliesTo = Field(default_factory=AppliesTo)
    allow: Allow = Field(default_factory=Allow)
    max_gpus_per_machine: int | None = Field(None, ge=1, le=1024)
    max_machines: int | None = Field(None, ge=0, le=1_000_000)
    max_price_per_hour: Amount | None = None
    budget: Budget | None = None
    off_hours: OffHours | None = None
    idle: IdleRule | None = None
    max_lifetime: MaxLifetime | None = None
    max_autostop: timedelta | None = None  # caps a machine's autostop (and gives one to all)
    notify: list[Channel] = Field(default_factory=list)  # where its notices go, beside mail
    per_owner: PerOwner | None = None
    # who may launch for whom in this policy's scope: actor glob → owner globs
    act_as: dict[str, list[str]] = Field(default_factory=dict)

    @field_validator("act_as", mode="before")
    @classmethod
    def _act_as(cls, v: Any) -> Any:
        """``{lead@x.org: ["*"]}``: that actor (a glob of e-mails) may launch for these owners
        (globs) in the policy's scope; one owner may be written without the list."""
        if isinstance(v, dict):
            return {k: [o] if isinstance(o, str) else o for k, o in v.items()}
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        """Any character but NUL, which no state can keep (PostgreSQL's text has none)."""
        if "\x00" in v:
            raise ValueError("a name without the NUL character (\\0)")
        return v

    @field_validator("max_autostop", mode="before")
    @classmethod
    def _max_autostop(cls, v: Any) -> Any:
        return None if v is None else autostop_duration(v)

    @property
    def timezone(self) -> str:
        """The policy's local time (off-hours calendar, budget periods, report cron)."""
        return self.off_hours.timezone if self.off_hours else "UTC"

    @property
    def idle_rule(self) -> IdleRule | None:
        """An off-hours calendar without an idle rule stops idle machines with the defaults."""
        return self.idle or (IdleRule() if self.off_hours else None)


def matching(policies: list[Policy], project: str, owner: str) -> list[Policy]:
    """The policies that apply to ``project`` and ``owner``, in the order given."""
    return [p for p in policies if p.applies_to.matches(project, owner)]


def autostop_cap(policies: list[Policy], project: str, owner: str) -> tuple[timedelta, str] | None:
    """The shortest ``max_autostop`` of the policies that apply, and its policy's name."""
    caps = [(p.max_autostop, p.name) for p in matching(policies, project, owner) if p.max_autostop]
    return min(caps, key=lambda c: c[0]) if caps else None
