"""Broken input, generated: never a traceback, every message names file, line and field, exit 2."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import sys
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from provisioner.errors import ConfigError
from provisioner.settings import load_settings
from provisioner.spec import load_experiment
from tests.conftest import ROOT

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

VALID = {
    "name": "llama",
    "project": "nlp",
    "owner": "ana@example.com",
    "resources": {
        "gpu": "A100:8",
        "market": "spot",
        "clouds": ["aws", "gcp"],
        "max_price_per_hour": "40 USD",
        "disk_gb": 200,
        "min_vcpus": 32,
    },
    "lifecycle": {
        "max_lifetime": "48h",
        "on_preemption": "relaunch",
        "idle": {"gpu_util_below": 5, "for_minutes": 30},
    },
    "labels": {"team": "nlp"},
}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["A100:x", "-1 USD", "99999999999999h", "spot ", "", "nan"]),
)
values = st.recursive(
    scalars,
    lambda c: st.one_of(
        st.lists(c, max_size=3), st.dictionaries(st.text(max_size=6), c, max_size=3)
    ),
    max_leaves=6,
)


def paths(d, prefix=()):
    for k, v in d.items():
        yield (*prefix, k)
        if isinstance(v, dict):
            yield from paths(v, (*prefix, k))


ALL_PATHS = list(paths(VALID))


def parent_of(doc, path):
    """The mapping that holds ``path``'s last key, or None where earlier changes cut the path."""
    for k in path[:-1]:
        doc = doc.get(k) if isinstance(doc, dict) else None
    return doc if isinstance(doc, dict) else None


@st.composite
def broken_documents(draw):
    doc = yaml.safe_load(yaml.safe_dump(VALID))
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(ALL_PATHS))
        parent = parent_of(doc, path)
        if parent is None:
            continue
        action = draw(st.sampled_from(["delete", "replace", "add"]))
        if action == "delete":
            parent.pop(path[-1], None)
        elif action == "replace":
            parent[path[-1]] = draw(values)
        else:
            parent[draw(st.text(min_size=1, max_size=8))] = draw(values)
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def garbled(text: str, data) -> str:
    i = data.draw(st.integers(0, max(0, len(text) - 1)))
    junk = data.draw(
        st.sampled_from([":", "- ", "[", "{", "\t", "'", "&a", "*b", "!!python/object "])
    )
    return text[:i] + junk + text[i:]


def check_problems(e: ConfigError, file: Path, text: str) -> None:
    assert e.problems
    for p in e.problems:
        assert p.file == str(file)
        if text.strip():
            # YAML also breaks lines at \x85, \u2028, \u2029: count them as it does
            assert p.line is not None and 1 <= p.line <= len(text.splitlines()) + 1, p
        assert p.message
        assert (
            p.field is not None
            or "YAML" in p.message
            or "mapping" in p.message
            or "empty" in p.message
        ), p


FAST = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FAST
@given(text=broken_documents())
def test_broken_experiments_are_reported_not_raised(tmp_path, text):
    f = tmp_path / "exp.yaml"
    f.write_text(text)
    try:
        load_experiment(f)
    except ConfigError as e:
        check_problems(e, f, text)


@FAST
@given(data=st.data())
def test_garbled_yaml_is_reported_with_a_line(tmp_path, data):
    text = garbled(yaml.safe_dump(VALID, sort_keys=False), data)
    f = tmp_path / "exp.yaml"
    f.write_text(text)
    try:
        load_experiment(f)
    except ConfigError as e:
        check_problems(e, f, text)


SETTINGS_VALID = {
    "currency": "USD",
    "rates": {"RUB": 80},
    "clouds": {"aws": {"regions": ["us-east-1"]}},
    "smtp": {"host": "localhost", "port": 25, "security": "none"},
    "prices": {"sbercloud": {"p3.2xlarge.8": {"price": 300}}},
}
SETTINGS_PATHS = list(paths(SETTINGS_VALID))


