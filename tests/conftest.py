"""Shared fixtures: an isolated provisioner home, settings with a fast sandbox cloud, an App on
a manual clock, and a way to run the real CLI."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import hypothesis
import pytest
import yaml

from provisioner.app import App
from provisioner.clock import CLOCK_ENV, ManualClock
from provisioner.identity import os_user
from provisioner.settings import Settings

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # an emulator stopping is not news
# CI replays the same generated examples every run; developers' runs explore new ones.
hypothesis.settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    hypothesis.settings.load_profile("ci")
# No test may reach past loopback: no cloud metadata service probes either.
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "configs" / "examples"


def _loopback_only() -> None:
    """No test reaches the internet: a connection from the test process to any address off
    this machine fails at once, naming it (a name other than localhost is refused unresolved,
    so a stray ``api.telegram.org`` neither waits on DNS nor leaks). Installed once, however
    often pytest imports this file."""
    import ipaddress
    import socket

    if getattr(socket.socket.connect, "loopback_only", False):
        return
    plain_connect, plain_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def near(address: object) -> bool:
        if not isinstance(address, tuple) or not address:
            return True  # AF_UNIX and the like: this machine
        host = str(address[0]).split("%", 1)[0]
        if host in ("localhost", ""):
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def refused(address: object) -> OSError:
        return OSError(f"tests reach no address off this machine (asked for {address!r})")

    def connect(self: socket.socket, address: object) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not near(address):
            raise refused(address)
        plain_connect(self, address)  # type: ignore[arg-type]

    def connect_ex(self: socket.socket, address: object) -> int:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not near(address):
            raise refused(address)
        return plain_connect_ex(self, address)  # type: ignore[arg-type]

    connect.loopback_only = True  # type: ignore[attr-defined]
    socket.socket.connect = connect  # type: ignore[method-assign]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign]


_loopback_only()


@pytest.fixture(autouse=True)
def user_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HOME is an empty directory of the test run's, for every test and the CLI processes it
    starts: what `up` takes from ``~/.ssh`` (a key) or any SDK from ``~/.aws``/``~/.config``
    never depends on the machine the suite runs on. A test that wants a key puts it there."""
    home = tmp_path_factory.getbasetemp() / "user-home"
    home.mkdir(exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
    # who runs the suite launches as the experiments' usual owner (provisioner.identity)
    monkeypatch.setenv(MEMBERS_ENV, json.dumps({os_user(): TEST_OWNER, _pg_role(): TEST_OWNER}))
    return home


#: the owner of the tests' experiments: the OS user running the suite is mapped to it
TEST_OWNER = "ana@example.com"
MEMBERS_ENV = "PROVISIONER_IDENTITY__MEMBERS"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private PROVISIONER_HOME; no user config file leaks in. What the test left running
    from its folder (a sandbox machine's job or agent, detached on purpose: it outlives the
    command that started it) is ended with the test, not left to run on."""
    h = tmp_path / "home"
    monkeypatch.setenv("PROVISIONER_HOME", str(h))
    monkeypatch.delenv("PROVISIONER_CONFIG", raising=False)
    monkeypatch.delenv("PROVISIONER_STATE_URL", raising=False)
    yield h
    end_processes_of(tmp_path)


def end_processes_of(folder: Path) -> list[int]:
    """Kill every process whose command line names ``folder`` (this one and its parents
    spared); the pids killed."""
    import signal

    mark, spared, killed = str(folder).encode(), {os.getpid(), os.getppid()}, []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in spared:
            continue
        try:
            if mark not in (entry / "cmdline").read_bytes():
                continue
            os.kill(int(entry.name), signal.SIGKILL)
            killed.append(int(entry.name))
        except (OSError, ProcessLookupError):
            continue  # gone already, or not ours to read
    return killed


#: Where every test's time starts: a Monday morning early in a month, whatever the wall clock says.
TEST_START = datetime(2026, 11, 2, 9, 0, tzinfo=UTC)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(TEST_START)


def make_settings(home: Path, **overrides: object) -> Settings:
    """Settings with a fast sandbox; a new SQLite state in ``home`` starts as a copy of the
    worker's migrated one (:func:`migrated_sqlite`)."""
    return start_state(_settings(home, **overrides))


def _settings(home: Path, **overrides: object) -> Settings:
    # the machines' own agent off: the scheduler's side is tested alone (test_sandbox_guard
    # turns it on)
    sandbox = {
        "latency_seconds": 0,
        "retry_base_seconds": 0.001,
        "retry_max_seconds": 0.01,
        "agent": False,
    }
    sandbox.update(overrides.pop("sandbox", {}))  # type: ignore[arg-type]
    data: dict = {
        "home": home,
        "state_url": overrides.pop("state_url", None) or os.environ.get("PROVISIONER_TEST_DB_URL"),
        "clouds": {"sandbox": sandbox, **overrides.pop("clouds", {})},  # type: ignore[dict-item]
    }
    data.update(overrides)
    return Settings(**data)


#: The PostgreSQL server the ``postgres`` half writes to (a schema per test), only when named:
#: nothing writes to a database the user did not name. `.ci/run` sets it.
PG_URL = os.environ.get("PROVISIONER_TEST_POSTGRES_URL", "")


def _pg_role() -> str:
    """The role the PostgreSQL half connects as (its actor: provisioner.identity)."""
    from sqlalchemy.engine import make_url

    return (make_url(PG_URL).username if PG_URL else None) or "postgres"


def _postgres_problem() -> str | None:
    if not PG_URL:
        return "PostgreSQL half off: set PROVISIONER_TEST_POSTGRES_URL to run it"
    try:
        import psycopg

        psycopg.connect(PG_URL, connect_timeout=3).close()
    except Exception as e:  # any failure to reach it means: skip, and say why in one line
        return f"PostgreSQL not reachable at {PG_URL}: {str(e).splitlines()[0]}"
    return None


@pytest.fixture(scope="session")
def postgres_problem() -> str | None:
    return _postgres_problem()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests parametrized onto the PostgreSQL server carry the ``postgres`` marker, so
    ``-m "not postgres"`` runs without one."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("db_url") == "postgresql":
            item.add_marker(pytest.mark.postgres)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest):
    """Each state test runs on SQLite (a file in the test's home) and on PostgreSQL (a fresh
    schema in the database PROVISIONER_TEST_POSTGRES_URL names, dropped afterwards)."""
    if request.param == "sqlite":
        yield None
        return
    problem = request.getfixturevalue("postgres_problem")
    if problem:
        pytest.skip(problem)
    import psycopg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield f"{PG_URL}?options=-csearch_path%3D{schema}&application_name={schema}"
    finally:  # a test that left a session open must not block the drop
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = %s",
                (schema,),
            )
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


