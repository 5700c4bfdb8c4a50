"""The job is told: the real agent code polls a metadata server on loopback that speaks each
cloud's documented shape (AWS IMDSv2 with its token and the 404 before a notice, GCP's
``instance/preempted``, Azure's Scheduled Events), signals a real child process or runs a
command once per notice, and posts the notice, signed, to the scheduler's endpoint, which
records one ``preemption-notice`` event with the cloud's time. No notice: nothing happens."""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from provisioner import agent, endpoint, startup
from provisioner.app import App
from provisioner.clock import Clock
from provisioner.errors import ConfigError
from provisioner.models import Event, Machine
from provisioner.spec import load_experiment
from tests.conftest import TEST_START, make_settings
from tests.test_heartbeat import launch, token_in, user_data

NOT_BEFORE = "2026-11-02T09:02:00Z"  # the cloud's time in each shape below
AZURE_NOT_BEFORE = "Mon, 02 Nov 2026 09:02:00 GMT"  # RFC 1123, as Scheduled Events writes it


class Metadata(ThreadingHTTPServer):
    """A metadata service that answers exactly as each cloud documents (see provisioner/agent.py
    for the sources); ``notice`` switches the announcement on."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), MetadataHandler)
        self.notice = False
        self.tokens: set[str] = set()
        self.requests: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class MetadataHandler(BaseHTTPRequestHandler):
    server: Metadata

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: str = "", ctype: str = "text/plain") -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:
        self.server.requests.append("PUT " + self.path)
        # IMDSv2: the session token, for a TTL of 1..21600 seconds given in the header
        ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
        if self.path != "/latest/api/token" or not ttl.isdigit() or not 0 < int(ttl) <= 21600:
            return self._send(400)
        token = secrets.token_urlsafe(16)
        self.server.tokens.add(token)
        self._send(200, token)

    def do_GET(self) -> None:
        self.server.requests.append("GET " + self.path)
        notice = self.server.notice
        if self.path == "/latest/meta-data/spot/instance-action":
            # HttpTokens=required: no valid token, 401; no interruption scheduled, 404
            if self.headers.get("X-aws-ec2-metadata-token") not in self.server.tokens:
                return self._send(401)
            if not notice:
                return self._send(404)
            doc = {"action": "terminate", "time": NOT_BEFORE}
            return self._send(200, json.dumps(doc), "application/json")
        if self.path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._send(403)
            return self._send(200, "TRUE" if notice else "FALSE")
        if self.path == "/metadata/scheduledevents?api-version=2020-07-01":
            if self.headers.get("Metadata") != "true":
                return self._send(400)
            events = [
                {
                    "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
                    "EventType": "Preempt",
                    "ResourceType": "VirtualMachine",
                    "Resources": ["exp"],
                    "EventStatus": "Scheduled",
                    "NotBefore": AZURE_NOT_BEFORE,
                }
            ]
            doc = {"DocumentIncarnation": 2 if notice else 1, "Events": events if notice else []}
            return self._send(200, json.dumps(doc), "application/json")
        self._send(404)


@pytest.fixture
def metadata() -> Iterator[Metadata]:
    server = Metadata()
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def job() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A real child process that sleeps until signalled, with a unique mark in its command
    line (the pattern the agent is given), started and ready."""
    mark = "pv-job-" + secrets.token_hex(6)
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(300)", mark],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    yield child, mark
    if child.poll() is None:
        child.kill()
    child.wait(timeout=30)


def setup(agent_app: Any, tmp_path: Path) -> tuple[Machine, Path]:
    m = launch(agent_app)
    token_file = tmp_path / "agent-token"
    token_file.write_text(token_in(user_data(agent_app, m)) + "\n")
    return m, token_file