@FAST
@given(data=st.data())
def test_broken_settings_are_reported(tmp_path, data, monkeypatch):
    monkeypatch.setenv("PROVISIONER_HOME", str(tmp_path))
    doc = yaml.safe_load(yaml.safe_dump(SETTINGS_VALID))
    path = data.draw(st.sampled_from(SETTINGS_PATHS))
    parent_of(doc, path)[path[-1]] = data.draw(values)
    text = yaml.safe_dump(doc, sort_keys=False)
    f = tmp_path / "settings.yaml"
    f.write_text(text)
    try:
        load_settings(f)
    except ConfigError as e:
        check_problems(e, f, text)


POLICY_VALID = {
    "name": "nlp",
    "applies_to": {"projects": ["nlp-*"], "owners": ["*@example.com"]},
    "allow": {"clouds": ["aws"], "gpus": ["A100"], "markets": ["spot"]},
    "max_gpus_per_machine": 8,
    "max_machines": 3,
    "max_price_per_hour": "25 USD",
    "budget": {
        "amount": "5000 USD",
        "period": "month",
        "alerts": {"actual": [50, 100]},
        "on_exhausted": "stop",
        "recipients": ["a@example.com"],
    },
    "off_hours": {
        "timezone": "Europe/Berlin",
        "windows": [{"days": "mon-fri", "start": "20:00", "end": "08:00"}],
        "holidays": {"country": "DE"},
    },
    "idle": {"gpu_util_below": 10, "for_minutes": 20, "action": "stop"},
    "max_lifetime": {"after": "72h", "action": "terminate"},
}
POLICY_PATHS = list(paths(POLICY_VALID))


@FAST
@given(data=st.data())
def test_broken_policies_are_reported(tmp_path, data):
    from policies.loader import PolicyError, load

    doc = yaml.safe_load(yaml.safe_dump(POLICY_VALID))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(POLICY_PATHS))
        parent = parent_of(doc, path)
        if parent is not None:
            parent[path[-1]] = data.draw(values)
    text = yaml.safe_dump(doc, sort_keys=False)
    if data.draw(st.booleans()):
        text = garbled(text, data)
    f = tmp_path / "policy.yaml"
    f.write_text(text)
    try:
        load([f])
    except PolicyError as e:
        check_problems(e, f, text)


def run_main(argv: list[str]) -> tuple[int, str]:
    from provisioner.cli.main import main

    err, out = io.StringIO(), io.StringIO()
    old = sys.argv
    sys.argv = ["provisioner", *argv]
    try:
        with redirect_stderr(err), redirect_stdout(out):
            main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = old
    return code, err.getvalue() + out.getvalue()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=broken_documents())
def test_cli_exits_2_with_a_located_message(tmp_path, text, monkeypatch):
    monkeypatch.setenv("PROVISIONER_HOME", str(tmp_path / "home"))
    f = tmp_path / "exp.yaml"
    f.write_text(text)
    code, output = run_main(["plan", str(f)])
    assert "Traceback" not in output
    if code != 0:
        assert code == 2, output
        assert f"{f}:" in output


@pytest.mark.parametrize(
    "text", ["name: [unclosed\n", "\x00\x01", "resources: !!python/object:os.system ls\n"]
)
def test_hostile_yaml(tmp_path, text):
    f = tmp_path / "exp.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_experiment(f)
    assert "YAML" in str(e.value) or "mapping" in str(e.value)


@pytest.mark.parametrize(
    "value", [24000000000.0, -24000000000.0, "99999999999999h", ".inf", "P99999999D", 1e308, -1]
)
def test_absurd_durations_are_errors_not_overflows(tmp_path, value):
    from policies.loader import PolicyError, load

    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"name": "p", "max_lifetime": value}))
    with pytest.raises(PolicyError) as e:
        load([f])
    assert e.value.problems[0].field.startswith("max_lifetime")
    g = tmp_path / "e.yaml"
    g.write_text(yaml.safe_dump({**VALID, "lifecycle": {"max_lifetime": value}}))
    with pytest.raises(ConfigError) as e:
        load_experiment(g)
    assert e.value.problems[0].field == "lifecycle.max_lifetime"


