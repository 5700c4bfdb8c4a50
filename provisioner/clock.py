"""Time comes from a clock object so schedules, ledgers and tests can run on simulated time."""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

#: An ISO 8601 instant the command's clock starts at (it ticks from there). For tests and
#: what-if runs of ``plan``/``report``: the test harness gives the CLI its clock this way, so
#: no test depends on the day it runs. On a state made on the real clock it may only look:
#: writing the state or acting on a cloud is refused (:mod:`provisioner.realclock`).
CLOCK_ENV = "PROVISIONER_CLOCK"

#: The instants a clock, a period or a report may name: [EARLIEST, LATEST). Far enough either
#: way for any what-if run, and far from datetime's year-9999 edge, where a month or a day
#: added to a date overflows.
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
LATEST = datetime(2200, 1, 1, tzinfo=UTC)


class Clock:
    #: Whether this is not the wall clock: a state made on such a clock is a simulated one,
    #: and on a real state such a clock may only look (:mod:`provisioner.realclock`).
    simulated = False

    def now(self) -> datetime:
        return datetime.now(UTC)


class ManualClock(Clock):
    """A clock that only moves when told to (tests, simulations)."""

    simulated = True

    def __init__(self, start: datetime) -> None:
        if start.tzinfo is None:
            raise ValueError("ManualClock needs an aware datetime")
        self._now = start.astimezone(UTC)

    def now(self) -> datetime:
        return self._now

    def advance(self, delta: timedelta) -> datetime:
        self._now += delta
        return self._now

    def set(self, when: datetime) -> None:
        self._now = when.astimezone(UTC)


class ShiftedClock(Clock):
    """The wall clock moved to start at ``start``: it ticks, so waits and timeouts still end."""

    simulated = True

    def __init__(self, start: datetime) -> None:
        if start.tzinfo is None:
            raise ValueError("ShiftedClock needs an aware datetime")
        self._shift = start - datetime.now(UTC)

    def now(self) -> datetime:
        return datetime.now(UTC) + self._shift


def clock_from_env() -> Clock:
    """The wall clock, or a shifted one when ``PROVISIONER_CLOCK`` names an instant."""
    raw = os.environ.get(CLOCK_ENV, "").strip()
    if not raw:
        return Clock()
    try:
        start = datetime.fromisoformat(raw)
    except ValueError:
        start = None
    if start is None or start.tzinfo is None:
        from provisioner.errors import UserError  # policies' problems: not for a good clock

        raise UserError(
            f"{CLOCK_ENV}: {raw!r} is not an ISO 8601 instant with a UTC offset"
            " (e.g. 2026-11-02T09:00:00+00:00)"
        )
    if not EARLIEST <= start < LATEST:
        from provisioner.errors import UserError

        raise UserError(
            f"{CLOCK_ENV}: {raw!r} is outside {EARLIEST:%Y-%m-%d}..{LATEST - timedelta(1):%Y-%m-%d}"
        )
    return ShiftedClock(start)


def team_zone(settings: Any, policies: Iterable[Any] = ()) -> ZoneInfo:
    """The one time zone a team reads its times in (the dashboard, ``status``): ``timezone``
    in settings when set; left unset, the zone the team's policy calendars share (all of
    them in Europe/Berlin: Berlin, as their working hours read); else UTC."""
    if "timezone" in settings.model_fields_set:
        return ZoneInfo(settings.timezone)
    zones = {p.off_hours.timezone for p in policies if getattr(p, "off_hours", None)}
    return ZoneInfo(zones.pop()) if len(zones) == 1 else ZoneInfo("UTC")


def zoned(at: datetime, now: datetime, zone: ZoneInfo) -> str:
    """``19:20 Europe/Berlin`` today (in ``zone``), ``2026-11-03 19:20 Europe/Berlin``
    another day: an instant as the CLI says it, in the team's zone."""
    local, today = at.astimezone(zone), now.astimezone(zone).date()
    shown = f"{local:%H:%M}" if local.date() == today else f"{local:%Y-%m-%d %H:%M}"
    return f"{shown} {zone.key}"
