"""The idle signal end to end: the token issued at launch travels in the startup data, the agent
posts over real HTTP on loopback, a wrong or missing token is refused with 401 and nothing is
recorded; the agent survives every error; idle is computed from what was recorded."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import re
import sqlite3
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from provisioner import agent, endpoint, idle, machines, startup
from provisioner.app import App
from provisioner.jobs.metrics import Metrics
from provisioner.models import Event, Heartbeat, Machine
from provisioner.spec import Experiment
from tests.conftest import TEST_START, sandbox_experiment


def launch(app: App, name: str = "exp", script: str | None = "#!/bin/bash\necho hi") -> Machine:
    spec = sandbox_experiment(name)
    spec["startup_script"] = script
    return machines.up(app, Experiment.model_validate(spec)).machine


def user_data(app: App, m: Machine) -> str:
    db = sqlite3.connect(app.provider("sandbox").db_path)
    try:
        return db.execute(
            "SELECT user_data FROM machines WHERE id = ?", (m.instance_id,)
        ).fetchone()[0]
    finally:
        db.close()


def token_in(data: str) -> str:
    return re.search(r"<<'PV_TOKEN_EOF'\n(\S+)\nPV_TOKEN_EOF", data).group(1)


def post(
    url: str,
    machine: Machine | str,
    token: str | None,
    body: object,
    at: datetime | int | None = None,
    headers: dict[str, str] | None = None,
    source: str | None = None,
) -> tuple[int, dict]:
    """A heartbeat as the agent signs it: ``at`` (default: the test clock's start) is the time
    it carries; ``token=None`` sends it unsigned; ``source``: from that loopback address."""
    mid = machine if isinstance(machine, str) else machine.id
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    ms = at if isinstance(at, int) else int((at or TEST_START).timestamp() * 1000)
    if token is not None:
        hdrs["Authorization"] = agent.authorization(agent.signing_key(token), mid, ms, raw)
    if source is not None:
        import http.client

        where = urllib.parse.urlsplit(url)
        c = http.client.HTTPConnection(
            where.hostname, where.port, timeout=30, source_address=(source, 0)
        )
        try:
            c.request("POST", "/v1/heartbeat", raw, hdrs)
            r = c.getresponse()
            return r.status, json.loads(r.read() or b"null")
        finally:
            c.close()
    req = urllib.request.Request(url + "/v1/heartbeat", data=raw, headers=hdrs, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def count_beats(app: App) -> int:
    with app.db.session() as s:
        return s.scalar(select(func.count()).select_from(Heartbeat))


def test_token_travels_in_startup_data_and_only_its_hash_is_stored(agent_app):
    m = launch(agent_app)
    data = user_data(agent_app, m)
    token = token_in(data)
    assert m.agent_token_hash == startup.token_hash(token) != token
    # the agent is installed as a service, then the user's script runs unchanged
    assert "--endpoint 'http://10.0.0.5:8787'" in data and "provisioner-agent.service" in data
    assert data.rstrip().endswith("exec /var/lib/provisioner/startup")
    assert "#!/bin/bash\necho hi\n" in data
    assert "def run(" in data  # the agent itself, copied onto the machine
    # the token is nowhere in provisioner's own records
    with agent_app.db.session() as s:
        details = [json.dumps(e.detail) for e in s.scalars(select(Event))]
        row = s.get(Machine, m.id)
    assert not any(token in d for d in details)
    assert token not in json.dumps(row.spec)


def test_cloud_config_user_data_is_combined_as_multipart(agent_app):
    m = launch(agent_app, script="#cloud-config\npackages: [htop]\n")
    data = user_data(agent_app, m)
    assert data.startswith("Content-Type: multipart/mixed")
    assert "text/x-shellscript" in data and "text/cloud-config" in data
    assert "packages: [htop]" in data


def test_no_endpoint_in_settings_means_an_agent_without_heartbeats(app):
    """The agent guards every machine (issue #32); without an endpoint it has no token and
    sends nothing, and the user's script still runs unchanged after it."""
    m = launch(app)
    data = user_data(app, m)
    assert "/usr/local/bin/provisioner-agent --state-dir" in data
    assert "--endpoint" not in data.split("ExecStart=")[1].split("\n")[0]
    assert "agent-token" not in data
    assert data.rstrip().endswith("exec /var/lib/provisioner/startup")
    assert "#!/bin/bash\necho hi\n" in data
    assert m.agent_token_hash is None


def test_endpoint_records_good_tokens_and_refuses_others(agent_app):
    m = launch(agent_app)
    other = launch(agent_app, "other")
    token = token_in(user_data(agent_app, m))
    ms = int(TEST_START.timestamp() * 1000)
    with endpoint.Endpoint(agent_app, port=0) as ep:
        gpus = [{"index": 0, "util": 42.5, "mem_used_mb": 1000, "mem_total_mb": 16000}]
        assert post(ep.url, m, token, {"gpus": gpus}, ms) == (200, {"ok": True, "machine": "exp"})
        assert post(ep.url, m, "not-a-token", {"gpus": gpus}, ms + 1)[0] == 401
        assert post(ep.url, other, token, {"gpus": gpus}, ms + 2)[0] == 401  # not its machine
        assert post(ep.url, m, None, {"gpus": gpus}, ms + 3)[0] == 401
        bearer = {"Authorization": f"Bearer {token}"}  # the token itself is no longer accepted
        assert post(ep.url, m, None, {"gpus": gpus}, ms + 4, bearer)[0] == 401
        assert post(ep.url, m, token, b"{nope", ms + 5)[0] == 400
        assert post(ep.url, m, token, {"gpus": [{"util": 250}]}, ms + 6)[0] == 400
        with urllib.request.urlopen(ep.url + "/healthz", timeout=10) as r:
            assert json.loads(r.read()) == {"ok": True}
        machines.down(agent_app, "exp")
        assert post(ep.url, m, token, {"gpus": gpus}, ms + 7)[0] == 401  # a terminated machine
    assert count_beats(agent_app) == 1
    with agent_app.db.session() as s:
        hb = s.scalars(select(Heartbeat)).one()
    assert (hb.machine_id, hb.max_util, hb.gpus[0]["mem_total_mb"]) == (m.id, 42.5, 16000.0)
    assert other.id != hb.machine_id


def test_replayed_stale_and_future_heartbeats_are_refused(agent_app):
    m = launch(agent_app)
    token = token_in(user_data(agent_app, m))
    ms = int(TEST_START.timestamp() * 1000)
    window = int(endpoint.REPLAY_WINDOW.total_seconds() * 1000)
    body = {"gpus": [{"index": 0, "util": 3.0}]}
    with endpoint.Endpoint(agent_app, port=0) as ep:
        assert post(ep.url, m, token, body, ms)[0] == 200
        assert post(ep.url, m, token, body, ms)[0] == 409  # the same request again
        assert post(ep.url, m, token, body, ms - 1)[0] == 409  # an older one, captured earlier
        assert post(ep.url, m, token, body, ms - window - 1)[0] == 401  # stale
        assert post(ep.url, m, token, body, ms + window + 1)[0] == 401  # from the future
        assert post(ep.url, m, token, body, ms + 1)[0] == 200  # the next one
    assert count_beats(agent_app) == 2


def test_a_replay_is_refused_after_the_scheduler_restarts(agent_app):
    """The newest signed time per machine is kept in the state database, not in the process:
    a heartbeat captured before a restart is refused after it (issue 26)."""
    m = launch(agent_app)
    token = token_in(user_data(agent_app, m))
    ms = int(TEST_START.timestamp() * 1000)
    body = {"gpus": [{"index": 0, "util": 3.0}]}
    with endpoint.Endpoint(agent_app, port=0) as ep:
        assert post(ep.url, m, token, body, ms)[0] == 200
    restarted = App(agent_app.settings, agent_app.clock)  # another process on the same state
    try:
        with endpoint.Endpoint(restarted, port=0) as ep:
            assert post(ep.url, m, token, body, ms)[0] == 409  # captured, sent again
            assert post(ep.url, m, token, body, ms - 1)[0] == 409
            assert post(ep.url, m, token, body, ms + 1)[0] == 200  # the agent's next one
    finally:
        restarted.close()
    assert count_beats(agent_app) == 2


def raw_request(ep: endpoint.Endpoint, head: bytes, wait: float = 30) -> bytes:
    """Send ``head`` as it is and read until the server closes (bounded by ``wait``)."""
    import socket

    with socket.create_connection(ep.address, timeout=wait) as c:
        c.sendall(head)
        chunks = []
        with contextlib.suppress(ConnectionResetError):
            while chunk := c.recv(65536):
                chunks.append(chunk)
    return b"".join(chunks)


def status_of(reply: bytes) -> bytes:
    return reply.split(b"\r\n")[0].split(b" ")[1] if reply else b"closed"


def test_endpoint_refuses_bad_lengths_and_never_waits_forever(agent_app, caplog):
    m = launch(agent_app)
    token = token_in(user_data(agent_app, m))
    ms = int(TEST_START.timestamp() * 1000)
    auth = agent.authorization(agent.signing_key(token), m.id, ms, b"{}")
    with endpoint.Endpoint(agent_app, port=0, channel_timeout=1) as ep:
        head = b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        signed = head + f"Authorization: {auth}\r\n".encode()
        # Unsigned, with a body that never comes or is garbage: 401 once the request is in,
        # never a parse of the body.
        for body in (b"{nope", b"[" * 60000, b'{"gpus": 7}'):
            length = f"Content-Length: {len(body)}\r\n\r\n".encode()
            assert status_of(raw_request(ep, head + length + body)) == b"401"
        # RFC 9112 §6.3: an invalid Content-Length is a 400; too large a 413, unread; none 411
        for length, status in ((b"abc", b"400"), (b"-1", b"400"), (b"99999999", b"413")):
            reply = raw_request(ep, signed + b"Content-Length: " + length + b"\r\n\r\n")
            assert status_of(reply) == status, (length, reply)
        assert status_of(raw_request(ep, signed + b"\r\n")) == b"411"
        # Signed, deep JSON: refused as a bad body, not a RecursionError.
        deep = b"[" * 60000
        assert post(ep.url, m, token, deep, ms)[0] == 400
        # A client that promises a body and stalls is cut off; the endpoint answers others.
        stalled = signed + b"Content-Length: 10\r\n\r\n"
        assert b" 200 " not in raw_request(ep, stalled)
        assert post(ep.url, m, token, {"gpus": [{"index": 0, "util": 1.0}]}, ms + 1)[0] == 200
    assert count_beats(agent_app) == 1
    assert "Traceback" not in caplog.text and not [
        r for r in caplog.records if r.levelno >= logging.ERROR
    ]


def test_slow_clients_hold_sockets_not_threads(agent_app):
    """300 connections that send part of a request and stall: the endpoint's threads stay
    what they were (waitress reads on one I/O thread), the stalled sockets are closed (over
    the per-address cap at once, the others after the header deadline), and a real heartbeat
    from another address is recorded."""
    import socket

    m = launch(agent_app)
    token = token_in(user_data(agent_app, m))
    body = {"gpus": [{"index": 0, "util": 50.0}]}
    with endpoint.Endpoint(agent_app, port=0, channel_timeout=1, connection_limit=50) as ep:
        before = threading.active_count()
        slow = []
        try:
            for i in range(300):
                c = socket.create_connection(ep.address, timeout=30)
                c.sendall(b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n")
                slow.append(c)
                if i % 50 == 0:
                    assert threading.active_count() <= before, i
            peak = threading.active_count()
            assert post(ep.url, m, token, body, source="127.0.0.2")[0] == 200
            closed = sum(1 for c in slow if _closed_by_server(c))
        finally:
            for c in slow:
                c.close()
    assert peak <= before
    assert closed >= 250  # the stalled ones were cut off, not served by a thread each
    assert count_beats(agent_app) == 1


def _closed_by_server(c) -> bool:
    """The server closed ``c`` (after a 503 for one over a cap, or with nothing said)."""
    c.settimeout(30)
    try:
        while c.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


def test_agent_without_nvml_reports_no_gpu(agent_app, tmp_path):
    """No GPU and no NVML library here: the real reader says so instead of failing. (NVML
    itself cannot be exercised on this machine.)"""
    m = launch(agent_app)
    token_file = tmp_path / "token"
    token_file.write_text(token_in(user_data(agent_app, m)) + "\n")
    gpus, note = agent.GPUReader().read()
    assert gpus == [] and note.startswith("no gpu:")
    sleeps: list[float] = []
    with endpoint.Endpoint(agent_app, port=0) as ep:
        agent.run(
            ep.url,
            m.id,
            str(token_file),
            30,
            sleep=sleeps.append,
            stop=lambda: len(sleeps) >= 2,
            now=lambda: TEST_START.timestamp(),  # the endpoint's clock: within its window
        )
    assert sleeps == [30, 30]  # both heartbeats accepted: no backoff
    with agent_app.db.session() as s:
        beats = list(s.scalars(select(Heartbeat)))
    assert [(b.gpus, b.max_util) for b in beats] == [([], None), ([], None)]


def test_agent_never_raises_and_backs_off(tmp_path):
    logs: list[str] = []
    sleeps: list[float] = []
    # nothing listens on port 9 of loopback, and the token file does not exist yet
    agent.run(
        "http://127.0.0.1:9",
        "m-1",
        str(tmp_path / "missing"),
        10,
        sleep=sleeps.append,
        stop=lambda: len(sleeps) >= 4,
        log=logs.append,
    )
    (tmp_path / "token").write_text("t")
    agent.run(
        "http://127.0.0.1:9",
        "m-1",
        str(tmp_path / "token"),
        10,
        sleep=sleeps.append,
        stop=lambda: len(sleeps) >= 8,
        log=logs.append,
    )
    assert len(logs) == 8 and "FileNotFoundError" in logs[0] and "URLError" in logs[-1]
    assert all(s > 10 for s in sleeps) and max(sleeps) <= agent.MAX_BACKOFF_SECONDS
    assert sleeps[3] > sleeps[0]  # the wait grows with repeated failures


def test_agent_reads_gpus_through_nvml_when_it_is_there():
    """A stand-in NVML module with the real function names (the GPU path cannot run here)."""

    class Rates:
        gpu = 3

    class Mem:
        used, total = 2**30, 16 * 2**30

    class FakeNVML:
        def nvmlInit(self):
            pass

        def nvmlDeviceGetCount(self):
            return 2

        def nvmlDeviceGetHandleByIndex(self, i):
            return i

        def nvmlDeviceGetUtilizationRates(self, h):
            return Rates()

        def nvmlDeviceGetMemoryInfo(self, h):
            return Mem()

    reader = agent.GPUReader()
    reader._nvml = FakeNVML()
    gpus, note = reader.read()
    assert note is None
    assert gpus[1] == {"index": 1, "util": 3.0, "mem_used_mb": 1024, "mem_total_mb": 16384}


T0 = datetime(2026, 11, 6, 20, 0, tzinfo=UTC)
W = timedelta(minutes=30)
G = timedelta(minutes=5)


def beats(*points: tuple[int, float | None]) -> list[idle.Beat]:
    """(minutes before T0, busiest GPU %)"""
    return [idle.Beat(T0 - timedelta(minutes=m), u) for m, u in sorted(points, reverse=True)]


@pytest.mark.parametrize(
    ("points", "since", "expected"),
    [
        ([(m, 2.0) for m in range(0, 40, 2)], 120, "idle"),
        ([(m, 2.0 if m != 10 else 60.0) for m in range(0, 40, 2)], 120, "busy"),
        ([(m, 2.0) for m in range(10, 40, 2)], 120, "unknown"),  # silent for the last 10 min
        ([(m, 2.0) for m in range(0, 40, 2) if not 10 < m < 20], 120, "unknown"),  # a gap
        ([(m, 2.0) for m in range(0, 20, 2)], 120, "unknown"),  # no beats the first 10 min
        ([(m, None) for m in range(0, 40, 2)], 120, "unknown"),  # the agent sees no GPU
        ([], 120, "unknown"),
        ([(m, 2.0) for m in range(0, 20, 2)], 20, "starting"),  # up for 20 of 30 minutes
        ([(m, 5.0) for m in range(0, 40, 2)], 120, "busy"),  # at the threshold is not below
    ],
)
def test_idle_needs_every_gpu_below_the_threshold_for_the_whole_window(points, since, expected):
    got = idle.classify(
        beats(*points),
        now=T0,
        running_since=T0 - timedelta(minutes=since),
        below=5.0,
        window=W,
        grace=G,
    )
    assert got == expected


def scrape(url: str, token: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(url + "/metrics", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_show_machines_utilisation_and_actions(agent_app):
    m = launch(agent_app)
    token = token_in(user_data(agent_app, m))
    metrics = Metrics(agent_app)
    with endpoint.Endpoint(agent_app, port=0, metrics=metrics, metrics_token="scrape-me") as ep:
        gpus = [{"index": 0, "util": 77.0}, {"index": 1, "util": 12.0}]
        assert post(ep.url, m, token, {"gpus": gpus})[0] == 200
        assert scrape(ep.url)[0] == 401
        assert scrape(ep.url, "wrong")[0] == 401
        code, text = scrape(ep.url, "scrape-me")
    assert code == 200
    assert 'provisioner_machines{cloud="sandbox",state="running"} 1.0' in text
    assert 'provisioner_gpu_utilization_ratio{cloud="sandbox",gpu="0",machine="exp"} 0.77' in text
    assert 'provisioner_gpu_utilization_ratio{cloud="sandbox",gpu="1",machine="exp"} 0.12' in text
    assert "provisioner_idle_machines 0.0" in text


def test_metrics_without_a_token_name_no_machine(agent_app):
    m = launch(agent_app)
    token = token_in(user_data(agent_app, m))
    with endpoint.Endpoint(agent_app, port=0, metrics=Metrics(agent_app)) as ep:
        assert post(ep.url, m, token, {"gpus": [{"index": 0, "util": 77.0}]})[0] == 200
        code, text = scrape(ep.url)
    assert code == 200
    assert 'provisioner_machines{cloud="sandbox",state="running"} 1.0' in text
    assert "exp" not in text and "machine=" not in text


def test_other_wsgi_apps_mount_beside_the_endpoint(agent_app):
    """The dashboard's way in: a WSGI app under ``/`` gets every other path, with SCRIPT_NAME
    and PATH_INFO as PEP 3333 has them; the endpoint's own paths stay the endpoint's."""
    seen = []

    def hello(environ, start_response):
        seen.append((environ["SCRIPT_NAME"], environ["PATH_INFO"]))
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"hello"]

    with endpoint.Endpoint(agent_app, port=0, apps={"/": hello, "/dash": hello}) as ep:
        for path in ("/", "/dash/x", "/v1/other"):
            with urllib.request.urlopen(ep.url + path, timeout=10) as r:
                assert r.read() == b"hello"
        with urllib.request.urlopen(ep.url + "/healthz", timeout=10) as r:
            assert json.loads(r.read()) == {"ok": True}
    assert seen == [("", "/"), ("/dash", "/x"), ("", "/v1/other")]


def test_status_says_when_the_agent_sees_no_gpu(agent_app, clock):
    """A wrong image or a missing driver shows in `status` within a heartbeat: the agent
    (here without NVML, as on such a machine) reports no GPU for a T4 machine."""
    from datetime import timedelta

    from tests.conftest import run_cli, write_settings

    m = launch(agent_app)
    token = token_in(user_data(agent_app, m))
    with endpoint.Endpoint(agent_app, port=0) as ep:
        gpus, note = agent.GPUReader().read()  # no NVML here: no GPU, and why
        assert gpus == [] and note
        assert post(ep.url, m, token, {"gpus": gpus, "note": note})[0] == 200
    s = agent_app.settings
    cfg = write_settings(
        agent_app.settings.home, state_url=s.state_url, scheduler=s.scheduler.model_dump()
    )
    at = clock.now() + timedelta(minutes=1)
    table = run_cli("--config", str(cfg), "status", "--no-refresh", now=at)
    assert "exp: the agent sees 0 of 1 GPUs: driver missing or wrong image?" in table.stderr
    js = run_cli("--config", str(cfg), "status", "--no-refresh", "-o", "json", now=at)
    assert [x["problem"] for x in json.loads(js.stdout)] == [
        "the agent sees 0 of 1 GPUs: driver missing or wrong image?"
    ]
    later = run_cli("--config", str(cfg), "status", "--no-refresh", now=at + timedelta(hours=1))
    assert "GPUs" not in later.stderr  # an old heartbeat says nothing about now


def reference_signal(beats, *, now, running_since, below, window, grace):
    """The idle rule read off each heartbeat (how the sweep judged before the database summed
    the heartbeats up): the oracle the summed-up evidence must agree with."""
    start = now - window
    if running_since is not None and running_since > start:
        return "starting"
    recent = [b for b in beats if b.at >= start - grace]
    if not recent or recent[-1].at < now - grace:
        return "unknown"
    in_window = [b for b in recent if b.at >= start]
    if any(b.max_util is not None and b.max_util >= below for b in in_window):
        return "busy"
    if any(b.max_util is None for b in in_window):
        return "unknown"
    seen = [b.at for b in recent] + [now]
    if seen[0] > start + grace or any(b - a > grace for a, b in itertools.pairwise(seen)):
        return "unknown"
    return "idle"


def test_database_evidence_gives_the_verdicts_of_each_heartbeat(app):
    """Random heartbeat histories (gaps of exactly the grace, a microsecond over it, agents
    that see no GPU, a threshold met exactly): the sweep's evidence, summed up by the database
    in two queries, gives every machine the verdict its heartbeats give, for two windows."""
    from random import Random

    from sqlalchemy import event, insert

    rnd, windows = Random(16), [timedelta(minutes=30), timedelta(minutes=10)]
    history: dict[str, list[idle.Beat]] = {}
    with app.db.engine.begin() as conn:
        for i in range(80):
            mid = f"m{i:03d}"
            conn.execute(
                insert(Machine.__table__),
                {
                    "id": mid,
                    "name": mid,
                    "project": "p",
                    "owner": "o",
                    "status": "running",
                    "spec": {},
                    "created_at": T0 - timedelta(days=1),
                },
            )
            at, beats = T0 - timedelta(minutes=rnd.choice((20, 36, 45))), []
            usual = rnd.choice((2.0, 2.0, 2.0, 4.999, 5.0, 60.0))
            while at <= T0 + timedelta(seconds=rnd.choice((-400, 0, 30))):
                util = usual if rnd.random() > 0.03 else rnd.choice((None, 5.0, 1.0))
                beats.append(idle.Beat(at, util))
                at += rnd.choice(
                    [timedelta(seconds=30)] * 30
                    + [G, G + timedelta(microseconds=1), G - timedelta(microseconds=1), 2 * G]
                )
            history[mid] = beats
            if beats:
                conn.execute(
                    insert(Heartbeat.__table__),
                    [
                        {"machine_id": mid, "at": b.at, "gpus": [], "max_util": b.max_util}
                        for b in beats
                    ],
                )
    statements: list[str] = []
    plans: list[str] = []

    def seen(conn, cursor, statement, parameters, *rest):
        statements.append(statement)
        if conn.dialect.name == "sqlite" and not plans:  # the query over every machine
            plans.append(
                str(
                    cursor.connection.execute(
                        "EXPLAIN QUERY PLAN " + statement, parameters
                    ).fetchall()
                )
            )

    verdicts = []
    for busy_at in (None, 5.0):  # None: every machine's silences read
        statements.clear()
        event.listen(app.db.engine, "before_cursor_execute", seen)
        got = idle.evidence(app, list(history), T0, windows, G, busy_at)
        event.remove(app.db.engine, "before_cursor_execute", seen)
        # one query for all, one for the silences of those whose verdict turns on them
        assert len([s for s in statements if s.lstrip().upper().startswith("SELECT")]) == 2
        for mid, beats in history.items():
            for w in windows:
                ev = got.get((mid, w), idle.Evidence(None, None, None, 0, None))
                held = idle.Evidence.of(beats, now=T0, window=w, grace=G)
                assert ev == replace(held, gap_us=ev.gap_us), (mid, w)
                assert ev.gap_us in (None, held.gap_us), (mid, w)
                for since in (T0 - 2 * w, T0 - w / 2):
                    kw = dict(now=T0, running_since=since, below=5.0, window=w, grace=G)
                    verdict = idle.judge(ev, **kw)
                    assert verdict == reference_signal(beats, **kw), (mid, w, beats)
                    verdicts.append(verdict)
        if plans:  # recent heartbeats read by time, not by walking every machine's day (for
            # up to 500 machines, a page of the fleet: each one's recent ones by its index)
            assert (
                "USING INDEX ix_heartbeats_at" in plans[0]
                or "USING INDEX ix_heartbeats_machine_at (machine_id=? AND at>?)" in plans[0]
            ), plans[0]
        silences_read = sum(ev.gap_us is not None for ev in got.values())
        assert 0 < silences_read < len(got)  # the busy and the silent needed none
    assert set(verdicts) == {"idle", "busy", "unknown", "starting"}


def test_a_signature_holds_for_its_own_route_only(agent_app):
    """A heartbeat and a preemption notice are signed over their route: one cannot be replayed
    as the other, and each route keeps its own sequence of times."""
    m = launch(agent_app)
    token = token_in(user_data(agent_app, m))
    ms = int(TEST_START.timestamp() * 1000)
    body = {"gpus": [{"index": 0, "util": 7.0}]}
    raw = json.dumps(body).encode()
    as_notice = agent.authorization(agent.signing_key(token), m.id, ms, raw, agent.NOTICE)
    with endpoint.Endpoint(agent_app, port=0) as ep:
        assert post(ep.url, m, None, body, headers={"Authorization": as_notice})[0] == 401
        notice = {"cloud": "aws", "event_id": "e", "action": "stop", "not_before": None}
        assert agent.post(ep.url, m.id, token, notice, ms + 5, route=agent.NOTICE) == 200
        assert post(ep.url, m, token, body, ms)[0] == 200  # older than the notice: still good
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(ep.url + "/v1/notice", timeout=30)
        assert e.value.code == 405
    assert count_beats(agent_app) == 1


def test_the_launch_passes_the_cloud_and_the_notice_action_to_the_agent(agent_app):
    """The startup data names the cloud whose preemption notice the agent watches, and what it
    does on one (``lifecycle.on_preemption_notice``)."""
    spec = sandbox_experiment("exp")
    spec["lifecycle"] = {"on_preemption_notice": {"signal": "SIGUSR1", "to": "train\\.py"}}
    m = machines.up(agent_app, Experiment.model_validate(spec)).machine
    data = user_data(agent_app, m)
    assert "--cloud 'sandbox' --on-notice-file /etc/provisioner/on-notice.json" in data
    assert '{"signal": "SIGUSR1", "to": "train\\\\.py"}\nPV_NOTICE_EOF' in data