# ---- hostile and broken input through the real CLI (issue 14, item 5) -------------------------

QUICKSTART = (ROOT / "configs" / "examples" / "quickstart.yaml").read_text()
SANDBOX = "clouds:\n  sandbox: {latency_seconds: 0, retry_base_seconds: 0.001}\n"
LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


def _exp(old: str, new: str) -> str:
    assert old in QUICKSTART
    return QUICKSTART.replace(old, new)


def _future_schema(home: Path) -> None:
    import sqlite3

    home.mkdir(parents=True)
    db = sqlite3.connect(home / "state.db")
    db.execute("PRAGMA journal_mode=WAL")  # as every provisioner leaves it
    db.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
    db.execute("INSERT INTO alembic_version VALUES ('9999_from_the_future')")
    db.commit()
    db.close()


def _corrupt(home: Path) -> None:
    home.mkdir(parents=True)
    (home / "state.db").write_bytes(b"this is not SQLite\n" * 200)


def _policy_file(home: Path, text: str) -> str:
    home.mkdir(parents=True, exist_ok=True)
    (home.parent / "policy.yaml").write_text(text)
    return f"policies: [{home.parent / 'policy.yaml'}]\n"


# (id, settings text (None: the sandbox only), experiment text, extra CLI args, environment,
#  what the one line must say)
HOSTILE = [
    ("billion-laughs", None, LAUGHS, [], {}, "aliases (*a) are not allowed"),
    ("alias-in-valid-file", None, QUICKSTART + "labels: &l {a: b}\nx: *l\n", [], {}, "alias"),
    ("merge-key", None, QUICKSTART + "base: &b {a: 1}\nother: {<<: *b}\n", [], {}, "alias"),
    (
        "over-1-MiB",
        None,
        QUICKSTART + "labels:\n" + "".join(f"  k{i}: v\n" for i in range(120_000)),
        [],
        {},
        "larger than 1 MiB",
    ),
    ("5000-deep-list", None, "a: " + "[" * 5000 + "]" * 5000 + "\n", [], {}, "nest"),
    ("5000-deep-map", None, "a: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n", [], {}, "nested"),
    ("rate-zero", SANDBOX + "rates: {RUB: 0}\n", QUICKSTART, [], {}, "rates.RUB"),
    ("rate-negative", SANDBOX + "rates: {RUB: -80}\n", QUICKSTART, [], {}, "rates.RUB"),
    ("rate-huge", SANDBOX + "rates: {RUB: 1e999999}\n", QUICKSTART, [], {}, "rates.RUB"),
    (
        "price-in-unknown-currency",
        None,
        _exp("disk_gb: 50", "disk_gb: 50\n  max_price_per_hour: 1 XYZ"),
        [],
        {},
        "resources.max_price_per_hour: no exchange rate for XYZ",
    ),
    (
        "price-1e999999",
        None,
        _exp("disk_gb: 50", "disk_gb: 50\n  max_price_per_hour: 1e999999 USD"),
        [],
        {},
        "too large",
    ),
    ("state-url-scheme", SANDBOX + "state_url: nonsense://x\n", QUICKSTART, [], {}, "state_url"),
    (
        "state-url-unreachable",
        SANDBOX + "state_url: postgresql://nobody@127.0.0.1:1/x\n",
        QUICKSTART,
        [],
        {},
        "check state_url",
    ),
    ("home-in-proc", SANDBOX + "home: /proc/nope\n", QUICKSTART, [], {}, "home: cannot create"),
    ("clouds-env-not-json", None, QUICKSTART, [], {"PROVISIONER_CLOUDS": "{bad"}, "CLOUDS"),
    (
        "cloud-option-wrong-type",
        "clouds:\n  sandbox: {latency_seconds: soon}\n",
        QUICKSTART,
        [],
        {},
        "clouds.sandbox.latency_seconds",
    ),
    ("cloud-options-not-a-mapping", "clouds:\n  sandbox: 5\n", QUICKSTART, [], {}, "mapping"),
    (
        "cloud-capacity-negative",
        "clouds:\n  sandbox: {capacity: {sandbox-us-1a: -1}}\n",
        QUICKSTART,
        [],
        {},
        "clouds.sandbox.capacity",
    ),
    (
        "cloud-regions-a-string",
        SANDBOX + "  aws: {regions: us-east-1}\n",
        QUICKSTART,
        [],
        {},
        "should be a list, e.g. [us-east-1]",
    ),
    (
        "listen-without-port",
        SANDBOX + "scheduler: {listen: localhost}\n",
        None,
        ["scheduler", "run"],
        {},
        "scheduler.listen",
    ),
    (
        "listen-port-99999",
        SANDBOX + "scheduler: {listen: '127.0.0.1:99999'}\n",
        None,
        ["scheduler", "run"],
        {},
        "scheduler.listen",
    ),
    (
        "sweep-interval-huge",
        SANDBOX + "scheduler: {sweep_interval_seconds: 99999999999999999999}\n",
        None,
        ["status"],
        {},
        "scheduler.sweep_interval_seconds",
    ),
    ("period-9999-12", None, None, ["report", "--period", "9999-12"], {}, "9999-12"),
    ("state-db-corrupt", None, QUICKSTART, [], {}, "move it aside"),
    ("state-db-a-directory", None, QUICKSTART, [], {}, "is a directory"),
    ("state-db-newer-schema", None, QUICKSTART, [], {}, "upgrade provisioner"),
    (
        "regions-a-string",
        None,
        _exp("disk_gb: 50", "disk_gb: 50\n  regions: us-east-1"),
        [],
        {},
        "resources.regions: should be a list",
    ),
    (
        "max-lifetime-zero",
        None,
        _exp("max_lifetime: 12h", "max_lifetime: 0"),
        [],
        {},
        "lifecycle.max_lifetime: must be longer than zero",
    ),
    (
        "idle-minutes-huge",
        None,
        _exp("for_minutes: 30", "for_minutes: 99999999999999999999"),
        [],
        {},
        "lifecycle.idle.for_minutes",
    ),
    (
        "policy-idle-minutes-huge",
        "POLICY:name: p\nidle: {for_minutes: 99999999999999999999}\n",
        QUICKSTART,
        [],
        {},
        "idle.for_minutes",
    ),
    (
        "policy-aliases",
        "POLICY:name: p\nallow: &a {clouds: [sandbox]}\nx: *a\n",
        QUICKSTART,
        [],
        {},
        "aliases",
    ),
    (
        "policy-regions-a-string",
        "POLICY:name: p\nallow: {regions: us-east-1}\n",
        QUICKSTART,
        [],
        {},
        "allow.regions: should be a list",
    ),
    (
        "regions-env-not-json",
        None,
        QUICKSTART,
        [],
        {"PROVISIONER_CLOUDS__AWS__REGIONS": "us-east-1"},
        "PROVISIONER_CLOUDS__AWS__REGIONS: not valid JSON",
    ),
    (
        "env-json-50000-deep",
        None,
        QUICKSTART,
        [],
        {"PROVISIONER_CLOUDS": "[" * 50_000},
        "environment: PROVISIONER_CLOUDS: not valid JSON",
    ),
    (
        "env-state-url",
        None,
        QUICKSTART,
        [],
        {"PROVISIONER_STATE_URL": "mysql://x"},
        "environment: PROVISIONER_STATE_URL: write sqlite",
    ),
    ("label-900-kB", None, QUICKSTART + "labels: {a: " + "x" * 900_000 + "}\n", [], {}, "labels.a"),
    ("settings-control-characters", "\x00\x01", QUICKSTART, [], {}, "invalid YAML"),
    ("policies-a-string", SANDBOX + "policies: /etc/p.yaml\n", QUICKSTART, [], {}, "policies"),
    (
        "cloud-endpoint-not-a-url",  # was a traceback after the intent was written
        SANDBOX + "  aws: {endpoint: 'not a url'}\n",
        QUICKSTART,
        [],
        {},
        "clouds.aws.endpoint: write an http:// or https:// URL",
    ),
    (
        "ca-file-missing",
        SANDBOX + "  yandex: {root_certificates_file: /nonexistent.pem}\n",
        QUICKSTART,
        [],
        {},
        "no such file",
    ),
    ("settings-aliases", SANDBOX + "x: &x 1\ncurrency: *x\n", QUICKSTART, [], {}, "aliases"),
    (
        "currency-without-rates",
        SANDBOX + "currency: EUR\n",
        QUICKSTART,
        [],
        {},
        "rates: no rate for USD",
    ),
    # ---- issue 26, point 7: names and text fields at the spec boundary
    (
        "name-trailing-newline",  # was a second machine beside `quickstart`
        None,
        _exp("name: quickstart", 'name: "quickstart\\n"'),
        [],
        {},
        "name: use 2–40 lowercase letters",
    ),
    ("name-trailing-space", None, _exp("name: quickstart", 'name: "quickstart "'), [], {}, "name"),
    (
        "project-ansi-escape",  # reached teammates' terminals through `report`
        None,
        _exp("project: demo", 'project: "demo\\e[2J\\e[31m"'),
        [],
        {},
        "project: control characters",
    ),
    (
        "owner-nul",  # crashed `up` on PostgreSQL
        None,
        _exp("project: demo\n", 'project: demo\nowner: "you\\0@example.com"\n'),
        [],
        {},
        "owner: control characters",
    ),
    (
        "label-ansi-escape",
        None,
        QUICKSTART + 'labels: {team: "\\e]0;owned\\a"}\n',
        [],
        {},
        "labels.team: control characters",
    ),
    (
        "env-nul",
        None,
        _exp('STEPS: "3"', 'STEPS: "3\\0"'),
        [],
        {},
        "env.STEPS: control characters",
    ),
    (
        "run-nul",
        None,
        QUICKSTART.split("run: |")[0] + 'run: "echo done\\0"\n',
        [],
        {},
        "run",
    ),
    # ---- extreme clock values: 1970-01-01 .. 9000-12-31 (provisioner.clock.EARLIEST/LATEST)
    (
        "clock-9999",
        None,
        QUICKSTART,
        [],
        {"PROVISIONER_CLOCK": "9999-12-31T23:59:59+00:00"},
        "PROVISIONER_CLOCK",
    ),
    (
        "clock-year-1",
        None,
        QUICKSTART,
        [],
        {"PROVISIONER_CLOCK": "0001-01-01T00:00:00+00:00"},
        "PROVISIONER_CLOCK",
    ),
    (
        "period-to-9999",
        None,
        None,
        ["report", "--period", "2026-01-01..9999-12-31"],
        {},
        "9999-12-31",
    ),
    # ---- non-regular files: refused, never read (a FIFO hung)
    ("experiment-fifo", None, None, ["up", "FIFO"], {}, "not a regular file"),
    ("experiment-device", None, None, ["up", "/dev/zero"], {}, "not a regular file"),
    ("settings-fifo", "FIFO", QUICKSTART, [], {}, "not a regular file"),
    ("policy-fifo", SANDBOX + "policies: [FIFO]\n", QUICKSTART, [], {}, "not a regular file"),
    # ---- exit codes
    ("catalog-unknown-gpu", None, None, ["catalog", "--gpu", "A10O"], {}, "did you mean 'A100'"),
]
PREPARE = {
    "state-db-corrupt": _corrupt,
    "state-db-a-directory": lambda home: (home / "state.db").mkdir(parents=True),
    "state-db-newer-schema": _future_schema,
}


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize(
    ("settings_text", "experiment", "args", "env", "says"),
    [pytest.param(*case[1:], id=case[0]) for case in HOSTILE],
)
def test_hostile_input_is_one_line_exit_2_and_writes_nothing(
    tmp_path, monkeypatch, request, cli, settings_text, experiment, args, env, says
):
    """Through the console entry point in this process (the fresh interpreter of a real run
    costs ~1 s of CPU a case; ``test_check_fails_…`` and the end-to-end files run it): a
    warning the run would print counts as a line of its stderr, an exception as a traceback."""
    home = tmp_path / "home"
    monkeypatch.delenv("PROVISIONER_HOME", raising=False)  # settings name the home
    monkeypatch.delenv("PROVISIONER_CONFIG", raising=False)
    monkeypatch.delenv("PROVISIONER_STATE_URL", raising=False)
    text = settings_text or SANDBOX
    if text.startswith("POLICY:"):
        text = SANDBOX + _policy_file(home, text.removeprefix("POLICY:"))
    if "home:" not in text:
        text += f"home: {home}\n"
    fifo = tmp_path / "fifo.yaml"  # "FIFO": a named pipe nobody writes to (reading it hangs)
    os.mkfifo(fifo)
    text = text.replace("FIFO", str(fifo))
    args = [str(fifo) if a == "FIFO" else a for a in args]
    cfg = tmp_path / "settings.yaml"
    if settings_text == "FIFO":
        cfg, env = fifo, {**env, "PROVISIONER_HOME": str(home)}
    else:
        cfg.write_text(text)
    spec = tmp_path / "exp.yaml"
    if experiment is not None:
        spec.write_text(experiment)
    PREPARE.get(request.node.callspec.id, lambda home: None)(home)
    before = _snapshot(tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")  # what a fresh interpreter prints
        r = cli("--config", str(cfg), *(args or ["up", str(spec)]))
    gc.collect()  # what the run opened is closed, as its exit would (SQLite's -wal, -shm)
    hidden = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
    printed = [str(w.message) for w in shown if not issubclass(w.category, hidden)]
    lines = [ln for ln in r.err.splitlines() if ln.strip()] + printed
    assert r.code == 2, r.err[-2000:]
    assert "Traceback" not in r.err + r.out
    assert len(lines) == 1, lines
    assert says in lines[0], lines[0]
    assert _snapshot(tmp_path) == before  # no state row, no database, no file


# ---- messages in the user's words (issue 12, item 10) -----------------------------------------


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (
            {"budget": {"amount": "5 USD", "period": "monht"}},
            "budget.period: 'monht' is not one of month, week; did you mean 'month'?",
        ),
        (
            {"budget": {"amount": "5 USD", "period": {"start": "2026-02-01", "end": "2026-01-01"}}},
            "budget.period: end is before start",
        ),
        ({"budgte": {"amount": "5 USD"}}, "budgte: unknown field; did you mean 'budget'?"),
        (
            {"idle": {"action": "terminat"}},
            "idle.action: 'terminat' is not one of stop, terminate; did you mean 'terminate'?",
        ),
        ({"max_lifetime": {"after": "1h", "acton": "stop"}}, "did you mean 'action'?"),
        ({"allow": {"markets": ["spto"]}}, "allow.markets.0: 'spto' is not one of spot, reserved"),
    ],
)
def test_policy_messages_name_no_pydantic_internals_and_suggest(tmp_path, policy, expected):
    from policies.loader import PolicyError, load

    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"name": "p", **policy}))
    with pytest.raises(PolicyError) as e:
        load([f])
    [problem] = e.value.problems
    assert expected in str(problem)
    for internal in ("function-after", "literal[", "CustomPeriod", "Input should be a valid dict"):
        assert internal not in str(problem)


