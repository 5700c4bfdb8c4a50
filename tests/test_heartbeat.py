"""The idle signal end to end: the token issued at launch travels in the startup data, the agent
posts over real HTTP on loopback, a wrong or missing token is refused with 401 and nothing is
recorded; the agent survives every error; idle is computed from what was recorded."""

from __future__ import annotations

import json
import re
import sqlite3
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from provisioner import agent, idle, lifecycle
from provisioner.app import App
from provisioner.jobs.metrics import Metrics
from provisioner.models import Event, Heartbeat, Machine
from provisioner.spec import Experiment
from tests.conftest import make_settings, sandbox_experiment


@pytest.fixture
def agent_app(home, clock, db_url):
    a = App(
        make_settings(home, state_url=db_url, scheduler={"endpoint_url": "http://10.0.0.5:8787"}),
        clock,
    )
    yield a
    a.close()


def launch(app: App, name: str = "exp", script: str | None = "#!/bin/bash\necho hi") -> Machine:
    spec = sandbox_experiment(name)
    spec["startup_script"] = script
    return lifecycle.up(app, Experiment.model_validate(spec)).machine


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


def post(url: str, token: str | None, body: object) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/heartbeat", data=raw, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
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
    assert m.agent_token_hash == idle.token_hash(token) != token
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


def test_no_endpoint_in_settings_means_no_agent(app):
    m = launch(app)
    assert user_data(app, m) == "#!/bin/bash\necho hi"
    assert m.agent_token_hash is None


def test_endpoint_records_good_tokens_and_refuses_others(agent_app):
    m = launch(agent_app)
    other = launch(agent_app, "other")
    token = token_in(user_data(agent_app, m))
    with idle.Endpoint(agent_app, port=0) as ep:
        gpus = [{"index": 0, "util": 42.5, "mem_used_mb": 1000, "mem_total_mb": 16000}]
        assert post(ep.url, token, {"gpus": gpus}) == (200, {"ok": True, "machine": "exp"})
        assert post(ep.url, "not-a-token", {"gpus": gpus})[0] == 401
        assert post(ep.url, None, {"gpus": gpus})[0] == 401
        assert post(ep.url, idle.token_hash(token), {"gpus": gpus})[0] == 401  # the hash is no key
        assert post(ep.url, token, b"{nope")[0] == 400
        assert post(ep.url, token, {"gpus": [{"util": 250}]})[0] == 400
        with urllib.request.urlopen(ep.url + "/healthz", timeout=10) as r:
            assert json.loads(r.read()) == {"ok": True}
        lifecycle.down(agent_app, "exp")
        assert post(ep.url, token, {"gpus": gpus})[0] == 401  # a terminated machine's token
    assert count_beats(agent_app) == 1
    with agent_app.db.session() as s:
        hb = s.scalars(select(Heartbeat)).one()
    assert (hb.machine_id, hb.max_util, hb.gpus[0]["mem_total_mb"]) == (m.id, 42.5, 16000.0)
    assert other.id != hb.machine_id


def raw_request(ep: idle.Endpoint, head: bytes, wait: float = 30) -> bytes:
    """Send ``head`` as it is and read until the server closes (bounded by ``wait``)."""
    import socket

    host, port = ep.server.server_address[:2]
    with socket.create_connection((host, port), timeout=wait) as c:
        c.sendall(head)
        chunks = []
        while chunk := c.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_endpoint_refuses_before_reading_and_never_waits_forever(agent_app, monkeypatch):
    m = launch(agent_app)
    token = token_in(user_data(agent_app, m))
    monkeypatch.setattr(idle, "SOCKET_TIMEOUT", 0.5)
    with idle.Endpoint(agent_app, port=0) as ep:
        monkeypatch.setattr(ep.server.RequestHandlerClass, "timeout", 0.5)
        # No token: 401 at once, although the promised body never comes.
        head = b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: 50000\r\n\r\n"
        assert raw_request(ep, head).startswith(b"HTTP/1.0 401")
        auth = f"Authorization: Bearer {token}\r\n".encode()
        for length, status in ((b"abc", b"411"), (b"-1", b"413"), (b"99999999", b"413")):
            head = b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\n" + auth
            reply = raw_request(ep, head + b"Content-Length: " + length + b"\r\n\r\n")
            assert reply.split(b"\r\n")[0].split(b" ")[1] == status, (length, reply)
        # A client that promises a body and stalls is cut off by the socket timeout, and the
        # endpoint keeps answering others.
        stalled = (
            b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 10\r\n\r\n"
        )
        assert b" 200 " not in raw_request(ep, stalled)
        gpus = [{"index": 0, "util": 1.0}]
        assert post(ep.url, token, {"gpus": gpus})[0] == 200
    assert count_beats(agent_app) == 1


def test_agent_without_nvml_reports_no_gpu(agent_app, tmp_path):
    """No GPU and no NVML library here: the real reader says so instead of failing. (NVML
    itself cannot be exercised on this machine.)"""
    m = launch(agent_app)
    token_file = tmp_path / "token"
    token_file.write_text(token_in(user_data(agent_app, m)) + "\n")
    gpus, note = agent.GPUReader().read()
    assert gpus == [] and note.startswith("no gpu:")
    sleeps: list[float] = []
    with idle.Endpoint(agent_app, port=0) as ep:
        agent.run(ep.url, str(token_file), 30, sleep=sleeps.append, stop=lambda: len(sleeps) >= 2)
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
        str(tmp_path / "missing"),
        10,
        sleep=sleeps.append,
        stop=lambda: len(sleeps) >= 4,
        log=logs.append,
    )
    (tmp_path / "token").write_text("t")
    agent.run(
        "http://127.0.0.1:9",
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


def test_metrics_show_machines_utilisation_and_actions(agent_app):
    m = launch(agent_app)
    token = token_in(user_data(agent_app, m))
    metrics = Metrics(agent_app)
    with idle.Endpoint(agent_app, port=0, metrics=metrics) as ep:
        gpus = [{"index": 0, "util": 77.0}, {"index": 1, "util": 12.0}]
        assert post(ep.url, token, {"gpus": gpus})[0] == 200
        with urllib.request.urlopen(ep.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    assert 'provisioner_machines{cloud="sandbox",state="running"} 1.0' in text
    assert 'provisioner_gpu_utilization_percent{cloud="sandbox",gpu="0",machine="exp"} 77.0' in text
    assert 'provisioner_gpu_utilization_percent{cloud="sandbox",gpu="1",machine="exp"} 12.0' in text
    assert "provisioner_idle_machines 0.0" in text


def test_status_says_when_the_agent_sees_no_gpu(agent_app, clock):
    """A wrong image or a missing driver shows in `status` within a heartbeat: the agent
    (here without NVML, as on such a machine) reports no GPU for a T4 machine."""
    from datetime import timedelta

    from tests.conftest import run_cli, write_settings

    m = launch(agent_app)
    token = token_in(user_data(agent_app, m))
    with idle.Endpoint(agent_app, port=0) as ep:
        gpus, note = agent.GPUReader().read()  # no NVML here: no GPU, and why
        assert gpus == [] and note
        assert post(ep.url, token, {"gpus": gpus, "note": note})[0] == 200
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
