"""The state database never keeps a command waiting without end: a server that accepts the
connection and never answers, a statement stuck on the server, a SQLite file another process
holds — each is one line, within the timeouts settings give (``database:``), with defaults
(issue 33: such a server hung `status` for 300 s and more)."""

from __future__ import annotations

import socket
import threading

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from provisioner.app import App
from provisioner.errors import database_failure
from tests.conftest import make_settings, run_cli, write_settings


@pytest.fixture
def mute_server():
    """A TCP server on 127.0.0.1 that accepts every connection and never says a word."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1]
    done.set()
    listener.close()
    for s in held:
        s.close()


def test_a_server_that_never_answers_is_one_line(home, mute_server):
    cfg = write_settings(
        home,
        state_url=f"postgresql://ana@127.0.0.1:{mute_server}/team",
        database={"connect_timeout_seconds": 1},
    )
    for args in (["status"], ["events"], ["status", "-o", "json"]):
        r = run_cli("--config", str(cfg), *args, timeout=60)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]  # -o json: also on stdout
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr[-2000:])
        assert len(lines) == 1 and "connection timeout expired" in lines[0], (args, lines)


def test_a_statement_past_the_statement_timeout_is_cancelled_and_said(home, clock, db_url):
    if db_url is None:
        pytest.skip("statement_timeout is PostgreSQL's")
    app = App(
        make_settings(home, state_url=db_url, database={"statement_timeout_seconds": 1}), clock
    )
    with pytest.raises(OperationalError) as e, app.db.session() as s:
        s.execute(text("SELECT pg_sleep(30)"))
    said = database_failure(e.value)
    assert said is not None and "canceling statement due to statement timeout" in said
    app.close()