def test_misspelt_experiment_and_settings_keys_get_a_suggestion(tmp_path, monkeypatch):
    monkeypatch.setenv("PROVISIONER_HOME", str(tmp_path))
    e = tmp_path / "e.yaml"
    e.write_text(
        yaml.safe_dump(
            {
                **VALID,
                "lifecycel": {},
                "resources": {"gpu": "A100:8", "markt": "spot", "clouds": ["awz"]},
            }
        )
    )
    with pytest.raises(ConfigError) as err:
        load_experiment(e)
    text = str(err.value)
    assert "lifecycel: unknown field; did you mean 'lifecycle'?" in text
    assert "resources.markt: unknown field; did you mean 'market'?" in text
    assert "unknown cloud 'awz'; did you mean 'aws'?" in text
    s = tmp_path / "s.yaml"
    s.write_text("clouds:\n  aws: {regoins: [us-east-1]}\nsmtp: {security: tsl}\ncurrncy: EUR\n")
    with pytest.raises(ConfigError) as err:
        load_settings(s)
    text = str(err.value)
    assert "clouds.aws.regoins: unknown field; did you mean 'regions'?" in text
    assert "smtp.security: 'tsl' is not one of starttls, ssl, none" in text
    assert "currncy: unknown field; did you mean 'currency'?" in text


