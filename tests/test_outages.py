"""Silence the scheduler's own endpoint caused never counts as idle: with
``unknown_counts_as_idle: true``, a busy machine whose heartbeats were refused during a flood,
or sent while the endpoint was down, is not stopped; the same silence once the endpoint is
back and answering is."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
from sqlalchemy import select

from provisioner import endpoint, heartbeats, outages
from provisioner.app import App
from provisioner.jobs import autostop, sweep
from provisioner.models import EndpointOutage, Heartbeat, Machine
from tests.conftest import make_settings, write_yaml
from tests.daemon import start_scheduler
from tests.test_autostop import WED_NOON, beats, launched, sched  # noqa: F401  (fixture)
from tests.test_heartbeat import launch, post, token_in, user_data
from tests.test_scheduler import BERLIN_NIGHTS

SILENCE_IS_IDLE = {
    "name": "always-off",
    "off_hours": {"timezone": "UTC", "weekends": ["mon-sun"]},
    "idle": {"gpu_util_below": 5, "for_minutes": 30, "unknown_counts_as_idle": True},
}


@pytest.fixture
def oapp(home, clock, tmp_path, db_url):
    write_yaml(tmp_path / "p.yaml", SILENCE_IS_IDLE)
    a = App(
        make_settings(
            home,
            state_url=db_url,
            policies=[str(tmp_path / "p.yaml")],
            scheduler={"endpoint_url": "http://10.0.0.5:8787"},
        ),
        clock,
    )
    yield a
    a.close()


def status(app: App, m: Machine) -> str:
    with app.db.session() as s:
        return s.get(Machine, m.id).status


def busy_hour(app: App, m: Machine) -> None:
    """An hour of heartbeats at 90 % every 5 minutes, recorded as the endpoint records them."""
    for _ in range(12):
        app.clock.advance(timedelta(minutes=5))
        heartbeats.record(app, m.id, [{"index": 0, "util": 90.0}])


def test_heartbeats_refused_in_a_flood_do_not_make_a_busy_machine_idle(oapp, clock):
    m = launch(oapp)
    token = token_in(user_data(oapp, m))
    rec = outages.Recorder(oapp, "test")
    assert rec.started() is None  # the first start: nothing was missed before
    with endpoint.Endpoint(oapp, port=0, per_address_limit=4, channel_timeout=600) as ep:
        ep.server.limits.on_refuse = rec.refused

        def beat() -> int:  # the agent, behind the same address as the flood (one NAT)
            ms = int(clock.now().timestamp() * 1000)
            body = {"gpus": [{"index": 0, "util": 90.0}]}
            try:
                return post(ep.url, m, token, body, ms, source="127.0.0.1")[0]
            except OSError:  # closed at once: a 503 the client may not get to read
                return 503

        for _ in range(12):  # an hour of busy heartbeats
            clock.advance(timedelta(minutes=5))
            assert beat() == 200
        rec.flush()
        flood = [socket.create_connection(ep.address, timeout=30) for _ in range(4)]
        try:
            for _ in range(40):  # 40 minutes of flood: every heartbeat refused
                clock.advance(timedelta(minutes=1))
                assert beat() == 503
        finally:
            for c in flood:
                c.close()
        rec.flush()
        sweep.run(oapp)
        assert status(oapp, m) == "running"
        with oapp.db.session() as s:
            (o,) = s.scalars(select(EndpointOutage))
            assert (o.reason, o.refused, o.ended_at) == ("address-limit", 40, None)  # going on

        # the flood is over and the endpoint answers: the same silence now is the machine's
        clock.advance(timedelta(hours=2))
        rec.flush()
        acts = sweep.run(oapp).actions
    assert [(a.action, a.reason) for a in acts] == [("stop", "off-hours-idle")]
    assert "no heartbeat (counted as idle)" in acts[0].why
    assert status(oapp, m) == "stopped"


def test_silence_while_the_endpoint_was_down_is_not_idle(oapp, clock):
    m = launch(oapp)
    rec = outages.Recorder(oapp, "first")
    rec.started()
    busy_hour(oapp, m)
    rec.flush()
    rec.stopped()  # the daemon stops (or dies: it was last seen at its last flush)

    clock.advance(timedelta(minutes=40))  # the agent's heartbeats have nowhere to go
    sweep.run(oapp)  # a cron sweep meanwhile: no endpoint runs, silence is not idle
    assert status(oapp, m) == "running"

    again = outages.Recorder(oapp, "second")
    down = again.started()  # the daemon restarts: the span between is recorded as down
    assert down is not None and down.reason == "down"
    assert down.ended_at - down.started_at == timedelta(minutes=40)
    sweep.run(oapp)
    assert status(oapp, m) == "running"

    clock.advance(timedelta(hours=2))  # up and answering all along: now it is the machine
    again.flush()
    sweep.run(oapp)
    assert status(oapp, m) == "stopped"


def test_without_any_outage_silence_follows_the_policy(oapp, clock):
    """The guard is no blanket: an endpoint that ran and refused nothing leaves the policy's
    ``unknown_counts_as_idle`` in charge."""
    m = launch(oapp)
    rec = outages.Recorder(oapp, "only")
    rec.started()
    busy_hour(oapp, m)
    for _ in range(8):  # 40 minutes of silence, the endpoint running and refusing nothing
        clock.advance(timedelta(minutes=5))
        rec.flush()
    sweep.run(oapp)
    assert status(oapp, m) == "stopped"
    with oapp.db.session() as s:
        assert s.scalars(select(EndpointOutage)).all() == []
        assert s.scalars(select(Heartbeat)).all()  # it had been heard, then went silent


def test_autostop_does_not_count_silence_the_endpoint_caused(sched):  # noqa: F811
    """A machine's own autostop under a policy that counts silence as idle: busy, then silent
    for 45 minutes while the endpoint refused connections — kept; the same without the
    refusals is stopped (as test_autostop shows)."""
    silent = BERLIN_NIGHTS.replace("unknown_counts_as_idle: false", "unknown_counts_as_idle: true")
    app, m = launched(sched, silent, WED_NOON)
    beats(app, m, [(90, 45, 80.0, 0)])  # busy, then silent for 45 minutes
    rec = outages.Recorder(app, "test")
    rec.started()
    app.clock.advance(timedelta(minutes=-20))
    rec.refused("connection-limit")  # a flood 20 minutes ago, going on
    app.clock.advance(timedelta(minutes=20))
    rec.refused("connection-limit")
    rec.flush()
    assert sweep.run(app).actions == []
    assert autostop.show(app, m)["why_not"] is not None
    assert status(app, m) == "running"


@pytest.mark.slow
def test_a_restarted_scheduler_records_the_time_it_was_down(home, tmp_path):
    import signal
    import sqlite3

    from tests.conftest import write_settings

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    write_yaml(tmp_path / "p.yaml", SILENCE_IS_IDLE)
    cfg = write_settings(
        home, policies=[str(tmp_path / "p.yaml")], scheduler={"listen": f"127.0.0.1:{port}"}
    )
    logs = []
    for run in range(2):
        log = tmp_path / f"run{run}.log"
        proc = start_scheduler(cfg, port, log)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert proc.returncode == 0, log.read_text()
        logs.append(log.read_text())
    assert "the endpoint was down from" not in logs[0]  # the first start: nothing before it
    assert "the endpoint was down from" in logs[1]
    with sqlite3.connect(home / "state.db") as db:
        rows = db.execute("SELECT reason, started_at < ended_at FROM endpoint_outages").fetchall()
    assert rows == [("down", 1)]
