"""Off hours: is a given instant out of hours under a policy's calendar?

State, not edges: the answer depends only on the instant, so a sweep that missed a tick acts on
the next one (Cloud Custodian's offhour filter matches only the exact hour). Local time comes
from the IANA timezone for each instant, so DST shifts move the windows with the wall clock.

A day is classified first:
- ``extra_on`` dates are working days, whatever else says;
- ``extra_off`` dates and public holidays (the ``holidays`` package) are off all day;
- weekend days are off all day, except the transferred working days the package knows (RU);
- anything else is a working day.
On a working day the ``windows`` decide. A transferred working day on a weekend is read as a
Monday-to-Friday day: the windows listing any weekday apply to it.
"""

from __future__ import annotations

import zoneinfo
from datetime import UTC, date, datetime, time, timedelta
from functools import cached_property
from typing import TYPE_CHECKING

from policies.schema import DAYS, OffHours

if TYPE_CHECKING:
    from holidays import HolidayBase

_WEEKDAYS = frozenset(DAYS[:5])


class Calendar:
    def __init__(self, spec: OffHours) -> None:
        self.spec = spec
        self.tz = zoneinfo.ZoneInfo(spec.timezone)

    @cached_property
    def _holidays(self) -> HolidayBase | None:  # expands to new years on lookup
        if self.spec.holidays is None:
            return None
        import holidays

        return holidays.country_holidays(
            self.spec.holidays.country, subdiv=self.spec.holidays.subdivision
        )

    def local(self, at: datetime) -> datetime:
        if at.tzinfo is None:
            raise ValueError("the calendar needs an aware datetime")
        return at.astimezone(self.tz)

    def day_off(self, d: date) -> str | None:
        """Why ``d`` is off all day, or None for a working day."""
        if d in self.spec.extra_on:
            return None
        if d in self.spec.extra_off:
            return "extra day off"
        h = self._holidays
        if h is not None and d in h:  # the lookup also loads d.year's transferred workdays
            return f"holiday: {h.get(d)}"
        if DAYS[d.weekday()] in self.spec.weekends and not self._transferred_workday(d):
            return "weekend"
        return None

    def _transferred_workday(self, d: date) -> bool:
        h = self._holidays
        if h is None:
            return False
        d in h  # noqa: B015  (populates the year, and with it weekend_workdays)
        return d in getattr(h, "weekend_workdays", ())

    def why_off(self, at: datetime) -> str | None:
        """Why ``at`` is out of hours, or None when it is within hours."""
        loc = self.local(at)
        d, t = loc.date(), loc.time().replace(tzinfo=None)
        if why := self.day_off(d):
            return why
        day = DAYS[d.weekday()]
        for w in self.spec.windows:
            # a working weekend day (transferred, extra_on) follows the windows of weekdays
            applies = day in w.days if day not in self.spec.weekends else _WEEKDAYS & set(w.days)
            if applies and w.covers(t):
                return f"off-hours window {w.start:%H:%M}–{w.end:%H:%M}"
        return None

    def is_off(self, at: datetime) -> bool:
        return self.why_off(at) is not None

    def to_instant(self, day: date, t: time) -> datetime:
        """The instant a local wall-clock time names (PEP 495 fold=0): a time a spring-forward
        shift skips moves on by the shift; an ambiguous fall-back time is its first occurrence."""
        return datetime.combine(day, t).replace(tzinfo=self.tz, fold=0).astimezone(UTC)

    def next_on(self, at: datetime, days: int = 15) -> datetime | None:
        """The first instant after ``at`` within hours (a window's end or a working day's
        midnight), within ``days``; None when there is none (``at`` within hours: itself)."""
        if not self.is_off(at):
            return at
        return self._next(at, days, {time(0), *(w.end for w in self.spec.windows)}, off=False)

    def next_off(self, at: datetime, days: int = 15) -> datetime | None:
        """The first instant after ``at`` out of hours (a window's start or a day off's
        midnight), within ``days``; None when the calendar has none."""
        return self._next(at, days, {time(0), *(w.start for w in self.spec.windows)}, off=True)

    def _next(self, at: datetime, days: int, times: set[time], off: bool) -> datetime | None:
        today = self.local(at).date()
        starts = sorted(
            self.to_instant(today + timedelta(days=d), t) for d in range(days) for t in times
        )
        return next((s for s in starts if s > at and self.is_off(s) is off), None)

    def next_at(self, now: datetime, t: time) -> datetime:
        """The next instant (after ``now``) at local time ``t``: today's, or tomorrow's."""
        today = self.local(now).date()
        for d in (today, today + timedelta(days=1)):
            at = self.to_instant(d, t)
            if at > now:
                return at
        return self.to_instant(today + timedelta(days=2), t)