# ---- settings that silently did the wrong thing (issue 12, item 8) ----------------------------


def test_a_currency_without_its_rates_is_an_error_not_the_rub_per_usd_rate(tmp_path, monkeypatch):
    monkeypatch.setenv("PROVISIONER_HOME", str(tmp_path))
    s = tmp_path / "s.yaml"
    s.write_text("currency: EUR\nclouds:\n  yandex: {}\n")
    with pytest.raises(ConfigError) as err:
        load_settings(s)
    assert "rates: no rate for RUB (the currency of yandex): set rates.RUB" in str(err.value)
    s.write_text("currency: EUR\nclouds:\n  yandex: {}\nrates: {RUB: 98}\n")
    assert load_settings(s).money_rates.per_base == {"EUR": 1, "RUB": 98}
    s.write_text("clouds:\n  yandex: {}\n")  # USD: the built-in RUB-per-USD rate holds
    assert load_settings(s).money_rates.per_base["RUB"] == 80


def test_check_fails_when_no_cloud_can_be_used_and_says_why_once(home):
    from tests.conftest import run_cli, write_settings

    cfg = write_settings(home, sandbox={"auth_fail": True})
    r = run_cli("--config", str(cfg), "check")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.split()[:2] == ["no", "sandbox"]
    assert r.stdout.count("sandbox:") == 0 and "credentials refused" in r.stdout
    assert "no cloud can be used" in r.stderr and "Traceback" not in r.stderr
    ok = run_cli("--config", str(write_settings(home)), "check")
    assert ok.returncode == 0 and ok.stdout.startswith("ok")


