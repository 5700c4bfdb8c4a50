"""Off-hours calendars: windows across midnight, weekends, holidays (RU New Year break and a
transferred working Saturday), extra dates, and DST shifts in Berlin and New York — evaluated
for any instant, so a missed tick still acts on the next one."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta

import pytest

from policies.calendar import Calendar
from policies.schema import OffHours


def cal(tz: str = "Europe/Berlin", **kw) -> Calendar:
    spec = {"timezone": tz, "windows": [{"days": "mon-fri", "start": "20:00", "end": "08:00"}]}
    spec.update(kw)
    return Calendar(OffHours.model_validate(spec))


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


@pytest.mark.parametrize(
    ("when", "off"),
    [
        ("2026-11-10T19:59:00+01:00", False),  # Tuesday, working hours
        ("2026-11-10T20:00:00+01:00", True),  # the window opens
        ("2026-11-10T23:59:00+01:00", True),
        ("2026-11-11T00:00:00+01:00", True),  # across midnight
        ("2026-11-11T07:59:59+01:00", True),
        ("2026-11-11T08:00:00+01:00", False),  # the window closes
        ("2026-11-09T03:00:00+01:00", True),  # Monday before work, after the weekend
        ("2026-11-07T12:00:00+01:00", True),  # Saturday noon: weekend
        ("2026-11-08T23:00:00+01:00", True),  # Sunday night
    ],
)
def test_window_across_midnight_and_weekends(when, off):
    assert cal().is_off(at(when)) is off


def test_instants_in_other_timezones_are_read_in_the_calendar_zone():
    # 18:30 UTC is 19:30 in Berlin (on) and 21:30 in Moscow (off) in November
    now = datetime(2026, 11, 10, 18, 30, tzinfo=UTC)
    assert not cal().is_off(now)
    assert cal("Europe/Moscow").is_off(now)


def test_no_weekends_means_saturday_follows_its_windows():
    c = cal(weekends=[], windows=[{"days": "mon-sun", "start": "22:00", "end": "06:00"}])
    assert not c.is_off(at("2026-11-07T12:00:00+01:00"))
    assert c.is_off(at("2026-11-07T23:00:00+01:00"))


@pytest.mark.parametrize(
    ("utc", "off"),
    [
        # Berlin spring forward, Sunday 29 March 2026 (02:00 CET → 03:00 CEST); every day listed
        ("2026-03-28T06:59", True),  # 07:59 CET
        ("2026-03-28T07:00", False),  # 08:00 CET
        ("2026-03-29T05:59", True),  # 07:59 CEST
        ("2026-03-29T06:00", False),  # 08:00 CEST: an hour earlier in UTC than the day before
        ("2026-03-29T17:59", False),
        ("2026-03-29T18:00", True),  # 20:00 CEST
        # Berlin fall back, Sunday 25 October 2026 (03:00 CEST → 02:00 CET)
        ("2026-10-24T05:59", True),  # 07:59 CEST
        ("2026-10-24T06:00", False),
        ("2026-10-25T06:59", True),  # 07:59 CET: an hour later in UTC than the day before
        ("2026-10-25T07:00", False),
        ("2026-10-25T18:59", False),
        ("2026-10-25T19:00", True),  # 20:00 CET
    ],
)
def test_dst_berlin(utc, off):
    c = cal(weekends=[], windows=[{"days": "mon-sun", "start": "20:00", "end": "08:00"}])
    assert c.is_off(datetime.fromisoformat(utc).replace(tzinfo=UTC)) is off


@pytest.mark.parametrize(
    ("utc", "off"),
    [
        # New York springs forward on Sunday 8 March 2026; work starts 08:00 local
        ("2026-03-06T12:30", True),  # Friday 07:30 EST
        ("2026-03-09T12:30", False),  # Monday 08:30 EDT, same UTC time
        ("2026-03-09T23:59", False),  # 19:59 EDT
        ("2026-03-10T00:00", True),  # 20:00 EDT
        # … and falls back on Sunday 1 November 2026
        ("2026-10-30T12:30", False),  # Friday 08:30 EDT
        ("2026-11-02T12:30", True),  # Monday 07:30 EST
        ("2026-11-02T13:00", False),  # 08:00 EST
        ("2026-11-02T00:30", True),  # Sunday 19:30 EST: weekend
    ],
)
def test_dst_new_york(utc, off):
    c = cal("America/New_York")
    assert c.is_off(datetime.fromisoformat(utc).replace(tzinfo=UTC)) is off


def test_the_repeated_hour_of_a_fall_back_is_off_both_times():
    c = cal(weekends=[], windows=[{"days": "mon-sun", "start": "02:00", "end": "03:00"}])
    first = datetime(2026, 10, 25, 0, 30, tzinfo=UTC)  # 02:30 CEST
    second = datetime(2026, 10, 25, 1, 30, tzinfo=UTC)  # 02:30 CET, an hour later
    assert c.is_off(first) and c.is_off(second)
    assert not c.is_off(datetime(2026, 10, 25, 2, 0, tzinfo=UTC))  # 03:00 CET


def test_local_times_to_instants_across_dst():
    c = cal()
    # 02:30 does not exist on 29 March in Berlin: it moves on by the shift, to 03:30 CEST
    assert c.to_instant(date(2026, 3, 29), time(2, 30)) == datetime(2026, 3, 29, 1, 30, tzinfo=UTC)
    # 02:30 happens twice on 25 October: the first one
    assert c.to_instant(date(2026, 10, 25), time(2, 30)) == datetime(
        2026, 10, 25, 0, 30, tzinfo=UTC
    )
    # the next 23:00 after Saturday 28 March 22:30 CET is on the same day, in CET
    assert c.next_at(datetime(2026, 3, 28, 21, 30, tzinfo=UTC), time(23)) == datetime(
        2026, 3, 28, 22, 0, tzinfo=UTC
    )
    # and after 23:30 it is Sunday's, in CEST
    assert c.next_at(datetime(2026, 3, 28, 22, 30, tzinfo=UTC), time(23)) == datetime(
        2026, 3, 29, 21, 0, tzinfo=UTC
    )


def test_russian_new_year_break_is_off_at_noon_every_day():
    c = cal("Europe/Moscow", holidays="RU")
    for day in range(1, 9):
        noon = datetime(2026, 1, day, 12, 0, tzinfo=UTC) + timedelta(hours=-3)
        assert c.why_off(noon) is not None, day
        assert c.why_off(noon).startswith(("holiday", "weekend")), day
    # Tuesday 6 January 2026 is a weekday: off only because it is a holiday
    assert c.why_off(at("2026-01-06T12:00:00+03:00")).startswith("holiday")
    assert not c.is_off(at("2026-01-12T12:00:00+03:00"))  # Monday after the break


def test_transferred_working_saturday_is_a_working_day():
    c = cal("Europe/Moscow", holidays="RU")
    # Saturday 2 November 2024 was a working day in Russia (the package knows it)
    assert not c.is_off(at("2024-11-02T12:00:00+03:00"))
    assert c.is_off(at("2024-11-02T21:00:00+03:00"))  # with a weekday's evening window
    assert c.is_off(at("2024-11-02T07:00:00+03:00"))
    assert c.why_off(at("2024-11-09T12:00:00+03:00")) == "weekend"  # an ordinary Saturday
    # without the holidays block the same Saturday is a weekend
    assert cal("Europe/Moscow").is_off(at("2024-11-02T12:00:00+03:00"))


def test_extra_days_off_and_on():
    c = cal(holidays="DE", extra_off=["2026-12-24"], extra_on=["2026-12-26"])
    assert c.why_off(at("2026-12-24T12:00:00+01:00")) == "extra day off"  # Thursday
    assert c.why_off(at("2026-12-25T12:00:00+01:00")).startswith("holiday")
    assert not c.is_off(at("2026-12-26T12:00:00+01:00"))  # a holiday and a Saturday, but on
    assert c.is_off(at("2026-12-26T21:00:00+01:00"))  # … with weekday evening windows


def test_missed_ticks_do_not_matter_every_instant_of_the_night_is_off():
    c = cal()
    start = at("2026-11-10T20:00:00+01:00")
    # whatever minute a tick lands on during the night, the answer is the same
    assert all(c.is_off(start + timedelta(minutes=m)) for m in range(0, 12 * 60, 7))
    assert not c.is_off(start + timedelta(hours=12))


def test_naive_instants_are_refused():
    with pytest.raises(ValueError, match="aware"):
        cal().is_off(datetime(2026, 11, 10, 12, 0))