def watcher(
    cloud: str, ep: endpoint.Endpoint, m: Machine, token_file: Path, md: Metadata, **kw: Any
) -> agent.NoticeWatcher:
    logs: list[str] = []
    w = agent.NoticeWatcher(
        cloud,
        ep.url,
        m.id,
        str(token_file),
        metadata_url=md.url,
        now=lambda: TEST_START.timestamp(),  # the agent's clock agrees with the scheduler's
        log=logs.append,
        **kw,
    )
    w.logs = logs  # type: ignore[attr-defined]
    return w


def notices(app: Any, m: Machine) -> list[Event]:
    with app.db.session() as s:
        return list(
            s.scalars(
                select(Event).where(Event.machine_id == m.id, Event.kind == "preemption-notice")
            )
        )


EXPECTED = {  # per cloud: the event's action and the cloud's time, as recorded
    "aws": ("terminate", "2026-11-02T09:02:00+00:00"),
    "gcp": ("preempt", None),  # Google's notice carries no time
    "azure": ("preempt", "2026-11-02T09:02:00+00:00"),
}


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_a_notice_signals_the_job_once_and_is_recorded_with_the_clouds_time(
    agent_app, tmp_path, metadata, job, cloud
):
    child, mark = job
    m, token_file = setup(agent_app, tmp_path)
    with endpoint.Endpoint(agent_app, port=0) as ep:
        w = watcher(cloud, ep, m, token_file, metadata, action={"signal": "SIGTERM", "to": mark})
        for _ in range(3):  # before the cloud announces anything: nothing happens
            w.tick()
        assert child.poll() is None
        assert notices(agent_app, m) == []

        metadata.notice = True
        w.tick()
        assert child.wait(timeout=30) == -signal.SIGTERM  # the job got SIGTERM
        w.tick()
        w.tick()  # the notice is still up: neither told nor posted again
    (ev,) = notices(agent_app, m)
    action, not_before = EXPECTED[cloud]
    assert (ev.reason, ev.detail["not_before"], ev.detail["cloud"]) == (action, not_before, cloud)
    assert ev.detail["seen_at"] == "2026-11-02T09:00:00+00:00"
    assert ev.at == TEST_START
    assert not [line for line in w.logs if "failed" in line or "refused" in line], w.logs  # type: ignore[attr-defined]


def test_aws_asks_for_one_session_token_and_reuses_it(agent_app, tmp_path, metadata):
    m, token_file = setup(agent_app, tmp_path)
    with endpoint.Endpoint(agent_app, port=0) as ep:
        w = watcher("aws", ep, m, token_file, metadata)
        for _ in range(4):
            w.tick()
        metadata.tokens.clear()  # the session expired early: 401, then a fresh token
        w.tick()
    puts = [r for r in metadata.requests if r.startswith("PUT")]
    gets = [r for r in metadata.requests if r.startswith("GET")]
    assert puts == ["PUT /latest/api/token"] * 2
    assert gets == ["GET /latest/meta-data/spot/instance-action"] * 6
    assert notices(agent_app, m) == []


def test_a_notice_can_run_a_command_instead(agent_app, tmp_path, metadata):
    m, token_file = setup(agent_app, tmp_path)
    out = tmp_path / "told"
    env = "$PROVISIONER_NOTICE_CLOUD $PROVISIONER_NOTICE_NOT_BEFORE"
    command = f"echo {env} >> {out}.part && mv {out}.part {out}"
    with endpoint.Endpoint(agent_app, port=0) as ep:
        w = watcher("azure", ep, m, token_file, metadata, action={"run": command})
        w.tick()
        metadata.notice = True
        w.tick()
        w.tick()
    for _ in range(600):  # the command is started, not waited for: wait for its file
        if out.exists():
            break
        time.sleep(0.05)  # not Event.wait: under libfaketime its timed wait can hang (CI)
    assert out.read_text() == f"azure {NOT_BEFORE}\n"  # ran once, with the notice in its env
    assert len(notices(agent_app, m)) == 1