def test_an_experiment_without_clouds_hears_which_are_enabled(home):
    from tests.conftest import run_cli, write_settings

    cfg = write_settings(home)
    spec = home.parent / "e.yaml"
    spec.write_text(QUICKSTART.replace("  clouds: [sandbox]\n", ""))
    r = run_cli("--config", str(cfg), "up", str(spec))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "real clouds enabled in settings, and only sandbox is" in r.stderr
    assert "list clouds: [CLOUD] in the experiment" in r.stderr


# ---- the state database failing under a command (issue 26, point 7) ---------------------------


def test_a_locked_sqlite_state_on_up_is_one_line_and_writes_nothing(home, tmp_path, clock):
    import sqlite3

    from provisioner.app import App
    from tests.conftest import make_settings, run_cli, write_settings

    App(make_settings(home), clock).db.migrate()  # a state at the current schema
    cfg = write_settings(home, database={"busy_timeout_seconds": 2})  # not the default 30 s
    spec = tmp_path / "exp.yaml"
    spec.write_text(QUICKSTART)
    holder = sqlite3.connect(home / "state.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process writing, and writing, and writing
    try:
        r = run_cli("--config", str(cfg), "up", str(spec), "--detach", timeout=120)
    finally:
        holder.execute("ROLLBACK")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout, r.stderr[-2000:]
    assert len(lines) == 1 and "the state database is locked" in lines[0], lines
    assert holder.execute("SELECT count(*) FROM machines").fetchone() == (0,)
    holder.close()


class CutProxy:
    """A TCP proxy to PostgreSQL that, once a client sends ``cut_on`` (a table's name in a
    query), closes every connection and stops listening: the server gone mid-command."""

    def __init__(self, target: tuple[str, int], cut_on: bytes) -> None:
        import socket
        import threading

        self.target, self.cut_on, self.cut = target, cut_on, threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.socks: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while not self.cut.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self.socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src, dst, from_client: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_client and self.cut_on in data:
                    self.close()
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        import socket

        self.cut.set()
        with contextlib.suppress(OSError):
            self.listener.close()
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
                s.close()


@pytest.mark.slow  # a sandbox launch and a sweep on PostgreSQL, through a proxy
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_the_database_lost_mid_sweep_is_one_line_not_a_traceback(home, clock, db_url):
    from urllib.parse import urlsplit

    from provisioner import machines
    from provisioner.app import App
    from provisioner.spec import Experiment
    from tests.conftest import make_settings, run_cli, sandbox_experiment, write_settings

    a = App(make_settings(home, state_url=db_url), clock)
    machines.up(a, Experiment.model_validate(sandbox_experiment("busy")))
    a.close()
    where = urlsplit(db_url)
    proxy = CutProxy((where.hostname, where.port or 5432), b"scheduler_leases")
    try:
        via = db_url.replace(where.netloc, f"{where.username}@127.0.0.1:{proxy.port}", 1)
        cfg = write_settings(home, state_url=via)
        r = run_cli("--config", str(cfg), "sweep", timeout=120)
    finally:
        proxy.close()
    assert proxy.cut.is_set()  # the server went away during the sweep, not before it
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    assert len(lines) == 1 and "the state database failed" in lines[0], lines


@pytest.mark.slow  # four CLI runs
def test_escapes_stored_before_the_spec_checked_them_never_reach_the_terminal(home, clock):
    """A project and owner with ANSI escapes, as an older provisioner stored them: `report`
    shows them with ``?``, never the escape itself."""
    from datetime import timedelta

    from provisioner import machines
    from provisioner.app import App
    from provisioner.spec import Experiment
    from tests.conftest import make_settings, run_cli, sandbox_experiment, write_settings

    a = App(make_settings(home), clock)
    e = Experiment.model_validate(sandbox_experiment("old"))
    a.actor = "[bold]o\x1b]0;t\a"  # stored before the checks: its owner launched it
    machines.up(
        a, e.model_copy(update={"project": "x\x1b[2J\x1b[31m", "owner": "[bold]o\x1b]0;t\a"})
    )
    clock.advance(timedelta(hours=3))
    a.close()
    cfg = write_settings(home)
    for by in ("project", "owner", "machine"):
        r = run_cli("--config", str(cfg), "report", "--by", by, now=clock.now())
        assert r.returncode == 0, r.stderr
        assert "\x1b" not in r.stdout and "\a" not in r.stdout, r.stdout
    r = run_cli("--config", str(cfg), "report", "--project", "x\x1b[2J\x1b[31m", now=clock.now())
    assert "\x1b" not in r.stdout and "x?[2J?[31m" in r.stdout, r.stdout


def test_surrounding_whitespace_is_dropped_from_names_and_control_characters_refused(tmp_path):
    """``owner: " ana@example.com "`` or a block scalar's final newline is the same owner (not
    a second one beside it); a control character inside is an error at its line."""
    doc = {
        **VALID,
        "project": "nlp\n",
        "owner": " ana@example.com ",
        "labels": {" team": "nlp\t"},
        "ssh_public_key": "ssh-ed25519 AAAAC3Nza ana@laptop\n",
    }
    f = tmp_path / "e.yaml"
    f.write_text(yaml.safe_dump(doc))
    e = load_experiment(f)
    assert (e.project, e.owner, e.labels) == ("nlp", "ana@example.com", {"team": "nlp"})
    assert e.ssh_public_key == "ssh-ed25519 AAAAC3Nza ana@laptop"
    for field, value in [
        ("project", "nlp\x1b[31m"),
        ("owner", "ana\x00@example.com"),
        ("project", "a\u0085b"),
        ("owner", "   "),
    ]:
        f.write_text(yaml.safe_dump({**VALID, field: value}))
        with pytest.raises(ConfigError) as err:
            load_experiment(f)
        assert err.value.problems[0].field == field, err.value
    f.write_text(yaml.safe_dump({**VALID, "name": "llama\n"}))
    with pytest.raises(ConfigError, match="name: use 2–40"):
        load_experiment(f)
