"""The dashboard's pages as a reader sees them over time (plain WSGI, no browser): times in
the team's time zone with UTC on hover, sparklines that show silence as a gap and carry a time
axis, and a ``/favicon.ico`` that answers. The browser half (1280 px, 150 % zoom, axe-core) is
in test_dashboard.py."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from provisioner import heartbeats, startup
from provisioner.app import App
from provisioner.dashboard import make_app, svg
from provisioner.models import Machine
from tests.conftest import make_settings
from tests.test_dashboard import call, up


@pytest.fixture
def berlin(home, clock):
    """A team in Berlin (settings.timezone), one machine launched at 09:00 UTC."""
    a = App(make_settings(home, timezone="Europe/Berlin"), clock)
    up(a, "train-a")
    yield a
    a.close()


def beat(a: App, mid: str, util: float) -> None:
    heartbeats.record(a, mid, [{"index": 0, "util": util, "mem_used_mb": 1000}])


def test_times_are_the_teams_with_utc_on_hover(berlin, clock):
    clock.advance(timedelta(hours=1))
    status, _, page = call(make_app(berlin), "/machine/train-a")
    assert status == 200
    # launched 09:00 UTC: 10:00 in Berlin in November (CET, UTC+1), the instant in UTC on hover
    assert re.search(
        r'<time datetime="2026-11-02T09:00:00(\+00:00)?" title="2026-11-02 09:00 UTC">'
        r"10:00 Europe/Berlin</time>",
        page,
    ), page
    assert "09:00 UTC<" not in page  # never shown as the text, only in the title
    _, _, fleet = call(make_app(berlin), "/")
    assert re.search(
        r'id="updated"[^>]*>as of <time [^>]*title="2026-11-02 10:00 UTC">11:00 Europe', fleet
    )


def test_a_sparkline_breaks_where_the_agent_was_silent_and_has_a_time_axis(berlin, clock):
    with berlin.db.session() as s:
        mid = s.scalars(select(Machine.id).where(Machine.name == "train-a")).one()
    startup.issue_token(berlin, mid)
    for _ in range(6):  # half an hour of heartbeats, five minutes apart
        beat(berlin, mid, 80.0)
        clock.advance(timedelta(minutes=5))
    clock.advance(timedelta(hours=3))  # the agent says nothing for three hours
    for _ in range(6):
        beat(berlin, mid, 10.0)
        clock.advance(timedelta(minutes=5))
    _, _, page = call(make_app(berlin), "/machine/train-a")
    chart = re.search(r'<svg class="sparkline".*?</svg>', page, re.S)
    assert chart is not None
    lines = re.findall(r'<polyline class="spark" points="([^"]+)"', chart.group(0))
    assert len(lines) == 2  # two runs of heartbeats, no straight line across the silence
    assert [len(p.split()) for p in lines] == [6, 6]
    # the time axis: from the first heartbeat (10:00 Berlin) to now (14:00 Berlin)
    labels = re.findall(r'<text class="spark-axis spark-(?:start|end)"[^>]*>([^<]+)</text>', page)
    assert labels == ["10:00 Europe/Berlin", "14:00 Europe/Berlin"]


def test_points_a_step_apart_make_one_line():
    t0 = datetime(2026, 11, 2, 9, tzinfo=UTC)
    pts = [(t0 + timedelta(minutes=5 * i), 50.0) for i in range(10)]
    one = svg.sparkline(pts, t0, t0 + timedelta(hours=1), step=timedelta(minutes=5))
    assert one.count("<polyline") == 1
    # a missing point or two (an agent late once) is not a gap: only more than two steps is
    late = [p for i, p in enumerate(pts) if i != 4]
    assert svg.sparkline(late, t0, t0 + timedelta(hours=1)).count("<polyline") == 1
    gone = [p for i, p in enumerate(pts) if i not in (4, 5, 6)]
    assert svg.sparkline(gone, t0, t0 + timedelta(hours=1)).count("<polyline") == 2


def test_the_favicon_answers_without_a_login(home, clock):
    a = App(make_settings(home), clock)
    wsgi = make_app(a, listen="0.0.0.0:8765", token="s3cret-token-of-the-team")
    status, _, body = call(wsgi, "/favicon.ico")
    assert status == 204 and body == ""
    assert call(wsgi, "/")[0] == 303  # the pages still need the login
    a.close()


def test_no_page_reloads_itself(berlin):
    for path in ("/", "/spend", "/machine/train-a", "/plan"):
        status, _, page = call(make_app(berlin), path)
        assert status == 200 and 'http-equiv="refresh"' not in page, path
