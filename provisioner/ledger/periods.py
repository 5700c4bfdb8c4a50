"""Periods of the ledger: a month, an ISO week or a range of whole days between a time zone's
midnights, as people name them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from functools import lru_cache
from zoneinfo import ZoneInfo

from provisioner.clock import EARLIEST, LATEST
from provisioner.money import US_PER_HOUR

SECONDS_PER_HOUR = Decimal(3600)
_US = timedelta(microseconds=1)
DAY = timedelta(days=1)

_MONTH = re.compile(r"^(\d{4})-(\d{2})$")
_WEEK = re.compile(r"^(\d{4})-W(\d{2})$", re.I)
_RANGE = re.compile(r"^(\d{4}-\d{2}-\d{2})\s*\.\.\s*(\d{4}-\d{2}-\d{2})$")


@lru_cache(maxsize=4096)  # a report asks for the same few days a million times
def midnight(d: date, tz: str = "UTC") -> datetime:
    """The start of day ``d`` in ``tz``, as a UTC datetime."""
    return datetime.combine(d, time(0), tzinfo=ZoneInfo(tz)).astimezone(UTC)


@dataclass(frozen=True)
class Period:
    """[start, end) between local midnights of ``tz`` (a policy's timezone; UTC by default),
    with the label people use for it (``2026-11``, ``2026-W48``)."""

    start: datetime
    end: datetime
    label: str
    tz: str = "UTC"

    @classmethod
    def month(cls, at: datetime, tz: str = "UTC") -> Period:
        if not EARLIEST <= at < LATEST:
            raise ValueError(f"{at:%Y-%m} is outside {EARLIEST:%Y-%m}..{LATEST - DAY:%Y-%m}")
        local = at.astimezone(ZoneInfo(tz))
        first = date(local.year, local.month, 1)
        nxt = date(local.year + local.month // 12, local.month % 12 + 1, 1)
        return cls(midnight(first, tz), midnight(nxt, tz), f"{first:%Y-%m}", tz)

    @classmethod
    def week(cls, at: datetime, tz: str = "UTC") -> Period:
        if not EARLIEST <= at < LATEST:
            raise ValueError(f"{at:%Y-%m-%d} is outside {EARLIEST:%Y}..{LATEST - DAY:%Y}")
        day = at.astimezone(ZoneInfo(tz)).date()
        monday = day - timedelta(days=day.weekday())
        y, w, _ = monday.isocalendar()
        return cls(midnight(monday, tz), midnight(monday + 7 * DAY, tz), f"{y}-W{w:02d}", tz)

    @classmethod
    def between(cls, first: date, last: date, tz: str = "UTC") -> Period:
        """Whole days ``first`` to ``last``, both included."""
        if last < first:
            raise ValueError(f"period ends ({last}) before it starts ({first})")
        for d in (first, last):
            if not EARLIEST.date() <= d < LATEST.date():
                raise ValueError(f"{d} is outside {EARLIEST:%Y-%m-%d}..{LATEST - DAY:%Y-%m-%d}")
        return cls(midnight(first, tz), midnight(last + DAY, tz), f"{first}..{last}", tz)

    @classmethod
    def parse(cls, text: str, tz: str = "UTC") -> Period:
        """``2026-11`` (a month), ``2026-W48`` (an ISO week), ``2026-11-01..2026-11-15``."""
        text = text.strip()
        try:
            if m := _MONTH.match(text):
                return cls.month(midnight(date(int(m[1]), int(m[2]), 1), tz), tz)
            if m := _WEEK.match(text):
                return cls.week(midnight(date.fromisocalendar(int(m[1]), int(m[2]), 1), tz), tz)
            if m := _RANGE.match(text):
                return cls.between(date.fromisoformat(m[1]), date.fromisoformat(m[2]), tz)
        except (ValueError, OverflowError) as e:
            raise ValueError(f"not a period: {text!r} ({e})") from None
        raise ValueError(
            f"not a period: {text!r} (write 2026-11, 2026-W48 or 2026-11-01..2026-11-15)"
        )

    def previous(self) -> Period:
        """The period of the same kind just before: the month, the ISO week, or as many whole
        days (``ValueError`` before the earliest date)."""
        if _MONTH.match(self.label):
            return Period.month(self.start - _US, self.tz)
        if _WEEK.match(self.label):
            return Period.week(self.start - DAY, self.tz)
        days = self.days()
        return Period.between(days[0] - len(days) * DAY, days[0] - DAY, self.tz)

    def clip(self, at: datetime) -> datetime:
        return min(max(at, self.start), self.end)

    def days(self) -> list[date]:
        """The local days of the period."""
        d, out = self.start.astimezone(ZoneInfo(self.tz)).date(), []
        while midnight(d, self.tz) < self.end:
            out.append(d)
            d += DAY
        return out


def hours(delta: timedelta) -> Decimal:
    return Decimal(delta // _US) / US_PER_HOUR
