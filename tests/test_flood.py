"""Nobody blinds the scheduler: with 1,000 idle and 100 byte-a-second connections from one
address, real heartbeats from another address and ``/healthz`` are still answered; the flood's
sockets are capped per address and cut off at the request deadlines; the refusals are recorded
as an outage of the endpoint."""

from __future__ import annotations

import contextlib
import http.client
import resource
import socket
import statistics
import threading
import time

import pytest

from provisioner import endpoint
from tests.test_heartbeat import count_beats, launch, post, token_in, user_data

FLOOD = "127.0.0.1"


def healthz(address: tuple[str, int], source: str) -> int:
    c = http.client.HTTPConnection(*address, timeout=30, source_address=(source, 0))
    try:
        c.request("GET", "/healthz")
        return c.getresponse().status
    finally:
        c.close()


def timed(call):
    t = time.perf_counter()
    result = call()
    return result, (time.perf_counter() - t) * 1000


@pytest.fixture
def many_files():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 8192) if hard != resource.RLIM_INFINITY else 8192
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if want < 2500:
        pytest.skip(f"needs 2,500 file descriptors; the hard limit is {hard}")
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
def test_a_flood_from_one_address_does_not_blind_the_endpoint(agent_app, many_files):
    m = launch(agent_app)
    token = token_in(user_data(agent_app, m))
    refusals: list[str] = []
    ms = int(agent_app.clock.now().timestamp() * 1000)
    beat = {"gpus": [{"index": 0, "util": 87.0}]}
    stop = threading.Event()
    slow: list[socket.socket] = []
    idle_socks: list[socket.socket] = []
    with endpoint.Endpoint(agent_app, port=0, on_refuse=refusals.append) as ep:

        def slowloris() -> None:  # a byte a second on each, headers never finished
            while not stop.is_set():
                for c in list(slow):
                    with contextlib.suppress(OSError):
                        c.send(b"X")
                time.sleep(1)

        try:
            for _ in range(100):
                c = socket.create_connection(ep.address, timeout=30, source_address=(FLOOD, 0))
                c.sendall(b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\n")
                slow.append(c)
            loris = threading.Thread(target=slowloris, daemon=True)
            loris.start()
            for _ in range(1000):
                idle_socks.append(
                    socket.create_connection(ep.address, timeout=30, source_address=(FLOOD, 0))
                )
            beats, checks = [], []
            for k in range(20):  # while the flood holds every socket it can
                (code, _), took = timed(
                    lambda k=k: post(ep.url, m, token, beat, ms + k, source="127.0.0.2")
                )
                assert code == 200
                beats.append(took)
                code, took = timed(lambda: healthz(ep.address, "127.0.0.3"))
                assert code == 200
                checks.append(took)
            # the flooder's own sockets: 32 at most kept, each cut off at its deadline
            time.sleep(12)
            (code, _), after = timed(
                lambda: post(ep.url, m, token, beat, ms + 20, source="127.0.0.2")
            )
            assert code == 200
            assert healthz(ep.address, FLOOD) == 200  # the flooder's held sockets were cut off
        finally:
            stop.set()
            for c in slow + idle_socks:
                c.close()
    assert count_beats(agent_app) == 21
    assert len(refusals) >= 1000 and set(refusals) == {"address-limit"}
    print(
        f"\nflood: 1,000 idle + 100 slowloris from {FLOOD}; {len(refusals)} refused at accept;"
        f" heartbeat ms median {statistics.median(beats):.1f} max {max(beats):.1f};"
        f" /healthz ms median {statistics.median(checks):.1f} max {max(checks):.1f};"
        f" after 12 s {after:.1f}"
    )