#: the worker's SQLite state at the newest schema (set by :func:`migrated_sqlite`; in the
#: environment, because test files import this module a second time as ``tests.conftest``)
MIGRATED_ENV = "PROVISIONER_TEST_MIGRATED_STATE"


@pytest.fixture(scope="session", autouse=True)
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A SQLite state at the newest schema, migrated once per worker process: a test's new
    SQLite state (``make_settings``) starts as a copy of it, as the product would have made it
    on the tests' clock, marked as a simulated-clock state (provisioner.realclock) (Alembic's
    upgrade costs ~50 ms of CPU a database). The CLI's settings
    (``write_settings``) and the migration tests start with none."""
    from provisioner.state import Database

    path = tmp_path_factory.mktemp("migrated") / "state.db"
    db = Database(f"sqlite:///{path}")
    db.migrate(simulated=True)  # made on the tests' clock: a simulated-clock state
    db.dispose()
    os.environ[MIGRATED_ENV] = str(path)
    yield path
    os.environ.pop(MIGRATED_ENV, None)


def start_state(settings: Settings) -> Settings:
    """``settings``' SQLite state, when it has none yet, is a copy of the migrated one (0600, as
    the product creates it); a PostgreSQL schema is left to be migrated."""
    url, migrated = settings.database_url, os.environ.get(MIGRATED_ENV)
    if migrated and url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///"))
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(migrated, path)
            path.chmod(0o600)
    return settings


@pytest.fixture
def settings(home: Path, db_url: str | None) -> Settings:
    return make_settings(home, state_url=db_url)


@pytest.fixture
def app(settings: Settings, clock: ManualClock):
    a = App(settings, clock)
    yield a
    a.close()


@pytest.fixture
def agent_app(home: Path, clock: ManualClock, db_url: str | None):
    """An app whose settings name the endpoint agents report to (startup data carries one)."""
    a = App(
        make_settings(home, state_url=db_url, scheduler={"endpoint_url": "http://10.0.0.5:8787"}),
        clock,
    )
    yield a
    a.close()


def write_yaml(path: Path, data: object) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def sandbox_experiment(name: str = "exp", **resources: object) -> dict:
    """An experiment dict on the sandbox cloud (T4:1 spot unless told otherwise)."""
    res = {"gpu": "T4:1", "market": "spot", "clouds": ["sandbox"], "disk_gb": 50}
    res.update(resources)
    return {"name": name, "project": "demo", "owner": "ana@example.com", "resources": res}


#: set for a test marked ``slow``: its ``run_cli`` starts a fresh interpreter
FRESH_CLI_ENV = "PROVISIONER_TEST_FRESH_CLI"


@pytest.fixture(autouse=True)
def _cli_interpreter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("slow") is not None:
        monkeypatch.setenv(FRESH_CLI_ENV, "1")


def run_cli(
    *args: str,
    env: dict | None = None,
    cwd: Path | None = None,
    timeout: float = 120,
    now: datetime = TEST_START,
    fresh: bool | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the real console entry point, its clock starting at ``now`` (never the wall clock: a
    test must pass on every day of every month), and give its exit code, stdout and stderr.

    ``fresh``: in a new interpreter (``python -m provisioner``), as a user runs it. By default
    only the end-to-end tests (marked ``slow``) and runs that must end their process (a
    crashpoint's SIGKILL, ``ssh``'s exec) do: elsewhere the entry point runs in this process
    (a fresh interpreter costs ~1 s of CPU), with the same environment, working directory,
    empty stdin, and an exception printed as the interpreter would (a traceback, exit 1)."""
    full_env = {**os.environ, CLOCK_ENV: now.isoformat(), **(env or {})}
    if fresh is None:
        fresh = any(v in full_env for v in (FRESH_CLI_ENV, "PROVISIONER_CRASH_AT")) or "ssh" in args
    if not fresh:
        return _run_here(list(args), full_env, cwd or ROOT)
    return subprocess.run(
        [sys.executable, "-m", "provisioner", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd or ROOT,
        timeout=timeout,
    )


def _run_here(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``provisioner.entry.main`` in this process, as :func:`run_cli` describes."""
    import logging
    import traceback
    from contextlib import redirect_stderr, redirect_stdout

    from provisioner.entry import main

    saved = (dict(os.environ), sys.argv, sys.stdin, os.getcwd())
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level  # `scheduler run` configures logging
    out, err = (io.TextIOWrapper(io.BytesIO(), "utf-8", write_through=True) for _ in "12")
    os.environ.clear()
    os.environ.update(env)
    sys.argv, sys.stdin = ["provisioner", *argv], io.StringIO()
    os.chdir(cwd)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:  # sys.exit("message"): printed, exit 1
                    print(e.code, file=sys.stderr)
                    code = 1
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        os.environ.clear()
        os.environ.update(saved[0])
        sys.argv, sys.stdin = saved[1], saved[2]
        os.chdir(saved[3])
        root.handlers[:], root.level = handlers, level
    return subprocess.CompletedProcess(["provisioner", *argv], code, _text(out), _text(err))


def _text(stream: io.TextIOWrapper) -> str:
    """What was written to ``stream`` (text and ``.buffer``), as ``text=True`` reads a pipe."""
    stream.flush()
    raw = stream.buffer.getvalue()  # type: ignore[attr-defined]
    return raw.decode().replace("\r\n", "\n").replace("\r", "\n")


def write_settings(home: Path, **overrides: object) -> Path:
    """A settings file for CLI runs: the same fast sandbox as ``make_settings`` (no state yet:
    the first command makes it)."""
    s = _settings(home, **overrides)
    data = s.model_dump(mode="json", exclude_defaults=False)
    path = home.parent / "settings.yaml"
    home.mkdir(parents=True, exist_ok=True)
    return write_yaml(path, data)