def test_a_lost_post_is_retried_and_recorded_once(agent_app, tmp_path, metadata):
    m, token_file = setup(agent_app, tmp_path)
    with endpoint.Endpoint(agent_app, port=0) as ep:
        w = watcher("gcp", ep, m, token_file, metadata)
        url = w.endpoint
        w.endpoint = "http://127.0.0.1:9"  # the scheduler cannot be reached
        metadata.notice = True
        w.tick()
        assert notices(agent_app, m) == [] and len(w.unsent) == 1
        w.endpoint = url
        w.tick()
        assert w.unsent == []
        # the same notice posted again (an answer lost on the way back): one event
        body = {
            "cloud": "gcp",
            "event_id": "gcp:preempted",
            "action": "preempt",
            "not_before": None,
            "seen_at": None,
        }
        assert post_notice(ep, m, token_file, body, 10) == 200
    assert len(notices(agent_app, m)) == 1


def post_notice(
    ep: endpoint.Endpoint, m: Machine, token_file: Path, body: Any, plus_ms: int
) -> int:
    ms = int(TEST_START.timestamp() * 1000) + plus_ms
    token = token_file.read_text().strip()
    return agent.post(ep.url, m.id, token, body, ms, route=agent.NOTICE)


def test_notices_are_signed_and_replay_protected_like_heartbeats(agent_app, tmp_path):
    m, token_file = setup(agent_app, tmp_path)
    body = {
        "cloud": "aws",
        "event_id": "aws:terminate:x",
        "action": "terminate",
        "not_before": NOT_BEFORE,
        "seen_at": None,
    }
    ms = int(TEST_START.timestamp() * 1000)
    raw = json.dumps(body).encode()
    with endpoint.Endpoint(agent_app, port=0) as ep:
        assert post_notice(ep, m, token_file, body, 0) == 200
        assert post_notice(ep, m, token_file, body, 0) == 409  # the same request again
        wrong = token_file.parent / "wrong"
        wrong.write_text("not-the-token")
        assert post_notice(ep, m, wrong, body, 1) == 401
        # a heartbeat's signature does not pass for a notice (the route is signed)
        import urllib.error
        import urllib.request

        key = agent.signing_key(token_file.read_text().strip())
        auth = agent.authorization(key, m.id, ms + 2, raw)  # signed for /v1/heartbeat
        req = urllib.request.Request(
            ep.url + "/v1/notice", data=raw, headers={"Authorization": auth}, method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 401
        bad = {**body, "not_before": "tomorrow"}
        assert post_notice(ep, m, token_file, bad, 3) == 400
        # heartbeats keep their own sequence: a notice's time does not refuse them
        hb = agent.post(ep.url, m.id, token_file.read_text().strip(), {"gpus": []}, ms)
        assert hb == 200
    assert len(notices(agent_app, m)) == 1


def test_clouds_without_a_documented_notice_are_said_so_and_not_polled(tmp_path):
    """Yandex and SberCloud document no notice on the machine (see agent.py): the agent says
    so once and only sends heartbeats."""
    assert set(agent.WATCHERS) == {"aws", "gcp", "azure"}
    args = ["--endpoint", "http://127.0.0.1:9", "--machine", "m", "--interval", "3600"]
    args += ["--token-file", str(tmp_path / "none"), "--cloud", "yandex"]
    proc = subprocess.Popen(
        [sys.executable, agent.__file__, *args], stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert first.strip() == "provisioner-agent: yandex documents no preemption notice"


def test_startup_data_passes_the_cloud_and_the_action(tmp_path):
    action = {"signal": "SIGTERM", "to": "python train.py"}
    data = startup.startup_data(
        None, "http://10.0.0.1:8787", "tok", 30, "m-1", cloud="aws", on_notice=action
    )
    assert "--cloud 'aws' --on-notice-file /etc/provisioner/on-notice.json" in data
    written = data.split("<<'PV_NOTICE_EOF'\n")[1].split("\nPV_NOTICE_EOF")[0]
    path = tmp_path / "on-notice.json"
    path.write_text(written)
    assert agent.load_action(str(path)) == action  # what the agent reads back
    plain = startup.startup_data(None, "http://10.0.0.1:8787", "tok", 30, "m-1", cloud="gcp")
    assert "--cloud 'gcp'" in plain and "on-notice.json" not in plain


def test_spec_field_syntax_and_errors(tmp_path):
    base = (
        "name: llama\nproject: nlp\nowner: ana@example.com\nresources:\n  gpu: A100:8\n"
        "lifecycle:\n  on_preemption_notice:\n"
    )

    def load(tail: str) -> Any:
        p = tmp_path / "exp.yaml"
        p.write_text(base + tail)
        return load_experiment(p).lifecycle.on_preemption_notice

    got = load("    signal: term\n    to: train\\.py\n")
    assert got.for_agent() == {"signal": "SIGTERM", "to": "train\\.py"}
    assert load("    to: train.py\n").for_agent() == {"signal": "SIGTERM", "to": "train.py"}
    assert load("    run: touch /data/STOP\n").for_agent() == {"run": "touch /data/STOP"}

    field = "lifecycle.on_preemption_notice"
    for tail, where, words in (
        ("    signal: SIGFOO\n    to: x\n", (8, field + ".signal"), "unknown signal"),
        ("    to: '(unclosed'\n", (8, field + ".to"), "not a regular expression"),
        ("    signal: SIGTERM\n", (7, field), "say what to do"),
        ("    run: x\n    to: y\n", (7, field), "not both"),
        ("    kill: x\n", (8, field + ".kill"), "unknown field"),
    ):
        with pytest.raises(ConfigError) as e:
            load(tail)
        (p,) = e.value.problems
        assert (p.line, p.field) == where and words in p.message.lower(), (tail, p)


def test_an_unreachable_metadata_service_tells_nobody_and_logs_sparingly(agent_app, tmp_path, job):
    child, mark = job
    m, token_file = setup(agent_app, tmp_path)
    with endpoint.Endpoint(agent_app, port=0) as ep:
        down = Metadata()
        down.server_close()  # its port, closed: every check fails
        w = watcher("gcp", ep, m, token_file, down, action={"signal": "SIGTERM", "to": mark})
        for _ in range(8):
            w.tick()
    assert child.poll() is None and notices(agent_app, m) == []
    failed = [line for line in w.logs if "notice check failed" in line]  # type: ignore[attr-defined]
    assert [line.split("(")[1].split(")")[0] for line in failed] == ["1", "2", "4", "8"]


def test_the_agent_command_line_watches_and_tells(home, db_url, tmp_path, metadata, job):
    """The agent as the startup data runs it (``--cloud``, ``--on-notice-file``), in its own
    process: it signs with the machine's wall clock, so this scheduler keeps the wall clock."""
    child, mark = job
    app = App(
        make_settings(home, state_url=db_url, scheduler={"endpoint_url": "http://10.0.0.5:8787"}),
        Clock(),
    )
    try:
        m, token_file = setup(app, tmp_path)
        action = tmp_path / "on-notice.json"
        action.write_text(json.dumps({"signal": "SIGTERM", "to": mark}))
        metadata.notice = True
        with endpoint.Endpoint(app, port=0) as ep:
            args = ["--endpoint", ep.url, "--machine", m.id, "--token-file", str(token_file)]
            args += ["--interval", "3600", "--cloud", "aws", "--metadata-url", metadata.url]
            args += ["--notice-interval", "0.05", "--on-notice-file", str(action)]
            proc = subprocess.Popen([sys.executable, agent.__file__, *args])
            try:
                assert child.wait(timeout=60) == -signal.SIGTERM
                for _ in range(1200):  # bounded: the post follows the signal
                    if notices(app, m):
                        break
                    # a relative sleep: under libfaketime (CI's edge-date run) a timed
                    # Event.wait on a loaded machine was seen never to return
                    time.sleep(0.05)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
        (ev,) = notices(app, m)
        assert (ev.detail["cloud"], ev.reason) == ("aws", "terminate")
        assert ev.detail["not_before"] == "2026-11-02T09:02:00+00:00"
    finally:
        app.close()
